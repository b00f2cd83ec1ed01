"""LoRA adapters: PEFT reading and the adapter slots of the projections."""
