"""Model-based speculators: `eagle` (EAGLE-1), `eagle3` (EAGLE-3) and `mtp` (multi-token prediction).

Each loads a draft head (`speculators.draft_heads`) from `speculator.model` (MTP: also from the target's own
checkpoint when that holds the layers), borrows the target's embedding and LM head where the checkpoint has
none, declares one paged KV layer of the target's shape, and drafts with a `HeadDrafter` after every step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, ClassVar, Optional

import torch

from framework.layers.kernels.backend import set_kernel_backend
from framework.layers.quantization import set_activation_quantization
from framework.models.loader import CheckpointError
from speculators.draft_heads import DraftHead, load_draft_head
from speculators.head_drafter import HeadDrafter
from speculators.interface import Proposal, ProposeInputs, Speculator

if TYPE_CHECKING:
    from framework.config.schema import SpeculatorConfig
    from framework.models.loaded import LoadedModel

logger = logging.getLogger(__name__)


class DraftHeadSpeculator(Speculator):
    """A draft head of kind `head_kind` on its own KV layer; subclasses name the kind and where it loads from."""

    head_kind: ClassVar[str] = ""

    def __init__(
        self, config: "SpeculatorConfig", loaded: "LoadedModel", max_num_reqs: int, device: torch.device
    ) -> None:
        super().__init__(config, loaded, max_num_reqs, device)
        if loaded.parallel.world_size > 1:  # a rank holds a slice of the embedding and LM head the head borrows
            raise CheckpointError(
                f"speculator.method={self.head_kind}: draft heads do not run under tensor or pipeline parallelism "
                "yet (they borrow the target's whole embedding and LM head); use parallel.tensor_parallel_size=1 or "
                "speculator.method=ngram"
            )
        self.head = self._load_head(config, loaded, device)
        set_activation_quantization(self.head, *loaded.fp8_activation_min_tokens)  # the target's thresholds
        set_kernel_backend(self.head, loaded.kernel_backend)  # the target's kernels.backend
        target = loaded.model
        self.head.share_target_weights(*target.shareable_embeddings())
        head_kv, target_kv = self.head.kv_cache_shape(1, 1), target.kv_cache_shape(1, 1)
        if head_kv != target_kv:
            raise CheckpointError(
                f"{self.head_kind} head: its KV heads x head_dim {head_kv[3:]} differ from "
                f"the target's {target_kv[3:]}; "
                "the draft KV layer shares the target's block layout"
            )
        try:
            aux = self.head.aux_layer_ids(int(loaded.hf_config["num_hidden_layers"])) or ()
        except ValueError as err:
            raise CheckpointError(f"{self.head_kind} head: {err}") from None
        self.drafter = HeadDrafter(self.head, max_num_reqs, loaded.max_model_len, device, aux_layer_ids=aux)

    def _model_path(self, config: "SpeculatorConfig", loaded: "LoadedModel") -> str:
        path: Optional[str] = getattr(config, "model", None)
        if path is None:
            raise CheckpointError(
                f"speculator.method={self.head_kind} needs speculator.model: a local directory "
                "with the draft head's config.json and safetensors"
            )
        return path

    def _load_head(self, config: "SpeculatorConfig", loaded: "LoadedModel", device: torch.device) -> DraftHead:
        path = self._model_path(config, loaded)
        return load_draft_head(path, self.head_kind, loaded.hf_config, device, loaded.dtype, loaded.quantization)

    @property
    def num_kv_layers(self) -> int:
        return 1

    @property
    def aux_hidden_layer_ids(self) -> tuple[int, ...]:
        return self.drafter.aux_layer_ids

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.drafter.bind_kv_cache(kv_caches[0])

    def capture_cuda_graphs(self, batch_sizes: list[int], block_size: int, max_blocks_per_req: int) -> None:
        if self.config.draft_cuda_graphs:
            self.drafter.capture_cuda_graphs(
                batch_sizes, self.num_speculative_tokens, block_size, max_blocks_per_req, self.loaded.dtype
            )

    def propose(self, inputs: ProposeInputs) -> Proposal:
        if inputs.attn_metadata is None:
            raise RuntimeError(f"the {self.head_kind} speculator needs the step's attention metadata")
        inputs.attn_metadata.kv_waits.all()  # a KV tier's loads of the draft's layers (after the target's) are in place
        drafts = self.drafter.propose(inputs, inputs.attn_metadata)
        return Proposal(drafts.to(torch.int32))


class EagleSpeculator(DraftHeadSpeculator):
    """EAGLE-1: one decoder layer over [token embedding, the target's final hidden state]."""

    name = "eagle"
    head_kind = "eagle"


class Eagle3Speculator(DraftHeadSpeculator):
    """EAGLE-3: the hidden states of three target layers, fused by `fc`, feed one midlayer."""

    name = "eagle3"
    head_kind = "eagle3"


class MTPSpeculator(DraftHeadSpeculator):
    """MTP layers of a DeepSeek-V3-style checkpoint, or the `mtp.*` head of a Qwen3.5 / Qwen3-Next one (chosen by
    the architecture); the first layer drafts every one of the k tokens.

    With `speculator.model` null, the layers are read from the target's checkpoint (`model.path`).
    """

    name = "mtp"
    head_kind = "mtp"

    def _model_path(self, config: "SpeculatorConfig", loaded: "LoadedModel") -> str:
        path: Optional[str] = getattr(config, "model", None)
        if path is not None:
            return path
        has_mtp = any(key in loaded.hf_config for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"))
        if not has_mtp or not loaded.path:
            raise CheckpointError(
                "speculator.method=mtp needs speculator.model, or a target checkpoint (model.path) "
                "whose config.json has num_nextn_predict_layers (DeepSeek layout) or mtp_num_hidden_layers "
                "(Qwen3.5 / Qwen3-Next mtp.* layout)"
            )
        return loaded.path

    def _load_head(self, config: "SpeculatorConfig", loaded: "LoadedModel", device: torch.device) -> DraftHead:
        head = super()._load_head(config, loaded, device)
        num_layers = int(getattr(head, "num_layers", 1))
        if num_layers > 1:
            logger.warning(
                "MTP checkpoint has %d layers; mrv2 drafts with the first one only (its KV covers the "
                "whole context; the others would see only draft positions)",
                num_layers,
            )
        return head
