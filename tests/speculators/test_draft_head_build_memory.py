"""`load_draft_head` allocates each weight once, in the serving dtype: peak ~1x the head, not the float32 head.

The meter is the CPU allocator's own events (as in tests/models/test_model_build_memory.py). The old load (float32
head on the CPU, filled, checked, then `.to(dtype)`) is measured with the same meter as the negative control,
and the new head equals the old one: same tensors, dtypes, buffers (RoPE, the EAGLE-3 vocabulary maps, with and
without `t2d` in the checkpoint), and the same forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_draft_heads import hidden_width, random_head
from torch import nn
from torch.profiler import ProfilerActivity, profile

from framework.models.loader import read_hf_config
from speculators.draft_heads import HEAD_CLASSES, DraftHead, Eagle3Head, load_draft_head
from speculators.draft_heads import io as head_io

# Wider than test_draft_heads.TARGET, so that no single tensor is a large part of a head.
TARGET = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}
KINDS = [("eagle", {}), ("eagle3", {"draft_vocab_size": 200}), ("mtp", {"num_mtp_layers": 2})]
IDS = [k for k, _ in KINDS]


def _peak_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """(fn(), the most bytes of CPU tensors live at once while it ran, counted from the allocator's events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return result, peak


def _head_bytes(head: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in head.state_dict().values())


def _old_load(path: Path, kind: str, dtype: torch.dtype) -> DraftHead:
    """The load before this change: a float32 head on the CPU, filled and checked, then cast."""
    tensors = head_io._read_tensors(path)
    head = HEAD_CLASSES[kind].from_tensor_names(read_hf_config(path), set(tensors))  # type: ignore[attr-defined]
    head_io._copy_tensors(head, tensors)
    if isinstance(head, Eagle3Head):
        head_io._check_draft_vocab(head, tensors, path)
    frequencies = {n: b for n, b in head.named_buffers() if n.endswith("inv_freq")}
    head = head.to(dtype=dtype).eval()
    for name, buf in frequencies.items():  # RoPE frequencies stay float32, as in the build (`materialise.py`)
        owner, _, leaf = name.rpartition(".")
        head.get_submodule(owner)._buffers[leaf] = buf
    return head


def _bf16_checkpoint(kind: str, kwargs: dict, root: Path) -> Path:
    head = random_head(kind, seed=4, target=TARGET, **kwargs)
    head.to(torch.bfloat16).save_pretrained(root)
    return root


@pytest.mark.parametrize("kind,kwargs", KINDS, ids=IDS)
def test_load_peaks_near_the_bf16_head_and_the_old_load_does_not(kind: str, kwargs: dict, tmp_path: Path) -> None:
    path = _bf16_checkpoint(kind, kwargs, tmp_path)
    head, peak = _peak_bytes(lambda: load_draft_head(path, kind, TARGET, "cpu", torch.bfloat16))
    weights = _head_bytes(head)
    # safetensors maps the file into one CPU storage, counted once while it is open (see test_model_build_memory).
    shard = (path / "model.safetensors").stat().st_size
    assert peak - shard < 1.3 * weights, f"{kind}: the load peaked at {(peak - shard) / weights:.2f}x the head"
    _, old_peak = _peak_bytes(lambda: _old_load(path, kind, torch.bfloat16))  # negative control: same meter
    assert old_peak - shard >= 1.9 * weights, f"{kind}: the meter saw only {(old_peak - shard) / weights:.2f}x"


def _assert_same_head(got: DraftHead, want: DraftHead) -> None:
    assert list(got.state_dict()) == list(want.state_dict())
    for name, t in want.state_dict().items():
        g = got.state_dict()[name]
        assert g.dtype == t.dtype and g.device == t.device and torch.equal(g, t), name
    assert dict(got.named_buffers()).keys() == dict(want.named_buffers()).keys()
    for name, buf in want.named_buffers():  # inv_freq (not saved) too
        assert torch.equal(dict(got.named_buffers())[name], buf), name
    assert all(p.requires_grad == q.requires_grad for p, q in zip(got.parameters(), want.parameters()))
    assert not got.training


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind,kwargs", KINDS, ids=IDS)
def test_the_head_equals_the_old_load(kind: str, kwargs: dict, dtype: torch.dtype, tmp_path: Path) -> None:
    source = random_head(kind, seed=9, target=TARGET, **kwargs)
    source.save_pretrained(tmp_path)  # float32 checkpoint: the bf16 load rounds once, like the old cast
    got, want = load_draft_head(tmp_path, kind, TARGET, "cpu", dtype), _old_load(tmp_path, kind, dtype)
    _assert_same_head(got, want)
    embed = source._shared["embed_tokens"].to(dtype)
    for head in (got, want):
        head.share_target_weights(embed, embed)
    ids = torch.randint(0, TARGET["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(2, 7, hidden_width(source), generator=torch.Generator().manual_seed(2)).to(dtype)
    assert torch.equal(got(ids, hidden), want(ids, hidden))
    assert torch.equal(got.draft_token_ids(got(ids, hidden)), want.draft_token_ids(want(ids, hidden)))


@pytest.mark.parametrize("maps", ["d2t only", "neither"])
def test_eagle3_vocab_maps_are_built_on_the_meta_path(maps: str, tmp_path: Path) -> None:
    """Without `t2d` (or without both maps, for a full draft vocabulary) the loader derives them from the
    buffers `init_buffers` made: the same maps as the old load."""
    full = maps == "neither"
    source = random_head("eagle3", seed=3, target=TARGET, **({} if full else {"draft_vocab_size": 200}))
    source.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    drop = {"t2d"} | ({"d2t"} if full else set())
    save_file({n: t for n, t in tensors.items() if n not in drop}, str(tmp_path / "model.safetensors"))
    got, want = (
        load_draft_head(tmp_path, "eagle3", TARGET, "cpu", torch.bfloat16),
        _old_load(tmp_path, "eagle3", torch.bfloat16),
    )
    _assert_same_head(got, want)
    assert torch.equal(got.t2d, source.t2d) and torch.equal(got.d2t, source.d2t)
    assert int(got.t2d.sum()) == got.draft_vocab_size


def test_a_bad_config_allocates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks run on the meta head: a checkpoint that fails them never reaches the allocation."""
    path = _bf16_checkpoint("eagle", {}, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    save_file({**tensors, "stray.weight": torch.zeros(2)}, str(path / "model.safetensors"))
    monkeypatch.setattr(head_io, "build_materialised", lambda *a: pytest.fail("allocated before the checks"))
    with pytest.raises(head_io.CheckpointError, match="stray.weight"):
        load_draft_head(path, "eagle", TARGET, "cpu", torch.bfloat16)
