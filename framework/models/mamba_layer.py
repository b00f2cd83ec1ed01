"""A Mamba-1 mixer over a varlen batch whose recurrent state lives in request slots.

The state itself is owned by `MambaHybridModelState`; the layer receives, per step, its views of the conv
and SSM state tables and the batch's row-to-slot mapping (`MambaStepInputs`), so the same module serves
prefill chunks, decode steps and draft verification. Parameter names follow HF Jamba's `JambaMambaMixer`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import nn

from framework.layers.kernels.causal_conv1d import causal_conv1d_varlen
from framework.layers.kernels.selective_scan import (
    ScanInputs,
    ScanWeights,
    selective_scan_varlen,
    selective_state_update,
)
from framework.models.llama import RMSNorm
from framework.models.recurrent import RecurrentKind, RecurrentStepInputs, register_recurrent_kind, slab_layer_state


class MambaLayerState(NamedTuple):
    """One Mamba layer's views of the per-slot state tables (and, with drafts, this step's tail buffers)."""

    conv: torch.Tensor  # [S, d_inner, d_conv-1] model dtype, by req_slot
    ssm: torch.Tensor  # [S, d_inner, d_state] float32, by req_slot
    conv_tail: Optional[torch.Tensor]  # [R, K+1, d_inner, d_conv-1]: state after each of a row's last K+1 tokens
    ssm_tail: Optional[torch.Tensor]  # [R, K+1, d_inner, d_state]
    conv_snapshots: Optional[torch.Tensor] = None  # [P, d_inner, d_conv-1] by snapshot slot (prefix caching)
    ssm_snapshots: Optional[torch.Tensor] = None  # [P, d_inner, d_state] float32


# What every Mamba layer needs about this step (`layers`: one `MambaLayerState` per Mamba layer).
MambaStepInputs = RecurrentStepInputs


register_recurrent_kind(RecurrentKind("mamba", "mamba", slab_layer_state(MambaLayerState)))


class MambaMixer(nn.Module):
    """in_proj -> causal conv (+silu) -> x_proj -> RMS-normed dt, B, C -> selective scan -> gate -> out_proj."""

    def __init__(
        self,
        hidden_size: int,
        d_inner: int,
        d_state: int,
        d_conv: int,
        dt_rank: int,
        eps: float,
        conv_bias: bool,
        proj_bias: bool,
    ) -> None:
        super().__init__()
        self.d_inner, self.d_state, self.d_conv, self.dt_rank = d_inner, d_state, d_conv, dt_rank
        self.in_proj = nn.Linear(hidden_size, 2 * d_inner, bias=proj_bias)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, bias=conv_bias, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(d_inner, d_state))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, hidden_size, bias=proj_bias)
        self.dt_layernorm = RMSNorm(dt_rank, eps)
        self.b_layernorm = RMSNorm(d_state, eps)
        self.c_layernorm = RMSNorm(d_state, eps)

    def forward(self, hidden: torch.Tensor, state: MambaLayerState, step: MambaStepInputs) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; the slots' conv and SSM state advance by each row's tokens."""
        x, z = self.in_proj(hidden).chunk(2, dim=-1)  # [T, d_inner] each
        x = causal_conv1d_varlen(
            x.contiguous(),
            self.conv1d.weight[:, 0, :],
            self.conv1d.bias,
            state.conv,
            step.idx_mapping,
            step.query_start_loc,
            state.conv_tail,
            step.snapshots,
            state.conv_snapshots,
        )
        dt, B, C = torch.split(self.x_proj(x), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = self.dt_layernorm(dt) @ self.dt_proj.weight.t()  # bias is added inside the scan, in float32
        inputs = ScanInputs(x=x, dt=dt, B=self.b_layernorm(B), C=self.c_layernorm(C), z=z)
        weights = ScanWeights(A=-torch.exp(self.A_log.float()), D=self.D, dt_bias=self.dt_proj.bias)
        if step.pure_decode and state.ssm_tail is None:
            y = selective_state_update(inputs, weights, state.ssm, step.idx_mapping)
        else:
            y = selective_scan_varlen(
                inputs,
                weights,
                state.ssm,
                step.idx_mapping,
                step.query_start_loc,
                state.ssm_tail,
                step.snapshots,
                state.ssm_snapshots,
            )
        return self.out_proj(y)
