"""What `bench_spec.py` reports once every cell ran: fast-host medians and dynamic-k's paired comparison with the
best fixed k (`compare`), the table, the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from host_speed import fast_runs, median, paired_ratio


def compare(results: list[dict[str, Any]], fastest: float) -> None:
    """Add to every row its fast-host median (`fast_host_tok_per_s`, None without a fast-host run) and to
    dynamic-k's rows the round-by-round comparison with the best fixed k (`paired_vs_best`), once the
    fastest probe of the whole benchmark is known."""
    for r in results:
        r["fast_host_tok_per_s"] = median(fast_runs(r["runs_tok_per_s"], r["runs_host_probe_us"], fastest))
    for r in results:
        if r["engine"] == "dynamic":
            best = next(
                x
                for x in results
                if (x["workload"], x["batch"], x["engine"])
                == (r["workload"], r["batch"], f"ngram k={r['best_fixed_k']}")
            )
            r["paired_vs_best"] = paired_ratio(r, best, fastest)


def print_table(results: list[dict[str, Any]]) -> None:
    head = (
        f"{'workload':<14}{'batch':>6}  {'engine':<11}{'out tok/s':>10}{'fast host':>10}{'vs none':>9}"
        f"{'acc len':>9}  per-position acceptance"
    )
    print(head)
    print("-" * len(head))
    base = {(r["workload"], r["batch"]): r["output_tok_per_s"] for r in results if r["engine"] == "none"}
    for r in results:
        rel = r["output_tok_per_s"] / base[(r["workload"], r["batch"])]
        per_pos = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"])
        fast = f"{r['fast_host_tok_per_s']:>10.0f}" if r["fast_host_tok_per_s"] else f"{'-':>10}"
        chosen = ""
        if "k_chosen" in r:
            p = r["paired_vs_best"]
            fast_paired = (
                f"{100 * (p['fast']['median'] - 1):+.1f}% over {p['fast']['rounds']} fast-host rounds"
                if p["fast"]["rounds"]
                else "no fast-host round"
            )
            chosen = (
                f"  k chosen {r['k_chosen']}; cold run {r['cold_tok_per_s']}; paired vs k={r['best_fixed_k']} "
                f"{100 * (p['median'] - 1):+.1f}% (quartiles "
                f"{', '.join(f'{100 * (q - 1):+.1f}%' for q in p['quartiles'])}; {p['rounds']} rounds), "
                f"{fast_paired}"
            )
        print(
            f"{r['workload']:<14}{r['batch']:>6}  {r['engine']:<11}{r['output_tok_per_s']:>10.0f}{fast}{rel:>8.2f}x"
            f"{r['mean_acceptance_length']:>9.2f}  [{per_pos}]{chosen}"
        )


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in results))
    engines = list(dict.fromkeys(r["engine"] for r in results))
    fig, axes = plt.subplots(1, len(workloads) + 1, figsize=(5 * (len(workloads) + 1), 4))
    for ax, w in zip(axes, workloads):
        rows = [r for r in results if r["workload"] == w]
        batches = sorted({r["batch"] for r in rows})
        width = 0.8 / len(engines)
        for i, e in enumerate(engines):
            ys = [
                next((r["output_tok_per_s"] for r in rows if r["engine"] == e and r["batch"] == b), 0) for b in batches
            ]
            ax.bar([j + i * width for j in range(len(batches))], ys, width, label=e)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [str(b) for b in batches])
        ax.set_xlabel("requests at once")
        ax.set_ylabel("output tokens / s")
        ax.set_title(w)
    axes[0].legend(fontsize=7)
    dyn = [r for r in results if r["engine"] == "dynamic" and r["workload"] == "shifting"]
    if dyn:
        axes[-1].plot(dyn[0]["k_history"], lw=0.8)
        axes[-1].set_xlabel("step")
        axes[-1].set_ylabel("k chosen")
        axes[-1].set_title("dynamic-k on 'shifting'")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
