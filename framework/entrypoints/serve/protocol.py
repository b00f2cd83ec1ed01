"""The typed messages between the API server and the engine-core process (msgpack through msgspec, never pickle).

Decoding checks every message against these declared types: a peer can only ever send data, not code.
Requests go in as token ids plus sampling (or pooling) parameters; outputs come back once per engine step as
token-id deltas per sequence, with the engine's counters.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from framework.params.lora_request import LoRARequest
from framework.params.pooling_params import PoolingParams
from framework.params.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag="add"):
    """Queue one request. Exactly one of `sampling_params` (generation) and `pooling_params` (embedding)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Optional[SamplingParams] = None
    pooling_params: Optional[PoolingParams] = None
    lora: Optional[LoRARequest] = None  # the LoRA adapter it runs with (None: the base model)


class AbortRequests(msgspec.Struct, tag="abort"):
    """Abort these requests (every sequence of each); unknown or finished ids are ignored."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Abort everything, free the engine and exit."""


EngineRequest = Union[AddRequest, AbortRequests, Shutdown]

# One token's logprobs: (token id, logprob, rank) for the sampled token first, then the top-k in rank order.
TokenLogprobs = list[tuple[int, float, int]]


class SequenceDelta(msgspec.Struct, array_like=True):
    """What one sequence (`index` of request `request_id`) gained in one step."""

    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error" | "pooled"; None while running
    stop_reason: Union[int, str, None] = None
    logprobs: Optional[list[TokenLogprobs]] = None  # one entry per token in `token_ids`
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None  # once, when the prompt is done
    num_cached_tokens: int = 0
    error: Optional[str] = None
    embedding: Optional[list[float]] = None  # an embedding request's vector, with its final delta


class EngineStats(msgspec.Struct, array_like=True):
    """The engine's gauges now and its counters since start."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    # The host-memory KV tier (zeros without one): prompt tokens loaded from it, failed loads, bytes each way,
    # load batches and their summed device time, blocks held now; a hybrid model's recurrent-state snapshots
    # loaded from it (one ends each of its hits) and held in it now.
    kv_tier_hit_tokens: int = 0
    kv_tier_failed_loads: int = 0
    kv_tier_bytes_to_host: int = 0
    kv_tier_bytes_to_device: int = 0
    kv_tier_loads: int = 0
    kv_tier_load_seconds: float = 0.0
    kv_tier_blocks_held: int = 0
    kv_tier_snapshot_hits: int = 0
    kv_tier_snapshots_held: int = 0


class EngineOutputs(msgspec.Struct, tag="outputs"):
    """One step's results: requests refused on arrival (with the reason), sequence deltas, and stats."""

    deltas: list[SequenceDelta]
    stats: EngineStats
    rejected: list[tuple[str, str]] = []  # (request id, why)


class EngineReady(msgspec.Struct, tag="ready"):
    """Sent once the engine has loaded its model and sized its KV cache."""

    max_model_len: int
    vocab_size: int
    eos_token_id: Optional[int]
    max_logprobs: int
    runner: str
    stats: EngineStats
    # The projections LoRA adapters may update, (layer, part, in, out), and the MoE layers (experts refused): the
    # API server checks adapters against them (empty without lora.enable).
    lora_targets: list[tuple[int, str, int, int]] = []
    lora_moe_layers: list[int] = []


class EngineDead(msgspec.Struct, tag="dead"):
    """The engine stopped (start-up failure or repeated step failures); the process exits after this."""

    message: str


EngineMessage = Union[EngineOutputs, EngineReady, EngineDead]


class Codec:
    """msgpack both ways; decoding accepts only `incoming`'s declared types (anything else raises)."""

    def __init__(self, incoming: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)

    def encode(self, message: Union[EngineRequest, EngineMessage]) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes) -> Any:
        return self._decoder.decode(data)


def front_end_codec() -> Codec:
    """The API server's side: sends requests, receives engine messages."""
    return Codec(EngineMessage)


def engine_codec() -> Codec:
    """The engine core's side: sends engine messages, receives requests."""
    return Codec(EngineRequest)
