"""The scheduler's decision for one step: the hand-off from the scheduler to a model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from framework.params.encoder_input import EncoderInput
from framework.params.kv_transfer import KVConnectorMetadata
from framework.params.lora_request import LoRARequest
from framework.params.pooling_params import PoolingParams
from framework.params.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request that needs a slot: first scheduled, or resumed after preemption.

    `prefill_token_ids` is the prompt plus any output produced before a preemption, so
    `len(prefill_token_ids) >= prompt_len`; penalties and prompt logprobs use `prompt_len`.
    """

    request_id: str
    prefill_token_ids: list[int]
    prompt_len: int
    sampling_params: SamplingParams
    sampling_seed: int  # the request's seed, or one drawn for it: keys its noise by position
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: Optional[PoolingParams] = None  # set for an embedding request: pool its prompt, sample nothing
    encoder_input: Optional[EncoderInput] = None  # set for an encoder-decoder request: the encoder runs this step
    # A prefix-cache hit of a model with recurrent state: the snapshot slot holding its state after the first
    # `num_computed_tokens` tokens, which the request starts from (None: it starts from a zero state).
    snapshot_slot: Optional[int] = None
    lora: Optional[LoRARequest] = None  # the request's LoRA adapter (None: the base model)


@dataclass(frozen=True)
class StateSnapshot:
    """Store the recurrent state of batch row `batch_row` after `num_tokens` of this step's tokens (0 = the state
    before the step) in snapshot slot `snapshot_slot` (prefix caching of hybrid models)."""

    batch_row: int
    num_tokens: int
    snapshot_slot: int


@dataclass(frozen=True)
class CachedRequestData:
    """A request that already holds a slot and gained KV blocks this step (never an empty list: a row that
    stays inside its blocks, most decode rows, has no entry)."""

    request_id: str
    new_block_ids: list[int]


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything a runner needs for one step.

    Rows of the batch follow `scheduled_request_ids`; `num_scheduled_tokens[i]` tokens are computed for row i,
    of which `num_draft_tokens[i]` are speculative drafts to verify.
    """

    scheduled_request_ids: list[str]
    num_scheduled_tokens: list[int]
    num_draft_tokens: list[int]
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]  # only the scheduled requests that gained KV blocks
    finished_request_ids: set[str] = field(default_factory=set)  # finished, aborted or preempted since last step
    # k: drafts per row the speculator proposes after this step, verified by the next (0 = propose nothing).
    num_propose_tokens: int = 0
    # Per row: tokens the scheduler counts as computed before this step; an upper bound while drafts are in
    # flight (rejected ones are subtracted when the output arrives). None: the runner keeps its own count.
    num_computed_tokens: Optional[list[int]] = None
    # Recurrent-state snapshots this step stores, by batch row then num_tokens (empty unless the model state's
    # prefix-cache hooks take snapshots).
    state_snapshots: list[StateSnapshot] = field(default_factory=list)
    # The KV connector's transfers for this step (blocks to save out of and load into the device cache before
    # the forward); None without a connector or with nothing to move.
    kv_connector_metadata: Optional[KVConnectorMetadata] = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_request_ids
