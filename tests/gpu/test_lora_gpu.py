"""LoRA on a CUDA GPU: the shrink / expand kernels against their PyTorch references at real shapes, their CUDA
graph safety, and an engine with adapters (decode graphs, full-step graphs, prefill pieces) against HF + PEFT.

Shapes: every projection group of the Qwen3-0.6B and Qwen3-8B geometries (merged q/k/v, o, merged gate/up,
down), rank 16, 8 adapter slots, bfloat16, at token counts that take the per-row kernels (1, 8, 64) and the
segment kernels (65, 512, 4096), with segments of several adapters and rows without one; the split-K shrink's
partials through both expands at decode batch sizes (65, 256, 512), adapters round robin; the fused shrink + expand
and the unfused sorted pair over the tokens grouped by adapter (`lora_fused`) at every group and 1 to 4096 tokens,
and in a CUDA graph whose token map and layout change between replays.
Run: `PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_lora_gpu.py` (~1.5 min).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: GPU kernels would be interpreted", allow_module_level=True)

from framework.layers.kernels import lora, lora_fused  # noqa: E402
from framework.layers.kernels.lora import (  # noqa: E402
    LoraPartLayout,
    lora_expand_reference,
    lora_expand_triton,
    lora_shrink_reference,
    lora_shrink_triton,
)
from framework.layers.kernels.lora_fused import (  # noqa: E402
    lora_expand_sorted_triton,
    lora_segments_of,
    lora_shrink_expand_reference,
    lora_shrink_expand_triton,
    lora_shrink_sorted_triton,
)
from framework.models.lora.adapter import ProjectionShape  # noqa: E402
from framework.models.lora.projection import LoraGroup, LoraTokens  # noqa: E402

DEVICE, DTYPE, RANK, SLOTS = "cuda", torch.bfloat16, 16, 8
# geometry -> group -> (K, [N of each part])
GROUPS = {
    "0.6b": {
        "qkv": (1024, [2048, 1024, 1024]),
        "o": (2048, [1024]),
        "gate_up": (1024, [3072] * 2),
        "down": (3072, [1024]),
    },
    "8b": {
        "qkv": (4096, [4096, 1024, 1024]),
        "o": (4096, [4096]),
        "gate_up": (4096, [12288] * 2),
        "down": (12288, [4096]),
    },
}
TOKENS = [1, 8, 64, 65, 512, 4096]


def _token_lora(num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(num_tokens, dtype=torch.int32)
    start = 0
    while start < num_tokens:  # segments of one adapter each (or none), as a batch of requests lays them out
        length = int(torch.randint(1, 300, (1,), generator=gen)) if num_tokens > 64 else 1
        out[start : start + length] = int(torch.randint(-1, SLOTS, (1,), generator=gen))
        start += length
    return out.to(DEVICE)


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("group", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("geometry", list(GROUPS))
def test_kernels_equal_reference_at_real_shapes(geometry: str, group: str, num_tokens: int) -> None:
    k, parts = GROUPS[geometry][group]
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, k, device=DEVICE, dtype=DTYPE)
    a = (torch.randn(SLOTS, len(parts) * RANK, k, device=DEVICE) / k**0.5).to(DTYPE)
    token_lora = _token_lora(num_tokens, seed=num_tokens)
    xa_ref = lora_shrink_reference(x, a, token_lora)
    xa = lora_shrink_triton(x, a, token_lora)  # [T, P*R], or split-K partials [S, T, P*R] (the expand sums them)
    has = token_lora >= 0
    summed = xa.sum(0) if xa.dim() == 3 else xa
    torch.testing.assert_close(summed[has], xa_ref[has], atol=2e-2, rtol=2e-2)
    out = torch.randn(num_tokens, sum(parts), device=DEVICE, dtype=DTYPE)
    want, got, fused = out.clone(), out.clone(), out.clone()
    offsets = [sum(parts[:i]) for i in range(len(parts) + 1)]
    b_all = (torch.randn(SLOTS, offsets[-1], RANK, device=DEVICE) / RANK**0.5).to(DTYPE)  # parts stacked
    for i, (start, end) in enumerate(zip(offsets, offsets[1:])):
        b, part = b_all[:, start:end].contiguous(), xa_ref[:, i * RANK : (i + 1) * RANK]
        lora_expand_reference(want[:, start:end], part, b, token_lora)
        lora_expand_triton(got[:, start:end], part, b, token_lora)
    layout = LoraPartLayout(offsets, torch.device(DEVICE)) if len(parts) > 1 else None
    lora_expand_triton(fused, xa_ref, b_all, token_lora, layout)  # the group's one launch
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)  # bf16: one rounding of y + delta
    torch.testing.assert_close(fused, got, atol=3e-2, rtol=2e-2)
    from_shrink = out.clone()  # the default pipeline: the shrink's own output (partials too) into the group's expand
    lora_expand_triton(from_shrink, xa, b_all, token_lora, layout)
    torch.testing.assert_close(from_shrink, got, atol=3e-2, rtol=2e-2)
    assert torch.equal(from_shrink[~has], out[~has])
    assert torch.equal(got[~has], out[~has]) and torch.equal(fused[~has], out[~has]), "a row without one written"


@pytest.mark.parametrize("splits", [4, 16])
@pytest.mark.parametrize("num_tokens", [65, 256, 512])
@pytest.mark.parametrize("group", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("geometry", list(GROUPS))
def test_split_shrink_partials_at_real_shapes(geometry: str, group: str, num_tokens: int, splits: int) -> None:
    """Decode batches with adapters round robin (every tile holds every slot), every fourth row without one."""
    k, parts = GROUPS[geometry][group]
    torch.manual_seed(splits)
    x = torch.randn(num_tokens, k, device=DEVICE, dtype=DTYPE)
    a = (torch.randn(SLOTS, len(parts) * RANK, k, device=DEVICE) / k**0.5).to(DTYPE)
    rows = torch.arange(num_tokens, device=DEVICE)
    token_lora = torch.where(rows % 4 == 3, -1, rows % SLOTS).to(torch.int32)
    xa_ref = lora_shrink_reference(x, a, token_lora)
    partials = lora_shrink_triton(x, a, token_lora, variant="split", splits=splits)
    assert partials.shape[0] == splits  # every geometry's K is whole 64-column steps for up to 16 ranges
    has = token_lora >= 0
    torch.testing.assert_close(partials.sum(0)[has], xa_ref[has], atol=2e-2, rtol=2e-2)
    offsets = [sum(parts[:i]) for i in range(len(parts) + 1)]
    b = (torch.randn(SLOTS, offsets[-1], RANK, device=DEVICE) / RANK**0.5).to(DTYPE)
    layout = LoraPartLayout(offsets, torch.device(DEVICE)) if len(parts) > 1 else None
    out = torch.randn(num_tokens, offsets[-1], device=DEVICE, dtype=DTYPE)
    want = out.clone()
    lora_expand_reference(want, xa_ref, b, token_lora, layout)
    for variant in ("row", "segment"):
        got = out.clone()
        lora_expand_triton(got, partials, b, token_lora, layout, variant=variant)
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
        assert torch.equal(got[~has], out[~has]), "a row without an adapter was written"


@pytest.mark.parametrize("num_tokens,block_n", [(1, 512), (64, 256), (4096, 128)])
@pytest.mark.parametrize("group", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("geometry", list(GROUPS))
def test_grouped_launches_equal_reference_at_real_shapes(
    geometry: str, group: str, num_tokens: int, block_n: int
) -> None:
    """The fused launch (each column tile width the benchmark sweeps) and the sorted pair against the reference
    composition: decode sizes with each row's adapter drawn at random, prefill sizes in segments, rows without one."""
    k, parts = GROUPS[geometry][group]
    torch.manual_seed(num_tokens + block_n)
    x = torch.randn(num_tokens, k, device=DEVICE, dtype=DTYPE)
    a = (torch.randn(SLOTS, len(parts) * RANK, k, device=DEVICE) / k**0.5).to(DTYPE)
    offsets = [sum(parts[:i]) for i in range(len(parts) + 1)]
    b = (torch.randn(SLOTS, offsets[-1], RANK, device=DEVICE) / RANK**0.5).to(DTYPE)
    layout = LoraPartLayout(offsets, torch.device(DEVICE)) if len(parts) > 1 else None
    token_lora = _token_lora(num_tokens, seed=num_tokens + 1)
    rows, bounds = lora_segments_of(token_lora, SLOTS)
    out = torch.randn(num_tokens, offsets[-1], device=DEVICE, dtype=DTYPE)
    want, fused, pair = out.clone(), out.clone(), out.clone()
    lora_shrink_expand_reference(want, x, a, b, token_lora, layout)
    lora_shrink_expand_triton(fused, x, a, b, rows, bounds, layout, block_n=block_n)
    wide = out.clone()  # four column tiles a program, every part's xa computed once (the benchmark's fused256x4)
    lora_shrink_expand_triton(wide, x, a, b, rows, bounds, layout, block_n=block_n, tiles_per_program=4)
    xa = lora_shrink_sorted_triton(x, a, rows, bounds, RANK)
    lora_expand_sorted_triton(pair, xa, b, rows, bounds, layout, block_n=block_n)
    has = token_lora >= 0
    for got in (fused, wide, pair):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
        assert torch.equal(got[~has], out[~has]), "a row without an adapter was written"


