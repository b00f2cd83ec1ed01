"""Merging projections that read the same input into one GEMM (q/k/v, gate/up) without copying the weights twice."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def merge_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight, bias) stacking the output rows of `linears`; their parameters become views into them, so the
    merge costs no memory and the loaded values stay where the names point."""
    weight = torch.cat([lin.weight.data for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = torch.cat([b.data for b in biases]) if all(b is not None for b in biases) else None  # type: ignore[union-attr]
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = weight[start : start + rows]
        if bias is not None:
            lin.bias.data = bias[start : start + rows]  # type: ignore[union-attr]
        start += rows
    return weight, bias
