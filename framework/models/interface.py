"""What the loader, the runner and the engine ask of a model: the `Model` base every family implements.

A family (`LlamaForCausalLM`, `JambaForCausalLM`, `WhisperForConditionalGeneration`, ...) subclasses `Model` and
declares its KV geometry (`num_kv_layers`, `kv_heads`, `kv_head_dim`) and its forward; the paged KV cache's
shape, the LM head and the loader's hooks are written once here. Capabilities that only some families have
are their own small interfaces: `EncoderDecoder` (Whisper) and `RecurrentHybrid` (Jamba's `MambaHybrid`, Qwen3.5 /
Qwen3-Next), which the matching
model states require.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from framework.layers.parallel.context import ParallelContext
from framework.layers.parallel.linear import SINGLE, StackedPart
from framework.models.recurrent import RecurrentStateSpec, StateTensor


def paged_kv_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Shape of one layer's paged KV cache: [2 (K, V), num_blocks, block_size, kv_heads, head_dim]."""
    return (2, num_blocks, block_size, kv_heads, head_dim)


class Model(nn.Module, ABC):
    """A model family on the paged KV cache.

    `forward(input_ids [T], positions [T], kv_caches, attn_metadata, **model_state_inputs) -> [T, hidden]`
    returns hidden states; `compute_logits` turns the rows that are sampled into logits `[L, vocab]` in the
    model dtype. The runner allocates `num_kv_layers` tensors of `kv_cache_shape(...)`.

    A family whose forward calls `attn_metadata.kv_waits.layer(i)` before it stores to or reads `kv_caches[i]`
    sets `waits_per_kv_layer`: a KV connector then loads a step's blocks layer by layer while the forward runs.
    Without it a connector's loads are waited for whole before the forward.
    """

    # Registry name of the ModelState this family needs (None: chosen from the config's shape).
    model_state_name: ClassVar[Optional[str]] = None
    supports_parallel: ClassVar[bool] = False  # the class can hold one rank's part (tensor / pipeline parallel)
    # Every weight a quantized checkpoint may quantize sits in a column- / row-parallel linear layer
    # (framework/layers/quantization gives those their method).
    supports_quantization: ClassVar[bool] = False
    supports_lora: ClassVar[bool] = True  # LoRA adapters attach to its attention and MLP projections
    ctx: ParallelContext = SINGLE  # this rank's place (a parallel family sets its own)
    waits_per_kv_layer: ClassVar[bool] = False  # the forward calls `attn_metadata.kv_waits.layer(i)` (above)
    # The quantization `build_model` gave the layers (a `framework.layers.quantization.QuantScheme`; None: 16-bit):
    # random weights of a parallel rank rebuild the whole model with it.
    quant_scheme: Optional[Any] = None

    def __init__(self) -> None:
        super().__init__()
        # Parameter name -> checkpoint tensor it loads from (a tied LM head on a stage without the embedding).
        self.checkpoint_aliases: dict[str, str] = {}

    @classmethod
    @abstractmethod
    def from_hf_config(cls, hf_config: dict[str, Any], *args: Any) -> "Model":
        """Build (uninitialised) from an HF config dict (a parallel family also takes the `ParallelContext`)."""

    # ---- KV geometry ------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def num_kv_layers(self) -> int:
        """Attention layers on the paged KV cache (this pipeline stage's)."""

    @property
    @abstractmethod
    def kv_heads(self) -> int:
        """KV heads of one attention layer on this rank."""

    @property
    @abstractmethod
    def kv_head_dim(self) -> int:
        """Head dimension of the KV cache."""

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's paged KV cache (this rank's KV heads)."""
        return paged_kv_shape(num_blocks, block_size, self.kv_heads, self.kv_head_dim)

    # ---- output --------------------------------------------------------------------------------------------
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[L, hidden] -> [L, vocab] in the LM head's output dtype (the model dtype; the sampler widens them
        where it needs float32)."""
        return self.lm_head(hidden)

    def shareable_embeddings(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(token embedding [vocab, H], LM head weight [vocab, H]) on this rank, for a draft head to borrow
        (None: not held here)."""
        return None, None

    def check_max_model_len(self, max_model_len: int) -> None:
        """Raise `UnsupportedModelError` for a length this model cannot attend over correctly."""

    def cuda_graph_unsupported_reason(self) -> Optional[str]:
        """None when this model's decode forward may be captured as a CUDA graph; otherwise why not (logged)."""
        return None

    # ---- loader hooks ----------------------------------------------------------------------------------------
    def owns_checkpoint_tensor(self, name: str) -> bool:
        """False for checkpoint tensors of other pipeline stages (the loader skips them without reading)."""
        return True

    def stacked_tensor_part(self, name: str) -> Optional[StackedPart]:
        """Where a checkpoint tensor goes when not into the parameter of its name (MoE experts); None: by name."""
        return None


class EncoderDecoder(ABC):
    """A model with an encoder whose output every decoder step cross-attends (`EncoderDecoderModelState`)."""

    @abstractmethod
    def cross_kv_shape(self) -> tuple[int, ...]:
        """One request's cross-attention K/V: (decoder_layers, 2, enc_len, heads, head_dim)."""

    @abstractmethod
    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """Encoder input [B, ...] -> cross-attention K/V [B, *cross_kv_shape()]."""


class RecurrentHybrid(ABC):
    """A model with recurrent layers keeping per-slot state (`HybridRecurrentModelState`): it declares the state of
    each recurrent layer kind it has (`framework.models.recurrent`), and its forward takes each kind's
    `RecurrentStepInputs` under the kind's `forward_arg`."""

    @abstractmethod
    def recurrent_state_specs(self) -> list[RecurrentStateSpec]:
        """One spec per recurrent layer kind of the model."""


class MambaHybrid(RecurrentHybrid):
    """A model with Mamba layers keeping per-slot conv and SSM state (kind `mamba`, forward input `mamba`)."""

    @abstractmethod
    def mamba_state_shapes(self) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(number of Mamba layers, per-slot conv state shape, per-slot SSM state shape)."""

    def recurrent_state_specs(self) -> list[RecurrentStateSpec]:
        """The Mamba layers' conv state (model dtype) and SSM state (float32)."""
        num_layers, conv, ssm = self.mamba_state_shapes()
        return [RecurrentStateSpec("mamba", num_layers, (StateTensor(conv, None), StateTensor(ssm, torch.float32)))]
