"""`kernels.longest_rows_first`: the model hands attention its large batches' rows by descending KV length.

The kernel side (same bits in any launch order, the rank kernel against a stable argsort) is tested in
tests/layers/test_attention_triton.py and, at real shapes inside a CUDA graph, tests/gpu/test_attention_gpu.py.
"""

import pytest
import torch

from framework import SamplingParams
from framework.layers.attention.backend import LONGEST_FIRST_MIN_ROWS


def _attention_calls(make_llm, longest_rows_first: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(seq_lens, row_order) of every attention call of a run with one more request than the threshold."""
    num = LONGEST_FIRST_MIN_ROWS + 1
    llm = make_llm(max_num_seqs=num, longest_rows_first=longest_rows_first)
    model = llm.engine.runner.model
    attention, calls = model.attention, []

    def recording(query, kv_cache, meta, scale, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((meta.seq_lens[: meta.num_rows].clone(), meta.row_order))
        return attention(query, kv_cache, meta, scale, **kwargs)

    model.attention = recording
    prompts = [[3 + i % 50] * (1 + (i * 37) % 23) for i in range(num)]  # lengths 1..23, many ties
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    return calls


@pytest.mark.parametrize("longest_rows_first", [True, False])
def test_large_batches_get_their_rows_longest_first(tiny_llm_factory, longest_rows_first):
    calls = _attention_calls(tiny_llm_factory, longest_rows_first)
    large = [(lens, order) for lens, order in calls if len(lens) >= LONGEST_FIRST_MIN_ROWS]
    assert large, "no batch reached the threshold"
    assert all(order is None for lens, order in calls if len(lens) < LONGEST_FIRST_MIN_ROWS)
    for lens, order in large:
        if not longest_rows_first:
            assert order is None
            continue
        assert order is not None and order.dtype == torch.int32
        assert torch.equal(order, torch.argsort(lens, descending=True, stable=True).to(torch.int32))
