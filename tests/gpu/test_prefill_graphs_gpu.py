"""Prefill graph pieces (runner.prefill_cuda_graphs, framework/runner/graphs/prefill_graphs.py) on a GPU, real
CUDA graphs.

- on == off at the Qwen3-0.6B geometry (random weights, float32 so that the padded GEMMs' other shapes cannot
  flip a near-tie): prompts of 20-900 tokens, chunked by a 1,024-token budget, so prompt steps mix chunks with
  decode rows and most need padding; greedy and seeded rows, logprobs within 1e-3; the pieces really replayed;
- bf16 at nano's step size: one 8,000-token prompt step through the pieces (padded to 8,192) against the eager
  forward on the same weights and an identical KV cache: hidden states and the stored K/V within bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ENGINE = {
    "device": "cuda",
    "dtype": "float32",
    "max_model_len": 1024,
    "max_num_seqs": 32,
    "seed": 0,
    "max_num_batched_tokens": 1024,
    "gpu_memory_utilization": 0.8,  # also of one xdist worker's share of the card (tests/gpu/conftest.py)
}


def test_prefill_pieces_equal_eager_at_real_shapes() -> None:
    from framework import LLM, SamplingParams

    prompts = [[(7 * i + 13 * j) % 151_000 for j in range(20 + 29 * i)] for i in range(30)]
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            seed=i,
            max_tokens=6 + i % 7,
            ignore_eos=True,
            logprobs=2 if i % 3 == 0 else None,
        )
        for i in range(30)
    ]
    results = {}
    for on in (False, True):
        llm = LLM("qwen3-0.6b", **ENGINE, prefill_cuda_graphs=on)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[on] = [
            (o.token_ids, [{t: (e.logprob, e.rank) for t, e in d.items()} for d in (o.logprobs or [])]) for o in outs
        ]
        graphs = llm.engine.runner.graphs.prefill_graphs
        if on:
            assert graphs is not None and graphs.sizes == [512, 1024]
            assert graphs.num_replayed_steps >= 10, graphs.num_replayed_steps
        else:
            assert graphs is None
        llm.shutdown()
    for (tokens_off, lp_off), (tokens_on, lp_on) in zip(results[False], results[True]):
        assert tokens_on == tokens_off
        for a, b in zip(lp_off, lp_on):
            assert set(a) == set(b)
            for t, (value, rank) in a.items():
                assert abs(b[t][0] - value) <= 1e-3 and b[t][1] == rank, (t, a, b)


@torch.inference_mode()
def test_bf16_pieces_at_nano_step_size_match_the_eager_forward() -> None:
    from framework import LLM
    from framework.layers.attention import AttentionMetadata
    from framework.runner.graphs.prefill_graphs import PrefillPieceGraphs

    llm = LLM(
        "qwen3-0.6b", device="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=8, seed=0, num_kv_blocks=1024
    )  # 16K tokens: room for the 8,000 and two copies of the cache
    runner = llm.engine.runner
    model, block = runner.model, runner.block_tables.block_size
    lengths = [2000, 2000, 2000, 1000, 1000]  # 8,000 tokens in five rows
    starts, slots, positions, tables, first = [0], [], [], [], 0
    for n in lengths:
        row = list(range(first, first + -(-n // block)))
        first += len(row)
        tables.append(row + [0] * (-(-2048 // block) - len(row)))
        slots += [row[p // block] * block + p % block for p in range(n)]
        positions += list(range(n))
        starts.append(starts[-1] + n)
    dev = torch.device("cuda")
    meta = AttentionMetadata(
        num_tokens=starts[-1],
        num_rows=len(lengths),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=dev),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        kv_slot_mapping=torch.tensor(slots, device=dev),
        block_size=block,
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
    )
    ids = torch.randint(0, 151_000, (starts[-1],), generator=torch.Generator().manual_seed(0)).to(dev)
    pos = torch.tensor(positions, device=dev)
    eager_caches = [torch.zeros_like(c) for c in runner.kv_caches]
    expected = model(ids, pos, eager_caches, meta)
    piece_caches = [torch.zeros_like(c) for c in runner.kv_caches]
    graphs = PrefillPieceGraphs(model, piece_caches, [8192], dev)
    graphs.capture()
    got = graphs.run(8192, ids, pos, meta)
    torch.cuda.synchronize()
    rel = ((got.float() - expected.float()).norm() / expected.float().norm()).item()
    assert rel < 2e-2, rel
    for piece, eager in zip(piece_caches, eager_caches):
        stored = torch.tensor(slots, device=dev)
        a = piece.flatten(1, 2)[:, stored].float()
        b = eager.flatten(1, 2)[:, stored].float()
        assert ((a - b).norm() / b.norm()).item() < 2e-2
        assert piece.flatten(1, 2)[:, first * block :].abs().sum().item() == 0  # padding stored nothing
    llm.shutdown()
