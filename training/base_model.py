"""Train the tiny Qwen3-architecture code model for a wall-clock budget and save it as an HF directory.

The budget is time, not steps, so the run fits one call on the GPU machine whatever its speed. The
learning rate follows the elapsed fraction of the budget (linear warm-up over the first steps, then cosine
to 10%). Held-out loss is measured at fixed intervals and the weights with the lowest held-out loss are
the ones saved: the corpus is small, so a fast machine runs many epochs and would otherwise overfit.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

Log = Callable[[str], None]


@dataclass(frozen=True)
class ModelShape:
    """Geometry of the model; the default is ~14.6M parameters (29 MB of bf16 weights, tied embeddings)."""

    vocab_size: int = 8192
    hidden_size: int = 384
    intermediate_size: int = 896
    num_layers: int = 8
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 1024


@dataclass(frozen=True)
class TrainSettings:
    """Optimiser and batch settings of the base model."""

    seq_len: int = 1024
    batch_size: int = 32
    peak_lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    train_seconds: float = 330.0
    eval_every_seconds: float = 30.0
    log_every_steps: int = 25
    max_val_windows: int = 512
    compile: bool = False


@dataclass
class TrainResult:
    """What the log and the report need from the base-model run."""

    steps: int = 0
    tokens_seen: int = 0
    train_seconds: float = 0.0
    best_val_loss: float = float("inf")
    best_step: int = 0
    final_val_loss: float = float("inf")
    curve: list[dict[str, float]] = field(default_factory=list)  # {step, tokens, seconds, loss, lr}
    val_curve: list[dict[str, float]] = field(default_factory=list)  # {step, tokens, seconds, val_loss}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def qwen3_config(shape: ModelShape, eos_token_id: int, pad_token_id: int):  # type: ignore[no-untyped-def]
    """The transformers `Qwen3Config` of `shape` (tied embeddings, no sliding window, no bos token)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        attention_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )


def build_model(shape: ModelShape, eos_token_id: int, pad_token_id: int, seed: int, device: torch.device):  # type: ignore[no-untyped-def]
    """A freshly initialised fp32 `Qwen3ForCausalLM` (seeded), SDPA attention on the GPU."""
    from transformers import Qwen3ForCausalLM

    config = qwen3_config(shape, eos_token_id, pad_token_id)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    return model.to(device)


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on the GPU; full precision on the CPU (smoke runs), where bf16 is slow."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class WindowSampler:
    """Random windows of `seq_len + 1` tokens from one token stream, from a seeded generator."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int, device: torch.device) -> None:
        if len(stream) < seq_len + 2:
            raise RuntimeError(f"token stream of {len(stream)} tokens is shorter than one window of {seq_len + 1}")
        self.tokens = torch.from_numpy(stream.astype(np.int64)).to(device)  # [N]
        self.seq_len, self.batch_size = seq_len, batch_size
        self.offsets = torch.arange(seq_len + 1, device=device)  # [S+1]
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.device = device

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs [B, S] and targets [B, S] (targets = inputs shifted by one token)."""
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=self.gen)
        window = self.tokens[starts.to(self.device).unsqueeze(1) + self.offsets]  # [B, S+1]
        return window[:, :-1], window[:, 1:]


