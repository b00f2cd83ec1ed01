"""Compile the decode step's PDL kernels for sm_90 without a GPU and read their PTX: where `griddepcontrol` is.

Uses `compile_check.py`'s stand-in driver (real NVIDIA backend, launches do nothing). Each wrapper runs
once with `pdl=False` and once with `pdl=True` (GEMV: qkv-style add + norm, a K longer than its first tile, the
SiLU gate/up; q/k norm + RoPE + store; split-KV attention and its reduce; RMSNorm); for every compiled variant it
reports USE_PDL, the `launch_pdl` option, how many `griddepcontrol.wait` / `.launch_dependents` the PTX holds, and
how many `ld.global` come before the first wait (in the GEMV: its weight tile). One JSON line per variant.

    python3 tests/gpu/pdl_ptx_check.py [--geometry small|0.6b] [--dump DIR]

`--geometry 0.6b`: the GEMV at the Qwen3-0.6B shapes (qkv, o_proj, gate_up, down, LM head; slower to compile).
tests/layers/test_pdl.py runs the small one in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
runpy.run_path(str(REPO / "tests" / "gpu" / "compile_check.py"), run_name="compile_check")  # the fake driver

import torch  # noqa: E402

from framework.layers.attention.metadata import AttentionMetadata  # noqa: E402
from framework.layers.attention.triton_paged_attention import (  # noqa: E402
    _paged_attention_kernel,
    _split_kv_reduce_kernel,
    paged_attention,
)
from framework.layers.kernels.triton_gemv import _gemv_kernel, gemv_triton  # noqa: E402
from framework.layers.kernels.triton_norm_silu import _rms_norm_kernel, rms_norm_triton  # noqa: E402
from framework.layers.kernels.triton_qk_norm_rope import _qk_norm_rope_store_kernel, qk_norm_rope_store_triton  # noqa: E402

KERNELS = {
    "gemv": _gemv_kernel,
    "qk_norm_rope_store": _qk_norm_rope_store_kernel,
    "paged_attention": _paged_attention_kernel,
    "split_kv_reduce": _split_kv_reduce_kernel,
    "rms_norm": _rms_norm_kernel,
}
DT = torch.bfloat16
GEMV_SHAPES = {  # name: (N, K, silu_mul, norm + residual, float32 out)
    "small": {
        "qkv": (64, 256, False, True, False),
        "long_k": (32, 4096, False, False, False),
        "gate_up": (32, 256, True, True, False),
    },
    "0.6b": {
        "qkv": (4096, 1024, False, True, False),
        "o_proj": (1024, 2048, False, False, False),
        "gate_up": (3072, 1024, True, True, False),
        "down": (1024, 3072, False, False, False),
        "lm_head": (151936, 1024, False, False, True),
    },
}


def launch_all(geometry: str, pdl: bool) -> None:
    """Each PDL kernel's wrapper once (CPU tensors: the stand-in driver launches nothing)."""
    for n, k, silu, norm, fp32 in GEMV_SHAPES[geometry].values():
        x, w = torch.zeros(1, k, dtype=DT), torch.zeros(2 * n if silu else n, k, dtype=DT)
        g = torch.ones(k, dtype=DT) if norm else None
        gemv_triton(
            x,
            w,
            norm_weight=g,
            eps=1e-6,
            residual=torch.zeros_like(x) if norm else None,
            silu_mul=silu,
            out_dtype=torch.float32 if fp32 else None,
            pdl=pdl,
        )
    heads, kv_heads, dim, page = 16, 8, 128, 16
    qkv = torch.zeros(1, (heads + 2 * kv_heads) * dim, dtype=DT)
    cache = torch.zeros(2, 8, page, kv_heads, dim, dtype=DT)
    cos = torch.ones(1, dim, dtype=DT)
    q = qk_norm_rope_store_triton(
        qkv, cos, cos, cos[0], cos[0], 1e-6, heads, kv_heads, dim, cache, torch.zeros(1, dtype=torch.int64), pdl=pdl
    )
    meta = AttentionMetadata(
        num_tokens=1,
        num_rows=1,
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([100], dtype=torch.int32),
        block_tables=torch.zeros(1, 8, dtype=torch.int32),
        kv_slot_mapping=torch.zeros(1, dtype=torch.int64),
        block_size=page,
        max_query_len=1,
        max_seq_len=100,
    )
    paged_attention(q, cache, meta, dim**-0.5, num_splits=4, pdl=pdl)  # splits merged in the kernel
    paged_attention(q, cache, meta, dim**-0.5, num_splits=4, pdl=pdl, fused_reduce=False)  # + the reduce
    rms_norm_triton(
        torch.zeros(1, 1024, dtype=DT), torch.ones(1024, dtype=DT), 1e-6, torch.zeros(1, 1024, dtype=DT), pdl=pdl
    )


def ptx_report(name: str, compiled) -> dict:  # type: ignore[no-untyped-def]
    """What the PTX of one compiled variant says about PDL (see the module docstring)."""
    ptx: str = compiled.asm["ptx"]
    lines = ptx.splitlines()
    wait_at = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), len(lines))
    arg_names = KERNELS[name].arg_names
    constants = {
        arg_names[key[0]] if isinstance(key, tuple) else str(key): value
        for key, value in compiled.src.constants.items()
    }
    return {
        "kernel": name,
        "use_pdl": bool(constants.get("USE_PDL", False)),
        "launch_pdl": bool(getattr(compiled.metadata, "launch_pdl", False)),
        "griddepcontrol_wait": ptx.count("griddepcontrol.wait"),
        "griddepcontrol_launch_dependents": ptx.count("griddepcontrol.launch_dependents"),
        "ld_global_before_wait": sum(bool(re.search(r"\bld\.global", line)) for line in lines[:wait_at]),
        "ld_global": sum(bool(re.search(r"\bld\.global", line)) for line in lines),
        "shape": {k: constants[k] for k in ("N", "K", "PRE_K", "BLOCK_K", "SILU_MUL") if k in constants},
    }


def compiled_kernels():  # type: ignore[no-untyped-def]
    """(name, CompiledKernel) of every variant compiled so far."""
    for name, fn in KERNELS.items():
        for cache in fn.device_caches.values():
            for compiled in cache[0].values():
                yield name, compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", choices=sorted(GEMV_SHAPES), default="small")
    parser.add_argument("--dump", type=Path, help="write each variant's PTX here")
    args = parser.parse_args()
    assert os.environ.get("TRITON_INTERPRET") == "0"
    for pdl in (False, True):
        launch_all(args.geometry, pdl)
    for i, (name, compiled) in enumerate(compiled_kernels()):
        report = ptx_report(name, compiled)
        print(json.dumps(report), flush=True)
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{i:02d}_{name}_pdl{int(report['launch_pdl'])}.ptx").write_text(compiled.asm["ptx"])


if __name__ == "__main__":
    main()
