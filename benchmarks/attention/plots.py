"""The attention benchmarks' plots (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path


def plot_decode(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in results if r["kind"] == "decode"]
    seq_lens = sorted({r["seq_len"] for r in decode})
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for seq_len in seq_lens:
        rows = sorted((r for r in decode if r["seq_len"] == seq_len), key=lambda r: r["batch"])
        batches = [r["batch"] for r in rows]
        line = axes[0].plot(batches, [r["triton_tbps"] for r in rows], marker="o", label=f"triton S={seq_len}")[0]
        if all("baseline_tbps" in r for r in rows):
            axes[0].plot(
                batches,
                [r["baseline_tbps"] for r in rows],
                ls="--",
                color=line.get_color(),
                label=f"{rows[0]['baseline']} S={seq_len}",
            )
        axes[1].plot(
            batches,
            [r["triton_ms"] * 1e3 for r in rows],
            marker="o",
            color=line.get_color(),
            label=f"triton S={seq_len}",
        )
        axes[1].plot(
            batches,
            [r["triton_1split_ms"] * 1e3 for r in rows],
            ls=":",
            color=line.get_color(),
            label=f"1 split S={seq_len}",
        )
    axes[0].set(
        xscale="log",
        xlabel="batch (decode rows)",
        ylabel="achieved KV bandwidth (TB/s)",
        title="Decode attention bandwidth",
    )
    axes[1].set(
        xscale="log",
        yscale="log",
        xlabel="batch (decode rows)",
        ylabel="time (us)",
        title="Decode attention time (split rule vs 1 split)",
    )
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rows_plot(
    path: Path, series: list[tuple[str, list[int], list[float]]], xlabel: str, ylabel: str, title: str
) -> None:
    """One line per (label, decode rows, values), rows on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    for label, xs, ys in series:
        ax.plot(xs, ys, marker="o", label=label)
    ax.set(xscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
