"""Start-up decisions: device, dtype, the model and its tokenizer, max_model_len and the KV cache size."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch

from framework.config.schema import ConfigError, Mrv2Config
from framework.layers.kernels.backend import set_kernel_backend
from framework.layers.kernels.kv_cache_dtype import kv_cache_torch_dtype
from framework.layers.kernels.pdl import resolve_programmatic_launch
from framework.layers.parallel.context import ParallelContext
from framework.layers.quantization import (
    QuantizationError,
    finish_quantization,
    is_quantized,
    set_activation_quantization,
)
from framework.models.embedded import resolve_model_source
from framework.models.llama import MLP, Attention, LlamaForCausalLM, fuse_projections
from framework.models.loaded import LoadedModel
from framework.models.loader import (
    CheckpointError,
    build_model,
    init_random_weights,
    load_safetensors_weights,
    mtp_tensor_prefixes,
    read_hf_config,
)
from framework.models.presets import preset_config
from framework.models.small_batch import SMALL_BATCH_MAX_TOKENS, enable_small_batch
from framework.models.tokenizer import checkpoint_eos_token_ids, eos_ids_of, load_tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_BYTES = 4 << 30  # default CPU KV budget when cache.num_blocks is not set
RETIRED_BACKEND_ENV = "MRV2_ATTENTION_BACKEND"  # became the config key kernels.backend


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available (use device=cpu or device=auto)")
    return torch.device(name)


def read_model_config(config: Mrv2Config) -> dict[str, Any]:
    """The HF config dict of the configured model (its config.json, a shipped directory's, or the preset's)."""
    source = resolve_model_source(config.model.path, config.model.preset)
    return read_hf_config(source.path) if source.path else preset_config(source.preset or "")


def small_batch_max_tokens(config: Mrv2Config, device: torch.device) -> int:
    """Token count up to which forwards take the small-batch GEMV kernels (0: never); see
    `kernels.small_batch`. `auto` means Hopper or newer, the GPUs the kernels were written for."""
    mode = config.kernels.small_batch
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    if mode == "off" or (mode == "auto" and not hopper):
        return 0
    return SMALL_BATCH_MAX_TOKENS


def load_model(config: Mrv2Config, device: torch.device, parallel: Optional[ParallelContext] = None) -> LoadedModel:
    """Build the configured model: safetensors weights from `model.path` or a shipped directory (`tiny`),
    else a preset's random weights.

    Under parallelism (`parallel`) this rank builds and reads only its part of the model.
    """
    parallel = ParallelContext() if parallel is None else parallel
    mc = config.model
    dtype = _DTYPES.get(mc.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    source = resolve_model_source(mc.path, mc.preset)
    if source.preset is not None and source.preset != mc.preset:
        logger.warning(
            "model.preset=%s: its trained files are not in the package (framework/models/embedded/); "
            "running the random-weight %s instead",
            mc.preset,
            source.preset,
        )
    hf_config = read_hf_config(source.path) if source.path else preset_config(source.preset or "")
    model = build_model(hf_config, dtype, device, parallel, mc.quantization)
    if source.path:
        load_safetensors_weights(model, source.path, mtp_tensor_prefixes(hf_config))  # MTP layers: the speculator's
        eos_ids = checkpoint_eos_token_ids(Path(source.path), hf_config)
    else:
        init_random_weights(model, mc.seed, float(hf_config.get("initializer_range", 0.02)))
        eos_ids = eos_ids_of(hf_config.get("eos_token_id"))
    try:  # quantized layers: checks, and online FP8 quantizes the loaded weights
        finish_quantization(model)
    except QuantizationError as err:
        raise CheckpointError(str(err)) from None
    set_activation_quantization(model, mc.fp8_activation_min_tokens, mc.fp8_moe_activation_min_tokens)
    model.eval()
    fuse_unquantized_projections(model)  # merged q/k/v and gate/up GEMMs (the loaded parameters become views)
    set_kernel_backend(model, config.kernels.backend)  # the model's layers hand it to every kernel dispatcher
    if RETIRED_BACKEND_ENV in os.environ:
        logger.warning(
            "%s is no longer read: set the config key kernels.backend=%s (LLM(kernel_backend=...)) instead",
            RETIRED_BACKEND_ENV,
            os.environ[RETIRED_BACKEND_ENV],
        )
    if isinstance(model, LlamaForCausalLM):  # dense and MoE decoders: the launch order of large decode batches
        model.longest_rows_first = config.kernels.longest_rows_first
    small_tokens = small_batch_max_tokens(config, device)
    pdl = resolve_programmatic_launch(config.kernels.programmatic_launch, device) if small_tokens else False
    if enable_small_batch(model, small_tokens, pdl):
        logger.info(
            "small-batch GEMV kernels for forwards of <= %d tokens%s",
            small_tokens,
            ", with programmatic dependent launch" if pdl else "",
        )
    # Decoder positions: max_position_embeddings, or an encoder-decoder's max_target_positions (Whisper: 448).
    limit = int(hf_config.get("max_position_embeddings") or hf_config.get("max_target_positions") or 2048)
    max_model_len = mc.max_model_len or limit
    if max_model_len > limit:
        raise ConfigError(f"model.max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}")
    model.check_max_model_len(max_model_len)
    return LoadedModel(
        model=model,
        hf_config=hf_config,
        tokenizer=load_tokenizer(source.path, hf_config),
        eos_token_id=eos_ids[0] if eos_ids else None,
        vocab_size=int(hf_config["vocab_size"]),
        max_model_len=max_model_len,
        device=device,
        dtype=dtype,
        kv_dtype=resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype, device),
        kernel_backend=config.kernels.backend,
        parallel=parallel,
        path=source.path,
        extra_eos_token_ids=eos_ids[1:],
        quantization=mc.quantization,
        fp8_activation_min_tokens=(mc.fp8_activation_min_tokens, mc.fp8_moe_activation_min_tokens),
    )


def fuse_unquantized_projections(model: torch.nn.Module) -> None:
    """`fuse_projections` for every attention and MLP whose projections are all 16-bit: quantized ones stay
    separate (merged quantized layouts are not built yet), and their layers keep the default path."""
    if not any(is_quantized(m) for m in model.modules()):
        fuse_projections(model)
        return
    for module in model.modules():
        if isinstance(module, (Attention, MLP)) and not any(is_quantized(m) for m in module.children()):
            module.fuse_projections()


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's element type for `cache.kv_cache_dtype` = `name`; `ConfigError` where the attention kernels
    cannot read it (FP8 e4m3 needs compute capability 8.9 or newer for Triton's conversions)."""
    dtype = kv_cache_torch_dtype(name, model_dtype)
    if dtype == torch.float8_e4m3fn and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ConfigError(
                f"cache.kv_cache_dtype={name} needs a GPU of compute capability 8.9 or newer (this one: "
                f"{capability[0]}.{capability[1]}); use fp8_e5m2 or auto"
            )
    return dtype


