"""The L2 prefetch of the small-batch path (framework/kernels/l2_prefetch.py) without a GPU.

Claims: a plan's chunks, as the kernel computes them (`_chunk_span`, run in the interpreter), cover every region
exactly once, in order, cut at each region's end and nothing past the last; compiled for sm_90, the kernel's
PTX holds one bulk L2 prefetch with an evict_last policy per lane and, under PDL, waits (`griddepcontrol.wait`)
only after it; `model.l2_prefetch` resolves off on a CPU and under the interpreter (a warning for `on`) and on
for a faked sm_90; `enable_small_batch` gives each dense layer the plan of its o_proj, gate/up and down weights
and the next layer's qkv (the last layer: three regions), none when off; the small-batch decode calls the
prefetch once per layer between the q/k RoPE kernel and the attention, the prefill never, and the tokens are
those of a run without it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
import triton.language as tl

import framework.kernels.l2_prefetch as l2
import framework.models.llama as llama
import framework.models.small_batch as small_batch
from framework.config import Mrv2Config
from framework.kernels.l2_prefetch import _chunk_span, prefetch_plan, resolve_l2_prefetch
from framework.models.small_batch import enable_small_batch
from framework.sampling_params import SamplingParams

CUDA = torch.device("cuda")
REPO = Path(__file__).resolve().parents[1]


@triton.jit
def _spans_kernel(out_addr, out_size, a0, a1, a2, a3, n0, n1, n2, n3, c1, c2, c3, total,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    address, size = _chunk_span(i, a0, a1, a2, a3, n0, n1, n2, n3, c1, c2, c3, total, CHUNK)
    tl.store(out_addr + i, address)
    tl.store(out_size + i, size)


def _spans(plan: l2.PrefetchPlan, block: int = 16) -> list[tuple[int, int]]:
    """(address, bytes) of every chunk the kernel would prefetch (bytes > 0), from the interpreted index math."""
    n = triton.cdiv(plan.total + block, block) * block  # one block past the end: those lanes fetch nothing
    addr, size = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int32)
    _spans_kernel[(n // block,)](addr, size, *plan.addresses, *plan.sizes, *plan.starts, plan.total,
                                 CHUNK=plan.chunk, BLOCK=block)
    assert (size[plan.total:] == 0).all(), "lanes past the last chunk must fetch nothing"
    return [(int(a), int(s)) for a, s in zip(addr[: plan.total], size[: plan.total])]


@pytest.mark.parametrize("shapes", [[(40, 24)], [(64, 64), (3, 100), (1000,)], [(7, 3), (512,), (9, 9), (130,)]])
def test_chunks_cover_each_region_once_in_order(shapes: list[tuple[int, ...]]) -> None:
    regions = [torch.empty(shape, dtype=torch.bfloat16) for shape in shapes]
    plan = prefetch_plan(regions, chunk=256)
    spans = _spans(plan)
    assert all(0 < s <= 256 and s % 16 == 0 for _, s in spans)
    expected: list[tuple[int, int]] = []
    for t in regions:  # each region from its start to its end rounded down to 16 bytes, in 256-byte chunks
        end = t.numel() * t.element_size() // 16 * 16
        expected += [(t.data_ptr() + o, min(256, end - o)) for o in range(0, end, 256)]
    assert spans == expected
    assert plan.grid == triton.cdiv(plan.total, l2.LANES)


def test_plan_limits() -> None:
    assert prefetch_plan([]).total == 0
    with pytest.raises(AssertionError, match="regions"):
        prefetch_plan([torch.empty(16)] * 5)
    with pytest.raises(AssertionError, match="contiguous"):
        prefetch_plan([torch.empty(8, 8).t()])
    l2.l2_prefetch(prefetch_plan([torch.empty(64)]), torch.device("cpu"))  # a CPU: nothing launched, no error


_PTX_SCRIPT = """
import json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import framework.kernels.l2_prefetch as l2
signature = {n: "i64" for n in ("a0", "a1", "a2", "a3")}
signature.update({n: "i32" for n in ("n0", "n1", "n2", "n3", "c1", "c2", "c3", "total")})
for pdl in (False, True):
    constants = {"CHUNK": l2.CHUNK_BYTES, "BLOCK": l2.LANES, "BULK": True, "USE_PDL": pdl}
    compiled = triton.compile(ASTSource(l2._l2_prefetch_kernel, {**signature, **{k: "constexpr" for k in constants}},
                                        constants), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print(json.dumps([line.strip() for line in compiled.asm["ptx"].splitlines()
                      if not line.strip().startswith(("//", "."))]))
"""


def test_ptx_prefetches_before_it_waits() -> None:
    """Compiled for sm_90 (a subprocess: the interpreter is on here; the real backend compiles without a GPU)."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    variants = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("[")]
    assert len(variants) == 2
    for pdl, lines in zip((False, True), variants):
        prefetch = [i for i, line in enumerate(lines) if line.startswith("@") and "cp.async.bulk.prefetch.L2" in line]
        assert len(prefetch) == 1 and "L2::cache_hint" in lines[prefetch[0]], lines
        assert any("createpolicy.fractional.L2::evict_last" in line for line in lines)
        waits = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait")]
        launches = [i for i, line in enumerate(lines) if line.startswith("griddepcontrol.launch_dependents")]
        if pdl:  # the weights are asked for before the wait: that is the point of launching it early
            assert len(waits) == 1 and len(launches) == 1 and prefetch[0] < waits[0] < launches[0]
        else:
            assert not waits and not launches


def test_resolves_off_on_a_cpu_and_under_the_interpreter(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    assert Mrv2Config().model.l2_prefetch == "off"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with caplog.at_level(logging.WARNING, logger=l2.__name__):
        assert not resolve_l2_prefetch("on", torch.device("cpu"))
        assert not resolve_l2_prefetch("auto", torch.device("cpu"))
    assert [r.getMessage() for r in caplog.records] == [
        "L2 prefetch off: device cpu is not a CUDA GPU (model.l2_prefetch=on)"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve_l2_prefetch("auto", CUDA) and resolve_l2_prefetch("on", CUDA)
    assert not resolve_l2_prefetch("off", CUDA)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not resolve_l2_prefetch("auto", CUDA)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not resolve_l2_prefetch("auto", CUDA)


def test_each_layer_plans_its_gemv_weights_and_the_next_qkv(tiny_llm_factory: Any) -> None:
    model = tiny_llm_factory(small_batch_kernels="on", cuda_graphs=False).engine.runner.model
    layers = list(model.model.layers)
    assert all(layer.l2_prefetch is None for layer in layers)  # the default (off; a CPU anyway)
    assert enable_small_batch(model, 1, l2_prefetch=True) == len(layers) > 1
    for i, layer in enumerate(layers):
        weights = [layer.self_attn.o_proj.weight, layer.mlp.gate_up_weight, layer.mlp.down_proj.weight]
        weights += [layers[i + 1].self_attn.qkv_weight] if i + 1 < len(layers) else []
        plan = layer.l2_prefetch
        assert plan.addresses[: len(weights)] == tuple(w.data_ptr() for w in weights)
        assert plan.sizes[: len(weights)] == tuple(w.numel() * w.element_size() for w in weights)
        assert plan.sizes[len(weights):] == (0,) * (4 - len(weights))
    enable_small_batch(model, 1, l2_prefetch=False)
    assert all(layer.l2_prefetch is None for layer in layers)
    enable_small_batch(model, 0, l2_prefetch=True)
    assert all(layer.l2_prefetch is None for layer in layers)


def test_decode_prefetches_once_per_layer_before_attention(tiny_llm_factory: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    prompts, params = [[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_tokens=4, temperature=0.0)
    llm = tiny_llm_factory(small_batch_kernels="on", cuda_graphs=False, max_num_seqs=1)
    expected = [out.token_ids for out in llm.generate(prompts, params)]
    model = llm.engine.runner.model
    layers = list(model.model.layers)
    enable_small_batch(model, 1, l2_prefetch=True)
    events: list[tuple[str, Any]] = []
    rope_store = llama.Attention.rope_store

    def record_rope(self: Any, qkv: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        events.append(("rope", qkv.shape[0]))
        return rope_store(self, qkv, *args, **kwargs)

    def record_prefetch(plan: l2.PrefetchPlan, device: torch.device, pdl: bool = False) -> None:
        events.append(("prefetch", plan))

    monkeypatch.setattr(llama.Attention, "rope_store", record_rope)
    monkeypatch.setattr(small_batch, "l2_prefetch", record_prefetch)
    assert [out.token_ids for out in llm.generate(prompts, params)] == expected
    decode_ropes = sum(1 for kind, n in events if kind == "rope" and n == 1)
    prefetches = [plan for kind, plan in events if kind == "prefetch"]
    assert decode_ropes == 2 * 3 * len(layers)  # 2 requests, 3 decode steps each (one row: max_num_seqs=1)
    assert prefetches == [layer.l2_prefetch for layer in layers] * (2 * 3)
    for i, (kind, value) in enumerate(events):  # each prefetch right after a one-token rope
        if kind == "prefetch":
            assert events[i - 1] == ("rope", 1)
