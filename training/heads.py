"""Train EAGLE and MTP draft heads for the frozen tiny model, each for a wall-clock budget.

The head classes are parameters (`head_cls` with mrv2's `DraftHead` interface: `head(input_ids, hidden,
positions, step)`, `compute_logits`, `share_target_weights`, `save_pretrained`), so this file knows the
recipe, not the layout. Shift convention of the heads: row p reads the token at p + 1 and a hidden state of
position p, runs at position p, and its output predicts the token at p + 2.

Recipe (both kinds): the target's final (post-norm) hidden states f and its next-token distributions are
computed on the fly, with no gradient, from random training windows. The head's token loss is the
cross-entropy against the target's distribution (distillation: acceptance is agreement with the target,
not with the data). EAGLE also regresses its output onto the target's next feature (smooth L1, as EAGLE-1:
L = L_reg + 0.1 L_cls) and sees uniform noise on its input features. Both are unrolled for
`unroll_steps` draft steps, each later step reading the head's own previous output as the hidden state, as
the speculator does at k > 1 (later steps weigh less). The head's decoder block starts as a copy of the
target's last layer.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from training.base_model import WindowSampler, autocast, val_windows

Log = Callable[[str], None]


@dataclass(frozen=True)
class HeadSettings:
    """Optimiser, batch and recipe of one head."""

    seq_len: int = 512
    batch_size: int = 32
    peak_lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    train_seconds: float = 75.0
    unroll_steps: int = 2
    unroll_decay: float = 0.6  # weight of draft step s is decay**s
    feature_weight: float = 1.0  # EAGLE's L_reg
    token_weight: float = 0.1  # EAGLE's L_cls (MTP uses the token loss alone)
    input_noise: float = 0.1  # EAGLE: U(-a, a) added to the target features it reads
    log_every_steps: int = 25
    max_val_windows: int = 64


@dataclass
class HeadResult:
    """The head's training log and its held-out next-token agreement with the target, per draft step."""

    kind: str
    steps: int = 0
    train_seconds: float = 0.0
    curve: list[dict[str, float]] = field(default_factory=list)  # {step, seconds, loss}
    # fraction of held-out positions where the head's greedy token equals the target's greedy token, at draft
    # step s, given that every earlier step was fed the target's own features (s = 0) or the head's (s > 0)
    val_top1_agreement: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, device: torch.device) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """[B, N, H] the target's final hidden states (after its last norm: what mrv2's runner hands a speculator)."""
    with autocast(device):
        return target.model(input_ids=input_ids).last_hidden_state.float()


def init_from_target_layer(head_layer: torch.nn.Module, target_layer: torch.nn.Module) -> None:
    """Copy every parameter the head's decoder layer shares by name with the target's last layer."""
    own = dict(head_layer.named_parameters())
    with torch.no_grad():
        for name, p in target_layer.named_parameters():
            if name in own and own[name].shape == p.shape:
                own[name].copy_(p.float())


