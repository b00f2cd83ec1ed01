"""Embedding (pooling) requests in the generation engine: HF parity, chunking, preemption, mixed batches.

Reference: HF transformers' last hidden state (after the final norm: the last entry of `hidden_states` with
`output_hidden_states=True`, which is what mrv2's `forward` returns), pooled the same way. fp32 on the CPU;
the two differ only in summation order, measured max |diff| ~1e-5 on hidden states of std ~1, so vectors
are compared with atol 1e-4, rtol 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from helpers.hf_models import SPEC_BY_NAME, SPECS, random_prompts, save_tiny_checkpoint

from framework.config.schema import ConfigError, load_config
from framework.entrypoints.llm import LLM
from framework.params.pooling_params import PoolingParams
from framework.params.sampling_params import InvalidRequestError, SamplingParams

ATOL = RTOL = 1e-4
MAX_MODEL_LEN = 96
PROMPTS = random_prompts(3, 5, 40, seed=4321)  # lengths 5, 22, 40
TYPES = ("last", "mean", "cls")
SCENARIOS = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 8},  # prompts longer than 8 are pooled over several chunks
    # 24 blocks of 4 tokens and generation requests beside: someone must be preempted and recomputed.
    "chunked_preempt": {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 8},
}


@torch.no_grad()
def hf_pooled(model: torch.nn.Module, prompt: list[int], pooling_type: str) -> torch.Tensor:
    hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0].float()  # [len, H]
    return {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling_type]


def run_mixed(
    llm: LLM, pooled: list[tuple[list[int], PoolingParams]], generated: list[list[int]], max_tokens: int = 8
) -> tuple[list, list]:
    """Queue generation and embedding requests together (interleaved) and step the engine to the end."""
    engine = llm.engine
    ids_p, ids_g = [], []
    for i in range(max(len(pooled), len(generated))):
        if i < len(generated):
            ids_g.append(f"g{i}")
            engine.add_request(
                ids_g[-1], generated[i], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            )
        if i < len(pooled):
            ids_p.append(f"p{i}")
            engine.add_request(ids_p[-1], pooled[i][0], None, pooling_params=pooled[i][1])
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    assert engine.is_idle()
    return [outputs[r] for r in ids_p], [outputs[r] for r in ids_g]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Lazily filled: architecture -> (checkpoint dir, HF model)."""
    return {"_root": tmp_path_factory.mktemp("hf-embed")}


# Every architecture with chunked prefill; plain and preemption once each (keeps the suite short on 2 cores).
CASES = [(s.name, "chunked") for s in SPECS] + [("qwen3", "plain"), ("llama", "chunked_preempt")]


