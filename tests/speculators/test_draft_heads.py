"""Draft head modules: save -> load round trips, strict loading, and the paged forward against the full one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from framework.layers.attention import AttentionMetadata
from framework.models.loader import CheckpointError
from speculators.draft_heads import HEAD_CLASSES, DraftHead, Eagle3Head, head_config, load_draft_head

TARGET = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


def random_head(kind: str, seed: int = 0, target: dict = TARGET, **kwargs) -> DraftHead:  # type: ignore[no-untyped-def]
    """A head of `kind` for `target` with random weights (norms around 1) and random borrowed target weights."""
    cfg = head_config(kind, target, **kwargs)
    names = {"eagle": {"fc.bias"}, "eagle3": set(), "mtp": set()}[kind]
    head = HEAD_CLASSES[kind].from_tensor_names(cfg, names)  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
    embed = torch.randn(target["vocab_size"], target["hidden_size"], generator=gen)
    head.share_target_weights(embed, embed)
    if isinstance(head, Eagle3Head) and head.draft_vocab_size < head.vocab_size:
        keep = torch.randperm(head.vocab_size, generator=gen)[: head.draft_vocab_size].sort().values
        head.set_draft_vocab(keep - torch.arange(head.draft_vocab_size))
    return head.eval()


KINDS = [("eagle", {}), ("eagle3", {"draft_vocab_size": 40}), ("mtp", {"num_mtp_layers": 2})]


def hidden_width(head: DraftHead) -> int:
    return 3 * head.hidden_size if isinstance(head, Eagle3Head) else head.hidden_size


@pytest.mark.parametrize("kind,kwargs", KINDS, ids=[k for k, _ in KINDS])
def test_save_load_round_trip(kind: str, kwargs: dict, tmp_path: Path) -> None:
    head = random_head(kind, **kwargs)
    head.save_pretrained(tmp_path)
    loaded = load_draft_head(tmp_path, kind, TARGET)
    assert loaded.state_dict().keys() == head.state_dict().keys()
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    loaded.share_target_weights(head._shared["embed_tokens"], head._shared["lm_head"])
    ids = torch.randint(0, 96, (2, 9))
    hidden = torch.randn(2, 9, hidden_width(head))
    for step in (0, 1):
        assert torch.equal(loaded(ids, hidden, step=step), head(ids, hidden, step=step))
        assert torch.equal(
            loaded.draft_token_ids(head(ids, hidden), step), head.draft_token_ids(head(ids, hidden), step)
        )


def test_eagle3_draft_vocab_maps_into_target_vocab() -> None:
    head = random_head("eagle3", draft_vocab_size=40)
    h = torch.randn(5, 32)
    logits = head.compute_logits(h)
    assert logits.shape == (5, 96) and int(torch.isfinite(logits).sum(-1)[0]) == 40
    assert torch.equal(head.draft_token_ids(h), logits.argmax(-1))
    assert bool(head.t2d[head.draft_token_ids(h)].all())


def test_full_forward_is_causal() -> None:
    for kind, kwargs in KINDS:
        head = random_head(kind, **kwargs)
        ids = torch.randint(0, 96, (1, 8))
        hidden = torch.randn(1, 8, hidden_width(head))
        full = head(ids, hidden)
        prefix = head(ids[:, :5], hidden[:, :5])
        torch.testing.assert_close(full[:, :5], prefix, rtol=1e-5, atol=1e-5)


def paged_metadata(
    seq_starts: list[int], query_lens: list[int], block_size: int, blocks_per_seq: int
) -> AttentionMetadata:
    """Metadata for rows whose queries are positions start..start+len-1; row r owns blocks r*blocks_per_seq.."""
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    table = torch.arange(len(query_lens) * blocks_per_seq, dtype=torch.int32).view(len(query_lens), blocks_per_seq)
    slots = []
    for r, (start, n) in enumerate(zip(seq_starts, query_lens)):
        for p in range(start, start + n):
            slots.append(int(table[r, p // block_size]) * block_size + p % block_size)
    seq_lens = torch.tensor([s + n for s, n in zip(seq_starts, query_lens)], dtype=torch.int32)
    return AttentionMetadata(
        sum(query_lens),
        len(query_lens),
        qsl,
        seq_lens,
        table,
        torch.tensor(slots),
        block_size,
        max(query_lens),
        int(seq_lens.max()),
    )


@pytest.mark.parametrize("kind,kwargs", KINDS, ids=[k for k, _ in KINDS])
def test_paged_forward_equals_full_forward(kind: str, kwargs: dict) -> None:
    """Two sequences fed in chunks through the paged cache give the full forward's outputs."""
    head = random_head(kind, **kwargs)
    lengths, chunks, bs = [11, 6], [[4, 5, 2], [1, 3, 2]], 4
    ids = [torch.randint(0, 96, (n,)) for n in lengths]
    hidden = [torch.randn(n, hidden_width(head)) for n in lengths]
    for step in (0, 1):
        kv = torch.zeros(head.kv_cache_shape(8, bs))
        outs: list[list[torch.Tensor]] = [[], []]
        done = [0, 0]
        for c in range(3):
            n = [chunks[0][c], chunks[1][c]]
            meta = paged_metadata(done, n, bs, 4)
            flat_ids = torch.cat([ids[r][done[r] : done[r] + n[r]] for r in range(2)])
            flat_h = torch.cat([hidden[r][done[r] : done[r] + n[r]] for r in range(2)])
            pos = torch.cat([torch.arange(done[r], done[r] + n[r]) for r in range(2)])
            out = head.forward_paged(flat_ids, flat_h, pos, kv, meta, step=step)
            outs[0].append(out[: n[0]])
            outs[1].append(out[n[0] :])
            done = [done[r] + n[r] for r in range(2)]
        for r in range(2):
            ref = head(ids[r][None], hidden[r][None], step=step)[0]
            torch.testing.assert_close(torch.cat(outs[r]), ref, rtol=1e-4, atol=1e-5)


