"""Which LoRA adapter a request runs with (a plain type: the engine, the scheduler's hand-off and the server
carry it)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter: `name` identifies it (clients select it by name; it keys its prefix-cache blocks),
    `path` is its PEFT directory (`adapter_config.json` + `adapter_model.safetensors`). vLLM's class of the same
    name also takes an integer id; here the name is the id."""

    name: str
    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("LoRARequest.name must be a non-empty string")
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"LoRARequest '{self.name}': path must be a non-empty string")

    @property
    def int_id(self) -> int:
        """A positive 31-bit integer naming the adapter, the same in every process: the first bytes of the sha256
        of its name. KV-cache events carry it as vLLM's `lora_id` (vLLM's adapters have user-chosen integers)."""
        return int.from_bytes(hashlib.sha256(self.name.encode()).digest()[:4], "big") & 0x7FFFFFFF or 1

    @property
    def cache_key(self) -> str:
        """Mixed into every prefix-cache block hash of its requests: its blocks never meet another adapter's
        (or the base model's)."""
        return f"lora:{self.name}:{self.path}"