def _unrolled_losses(
    head,
    kind: str,
    lm_head: torch.Tensor,
    window: torch.Tensor,  # type: ignore[no-untyped-def]
    feats: torch.Tensor,
    settings: HeadSettings,
    training: bool,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Weighted loss over `unroll_steps` draft steps, and per step the [B, M] agreement with the target's argmax.

    window [B, S+1] tokens; feats [B, S, H] target features of positions 0..S-1. Draft step s runs at
    positions p + s (p = 0 .. S-2-s), reads token p + s + 1 and (s = 0) the target feature at p or (s > 0)
    the head's output of step s - 1, and predicts the token at p + s + 2, whose target distribution is
    softmax(lm_head @ f[p + s + 1]) (`lm_head` [vocab, H]: the target's, no norm after its final one).
    """
    b, s_len, _ = feats.shape
    hidden = feats[:, : s_len - 1]
    if training and kind == "eagle" and settings.input_noise > 0:
        hidden = hidden + (torch.rand_like(hidden) * 2 - 1) * settings.input_noise
    total = feats.new_zeros(())
    agreements: list[torch.Tensor] = []
    positions = torch.arange(s_len - 1, device=feats.device).expand(b, -1)
    for step in range(settings.unroll_steps):
        m = s_len - 1 - step  # rows this step still has a target for
        ids = window[:, step + 1 : step + 1 + m]
        out = head(ids, hidden[:, :m], positions=positions[:, :m] + step, step=step)  # [B, m, H]
        next_feats = feats[:, step + 1 : step + 1 + m]
        with torch.no_grad():
            target_logits = F.linear(next_feats, lm_head).float()
            target_probs = target_logits.softmax(-1)
        logits = head.compute_logits(out, step)
        token_loss = -(target_probs * logits.log_softmax(-1)).sum(-1).mean()
        if kind == "eagle":
            loss = settings.feature_weight * F.smooth_l1_loss(out, next_feats) + settings.token_weight * token_loss
        else:
            loss = token_loss
        total = total + (settings.unroll_decay**step) * loss
        agreements.append((logits.argmax(-1) == target_logits.argmax(-1)).float())
        hidden = out[:, : m - 1]  # step s+1 reads this step's output at the same row
    return total, agreements


def train_head(
    head_cls: type,
    kind: str,
    target,  # type: ignore[no-untyped-def]
    target_config: dict[str, Any],
    head_config_fn: Callable[..., dict[str, Any]],
    train_stream: np.ndarray,
    val_stream: np.ndarray,
    settings: HeadSettings,
    seed: int,
    device: torch.device,
    log: Log,
    head_kwargs: dict[str, Any] | None = None,
):  # type: ignore[no-untyped-def]
    """Build a `kind` head of class `head_cls` for the frozen `target`, train it, return (head, HeadResult)."""
    torch.manual_seed(seed)
    config = head_config_fn(kind, target_config)
    head = head_cls(config, **(head_kwargs or {})).to(device)
    last_layer = target.model.layers[-1]
    block = head.layers[0] if kind == "eagle" else head.layer(0)
    init_from_target_layer(block, last_layer)
    if kind == "mtp":  # the MTP output goes through shared_head.norm then the LM head, as the target's final norm
        with torch.no_grad():
            block.shared_head.norm.weight.copy_(target.model.norm.weight.float())
    embed = target.model.embed_tokens.weight.detach()
    lm_head = target.lm_head.weight.detach()
    head.share_target_weights(embed, lm_head)
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.peak_lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    sampler = WindowSampler(train_stream, settings.seq_len, settings.batch_size, seed + 1, device)
    result = HeadResult(kind=kind)
    head.train()
    start = time.time()
    step = 0
    running = torch.zeros((), device=device)
    while time.time() - start < settings.train_seconds:
        frac = (time.time() - start) / settings.train_seconds
        lr = (
            settings.peak_lr
            * min(1.0, (step + 1) / settings.warmup_steps)
            * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
        )
        for g in opt.param_groups:
            g["lr"] = lr
        inputs, targets = sampler.next()
        window = torch.cat([inputs, targets[:, -1:]], dim=1)  # [B, S+1]
        feats = target_features(target, inputs, device)
        with autocast(device):
            loss, _ = _unrolled_losses(head, kind, lm_head, window, feats, settings, training=True)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        opt.step()
        running += loss.detach()
        step += 1
        if step % settings.log_every_steps == 0:
            mean = float(running) / settings.log_every_steps
            running.zero_()
            result.curve.append({"step": step, "seconds": round(time.time() - start, 2), "loss": round(mean, 4)})
            if step % (settings.log_every_steps * 4) == 0:
                log(f"{kind} head step {step} loss {mean:.4f}")
    result.steps, result.train_seconds = step, round(time.time() - start, 2)
    result.val_top1_agreement = held_out_agreement(head, kind, target, val_stream, settings, device)
    log(f"{kind} head: {step} steps, held-out top-1 agreement per draft step {result.val_top1_agreement}")
    head.eval()
    return head, result


@torch.no_grad()
def held_out_agreement(
    head,
    kind: str,
    target,
    val_stream: np.ndarray,
    settings: HeadSettings,  # type: ignore[no-untyped-def]
    device: torch.device,
) -> list[float]:
    """Per draft step, the fraction of held-out positions where the head's argmax equals the target's."""
    head.eval()
    windows = val_windows(val_stream, settings.seq_len, settings.max_val_windows)
    sums = [0.0] * settings.unroll_steps
    counts = [0] * settings.unroll_steps
    for i in range(0, len(windows), settings.batch_size):
        window = windows[i : i + settings.batch_size].to(device)
        feats = target_features(target, window[:, :-1], device)
        with autocast(device):
            _, agreements = _unrolled_losses(head, kind, target.lm_head.weight, window, feats, settings, training=False)
        for s, a in enumerate(agreements):
            sums[s] += float(a.sum())
            counts[s] += a.numel()
    head.train()
    return [round(sums[s] / max(counts[s], 1), 4) for s in range(settings.unroll_steps)]


def save_head(head, out_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """The head's own tensors in bf16 (config.json + model.safetensors) through its `save_pretrained`."""
    head.to(torch.bfloat16).save_pretrained(out_dir)
