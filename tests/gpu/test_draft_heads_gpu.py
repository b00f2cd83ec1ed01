"""EAGLE / EAGLE-3 / MTP on the GPU (skipped without CUDA): kernels at real shapes, no host sync while
drafting, greedy equality with and without speculation, CUDA graphs against eager.

Run on the GPU machine: `python -m pytest -q tests/gpu/test_draft_heads_gpu.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

KINDS = {"eagle": {}, "eagle3": {"draft_vocab_size": 200, "aux_layer_ids": [0, 1, 1]}, "mtp": {}}


def test_prepare_draft_inputs_at_real_shapes_with_pinned_history():
    from speculators.draft_inputs import prepare_draft_inputs_reference, prepare_draft_inputs_triton

    gen = torch.Generator().manual_seed(0)
    rows, slots, max_len, k = 256, 512, 4096, 4
    query_lens = torch.randint(1, 2 * k, (rows,), generator=gen).int()
    qsl = torch.zeros(rows + 1, dtype=torch.int32)
    qsl[1:] = query_lens.cumsum(0)
    idx_mapping = torch.randperm(slots, generator=gen)[:rows].int()
    seq_lens = torch.randint(8, max_len + 1, (rows,), generator=gen).int()
    num_sampled = torch.randint(0, k + 2, (rows,), generator=gen).int().clamp(max=query_lens)
    num_rejected = torch.where(num_sampled > 0, query_lens - num_sampled, 0).int()
    sampled = torch.randint(0, 150000, (rows, k + 1), generator=gen)
    history = torch.randint(0, 150000, (slots, max_len), generator=gen).int()
    input_ids = torch.randint(0, 150000, (int(qsl[-1]),), generator=gen)
    args = [input_ids, qsl, idx_mapping, seq_lens, sampled, num_sampled, num_rejected, history]
    ref = prepare_draft_inputs_reference(*args)
    cuda_args = [a.cuda() for a in args[:-1]] + [history.pin_memory()]
    got = prepare_draft_inputs_triton(*cuda_args)
    assert torch.equal(got.input_ids.cpu(), ref.input_ids)
    assert torch.equal(got.last_token_index.cpu(), ref.last_token_index)


def _target_and_heads(tmp_path: Path) -> tuple[Path, dict[str, Path]]:
    from helpers.hf_models import SPEC_BY_NAME, save_tiny_checkpoint
    from test_draft_heads import random_head

    from framework.models.loader import read_hf_config

    target = tmp_path / "target"
    save_tiny_checkpoint(SPEC_BY_NAME["qwen3"], target)
    cfg = read_hf_config(target)
    heads = {}
    for kind, kwargs in KINDS.items():
        heads[kind] = tmp_path / kind
        random_head(kind, seed=7, target=cfg, **kwargs).save_pretrained(heads[kind])
    return target, heads


def _generate(
    target: Path, head: Path | None, kind: str, prompts: list[list[int]], drafts: list | None = None, **overrides
) -> list[list[int]]:
    """Greedy outputs; `drafts` collects (request id, history length, drafts) of every row that sampled."""
    from framework import LLM, SamplingParams
    from framework.config.schema import load_config

    data = {
        "model": {"path": str(target), "preset": None, "dtype": "float32", "max_model_len": 256},
        "device": "cuda",
        "scheduler": {"max_num_batched_tokens": 64},
        "cache": {"gpu_memory_utilization": 0.25},
    }
    if head is not None:
        data["speculator"] = {"method": kind, "num_speculative_tokens": 3, "model": str(head)}
    for key, value in overrides.items():
        section, leaf = key.split(".")
        data.setdefault(section, {})[leaf] = value
    llm = LLM(config=load_config(data))
    if drafts is not None:
        spec = llm.engine.runner.speculator
        propose = spec.propose

        def recording(inputs):  # type: ignore[no-untyped-def]
            proposal = propose(inputs)
            sampled = inputs.num_sampled.cpu().tolist()
            lengths = inputs.request_state.total_len[inputs.batch.idx_mapping.long()].cpu().tolist()
            for row, request_id in enumerate(inputs.batch.request_ids):
                if sampled[row]:
                    drafts.append((request_id, lengths[row], proposal.draft_token_ids[row].cpu().tolist()))
            return proposal

        spec.propose = recording
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    del llm
    _free()
    return [o.token_ids for o in outs]


def _free() -> None:
    import gc

    gc.collect()  # engines with a wrapped propose form reference cycles
    torch.cuda.empty_cache()


@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_output_equals_no_speculation_graphs_and_eager(tmp_path, kind):
    from helpers.hf_models import random_prompts

    target, heads = _target_and_heads(tmp_path)
    prompts = random_prompts(12, 5, 90, seed=3)
    plain = _generate(target, None, kind, prompts)
    with_graphs: list = []
    assert _generate(target, heads[kind], kind, prompts, with_graphs) == plain
    draft_steps_eager: list = []
    assert (
        _generate(target, heads[kind], kind, prompts, draft_steps_eager, **{"speculator.draft_cuda_graphs": False})
        == plain
    )
    assert _generate(target, heads[kind], kind, prompts, **{"runner.cuda_graphs": False}) == plain
    assert len(with_graphs) > 50 and with_graphs == draft_steps_eager  # draft-step graphs draft what eager does


@pytest.mark.parametrize("kind", list(KINDS))
def test_drafting_never_syncs(tmp_path, kind):
    """Every propose call of a real run executes under torch.cuda.set_sync_debug_mode('error')."""
    from helpers.hf_models import random_prompts

    from framework import LLM, SamplingParams
    from framework.config.schema import load_config

    target, heads = _target_and_heads(tmp_path)
    data = {
        "model": {"path": str(target), "preset": None, "max_model_len": 256},
        "device": "cuda",
        "cache": {"gpu_memory_utilization": 0.25},
        "speculator": {"method": kind, "num_speculative_tokens": 3, "model": str(heads[kind])},
    }
    llm = LLM(config=load_config(data))
    spec = llm.engine.runner.speculator
    calls = []
    propose = spec.propose

    def strict_propose(inputs):  # type: ignore[no-untyped-def]
        torch.cuda.set_sync_debug_mode("error")
        try:
            return propose(inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            calls.append(inputs.num_draft_tokens)

    spec.propose = strict_propose
    llm.generate(random_prompts(8, 5, 60, seed=4), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert calls and max(calls) == 3
    del llm, spec
    _free()


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_head_is_built_on_the_device_in_its_dtype_and_equals_the_old_load(tmp_path, kind):
    """The meta build allocates every tensor on the GPU in bf16 (the vocabulary maps and their checks on the
    device too) and equals the old load (float32 on the CPU, cast, then moved)."""
    from test_draft_head_build_memory import TARGET, _old_load
    from test_draft_heads import random_head

    from speculators.draft_heads import load_draft_head

    kwargs = {"draft_vocab_size": 200} if kind == "eagle3" else {"num_mtp_layers": 2}
    random_head(kind, seed=5, target=TARGET, **kwargs).save_pretrained(tmp_path)
    head = load_draft_head(tmp_path, kind, TARGET, "cuda", torch.bfloat16)
    want = _old_load(tmp_path, kind, torch.bfloat16).cuda()
    tensors = dict(head.named_parameters()) | dict(head.named_buffers())
    assert all(t.is_cuda for t in tensors.values()), [n for n, t in tensors.items() if not t.is_cuda]
    for name, t in (dict(want.named_parameters()) | dict(want.named_buffers())).items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name