@pytest.mark.parametrize(
    "num_tokens,split_max,fused_max", [(32, 0, 0), (256, 256, 0), (64, 0, 64)], ids=["per_row", "split", "fused"]
)
def test_graph_replays_follow_the_token_map_without_a_host_sync(
    num_tokens: int, split_max: int, fused_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One capture of a group's update; the adapters of the rows change between replays (a tensor input), and
    each replay equals the reference for the map of that replay. Eager calls queue without a host sync. Per-row
    kernels at 32 tokens; at 256 the split-K shrink (its partials summed by the segment expand); at 64 with
    `FUSED_MAX_TOKENS` raised the fused launch over the layout staged with the map."""
    monkeypatch.setattr(lora, "SPLIT_K_MAX_TOKENS", split_max)
    monkeypatch.setattr(lora_fused, "FUSED_MAX_TOKENS", fused_max)
    tokens = LoraTokens(num_tokens, SLOTS, torch.device(DEVICE))
    host = np.empty(tokens.buffer.shape[0], dtype=np.int32)
    shapes = [ProjectionShape(1024, 2048), ProjectionShape(1024, 1024), ProjectionShape(1024, 1024)]
    group = LoraGroup(0, ("q_proj", "k_proj", "v_proj"), shapes, SLOTS, RANK, tokens, DTYPE, torch.device(DEVICE))
    group.lora_a.normal_(std=0.03)
    group.lora_b.normal_(std=0.25)
    x = torch.randn(num_tokens, 1024, device=DEVICE, dtype=DTYPE)
    out = torch.zeros(num_tokens, 4096, device=DEVICE, dtype=DTYPE)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        group.add(x, out.clone())  # compile before capture
    torch.cuda.synchronize()
    graph, static_out = torch.cuda.CUDAGraph(), out.clone()
    with torch.cuda.graph(graph):
        group.add(x, static_out)
    for seed in range(3):
        token_lora = torch.randint(
            -1, SLOTS, (num_tokens,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32
        )
        start, stop = tokens.stage(host, token_lora.numpy(), num_tokens)  # as LoraState.prepare: one copy
        tokens.buffer[start:stop].copy_(torch.from_numpy(host[start:stop]))
        static_out.zero_()
        graph.replay()
        want = torch.zeros_like(out)
        xa = lora_shrink_reference(x, group.lora_a, tokens.token_lora[:num_tokens])
        for i, (start, end) in enumerate(zip(group.offsets, group.offsets[1:])):
            b, part_xa = group.lora_b[:, start:end], xa[:, i * RANK : (i + 1) * RANK]
            lora_expand_reference(want[:, start:end], part_xa, b, tokens.token_lora[:num_tokens])
        torch.testing.assert_close(static_out, want, atol=3e-2, rtol=2e-2)
    torch.cuda.set_sync_debug_mode("error")
    try:
        group.add(x, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_engine_with_adapters_matches_hf_peft(tmp_path: Path) -> None:
    """float32 tiny Qwen3 on the GPU with graphs on (decode, full-step, prefill pieces): mixed adapters + base
    give PEFT's greedy tokens (computed on the CPU)."""
    from helpers.hf_models import SPEC_BY_NAME, build_hf_model, hf_greedy, random_prompts, save_tiny_checkpoint
    from helpers.lora_adapters import ADAPTERS, hf_peft_model, save_adapter

    from framework.entrypoints.llm import LLM
    from framework.params.lora_request import LoRARequest
    from framework.params.sampling_params import SamplingParams

    spec = SPEC_BY_NAME["qwen3"]
    save_tiny_checkpoint(spec, tmp_path / "base")
    loras = {a.name: LoRARequest(a.name, str(save_adapter(spec, a, tmp_path / a.name))) for a in ADAPTERS}
    prompts = random_prompts(3, 5, 40, seed=3)
    names = [None, *loras]
    requests = [(n, p) for p in range(len(prompts)) for n in names]
    llm = LLM(
        str(tmp_path / "base"), device="cuda", dtype="float32", max_model_len=96, enable_lora=True, max_loras=2,
        gpu_memory_utilization=0.3,
    )  # fmt: skip
    outs = llm.generate(
        [prompts[p] for _, p in requests],
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
        lora_request=[loras.get(n) for n, _ in requests],
    )
    models = {None: build_hf_model(spec)} | {n: hf_peft_model(spec, Path(r.path)) for n, r in loras.items()}
    for (name, p), out in zip(requests, outs):
        assert out.token_ids == hf_greedy(models[name], prompts[p], 16), f"adapter {name}, prompt {p}"
