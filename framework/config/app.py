"""The sections of the commands on top of the engine: what `mrv2 run` generates, the workload of `mrv2 bench`
and the HTTP server of `mrv2 serve`. The engine itself never reads them."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from framework.config.base import StrictModel


class RunConfig(StrictModel):
    """What `mrv2 run` generates."""

    prompts: list[str] = Field(default_factory=lambda: ["def fibonacci(n):", "The quick brown fox"])
    show_progress: bool = True


class BenchConfig(StrictModel):
    """The workload of `mrv2 bench`: random prompt ids, lengths uniform in the given ranges."""

    name: str = "bench"
    num_requests: int = Field(16, ge=1)
    input_len: tuple[int, int] = (16, 64)
    output_len: tuple[int, int] = (16, 64)
    temperature: float = Field(0.6, ge=0.0)
    seed: int = 0
    baselines: list[Literal["hf"]] = Field(default_factory=list, description="Also run these on the same requests.")
    hf_batch_size: int = Field(256, ge=1, description="Batch size of the HF transformers baseline.")
    warmup_requests: int = Field(
        16,
        ge=0,
        description="Untimed requests (other prompts, at most 16 output tokens) run before the timed "
        "workload, so that first-use costs (Triton compiles, allocator growth) are not counted.",
    )
    decode_idle_batch: int = Field(0, ge=0, description="If > 0 (GPU): measure GPU idle time of decode at this batch.")
    step_timeline: bool = Field(
        False,
        description="GPU: record each timed step's rows and device time; print where the run's device time "
        "went against a floor (its bytes or its FLOPs), write timeline.json and timeline.png "
        "(framework/entrypoints/bench/timeline.py).",
    )
    shared_prefix_len: int = Field(
        0,
        ge=0,
        description="If > 0: every prompt starts with one shared random prefix of this many tokens "
        "(then `input_len` unique tokens), and the workload runs with prefix caching off, then on "
        "(framework/entrypoints/bench/prefix.py).",
    )
    num_turns: int = Field(
        0,
        ge=0,
        description="If > 0: the multi-turn workload (framework/entrypoints/bench/multiturn.py): `num_requests` "
        "conversations of this many turns over a random context of `context_len` tokens each, every turn adding "
        "`input_len` user and `output_len` generated tokens; runs without, then with the host KV tier.",
    )
    context_len: int = Field(8192, ge=1, description="Multi-turn: each conversation's own random context.")
    host_kv_gib: float = Field(64.0, gt=0.0, description="Multi-turn: the host KV tier of the run with it.")
    kv_pool_fraction: float = Field(
        0.25,
        gt=0.0,
        le=1.0,
        description="Multi-turn: the device KV pool holds this fraction of the conversations at their longest.",
    )
    output_dir: Optional[str] = Field(None, description="Where JSON and plot go; null = Hydra's run directory.")
    serve: bool = Field(
        False,
        description="Also send the workload through `mrv2 serve` (streaming completions over HTTP) and "
        "compare with offline (framework/entrypoints/bench/serve.py).",
    )
    request_rates: list[float] = Field(
        default_factory=list,
        description="With `serve`: Poisson request rates (req/s) to run after the all-at-once run.",
    )
    concurrencies: list[int] = Field(
        default_factory=list,
        description="With `serve`: closed-loop runs with at most this many requests in flight each (a user "
        "sends its next request when its stream ends), after the rate runs.",
    )
    requests_per_user: int = Field(
        2, ge=1, description="With `concurrencies`: each run sends concurrency x this many of the requests."
    )
    slo_ttft_ms: float = Field(
        1000.0, gt=0, description="With `serve`: goodput counts requests whose time to first token is within this."
    )
    slo_tpot_ms: float = Field(
        50.0, gt=0, description="With `serve`: goodput counts requests whose time per output token is within this."
    )

    @model_validator(mode="after")
    def _ranges(self) -> "BenchConfig":
        for key in ("input_len", "output_len"):
            lo, hi = getattr(self, key)
            if not 1 <= lo <= hi:
                raise ValueError(f"bench.{key} must be [lo, hi] with 1 <= lo <= hi, got [{lo}, {hi}]")
        return self


class KVEventsConfig(StrictModel):
    """KV-cache events for KV-aware routers (docs/scaling-out.md): every block the prefix cache stores or
    evicts, published over ZMQ as msgspec-encoded batches in vLLM's layout."""

    enabled: bool = Field(False, description="Publish KV-cache events (off: no socket is opened).")
    endpoint: str = Field(
        "tcp://127.0.0.1:5557",
        description="ZMQ PUB address bound by the engine; data-parallel rank r binds the TCP port + r.",
    )
    replay_endpoint: Optional[str] = Field(
        "tcp://127.0.0.1:5558",
        description="ZMQ ROUTER address answering replay requests (8-byte big-endian start sequence number); "
        "rank r binds the TCP port + r; null = no replay.",
    )
    topic: str = Field("kv-events", description="First frame of every published message (subscription filter).")
    buffer_steps: int = Field(10000, ge=1, description="Published batches kept for replay.")


