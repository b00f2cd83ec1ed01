"""`LoadedModel`: a model ready to run and what the engine must know about it (built by `models.setup`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from framework.layers.parallel.context import ParallelContext
from framework.layers.quantization.fp8 import W8A8_MIN_TOKENS
from framework.layers.quantization.moe import MOE_W8A8_MIN_TOKENS
from framework.models.interface import Model
from framework.models.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine must know about it."""

    model: Model
    hf_config: dict[str, Any]
    tokenizer: Optional[Tokenizer]
    eos_token_id: Optional[int]
    vocab_size: int
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype  # the attention KV cache's element type (`cache.kv_cache_dtype`: dtype, or an FP8 type)
    kernel_backend: str = "auto"  # `kernels.backend`, handed to the model's layers (and a draft head's)
    parallel: ParallelContext = field(default_factory=ParallelContext)  # this rank's place (single process: 1 x 1)
    path: Optional[str] = None  # the HF directory the weights came from (a shipped one for `tiny`); None: random
    # The checkpoint's other end-of-sequence ids (a list's after the first): every request's stop tokens unless
    # ignore_eos, as vLLM adds them (`Engine.add_request`).
    extra_eos_token_ids: tuple[int, ...] = ()
    # `model.quantization`: the online format the target's weights took at load (None: the checkpoint's own); a
    # draft head read beside the target takes it too.
    quantization: Optional[str] = None
    # (`model.fp8_activation_min_tokens`, `model.fp8_moe_activation_min_tokens`): from how many tokens quantized
    # linear layers / experts quantize their activations (None: never); a draft head's layers follow them.
    fp8_activation_min_tokens: tuple[Optional[int], Optional[int]] = (W8A8_MIN_TOKENS, MOE_W8A8_MIN_TOKENS)
