"""What an encoder-decoder request carries besides its decoder prompt: the encoder's input features."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EncoderInput:
    """One request's encoder input (e.g. Whisper's log-mel spectrogram).

    The encoder runs on it once, in the step that first schedules the request (again after a preemption,
    which frees everything the request held). `num_encoder_tokens` is what the scheduler budgets per step
    (`scheduler.max_num_encoder_tokens`): the encoder's output length.
    """

    features: torch.Tensor  # [num_mel_bins, num_frames] float32, on the host
    num_encoder_tokens: int