def kv_bytes_per_block(loaded: LoadedModel, block_size: int, extra_kv_layers: int = 0) -> int:
    """Bytes of one KV block over the target's layers plus `extra_kv_layers` (a draft model's, same shape), in
    the cache's element type."""
    shape = loaded.model.kv_cache_shape(1, block_size)
    per_layer = int(torch.tensor(shape).prod()) * loaded.kv_dtype.itemsize
    groups = getattr(loaded.model, "kv_groups", None)  # KV groups: a block id holds one layer per tensor
    layers = loaded.model.num_kv_layers if groups is None else groups.num_tensors
    return per_layer * (layers + extra_kv_layers)


def blocks_per_request(config: Mrv2Config, loaded: LoadedModel) -> int:
    """Block ids one request of max_model_len tokens may hold: one per block; with KV groups, that per full group,
    and per window group what its window reads while a step computes up to `max_num_batched_tokens` tokens."""
    bs = config.cache.block_size
    blocks = -(-loaded.max_model_len // bs)
    groups = getattr(loaded.model, "kv_groups", None)
    if groups is None:
        return blocks
    chunk = config.scheduler.max_num_batched_tokens
    return sum(min(blocks, -(-(w - 1 + chunk) // bs) + 1) if w else blocks for w in groups.group_windows)


def num_kv_blocks(
    config: Mrv2Config, loaded: LoadedModel, peak_activation_bytes: int = 0, extra_kv_layers: int = 0
) -> int:
    """KV blocks to allocate: configured, else sized from memory (GPU) or a fixed budget (CPU).

    On a GPU the process may bring the device to `gpu_memory_utilization` of its total memory: the KV cache
    gets what is left after what is in use now (weights, other processes) and the profiled activation peak.
    Never more than max_num_seqs full-length requests need. Raises `ConfigError` when the cache cannot hold
    one request of max_model_len tokens.
    """
    num_blocks = kv_blocks_that_fit(config, loaded, peak_activation_bytes, extra_kv_layers)
    check_kv_blocks(config, loaded, num_blocks)
    return num_blocks


def kv_blocks_that_fit(
    config: Mrv2Config, loaded: LoadedModel, peak_activation_bytes: int = 0, extra_kv_layers: int = 0
) -> int:
    """`num_kv_blocks` without the check (a parallel run takes the minimum over ranks first)."""
    bs = config.cache.block_size
    per_block = kv_bytes_per_block(loaded, bs, extra_kv_layers)
    blocks_per_req = blocks_per_request(config, loaded)
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    wanted = blocks_per_req * config.scheduler.max_num_seqs
    if loaded.device.type == "cuda":
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(loaded.device)
        budget = total * config.cache.gpu_memory_utilization - (total - free) - peak_activation_bytes
    else:
        budget = CPU_KV_CACHE_BYTES
    return min(wanted, max(int(budget // per_block), 0))


def check_kv_blocks(config: Mrv2Config, loaded: LoadedModel, num_blocks: int) -> None:
    """Raise `ConfigError` when `num_blocks` cannot hold one request of max_model_len tokens."""
    bs = config.cache.block_size
    blocks_per_req = blocks_per_request(config, loaded)
    if num_blocks < blocks_per_req:
        raise ConfigError(
            f"the KV cache has {num_blocks} blocks of {bs} tokens ({num_blocks * bs} tokens), too small for one "
            f"request of max_model_len={loaded.max_model_len}: raise cache.num_blocks or "
            "cache.gpu_memory_utilization, or lower model.max_model_len"
        )
