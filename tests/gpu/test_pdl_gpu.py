"""Programmatic dependent launch (framework/layers/kernels/pdl.py) on a Hopper GPU, at the Qwen3-0.6B geometry in bf16.

Claims:
- each PDL kernel (the GEMV of every projection and the LM head, at 1 and 4 rows, q/k norm + RoPE + KV
  store, split-KV paged attention and its reduce, RMSNorm) gives the same bits with `pdl=True` as without;
- a chain of them (layers of the small-batch path, then the final norm and the LM head) captured in a CUDA graph
  with PDL gives, at every replay on new inputs, the bits of the same chain run eagerly without PDL. A kernel
  reading an activation before its `gdc_wait` would read the previous replay's value there: the new inputs of
  each replay are what would show it (negative control: a replay that skips the input copy differs);
- an engine (random-weight 0.6B, greedy, requests ending at different steps so that decode runs at 3, 2 and 1
  rows, the GEMVs at one row, full-step graphs) gives identical tokens with `kernels.programmatic_launch`
  on and off, and on really is on.
Run: `PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_pdl_gpu.py` (~1 min on an H200).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: GPU kernels would be interpreted", allow_module_level=True)

from framework.layers.attention.metadata import AttentionMetadata  # noqa: E402
from framework.layers.attention.triton_paged_attention import paged_attention  # noqa: E402
from framework.layers.kernels.pdl import pdl_supported, pdl_unsupported_reason  # noqa: E402
from framework.layers.kernels.triton_gemv import gemv_triton  # noqa: E402
from framework.layers.kernels.triton_norm_silu import rms_norm_triton  # noqa: E402
from framework.layers.kernels.triton_qk_norm_rope import qk_norm_rope_store_triton  # noqa: E402

DEVICE, DTYPE, EPS = torch.device("cuda"), torch.bfloat16, 1e-6
if not pdl_supported(DEVICE):
    pytest.skip(f"no PDL here: {pdl_unsupported_reason(DEVICE)}", allow_module_level=True)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, PAGE = 1024, 16, 8, 128, 3072, 151936, 16
SEQ_LEN, NUM_BLOCKS = 1000, 80  # 1,000 cached keys: several KV splits at one row
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM


def _randn(*shape: int, seed: int, std: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=DEVICE) * std + shift).to(DTYPE)


def _meta(rows: int = 1) -> AttentionMetadata:
    blocks = -(-SEQ_LEN // PAGE)
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0))[: rows * blocks]
    return AttentionMetadata(
        num_tokens=rows,
        num_rows=rows,
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.full((rows,), SEQ_LEN, dtype=torch.int32, device=DEVICE),
        block_tables=perm.view(rows, blocks).to(DEVICE, torch.int32),
        kv_slot_mapping=(perm.view(rows, blocks)[:, -1] * PAGE + (SEQ_LEN - 1) % PAGE).to(DEVICE),
        block_size=PAGE,
        max_query_len=1,
        max_seq_len=SEQ_LEN,
    )


def _same_both_ways(run: Callable[[bool], Any]) -> None:
    """`run(pdl)` returns tensors (or tuples of them): equal bit for bit with and without PDL."""
    off, on = run(False), run(True)
    torch.cuda.synchronize()
    off, on = (off if isinstance(off, tuple) else (off,)), (on if isinstance(on, tuple) else (on,))
    for a, b in zip(off, on):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize(
    "projection,n,k,variant",
    [
        ("qkv", QKV, HIDDEN, "add_norm"),
        ("o_proj", HIDDEN, HEADS * HEAD_DIM, "plain"),
        ("gate_up", INTER, HIDDEN, "silu"),
        ("down", HIDDEN, INTER, "plain"),
        ("lm_head", VOCAB, HIDDEN, "logits"),
    ],
)
@pytest.mark.parametrize("m", [1, 4])  # the GEMV loads its weight tile before the wait at any row count
def test_gemv_with_pdl_equals_without(projection: str, n: int, k: int, variant: str, m: int) -> None:
    silu = variant == "silu"
    x, weight = _randn(m, k, seed=1, std=2.0), _randn(2 * n if silu else n, k, seed=2, std=k**-0.5)
    kwargs: dict[str, Any] = {"out_dtype": torch.float32} if variant == "logits" else {}
    if variant in ("add_norm", "silu"):
        kwargs.update(
            norm_weight=_randn(k, seed=3, std=0.2, shift=1.0), eps=EPS, residual=_randn(m, k, seed=4), silu_mul=silu
        )
    _same_both_ways(lambda pdl: gemv_triton(x, weight, **kwargs, pdl=pdl))


def test_qk_norm_rope_store_attention_and_norm_with_pdl_equal_without() -> None:
    qkv, cos, sin = _randn(1, QKV, seed=5), _randn(1, HEAD_DIM, seed=6), _randn(1, HEAD_DIM, seed=7)
    qn, kn = _randn(HEAD_DIM, seed=8, std=0.2, shift=1.0), _randn(HEAD_DIM, seed=9, std=0.2, shift=1.0)
    cache, meta = _randn(2, NUM_BLOCKS, PAGE, KV_HEADS, HEAD_DIM, seed=10), _meta()

    def rope(pdl: bool):  # type: ignore[no-untyped-def]
        own = cache.clone()
        q = qk_norm_rope_store_triton(
            qkv, cos, sin, qn, kn, EPS, HEADS, KV_HEADS, HEAD_DIM, own, meta.kv_slot_mapping, pdl=pdl
        )
        return q, own

    _same_both_ways(rope)
    q = _randn(1, HEADS, HEAD_DIM, seed=11)
    for splits in (1, 4):  # unsplit, and split with the reduce kernel
        _same_both_ways(lambda pdl: paged_attention(q, cache, meta, HEAD_DIM**-0.5, num_splits=splits, pdl=pdl))
    x, res, g = _randn(1, HIDDEN, seed=12), _randn(1, HIDDEN, seed=13), _randn(HIDDEN, seed=14, shift=1.0)
    _same_both_ways(lambda pdl: rms_norm_triton(x, g, EPS, res, pdl=pdl))


class _Chain:
    """`layers` decoder layers of the small-batch path at one token, then the final norm and the LM head (float32
    logits); each layer its own weights and KV cache. `run(pdl)` reads `self.x` / `self.residual` (static inputs
    of a graph) and returns the logits and the final stream."""

    def __init__(self, layers: int) -> None:
        def layer(seed: int) -> dict[str, torch.Tensor]:
            gain = dict(std=0.2, shift=1.0)
            return dict(
                qkv=_randn(QKV, HIDDEN, seed=seed, std=HIDDEN**-0.5),
                o=_randn(HIDDEN, HEADS * HEAD_DIM, seed=seed + 1, std=(HEADS * HEAD_DIM) ** -0.5),
                gate_up=_randn(2 * INTER, HIDDEN, seed=seed + 2, std=HIDDEN**-0.5),
                down=_randn(HIDDEN, INTER, seed=seed + 3, std=INTER**-0.5),
                g1=_randn(HIDDEN, seed=seed + 4, **gain),
                g2=_randn(HIDDEN, seed=seed + 5, **gain),
                qn=_randn(HEAD_DIM, seed=seed + 6, **gain),
                kn=_randn(HEAD_DIM, seed=seed + 7, **gain),
                cache=_randn(2, NUM_BLOCKS, PAGE, KV_HEADS, HEAD_DIM, seed=seed + 8),
            )

        self.layers = [layer(100 + 10 * i) for i in range(layers)]
        self.norm, self.lm_head = _randn(HIDDEN, seed=7, shift=1.0), _randn(VOCAB, HIDDEN, seed=8, std=HIDDEN**-0.5)
        self.meta = _meta()
        self.cos, self.sin = _randn(1, HEAD_DIM, seed=9), _randn(1, HEAD_DIM, seed=10)
        self.x = torch.empty(1, HIDDEN, dtype=DTYPE, device=DEVICE)
        self.residual = torch.empty_like(self.x)

    def set_inputs(self, seed: int) -> None:
        self.x.copy_(_randn(1, HIDDEN, seed=seed))
        self.residual.copy_(_randn(1, HIDDEN, seed=seed + 1, std=3.0))

    def run(self, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.x, self.residual
        for w in self.layers:  # small_batch_layer's kernels, in its order
            qkv, residual = gemv_triton(x, w["qkv"], norm_weight=w["g1"], eps=EPS, residual=residual, pdl=pdl)
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
            attn = paged_attention(q, w["cache"], self.meta, HEAD_DIM**-0.5, num_splits=4, pdl=pdl)
            h = gemv_triton(attn.view(1, HEADS * HEAD_DIM), w["o"], pdl=pdl)[0]
            act, residual = gemv_triton(
                h, w["gate_up"], norm_weight=w["g2"], eps=EPS, residual=residual, silu_mul=True, pdl=pdl
            )
            x = gemv_triton(act, w["down"], pdl=pdl)[0]
        hidden, stream = rms_norm_triton(x, self.norm, EPS, residual, pdl=pdl)
        return gemv_triton(hidden, self.lm_head, out_dtype=torch.float32, pdl=pdl)[0], stream


def test_a_pdl_chain_in_a_cuda_graph_equals_the_plain_chain_at_every_replay() -> None:
    chain = _Chain(layers=3)
    chain.set_inputs(seed=0)
    for pdl in (False, True):  # compile both ways outside the capture
        chain.run(pdl)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        static_logits, static_stream = chain.run(True)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2, 3, 4):
        chain.set_inputs(seed)
        want_logits, want_stream = (t.clone() for t in chain.run(False))  # the caches are rewritten alike
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_logits, want_logits) and torch.equal(static_stream, want_stream), seed
    # Negative control: a replay whose inputs were not updated does not give the new inputs' logits.
    chain.set_inputs(seed=5)
    want_logits = chain.run(False)[0].clone()
    chain.set_inputs(seed=4)
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(static_logits, want_logits)


def test_engine_tokens_are_the_same_with_programmatic_launch_on_and_off() -> None:
    from framework import LLM, SamplingParams

    prompts = [[(37 * i + 11 * j) % 150_000 for j in range(16 + 9 * i)] for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=12 + 6 * i, ignore_eos=True) for i in range(3)]
    tokens = {}
    for mode in ("off", "on"):
        llm = LLM(
            "qwen3-0.6b",
            device="cuda",
            dtype="bfloat16",
            max_model_len=256,
            max_num_seqs=4,
            seed=0,
            gpu_memory_utilization=0.3,
            small_batch_kernels="on",
            programmatic_launch=mode,
            full_step_cuda_graphs=True,
        )
        model = llm.engine.runner.model
        assert model.model.layers[0].programmatic_launch == (mode == "on") == model.programmatic_launch
        tokens[mode] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    assert tokens["on"] == tokens["off"]
    assert [len(t) for t in tokens["on"]] == [12, 18, 24]
