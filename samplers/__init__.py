"""Sampling: per-slot sampling states, the sampler pipeline and its kernels (with PyTorch references).

Every kernel has a PyTorch `name_reference`, a Triton `name_triton` and a dispatching `name` (Triton on
CUDA tensors). See the "Sampling" docs page for the pipeline order and every parameter.
"""

from samplers.gumbel import gumbel_sample, gumbel_sample_reference, gumbel_sample_triton, uniform_noise_reference
from samplers.logits_processors import LogitsContext, LogitsProcessor
from samplers.logprobs import LogprobsTensors, compute_logprobs
from samplers.prompt_logprobs import PromptLogprobsPiece
from samplers.sampler import ROW_ERROR_MESSAGES, Sampler, SamplerOutput
from samplers.states import SamplingStages, SamplingStates
from samplers.top_k_top_p import (
    apply_min_p,
    apply_min_p_reference,
    apply_top_k_top_p,
    apply_top_k_top_p_reference,
)

__all__ = [
    "LogitsContext",
    "LogitsProcessor",
    "LogprobsTensors",
    "PromptLogprobsPiece",
    "ROW_ERROR_MESSAGES",
    "Sampler",
    "SamplerOutput",
    "SamplingStages",
    "SamplingStates",
    "apply_min_p",
    "apply_min_p_reference",
    "apply_top_k_top_p",
    "apply_top_k_top_p_reference",
    "compute_logprobs",
    "gumbel_sample",
    "gumbel_sample_reference",
    "gumbel_sample_triton",
    "uniform_noise_reference",
]
