"""The validated configuration of one mrv2 run.

Hydra composes YAML from `conf/`; :func:`load_config` turns the composed tree into these pydantic models.
Code reads only these objects, never a raw `DictConfig`. Unknown keys are forbidden everywhere, so a typo
fails before any work with a message that names the key and the allowed ones.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending key and what is allowed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ModelConfig(_Strict):
    """Which weights to run and how."""

    preset: Optional[str] = Field(
        "tiny", description="Embedded model, used when `path` is null: `tiny` (the trained code model shipped in "
        "the package; random weights until its files are there), or a random-weight geometry (`random_tiny`, "
        "`qwen3-0.6b`)."
    )
    path: Optional[str] = Field(None, description="Local HF directory: config.json + *.safetensors (+ tokenizer.json).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; auto = float32 on CPU, bfloat16 on GPU."
    )
    max_model_len: Optional[int] = Field(
        None, ge=2, description="Longest sequence (prompt + output); null = the model's own limit."
    )
    seed: int = Field(0, description="Seed of the random weights of an embedded preset.")
    model_state: Optional[str] = Field(
        None, description="Registry name of the ModelState to use; null = chosen from the model."
    )
    pooling: Literal["last", "mean", "cls"] = Field(
        "last", description="How embedding requests pool prompt hidden states unless `PoolingParams.pooling_type` "
        "says: the last token, the mean over tokens, or the first (CLS) token."
    )

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if self.path is None and self.preset is None:
            raise ValueError("set model.path (an HF directory) or model.preset (an embedded model)")
        return self


class RunnerConfig(_Strict):
    """Which model runner executes the steps (see "Runner selection" in the architecture page)."""

    kind: Literal["auto", "v2", "v1"] = Field("auto", description="auto picks V2 unless the config needs V1.")
    cuda_graphs: bool = Field(True, description="Replay captured CUDA graphs for decode batches (GPU only).")
    cuda_graph_sizes: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512],
        description="Decode batch sizes to capture; larger batches and mixed batches run eagerly.",
    )

    @model_validator(mode="after")
    def _sizes(self) -> "RunnerConfig":
        if not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1:
            raise ValueError("runner.cuda_graph_sizes must be a non-empty list of positive batch sizes")
        return self


class SamplerConfig(_Strict):
    """Default sampling parameters of `mrv2 run` (the API takes a `SamplingParams` per request)."""

    temperature: float = Field(0.0, ge=0.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = no top-k.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: Optional[int] = Field(None, description="Per-request seed; null = drawn from the run seed.")
    max_tokens: int = Field(32, ge=1)
    ignore_eos: bool = False
    max_logprobs: int = Field(20, ge=0, description="Largest `logprobs` / `prompt_logprobs` a request may ask for.")
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = Field(
        "raw_logprobs",
        description="Logprobs of the model's logits (raw) or of the distribution each token was drawn from, "
        "after penalties, masks, temperature, top-k/top-p and min-p (processed). Prompt logprobs are always raw.",
    )
    logits_processors: list[str] = Field(
        default_factory=list,
        description="Registered custom logits processors to enable (registry `LOGITS_PROCESSORS`, entry-point "
        "group `mrv2.logits_processors`); requests pass them arguments in `SamplingParams.extra_args`.",
    )


class SpeculatorConfig(_Strict):
    """Speculative decoding; `method: none` disables it."""

    method: str = Field("none", description="Registry name of the speculator, or none.")
    num_speculative_tokens: int = Field(0, ge=0, le=16)

    @model_validator(mode="after")
    def _tokens_match_method(self) -> "SpeculatorConfig":
        if self.method == "none" and self.num_speculative_tokens:
            raise ValueError("speculator.num_speculative_tokens must be 0 when speculator.method is none")
        return self


class SchedulerConfig(_Strict):
    """Continuous batching limits."""

    max_num_seqs: int = Field(64, ge=1, description="Most requests running at once (= request slots).")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget of one step; prefills are chunked to fit.")
    max_num_encoder_tokens: Optional[int] = Field(
        None, ge=1, description="Encoder-decoder models: encoder output positions (1500 per Whisper request) the "
        "encoder may compute in one step, for the requests that step admits; null = max_num_batched_tokens. "
        "One request is always admitted, however large.",
    )
    async_scheduling: bool = Field(
        True, description="Schedule step N+1 on the host while the device runs step N (outputs arrive one step later)."
    )
    check_invariants: bool = Field(
        False, description="After every step, verify the block pool and the request queues (free + in use = total "
        "blocks, each request in one queue, only running requests hold blocks); for tests and debugging."
    )


class CacheConfig(_Strict):
    """Paged KV cache."""

    block_size: int = Field(16, ge=1, le=1024)
    num_blocks: Optional[int] = Field(
        None, ge=1, description="KV blocks; null = enough for max_num_seqs full-length requests (CPU) or profiled (GPU)."
    )
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    token_history_on_host: Optional[bool] = Field(
        None, description="Keep the per-slot token history in pinned host memory read by the GPU; null = on a GPU."
    )


class RunConfig(_Strict):
    """What `mrv2 run` generates."""

    prompts: list[str] = Field(default_factory=lambda: ["def fibonacci(n):", "The quick brown fox"])
    show_progress: bool = True


class BenchConfig(_Strict):
    """The workload of `mrv2 bench`: random prompt ids, lengths uniform in the given ranges."""

    name: str = "bench"
    num_requests: int = Field(16, ge=1)
    input_len: tuple[int, int] = (16, 64)
    output_len: tuple[int, int] = (16, 64)
    temperature: float = Field(0.6, ge=0.0)
    seed: int = 0
    baselines: list[Literal["hf"]] = Field(default_factory=list, description="Also run these on the same requests.")
    hf_batch_size: int = Field(256, ge=1, description="Batch size of the HF transformers baseline.")
    decode_idle_batch: int = Field(0, ge=0, description="If > 0 (GPU): measure GPU idle time of decode at this batch.")
    output_dir: Optional[str] = Field(None, description="Where JSON and plot go; null = Hydra's run directory.")

    @model_validator(mode="after")
    def _ranges(self) -> "BenchConfig":
        for key in ("input_len", "output_len"):
            lo, hi = getattr(self, key)
            if not 1 <= lo <= hi:
                raise ValueError(f"bench.{key} must be [lo, hi] with 1 <= lo <= hi, got [{lo}, {hi}]")
        return self


class Mrv2Config(_Strict):
    """The whole run: one field per Hydra config group, plus device and seed."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    speculator: SpeculatorConfig = Field(default_factory=SpeculatorConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    bench: BenchConfig = Field(default_factory=BenchConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    task: Literal["generate", "embed"] = Field(
        "generate", description="What `mrv2 run` / `mrv2 bench` do: complete prompts, or embed them (one vector each). "
        "The engine serves both kinds of request either way."
    )
    seed: int = Field(0, description="Run seed: per-request sampling seeds are drawn from it.")

    @model_validator(mode="after")
    def _cross_checks(self) -> "Mrv2Config":
        if self.model.max_model_len is not None and self.cache.num_blocks is not None:
            capacity = self.cache.num_blocks * self.cache.block_size
            if capacity < self.model.max_model_len:
                raise ValueError(
                    f"cache.num_blocks={self.cache.num_blocks} x cache.block_size={self.cache.block_size} holds "
                    f"{capacity} tokens, fewer than one request of model.max_model_len={self.model.max_model_len}"
                )
        return self


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the sub-model at `loc` (the parent of the offending key)."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return sorted(model.model_fields)


def format_validation_error(err: ValidationError, schema: type[BaseModel] = Mrv2Config) -> str:
    """One readable line per problem: the dotted key, what is wrong, and what is allowed."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<config>"
        if e["type"] == "extra_forbidden":
            allowed = _allowed_keys(schema, loc)
            close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            lines.append(f"{key}: unknown key{hint}; allowed keys: {', '.join(allowed)}")
        else:
            value = e.get("input")
            got = "" if isinstance(value, (dict, list)) else f" (got {value!r})"  # a whole section is noise
            lines.append(f"{key}: {e['msg']}{got}")
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(data: Any) -> Mrv2Config:
    """Validate a composed config (a dict or an OmegaConf node); raise `ConfigError` on any problem."""
    if not isinstance(data, dict):
        from omegaconf import OmegaConf
        from omegaconf.errors import MissingMandatoryValue

        try:
            data = OmegaConf.to_container(data, resolve=True, throw_on_missing=True)
        except MissingMandatoryValue as err:
            key = getattr(err, "full_key", None) or "a key"
            raise ConfigError(f"invalid config:\n  {key}: required, but no value was given (set {key}=...)") from None
    try:
        return Mrv2Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
