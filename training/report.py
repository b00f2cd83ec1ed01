"""train_log.json and the loss-curve plot of a training run (matplotlib is optional)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional


def write_log(path: Path, log: dict[str, Any]) -> None:
    path.write_text(json.dumps(log, indent=2) + "\n")


def plot_losses(path: Path, log: dict[str, Any], warn: Callable[[str], None]) -> Optional[Path]:
    """Training and held-out loss of the base model against tokens seen, plus the heads' losses.

    None if no matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warn("matplotlib is not installed: no loss plot (train_log.json has the curve)")
        return None
    base = log["base_model"]
    heads = log.get("heads", {})
    fig, axes = plt.subplots(1, 2 if heads else 1, figsize=(11 if heads else 6, 4), squeeze=False)
    ax = axes[0][0]
    curve = base["curve"]
    ax.plot([p["tokens"] / 1e6 for p in curve], [p["loss"] for p in curve], label="train", linewidth=1)
    val = base["val_curve"]
    ax.plot([p["tokens"] / 1e6 for p in val], [p["val_loss"] for p in val], "o-", label="held-out", markersize=3)
    ax.set_xlabel("tokens seen (M)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"tiny code model: best held-out {base['best_val_loss']:.3f} at step {base['best_step']}")
    ax.grid(alpha=0.3)
    ax.legend()
    if heads:
        ax = axes[0][1]
        for kind, h in heads.items():
            ax.plot([p["step"] for p in h["curve"]], [p["loss"] for p in h["curve"]], label=kind, linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("head loss")
        ax.set_title("draft heads")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown_summary(log: dict[str, Any]) -> str:
    """The rows of the report table in docs/embedded-model.md, filled from a train_log.json."""
    base, corpus, heads = log["base_model"], log["corpus"], log.get("heads", {})
    rows = [
        ("device", str(log["device"])),
        (
            "corpus",
            f"{corpus['train_files']} files, {corpus['train_tokens'] / 1e6:.2f}M training tokens, "
            f"{corpus['val_tokens'] / 1e6:.3f}M held-out tokens ({corpus['val_files']} files)",
        ),
        ("training time, base model", f"{base['train_seconds']:.0f} s, {base['steps']} steps"),
        ("tokens seen", f"{base['tokens_seen'] / 1e6:.0f}M"),
        (
            "held-out loss (nats/token)",
            f"{base['best_val_loss']:.3f} at step {base['best_step']}; last: {base['final_val_loss']:.3f}",
        ),
    ]
    for kind, label in (("eagle", "EAGLE head"), ("mtp", "MTP head")):
        if kind in heads:
            h = heads[kind]
            rows.append(
                (
                    label,
                    f"{h['train_seconds']:.0f} s, {h['steps']} steps; held-out top-1 agreement with "
                    f"the target, draft steps 1..{len(h['val_top1_agreement'])}: "
                    + ", ".join(f"{a:.3f}" for a in h["val_top1_agreement"]),
                )
            )
    rows.append(("whole run", f"{log['wall_seconds']:.0f} s"))
    return "\n".join(["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])
