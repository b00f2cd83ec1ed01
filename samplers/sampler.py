"""The sampling pipeline: one logits row per sampled or verified token, parameters read by req_slot.

Order (each stage skipped when no request of the batch uses it, decided on the host):

1. non-finite logits (NaN, +inf) -> -inf, row flagged; 1b. the grammar bitmask of structured outputs
   (`samplers.structured`: -inf for every token a request's grammar forbids; raw logprobs see it too)
2. allowed_token_ids, 3. bad_words, 4. min_tokens, 4b. thinking_token_budget (a row past its budget keeps
   only the next end-of-thinking token), 5. logit_bias, 6. repetition/frequency/presence
   penalties, 7. custom logits processors
8. temperature (greedy rows: none), 9. top-k then top-p, 10. min-p
11. greedy rows take the argmax, the others Gumbel-max with (seed, position) noise
12. a row whose chosen token has a -inf logit (every token excluded) is flagged
13. logprobs of the chosen token and the top-k: raw (the model's logits, after step 1) or processed (the
    distribution the token was drawn from: after step 10, or after step 7 for greedy rows)

On CUDA, steps 8-12 run fused (`samplers.fused_sampling`: one or two reads of the logits, which are left
untouched, but for step 6), and step 1 joins them when no logprobs are wanted and the only edits are bias and
penalties (which keep NaN and +inf as they are; a finite logit they push past float32's range is reported
too). Step 6 runs as its own kernel on both paths, touching only the seen tokens of each row
(`samplers.penalties`), so the fused passes that follow stay plain reads. The
separate stages (`samplers.reference`: `processed_logits`, `pick_tokens`, which run the unfused Triton kernels on
CUDA) remain for processed logprobs and draft verification, which need the masked logits; on the CPU they are
the reference everywhere (`samplers.reference.sample_reference` is the same code, steps 1 and 8-12).

The logits arrive in the model dtype (`compute_logits`: bf16 on a GPU). When no stage before the fused kernels
reads or writes them (no logprobs, grammar, masks, bias, penalties or processors: plain, temperature, top-k,
top-p, min-p and greedy rows) the kernels read them as they are and widen each value in registers, which is
exact, so the tokens are those of a float32 copy, without making that copy. Every other stage, and the unfused
path, casts to float32 at its entry (`.float()`): each runs float32 arithmetic there anyway.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Optional

import torch

from samplers.fused_sampling import sample_fused_triton
from samplers.logits_processors import LogitsContext
from samplers.logprobs import LogprobsTensors, compute_logprobs
from samplers.reference import pick_tokens, processed_logits, row_errors
from samplers.sanitize import sanitize_logits
from samplers.states import SamplingStages, SamplingStates
from samplers.triton_utils import use_triton

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]

# SamplerOutput.errors codes, per logits row.
ROW_OK = 0
ROW_NONFINITE_LOGITS = 1
ROW_NO_TOKEN_LEFT = 2
ROW_ERROR_MESSAGES = {
    ROW_NONFINITE_LOGITS: "the model produced NaN or +inf logits",
    ROW_NO_TOKEN_LEFT: (
        "no token can be sampled: every token is excluded (allowed_token_ids, bad_words, a "
        "structured-output grammar that has ended before min_tokens, ...)"
    ),
}


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # [L] int64: one token per logits row
    logprobs: Optional[LogprobsTensors] = None  # [L, 1+k] when some request asked for logprobs
    errors: Optional[torch.Tensor] = None  # [L] int32: ROW_OK or an error code
    # [L, V] float32 logits the tokens were drawn from (after step 10; greedy rows after step 7), kept only
    # when asked (`keep_processed`): probabilistic draft verification compares them with the draft's q.
    processed_logits: Optional[torch.Tensor] = None


class Sampler:
    """The pipeline above, over `SamplingStates`; `logprobs_mode` picks raw or processed logprobs.

    `fused` picks steps 8-12: the fused Triton path (None: on CUDA tensors; True also runs it on the CPU
    under `TRITON_INTERPRET=1`, for tests) or the separate stages.
    """

    def __init__(
        self, states: SamplingStates, logprobs_mode: LogprobsMode = "raw_logprobs", fused: Optional[bool] = None
    ) -> None:
        self.states = states
        self.logprobs_mode = logprobs_mode
        self.fused = fused

    def __call__(
        self,
        logits: torch.Tensor,  # [L, V] float32 or the model dtype, bf16 (a float32 one may be overwritten)
        expanded_idx_mapping: torch.Tensor,  # [L] int32: logits row -> req_slot
        sample_positions: torch.Tensor,  # [L] int64: position of the token being sampled
        stages: SamplingStages,
        keep_processed: bool = False,
    ) -> SamplerOutput:
        want_logprobs = stages.num_logprobs >= 0
        fused = self.fused if self.fused is not None else use_triton(logits)
        # The fused path never materialises the processed logits: verification against draft probabilities
        # (`keep_processed`) and processed logprobs take the separate stages.
        if fused and not keep_processed and not (want_logprobs and self.logprobs_mode == "processed_logprobs"):
            return self._sample_fused(logits, expanded_idx_mapping, sample_positions, stages)
        logits, nonfinite = sanitize_logits(logits.float())  # 1.
        if stages.any_structured:  # 1b. grammar bitmask: first, so even raw logprobs see only allowed tokens
            logits = self.states.structured.apply(logits)  # type: ignore[union-attr]
        raw = None
        if want_logprobs and self.logprobs_mode == "raw_logprobs":
            raw = logits.clone() if (stages.any_logits_edit or stages.any_random) else logits
        logits = self.apply_logits_edits(logits, expanded_idx_mapping, sample_positions, stages)  # 2.-7.
        if stages.any_random:
            row = self.states.params.gather(expanded_idx_mapping)
            logits = processed_logits(
                logits,
                row,
                top_k_top_p=stages.any_top_k or stages.any_top_p,  # 8.-10.
                min_p=stages.any_min_p,
            )
            sampled = pick_tokens(logits, row, sample_positions)  # 11.
        else:
            sampled = logits.argmax(dim=-1)
        errors = row_errors(logits, sampled, nonfinite, ROW_NONFINITE_LOGITS, ROW_NO_TOKEN_LEFT)  # 12.
        logprobs = None
        if want_logprobs:  # 13.
            logprobs = compute_logprobs(raw if raw is not None else logits, sampled, stages.num_logprobs)
        return SamplerOutput(sampled, logprobs, errors, logits if keep_processed else None)

    def _sample_fused(
        self,
        logits: torch.Tensor,  # [L, V] float32 or the model dtype (may be overwritten by the edits)
        expanded_idx_mapping: torch.Tensor,  # [L] int32: logits row -> req_slot
        sample_positions: torch.Tensor,  # [L] int64
        stages: SamplingStages,
    ) -> SamplerOutput:
        """The same pipeline with steps 8-12 fused (and step 1 too when nothing reads the logits before)."""
        want_logprobs = stages.num_logprobs >= 0
        if stages.any_logits_read:  # else the fused kernels read the model dtype as it is (widened there, exactly)
            logits = logits.float()
        # Bias and penalties are finite arithmetic that keeps NaN and +inf as they are, so the fused kernels see
        # (and flag) them just as step 1 would; masks (which may hide them) and custom processors need step 1.
        separate_sanitize = (
            want_logprobs
            or bool(stages.processors)
            or stages.any_allowed_tokens
            or stages.any_bad_words
            or stages.any_min_tokens
            or stages.any_thinking_budget
            or stages.any_structured
        )
        nonfinite = None
        if separate_sanitize:
            logits, nonfinite = sanitize_logits(logits)  # 1.
        if stages.any_structured:  # 1b.
            logits = self.states.structured.apply(logits)  # type: ignore[union-attr]
        raw = None
        if want_logprobs:  # raw logprobs (processed ones take the unfused path); the fused steps write nothing
            raw = logits.clone() if stages.any_logits_edit else logits
        need_plan = stages.any_top_k or stages.any_top_p or stages.any_min_p
        logits = self.apply_logits_edits(logits, expanded_idx_mapping, sample_positions, stages)  # 2.-7.
        sampled, errors = sample_fused_triton(  # 8.-12.
            logits,
            expanded_idx_mapping,
            sample_positions.long(),
            self.states.params.slot_params,
            sanitize=not separate_sanitize,
            nonfinite=nonfinite,
            need_plan=need_plan,
            all_gather=stages.all_gather,
            nonfinite_code=ROW_NONFINITE_LOGITS,
            no_token_code=ROW_NO_TOKEN_LEFT,
        )
        logprobs = compute_logprobs(raw, sampled, stages.num_logprobs) if raw is not None else None  # 13.
        return SamplerOutput(sampled, logprobs, errors)

    def apply_logits_edits(
        self,
        logits: torch.Tensor,  # [L, V] float32
        expanded_idx_mapping: torch.Tensor,  # [L] int32
        sample_positions: torch.Tensor,  # [L] int64
        stages: SamplingStages,
    ) -> torch.Tensor:
        """Stages 2-7: masks, the thinking budget, bias, penalties and custom processors, in that order."""
        s = self.states
        if stages.any_allowed_tokens:
            logits = s.allowed_tokens.apply(logits, expanded_idx_mapping)
        if stages.any_bad_words:
            logits = s.bad_words.apply(logits, expanded_idx_mapping, sample_positions)
        if stages.any_min_tokens:
            logits = s.min_tokens.apply(logits, expanded_idx_mapping, sample_positions)
        if stages.any_thinking_budget:
            logits = s.thinking_budget.apply(logits, expanded_idx_mapping, sample_positions)
        if stages.any_logit_bias:
            logits = s.logit_bias.apply(logits, expanded_idx_mapping)
        if stages.any_penalties:
            logits = s.penalties.apply(logits, expanded_idx_mapping, sample_positions)
        if stages.processors:
            context = LogitsContext(expanded_idx_mapping, sample_positions, s.history)
            for i in stages.processors:
                logits = s.processors[i].apply(logits, context)
        return logits
