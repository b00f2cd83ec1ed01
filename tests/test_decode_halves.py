"""Decode batches as two halves (`model.decode_halves_min_rows`, `LlamaForCausalLM._layers_in_halves`) on the CPU.

The two CUDA streams are stood in for by objects that record the fork and the join (on the CPU the halves run
one after the other; the GPU runs them at once: tests/gpu/test_gpu_engine.py). Claims: `decode_rows` gives a
part of a decode batch as a batch of its own (query offsets from 0, the same lengths, tables and slots), and
attention over the two parts is attention over the whole; an engine with halves from 4 rows gives HF's greedy
tokens and those of an engine without, the halves path ran at 4-5 rows and not below, forking the side stream
from the current one and joining it back; it never runs for prefill, MoE models or on a CPU tensor without the
stand-in.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import framework.models.llama as llama
from framework.attention.metadata import AttentionMetadata, decode_rows
from framework.attention.paged import paged_attention_reference
from framework.llm import LLM
from framework.sampling_params import SamplingParams

try:
    from hf_models import SPEC_BY_NAME, hf_greedy, random_prompts, save_tiny_checkpoint
except ImportError:  # tests/ collected as a package
    from tests.hf_models import SPEC_BY_NAME, hf_greedy, random_prompts, save_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def _decode_meta(seq_lens: list[int], block_size: int = 4, blocks: int = 40) -> AttentionMetadata:
    rows = len(seq_lens)
    gen = torch.Generator().manual_seed(0)
    tables = torch.stack([torch.randperm(blocks, generator=gen)[:8] for _ in range(rows)]).to(torch.int32)
    slots = torch.tensor([int(tables[r, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for r, n in enumerate(seq_lens)])
    return AttentionMetadata(num_tokens=rows, num_rows=rows, query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                             kv_slot_mapping=slots, block_size=block_size, max_query_len=1, max_seq_len=max(seq_lens))


def test_decode_rows_is_a_batch_of_its_own() -> None:
    meta = _decode_meta([5, 17, 9, 30, 2])
    part = decode_rows(meta, 2, 5)
    assert (part.num_rows, part.num_tokens, part.max_query_len, part.max_seq_len) == (3, 3, 1, meta.max_seq_len)
    assert part.query_start_loc.tolist() == [0, 1, 2, 3]
    assert torch.equal(part.seq_lens, meta.seq_lens[2:]) and torch.equal(part.block_tables, meta.block_tables[2:])
    assert torch.equal(part.kv_slot_mapping, meta.kv_slot_mapping[2:]) and part.row_order is None
    with pytest.raises(AssertionError, match="one token per row"):
        decode_rows(AttentionMetadata(**{**meta.__dict__, "max_query_len": 2}), 0, 2)
    with pytest.raises(AssertionError, match="rows"):
        decode_rows(meta, 3, 3)


def test_attention_over_the_halves_is_attention_over_the_whole() -> None:
    meta = _decode_meta([5, 17, 9, 30, 2, 11])
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 40, 4, 2, 8, generator=gen)  # [2, blocks, block_size, kv heads, head_dim]
    q = torch.randn(6, 4, 8, generator=gen)
    whole = paged_attention_reference(q, cache, meta, 0.3)
    halves = torch.cat([paged_attention_reference(q[:3], cache, decode_rows(meta, 0, 3), 0.3),
                        paged_attention_reference(q[3:], cache, decode_rows(meta, 3, 6), 0.3)])
    assert torch.equal(halves, whole)


class _Stream:
    """Stands in for a CUDA stream: records `wait_stream` as (waiter, waited)."""

    log: list[tuple[str, str]] = []

    def __init__(self, name: str = "side") -> None:
        self.name = name

    def wait_stream(self, other: "_Stream") -> None:
        _Stream.log.append((self.name, other.name))


def _stand_in_streams(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Patch the stream calls of `_layers_in_halves` (after transformers is imported: it reads torch.cuda)."""
    main = _Stream("main")
    _Stream.log = []
    monkeypatch.setattr(llama.LlamaForCausalLM, "_has_streams", staticmethod(lambda x: True))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream("side"))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    return _Stream.log


def test_an_engine_in_halves_gives_hfs_tokens(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    hf_model = save_tiny_checkpoint(SPEC_BY_NAME["qwen3"], tmp_path)
    prompts = random_prompts(5, 3, 12, seed=5)
    max_tokens = [3, 4, 5, 6, 7]  # decode at 5, 4, 3, 2, 1 rows as the requests end
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    want = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, max_tokens)]
    log = _stand_in_streams(monkeypatch)
    calls: list[tuple[int, int, int]] = []  # (rows of the batch, start, end) of each part
    real_decode_rows = llama.decode_rows

    def spy(meta: AttentionMetadata, start: int, end: int) -> AttentionMetadata:
        calls.append((meta.num_rows, start, end))
        return real_decode_rows(meta, start, end)

    monkeypatch.setattr(llama, "decode_rows", spy)
    tokens = {}
    for min_rows in (0, 4):
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_seqs=8, cuda_graphs=False,
                  decode_halves_min_rows=min_rows)
        tokens[min_rows] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[4] == tokens[0] == want
    # Only decode batches of >= 4 rows, split at half (prefill never; 5 rows: 2 + 3).
    assert set(calls) == {(5, 0, 2), (5, 2, 5), (4, 0, 2), (4, 2, 4)}
    forwards = len(calls) // 2  # each forward in halves forks the side stream from the main one, then joins it
    assert forwards >= 2 and log == [("side", "main"), ("main", "side")] * forwards


def test_not_on_a_cpu_tensor_or_for_moe() -> None:
    assert llama.LlamaForCausalLM.dense and not llama.LlamaForCausalLM._has_streams(torch.zeros(1))
    from framework.models.moe import MoeForCausalLM

    assert MoeForCausalLM.dense is False
