"""GPU checks at real shapes (skipped without CUDA): kernels vs references, HF parity, no host sync, graphs.

Run on the GPU machine: `python -m pytest -q tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch
from helpers.sync_check import step_without_host_sync

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_input_prep_kernels_at_real_shapes():
    from test_kernels_triton import random_step  # noqa: E402

    from framework.layers.kernels.input_prep import prepare_inputs_reference, prepare_inputs_triton

    state, step, n_draft = random_step(seed=11, num_slots=512, num_rows=256, max_len=4096, k=4)
    ref = prepare_inputs_reference(**step, **state)
    got, _ = prepare_inputs_triton(**step, **state, max_logits_per_row=max(n_draft) + 1)
    for name in ref._fields:
        assert torch.equal(getattr(got, name), getattr(ref, name).to(getattr(got, name).dtype)), name


def test_prepare_inputs_reads_pinned_host_history():
    """The token history may live in pinned host memory: the kernel must read it through unified addressing."""
    from test_kernels_triton import random_step  # noqa: E402

    from framework.layers.kernels.input_prep import prepare_inputs_reference, prepare_inputs_triton

    state, step, n_draft = random_step(seed=12, num_slots=64, num_rows=32, max_len=1024, k=0, prefill_only=True)
    ref = prepare_inputs_reference(**step, **state)
    state["all_token_ids"] = state["all_token_ids"].cpu().pin_memory()
    got, _ = prepare_inputs_triton(**step, **state, max_logits_per_row=1)
    assert torch.equal(got.input_ids, ref.input_ids)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_parity_with_hf_on_gpu(tmp_path, dtype):
    from helpers.hf_models import SPEC_BY_NAME, random_prompts, save_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    from framework import LLM, SamplingParams

    save_tiny_checkpoint(SPEC_BY_NAME["qwen3"], tmp_path)
    # As served: from_pretrained keeps the RoPE frequencies float32 (a `.to(bf16)` would round them; mrv2 keeps them).
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=getattr(torch, dtype)).to("cuda")
    prompts = random_prompts(6, 5, 60, seed=3)
    llm = LLM(str(tmp_path), device="cuda", dtype=dtype, max_model_len=128, gpu_memory_utilization=0.3)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    matches = 0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt], device="cuda")
        ref = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=None,
            pad_token_id=None,
        )[0, len(prompt) :].tolist()
        matches += out.token_ids == ref
    # fp32: exact. bf16: different kernels round differently, so a near-tie may flip late in a sequence.
    assert matches == len(prompts) if dtype == "float32" else matches >= len(prompts) - 1


def test_fp8_kv_cache_against_hf_with_a_rounding_cache_on_gpu(tmp_path):
    """`kv_cache_dtype=fp8` on the GPU path in bf16 (Triton stores, prefill and decode attention with float16
    products, CUDA graphs, the small-batch kernels) against HF's forward with K / V rounded to FP8
    (`hf_models.Fp8RoundingLayer`): the prompt's logprobs within 0.5, and 0.05 on average, and each greedy token
    HF's argmax wherever HF's top two are more than 0.25 apart. (float32 is compared within 1e-2 on the CPU:
    tests/models/test_kv_cache_fp8.py.)"""
    dtype = "bfloat16"
    from helpers.hf_models import SPEC_BY_NAME, cache_kwarg, fp8_rounding_cache, random_prompts, save_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    from framework import LLM, SamplingParams

    save_tiny_checkpoint(SPEC_BY_NAME["qwen3"], tmp_path)
    # As served: from_pretrained keeps the RoPE frequencies float32 (a `.to(bf16)` would round them; mrv2 keeps them).
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=getattr(torch, dtype)).to("cuda")
    prompts = random_prompts(4, 20, 60, seed=5)
    llm = LLM(
        str(tmp_path), device="cuda", dtype=dtype, max_model_len=128, gpu_memory_utilization=0.3, kv_cache_dtype="fp8"
    )
    assert {c.dtype for c in llm.engine.runner.kv_caches} == {torch.float8_e4m3fn}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    diffs, checked, tokens = [], 0, 0
    for prompt, out in zip(prompts, outs):
        seq = prompt + list(out.token_ids)
        with torch.no_grad():
            logits = (
                hf(
                    torch.tensor([seq[:-1]], device="cuda"),
                    use_cache=True,
                    **{cache_kwarg(hf): fp8_rounding_cache(hf.config.num_hidden_layers)},
                )
                .logits[0]
                .float()
            )
        ref = torch.log_softmax(logits, dim=-1)
        for pos in range(1, len(prompt)):  # prompt token pos, predicted by row pos - 1
            got = out.prompt_logprobs[pos][prompt[pos]].logprob
            diffs.append(abs(got - ref[pos - 1, prompt[pos]].item()))
        top2 = logits[len(prompt) - 1 :].topk(2, dim=-1).values
        for j, token in enumerate(out.token_ids):
            tokens += 1
            if top2[j, 0] - top2[j, 1] > 0.25:
                assert int(logits[len(prompt) - 1 + j].argmax()) == token, f"output token {j}"
                checked += 1
    worst, mean = max(diffs), sum(diffs) / len(diffs)
    assert worst < 0.5 and mean < 0.05, (worst, mean)
    assert checked >= 0.5 * tokens


def test_step_path_has_no_host_sync():
    from framework import LLM, SamplingParams

    llm = LLM("random_tiny", device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, async_scheduling=False)
    engine = llm.engine
    for i in range(8):
        engine.add_request(
            f"r{i}",
            list(range(10 + 3 * i)),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=16, ignore_eos=True),
        )
    engine.step()  # warm-up: compilation and first allocations may sync
    for _ in range(5):
        step_without_host_sync(engine)


def test_longest_rows_first_same_tokens_and_no_host_sync():
    """72 mixed-length requests, so forwards of >= 64 rows order their attention longest rows first (the rank
    kernel in eager prefills, decode graphs and full-step graphs alike): the same greedy tokens as batch order,
    and a decode step at 72 rows queues without a host sync."""
    from framework import LLM, SamplingParams
    from framework.layers.attention.backend import LONGEST_FIRST_MIN_ROWS

    prompts = [[(11 * i + j) % 250 for j in range(3 + (37 * i) % 90)] for i in range(72)]
    assert len(prompts) >= LONGEST_FIRST_MIN_ROWS
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for order in (True, False):
        llm = LLM(
            "random_tiny",
            device="cuda",
            dtype="bfloat16",
            gpu_memory_utilization=0.3,
            max_num_seqs=96,
            full_step_cuda_graphs=True,
            longest_rows_first=order,
        )
        outs[order] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if order:
            engine = llm.engine
            for i, p in enumerate(prompts):
                engine.add_request(f"s{i}", p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
            for _ in range(3):  # the prefill steps, then a decode step at 72 rows
                engine.step()
            step_without_host_sync(engine)
        del llm
    assert outs[True] == outs[False]


def test_cuda_graph_replay_equals_eager():
    from framework import LLM, SamplingParams

    prompts = [[(7 * i + j) % 250 for j in range(5 + 9 * i)] for i in range(11)]
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=40, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = LLM("random_tiny", device="cuda", dtype="float32", gpu_memory_utilization=0.3, cuda_graphs=graphs)
        assert (llm.engine.runner.graphs.cuda_graphs is not None) == graphs
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert outs[True] == outs[False]


def test_v1_cuda_graph_replay_equals_eager():
    """V1 replays V2's decode graphs: the same tokens as its eager forwards (seeded sampling through the fused
    sampler), and the decode steps did replay."""
    from framework import LLM, SamplingParams

    prompts = [[(7 * i + j) % 250 for j in range(5 + 9 * i)] for i in range(11)]
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=40, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        llm = LLM(
            "random_tiny", device="cuda", dtype="float32", gpu_memory_utilization=0.3, cuda_graphs=graphs, runner="v1"
        )
        runner = llm.engine.runner
        assert runner.name == "v1" and (runner.cuda_graphs is not None) == graphs
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if graphs:
            assert runner.eager_forwards < 10, "the ~40 decode steps ran eagerly"
        del llm
    assert outs[True] == outs[False]


def test_v1_step_waits_for_the_device_once():
    """V1 is synchronous by design, but one step (execute, sample, read the output) syncs with the device once:
    counted by CUDA's sync debug mode, whose warnings a planted `.item()` shows are seen."""
    import warnings

    from framework import LLM, SamplingParams

    llm = LLM("random_tiny", device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, runner="v1")
    engine = llm.engine
    for i in range(8):
        engine.add_request(
            f"r{i}",
            list(range(10 + 3 * i)),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=16, ignore_eos=True),
        )
    engine.step()  # warm-up: compilation and first allocations may sync

    def syncs(fn) -> int:  # type: ignore[no-untyped-def]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    assert syncs(lambda: torch.ones(2, device="cuda").sum().item()) >= 1  # the counter sees a planted sync
    for _ in range(5):
        so = engine.scheduler.schedule()
        out = {}
        n = syncs(lambda: (engine.runner.execute_model(so), out.setdefault("o", engine.runner.sample_tokens().get())))
        engine.scheduler.update_from_output(so, out["o"].sampled_token_ids)
        assert n == 1, f"a V1 step synced {n} times"


