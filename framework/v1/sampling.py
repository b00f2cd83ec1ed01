"""V1 sampling: per-row parameter tensors built from the persistent batch rows, then the samplers' functions.

The stages and their order are V2's (greedy | temperature -> top-k/top-p -> min-p -> Gumbel-max, a stage
skipped when no random row of the batch uses it), and the noise is keyed by (seed, position), so a seeded
request draws the same tokens under either runner.
"""

from __future__ import annotations

import numpy as np
import torch

from framework.v1.inputs import HostToDevice
from framework.v1.persistent_batch import PersistentBatch
from samplers.gumbel import gumbel_sample_reference
from samplers.top_k_top_p import apply_min_p_reference, apply_top_k_top_p_reference


def sample_rows(
    logits: torch.Tensor,  # [R, V] float32, one logits row per batch row
    pb: PersistentBatch,  # rows 0..R-1 are the batch rows
    sample_positions: torch.Tensor,  # [R] int64: position each row's sampled token will occupy
    to_device: HostToDevice,
) -> torch.Tensor:
    """[R] int64: one sampled token per batch row."""
    num_rows = logits.shape[0]
    greedy_ids = torch.argmax(logits, dim=-1)
    random = pb.temperature[:num_rows] > 0
    if not random.any():
        return greedy_ids

    def rows(name: str) -> torch.Tensor:
        array: np.ndarray = getattr(pb, name)
        return to_device(name, array[:num_rows], array.dtype.type, fresh=False)

    temperature = rows("temperature")
    is_greedy = temperature == 0
    scaled = logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(1)
    any_top_k = bool((random & (pb.top_k[:num_rows] > 0)).any())
    any_top_p = bool((random & (pb.top_p[:num_rows] < 1.0)).any())
    if any_top_k or any_top_p:
        scaled = apply_top_k_top_p_reference(scaled, rows("top_k"), rows("top_p"))
    if (random & (pb.min_p[:num_rows] > 0)).any():
        scaled = apply_min_p_reference(scaled, rows("min_p"))
    sampled = gumbel_sample_reference(scaled, rows("seed"), sample_positions)
    return torch.where(is_greedy, greedy_ids, sampled)
