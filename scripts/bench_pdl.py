"""Programmatic dependent launch (PDL) off vs on for the batch-1 decode kernels, replayed from CUDA graphs.

Chains at the Qwen3-0.6B geometry (bfloat16, random weights, one token, 1,000 cached keys a layer), each the
small-batch path's kernels in its order (framework/models/small_batch.py): add + RMSNorm + qkv GEMV, q/k norm +
RoPE + KV store, split-KV paged attention + reduce, o_proj GEMV, add + RMSNorm + gate_up GEMV + SiLU*up, down
GEMV; then the final RMSNorm and the LM head GEMV (float32 logits):

* `layer`: one decoder layer (7 kernels; its 28 MB of weights fit the H200's L2, so the L2 is flushed before
  each replay, as `triton.testing.do_bench` does);
* `head`: the final norm and the LM head (311 MB);
* `stack`: `--layers` layers (28: the whole model) and the head, one graph (~200 kernels, as a decode step).

Variants: PDL off / on, each with the GEMV's weight-first tile (`prefetch_k`, the `gemv_tiles` rule) and
without it (0: the GEMV as it was before PDL). `--ablate` times instead the `stack` chain with PDL on and one
kernel kind left out or launched otherwise (`ABLATIONS`): the difference to `full` is what that kernel costs
inside the chain, where PDL overlaps each kernel's start with the previous one's end (a profiler's per-kernel
durations count that overlap twice). Times are medians of `do_bench` over graph replays, in
microseconds; `us/kernel` divides by the kernels of the chain. Off and on are compared bit for bit first.
Prints a table, writes `pdl_bench.json` and `pdl_bench.png` into `--out`.

    PYTHONPATH=$PWD python3 scripts/bench_pdl.py --out bench_results/pdl [--layers 28]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_small_batch import capture_graph  # noqa: E402

from framework.layers.attention.metadata import AttentionMetadata  # noqa: E402
from framework.layers.attention.triton_paged_attention import AttentionTiles, paged_attention  # noqa: E402
from framework.layers.kernels.pdl import pdl_supported, pdl_unsupported_reason  # noqa: E402
from framework.layers.kernels.triton_gemv import gemv_tiles, gemv_triton  # noqa: E402
from framework.layers.kernels.triton_norm_silu import rms_norm_triton  # noqa: E402
from framework.layers.kernels.triton_qk_norm_rope import qk_norm_rope_store_triton  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, PAGE = 1024, 16, 8, 128, 3072, 151936, 16
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM
EPS, DTYPE = 1e-6, torch.bfloat16
KERNELS_PER_LAYER, KERNELS_HEAD = 7, 2  # with the split-KV reduce
VARIANTS = {"off": (False, None), "on": (True, None), "off_noprefetch": (False, 0), "on_noprefetch": (True, 0)}
# --ablate: the stack with PDL on, one part changed. no_attention: o_proj reads q; no_rope: attention reads q out
# of the qkv output (no q/k norm, RoPE or KV store); other keys go to `paged_attention` (num_splits, fused_reduce,
# merge_unroll; tiles: (keys, warps, stages) of the small-rows launch). Default: the split rule.
ABLATIONS: dict[str, dict] = {
    "full": {},
    "no_attention": {"attention": False},
    "no_rope": {"rope": False},
    "no_rope_no_attention": {"rope": False, "attention": False},
    "merge1": {"merge_unroll": 1},
    "merge4": {"merge_unroll": 4},
    "two_launch_reduce": {"fused_reduce": False},
    **{f"splits{n}": {"num_splits": n} for n in (1, 4, 6, 8, 12, 16, 32)},
    "tiles64_4_2": {"tiles": (64, 4, 2)},
}


class Model:
    """Weights, KV caches and the static inputs of the chains; `layer` / `head` launch one chain's kernels."""

    def __init__(self, layers: int, device: torch.device, seq_len: int = 1000) -> None:
        self.device, self.seq_len = device, seq_len
        self.changes: dict = {}  # what the running chain changes in a layer: an ABLATIONS entry (or 4 KV splits)
        num_blocks = -(-seq_len // PAGE) + 8
        gen = torch.Generator(device=device).manual_seed(0)

        def randn(*shape: int, std: float = 1.0, shift: float = 0.0) -> torch.Tensor:
            return (torch.randn(shape, generator=gen, device=device) * std + shift).to(DTYPE)

        def layer() -> dict[str, torch.Tensor]:
            gain = dict(std=0.2, shift=1.0)
            return dict(
                qkv=randn(QKV, HIDDEN, std=HIDDEN**-0.5),
                o=randn(HIDDEN, HEADS * HEAD_DIM, std=(HEADS * HEAD_DIM) ** -0.5),
                gate_up=randn(2 * INTER, HIDDEN, std=HIDDEN**-0.5),
                down=randn(HIDDEN, INTER, std=INTER**-0.5),
                g1=randn(HIDDEN, **gain),
                g2=randn(HIDDEN, **gain),
                qn=randn(HEAD_DIM, **gain),
                kn=randn(HEAD_DIM, **gain),
                cache=randn(2, num_blocks, PAGE, KV_HEADS, HEAD_DIM),
            )

        self.layers = [layer() for _ in range(layers)]
        self.norm, self.lm_head = randn(HIDDEN, shift=1.0), randn(VOCAB, HIDDEN, std=HIDDEN**-0.5)
        self.cos, self.sin = randn(1, HEAD_DIM), randn(1, HEAD_DIM)
        self.x, self.residual = randn(1, HIDDEN), randn(1, HIDDEN, std=3.0)
        blocks = -(-seq_len // PAGE)
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))[:blocks].to(device)
        self.meta = AttentionMetadata(
            num_tokens=1,
            num_rows=1,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
            block_tables=perm.view(1, blocks).to(torch.int32),
            kv_slot_mapping=perm[-1:] * PAGE + (seq_len - 1) % PAGE,
            block_size=PAGE,
            max_query_len=1,
            max_seq_len=seq_len,
        )
        self.counters = torch.zeros(64 * KV_HEADS, dtype=torch.int32, device=device)  # as a model's SplitCounters

    def _gemv(self, x: torch.Tensor, w: torch.Tensor, pdl: bool, prefetch: Optional[int], silu: bool = False, **kwargs):  # type: ignore[no-untyped-def]
        tiles = gemv_tiles(1, w.shape[0] // (2 if silu else 1), w.shape[1], 2, silu_mul=silu, prefetch_k=prefetch)
        return gemv_triton(x, w, silu_mul=silu, tiles=tiles, pdl=pdl, **kwargs)

    def layer(self, i: int, x: torch.Tensor, residual: torch.Tensor, pdl: bool, prefetch: Optional[int]):  # type: ignore
        w = self.layers[i]
        qkv, residual = self._gemv(x, w["qkv"], pdl, prefetch, norm_weight=w["g1"], eps=EPS, residual=residual)
        ab = self.changes
        if ab.get("rope", True):
            q = qk_norm_rope_store_triton(
                qkv,
                self.cos,
                self.sin,
                w["qn"],
                w["kn"],
                EPS,
                HEADS,
                KV_HEADS,
                HEAD_DIM,
                w["cache"],
                self.meta.kv_slot_mapping,
                pdl=pdl,
            )
        else:
            q = qkv[:, : HEADS * HEAD_DIM].view(1, HEADS, HEAD_DIM)
        if ab.get("attention", True):
            kwargs = {k: v for k, v in ab.items() if k not in ("rope", "attention", "tiles")}
            if "tiles" in ab:
                kwargs["small_tiles"] = AttentionTiles(16, *ab["tiles"])
            q = paged_attention(
                q, w["cache"], self.meta, HEAD_DIM**-0.5, pdl=pdl, split_counters=self.counters, **kwargs
            )
        h = self._gemv(q.reshape(1, HEADS * HEAD_DIM), w["o"], pdl, prefetch)[0]
        act, residual = self._gemv(
            h, w["gate_up"], pdl, prefetch, silu=True, norm_weight=w["g2"], eps=EPS, residual=residual
        )
        return self._gemv(act, w["down"], pdl, prefetch)[0], residual

    def head(self, x: torch.Tensor, residual: torch.Tensor, pdl: bool, prefetch: Optional[int]) -> torch.Tensor:
        hidden = rms_norm_triton(x, self.norm, EPS, residual, pdl=pdl)[0]
        return self._gemv(hidden, self.lm_head, pdl, prefetch, out_dtype=torch.float32)[0]

    def chains(self) -> dict[str, tuple[int, Callable[[bool, Optional[int]], torch.Tensor]]]:
        """name -> (kernels, run(pdl, prefetch) -> output)."""

        def stack(pdl: bool, prefetch: Optional[int]) -> torch.Tensor:
            x, residual = self.x, self.residual
            for i in range(len(self.layers)):
                x, residual = self.layer(i, x, residual, pdl, prefetch)
            return self.head(x, residual, pdl, prefetch)

        return {
            "layer": (KERNELS_PER_LAYER, lambda pdl, pre: self.layer(0, self.x, self.residual, pdl, pre)[0]),
            "head": (KERNELS_HEAD, lambda pdl, pre: self.head(self.x, self.residual, pdl, pre)),
            "stack": (KERNELS_PER_LAYER * len(self.layers) + KERNELS_HEAD, stack),
        }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chains = list(dict.fromkeys(r["chain"] for r in rows))
    fig, axes = plt.subplots(1, len(chains), figsize=(4.5 * len(chains), 4), squeeze=False)
    for ax, chain in zip(axes[0], chains):
        sel = [r for r in rows if r["chain"] == chain]
        ax.bar([r["variant"] for r in sel], [r["us"] for r in sel], color=["C0", "C1", "C2", "C3"][: len(sel)])
        ax.set(title=f"{chain} ({sel[0]['kernels']} kernels)", ylabel="us per replay (median)")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def ablate(model: Model, out: Path) -> int:
    """`--ablate`: the stack chain (PDL on, weight-first tiles) under each of ABLATIONS; table and JSON."""
    import triton.testing

    _kernels, stack = model.chains()["stack"]
    rows: list[dict] = []
    full_logits: Optional[torch.Tensor] = None  # the first row's (full) output
    print(f"{'ablation':<22}{'us':>10}{'vs full':>10}{'us/layer vs full':>18}{'max |diff|':>12}")
    for name, change in ABLATIONS.items():
        model.changes = change
        graph, logits = capture_graph(lambda: stack(True, None))
        graph.replay()
        torch.cuda.synchronize()
        if full_logits is None:
            full_logits = logits.clone()
        us = triton.testing.do_bench(graph.replay, warmup=25, rep=300, return_mode="median") * 1e3
        full = rows[0]["us"] if rows else us
        # Ablations that leave a kernel out change the logits; the launch variants may differ by rounding only.
        rows.append(
            dict(
                ablation=name,
                change=change,
                us=us,
                delta_us=us - full,
                delta_us_per_layer=(us - full) / len(model.layers),
                max_abs_diff_vs_full=float((logits - full_logits).abs().max()),
            )
        )
        print(
            f"{name:<22}{us:>10.1f}{us - full:>10.1f}{(us - full) / len(model.layers):>18.2f}"
            f"{rows[-1]['max_abs_diff_vs_full']:>12.3g}",
            flush=True,
        )
        del graph
    model.changes = {}
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        seq_len=model.seq_len,
        layers=len(model.layers),
        unit="microseconds per CUDA-graph replay of the stack (PDL on)",
    )
    (out / "pdl_ablation.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=2))
    plot_ablation(rows, f"{len(model.layers)} layers + head, {model.seq_len} keys, PDL on", out / "pdl_ablation.png")
    print(f"wrote {out}")
    return 0


def plot_ablation(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh([r["ablation"] for r in rows][::-1], [r["us"] for r in rows][::-1])
    ax.set(xlabel="us per replay of the stack (median)", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench_results/pdl"))
    parser.add_argument("--layers", type=int, default=28, help="layers of the `stack` chain (0: no stack)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seq-len", type=int, default=1000, help="cached keys of the one row, every layer")
    parser.add_argument("--ablate", action="store_true", help="the stack with PDL on, one part changed (ABLATIONS)")
    args = parser.parse_args()
    import triton.testing

    device = torch.device("cuda")
    if not pdl_supported(device):
        print(f"PDL is not supported here: {pdl_unsupported_reason(device)}")
        return 1
    model = Model(max(args.layers, 1), device, args.seq_len)
    if args.ablate:
        return ablate(model, args.out)
    model.changes = {"num_splits": 4}  # the PDL variants as first measured (docs/benchmarks.md): 4 KV splits
    chains = model.chains()
    if args.layers == 0:
        del chains["stack"]
    rows: list[dict] = []
    print(f"{'chain':<7}{'kernels':>8}{'variant':>16}{'us':>10}{'us/kernel':>11}{'vs off':>8}{'bits = off':>12}")
    for chain, (kernels, run) in chains.items():
        base: dict[Optional[int], torch.Tensor] = {}
        off_us = None
        for variant in args.variants:
            pdl, prefetch = VARIANTS[variant]
            graph, out = capture_graph(lambda: run(pdl, prefetch))
            graph.replay()
            torch.cuda.synchronize()
            same = bool(torch.equal(out, base.setdefault(prefetch, out.clone())))  # vs PDL off, same prefetch
            us = triton.testing.do_bench(graph.replay, warmup=25, rep=300, return_mode="median") * 1e3
            off_us = off_us or us
            rows.append(
                dict(
                    chain=chain,
                    kernels=kernels,
                    variant=variant,
                    pdl=pdl,
                    prefetch_k=prefetch,
                    us=us,
                    us_per_kernel=us / kernels,
                    equal_to_off=same,
                )
            )
            print(
                f"{chain:<7}{kernels:>8}{variant:>16}{us:>10.1f}{us / kernels:>11.2f}{us / off_us:>8.3f}"
                f"{str(same):>12}",
                flush=True,
            )
            del graph
    meta = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        dtype=str(DTYPE),
        seq_len=args.seq_len,
        kv_splits=4,
        unit="microseconds per CUDA-graph replay (median of triton.testing.do_bench, L2 flushed)",
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pdl_bench.json").write_text(json.dumps(dict(meta=meta, results=rows), indent=2))
    plot(rows, args.out / "pdl_bench.png")
    print(f"wrote {args.out}")
    return 0 if all(r["equal_to_off"] for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