def test_input_batch_is_one_pinned_host_to_device_copy():
    """build_input_batch sends its five per-row arrays in one copy from pinned memory (the profiler's memcpy
    count), and they arrive right, also after the buffers went round the ring."""
    from torch.profiler import ProfilerActivity, profile

    from framework.batch.input_batch import build_input_batch, input_staging
    from framework.batch.request_state import RequestState
    from framework.params.sampling_params import SamplingParams
    from framework.params.scheduler_output import NewRequestData, SchedulerOutput

    dev = torch.device("cuda")
    state = RequestState(256, 512, 2, dev, history_on_host=True)
    for i in range(200):
        state.add_request(NewRequestData(f"r{i}", [1 + i % 50] * 8, 8, SamplingParams(), 0, [i], 0))
    state.apply_staged_writes()
    staging = input_staging(256, dev)
    assert all(b.is_pinned() for b in staging.ring.buffers)
    for step in range(5):  # past the ring of 3
        ids = [f"r{i}" for i in range(step, 200, 1 + step % 2)]
        out = SchedulerOutput(
            ids, [1 + j % 3 for j in range(len(ids))], [0] * len(ids), [], [], num_computed_tokens=[0] * len(ids)
        )
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            batch = build_input_batch(out, state, dev, staging)
            torch.cuda.synchronize()
        h2d = [e for e in prof.events() if "Memcpy HtoD" in e.name]
        assert len(h2d) == 1, [e.name for e in h2d]
        assert batch.idx_mapping.tolist() == [state.req_id_to_slot[r] for r in ids]
        assert batch.query_lens.tolist() == out.num_scheduled_tokens
        assert batch.query_start_loc[-1].item() == sum(out.num_scheduled_tokens)
