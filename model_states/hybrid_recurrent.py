"""Hybrid models: per-slot recurrent state of every recurrent layer kind beside the paged KV cache.

A hybrid model (`RecurrentHybrid`) declares, per recurrent layer kind (`framework.models.recurrent`: Mamba's conv +
SSM state, Gated DeltaNet's conv state + per-head `[Dk, Dv]` matrix, or a third party's), the per-slot shape and
dtype of each state tensor. This owner allocates one slab `[layers, slots + 1, *shape]` per tensor with the slot
tables at start-up and zeroes a slot's rows when a request takes it, so a reused slot carries nothing of its
previous owner. It never looks inside a slab: resets, snapshot copies and speculative roll-back are the same
gather-scatter for every kind; each kind's registered `layer_state` factory turns a layer's views into what its
layer module reads. The forward advances the state in place: a prefill chunk continues from the slot's state
(chunked prefill continues where the last chunk stopped), a pure decode batch takes the one-step update.

Preemption frees the KV blocks and recomputes the request from its first token; the resumed request (a new
`add_request`) starts from a zeroed slot, or from a snapshot when prefix caching serves part of it.

Prefix caching: a cached prefix never runs through the model, so its recurrent state must have been kept.
With caching on, the state owns a pool of snapshot slots (`[L, P, ...]` beside every slab) and the
scheduler-side `MambaSnapshotIndex` decides which cached block has one. The step that computes the state at
the end of a cached block stores it there, from inside the kernels (`save_snapshots`: per batch row, after
how many of its tokens, into which slot); a request whose hit ends at that block starts from a device-side
copy of it (`add_request` with `snapshot_slot`, applied in `apply_staged_writes`).

Speculative decoding: a row verifying drafts runs `1 + k` tokens, but its state must advance only by the
tokens that were accepted. When a step has drafts, `prepare_inputs` hands every layer tail buffers in which the
kernels store the state after each of a row's last `K + 1` tokens; `postprocess` copies, for every row, the one
after `query_len - num_rejected` tokens into the slot, on the device, with no host sync.

Decode CUDA graphs: inside a graph the kernels read and write the same per-slot slabs through the graph's
static `idx_mapping` (padding rows on the extra slot `graph_dummy_slot`, which no request owns). With drafts
the tails are persistent buffers kept per graph. A decode row's snapshots are all after 0 or 1 of its tokens
(drafts excluded), so they are copied outside the graph: before the replay from the slot (0 tokens), after it
from the slot or the first tail (1 token, in `postprocess`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from framework.batch.graph_batch import GraphBatch
from framework.layers.kernels.state_snapshots import SnapshotTargets, build_snapshot_targets
from framework.models.interface import RecurrentHybrid
from framework.models.recurrent import RecurrentStepInputs, recurrent_kind
from framework.params.prefix_cache import PrefixCacheHooks
from model_states.default import DefaultModelState
from model_states.mamba_snapshots import MambaSnapshotIndex

if TYPE_CHECKING:
    from framework.batch.input_batch import InputBatch
    from framework.config.schema import CacheConfig
    from framework.params.scheduler_output import NewRequestData, StateSnapshot

Slabs = list[torch.Tensor]  # one per state tensor of every kind, in spec order; each [L_kind, n, ...]


class HybridRecurrentModelState(DefaultModelState):
    """Paged attention metadata (as the default state) plus per-slot state for every recurrent layer kind."""

    name = "hybrid_recurrent"
    supports_prefix_caching = True  # with snapshots of the state at cached block boundaries

    def __init__(self, model: nn.Module, hf_config: dict[str, Any], max_num_reqs: int, device: torch.device) -> None:
        super().__init__(model, hf_config, max_num_reqs, device)
        if not isinstance(model, RecurrentHybrid):
            raise TypeError(
                f"model state {self.name!r} needs a RecurrentHybrid model (recurrent_state_specs()); "
                f"{type(model).__name__} is none"
            )
        model_dtype = next(model.parameters()).dtype
        self.specs = model.recurrent_state_specs()
        self.kinds = [recurrent_kind(spec.kind) for spec in self.specs]
        # Slab k of spec s: [L_s, S+1, *shape]; the last slot is the dummy that padding rows of decode graphs write.
        self.slabs: Slabs = []
        self._spec_slabs: list[range] = []  # spec -> its slabs' positions in `self.slabs`
        for spec in self.specs:
            first = len(self.slabs)
            for tensor in spec.tensors:
                dtype = tensor.dtype or model_dtype
                self.slabs.append(
                    torch.zeros(spec.num_layers, max_num_reqs + 1, *tensor.shape, dtype=dtype, device=device)
                )
            self._spec_slabs.append(range(first, len(self.slabs)))
        # req_slot -> snapshot slot to start from (None: zeros), for every slot a request took since the last step
        self._starts: dict[int, Optional[int]] = {}
        self._tails: Optional[Slabs] = None  # this step's [L, R, K+1, ...] per slab, when it has drafts
        self.snapshot_pools: Optional[Slabs] = None  # [L, P, ...] per slab by snapshot slot, once caching is on
        self._snapshots: list["StateSnapshot"] = []  # this step's, from the scheduler
        # Decode graphs: (rows, tokens per row) -> that graph's tail views [L, rows, q, ...] of `_tail_storage`
        self._graph_tails: dict[tuple[int, int], Slabs] = {}
        self._tail_storage: Optional[Slabs] = None
        self._snapshots_after: list["StateSnapshot"] = []  # a replayed step's, after its first token

    def _like(self, slab: torch.Tensor, *lead: int) -> torch.Tensor:
        """An uninitialised [L, *lead, *per-slot shape] buffer of the slab's dtype."""
        return torch.empty(slab.shape[0], *lead, *slab.shape[2:], dtype=slab.dtype, device=self.device)

    def init_prefix_cache(self, cache: "CacheConfig") -> PrefixCacheHooks:
        """Allocate the snapshot pool (`cache.mamba_snapshot_slots`, default 2 x max_num_seqs) and return the
        index that maps cached blocks to its slots."""
        num_slots = cache.mamba_snapshot_slots or 2 * self.max_num_reqs
        self.snapshot_pools = [self._like(slab, num_slots).zero_() for slab in self.slabs]
        return MambaSnapshotIndex(num_slots)

    @property
    def snapshot_bytes(self) -> int:
        """Device memory of one snapshot: every recurrent layer's state of one request."""
        return sum(slab[:, 0].numel() * slab.element_size() for slab in self.slabs)

    def snapshot_tensors(self) -> list[torch.Tensor]:
        """Every slab's snapshot pool as `[P, L, ...]` (snapshot slot first): a KV tier copies a snapshot, every
        recurrent layer's state of one prefix, as one row of each."""
        return [pool.movedim(1, 0) for pool in self.snapshot_pools] if self.snapshot_pools is not None else []

    # ---- per-slot verbs ------------------------------------------------------------------------------------
    def add_request(self, req_slot: int, request: "NewRequestData") -> None:
        snapshot = request.snapshot_slot
        if request.num_computed_tokens and (snapshot is None or self.snapshot_pools is None):
            # A recurrent state exists only for tokens this slot ran, or in a snapshot of a cached prefix.
            raise ValueError(
                f"request '{request.request_id}' arrives with {request.num_computed_tokens} computed tokens (a "
                "prefix-cache hit) but no state snapshot to start from"
            )
        self._starts[req_slot] = snapshot if request.num_computed_tokens else None

    def remove_request(self, req_slot: int) -> None:
        """Nothing to free: the slot's rows are overwritten when the next request takes it."""

    def apply_staged_writes(self) -> None:
        """Every slot a request took since the last step: zeroed, or copied from its snapshot (one fill and
        one gather-scatter per slab, on the device)."""
        if not self._starts:
            return
        zero = [slot for slot, snapshot in self._starts.items() if snapshot is None]
        restore = [(slot, snapshot) for slot, snapshot in self._starts.items() if snapshot is not None]
        self._starts.clear()
        if zero:
            slots = torch.tensor(zero, dtype=torch.int64).to(self.device, non_blocking=True)
            for slab in self.slabs:
                slab.index_fill_(1, slots, 0)
        if restore:
            assert self.snapshot_pools is not None
            # [2, n]: request slots, then the snapshot slots they start from
            pairs = torch.tensor(list(zip(*restore)), dtype=torch.int64).to(self.device, non_blocking=True)
            for slab, pool in zip(self.slabs, self.snapshot_pools):
                slab.index_copy_(1, pairs[0], pool.index_select(1, pairs[1]))

    def save_snapshots(self, snapshots: "list[StateSnapshot]") -> None:
        if snapshots and self.snapshot_pools is None:
            raise RuntimeError("state snapshots asked for, but prefix caching did not allocate a snapshot pool")
        self._snapshots = snapshots

    # ---- step hooks --------------------------------------------------------------------------------------
    def _step_inputs(
        self,
        tails: Optional[Slabs],
        pools: Optional[Slabs],
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        pure_decode: bool,
        targets: Optional[SnapshotTargets],
    ) -> dict[str, Any]:
        """Each kind's `RecurrentStepInputs` under its forward keyword, with every layer's views."""
        inputs: dict[str, Any] = {}
        for spec, kind, where in zip(self.specs, self.kinds, self._spec_slabs):
            layers = [
                kind.layer_state(
                    [self.slabs[j][i] for j in where],
                    [tails[j][i] for j in where] if tails is not None else None,
                    [pools[j][i] for j in where] if pools is not None else None,
                )
                for i in range(spec.num_layers)
            ]
            inputs[kind.forward_arg] = RecurrentStepInputs(layers, idx_mapping, query_start_loc, pure_decode, targets)
        return inputs

    def prepare_inputs(self, batch: "InputBatch") -> dict[str, Any]:
        """Each kind's forward input: every layer's state views, and tail buffers when the step has drafts."""
        num_tail = int(batch.num_draft_host.max()) + 1 if batch.num_rows else 1
        self._tails, self._snapshots_after = None, []  # (none left over from a step that failed)
        if num_tail > 1:
            self._tails = [self._like(slab, batch.num_rows, num_tail) for slab in self.slabs]
        targets = self._snapshot_targets(batch.num_rows)
        pools = self.snapshot_pools if targets is not None else None
        pure_decode = batch.num_tokens == batch.num_rows and targets is None  # the one-step update stores none
        return self._step_inputs(self._tails, pools, batch.idx_mapping, batch.query_start_loc, pure_decode, targets)

    def _snapshot_targets(self, num_rows: int) -> Optional[SnapshotTargets]:
        """This step's snapshots as kernel targets (host lists to the device, no sync); None without any."""
        snapshots, self._snapshots = self._snapshots, []
        if not snapshots:
            return None
        return build_snapshot_targets(
            [s.batch_row for s in snapshots],
            [s.num_tokens for s in snapshots],
            [s.snapshot_slot for s in snapshots],
            num_rows,
            self.device,
        )

    def postprocess(self, batch: "InputBatch", num_sampled: torch.Tensor, num_rejected: torch.Tensor) -> None:
        """With drafts: keep, per row, the state after its accepted tokens (`query_len - num_rejected`)."""
        after, self._snapshots_after = self._snapshots_after, []
        self._copy_snapshots(batch, after, self._tails)  # a replayed step's: the state after one token
        if self._tails is None:
            return  # without drafts every token a row ran is accepted: the forward already advanced the slots
        tails, self._tails = self._tails, None
        num_tail = tails[0].shape[2]
        rows = torch.arange(batch.num_rows, device=self.device)
        keep = (num_tail - 1 - num_rejected.long()).clamp(min=0)  # tail index after the last accepted token
        slots = batch.idx_mapping.long()
        for slab, tail in zip(self.slabs, tails):
            slab[:, slots] = tail[:, rows, keep]

    # ---- decode CUDA graphs ------------------------------------------------------------------------------
    def prepare_graph_inputs(self, graph: GraphBatch) -> dict[str, Any]:
        """The forward inputs inside a decode graph: the persistent slabs through the graph's idx_mapping and,
        with drafts, tail buffers kept for `postprocess`. Snapshots are never stored inside a graph."""
        q = graph.tokens_per_row
        tails = self._graph_tail_views(graph.num_rows, q) if q > 1 else None
        return self._step_inputs(tails, None, graph.idx_mapping, graph.query_start_loc, q == 1, None)

    def _graph_tail_views(self, rows: int, q: int) -> Slabs:
        """[L, rows, q, ...] views of one persistent tail storage, the same ones for every call with this shape.
        Graphs are captured largest first, so the storage is allocated once (a larger one later would leave the
        earlier graphs' views, which they keep, on the old storage)."""
        if (rows, q) not in self._graph_tails:
            storage = self._tail_storage
            if storage is None or storage[0].shape[1] < rows or storage[0].shape[2] < q:
                n, m = max(rows, storage[0].shape[1] if storage else 0), max(q, storage[0].shape[2] if storage else 0)
                storage = [self._like(slab, n, m) for slab in self.slabs]
                self._tail_storage = storage
            self._graph_tails[(rows, q)] = [s[:, :rows, :q] for s in storage]
        return self._graph_tails[(rows, q)]

    def prepare_graph_step(self, batch: "InputBatch", graph_rows: int) -> None:
        """The tails of the graph this step replays; snapshots after 0 tokens now, after 1 in `postprocess`."""
        q = batch.max_query_len
        self._tails = None
        if q > 1:
            self._tails = [tail[:, : batch.num_rows] for tail in self._graph_tails[(graph_rows, q)]]
        snapshots, self._snapshots = self._snapshots, []
        if any(s.num_tokens > 1 for s in snapshots):
            raise RuntimeError(
                "a decode row's snapshots are after 0 or 1 of its tokens; got "
                f"{sorted({s.num_tokens for s in snapshots})}"
            )
        self._copy_snapshots(batch, [s for s in snapshots if s.num_tokens == 0], None)
        self._snapshots_after = [s for s in snapshots if s.num_tokens == 1]

    def _copy_snapshots(self, batch: "InputBatch", snapshots: "list[StateSnapshot]", tails: Optional[Slabs]) -> None:
        """Store snapshots from the rows' slots (the slot's state now), or from the first tail (after one token
        of a row verifying drafts): one gather-scatter per slab, on the device."""
        if not snapshots:
            return
        assert self.snapshot_pools is not None
        rows = [s.batch_row for s in snapshots]
        sources = rows if tails is not None else batch.idx_mapping_host[rows].tolist()
        # [2, n]: batch rows (or their req_slots), then the snapshot slots they are stored into
        pairs = torch.tensor([sources, [s.snapshot_slot for s in snapshots]], dtype=torch.int64)
        pairs = pairs.to(self.device, non_blocking=True)
        for j, (slab, pool) in enumerate(zip(self.slabs, self.snapshot_pools)):
            value = slab.index_select(1, pairs[0]) if tails is None else tails[j][:, pairs[0], 0]
            pool.index_copy_(1, pairs[1], value)
