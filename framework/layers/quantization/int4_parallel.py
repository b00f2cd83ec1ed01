"""Tensor parallelism of 4-bit weights: which checkpoint tensors each rank splits, and each rank's group layout.

A column-parallel layer (q/k/v, gate/up: output features N split) splits every checkpoint tensor along its N
dimension; where a format packs eight output columns into an int32 (GPTQ and AWQ `qzeros`, AWQ `qweight`), N per
rank must be a multiple of 8. GPTQ's `g_idx` (over the input columns) is read whole. Every rank then has the whole
layer's groups for its rows, as with one rank.

A row-parallel layer (o_proj, down_proj: input features K split) splits the packed weight and GPTQ's `g_idx` along
K (K per rank a multiple of 8: GPTQ's `qweight` and compressed-tensors' `weight_packed` pack eight input columns per
int32). Its group tensors (scales, zero points) are read whole, and `rank_group_layout` keeps the groups the rank's
input columns use: each column's group is `g_idx[k]` (act-order: any group of the layer) or `k // G` of the whole
layer. The rank sorts its columns by group. When every group's run of columns has the same length u, a multiple of
16 (no act-order and G dividing K per rank: u = G; a rank starting mid-group: the runs' common length), that is the
layout with group u. Otherwise (act-order) each run is padded to a multiple of u with columns whose activation is
zero, u being the unit of 16 to 128 (8 where G is not a multiple of 16) that reads the fewest bytes, and each unit
of u columns gets its group's scale and zero point.

Stacked MoE experts split their intermediate dimension I: each expert's gate/up is column-parallel, its down
row-parallel; there the group tensors are split like the weight (`GROUP_DIMS`), so G must divide I per
rank (the fused MoE kernel reads groups of G consecutive inputs).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

# layout -> checkpoint tensor -> (dim a column-parallel layer splits, dim a row-parallel one splits); None: whole
SPLIT_DIMS: dict[str, dict[str, tuple[Optional[int], Optional[int]]]] = {
    # qweight [K/8, N], qzeros [K/G, N/8], scales [K/G, N], g_idx [K]
    "gptq": {"qweight": (1, 0), "qzeros": (1, None), "scales": (1, None), "g_idx": (None, 0)},
    # qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]
    "awq": {"qweight": (1, 0), "qzeros": (1, None), "scales": (1, None)},
    # weight_packed [N, K/8], weight_scale [N, K/G], weight_shape [2]
    "ct": {"weight_packed": (0, 1), "weight_scale": (0, None), "weight_shape": (None, None)},
}
# The group tensors' group dim, which experts' down projections split with the weight (groups inside each rank's part).
GROUP_DIMS = {"qzeros": 0, "scales": 0, "weight_scale": 1}


def split_dims(layout: str, column: bool, group_split: bool = False) -> dict[str, Optional[int]]:
    """Checkpoint tensor name -> the dim tensor parallelism splits (None: every rank reads it whole); `group_split`:
    a row-parallel layer splits its group tensors along the groups too (experts) instead of reading them whole."""
    dims = {name: pair[0 if column else 1] for name, pair in SPLIT_DIMS[layout].items()}
    if group_split and not column:
        dims.update({name: dim for name, dim in GROUP_DIMS.items() if name in dims})
    return dims


def _unit(counts: list[int], group: int) -> int:
    """Columns per scale of the rank's layout: the runs' common length where the kernel can read it (no padding);
    else the unit of 16, 32, 64 or 128 (8 where G is not a multiple of 16) that reads the fewest bytes per output
    row: half a byte per padded column plus a float32 scale and zero point per unit."""
    u = math.gcd(*counts)
    base = 16 if group % 16 == 0 else 8
    if u % base == 0:
        return u
    candidates = [c for c in (16, 32, 64, 128) if c <= max(group, 16)] if base == 16 else [8]

    def cost(unit: int) -> float:
        padded = sum(-(-c // unit) * unit for c in counts)
        return padded * (0.5 + 8 / unit)

    return min(candidates, key=cost)


def rank_group_layout(
    q: torch.Tensor, col_group: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]:
    """Regroup a rank's input columns for the W4A16 kernel (module docstring).

    q uint8 [N, K] (this rank's columns), col_group long [K] (each column's group), scales / zeros float32 [N, Gt]
    (the groups `col_group` indexes), `group` the checkpoint's group size ->
    (q [N, K'], scales [N, K'/u], zeros [N, K'/u], perm [K'] or None, u): the activations are `x[:, perm]`, where
    index K stands for a zero column (padding); perm is None when the columns keep their order and K' = K.
    """
    k = q.shape[1]
    if bool((col_group < 0).any()) or bool((col_group >= scales.shape[1]).any()):
        raise ValueError(f"a column's group lies outside the {scales.shape[1]} groups of the layer")
    order = torch.argsort(col_group, stable=True)
    used, counts = torch.unique_consecutive(col_group[order], return_counts=True)
    u = _unit(counts.tolist(), group)
    padded = (counts + u - 1) // u * u
    runs = torch.split(order, counts.tolist())
    pieces = []
    for run, size in zip(runs, padded.tolist()):
        pieces.append(run)
        if size > len(run):
            pieces.append(torch.full((size - len(run),), k, dtype=order.dtype, device=order.device))
    perm = torch.cat(pieces)
    unit_group = torch.repeat_interleave(used, padded // u)
    q_padded = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[:, perm]
    in_order = perm.numel() == k and torch.equal(perm, torch.arange(k, device=perm.device))
    return q_padded, scales[:, unit_group], zeros[:, unit_group], None if in_order else perm, u


def gather_input(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """[M, K] activations -> [M, K'] in the rank layout's column order (index K: a zero column)."""
    if perm.numel() == x.shape[-1]:  # a permutation, no padding
        return x[:, perm]
    return torch.nn.functional.pad(x, (0, 1))[:, perm]


def scatter_columns(weight: torch.Tensor, perm: torch.Tensor, k: int) -> torch.Tensor:
    """[N, K'] weight in the rank layout's order -> [N, K] in the input's order (padding columns dropped)."""
    out = weight.new_zeros(weight.shape[0], k + 1)
    out[:, perm] = weight
    return out[:, :k]
