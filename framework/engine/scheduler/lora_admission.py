"""Admission of requests with a LoRA adapter: the runner holds `lora.max_loras` adapters on the device at once."""

from __future__ import annotations

from typing import Sequence

from framework.engine.request import Request
from framework.params.lora_request import LoRARequest


def lora_fits(lora: LoRARequest, running: Sequence[Request], max_loras: int) -> bool:
    """Whether a request with adapter `lora` may run now: its adapter already runs, or a GPU slot is free (else
    it waits at the head of the queue until a running adapter's last request ends)."""
    active = {r.lora for r in running if r.lora is not None}
    return lora in active or len(active) < max_loras