class ServeConfig(StrictModel):
    """The HTTP server of `mrv2 serve` (docs/serving.md)."""

    host: str = Field("127.0.0.1", description="Address to bind; 0.0.0.0 exposes the server to the network.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 = any free port (the start-up line names it).")
    served_model_name: Optional[str] = Field(
        None,
        description="The model name clients send and /v1/models lists; null = the preset name, or the "
        "checkpoint directory's name.",
    )
    api_key: Optional[str] = Field(
        None, description="If set, every /v1 request needs the header `Authorization: Bearer <api_key>` (else 401)."
    )
    max_queued_requests: int = Field(
        1024,
        ge=0,
        description="Requests that may wait beyond the `scheduler.max_num_seqs` running ones; more get "
        "HTTP 503 with a Retry-After header.",
    )
    max_request_bytes: int = Field(
        32 << 20, ge=1024, description="Largest request body accepted; larger ones get HTTP 413."
    )
    log_requests: bool = Field(False, description="Log one line per request (id, endpoint, tokens, finish reason).")
    tool_call_parser: Optional[str] = Field(
        None,
        description="How chat replies' tool calls are parsed for tool_choice='auto': a registered tool parser "
        "(hermes, qwen3_coder, llama3_json, mistral, or a plugin's); null = detected from the chat template "
        "where it writes one known format (docs/tool_calling.md).",
    )
    reasoning_parser: Optional[str] = Field(
        None,
        description="Split chat replies' <think>...</think> section into reasoning_content: a registered "
        "reasoning parser (think, qwen3, deepseek_r1, or a plugin's); null = no splitting.",
    )
    chat_format: Literal["auto", "template", "harmony"] = Field(
        "auto",
        description="How chat requests are rendered and their replies read: auto = the harmony format (through "
        "openai-harmony) for gpt-oss checkpoints (GptOssForCausalLM), the chat template for any other; template or "
        "harmony force one (docs/tool_calling.md).",
    )
    lora_modules: list[str] = Field(
        default_factory=list,
        description="LoRA adapters served from start-up, as `name=path` (PEFT directories); clients select one "
        "by sending its name as `model`, /v1/models lists them (needs lora.enable=true; docs/lora.md).",
    )
    allow_runtime_lora: bool = Field(
        False, description="Accept POST /v1/load_lora_adapter and /v1/unload_lora_adapter (else refused)."
    )
    thinking_token_budget: Optional[int] = Field(
        None,
        ge=0,
        description="Default `thinking_token_budget` of chat requests (the request field overrides it): the "
        "thinking section ends after that many tokens (its `</think>` forced); null = no limit.",
    )
    engine_start_timeout_s: float = Field(
        600.0, gt=0.0, description="How long start-up waits for the engine process to load the model."
    )
    metrics_names: Literal["mrv2", "vllm"] = Field(
        "mrv2",
        description="Prefix of /metrics names: mrv2 (`mrv2:num_requests_waiting`, ...) or vllm "
        "(`vllm:num_requests_waiting`, ...) for routers that read only vLLM's names (docs/scaling-out.md).",
    )
    kv_events: KVEventsConfig = Field(default_factory=KVEventsConfig)