# ---- strict loading ---------------------------------------------------------------------------------------


def _saved(kind: str, tmp_path: Path, **kwargs) -> Path:  # type: ignore[no-untyped-def]
    random_head(kind, **kwargs).save_pretrained(tmp_path)
    return tmp_path


def test_loader_names_unmatched_and_missing_tensors(tmp_path: Path) -> None:
    path = _saved("eagle", tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({**tensors, "layers.1.mlp.up_proj.weight": torch.zeros(48, 32)}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.1.mlp.up_proj.weight"):
        load_draft_head(path, "eagle", TARGET)
    del tensors["layers.0.mlp.down_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lacks tensors: layers.0.mlp.down_proj.weight"):
        load_draft_head(path, "eagle", TARGET)


def test_loader_rejects_wrong_geometry_and_kind(tmp_path: Path) -> None:
    path = _saved("eagle3", tmp_path / "e3", draft_vocab_size=40)
    with pytest.raises(CheckpointError, match="use speculator.method=eagle3"):
        load_draft_head(path, "eagle", TARGET)
    with pytest.raises(CheckpointError, match="hidden_size=32 does not match the target model's hidden_size=64"):
        load_draft_head(path, "eagle3", {**TARGET, "hidden_size": 64})
    with pytest.raises(CheckpointError, match="vocab_size"):
        load_draft_head(path, "eagle3", {**TARGET, "vocab_size": 97})
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "d2t"}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no 'd2t'"):
        load_draft_head(path, "eagle3", TARGET)
    save_file({**tensors, "d2t": tensors["d2t"] + 90}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="outside the target vocabulary"):
        load_draft_head(path, "eagle3", TARGET)
    save_file({**tensors, "fc.weight": torch.zeros(32, 64)}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'fc.weight' has shape \(32, 64\), the head expects \(32, 96\)"):
        load_draft_head(path, "eagle3", TARGET)
    mtp = _saved("mtp", tmp_path / "mtp")
    with pytest.raises(CheckpointError, match="num_hidden_layers=4 does not match the target's 6"):
        load_draft_head(mtp, "mtp", {**TARGET, "num_hidden_layers": 6})
    cfg = json.loads((mtp / "config.json").read_text())
    (mtp / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers"):
        load_draft_head(mtp, "mtp", TARGET)


def test_loader_refuses_pickle_and_missing_dirs(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_draft_head(tmp_path / "nope", "eagle", TARGET)
    (tmp_path / "config.json").write_text(json.dumps(head_config("eagle", TARGET)))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="never unpickles"):
        load_draft_head(tmp_path, "eagle", TARGET)


def test_mtp_loads_from_the_target_checkpoint(tmp_path: Path) -> None:
    """MTP layers stored inside the target's own checkpoint: the target's tensors are skipped, others are not."""
    head = random_head("mtp")
    target_tensors = {
        "model.embed_tokens.weight": torch.zeros(96, 32),
        "model.norm.weight": torch.ones(32),
        "model.layers.3.mlp.up_proj.weight": torch.zeros(48, 32),
    }
    save_file({**head.state_dict(), **target_tensors}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(head.config))
    loaded = load_draft_head(tmp_path, "mtp", TARGET)
    assert loaded.state_dict().keys() == head.state_dict().keys()
    save_file({**head.state_dict(), "model.layers.4.bogus.weight": torch.zeros(3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.4.bogus.weight"):
        load_draft_head(tmp_path, "mtp", TARGET)


def test_eagle3_aux_layers_must_exist_in_the_target() -> None:
    head = random_head("eagle3", aux_layer_ids=[0, 2, 7])
    with pytest.raises(ValueError, match=r"3 aux layer ids in \[0, 4\) of the target, got \(0, 2, 7\)"):
        head.aux_layer_ids(4)
    cfg = {k: v for k, v in head_config("eagle3", TARGET).items() if k != "eagle_aux_hidden_state_layer_ids"}
    assert Eagle3Head(cfg).aux_layer_ids(12) == (2, 6, 9)  # the default (2, L // 2, L - 3)
    assert Eagle3Head({**cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}}).aux_layer_ids(12) == (
        1,
        3,
        5,
    )
