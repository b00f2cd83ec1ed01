"""q/k norm + RoPE + KV store fused into the decode attention launch, on a CUDA GPU at the Qwen3-0.6B geometry
(16 query heads, 8 KV heads, head_dim 128, bfloat16, KV blocks of 16 tokens).

Claims:
- `rope_paged_attention` (one launch) against the two kernels it replaces (`qk_norm_rope_store_triton` +
  `paged_attention`) and against the PyTorch references (bf16 and float32), on decode rows and draft-verify
  rows of 4 tokens, batches 1 to 64, contexts up to 4096 keys (several KV splits), with and without q/k norm:
  the output within the bf16 tolerance of the float32 reference (and no worse than the bf16 reference), the
  cache as the two kernels leave it (bit for bit without the norm; within one bf16 step with it, whose
  summation order differs), untouched memory untouched;
- the same inside a CUDA graph replayed with new sequence lengths, KV slots and projections, with PDL off and
  on: a program reading a new key before it is stored, or another program's, would show at some replay;
- an engine (random-weight 0.6B, greedy, requests ending at different steps, CUDA graphs) gives the same
  tokens with `model.fuse_rope_attention` on and off, and the fused launch ran.
Run: `PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_rope_attention_gpu.py`
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: GPU kernels would be interpreted", allow_module_level=True)

from framework.attention import triton_rope_attention  # noqa: E402
from framework.attention.launch_config import decode_tiles, num_kv_splits  # noqa: E402
from framework.attention.paged import paged_attention_reference  # noqa: E402
from framework.attention.triton_paged_attention import paged_attention  # noqa: E402
from framework.attention.triton_rope_attention import rope_paged_attention  # noqa: E402
from framework.kernels.layer_ops import qk_norm_rope_store_reference  # noqa: E402
from framework.kernels.pdl import pdl_supported  # noqa: E402
from framework.kernels.triton_qk_norm_rope import qk_norm_rope_store_triton  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the shared case builder
from attention_cases import make_paged_case  # noqa: E402

DEVICE, DTYPE, EPS = "cuda", torch.bfloat16, 1e-6
HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16
SCALE = 1 / math.sqrt(HEAD_DIM)
TOL = 2e-2  # bf16: its spacing is 2^-7 relative (as tests/gpu/test_attention_gpu.py)


def _rows(kind: str, batch: int, max_seq: int, seed: int) -> list[tuple[int, int]]:
    lens = torch.randint(5, max_seq + 1, (batch,), generator=torch.Generator().manual_seed(seed)).tolist()
    lens[0] = max_seq  # the longest row: the split count follows it
    q = 1 if kind == "decode" else 4
    return [(n - q, q) for n in lens]


def _inputs(num_tokens: int, qk_norm: bool, seed: int):
    """qkv [T, (H + 2 Hkv) D], cos, sin [T, D], q / k norm weights (or None), all bf16 on the GPU."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=g, device=DEVICE).to(DTYPE)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g, device=DEVICE).float()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device=DEVICE).float() / HEAD_DIM))
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    weights = [(torch.rand(HEAD_DIM, generator=g, device=DEVICE) + 0.5).to(DTYPE) if qk_norm else None
               for _ in range(2)]
    return qkv, emb.cos().to(DTYPE), emb.sin().to(DTYPE), weights[0], weights[1]


def _unfused(inputs, cache, meta) -> torch.Tensor:
    qkv, cos, sin, qw, kw = inputs
    q = qk_norm_rope_store_triton(qkv, cos, sin, qw, kw, EPS, HEADS, KV_HEADS, HEAD_DIM, cache, meta.kv_slot_mapping)
    return paged_attention(q, cache, meta, SCALE)


def _fused(inputs, cache, meta, **kwargs) -> torch.Tensor:
    qkv, cos, sin, qw, kw = inputs
    return rope_paged_attention(qkv, cos, sin, qw, kw, EPS, HEADS, KV_HEADS, HEAD_DIM, cache, meta, SCALE, **kwargs)


