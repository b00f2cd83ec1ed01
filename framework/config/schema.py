"""The validated configuration of one mrv2 run. Hydra composes YAML from `conf/`; :func:`load_config` turns the
composed tree into these pydantic models. Code reads only these objects, never a raw `DictConfig`. Unknown keys
are forbidden everywhere, so a typo fails before any work with a message that names the key and the allowed ones.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, ValidationError, model_validator

from framework.config.app import BenchConfig, RunConfig, ServeConfig
from framework.config.base import ConfigError, StrictModel, format_validation_error
from framework.config.kernels import KernelsConfig
from framework.config.kv_tier import KVTierFields
from framework.config.lora import LoraConfig
from framework.config.parallel import ParallelConfig
from framework.config.retired import check_retired

__all__ = [  # the sections of the other modules, re-exported: `from framework.config.schema import ...` has them all
    "BenchConfig",
    "CacheConfig",
    "ConfigError",
    "DynamicKConfig",
    "KernelsConfig",
    "ModelConfig",
    "Mrv2Config",
    "ParallelConfig",
    "RunConfig",
    "RunnerConfig",
    "SamplerConfig",
    "SchedulerConfig",
    "ServeConfig",
    "SpeculatorConfig",
    "format_validation_error",
    "load_config",
]


class ModelConfig(StrictModel):
    """Which weights to run and how."""

    preset: Optional[str] = Field(
        "tiny",
        description="Embedded model, used when `path` is null: `tiny` (the trained code model shipped in "
        "the package; random weights until its files are there), or a random-weight geometry (`random_tiny`, "
        "`qwen3-0.6b`).",
    )
    path: Optional[str] = Field(None, description="Local HF directory: config.json + *.safetensors (+ tokenizer.json).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; auto = float32 on CPU, bfloat16 on GPU."
    )
    max_model_len: Optional[int] = Field(None, ge=2, description="Longest prompt + output; null = the model's limit.")
    seed: int = Field(0, description="Seed of the random weights of an embedded preset.")
    quantization: Optional[Literal["fp8"]] = Field(
        None,
        description="Quantize a 16-bit model's linear weights at load: `fp8` = FP8 e4m3, one scale per output "
        "channel (half the weight bytes); null: the checkpoint's own format (docs/quantization.md).",
    )
    fp8_activation_min_tokens: Optional[int] = Field(
        128,
        ge=1,
        description="FP8 checkpoints (and online FP8) quantize their activations and run the FP8 x FP8 GEMM in "
        "forwards of at least this many tokens, counted as the layer sees them (a CUDA graph's padded size); "
        "smaller forwards keep 16-bit activations (W8A16: the dequantized weights' result). null: W8A16 at every "
        "size, for outputs that equal the dequantized model's (docs/quantization.md).",
    )
    fp8_moe_activation_min_tokens: Optional[int] = Field(
        256,
        ge=1,
        description="The same for FP8 MoE experts (the grouped FP8 x FP8 GEMMs): from this many tokens in a "
        "layer's call (16 rows per expert at 128 experts, top-8: where W8A8 overtook W8A16 on an H100); null: W8A16 "
        "experts at every size.",
    )
    model_state: Optional[str] = Field(
        None, description="Registry name of the ModelState to use; null = chosen from the model."
    )
    pooling: Literal["last", "mean", "cls"] = Field(
        "last",
        description="How embedding requests pool prompt hidden states unless `PoolingParams.pooling_type` "
        "says: the last token, the mean over tokens, or the first (CLS) token.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if self.path is None and self.preset is None:
            raise ValueError(
                "model.path is required when model.preset is null (model=hf): set model.path=/path/to/hf-dir, "
                "or model.preset to an embedded model"
            )
        return self


class RunnerConfig(StrictModel):
    """Which model runner executes the steps (see "Runner selection" in the architecture page)."""

    kind: Literal["auto", "v2", "v1"] = Field("auto", description="auto picks V2 unless the config needs V1.")
    cuda_graphs: bool = Field(True, description="Replay captured CUDA graphs for decode batches (GPU only).")
    cuda_graph_sizes: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512],
        description="Decode batch sizes to capture; larger batches and mixed batches run eagerly.",
    )
    full_step_cuda_graphs: bool = Field(
        True,
        description="V2, with cuda_graphs: capture input preparation, attention metadata, forward, logits, "
        "sampling and the post-update of a pure-decode step (one token per row, no speculation) as one graph per "
        "batch size; steps whose sampling needs host work (grammars, bad_words, prompt logprobs, ...) keep the "
        "forward-only graph. On the H200: nano 22.7K -> 24.1K and batch 1 451 -> 643 out tok/s "
        "(docs/architecture.md, the whole decode step as one graph).",
    )

    prefill_cuda_graphs: bool = Field(
        True,
        description="V2, with cuda_graphs: steps with prompt tokens replay the forward of a dense decoder as "
        "CUDA graph pieces cut at every attention, which runs eagerly between them (one rank, no draft model; "
        "framework/runner/graphs/prefill_graphs.py). On the H200: an 8,192-token step's host time 33 -> 9 ms, nano "
        "+3.5 % (docs/benchmarks.md).",
    )
    prefill_cuda_graph_sizes: list[int] = Field(
        default_factory=lambda: [512, 1024, 2048, 4096, 6144, 8192],
        description="Token counts to capture prefill pieces at (up to scheduler.max_num_batched_tokens, which is "
        "always captured); a step is padded to the next one.",
    )

    @model_validator(mode="after")
    def _sizes(self) -> "RunnerConfig":
        if not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1:
            raise ValueError("runner.cuda_graph_sizes must be a non-empty list of positive batch sizes")
        if self.prefill_cuda_graph_sizes and min(self.prefill_cuda_graph_sizes) < 1:
            raise ValueError("runner.prefill_cuda_graph_sizes must hold positive token counts")
        return self


class SamplerConfig(StrictModel):
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
    structured_outputs_fill_threads: Optional[int] = Field(
        None,
        ge=0,
        description="Host threads that fill the grammar bitmasks while the step is queued (null = min(8, CPUs); "
        "0 = the main thread fills them when the sampler needs them).",
    )


class DynamicKConfig(StrictModel):
    """Tuning of the dynamic-k policy (`speculator.dynamic_k: true`), which picks k every step."""

    acceptance_decay: float = Field(
        0.95,
        gt=0.0,
        lt=1.0,
        description="Decay of the per-position acceptance moving averages per observation, i.e. per step "
        "that verified drafts (closer to 1 = longer memory).",
    )
    prior_acceptance: float = Field(
        0.5, ge=0.0, le=1.0, description="Acceptance assumed at every draft position before any is measured."
    )
    explore_every: int = Field(
        32,
        ge=0,
        description="Every this many steps (or later when exploring is dear), three steps at another k "
        "than the best one: max_k every other time while the best is below it (measures every draft position's "
        "acceptance), else the k unused for longest (refreshes its measured cost); 0 = never.",
    )


class SpeculatorConfig(StrictModel):
    """Speculative decoding; `method: none` disables it."""

    method: str = Field("none", description="Registry name of the speculator (ngram, eagle, ...), or none.")
    num_speculative_tokens: int = Field(
        0, ge=0, le=16, description="Drafts per request and step (k); with dynamic_k, the largest k it may pick."
    )
    dynamic_k: bool = Field(
        False,
        description="Choose k in [0, num_speculative_tokens] every step from measured acceptance and step "
        "cost (dynamic-k, tuned by speculator.dynamic.*), instead of always num_speculative_tokens.",
    )
    prompt_lookup_min: int = Field(2, ge=1, le=16, description="ngram: shortest suffix that may match.")
    prompt_lookup_max: int = Field(5, ge=1, le=16, description="ngram: longest suffix tried (the longest match wins).")
    dynamic: DynamicKConfig = Field(default_factory=DynamicKConfig)
    model: Optional[str] = Field(
        None,
        description="eagle, eagle3, mtp: local directory of the draft head (config.json + safetensors); "
        "mtp may leave it null to read the MTP layers from the target checkpoint (model.path).",
    )
    draft_cuda_graphs: bool = Field(
        True,
        description="eagle, eagle3, mtp: replay CUDA graphs for the draft steps after the first (GPU, with "
        "runner.cuda_graphs); false runs them eagerly.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_dynamic_method(cls, data: Any) -> Any:
        """`method: dynamic` wrapping `dynamic.method` became a flag on the drafting method itself."""
        if isinstance(data, dict):
            inner = data.get("dynamic")
            wrapped = inner.get("method") if isinstance(inner, dict) else None
            if data.get("method") == "dynamic" or wrapped is not None:
                method = wrapped if wrapped not in (None, "dynamic") else "ngram"
                raise ValueError(
                    "speculator.method=dynamic and speculator.dynamic.method are gone: dynamic-k is a flag on the "
                    f"method that drafts, e.g. speculator.method={method} speculator.dynamic_k=true "
                    "(speculator=dynamic is ngram with dynamic_k=true)"
                )
        return data

    @model_validator(mode="after")
    def _tokens_match_method(self) -> "SpeculatorConfig":
        if self.method == "none" and self.num_speculative_tokens:
            raise ValueError("speculator.num_speculative_tokens must be 0 when speculator.method is none")
        if self.method != "none" and not self.num_speculative_tokens:
            raise ValueError(f"speculator.num_speculative_tokens must be >= 1 with speculator.method={self.method}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculator.prompt_lookup_min={self.prompt_lookup_min} exceeds "
                f"speculator.prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.dynamic_k and self.method == "none":
            raise ValueError("speculator.dynamic_k=true needs a drafting speculator.method (ngram, eagle, ...)")
        return self

    @model_validator(mode="after")
    def _draft_model_path(self) -> "SpeculatorConfig":
        if self.model is not None:
            from pathlib import Path

            if not Path(self.model).is_dir():
                raise ValueError(f"speculator.model '{self.model}' is not a directory")
            if not (Path(self.model) / "config.json").is_file():
                raise ValueError(f"speculator.model '{self.model}' has no config.json")
        elif self.method in ("eagle", "eagle3"):
            raise ValueError(f"speculator.method={self.method} needs speculator.model: the draft head's directory")
        return self


class SchedulerConfig(StrictModel):
    """Continuous batching limits."""

    max_num_seqs: int = Field(64, ge=1, description="Most requests running at once (= request slots).")
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Token budget of one step; prefills are chunked to fit."
    )
    max_num_encoder_tokens: Optional[int] = Field(
        None,
        ge=1,
        description="Encoder-decoder models: encoder output positions (1500 per Whisper request) the "
        "encoder may compute in one step, for the requests that step admits; null = max_num_batched_tokens. "
        "One request is always admitted, however large.",
    )
    async_scheduling: bool = Field(
        True, description="Schedule step N+1 on the host while the device runs step N (outputs arrive one step later)."
    )
    check_invariants: bool = Field(
        False,
        description="After every step, verify the block pool and the request queues (free + in use = total "
        "blocks, each request in one queue, only running requests hold blocks); for tests and debugging.",
    )


class CacheConfig(KVTierFields):
    """Paged KV cache (and the KV tier beside it: `KVTierFields`)."""

    block_size: int = Field(16, ge=1, le=1024)
    num_blocks: Optional[int] = Field(
        None,
        ge=1,
        description="KV blocks; null = enough for max_num_seqs full-length requests (CPU) or profiled (GPU).",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto",
        description="Element type of the attention KV cache: auto = the model's dtype; fp8 (= fp8_e4m3) or "
        "fp8_e5m2 store K and V in one byte (saturating cast, no scale): twice the tokens per GiB and half the bytes "
        "decode attention reads, at the cost of rounding the cached K and V (docs/kernels.md#fp8-kv-cache).",
    )
    token_history_on_host: Optional[bool] = Field(
        None, description="Keep the per-slot token history in pinned host memory read by the GPU; null = on a GPU."
    )
    enable_prefix_caching: Optional[bool] = Field(
        None,
        description="Share the KV blocks of common prompt prefixes between requests (docs/prefix-caching.md); "
        "null = on when the model's ModelState supports it, true = required (an error if it does not), false = off.",
    )
    free_window_blocks: bool = Field(
        True,
        description="Models whose every attention layer has a sliding window (Mistral): a request gives back the "
        "KV blocks that fell out of the window, so it holds about window / block_size + 1 blocks whatever its "
        "length (docs/sliding-window.md#kv-memory).",
    )
    kv_groups: bool = Field(
        False,
        description="Models mixing full-attention and sliding-window layers (gpt-oss, Gemma 3): one block table per "
        "KV group from one block pool, so window layers keep only the blocks their window reads "
        "(docs/sliding-window.md#kv-memory): Gemma 3 4B keeps 5.3x less KV per token at 32K context, slower per "
        "request so far (the page has the figures). Off: every layer shares one table and keeps every block.",
    )
    mamba_snapshot_slots: Optional[int] = Field(
        None,
        ge=1,
        description="Mamba hybrids with prefix caching: how many recurrent-state snapshots (each every "
        "Mamba layer's conv and SSM state, at the end of a cached block) are kept on the device; a cache hit ends "
        "at the last hit block with one. null = 2 x scheduler.max_num_seqs.",
    )


class Mrv2Config(StrictModel):
    """The whole run: one field per Hydra config group, plus device and seed."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    speculator: SpeculatorConfig = Field(default_factory=SpeculatorConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    bench: BenchConfig = Field(default_factory=BenchConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    task: Literal["generate", "embed"] = Field(
        "generate",
        description="What `mrv2 run` / `mrv2 bench` do: complete prompts, or embed them (one vector each). "
        "The engine serves both kinds of request either way.",
    )
    seed: int = Field(0, description="Run seed: per-request sampling seeds are drawn from it.")

    @model_validator(mode="before")
    @classmethod
    def _no_retired_keys(cls, data: Any) -> Any:
        """An old key names where its setting went (framework/config/retired.py), not just "extra input"."""
        if isinstance(data, dict):
            check_retired(data)
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> "Mrv2Config":
        if self.model.max_model_len is not None and self.cache.num_blocks is not None:
            capacity = self.cache.num_blocks * self.cache.block_size
            if capacity < self.model.max_model_len:
                raise ValueError(
                    f"cache.num_blocks={self.cache.num_blocks} x cache.block_size={self.cache.block_size} holds "
                    f"{capacity} tokens, fewer than one request of model.max_model_len={self.model.max_model_len}"
                )
        if self.parallel.data_parallel_size > 1 and self.parallel.master_port is not None:
            raise ValueError("parallel.master_port: each data-parallel rank needs its own rendezvous; leave it null")
        if self.parallel.world_size > 1:
            if self.runner.kind == "v1":
                raise ValueError(
                    "parallel: tensor/pipeline parallelism runs on the V2 runner only; use runner=v2 or runner=auto"
                )
            if self.device == "cpu" and self.parallel.backend == "nccl":
                raise ValueError("parallel.backend=nccl needs GPUs; device=cpu runs with parallel.backend=gloo")
            if self.parallel.pipeline_parallel_size > 1 and self.speculator.method != "none":
                raise ValueError(
                    f"speculator.method={self.speculator.method}: speculative decoding does not run "
                    "under pipeline parallelism yet (only the last stage has logits to verify drafts); "
                    "use parallel.pipeline_parallel_size=1"
                )
        return self


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
    if isinstance(data, dict):
        check_retired(data)
    try:
        return Mrv2Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, Mrv2Config)) from None
