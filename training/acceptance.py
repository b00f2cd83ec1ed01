"""Greedy acceptance length of a drafter, simulated offline against the target's own greedy continuation.

With greedy verification, what speculative decoding accepts is determined by the drafts and the target's
greedy sequence alone: at each step the drafter sees the tokens produced so far (`seq[:i]`), proposes up to
k tokens, the target accepts the longest prefix equal to `seq[i:]` and adds one token of its own. So the
acceptance length (tokens per target step = 1 + accepted drafts) can be measured from one greedy sequence
and its hidden states, without the engine: a cross-check of the numbers the engine reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

# drafter(seq [i] int64 tokens produced so far, k) -> up to k draft token ids
Drafter = Callable[[torch.Tensor, int], list[int]]


@dataclass
class AcceptanceStats:
    """Counts over many verification steps, as the engine's spec-decode metrics count them."""

    steps: int = 0  # verification steps that had at least one draft
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        self.steps += 1
        self.drafted += num_draft
        self.accepted += num_accepted
        while len(self.drafted_per_position) < num_draft:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for j in range(num_draft):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += int(j < num_accepted)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted drafts per verification step (tokens the target produces per forward)."""
        return 1.0 + self.accepted / self.steps if self.steps else 1.0

    def as_dict(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "per_position_acceptance": [
                round(a / d, 4) if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ],
        }


def simulate(seq: torch.Tensor, prompt_len: int, drafter: Drafter, k: int, stats: AcceptanceStats) -> None:
    """Run greedy speculative decoding of `seq[prompt_len:]` with `drafter` proposing up to k tokens a step.

    As in the engine, the prefill samples the first output token with no drafts; each later step verifies
    at most (tokens still to produce - 1) drafts, since the target adds one token of its own.
    """
    i = prompt_len + 1
    n = len(seq)
    while i < n:
        budget = min(k, n - i - 1)
        if budget <= 0:  # one token left: a plain decode step
            i += 1
            continue
        drafts = drafter(seq[:i], budget)
        accepted = 0
        for j, token in enumerate(drafts):
            if token != int(seq[i + j]):
                break
            accepted += 1
        stats.record(len(drafts), accepted)
        i += accepted + 1


def ngram_drafter(prompt_lookup_min: int = 2, prompt_lookup_max: int = 5) -> Drafter:
    """Prompt lookup as mrv2's ngram speculator proposes: the longest suffix (n in [min, max]) that also
    ends earlier, at its latest such end e; drafts are the tokens after e, and positions past the end of the
    sequence, or every position when nothing matches, repeat the last token (always k drafts)."""

    def draft(seq: torch.Tensor, k: int) -> list[int]:
        tokens = seq.tolist()
        last = tokens[-1]
        for n in range(min(prompt_lookup_max, len(tokens) - 1), prompt_lookup_min - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):  # match ends at start + n - 1 <= len - 2
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + k]
                    return follow + [last] * (k - len(follow))
        return [last] * k

    return draft


def head_drafter(head, features: torch.Tensor) -> Drafter:  # type: ignore[no-untyped-def]
    """Drafts of a draft head (`DraftHead` interface) given the target's final hidden states of the sequence.

    `features` [L, H]: the target's hidden state of every position of the full greedy sequence (causal, so
    row p depends only on tokens 0..p). With `i` tokens produced, rows p = 0..i-2 read (token p+1, feature p)
    and the last one predicts token i; each further draft step appends a row at the next position that reads
    the previous draft token and the head's own previous output, as the speculator does.
    """

    @torch.no_grad()
    def draft(seq: torch.Tensor, k: int) -> list[int]:
        i = len(seq)
        if i < 2 or k <= 0:
            return []
        ids = seq[1:i].to(features.device)
        hidden = features[: i - 1]
        positions = torch.arange(i - 1, device=features.device)
        drafts: list[int] = []
        for step in range(k):
            out = head(ids.unsqueeze(0), hidden.unsqueeze(0), positions=positions.unsqueeze(0), step=step)[0]
            last = out[-1]
            token = int(head.draft_token_ids(last, step))
            drafts.append(token)
            ids = torch.cat([ids, ids.new_tensor([token])])
            hidden = torch.cat([hidden, last.unsqueeze(0).to(hidden.dtype)])
            positions = torch.cat([positions, positions[-1:] + 1])
        return drafts

    return draft


@torch.no_grad()
def greedy_sequence(hf_model, prompt_ids: Sequence[int], max_tokens: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """[len(prompt) + max_tokens] the prompt and the HF model's greedy continuation (end of text ignored)."""
    device = next(hf_model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], device=device)
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0].cpu()


@torch.no_grad()
def final_hidden_states(hf_model, seq: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """[L, H] the target's hidden states after its final norm (what mrv2 hands a speculator)."""
    device = next(hf_model.parameters()).device
    return hf_model.model(input_ids=seq.unsqueeze(0).to(device)).last_hidden_state[0]


def acceptance_table(
    sequences: Sequence[tuple[torch.Tensor, int]],
    drafters: dict[str, Callable[[int], Optional[Drafter]]],
    ks: Sequence[int],
) -> dict[str, dict[int, dict[str, object]]]:
    """{method: {k: stats}} over all (sequence, prompt_len); `drafters[m](index)` builds the drafter of one sequence."""
    table: dict[str, dict[int, dict[str, object]]] = {}
    for method, make in drafters.items():
        table[method] = {}
        for k in ks:
            stats = AcceptanceStats()
            for index, (seq, prompt_len) in enumerate(sequences):
                drafter = make(index)
                if drafter is not None:
                    simulate(seq, prompt_len, drafter, k, stats)
            table[method][k] = stats.as_dict()
    return table
