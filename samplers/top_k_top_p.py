"""Top-k, top-p (nucleus) and min-p masking: excluded tokens get -inf."""

from __future__ import annotations

import torch


def apply_top_k_top_p_reference(
    logits: torch.Tensor,  # [L, V] float32, temperature-scaled
    top_k: torch.Tensor,  # [L] int32, <= 0 = disabled
    top_p: torch.Tensor,  # [L] float32, 1.0 = disabled
) -> torch.Tensor:
    """[L, V]: keep the k most likely tokens, then the smallest prefix whose probability reaches p."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab)).unsqueeze(1)
    drop = ranks >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly more likely tokens
    drop |= (mass_before >= top_p.unsqueeze(1)) & (ranks > 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p_reference(
    logits: torch.Tensor,  # [L, V] float32
    min_p: torch.Tensor,  # [L] float32, 0 = disabled
) -> torch.Tensor:
    """[L, V]: drop tokens whose probability is below min_p times the most likely token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))
