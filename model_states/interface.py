"""The ModelState boundary: per-architecture state and hooks, kept out of the common runner path."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch
from torch import nn

from framework.batch.graph_batch import GraphBatch
from framework.params.prefix_cache import PrefixCacheHooks

if TYPE_CHECKING:
    from framework.batch.block_tables import BlockTables
    from framework.batch.input_batch import InputBatch
    from framework.config.schema import CacheConfig
    from framework.layers.attention import AttentionMetadata
    from framework.params.scheduler_output import NewRequestData, StateSnapshot


class ModelState(ABC):
    """Architecture-specific state owned per req_slot, with the runner's hook points.

    Verbs (the same as every other per-slot owner): `add_request` when a request takes a slot,
    `remove_request` when it leaves, `apply_staged_writes` once per step before inputs are prepared.
    Step hooks: `prepare_attn_metadata` and `prepare_inputs` before the forward, `postprocess` after
    sampling (with how many tokens each row sampled and rejected, so recurrent state can advance by the
    accepted count). A reused slot must keep nothing of its previous owner.

    Both runners call the hooks the same way: `req_slot` is a stable slot for the request's life, and
    `batch.idx_mapping` maps batch rows to those slots. (V1's persistent-batch rows move, so V1 hands out
    these slots from a free list of its own and carries each request's slot along with its row.)
    """

    name: ClassVar[str] = "base"
    # False for a state only the V1 runner may drive because its hooks rely on V1's synchronous step: V1
    # has step N's sampled tokens on the host before `postprocess` of step N and before any hook of step
    # N+1, so such a state may read them there (`num_sampled.tolist()`). V2 promises the opposite: no host
    # sync in the step, and step N+1 prepared while step N still runs. With False, `runner=auto` picks V1
    # and `runner=v2` fails validation naming the state.
    supports_v2: ClassVar[bool] = True
    # True when the state is correct for a request that starts with cached KV blocks (`num_computed_tokens` > 0
    # at `add_request`, the cached prefix never run through the model). False by default: per-slot state built
    # from the prompt (recurrent state, encoder outputs) would miss the cached part, unless the state keeps
    # snapshots of it for cached blocks (`init_prefix_cache`). See docs/prefix-caching.md.
    supports_prefix_caching: ClassVar[bool] = False
    # False: decode never replays a CUDA graph with this state (the runner logs `cuda_graph_unsupported_reason`).
    # A state with extra forward inputs opts in by implementing `prepare_graph_inputs` (see its docstring).
    decode_cuda_graphs: ClassVar[bool] = True
    # True: a pure-decode step may run as one full-step graph (`framework.runner.graphs.step_graphs`,
    # runner.full_step_cuda_graphs),
    # which builds the default paged self-attention metadata itself and calls none of the step hooks. Only a state
    # whose step hooks do nothing in a decode step sets it; a subclass that overrides one of them is out again
    # (`full_step_unsupported_reason`) unless it declares the flag itself.
    full_step_graphs: ClassVar[bool] = False
    _STEP_HOOKS: ClassVar[tuple[str, ...]] = (
        "prepare_attn_metadata",
        "prepare_inputs",
        "postprocess",
        "prepare_graph_inputs",
        "prepare_graph_step",
        "save_snapshots",
    )

    def __init__(self, model: nn.Module, hf_config: dict[str, Any], max_num_reqs: int, device: torch.device) -> None:
        self.model = model
        self.hf_config = hf_config
        self.max_num_reqs = max_num_reqs
        self.device = device

    def init_prefix_cache(self, cache: "CacheConfig") -> PrefixCacheHooks:
        """Prefix caching is on (called once, before the KV cache is sized): allocate what the state keeps for
        cached blocks and return the hooks the KV cache manager calls. Default: nothing kept, no-op hooks."""
        return PrefixCacheHooks()

    def save_snapshots(self, snapshots: "list[StateSnapshot]") -> None:
        """This step's state snapshots (asked for by this state's prefix-cache hooks), before `prepare_inputs`."""
        if snapshots:
            raise NotImplementedError(f"model state '{self.name}' keeps no state snapshots")

    def snapshot_tensors(self) -> list[torch.Tensor]:
        """The device tensors that hold this state's snapshots, each a view indexed by snapshot slot along
        dimension 0, so that a KV tier (the host tier) can carry a snapshot with its cached block: it copies slot
        `s` of every tensor out when the block is evicted and back into a reserved slot on a hit (the slots of
        `init_prefix_cache`'s hooks). Default: none (the state keeps no snapshots)."""
        return []

    def add_request(self, req_slot: int, request: "NewRequestData") -> None:
        """A request took `req_slot`: stage whatever per-slot state it needs."""

    def remove_request(self, req_slot: int) -> None:
        """The request in `req_slot` finished or was preempted."""

    def apply_staged_writes(self) -> None:
        """Apply this step's staged per-slot writes."""

    @abstractmethod
    def prepare_attn_metadata(self, batch: "InputBatch", block_tables: "BlockTables") -> "AttentionMetadata":
        """Attention metadata for this step's forward."""

    def prepare_inputs(self, batch: "InputBatch") -> dict[str, Any]:
        """Extra keyword inputs of the model's forward (encoder features, recurrent state views, ...)."""
        return {}

    def postprocess(self, batch: "InputBatch", num_sampled: torch.Tensor, num_rejected: torch.Tensor) -> None:
        """After sampling: advance per-slot state. num_sampled / num_rejected: [R] int32 on the device."""

    # ---- decode CUDA graphs --------------------------------------------------------------------------------
    # A pure decode step (every row 1 + k tokens, all of them sampled) replays a graph captured once per
    # (padded batch size, tokens per row). Instead of `prepare_inputs`, such a step calls `prepare_graph_step`
    # eagerly, then replays; the forward inputs inside the graph come from `prepare_graph_inputs`, called
    # per graph at capture on the graph's static `GraphBatch`. Per-slot tensors the forward reads or writes
    # must be persistent (allocated once, never reallocated) and have one extra row, `graph_dummy_slot`, for
    # padding rows: nobody else reads or writes it.

    @property
    def graph_dummy_slot(self) -> int:
        """The req_slot padding rows of a graph map to: one past the last real slot."""
        return self.max_num_reqs

    def cuda_graph_unsupported_reason(self) -> Optional[str]:
        """None when decode may replay CUDA graphs with this state; otherwise why not (the runner logs it)."""
        if not self.decode_cuda_graphs:
            return f"model state '{self.name}' sets decode_cuda_graphs = False"
        cls = type(self)
        if (
            cls.prepare_inputs is not ModelState.prepare_inputs
            and cls.prepare_graph_inputs is ModelState.prepare_graph_inputs
        ):
            return (
                f"model state '{self.name}' has extra forward inputs (prepare_inputs) but no "
                "prepare_graph_inputs to build them inside a graph"
            )
        return None

    def full_step_unsupported_reason(self) -> Optional[str]:
        """None when a pure-decode step may run as one full-step graph with this state; otherwise why not."""
        cls = type(self)
        owner = next(c for c in cls.__mro__ if "full_step_graphs" in c.__dict__)  # who set the flag last
        if not owner.__dict__["full_step_graphs"]:
            return f"model state '{self.name}' does not set full_step_graphs = True"
        changed = [h for h in self._STEP_HOOKS if getattr(cls, h) is not getattr(owner, h)]
        if changed:
            return (
                f"model state '{self.name}' overrides {', '.join(changed)} of {owner.__name__}, which opted in "
                "to full-step graphs"
            )
        return self.cuda_graph_unsupported_reason()

    def prepare_graph_inputs(self, graph: GraphBatch) -> dict[str, Any]:
        """Extra keyword inputs of the forward inside a captured graph, built from `graph`'s static buffers
        and the state's persistent per-slot tensors only (called at each graph's capture and its warm-up runs).

        Device work queued here is captured and runs again at every replay; host-side logic runs once, so
        it may depend on `graph.num_rows` and `graph.tokens_per_row` but never on a step's data. Anything a
        later hook reads back (e.g. buffers the kernels fill) must be a persistent tensor the state keeps.
        """
        return {}

    def prepare_graph_step(self, batch: "InputBatch", graph_rows: int) -> None:
        """This step replays the graph of `graph_rows` padded rows instead of an eager forward: do the
        step's work that stays outside the graph (called where `prepare_inputs` would be; no host sync)."""
