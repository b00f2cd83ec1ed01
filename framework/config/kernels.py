"""The `kernels:` section: which implementation the layer ops run and the launch choices of the Triton kernels.

None of these changes a result beyond float rounding order; they trade speed, and `backend: reference` is the
switch that bisects a numerical difference (docs/kernels.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from framework.config.base import StrictModel

KernelBackend = Literal["auto", "triton", "reference"]


class KernelsConfig(StrictModel):
    """Kernel selection and tuning (docs/kernels.md)."""

    backend: KernelBackend = Field(
        "auto",
        description="Implementation of attention, the KV store and the layer ops (norms, SiLU*up, q/k norm + "
        "RoPE, MoE routing and experts, small-batch GEMVs): `auto` = the Triton kernels for CUDA tensors, the "
        "PyTorch references elsewhere; `reference` forces the references (e.g. to bisect a numerical difference "
        "on a GPU); `triton` forces the kernels (on a CPU only under `TRITON_INTERPRET=1`). The loader hands it "
        "to the model, the model to its layers, the layers to each op.",
    )
    small_batch: Literal["auto", "on", "off"] = Field(
        "auto",
        description="One-token forwards (batch-1 decode, and one-row LM heads) run fused GEMV kernels (add + "
        "RMSNorm + GEMV, GEMV + SiLU*up; docs/kernels.md): `on` wherever Triton runs, `auto` on CUDA GPUs of "
        "compute capability 9.0 or newer, `off` never. On the H200 they took batch-1 decode from 650 to 859 out "
        "tok/s (docs/benchmarks.md).",
    )
    longest_rows_first: bool = Field(
        True,
        description="Decode attention of a batch of >= 64 rows starts its programs with the longest rows "
        "and ends with the shortest (one small kernel per forward; the result is the same), so that a batch of "
        "mixed lengths does not end on a few long rows (docs/kernels.md). False: batch order.",
    )
    programmatic_launch: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Programmatic dependent launch for the small-batch path's Triton kernels (GEMVs, "
        "q/k norm + RoPE, attention, the final norm): each may start while the previous one ends, loading its "
        "weights before it waits (docs/kernels.md). `auto` wherever it is supported (CUDA compute capability "
        ">= 9.0 and a Triton with `launch_pdl`; never under the interpreter), `on` the same but says why when it "
        "is not, `off` never.",
    )
