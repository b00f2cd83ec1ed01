"""The engine's check of a request's LoRA adapter, before the request is queued (the runner loads it later)."""

from __future__ import annotations

from typing import Optional

from torch import nn

from framework.config.lora import LoraConfig
from framework.models.lora.adapter import LoraAdapterError, read_adapter
from framework.models.lora.projection import lora_targets
from framework.params.lora_request import LoRARequest
from framework.params.request_errors import InvalidRequestError


class LoraCatalog:
    """Adapters checked against the model (config, target modules, shapes, rank); each is read once, shapes only."""

    def __init__(self, config: LoraConfig, model: nn.Module) -> None:
        self.config = config
        self.targets = lora_targets(model) if config.enable else None
        self.checked: set[LoRARequest] = set()

    def check(self, request_id: str, lora: Optional[LoRARequest]) -> None:
        """Raise `InvalidRequestError` naming the request and the adapter's problem; nothing is loaded."""
        if lora is None or lora in self.checked:
            return
        if self.targets is None:
            raise InvalidRequestError(f"request '{request_id}': a LoRA adapter was given but lora.enable is false")
        if not isinstance(lora, LoRARequest):
            raise InvalidRequestError(f"request '{request_id}': lora_request must be a LoRARequest")
        try:
            read_adapter(lora, self.targets, self.config.max_rank, load=False)
        except (LoraAdapterError, OSError, ValueError, KeyError) as err:
            raise InvalidRequestError(f"request '{request_id}': {err}") from err
        self.checked.add(lora)

    def forget(self, lora: LoRARequest) -> None:
        """Check `lora` again next time (its files may change after an unload)."""
        self.checked.discard(lora)