def _references(inputs, cache, meta) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bf16 output, float32 output, bf16 cache after the step) of the PyTorch references."""
    qkv, cos, sin, qw, kw = inputs
    cache = cache.clone()
    q = qk_norm_rope_store_reference(qkv, cos, sin, qw, kw, EPS, HEADS, KV_HEADS, HEAD_DIM, cache,
                                     meta.kv_slot_mapping)
    return (paged_attention_reference(q, cache, meta, SCALE).float(),
            paged_attention_reference(q.float(), cache.float(), meta, SCALE), cache)


def _assert_step(out, cache, inputs, cache_before, meta, n: int, qk_norm: bool) -> None:
    """The fused step's output and cache against the references and the two kernels on the same inputs."""
    ref, ref32, ref_cache = _references(inputs, cache_before, meta)
    out = out[:n].float()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref32[:n], atol=TOL, rtol=TOL)
    err, ref_err = (out - ref32[:n]).abs().mean().item(), (ref[:n] - ref32[:n]).abs().mean().item()
    assert err <= 2 * ref_err + 1e-4, (err, ref_err)
    unfused_cache = cache_before.clone()
    unfused = _unfused(inputs, unfused_cache, meta)[:n].float()
    torch.testing.assert_close(out, unfused, atol=TOL, rtol=TOL)
    assert torch.equal(cache.isnan(), ref_cache.isnan())  # nothing stored where the references store nothing
    if qk_norm:  # one bf16 step at most: the norm's summation order differs
        torch.testing.assert_close(cache, unfused_cache, atol=TOL, rtol=TOL, equal_nan=True)
    else:  # the same roundings on the same values
        torch.testing.assert_close(cache, unfused_cache, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("kind, batch, max_seq", [("decode", 1, 4096), ("decode", 1, 37), ("decode", 8, 2048),
                                                  ("decode", 64, 1024), ("verify", 1, 3000), ("verify", 16, 700)])
def test_fused_matches_unfused_and_references(kind, batch, max_seq, qk_norm):
    rows = _rows(kind, batch, max_seq, seed=batch + max_seq)
    case = make_paged_case(rows, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=PAGE,
                           dtype=DTYPE, device=DEVICE, num_pad_tokens=2, seed=batch, poison=True)
    inputs = _inputs(case.query.shape[0], qk_norm, seed=batch)
    cache = case.kv_cache.clone()
    out = _fused(inputs, cache, case.meta)
    _assert_step(out, cache, inputs, case.kv_cache, case.meta, case.num_real_tokens, qk_norm)


@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_graph_replays_with_changing_seq_lens(pdl):
    """As the engine decodes: max_seq_len fixed at 4096 (the split count fixed at capture), one counter buffer,
    the graph replayed with new sequence lengths, KV slots (a row's last position) and projections."""
    if pdl and not pdl_supported(torch.device(DEVICE)):
        pytest.skip("no PDL on this GPU / Triton")
    batch, max_seq = 4, 4096
    case = make_paged_case([(max_seq - 1, 1)] * batch, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                           block_size=PAGE, dtype=DTYPE, device=DEVICE, seed=5, poison=False)
    meta = dataclasses.replace(case.meta, max_seq_len=max_seq)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert num_kv_splits(batch, KV_HEADS, max_seq, sms, decode_tiles(HEAD_DIM, 2, True).block_n) > 1
    counters = torch.zeros(batch * KV_HEADS, dtype=torch.int32, device=DEVICE)
    inputs = _inputs(batch, True, seed=0)
    source = inputs[0].clone()
    cache = case.kv_cache

    def step() -> torch.Tensor:
        inputs[0].copy_(source)  # the projection, written by the kernel before (PDL: read only after the wait)
        return _fused(inputs, cache, meta, split_counters=counters, pdl=pdl)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    g = torch.Generator().manual_seed(1)
    table = meta.block_tables.cpu().long()
    for replay in range(6):
        seq_lens = torch.randint(1, max_seq + 1, (batch,), generator=g)
        seq_lens[0] = (1, 4096, 129, 2048, 17, 1024)[replay]  # split edges, a single key
        last = seq_lens - 1
        slots = table[torch.arange(batch), last // PAGE] * PAGE + last % PAGE
        meta.seq_lens.copy_(seq_lens)
        meta.kv_slot_mapping.copy_(slots)
        source.copy_(torch.randn(source.shape, generator=g).to(source))
        before = cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert not counters.any(), replay
        _assert_step(out, cache, inputs, before, meta, batch, qk_norm=True)


def test_engine_tokens_are_the_same_with_the_switch_on_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from framework import LLM, SamplingParams

    calls: list[int] = []
    kernel = triton_rope_attention.rope_paged_attention
    monkeypatch.setattr(triton_rope_attention, "rope_paged_attention",
                        lambda *a, **k: (calls.append(a[10].max_query_len), kernel(*a, **k))[1])
    prompts = [[(37 * i + 11 * j) % 150_000 for j in range(16 + 9 * i)] for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=12 + 6 * i, ignore_eos=True) for i in range(3)]
    tokens = {}
    for fuse in (False, True):
        llm = LLM("qwen3-0.6b", device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=4, seed=0,
                  gpu_memory_utilization=0.3, fuse_rope_attention=fuse)
        assert (llm.engine.runner.model.model.layers[0].self_attn.rope_attention is not None) == fuse
        tokens[fuse] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert tokens[True] == tokens[False]
    assert calls and set(calls) == {1}  # decode batches (graph capture included) took the fused launch
