"""Recurrent layer kinds of hybrid models, and what each needs of the per-slot state owner.

A hybrid model (Jamba's Mamba layers, Qwen3.5 / Qwen3-Next's Gated DeltaNet layers) declares its recurrent state
as `RecurrentStateSpec`s: per layer kind, how many layers and the per-slot shape and dtype of each state tensor.
`HybridRecurrentModelState` (model_states) allocates one slab `[layers, slots, *shape]` per tensor, resets,
restores, snapshots and rolls them back without knowing what they mean, and builds each layer's view of them with
the kind's `layer_state` factory registered here. A new recurrent layer kind is a `register_recurrent_kind` call
next to its layer module, and a model that declares its specs: nothing in the runner or the state owner changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from framework.layers.kernels.state_snapshots import SnapshotTargets


class StateTensor(NamedTuple):
    """One per-slot state tensor of a recurrent layer."""

    shape: tuple[int, ...]  # per slot
    dtype: Optional[torch.dtype]  # None: the model's dtype


class RecurrentStateSpec(NamedTuple):
    """The state of every layer of one recurrent kind in a model."""

    kind: str  # a registered `RecurrentKind` name
    num_layers: int
    tensors: tuple[StateTensor, ...]


class RecurrentStepInputs(NamedTuple):
    """What every layer of one recurrent kind needs about this step, built by the state owner's `prepare_inputs`."""

    layers: list[Any]  # one per layer of the kind, in layer order (the kind's `layer_state` objects)
    idx_mapping: torch.Tensor  # [R] int32: batch_row -> req_slot
    query_start_loc: torch.Tensor  # [R+1] int32: first token of each row
    pure_decode: bool  # every row computes exactly one token (host-known) and no snapshot: the one-step update
    snapshots: Optional[SnapshotTargets] = None  # states to store into the layers' snapshot pools this step


# (per-slot views [S, *shape] of each tensor, this step's tail views [R, K+1, *shape] or None,
#  snapshot-pool views [P, *shape] or None) -> the object a layer of the kind receives
LayerStateFactory = Callable[
    [Sequence[torch.Tensor], Optional[Sequence[torch.Tensor]], Optional[Sequence[torch.Tensor]]], Any
]


def slab_layer_state(state_type: Callable[..., Any]) -> LayerStateFactory:
    """The factory for a layer state whose fields are one view per state tensor, then one tail per tensor, then
    one snapshot pool per tensor (absent tails and pools as None): the layout of Mamba's and Gated DeltaNet's."""

    def build(
        slots: Sequence[torch.Tensor], tails: Optional[Sequence[torch.Tensor]], pools: Optional[Sequence[torch.Tensor]]
    ) -> Any:
        none = (None,) * len(slots)
        return state_type(*slots, *(tails or none), *(pools or none))

    return build


@dataclass(frozen=True)
class RecurrentKind:
    """A recurrent layer kind: the forward keyword its step inputs go to, and how a layer's state view is built."""

    name: str
    forward_arg: str  # the model's forward receives this kind's `RecurrentStepInputs` under this keyword
    layer_state: LayerStateFactory


RECURRENT_KINDS: dict[str, RecurrentKind] = {}


def register_recurrent_kind(kind: RecurrentKind) -> None:
    """Make a recurrent layer kind known to the hybrid state owner (re-registering the same name replaces it)."""
    RECURRENT_KINDS[kind.name] = kind


def recurrent_kind(name: str) -> RecurrentKind:
    """The registered kind `name`; an unknown one raises `KeyError` naming the registered ones."""
    if name not in RECURRENT_KINDS:
        raise KeyError(f"unknown recurrent layer kind {name!r}; registered: {', '.join(sorted(RECURRENT_KINDS))}")
    return RECURRENT_KINDS[name]
