"""Continuous batching under a token budget, with chunked prefill and preemption by recompute."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Optional, Sequence

from framework.config.schema import SchedulerConfig
from framework.engine.request import Request, RequestStatus
from framework.engine.scheduler.invariants import check_scheduler_invariants
from framework.engine.scheduler.kv_cache_manager import KVCacheManager
from framework.engine.scheduler.lora_admission import lora_fits
from framework.engine.scheduler.prefix import admit_cache_hit, cache_hit, take_snapshots
from framework.engine.scheduler.rows import StepRows
from framework.kv_transfer.interface import KVConnector, NoKVConnector
from framework.params.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

if TYPE_CHECKING:
    from framework.runner.plugins import DraftLengthPolicy, SpecDecodeMetrics


class Scheduler:
    """Decides, each step, which requests compute how many tokens.

    Running requests go first, in arrival order, each taking what it still needs (one token when decoding,
    the rest of its prompt in budget-sized chunks when prefilling). When the KV cache cannot grow a running
    request, the newest running request is preempted: its blocks are freed and it is re-queued at the front
    to be recomputed later (prompt + output so far). Waiting requests are admitted while budget, slots and
    blocks allow, and never in a step that preempted.

    Speculative decoding (`draft_policy` set): a decoding request whose slot holds drafts verifies up to k of
    them, i.e. computes 1 + k tokens (k capped by the budget and max_model_len, not max_tokens). Until its output
    arrives the host counts all of them as computed and all k + 1 possible tokens as placeholders (upper
    bounds, so KV blocks always suffice); the output's length then corrects `num_computed_tokens` down by
    the rejected drafts, whose KV positions the next steps overwrite.

    With prefix caching a waiting request starts at its cache hit (`num_computed_tokens` = the hit length, a
    whole number of blocks), and every scheduled request publishes the blocks it fills (docs/prefix-caching.md).
    For a model with recurrent state the hit ends at the last hit block with a state snapshot, and the step
    that computes the state at the end of a published block asks for a snapshot of it (`StateSnapshot`).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        draft_policy: Optional["DraftLengthPolicy"] = None,
        spec_metrics: Optional["SpecDecodeMetrics"] = None,
        draft_kv_lookahead: int = 0,
        max_loras: int = 0,
        kv_connector: Optional[KVConnector] = None,
    ) -> None:
        self.config = config
        self.max_loras = max_loras  # LoRA adapters running requests may use at once (the runner's GPU slots)
        self.kv_connector = kv_connector or NoKVConnector()
        # A draft model with its own KV (EAGLE, MTP) writes up to k - 1 positions past a sampling row's last
        # token while drafting: such rows get blocks for that many more positions.
        self.draft_kv_lookahead = draft_kv_lookahead
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.draft_policy = draft_policy
        self.spec_metrics = spec_metrics
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._released_ids: set[str] = set()  # slots the runner must free at its next step
        # Set by `prefix.recompute_failed_loads`: the next step admits nobody (in-flight tokens get dropped).
        self.hold_admissions = False

    # ---- requests in and out -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        # Under a grammar, end of sequence is the grammar's end: it stops even with ignore_eos.
        eos_stops = request.eos_token_id is not None and (
            not params.ignore_eos or params.structured_outputs is not None
        )
        request.stop_token_set = frozenset(params.stop_token_ids) | ({request.eos_token_id} if eos_stops else set())
        room = self.max_model_len - request.num_prompt_tokens
        request.max_output_len = room if params.max_tokens is None else min(params.max_tokens, room)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Optional[Request]:
        """End a request wherever it is; returns it, or None if it is not here (already ended)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(self, request_id: str, status: RequestStatus) -> Optional[Request]:
        """End a running or waiting request with `status` (e.g. a stop string matched); None if not here."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, status)
        return request

    def release_again(self, request_ids: set[str]) -> None:
        """Tell the runner again, at the next step, to free these requests' slots (its last step failed)."""
        self._released_ids |= request_ids

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def _finish(self, request: Request, status: RequestStatus, leave_running: bool = False) -> None:
        """End `request` with `status`. `leave_running`: a running request stays in `running` (ended), for the
        caller to drop every request ended in one pass (`_drop_ended`); many ends in a step cost one pass."""
        was_running = request.status is RequestStatus.RUNNING
        request.status = status
        if was_running:
            if not leave_running:
                self.running.remove(request)  # by identity: Request compares by identity
            self._released_ids.add(request.request_id)
        else:
            self.waiting.remove(request)
        self.kv_cache.free(request.request_id)
        del self.requests[request.request_id]
        if self.draft_policy is not None:
            self.draft_policy.remove_request(request.request_id)

    def _drop_ended(self) -> None:
        """Drop the requests `_finish(..., leave_running=True)` ended from `running`, keeping the order."""
        running_status = RequestStatus.RUNNING
        self.running[:] = [r for r in self.running if r.status is running_status]

    def preempt(self, request: Request) -> None:
        """Send a running request back to the waiting queue, to be recomputed from its tokens so far (its slot is
        released at the next step): what the step-failure policy does to the neighbours of a failed request."""
        self._preempt(request)

    def _preempt(self, request: Request) -> None:
        if self.running[-1] is request:
            self.running.pop()  # the newest: what `schedule` preempts
        else:
            self.running.remove(request)
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token still in flight is dropped; recompute samples it again
        request.num_drafts_ready = 0  # its slot (and the drafts in it) is released
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self._released_ids.add(request.request_id)

    # ---- one step ------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """This step's rows. One pass over the running requests, then one over the admitted ones: each row's
        counters advance as it is scheduled (nothing re-walks the batch), and a decode row that stays inside
        its last block costs no allocation beyond its entries in the per-row lists."""
        step = StepRows()
        self.kv_cache.hooks.on_schedule()
        # 1. Running requests, in arrival order; the newest are preempted when the KV cache cannot grow.
        budget, preempted = self._schedule_running(step, self.config.max_num_batched_tokens)
        # 2. Waiting requests, while budget, slots and blocks allow; never in a step that preempted.
        if not preempted and not self.hold_admissions:
            self._admit_waiting(step, budget)
        self.hold_admissions = False
        # 3. Speculative decoding: the drafts proposed after this step for every row that samples.
        num_propose = self._propose_drafts(step)
        # 4. The step's output, with the slots the runner must free.
        released, self._released_ids = self._released_ids, set()
        return SchedulerOutput(
            scheduled_request_ids=step.ids,
            num_scheduled_tokens=step.num_scheduled,
            num_draft_tokens=step.drafts,
            new_requests=step.new,
            cached_requests=step.cached,
            finished_request_ids=released,
            num_propose_tokens=num_propose,
            num_computed_tokens=step.computed_before,
            state_snapshots=step.snapshots,
            kv_connector_metadata=self.kv_connector.build_metadata(),
        )

    def _schedule_running(self, step: StepRows, budget: int) -> tuple[int, bool]:
        """Schedule what each running request still needs, within `budget` tokens; returns the budget left and
        whether a request was preempted."""
        kv = self.kv_cache
        takes_snapshots = kv.hooks.takes_snapshots
        max_model_len, lookahead = self.max_model_len, self.draft_kv_lookahead
        preempted = False

        # The hot loop (every running request, every step): builtins and method calls it can do without are
        # spelled out (min, StepRows.add, _with_lookahead, Request.num_tokens), about halving its cost.
        ids, num_scheduled, drafts, computed_before = step.ids, step.num_scheduled, step.drafts, step.computed_before
        sampling = step.sampling
        publishes, block_size, window = kv.enable_prefix_caching, kv.block_size, kv.window
        held_blocks, published = kv.growth_views()  # `allocate`'s and `cache_blocks`' first tests, inlined below
        running = self.running
        for request in running:  # preemption pops from the end: the iteration stops where the list now ends
            if budget <= 0:
                break
            computed, placeholders = request.num_computed_tokens, request.num_output_placeholders
            num_out = len(request.output_token_ids)
            num_tokens = len(request.prompt_token_ids) + num_out
            target = num_tokens + placeholders  # its length once the tokens being sampled arrive
            # Tokens already being sampled reach max_tokens or max_model_len (async scheduling): nothing more to
            # compute. An embedding request computes its prompt only: never a decode step.
            if placeholders and (
                num_out + placeholders >= request.max_output_len or request.pooling_params is not None
            ):
                continue
            n = target - computed if target - computed < budget else budget
            num_draft = self._num_drafts(request, budget) if n == 1 and request.num_drafts_ready else 0
            n += num_draft
            end = computed + n
            samples = end - num_draft == target
            # `_with_lookahead(end, samples)`
            need = (end + lookahead if end + lookahead < max_model_len else max_model_len) if samples else end
            if window:  # blocks before the window of its first uncertain position (rejected drafts recompute)
                kv.release_out_of_window(request.request_id, computed - placeholders)
            held = held_blocks.get(request.request_id)
            # A row that stays inside its blocks (most decode steps) gets no new block: `allocate` returns [].
            fits = held is not None and need <= len(held) * block_size
            new_blocks = [] if fits else kv.allocate(request.request_id, need)
            while new_blocks is None:
                victim = running[-1]  # never a row scheduled already: those come before `request`
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_blocks = kv.allocate(request.request_id, need)
            if new_blocks is None:
                break  # the request itself was preempted; everyone after it already was too
            if new_blocks:
                step.cached.append(CachedRequestData(request.request_id, new_blocks))
            upto = end if end < num_tokens else num_tokens
            # `cache_blocks` publishes nothing until the row fills its next block (its first test, inlined).
            if publishes and upto >= (published.get(request.request_id, 0) + 1) * block_size:
                offered = kv.cache_blocks(request, upto)
                if takes_snapshots and offered:
                    take_snapshots(kv, len(ids), computed, n - num_draft, offered, step.snapshots)
            # StepRows.add, spelled out
            ids.append(request.request_id)
            num_scheduled.append(n)
            drafts.append(num_draft)
            computed_before.append(computed)
            request.num_computed_tokens = end
            request.num_drafts_ready = 0
            if samples:
                request.num_output_placeholders = placeholders + 1 + num_draft
                sampling.append(request)
            budget -= n
        return budget, preempted

    def _admit_waiting(self, step: StepRows, budget: int) -> None:
        """Admit waiting requests in order (each from its prefix-cache hit) while budget, slots and blocks allow."""
        kv = self.kv_cache
        encoder_budget = self.config.max_num_encoder_tokens or self.config.max_num_batched_tokens
        encoder_scheduled = 0
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.lora is not None and not lora_fits(request.lora, self.running, self.max_loras):
                break  # its adapter waits for a GPU slot: a running request's adapter must leave first
            # The encoder runs in the step that admits the request (first or resumed): bound its work per step,
            # but always admit one, so a request larger than the budget still runs.
            num_encoder = request.encoder_input.num_encoder_tokens if request.encoder_input is not None else 0
            if encoder_scheduled and encoder_scheduled + num_encoder > encoder_budget:
                break
            hit_blocks, num_ext = cache_hit(kv, request, self.kv_connector)  # device blocks, then tier tokens
            num_hit = len(hit_blocks) * kv.block_size + num_ext
            n = min(request.num_tokens - num_hit, budget)
            samples = num_hit + n == request.num_tokens
            new_blocks = kv.allocate(request.request_id, self._with_lookahead(num_hit + n, samples), hit_blocks)
            if new_blocks is None:
                break
            encoder_scheduled += num_encoder
            tier_blocks = new_blocks[: num_ext // kv.block_size]  # where the external tier's tokens load
            offered = admit_cache_hit(kv, request, num_hit, n, self.kv_connector, tier_blocks)
            # its hit's snapshot (device-cached or loaded from the tier): read before this step's snapshots evict it
            restore = kv.hooks.snapshot_slot((hit_blocks + tier_blocks)[-1]) if num_hit else None
            take_snapshots(kv, len(step.ids), num_hit, n, offered, step.snapshots)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.new.append(
                NewRequestData(
                    request_id=request.request_id,
                    prefill_token_ids=request.all_token_ids,
                    prompt_len=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    sampling_seed=request.sampling_seed,
                    block_ids=kv.table_row(request.request_id),
                    num_computed_tokens=num_hit,
                    pooling_params=request.pooling_params,
                    encoder_input=request.encoder_input,
                    snapshot_slot=restore,
                    lora=request.lora,
                )
            )
            step.add(request, n, 0, num_hit, samples)
            budget -= n

    def _propose_drafts(self, step: StepRows) -> int:
        """k, the drafts the speculator proposes after this step for every row that samples (verified next
        step); 0 without speculative decoding."""
        if self.draft_policy is None:
            return 0
        step.uniform_drafts()
        num_propose = self.draft_policy.choose([r.request_id for r in self.running])
        for request in step.sampling:
            request.num_drafts_ready = num_propose
        return num_propose

    def _with_lookahead(self, num_tokens: int, samples: bool) -> int:
        """KV positions to allocate for a row computing up to `num_tokens`: plus the draft lookahead if it samples."""
        return min(num_tokens + self.draft_kv_lookahead, self.max_model_len) if samples else num_tokens

    def _num_drafts(self, request: Request, budget: int) -> int:
        """Drafts a decoding request verifies this step: what its slot holds, within the token budget and
        max_model_len.

        Not capped by max_tokens: near its end a row still verifies the k every other row verifies, so the
        batch stays uniform and replays a CUDA graph (a row with fewer tokens sends the whole step down the
        eager path, several times slower); tokens past max_tokens are dropped by `update_from_output`.
        """
        if not request.num_drafts_ready:
            return 0
        return max(
            0,
            min(
                request.num_drafts_ready,
                budget - 1,
                self.max_model_len - 1 - request.num_computed_tokens,  # the last draft's position must fit
            ),
        )

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: Sequence[Sequence[int]],
        errors: Optional[Sequence[Optional[str]]] = None,
    ) -> list[Request]:
        """Append each row's sampled tokens, apply stop conditions; returns the requests that finished.

        `errors[i]`, when set, ends row i's request with status FINISHED_ERROR and appends nothing (its logits
        were not finite, or every token was excluded); the other rows are not affected.
        """
        finished = []
        verified: list[tuple[str, int, int]] = []  # (request, drafts, accepted) of the rows that verified drafts
        requests, running_status = self.requests, RequestStatus.RUNNING
        for row, (request_id, tokens, num_draft) in enumerate(
            zip(output.scheduled_request_ids, sampled, output.num_draft_tokens)
        ):
            if not tokens:
                continue  # a prefill chunk that samples nothing
            request = requests.get(request_id)
            if request is None or request.status is not running_status:
                continue  # ended or preempted meanwhile
            request.num_output_placeholders -= 1 + num_draft
            if num_draft:
                # The rejected drafts' positions were counted as computed: the next step recomputes them.
                request.num_computed_tokens -= num_draft + 1 - len(tokens)
                verified.append((request_id, num_draft, len(tokens) - 1))
            if request.pooling_params is not None:  # its prompt is done and pooled; the sampled token is dropped
                status: Optional[RequestStatus] = RequestStatus.FINISHED_POOLED
            elif errors is not None and errors[row]:
                request.error = errors[row]
                status = RequestStatus.FINISHED_ERROR
            else:
                status = None
                output_ids = request.output_token_ids
                for token in tokens:
                    output_ids.append(token)
                    if token in request.stop_token_set and len(output_ids) >= request.sampling_params.min_tokens:
                        status = self._stopped_by(request, token)
                        break
                    if len(output_ids) >= request.max_output_len:
                        status = RequestStatus.FINISHED_LENGTH
                        break
            if status is not None:
                self._finish(request, status, leave_running=True)
                finished.append(request)
        if finished:
            self._drop_ended()
        if verified:
            self._record_acceptance(verified)
        return finished

    @staticmethod
    def _stopped_by(request: Request, token: int) -> RequestStatus:
        """`token` (in `request.stop_token_set`) ends the request: eos, or a stop token id it reports."""
        params = request.sampling_params
        if not (token == request.eos_token_id and (not params.ignore_eos or params.structured_outputs is not None)):
            request.stop_token_id = token  # a stop_token_ids entry (eos too, when ignore_eos lists it there)
        return RequestStatus.FINISHED_STOPPED

    def _record_acceptance(self, verified: list[tuple[str, int, int]]) -> None:
        ids, drafts, accepted = zip(*verified)
        if self.spec_metrics is not None:
            self.spec_metrics.record_step(drafts, accepted)
        if self.draft_policy is not None:
            self.draft_policy.observe_acceptance(ids, drafts, accepted)

    def check_invariants(self) -> None:
        """Raise `AssertionError` on a leak (`invariants.check_scheduler_invariants`)."""
        check_scheduler_invariants(self.kv_cache, self.waiting, self.running, self.requests, self.config.max_num_seqs)
