"""FP8 KV cache (`cache.kv_cache_dtype`): the config, the cache's size, and the engine against HF transformers.

The reference is HF's own forward with a cache layer that passes every K and V through torch's float8 cast
before HF's attention reads them (`hf_models.Fp8RoundingLayer`): the semantics mrv2 promises (each cached
element rounded once, saturating, no scale; everything else at the model's precision). Whisper's is in
test_whisper.py. On the CPU mrv2 runs the PyTorch
reference attention; the Triton kernels' FP8 paths are compared with it in test_attention_triton.py and
test_layer_ops.py (interpreter) and tests/gpu/test_attention_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers.hf_models import SPEC_BY_NAME, cache_kwarg, fp8_rounding_cache, save_tiny_checkpoint
from test_hf_parity import PROMPTS, SCENARIOS, run_mrv2

from framework.config.schema import ConfigError, load_config
from framework.entrypoints.llm import LLM
from framework.layers.kernels.kv_cache_dtype import FP8_E4M3_MAX, kv_cache_torch_dtype, saturating_cast
from framework.models.setup import kv_bytes_per_block
from framework.params.sampling_params import SamplingParams

# Measured on the CPU (fp32 model): 7e-6 to 1.6e-3 from HF with the rounding cache (a key computed 1e-7 apart
# by the two RoPEs now and then rounds to the neighbouring FP8 value), 0.9-1.4 from HF without it.
FP8_LOGITS_ATOL = 1e-2


def hf_logits_fp8_cache(model: torch.nn.Module, token_ids: list[int], rounding: bool = True) -> torch.Tensor:
    """[len, vocab] float32 logits of one sequence, its K and V read back from an FP8 cache (`rounding`)."""
    cache = fp8_rounding_cache(model.config.num_hidden_layers) if rounding else None
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), use_cache=rounding, **{cache_kwarg(model): cache})
    return out.logits[0].float()


def test_config_names_and_rejects_unknown_kv_cache_dtypes():
    assert load_config({"cache": {"kv_cache_dtype": "fp8"}}).cache.kv_cache_dtype == "fp8"
    assert load_config({}).cache.kv_cache_dtype == "auto"
    with pytest.raises(ConfigError, match="cache.kv_cache_dtype"):
        load_config({"cache": {"kv_cache_dtype": "int8"}})
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2


def test_saturating_cast_clamps_instead_of_overflowing():
    x = torch.tensor([1000.0, -1e6, 3.0, 447.0, float("inf")])
    e4m3 = saturating_cast(x, torch.float8_e4m3fn).float()
    assert e4m3.tolist() == [FP8_E4M3_MAX, -FP8_E4M3_MAX, 3.0, 448.0, FP8_E4M3_MAX]
    e5m2 = saturating_cast(torch.tensor([1e6, -1e6]), torch.float8_e5m2).float()
    assert e5m2.tolist() == [57344.0, -57344.0] and torch.isfinite(e5m2).all()
    assert saturating_cast(x[:3], torch.bfloat16).dtype == torch.bfloat16  # not FP8: a plain cast


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_fp8_cache_holds_one_byte_per_element(name):
    """The runner allocates the FP8 type, and the block budget counts one byte per element."""
    plain = LLM("tiny", device="cpu", num_kv_blocks=8, max_model_len=128)
    fp8 = LLM("tiny", device="cpu", num_kv_blocks=8, max_model_len=128, kv_cache_dtype=name)
    try:
        assert {c.dtype for c in fp8.engine.runner.kv_caches} == {kv_cache_torch_dtype(name, torch.float32)}
        assert {c.dtype for c in plain.engine.runner.kv_caches} == {plain.engine.loaded.dtype}
        ratio = kv_bytes_per_block(plain.engine.loaded, 16) / kv_bytes_per_block(fp8.engine.loaded, 16)
        assert ratio == plain.engine.loaded.dtype.itemsize
        assert sum(c.nbytes for c in plain.engine.runner.kv_caches) == ratio * sum(
            c.nbytes for c in fp8.engine.runner.kv_caches
        )
    finally:
        plain.shutdown()
        fp8.shutdown()


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(f"fp8-{request.param}")
    return path, save_tiny_checkpoint(SPEC_BY_NAME[request.param], path)


@pytest.mark.parametrize("scenario", ["plain", "chunked_preempt"])
def test_fp8_logits_match_hf_with_a_rounding_cache(checkpoint, scenario):
    """Every logits row of an FP8-cache run (prefills, decodes, chunks, recomputation after preemption) is close to
    HF's with K and V rounded to FP8, and far from HF's without: the cache really is FP8, and nothing else is."""
    path, hf_model = checkpoint
    run = run_mrv2(path, PROMPTS, kv_cache_dtype="fp8", **SCENARIOS[scenario])
    worst, worst_unrounded = 0.0, 0.0
    for i, (prompt, out) in enumerate(zip(PROMPTS, run.outputs)):
        sequence = prompt + out.token_ids[:-1]
        reference = hf_logits_fp8_cache(hf_model, sequence)
        unrounded = hf_logits_fp8_cache(hf_model, sequence, rounding=False)
        for j, seq_len, row in run.logits:
            if j == i:
                worst = max(worst, (row - reference[seq_len - 1]).abs().max().item())
                worst_unrounded = max(worst_unrounded, (row - unrounded[seq_len - 1]).abs().max().item())
                if seq_len >= len(prompt):  # greedy: the emitted token is the row's argmax
                    assert int(row.argmax()) == out.token_ids[seq_len - len(prompt)]
    assert worst < FP8_LOGITS_ATOL, f"max |logits - HF with an FP8 cache| = {worst:.2e}"
    assert worst_unrounded > 20 * FP8_LOGITS_ATOL, f"an FP8 cache should move logits: {worst_unrounded:.2e}"
    if "preempt" in scenario:
        assert sum(out.num_preemptions for out in run.outputs) > 0


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SEGMENT = [11, 200, 37, 5, 90, 141, 66]


def test_greedy_ngram_on_an_fp8_cache_equals_no_speculation(tmp_path):
    """Verification rows read the FP8 cache exactly as decode rows do: with drafts, the same greedy tokens."""
    save_tiny_checkpoint(SPEC_BY_NAME["llama"], tmp_path)
    prompts = PROMPTS[:3] + [SEGMENT * 5]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = {}
    for name, spec in (("plain", None), ("ngram", NGRAM)):
        llm = LLM(
            str(tmp_path),
            device="cpu",
            dtype="float32",
            max_model_len=96,
            seed=0,
            kv_cache_dtype="fp8",
            block_size=4,
            num_kv_blocks=24,
            **({"speculative_config": spec} if spec else {}),
        )
        runs[name] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if spec:
            assert llm.get_metrics()["spec_decode"]["num_accepted_tokens"] > 0
        llm.shutdown()
    assert runs["ngram"] == runs["plain"]


@pytest.mark.parametrize("model", ["jamba-tiny", "qwen3-moe-tiny"])
def test_hybrid_and_moe_models_run_on_an_fp8_cache(model):
    """The Mamba hybrid's attention layers and the MoE decoder store into and read the FP8 cache: prompt
    logprobs stay within 0.1 nats of the model-dtype cache's (and differ from them: the cache is FP8)."""
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0)
    prompt = list(range(3, 60))
    logprobs = {}
    for name in ("auto", "fp8"):
        llm = LLM(model, device="cpu", max_model_len=128, num_kv_blocks=16, kv_cache_dtype=name)
        assert {c.dtype for c in llm.engine.runner.kv_caches} == {kv_cache_torch_dtype(name, torch.float32)}
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        logprobs[name] = torch.tensor([next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]])
        llm.shutdown()
    diff = (logprobs["fp8"] - logprobs["auto"]).abs()
    assert diff.max() < 0.1 and diff.max() > 0, diff.max()


