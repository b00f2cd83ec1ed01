"""mrv2's own model code against HF transformers: same tiny random checkpoints, same prompts.

For each architecture (Llama MHA, Llama with Llama-3 RoPE scaling, Qwen2 qkv-bias GQA, Qwen3 q/k-norm GQA
tied, Mistral GQA) and each engine setting (plain; KV cache small enough to preempt; token budget small enough
to chunk prefills; both):
- greedy tokens from `LLM.generate` equal HF `generate` (one prompt at a time, no padding), token for token;
- every logits row mrv2 computes (prefill chunk ends, decode steps, recomputation after preemption) is close
  to HF's logits at the same position of the same sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.hf_models import SPEC_BY_NAME, SPECS, hf_greedy, hf_logits, random_prompts, save_tiny_checkpoint

from framework.engine.request import RequestOutput
from framework.entrypoints.llm import LLM
from framework.params.sampling_params import SamplingParams

MAX_TOKENS = 32
MAX_MODEL_LEN = 96
# 5 prompts of 5..40 random tokens (lengths 5, 14, 22, 31, 40).
PROMPTS = random_prompts(5, 5, 40, seed=1234)
# fp32 on CPU: mrv2 and HF differ only in summation order (paged SDPA per row vs HF eager attention, RoPE
# angles computed slightly differently); measured max |diff| is ~1.5e-5 on logits of |max| ~8, std ~1.7.
LOGITS_ATOL = 1e-4
LOGITS_RTOL = 1e-5

# LLM(...) keyword arguments per engine setting.
SCENARIOS: dict[str, dict] = {
    "plain": {},
    # 24 blocks of 4 tokens hold exactly one request of max_model_len: running 5 requests must preempt.
    "preempt": {"block_size": 4, "num_kv_blocks": 24},
    # 8 tokens per step: every prompt longer than 8 is prefilled in chunks, mixed with other rows' decodes.
    "chunked": {"max_num_batched_tokens": 8},
    # Both: resumed (recomputed) prefills are chunked too.
    "chunked_preempt": {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 8},
}


@dataclass
class Mrv2Run:
    outputs: list[RequestOutput]  # in prompt order
    # One entry per logits row mrv2 computed: (prompt index, seq_len of that row, float32 logits [vocab]).
    logits: list[tuple[int, int, torch.Tensor]]


def run_mrv2(path: Path, prompts: list[list[int]], **llm_kwargs) -> Mrv2Run:
    """Greedy generation with mrv2, recording every logits row the model returns.

    The scheduler's `schedule` is wrapped (on this engine only) to learn which requests each step runs and
    their KV length after it; `compute_logits` is wrapped to record its rows, one per scheduled request.
    """
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0, **llm_kwargs)
    engine = llm.engine
    scheduler, model = engine.scheduler, engine.runner.model
    step_rows: list[tuple[str, int]] = []
    records: list[tuple[str, int, torch.Tensor]] = []

    schedule = scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        # The scheduler advances num_computed_tokens by the scheduled count: that is this row's seq_len.
        step_rows[:] = [(rid, scheduler.requests[rid].num_computed_tokens) for rid in out.scheduled_request_ids]
        return out

    compute_logits = model.compute_logits

    def recording_compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        assert logits.shape[0] == len(step_rows), "one logits row per scheduled request expected (no drafts)"
        records.extend((rid, seq_len, row.detach().clone()) for (rid, seq_len), row in zip(step_rows, logits))
        return logits

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    model.compute_logits = recording_compute_logits  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    index = {out.request_id: i for i, out in enumerate(outputs)}
    return Mrv2Run(outputs, [(index[rid], seq_len, row) for rid, seq_len, row in records])


# ---- fixtures: one checkpoint and one HF reference per architecture, one mrv2 run per (arch, scenario) ----
@pytest.fixture(scope="module", params=[s.name for s in SPECS])
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(arch: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(f"hf-{arch}")
    return path, save_tiny_checkpoint(SPEC_BY_NAME[arch], path)


@pytest.fixture(scope="module")
def hf_tokens(checkpoint: tuple[Path, torch.nn.Module]) -> list[list[int]]:
    _, hf_model = checkpoint
    tokens = [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    assert all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


@pytest.fixture(scope="module")
def mrv2_runs(checkpoint: tuple[Path, torch.nn.Module]) -> dict[str, Mrv2Run]:
    """Lazily filled cache: scenario -> run (so the token and logits tests share one generation)."""
    return {}


def get_run(runs: dict[str, Mrv2Run], checkpoint: tuple[Path, torch.nn.Module], scenario: str) -> Mrv2Run:
    if scenario not in runs:
        runs[scenario] = run_mrv2(checkpoint[0], PROMPTS, **SCENARIOS[scenario])
    return runs[scenario]


# ---- tests ------------------------------------------------------------------------------------------------
def test_reference_outputs_are_not_degenerate(hf_tokens: list[list[int]]) -> None:
    """Parity is only meaningful if the tiny model's continuations vary (not one token repeated)."""
    distinct = [len(set(t)) for t in hf_tokens]
    assert min(distinct) >= 4, f"distinct tokens per HF continuation: {distinct}"
    assert len({tuple(t) for t in hf_tokens}) == len(hf_tokens), "prompts should give different continuations"


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_match_hf(checkpoint, hf_tokens, mrv2_runs, scenario: str) -> None:  # type: ignore[no-untyped-def]
    run = get_run(mrv2_runs, checkpoint, scenario)
    for i, (out, expected) in enumerate(zip(run.outputs, hf_tokens)):
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS
        assert out.token_ids == expected, (
            f"prompt {i} (len {len(PROMPTS[i])}): first mismatch at output token "
            f"{next(j for j, (a, b) in enumerate(zip(out.token_ids, expected)) if a != b)}"
        )
    preemptions = sum(out.num_preemptions for out in run.outputs)
    if "preempt" in scenario:
        assert preemptions > 0, "the KV cache was meant to be too small for all requests: nothing was preempted"
    else:
        assert preemptions == 0
    # Rows whose seq_len ends inside the prompt are prefill chunks that sample nothing.
    partial_prefills = sum(1 for i, seq_len, _ in run.logits if seq_len < len(PROMPTS[i]))
    if "chunked" in scenario:
        assert partial_prefills > 0, "max_num_batched_tokens=8 was meant to chunk prefills"
    else:
        assert partial_prefills == 0


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_logits_close_to_hf(checkpoint, mrv2_runs, scenario: str) -> None:  # type: ignore[no-untyped-def]
    """Every logits row mrv2 computed matches HF's forward over the same tokens at the same position."""
    _, hf_model = checkpoint
    run = get_run(mrv2_runs, checkpoint, scenario)
    worst = 0.0
    for i, (prompt, out) in enumerate(zip(PROMPTS, run.outputs)):
        sequence = prompt + out.token_ids[:-1]  # the last output token is never fed back
        reference = hf_logits(hf_model, sequence)  # [len, vocab]; row p predicts token p+1
        rows = [(seq_len, row) for j, seq_len, row in run.logits if j == i]
        decode_lens = {seq_len for seq_len, _ in rows if seq_len >= len(prompt)}
        # A logits row for every sampled token, the last step included.
        assert decode_lens == set(range(len(prompt), len(sequence) + 1))
        for seq_len, row in rows:
            expected = reference[seq_len - 1]
            worst = max(worst, (row - expected).abs().max().item())
            torch.testing.assert_close(
                row, expected, atol=LOGITS_ATOL, rtol=LOGITS_RTOL, msg=lambda m: f"prompt {i}, seq_len {seq_len}: {m}"
            )
        # Greedy consistency: each decode row's argmax is the token mrv2 emitted next.
        for seq_len, row in rows:
            if seq_len >= len(prompt):
                assert int(row.argmax()) == out.token_ids[seq_len - len(prompt)]
    print(f"max |logits diff| {scenario}: {worst:.2e}")


def test_comparison_detects_a_wrong_model(tmp_path: Path) -> None:
    """Guard against a vacuous harness: a small RoPE error in mrv2 must break both kinds of parity."""
    spec = SPEC_BY_NAME["llama"]
    hf_model = save_tiny_checkpoint(spec, tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    model = llm.engine.runner.model
    model.inv_freq.mul_(1.05)  # 5% off rotary frequencies
    recorded: list[torch.Tensor] = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: recorded.append(compute_logits(hidden)) or recorded[-1]
    prompt = PROMPTS[-1]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    reference = hf_logits(hf_model, prompt)
    assert (recorded[0][0] - reference[-1]).abs().max().item() > 100 * LOGITS_ATOL
    assert out.token_ids != hf_greedy(hf_model, prompt, 8)
