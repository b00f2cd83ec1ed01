"""Sampling: per-slot sampling states, the sampler pipeline and its kernels (with PyTorch references)."""

from samplers.gumbel import gumbel_sample_reference, uniform_noise_reference
from samplers.sampler import Sampler, SamplerOutput
from samplers.states import SamplingStages, SamplingStates
from samplers.top_k_top_p import apply_min_p_reference, apply_top_k_top_p_reference

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingStages",
    "SamplingStates",
    "apply_min_p_reference",
    "apply_top_k_top_p_reference",
    "gumbel_sample_reference",
    "uniform_noise_reference",
]
