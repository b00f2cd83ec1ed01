"""Mamba-hybrid models: per-slot conv and SSM state beside the paged KV cache of the attention layers.

Each request slot owns, for every Mamba layer, a conv state (the last `d_conv - 1` conv inputs) and an SSM
state (`d_inner x d_state`, float32). They are allocated with the slot tables at start-up and zeroed when a
request takes the slot, so a reused slot carries nothing of its previous owner. The forward advances them in
place: a prefill chunk scans from the slot's state (chunked prefill continues where the last chunk
stopped), a pure decode batch takes the one-step update.

Preemption frees the KV blocks and recomputes the request from its first token; the resumed request (a new
`add_request`) starts from a zeroed slot, or from a snapshot when prefix caching serves part of it.

Prefix caching: a cached prefix never runs through the model, so its recurrent state must have been kept.
With caching on, the state owns a pool of snapshot slots (`[L, P, ...]` beside the per-slot tables) and the
scheduler-side `MambaSnapshotIndex` decides which cached block has one. The step that computes the state at
the end of a cached block stores it there, from inside the kernels (`save_snapshots`: per batch row, after
how many of its tokens, into which slot); a request whose hit ends at that block starts from a device-side
copy of it (`add_request` with `snapshot_slot`, applied in `apply_staged_writes`).

Speculative decoding: a row verifying drafts runs `1 + k` tokens, but its state must advance only by the
tokens that were accepted. When a step has drafts, `prepare_inputs` hands every Mamba layer tail buffers in
which the kernels store the state after each of a row's last `K + 1` tokens; `postprocess` copies, for every
row, the one after `query_len - num_rejected` tokens into the slot, on the device, with no host sync.

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
from framework.models.interface import MambaHybrid
from framework.models.mamba_layer import MambaLayerState, MambaStepInputs
from framework.params.prefix_cache import PrefixCacheHooks
from model_states.default import DefaultModelState
from model_states.mamba_snapshots import MambaSnapshotIndex

if TYPE_CHECKING:
    from framework.batch.input_batch import InputBatch
    from framework.config.schema import CacheConfig
    from framework.params.scheduler_output import NewRequestData, StateSnapshot


class MambaHybridModelState(DefaultModelState):
    """Paged attention metadata (as the default state) plus per-slot Mamba conv and SSM state.

    The model must offer `mamba_state_shapes()` -> (number of Mamba layers, per-slot conv state shape,
    per-slot SSM state shape) and accept the `mamba` forward input (`MambaStepInputs`).
    """

    name = "mamba_hybrid"
    supports_prefix_caching = True  # with snapshots of the state at cached block boundaries

    def __init__(self, model: nn.Module, hf_config: dict[str, Any], max_num_reqs: int, device: torch.device) -> None:
        super().__init__(model, hf_config, max_num_reqs, device)
        if not isinstance(model, MambaHybrid):
            raise TypeError(
                f"model state 'mamba_hybrid' needs a MambaHybrid model (mamba_state_shapes()); "
                f"{type(model).__name__} is none"
            )
        num_layers, conv_shape, ssm_shape = model.mamba_state_shapes()
        conv_dtype = next(model.parameters()).dtype
        # [L, S+1, d_inner, d_conv-1] and [L, S+1, d_inner, d_state]: one slab per kind, a layer's view is
        # [S+1, ...]; the last slot is the dummy that padding rows of decode graphs write.
        slots = max_num_reqs + 1
        self.conv_state = torch.zeros(num_layers, slots, *conv_shape, dtype=conv_dtype, device=device)
        self.ssm_state = torch.zeros(num_layers, slots, *ssm_shape, dtype=torch.float32, device=device)
        # req_slot -> snapshot slot to start from (None: zeros), for every slot a request took since the last step
        self._starts: dict[int, Optional[int]] = {}
        self._tails: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # this step's, when it has drafts
        # [L, P, d_inner, d_conv-1] and [L, P, d_inner, d_state] by snapshot slot, once prefix caching is on
        self.conv_snapshots: Optional[torch.Tensor] = None
        self.ssm_snapshots: Optional[torch.Tensor] = None
        self._snapshots: list["StateSnapshot"] = []  # this step's, from the scheduler
        # Decode graphs: (rows, tokens per row) -> that graph's tail views [L, rows, q, ...] of `_tail_storage`
        self._graph_tails: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._tail_storage: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._snapshots_after: list["StateSnapshot"] = []  # a replayed step's, after its first token

    def init_prefix_cache(self, cache: "CacheConfig") -> PrefixCacheHooks:
        """Allocate the snapshot pool (`cache.mamba_snapshot_slots`, default 2 x max_num_seqs) and return the
        index that maps cached blocks to its slots."""
        num_slots = cache.mamba_snapshot_slots or 2 * self.max_num_reqs
        self.conv_snapshots = torch.zeros(
            self.conv_state.shape[0],
            num_slots,
            *self.conv_state.shape[2:],
            dtype=self.conv_state.dtype,
            device=self.device,
        )
        self.ssm_snapshots = torch.zeros(
            self.ssm_state.shape[0], num_slots, *self.ssm_state.shape[2:], dtype=torch.float32, device=self.device
        )
        return MambaSnapshotIndex(num_slots)

    @property
    def snapshot_bytes(self) -> int:
        """Device memory of one snapshot: every Mamba layer's conv and SSM state of one request."""
        return (
            self.conv_state[:, 0].numel() * self.conv_state.element_size()
            + self.ssm_state[:, 0].numel() * self.ssm_state.element_size()
        )

    # ---- per-slot verbs ------------------------------------------------------------------------------------
    def add_request(self, req_slot: int, request: "NewRequestData") -> None:
        snapshot = request.snapshot_slot
        if request.num_computed_tokens and (snapshot is None or self.ssm_snapshots is None):
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
        one gather-scatter per state slab, on the device)."""
        if not self._starts:
            return
        zero = [slot for slot, snapshot in self._starts.items() if snapshot is None]
        restore = [(slot, snapshot) for slot, snapshot in self._starts.items() if snapshot is not None]
        self._starts.clear()
        if zero:
            slots = torch.tensor(zero, dtype=torch.int64).to(self.device, non_blocking=True)
            self.conv_state.index_fill_(1, slots, 0)
            self.ssm_state.index_fill_(1, slots, 0)
        if restore:
            assert self.conv_snapshots is not None and self.ssm_snapshots is not None
            # [2, n]: request slots, then the snapshot slots they start from
            pairs = torch.tensor(list(zip(*restore)), dtype=torch.int64).to(self.device, non_blocking=True)
            self.conv_state.index_copy_(1, pairs[0], self.conv_snapshots.index_select(1, pairs[1]))
            self.ssm_state.index_copy_(1, pairs[0], self.ssm_snapshots.index_select(1, pairs[1]))

    def save_snapshots(self, snapshots: "list[StateSnapshot]") -> None:
        if snapshots and self.ssm_snapshots is None:
            raise RuntimeError("state snapshots asked for, but prefix caching did not allocate a snapshot pool")
        self._snapshots = snapshots

    # ---- step hooks --------------------------------------------------------------------------------------
    def prepare_inputs(self, batch: "InputBatch") -> dict[str, Any]:
        """The `mamba` forward input: each layer's state views, and tail buffers when the step has drafts."""
        num_tail = int(batch.num_draft_host.max()) + 1 if batch.num_rows else 1
        self._tails, self._snapshots_after = None, []  # (none left over from a step that failed)
        if num_tail > 1:
            r = batch.num_rows
            self._tails = (
                torch.empty(
                    self.conv_state.shape[0],
                    r,
                    num_tail,
                    *self.conv_state.shape[2:],
                    dtype=self.conv_state.dtype,
                    device=self.device,
                ),
                torch.empty(
                    self.ssm_state.shape[0],
                    r,
                    num_tail,
                    *self.ssm_state.shape[2:],
                    dtype=torch.float32,
                    device=self.device,
                ),
            )
        targets = self._snapshot_targets(batch.num_rows)
        conv_pool, ssm_pool = (self.conv_snapshots, self.ssm_snapshots) if targets is not None else (None, None)
        layers = [
            MambaLayerState(
                self.conv_state[i],
                self.ssm_state[i],
                self._tails[0][i] if self._tails else None,
                self._tails[1][i] if self._tails else None,
                conv_pool[i] if conv_pool is not None else None,
                ssm_pool[i] if ssm_pool is not None else None,
            )
            for i in range(self.conv_state.shape[0])
        ]
        pure_decode = batch.num_tokens == batch.num_rows and targets is None  # the one-step update stores none
        return {"mamba": MambaStepInputs(layers, batch.idx_mapping, batch.query_start_loc, pure_decode, targets)}

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
        conv_tail, ssm_tail = self._tails
        self._tails = None
        num_tail = ssm_tail.shape[2]
        rows = torch.arange(batch.num_rows, device=self.device)
        keep = (num_tail - 1 - num_rejected.long()).clamp(min=0)  # tail index after the last accepted token
        slots = batch.idx_mapping.long()
        self.conv_state[:, slots] = conv_tail[:, rows, keep]
        self.ssm_state[:, slots] = ssm_tail[:, rows, keep]

    # ---- decode CUDA graphs ------------------------------------------------------------------------------
    def prepare_graph_inputs(self, graph: GraphBatch) -> dict[str, Any]:
        """The `mamba` input inside a decode graph: the persistent slabs through the graph's idx_mapping and,
        with drafts, tail buffers kept for `postprocess`. Snapshots are never stored inside a graph."""
        q = graph.tokens_per_row
        tails = self._graph_tail_views(graph.num_rows, q) if q > 1 else None
        layers = [
            MambaLayerState(
                self.conv_state[i], self.ssm_state[i], tails[0][i] if tails else None, tails[1][i] if tails else None
            )
            for i in range(self.conv_state.shape[0])
        ]
        return {"mamba": MambaStepInputs(layers, graph.idx_mapping, graph.query_start_loc, q == 1)}

    def _graph_tail_views(self, rows: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[L, rows, q, ...] views of one persistent tail storage, the same ones for every call with this shape.
        Graphs are captured largest first, so the storage is allocated once (a larger one later would leave the
        earlier graphs' views, which they keep, on the old storage)."""
        if (rows, q) not in self._graph_tails:
            storage = self._tail_storage
            if storage is None or storage[1].shape[1] < rows or storage[1].shape[2] < q:
                n, m = max(rows, storage[1].shape[1] if storage else 0), max(q, storage[1].shape[2] if storage else 0)
                layers = self.conv_state.shape[0]
                storage = (
                    torch.empty(
                        layers, n, m, *self.conv_state.shape[2:], dtype=self.conv_state.dtype, device=self.device
                    ),
                    torch.empty(layers, n, m, *self.ssm_state.shape[2:], dtype=torch.float32, device=self.device),
                )
                self._tail_storage = storage
            self._graph_tails[(rows, q)] = (storage[0][:, :rows, :q], storage[1][:, :rows, :q])
        return self._graph_tails[(rows, q)]

    def prepare_graph_step(self, batch: "InputBatch", graph_rows: int) -> None:
        """The tails of the graph this step replays; snapshots after 0 tokens now, after 1 in `postprocess`."""
        q = batch.max_query_len
        self._tails = None
        if q > 1:
            conv_tail, ssm_tail = self._graph_tails[(graph_rows, q)]
            self._tails = (conv_tail[:, : batch.num_rows], ssm_tail[:, : batch.num_rows])
        snapshots, self._snapshots = self._snapshots, []
        if any(s.num_tokens > 1 for s in snapshots):
            raise RuntimeError(
                "a decode row's snapshots are after 0 or 1 of its tokens; got "
                f"{sorted({s.num_tokens for s in snapshots})}"
            )
        self._copy_snapshots(batch, [s for s in snapshots if s.num_tokens == 0], None)
        self._snapshots_after = [s for s in snapshots if s.num_tokens == 1]

    def _copy_snapshots(
        self, batch: "InputBatch", snapshots: "list[StateSnapshot]", tails: Optional[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Store snapshots from the rows' slots (the slot's state now), or from the first tail (after one token
        of a row verifying drafts): one gather-scatter per slab, on the device."""
        if not snapshots:
            return
        assert self.conv_snapshots is not None and self.ssm_snapshots is not None
        rows = [s.batch_row for s in snapshots]
        sources = rows if tails is not None else batch.idx_mapping_host[rows].tolist()
        # [2, n]: batch rows (or their req_slots), then the snapshot slots they are stored into
        pairs = torch.tensor([sources, [s.snapshot_slot for s in snapshots]], dtype=torch.int64)
        pairs = pairs.to(self.device, non_blocking=True)
        if tails is None:
            conv, ssm = self.conv_state.index_select(1, pairs[0]), self.ssm_state.index_select(1, pairs[0])
        else:
            conv, ssm = tails[0][:, pairs[0], 0], tails[1][:, pairs[0], 0]
        self.conv_snapshots.index_copy_(1, pairs[1], conv)
        self.ssm_snapshots.index_copy_(1, pairs[1], ssm)