def val_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """[W, S+1] consecutive non-overlapping windows of the held-out stream (the same ones every time)."""
    n = min((len(stream) - 1) // seq_len, max_windows)
    if n < 1:
        raise RuntimeError(f"held-out stream of {len(stream)} tokens is shorter than one window of {seq_len + 1}")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(stream[idx].astype(np.int64))


@torch.no_grad()
def held_out_loss(model, windows: torch.Tensor, batch_size: int, device: torch.device) -> float:  # type: ignore[no-untyped-def]
    """Mean next-token cross-entropy (nats) over every position of the held-out windows."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size].to(device)
        with autocast(device):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total += float(loss)
        count += batch[:, 1:].numel()
    model.train(was_training)
    return total / count


def lr_at(settings: TrainSettings, step: int, elapsed_fraction: float) -> float:
    """Linear warm-up by step, then cosine decay to `min_lr_ratio` by the elapsed fraction of the budget."""
    warm = min(1.0, (step + 1) / settings.warmup_steps)
    progress = min(1.0, max(0.0, elapsed_fraction))
    cosine = settings.min_lr_ratio + (1 - settings.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return settings.peak_lr * warm * cosine


def _optimizer(model, settings: TrainSettings, device: torch.device) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    """AdamW; norms and the (tied) embedding are not decayed."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "embed" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=settings.peak_lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def train_base_model(
    model,  # type: ignore[no-untyped-def]
    train_stream: np.ndarray,
    val_stream: np.ndarray,
    settings: TrainSettings,
    seed: int,
    device: torch.device,
    log: Log,
    deadline: Optional[float] = None,
) -> TrainResult:
    """Train until `settings.train_seconds` (or the absolute `deadline`, time.time()) pass; keep the best weights."""
    sampler = WindowSampler(train_stream, settings.seq_len, settings.batch_size, seed, device)
    windows = val_windows(val_stream, settings.seq_len, settings.max_val_windows)
    opt = _optimizer(model, settings, device)
    forward = torch.compile(model) if settings.compile else model
    result = TrainResult()
    best_state: Optional[dict[str, torch.Tensor]] = None
    tokens_per_step = settings.batch_size * settings.seq_len
    start = time.time()
    budget = settings.train_seconds if deadline is None else min(settings.train_seconds, deadline - start)
    next_eval = settings.eval_every_seconds
    running = torch.zeros((), device=device)
    model.train()
    step = 0
    while True:
        elapsed = time.time() - start
        if elapsed >= budget:
            break
        lr = lr_at(settings, step, elapsed / budget)
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, targets = sampler.next()
        with autocast(device):
            logits = forward(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        opt.step()
        running += loss.detach()
        step += 1
        if step % settings.log_every_steps == 0:
            mean = float(running) / settings.log_every_steps  # syncs once per log line, not per step
            running.zero_()
            point = {
                "step": step,
                "tokens": step * tokens_per_step,
                "seconds": round(time.time() - start, 2),
                "loss": round(mean, 4),
                "lr": lr,
            }
            result.curve.append(point)
            if step % (settings.log_every_steps * 8) == 0:
                log(
                    f"step {step} loss {mean:.4f} lr {lr:.2e} {point['seconds']:.0f}s "
                    f"{step * tokens_per_step / max(point['seconds'], 1e-9) / 1e6:.2f}M tok/s"
                )
        if time.time() - start >= next_eval:
            next_eval += settings.eval_every_seconds
            best_state = _evaluate(model, windows, settings, device, step, start, result, best_state, log)
    result.steps, result.tokens_seen = step, step * tokens_per_step
    result.train_seconds = round(time.time() - start, 2)
    best_state = _evaluate(model, windows, settings, device, step, start, result, best_state, log)
    result.final_val_loss = result.val_curve[-1]["val_loss"]
    if best_state is not None:
        model.load_state_dict(best_state)
    return result


def _evaluate(model, windows, settings, device, step, start, result, best_state, log):  # type: ignore[no-untyped-def]
    """Held-out loss now; a copy of the weights when it is the best so far."""
    val = held_out_loss(model, windows, settings.batch_size, device)
    result.val_curve.append(
        {
            "step": step,
            "tokens": step * settings.batch_size * settings.seq_len,
            "seconds": round(time.time() - start, 2),
            "val_loss": round(val, 4),
        }
    )
    log(f"held-out loss {val:.4f} at step {step}")
    if val < result.best_val_loss:
        result.best_val_loss, result.best_step = round(val, 4), step
        best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return best_state


def save_hf_model(model, out_dir: Path, eos_token_id: int, pad_token_id: int) -> None:  # type: ignore[no-untyped-def]
    """config.json + model.safetensors (bf16) + generation_config.json through transformers' save_pretrained."""
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.generation_config = GenerationConfig(
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None, do_sample=False
    )
    model.save_pretrained(out_dir)  # safetensors: the only format transformers 5 writes
    if not (out_dir / "model.safetensors").is_file():
        raise RuntimeError(f"save_pretrained wrote no model.safetensors in {out_dir}")


def count_parameters(model) -> int:  # type: ignore[no-untyped-def]
    """Unique parameters (the tied embedding counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