def test_eagle_on_an_fp8_cache_equals_no_speculation(tmp_path, monkeypatch):
    """The EAGLE draft layer's own KV cache is FP8 too, and with it the greedy tokens equal those of the same FP8
    cache without speculation."""
    from test_draft_heads import random_head
    from test_spec_heads_engine import HEAD_KWARGS, TARGET_OF, K, generate, target_dir

    from framework.models.loader import read_hf_config
    from speculators.head_drafter import HeadDrafter

    bound: list[torch.dtype] = []
    bind = HeadDrafter.bind_kv_cache
    monkeypatch.setattr(
        HeadDrafter, "bind_kv_cache", lambda self, cache: (bound.append(cache.dtype), bind(self, cache))
    )
    target = target_dir(TARGET_OF["eagle"], str(tmp_path))
    head_dir = tmp_path / "eagle-head"
    random_head("eagle", seed=1, target=read_hf_config(target), **HEAD_KWARGS["eagle"]).save_pretrained(head_dir)
    fp8 = {"cache": {"kv_cache_dtype": "fp8"}}
    spec = {"method": "eagle", "num_speculative_tokens": K, "model": str(head_dir)}
    drafts: list = []
    assert generate(target, spec, fp8, drafts) == generate(target, None, fp8)
    assert drafts, "the head proposed nothing"
    assert bound == [torch.float8_e4m3fn]
