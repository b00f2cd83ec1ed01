"""`LLM(...)`'s keyword arguments: each names one config key, so the offline API composes the same validated
config as `mrv2 run` overrides do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from framework.config.schema import Mrv2Config, load_config

# LLM(...) keyword -> dotted config key
LLM_KWARGS = {
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "model_state": "model.model_state",
    "quantization": "model.quantization",
    "fp8_activation_min_tokens": "model.fp8_activation_min_tokens",
    "fp8_moe_activation_min_tokens": "model.fp8_moe_activation_min_tokens",
    "seed": "seed",
    "device": "device",
    "runner": "runner.kind",
    "block_size": "cache.block_size",
    "num_kv_blocks": "cache.num_blocks",
    "gpu_memory_utilization": "cache.gpu_memory_utilization",
    "kv_cache_dtype": "cache.kv_cache_dtype",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "max_num_encoder_tokens": "scheduler.max_num_encoder_tokens",
    "max_logprobs": "sampler.max_logprobs",
    "logprobs_mode": "sampler.logprobs_mode",
    "logits_processors": "sampler.logits_processors",
    "async_scheduling": "scheduler.async_scheduling",
    "cuda_graphs": "runner.cuda_graphs",
    "full_step_cuda_graphs": "runner.full_step_cuda_graphs",
    "prefill_cuda_graphs": "runner.prefill_cuda_graphs",
    "prefill_cuda_graph_sizes": "runner.prefill_cuda_graph_sizes",
    "token_history_on_host": "cache.token_history_on_host",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "mamba_snapshot_slots": "cache.mamba_snapshot_slots",
    "host_kv_gib": "cache.host_kv_gib",
    "kv_connector": "cache.kv_connector",
    "task": "task",
    "pooling": "model.pooling",
    "kernel_backend": "kernels.backend",
    "small_batch_kernels": "kernels.small_batch",
    "longest_rows_first": "kernels.longest_rows_first",
    "programmatic_launch": "kernels.programmatic_launch",
    "small_batch_max_tokens": "model.small_batch_max_tokens",  # retired: load_config says why (RETIRED_KEYS)
    "tensor_parallel_size": "parallel.tensor_parallel_size",
    "pipeline_parallel_size": "parallel.pipeline_parallel_size",
    "speculative_config": "speculator",  # a dict of SpeculatorConfig fields, e.g. {"method": "ngram", ...}
    "enable_lora": "lora.enable",
    "max_loras": "lora.max_loras",
    "max_cpu_loras": "lora.max_cpu_loras",
    "max_lora_rank": "lora.max_rank",
}


def config_from_kwargs(model: str, kwargs: dict[str, Any]) -> Mrv2Config:
    """The config of `LLM(model, **kwargs)`: `model` a local HF directory or an embedded preset name, each keyword
    set at its config key (`LLM_KWARGS`); an unknown keyword is a `TypeError` naming the allowed ones."""
    data: dict[str, Any] = {"model": {"path": model, "preset": None} if Path(model).is_dir() else {"preset": model}}
    for key, value in kwargs.items():
        if key not in LLM_KWARGS:
            raise TypeError(f"LLM() got an unknown argument '{key}'; allowed: {', '.join(sorted(LLM_KWARGS))}")
        *parents, leaf = LLM_KWARGS[key].split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return load_config(data)
