"""The `lora:` section: LoRA adapters per request (docs/lora.md)."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, model_validator

from framework.config.base import StrictModel


class LoraConfig(StrictModel):
    """LoRA adapters: how many sit on the GPU at once, how many CPU copies are kept, the largest rank."""

    enable: bool = Field(False, description="Serve LoRA adapters (requests name one with `lora_request`).")
    max_loras: int = Field(4, ge=1, description="GPU adapter slots: adapters that running requests use at once.")
    max_cpu_loras: Optional[int] = Field(
        None, ge=1, description="Adapters kept in CPU memory (least recently used dropped first); null = max_loras."
    )
    max_rank: int = Field(16, ge=1, le=512, description="Largest adapter rank; a larger one is refused at load.")

    @model_validator(mode="after")
    def _cpu_holds_gpu(self) -> "LoraConfig":
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"lora.max_cpu_loras={self.max_cpu_loras} must be >= lora.max_loras={self.max_loras}")
        return self