@pytest.mark.parametrize("arch, scenario", CASES)
def test_embeddings_match_hf(checkpoints: dict, arch: str, scenario: str) -> None:
    if arch not in checkpoints:
        path = checkpoints["_root"] / arch
        checkpoints[arch] = (path, save_tiny_checkpoint(SPEC_BY_NAME[arch], path))
    path, hf_model = checkpoints[arch]
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, **SCENARIOS[scenario])
    requests = [(p, PoolingParams(pooling_type=t, normalize=False)) for p in PROMPTS for t in TYPES]
    generated = PROMPTS[-2:] if "preempt" in scenario else []
    pooled, gen = run_mixed(llm, requests, generated, max_tokens=24)
    for (prompt, params), out in zip(requests, pooled):
        assert out.finish_reason == "pooled" and out.prompt_token_ids == prompt
        expected = hf_pooled(hf_model, prompt, params.pooling_type)
        torch.testing.assert_close(
            torch.tensor(out.embedding),
            expected,
            atol=ATOL,
            rtol=RTOL,
            msg=lambda m: f"{params.pooling_type}, prompt len {len(prompt)}: {m}",
        )
    if "preempt" in scenario:
        assert sum(o.num_preemptions for o in pooled) > 0, "the small KV cache was meant to preempt a pooling request"
    if scenario == "plain":  # the reference pools what the base model returns after its final norm
        ids = torch.tensor([PROMPTS[1]])
        with torch.no_grad():
            torch.testing.assert_close(
                hf_model(ids, output_hidden_states=True).hidden_states[-1], hf_model.model(ids).last_hidden_state
            )


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_mixed_batches_change_neither_kind(tiny_llm_factory, runner: str) -> None:
    prompts = [[(7 * i + 3 * j) % 250 for j in range(6 + 11 * i)] for i in range(3)]
    requests = [(p, PoolingParams(pooling_type=t)) for p, t in zip(prompts, ("mean", "last", "cls"))]
    kwargs = {"runner": runner, "max_num_batched_tokens": 16}
    alone_p, _ = run_mixed(tiny_llm_factory(**kwargs), requests, [])
    _, alone_g = run_mixed(tiny_llm_factory(**kwargs), [], prompts)
    mixed_p, mixed_g = run_mixed(tiny_llm_factory(**kwargs), requests, prompts)
    assert [o.token_ids for o in mixed_g] == [o.token_ids for o in alone_g]
    for a, b in zip(alone_p, mixed_p):
        torch.testing.assert_close(torch.tensor(b.embedding), torch.tensor(a.embedding), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_embedding_only_steps_compute_no_logits(tiny_llm_factory, runner: str) -> None:
    llm = tiny_llm_factory(runner=runner, max_num_batched_tokens=8)
    model = llm.engine.runner.model
    calls: list[int] = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: calls.append(hidden.shape[0]) or compute_logits(hidden)
    out = llm.encode(["The quick brown fox jumps", "over the lazy dog"], use_tqdm=False)
    assert [o.finish_reason for o in out] == ["pooled", "pooled"] and calls == []
    llm.generate(["abc"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert calls  # generation still samples


def test_v1_and_v2_embed_alike(tiny_llm_factory) -> None:
    params = [PoolingParams(pooling_type=t) for t in TYPES]
    texts = ["def fibonacci(n):", "The quick brown fox", "import numpy as np\n"]
    v2 = tiny_llm_factory(runner="v2").encode(texts, params, use_tqdm=False)
    v1 = tiny_llm_factory(runner="v1").encode(texts, params, use_tqdm=False)
    for a, b in zip(v1, v2):
        torch.testing.assert_close(torch.tensor(a.embedding), torch.tensor(b.embedding), atol=1e-5, rtol=1e-5)


def test_dimensions_truncate_then_normalize(tiny_llm) -> None:
    prompt = "The quick brown fox"
    raw, unit, short, short_raw = tiny_llm.encode(
        [prompt] * 4,
        [
            PoolingParams(normalize=False),
            PoolingParams(),
            PoolingParams(dimensions=16),
            PoolingParams(dimensions=16, normalize=False),
        ],
        use_tqdm=False,
    )
    raw_t = torch.tensor(raw.embedding)
    assert len(raw.embedding) == 64 and abs(raw_t.norm().item() - 1.0) > 1e-3
    torch.testing.assert_close(torch.tensor(unit.embedding), raw_t / raw_t.norm())
    assert len(short.embedding) == 16 and len(short_raw.embedding) == 16
    torch.testing.assert_close(torch.tensor(short_raw.embedding), raw_t[:16])
    torch.testing.assert_close(torch.tensor(short.embedding), raw_t[:16] / raw_t[:16].norm())


def test_config_default_pooling_type(tiny_llm_factory) -> None:
    prompt = [5, 6, 7, 8, 9]
    by_config = tiny_llm_factory(pooling="mean").encode(prompt, use_tqdm=False)[0]
    explicit = tiny_llm_factory().encode(prompt, PoolingParams(pooling_type="mean"), use_tqdm=False)[0]
    default = tiny_llm_factory().encode(prompt, use_tqdm=False)[0]
    assert by_config.embedding == explicit.embedding != default.embedding


@pytest.mark.parametrize(
    "params, message",
    [
        (PoolingParams(dimensions=65), "PoolingParams.dimensions=65 exceeds the model's hidden size 64"),
        (PoolingParams(dimensions=0), "PoolingParams.dimensions must be a positive int"),
        (PoolingParams(pooling_type="max"), "PoolingParams.pooling_type='max': unknown pooling type; allowed: last"),
    ],
)
def test_invalid_pooling_params(tiny_llm, params: PoolingParams, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace("'", "'")):
        tiny_llm.encode(["a", "b"], [PoolingParams(), params], use_tqdm=False)
    assert tiny_llm.engine.is_idle()  # one bad request queues nothing


def test_config_validates_task_and_pooling() -> None:
    assert load_config({"task": "embed", "model": {"pooling": "cls"}}).task == "embed"
    with pytest.raises(ConfigError, match="task: Input should be 'generate' or 'embed'"):
        load_config({"task": "classify"})
    with pytest.raises(ConfigError, match="model.pooling: Input should be 'last', 'mean' or 'cls'"):
        load_config({"model": {"pooling": "max"}})


def test_cli_run_task_embed_prints_one_line_per_prompt(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "framework.entrypoints.cli", "run", *args, "run.show_progress=false"],
            cwd=tmp_path,
            env=dict(os.environ, HYDRA_FULL_ERROR="0", TMPDIR=str(tmp_path)),
            capture_output=True,
            text=True,
            timeout=300,
        )

    first = run("experiment=embed", "model=random_tiny")
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert len(lines) == 3 and all(
        line.startswith(f"embedding {i}: dim=64 norm=1.0000 [") for i, line in enumerate(lines)
    )
    # The preset is task=embed with mean pooling; the lines are the in-process vectors, formatted.
    from framework.entrypoints.run_command import format_embedding

    llm = LLM("random_tiny", device="cpu", task="embed", pooling="mean")
    expected = [
        format_embedding(i, o.embedding)
        for i, o in enumerate(
            llm.encode(["def fibonacci(n):", "import numpy as np\n", "The quick brown fox"], use_tqdm=False)
        )
    ]  # conf/base.yaml's run.prompts
    assert lines == expected
    bad = run("task=embedding")
    assert bad.returncode == 2 and "task: Input should be 'generate' or 'embed'" in bad.stderr


def test_embed_bench_runs_on_cpu_against_hf(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from framework.entrypoints.bench.embed import run_embed_bench

    config = load_config(
        {
            "task": "embed",
            "device": "cpu",
            "model": {"pooling": "mean"},
            "bench": {"name": "t", "num_requests": 4, "input_len": [4, 24], "baselines": ["hf"], "hf_batch_size": 2},
        }
    )
    results = run_embed_bench(config, tmp_path)
    assert [r.engine for r in results] == ["mrv2 v2", "hf transformers"]
    assert results[0].num_inputs == 4 and results[0].input_tokens == results[1].input_tokens
    table = capsys.readouterr().out
    assert "inputs/s" in table and "tok/s" in table
    payload = json.loads((tmp_path / "embed_bench.json").read_text())
    assert payload["max_abs_diff_vs_hf"] < ATOL  # same inputs, same pooling: same vectors
    assert (tmp_path / "embed_bench.png").stat().st_size > 0


def test_embedding_prompt_may_fill_max_model_len() -> None:
    """A pooling request generates nothing, so its prompt may be exactly max_model_len tokens (not one more)."""
    llm = LLM("random_tiny", device="cpu", task="embed", max_model_len=32)
    (out,) = llm.encode([list(range(1, 33))], use_tqdm=False)
    assert len(out.embedding) > 0
    with pytest.raises(InvalidRequestError, match="the prompt has 33 tokens but max_model_len is 32"):
        llm.encode([list(range(1, 34))], use_tqdm=False)
    gen = LLM("random_tiny", device="cpu", max_model_len=32)
    with pytest.raises(InvalidRequestError, match="prompt plus at least one output token must fit"):
        gen.generate([list(range(1, 33))], use_tqdm=False)


def test_encode_leaves_other_callers_requests_running(tiny_llm_factory) -> None:
    """`encode` steps until its own requests end, as `generate` does. It stepped until every request in the
    engine ended and dropped the others' outputs: a stream paused beside it never got its final output."""
    llm = tiny_llm_factory()
    texts = ["The quick brown fox", "def fibonacci(n):"]
    alone = llm.encode(texts, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    stream = llm.generate_stream([[1, 2, 3]], params)
    assert not next(stream).finished
    llm.engine.add_request("other", [4, 5, 6], params)
    beside = llm.encode(texts, use_tqdm=False)
    torch.testing.assert_close(
        torch.tensor([o.embedding for o in beside]), torch.tensor([o.embedding for o in alone]), atol=1e-5, rtol=1e-5
    )  # batched beside generation rows: summation order differs
    assert "other" in llm.engine.scheduler.requests  # still running: its output is its caller's to collect
    rest = list(stream)
    assert rest and rest[-1].finished and rest[-1].finish_reason == "length"
    llm.engine.abort_request("other")
    assert llm.engine.is_idle()


@pytest.mark.parametrize(
    "params, message",
    [
        ("mean", "pooling_params is a str, not a PoolingParams or a list of them"),
        (SamplingParams(), "pooling_params is a SamplingParams, not a PoolingParams or a list of them"),
        ([PoolingParams(), None], r"pooling_params\[1\] is None, not a PoolingParams"),
    ],
)
def test_pooling_params_of_the_wrong_type_are_refused_by_name(tiny_llm, params, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        tiny_llm.encode(["a", "b"], params, use_tqdm=False)
    assert tiny_llm.engine.is_idle()
