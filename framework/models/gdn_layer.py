"""A Gated DeltaNet mixer (Qwen3-Next, Qwen3.5) over a varlen batch whose recurrent state lives in request slots.

Per layer and request slot the state is the causal conv's last `kernel - 1` inputs (`[conv_dim, kernel-1]`, model
dtype) and one `[Dk, Dv]` float32 matrix per value head. `HybridRecurrentModelState` owns them (kind
`gated_deltanet`, forward input `gdn`); a layer receives, per step, its views (`GDNLayerState`) and the batch's
row-to-slot mapping (`RecurrentStepInputs`). Parameter names follow HF: Qwen3-Next's fused `in_proj_qkvz` /
`in_proj_ba` (grouped per key head) or Qwen3.5's separate `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.

Tensor parallelism splits the heads: each rank holds `num_k_heads / tp` key heads and the value heads that read
them (value head h reads key head `h // (num_v_heads / num_k_heads)`, so a rank's value heads are consecutive).
The fused projections are grouped per key head, so a contiguous block of their rows is a rank's heads; Qwen3.5's
`in_proj_qkv` and the conv over it are q, k, v sections, each split (`ColumnParallelLinear`'s `sections`). z, b, a,
`A_log` and `dt_bias` split by value head; the gated norm's weight is per head dim and stays whole; `out_proj` is
row-parallel (its all-reduce sums the ranks' heads). The per-slot state of a rank holds its heads only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import nn
from torch.nn import functional as F

from framework.layers.kernels.causal_conv1d import causal_conv1d_varlen
from framework.layers.kernels.gated_delta_rule import DeltaRuleInputs, gated_delta_rule_varlen
from framework.layers.kernels.gated_rms_norm import gated_rms_norm
from framework.layers.parallel.context import ParallelContext
from framework.layers.parallel.linear import (
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    _divide,
    shard_parameters,
)
from framework.models.recurrent import (
    RecurrentKind,
    RecurrentStateSpec,
    RecurrentStepInputs,
    StateTensor,
    register_recurrent_kind,
    slab_layer_state,
)


@dataclass(frozen=True)
class GDNGeometry:
    """The linear-attention geometry of a config (`linear_*` keys)."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float
    fused_projections: bool  # Qwen3-Next's in_proj_qkvz / in_proj_ba

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def per_rank(self, tp: int) -> "GDNGeometry":
        """The heads one of `tp` tensor-parallel ranks holds (`ValueError` when the key heads do not divide)."""
        k_heads = _divide(self.num_k_heads, tp, "linear_num_key_heads")
        return dataclasses.replace(self, num_k_heads=k_heads, num_v_heads=self.num_v_heads // tp)

    def state_spec(self, num_layers: int) -> RecurrentStateSpec:
        """Per slot: conv state [conv_dim, kernel-1] (model dtype), recurrent state [H, Dk, Dv] float32."""
        return RecurrentStateSpec(
            "gated_deltanet",
            num_layers,
            (
                StateTensor((self.conv_dim, self.conv_kernel - 1), None),
                StateTensor((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32),
            ),
        )


class GDNLayerState(NamedTuple):
    """One Gated DeltaNet layer's views of the per-slot state tables (and, with drafts, this step's tails)."""

    conv: torch.Tensor  # [S, conv_dim, kernel-1] model dtype, by req_slot
    recurrent: torch.Tensor  # [S, H, Dk, Dv] float32, by req_slot
    conv_tail: Optional[torch.Tensor]  # [R, K+1, conv_dim, kernel-1]
    recurrent_tail: Optional[torch.Tensor]  # [R, K+1, H, Dk, Dv]
    conv_snapshots: Optional[torch.Tensor] = None  # [P, conv_dim, kernel-1] by snapshot slot
    recurrent_snapshots: Optional[torch.Tensor] = None  # [P, H, Dk, Dv]


register_recurrent_kind(RecurrentKind("gated_deltanet", "gdn", slab_layer_state(GDNLayerState)))


class GatedDeltaNet(nn.Module):
    """projections -> causal conv (+silu) over q,k,v -> gated delta rule -> gated RMSNorm (z) -> out_proj."""

    def __init__(self, geo: GDNGeometry, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.geo = geo.per_rank(ctx.tp_size)  # this rank's heads; the layers below take the whole geometry
        key_dim, value_dim, hidden = geo.key_dim, geo.value_dim, geo.hidden_size
        if geo.fused_projections:  # rows grouped per key head: a contiguous block is a rank's heads
            self.in_proj_qkvz = ColumnParallelLinear(hidden, 2 * key_dim + 2 * value_dim, False, ctx)
            self.in_proj_ba = ColumnParallelLinear(hidden, 2 * geo.num_v_heads, False, ctx)
        else:
            self.in_proj_qkv = ColumnParallelLinear(hidden, geo.conv_dim, False, ctx, (key_dim, key_dim, value_dim))
            self.in_proj_z = ColumnParallelLinear(hidden, value_dim, False, ctx)
            self.in_proj_b = ColumnParallelLinear(hidden, geo.num_v_heads, False, ctx)
            self.in_proj_a = ColumnParallelLinear(hidden, geo.num_v_heads, False, ctx)
        conv_dim = self.geo.conv_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, geo.conv_kernel, groups=conv_dim, bias=False)
        shard_parameters(self.conv1d, ctx, {"weight": 0}, (key_dim, key_dim, value_dim))  # q, k, v channels
        self.dt_bias = nn.Parameter(torch.ones(self.geo.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.geo.num_v_heads))
        shard_parameters(self, ctx, {"dt_bias": 0, "A_log": 0})
        self.norm = GatedNormWeight(geo.head_v_dim)
        self.out_proj = RowParallelLinear(value_dim, hidden, False, ctx)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(qkv [T, conv_dim] in conv channel order, z [T, H, Dv], b [T, H], a [T, H])."""
        geo, t = self.geo, x.shape[0]
        if not geo.fused_projections:
            z = self.in_proj_z(x).view(t, geo.num_v_heads, geo.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        # Qwen3-Next groups the outputs per key head: [q, k, v of its value heads, z of its value heads].
        r = geo.num_v_heads // geo.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(t, geo.num_k_heads, -1)
        q, k, v, z = torch.split(qkvz, [geo.head_k_dim, geo.head_k_dim, r * geo.head_v_dim, r * geo.head_v_dim], -1)
        b, a = torch.split(self.in_proj_ba(x).view(t, geo.num_k_heads, 2 * r), [r, r], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        z = z.reshape(t, geo.num_v_heads, geo.head_v_dim)
        return qkv, z, b.reshape(t, geo.num_v_heads), a.reshape(t, geo.num_v_heads)

    def forward(self, hidden: torch.Tensor, state: GDNLayerState, step: RecurrentStepInputs) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; the slots' conv and recurrent state advance by each row's tokens."""
        geo, t = self.geo, hidden.shape[0]
        qkv, z, b, a = self._project(hidden)
        qkv = causal_conv1d_varlen(
            qkv.contiguous(),
            self.conv1d.weight[:, 0, :],
            None,
            state.conv,
            step.idx_mapping,
            step.query_start_loc,
            state.conv_tail,
            step.snapshots,
            state.conv_snapshots,
        )
        q, k, v = torch.split(qkv, [geo.key_dim, geo.key_dim, geo.value_dim], dim=-1)
        inputs = DeltaRuleInputs(
            q=q.reshape(t, geo.num_k_heads, geo.head_k_dim),
            k=k.reshape(t, geo.num_k_heads, geo.head_k_dim),
            v=v.reshape(t, geo.num_v_heads, geo.head_v_dim),
            g=-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float()),
            beta=torch.sigmoid(b).float(),
        )
        out = gated_delta_rule_varlen(
            inputs,
            state.recurrent,
            step.idx_mapping,
            step.query_start_loc,
            state.recurrent_tail,
            step.snapshots,
            state.recurrent_snapshots,
            pure_decode=step.pure_decode,
        )
        out = gated_rms_norm(out.reshape(-1, geo.head_v_dim), z.reshape(-1, geo.head_v_dim), self.norm.weight, geo.eps)
        return self.out_proj(out.view(t, -1))


class GatedNormWeight(nn.Module):
    """The gated RMSNorm's weight (`linear_attn.norm.weight`); the norm itself is `gated_rms_norm`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
