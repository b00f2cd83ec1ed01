"""LoRA on the decoder's projections: the adapter slots of one projection group, and attaching them to a model.

A group is one base GEMM: merged q/k/v, o, merged gate/up, or down. Its adapters are stacked over the
`lora.max_loras` GPU slots: one A for the whole group `[L, parts * R, in]` (one shrink) and the parts' B stacked
along the output `[L, sum out, R]` (one expand, each part's columns reading its own R columns of the shrink). A
rank below `R` is zero-padded, a part an adapter does not target is zero, so every slot has the same shapes and a
CUDA graph reads fixed addresses.

Every group of a model reads one `[max_tokens]` int32 buffer, `LoraTokens.token_lora`: the adapter slot of each
token of the step (-1: none), and the same tokens grouped by slot (`sorted_rows`, `slot_bounds`) for the fused
launch (`framework.layers.kernels.lora_fused`, taken up to `FUSED_MAX_TOKENS` tokens; 0 by default: off). The
runner's `LoraState` writes both before the forward (graph replay or eager), in one host-to-device copy.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import nn

from framework.layers.kernels import lora_fused
from framework.layers.kernels.lora import LoraPartLayout, lora_expand, lora_shrink
from framework.layers.kernels.lora_fused import lora_segments, lora_shrink_expand
from framework.models.lora.adapter import ATTENTION_PARTS, MLP_PARTS, LoraAdapter, LoraTargets, ProjectionShape


def _round4(n: int) -> int:
    return -(-n // 4) * 4  # int32 views start 16 bytes apart (Triton specialises pointers on 16-byte alignment)


class LoraTokens:
    """The step's token -> adapter slot map every group reads: `token_lora [max_tokens]` int32, -1 = no adapter
    (also every entry past the step's tokens, which CUDA graphs' padding rows read), and its tokens grouped by
    slot (`lora_fused.lora_segments`): `sorted_rows` (token rows) and `slot_bounds [max_loras + 1]` (positions in
    `sorted_rows`). All are views of one int32 `buffer` laid out `[sorted rows | slot bounds | token map]`, a step's
    sorted rows packed against the end of their region, so one copy of a contiguous range writes a whole step."""

    def __init__(self, max_tokens: int, max_loras: int, device: torch.device) -> None:
        self.num_slots = max_loras
        self.rows_end = _round4(max_tokens)  # sorted rows: buffer[rows_end - A : rows_end] for A adapter tokens
        self.map_start = self.rows_end + _round4(max_loras + 1)
        self.buffer = torch.full((self.map_start + max_tokens,), -1, dtype=torch.int32, device=device)
        self.sorted_rows = self.buffer[: self.rows_end]
        self.slot_bounds = self.buffer[self.rows_end : self.rows_end + max_loras + 1]
        self.slot_bounds.fill_(self.rows_end)  # every slot's segment empty
        self.token_lora = self.buffer[self.map_start :]

    def stage(self, host: np.ndarray, per_token: np.ndarray, count: int) -> tuple[int, int]:
        """Lay a step out in `host` (int32, `buffer`'s size and layout): the token map `per_token` ([T] slots),
        -1 up to `count` (>= T: rows an earlier step wrote), and its sorted layout; returns the range
        `[start, stop)` of `buffer` to copy from `host`. Only forwards of up to `FUSED_MAX_TOKENS` tokens read the
        layout: a larger step sends it empty (no sort on the host; never an older step's segments)."""
        if len(per_token) <= lora_fused.FUSED_MAX_TOKENS:
            rows, bounds = lora_segments(per_token, self.num_slots)
        else:
            rows, bounds = per_token[:0], np.zeros(self.num_slots + 1, dtype=np.int32)
        start = self.rows_end - len(rows)
        host[start : self.rows_end] = rows
        host[self.rows_end : self.rows_end + len(bounds)] = bounds + start
        first = self.map_start
        host[first : first + len(per_token)] = per_token
        host[first + len(per_token) : first + count] = -1
        return start, first + count


class LoraGroup:
    """Adapter slots of one projection group: `add(x, out)` adds each token's update to `out` in place."""

    def __init__(
        self,
        layer: int,
        parts: tuple[str, ...],
        shapes: list[ProjectionShape],
        max_loras: int,
        max_rank: int,
        tokens: LoraTokens,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layer, self.parts, self.rank, self.tokens = layer, parts, max_rank, tokens
        in_features = shapes[0].in_features
        self.lora_a = torch.zeros(max_loras, len(parts) * max_rank, in_features, dtype=dtype, device=device)
        self.offsets = [sum(s.out_features for s in shapes[:i]) for i in range(len(shapes) + 1)]
        # part i's B is lora_b[:, offsets[i]:offsets[i + 1]]: one expand launch for the whole group
        self.lora_b = torch.zeros(max_loras, self.offsets[-1], max_rank, dtype=dtype, device=device)
        self.layout = LoraPartLayout(self.offsets, device) if len(parts) > 1 else None
        self.kernel_backend = "auto"

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out[t, part columns] += x[t] @ A_part^T @ B_part^T of token t's adapter; x [T, in], out [T, sum out]."""
        token_lora = self.tokens.token_lora[: x.shape[0]]
        if 0 < x.shape[0] <= lora_fused.FUSED_MAX_TOKENS:  # one launch over the step's tokens grouped by adapter
            rows, bounds = self.tokens.sorted_rows, self.tokens.slot_bounds
            lora_shrink_expand(out, x, self.lora_a, self.lora_b, token_lora, rows, bounds, self.kernel_backend,
                               self.layout)  # fmt: skip
            return out
        xa = lora_shrink(x, self.lora_a, token_lora, self.kernel_backend)  # [T, parts * R] float32
        lora_expand(out, xa, self.lora_b, token_lora, self.kernel_backend, parts=self.layout)
        return out

    def load(self, slot: int, adapter: Optional[LoraAdapter]) -> None:
        """Write `adapter`'s weights of this group into GPU slot `slot` (zeros where it has none; None clears)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        for i, part in enumerate(self.parts):
            weights = adapter.weights.get((self.layer, part)) if adapter is not None else None
            if weights is None:
                continue
            a, b = weights
            rank = a.shape[0]
            self.lora_a[slot, i * self.rank : i * self.rank + rank].copy_(a)
            self.lora_b[slot, self.offsets[i] : self.offsets[i + 1], :rank].copy_(b)


GROUPS = {"lora_qkv": ("q_proj", "k_proj", "v_proj"), "lora_o": ("o_proj",)}
MLP_GROUPS = {"lora_gate_up": ("gate_proj", "up_proj"), "lora_down": ("down_proj",)}


def _dense_mlp(layer: nn.Module) -> Optional[nn.Module]:
    mlp = getattr(layer, "mlp", None)
    return mlp if mlp is not None and all(hasattr(mlp, p) for p in MLP_PARTS) else None


def lora_targets(model: nn.Module) -> LoraTargets:
    """The projections of `model`'s decoder layers an adapter may update, with their shapes; MoE layers' MLPs
    (experts) are listed apart, to be refused by name."""
    shapes: dict[tuple[int, str], ProjectionShape] = {}
    moe: set[int] = set()
    for i, layer in enumerate(model.model.layers):  # type: ignore[union-attr]
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            continue
        modules = [(p, getattr(attn, p)) for p in ATTENTION_PARTS]
        mlp = _dense_mlp(layer)
        if mlp is not None:
            modules += [(p, getattr(mlp, p)) for p in MLP_PARTS]
        elif getattr(layer, "mlp", None) is not None:
            moe.add(i)
        for part, linear in modules:
            shapes[(i, part)] = ProjectionShape(int(linear.in_features), int(linear.out_features))
    return LoraTargets(shapes, frozenset(moe))


def attach_lora(
    model: nn.Module, max_loras: int, max_rank: int, tokens: LoraTokens, dtype: torch.dtype, device: torch.device
) -> list[LoraGroup]:
    """Give every attention (`lora_qkv`, `lora_o`) and dense MLP (`lora_gate_up`, `lora_down`) of `model` its
    adapter slots; returns them all (the slot manager loads adapters into them)."""
    targets = lora_targets(model)
    groups: list[LoraGroup] = []
    for i, layer in enumerate(model.model.layers):  # type: ignore[union-attr]
        owners = [(getattr(layer, "self_attn", None), GROUPS), (_dense_mlp(layer), MLP_GROUPS)]
        for owner, kinds in owners:
            if owner is None or (i, next(iter(kinds.values()))[0]) not in targets.shapes:
                continue
            for attr, parts in kinds.items():
                shapes = [targets.shapes[(i, p)] for p in parts]
                group = LoraGroup(i, parts, shapes, max_loras, max_rank, tokens, dtype, device)
                group.kernel_backend = getattr(owner, "kernel_backend", "auto")
                setattr(owner, attr, group)
                groups.append(group)
    return groups
