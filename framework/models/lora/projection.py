"""LoRA on the decoder's projections: the adapter slots of one projection group, and attaching them to a model.

A group is one base GEMM: merged q/k/v, o, merged gate/up, or down. Its adapters are stacked over the
`lora.max_loras` GPU slots: one A for the whole group `[L, parts * R, in]` (one shrink) and the parts' B stacked
along the output `[L, sum out, R]` (one expand, each part's columns reading its own R columns of the shrink). A
rank below `R` is zero-padded, a part an adapter does not target is zero, so every slot has the same shapes and a
CUDA graph reads fixed addresses.

Every group of a model reads one `[max_tokens]` int32 buffer, `LoraTokens.token_lora`: the adapter slot of each
token of the step (-1: none). The runner's `LoraState` writes it before the forward (graph replay or eager).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from framework.layers.kernels.lora import LoraPartLayout, lora_expand, lora_shrink
from framework.models.lora.adapter import ATTENTION_PARTS, MLP_PARTS, LoraAdapter, LoraTargets, ProjectionShape


class LoraTokens:
    """The step's token -> adapter slot map every group reads: `token_lora [max_tokens]` int32, -1 = no adapter
    (also every entry past the step's tokens, which CUDA graphs' padding rows read)."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.token_lora = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)


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
