"""The per-row lists of one step's `SchedulerOutput`, filled in one pass as the scheduler walks its requests."""

from __future__ import annotations

from framework.engine.request import Request
from framework.params.scheduler_output import CachedRequestData, NewRequestData, StateSnapshot


class StepRows:
    """Rows of the step being scheduled, in batch order, as the parallel lists `SchedulerOutput` carries.

    `add` also advances the request's counters for the step (what it computes, the tokens it will sample), so
    nothing walks the batch again: a decode row costs four list appends and four attribute writes.
    """

    __slots__ = ("ids", "num_scheduled", "drafts", "computed_before", "sampling", "new", "cached", "snapshots")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.num_scheduled: list[int] = []
        self.drafts: list[int] = []  # per row: drafts verified this step
        self.computed_before: list[int] = []  # per row: num_computed_tokens before this step
        self.sampling: list[Request] = []  # the requests of the rows that sample, in row order
        self.new: list[NewRequestData] = []
        self.cached: list[CachedRequestData] = []  # only rows that gained KV blocks
        self.snapshots: list[StateSnapshot] = []

    def add(self, request: Request, num_tokens: int, num_draft: int, computed_before: int, samples: bool) -> None:
        """Row `len(ids)` computes `num_tokens` of `request` (`num_draft` of them drafts to verify) from
        `computed_before`; `samples`: the row reaches the request's last token and samples."""
        self.ids.append(request.request_id)
        self.num_scheduled.append(num_tokens)
        self.drafts.append(num_draft)
        self.computed_before.append(computed_before)
        request.num_computed_tokens = computed_before + num_tokens
        # Drafts proposed after a prefill chunk are never verified; a sampling row gets the step's k
        # (`Scheduler.schedule`, once the policy chose it).
        request.num_drafts_ready = 0
        if samples:
            # This row samples 1 + (accepted drafts) tokens the host will see later: count the most.
            request.num_output_placeholders += 1 + num_draft
            self.sampling.append(request)

    def uniform_drafts(self) -> None:
        """Decode rows that hold different numbers of drafts all verify the fewest (a prefix of a row's
        drafts is a valid proposal): a batch whose rows have equal lengths replays a CUDA graph, a mixed one
        runs eagerly, several times slower. Rows hold different numbers when k changed while a row sat out a
        step (its last tokens were in flight), or near max_model_len.

        Only pure decode batches are evened out (every row samples and computes 1 + its drafts): a batch
        with a prefill chunk runs eagerly anyway. The KV blocks allocated for the longer rows are kept (the
        request fills them next steps); the counters `add` advanced are taken back by the dropped drafts."""
        drafts = self.drafts
        if not drafts or min(drafts) == max(drafts) or len(self.sampling) != len(drafts):
            return
        if any(n != 1 + d for n, d in zip(self.num_scheduled, drafts)):
            return  # a prefill chunk: an eager batch whatever the drafts
        fewest = min(drafts)
        for request, d in zip(self.sampling, drafts):  # every row samples: `sampling` is in row order
            request.num_computed_tokens -= d - fewest
            request.num_output_placeholders -= d - fewest
        self.num_scheduled[:] = [1 + fewest] * len(drafts)
        drafts[:] = [fewest] * len(drafts)
