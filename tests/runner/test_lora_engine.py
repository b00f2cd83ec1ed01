"""LoRA in the engine: a batch mixing four adapters and the base equals each request run alone; prefix-cache
blocks are keyed by adapter; GPU slots are evicted least recently used; bad adapters are refused by name and
disturb nothing already loaded; PEFT's merged `qkv_proj` / `gate_up_proj` layout equals the separate one; the
opt-in fused launch over the per-step sorted layout gives the default launches' tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest
import torch
from helpers.hf_models import SPEC_BY_NAME, random_prompts, save_tiny_checkpoint
from helpers.lora_adapters import ADAPTERS, AdapterSpec, save_adapter
from safetensors.torch import load_file, save_file

from framework.entrypoints.llm import LLM
from framework.params.lora_request import LoRARequest
from framework.params.sampling_params import InvalidRequestError, SamplingParams

SPEC = SPEC_BY_NAME["qwen3"]
PROMPTS = random_prompts(3, 5, 28, seed=21)
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, LoRARequest]]:
    root = tmp_path_factory.mktemp("lora-engine")
    save_tiny_checkpoint(SPEC, root / "base")
    loras = {a.name: LoRARequest(a.name, str(save_adapter(SPEC, a, root / a.name))) for a in ADAPTERS}
    return root / "base", loras


def _llm(base: Path, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(base), device="cpu", dtype="float32", max_model_len=64, seed=0, enable_lora=True, **kwargs)


def test_mixed_batch_equals_each_request_alone(files) -> None:  # type: ignore[no-untyped-def]
    base, loras = files
    llm = _llm(base, max_loras=4)
    names: list[Optional[str]] = [None, *loras]
    requests = [(n, i) for i in range(len(PROMPTS)) for n in names]
    batch = llm.generate(
        [PROMPTS[i] for _, i in requests], PARAMS, use_tqdm=False, lora_request=[loras.get(n) for n, _ in requests]
    )
    alone = [llm.generate([PROMPTS[i]], PARAMS, use_tqdm=False, lora_request=loras.get(n))[0] for n, i in requests]
    for (name, i), together, single in zip(requests, batch, alone):
        assert together.token_ids == single.token_ids, f"adapter {name}, prompt {i}"
    outputs_of_prompt0 = {tuple(o.token_ids) for (n, i), o in zip(requests, batch) if i == 0}
    assert len(outputs_of_prompt0) == len(names), "every adapter should change the output"
    # ngram drafts verified by the target with each row's adapter: the same tokens
    spec = _llm(base, max_loras=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    drafted = spec.generate(
        [PROMPTS[i] for _, i in requests], PARAMS, use_tqdm=False, lora_request=[loras.get(n) for n, _ in requests]
    )
    assert [o.token_ids for o in drafted] == [o.token_ids for o in batch]
    assert spec.engine.spec_metrics.num_accepted_tokens > 0, "no draft was accepted: the check saw no verification"


def test_prefix_cache_blocks_are_keyed_by_adapter(files) -> None:  # type: ignore[no-untyped-def]
    base, loras = files
    llm = _llm(base, enable_prefix_caching=True, block_size=4)
    a, b = loras[ADAPTERS[0].name], loras[ADAPTERS[1].name]
    prompt = PROMPTS[2]  # 28 tokens: 7 full blocks
    order = [a, b, None, a, b, None]
    runs = [llm.generate([prompt], PARAMS, use_tqdm=False, lora_request=lora)[0] for lora in order]
    cached = [r.num_cached_tokens for r in runs]
    assert cached[:3] == [0, 0, 0], f"a prefix computed under another adapter (or the base) was reused: {cached}"
    assert all(c > 0 for c in cached[3:]), f"the same adapter should reuse its own prefix: {cached}"
    for first, again in zip(runs[:3], runs[3:]):
        assert first.token_ids == again.token_ids
    assert len({tuple(r.token_ids) for r in runs[:3]}) == 3


def test_more_adapters_than_slots_evicts_least_recently_used(files) -> None:  # type: ignore[no-untyped-def]
    base, loras = files
    llm = _llm(base, max_loras=1, max_cpu_loras=2)
    slots = llm.engine.runner.lora_state.slots
    order = [ADAPTERS[0].name, ADAPTERS[1].name, ADAPTERS[0].name, ADAPTERS[2].name]
    outs = [llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False, lora_request=loras[n])[0] for n in order]
    assert slots.loads == 4, "one GPU slot: every change of adapter loads it again"
    assert [r.name for r in slots.cpu] == [ADAPTERS[0].name, ADAPTERS[2].name], "CPU copies: LRU, at most 2"
    assert outs[0].token_ids == outs[2].token_ids != outs[1].token_ids
    # all at once through one slot: requests wait for the slot, none fails
    batch = llm.generate([PROMPTS[0]] * 4, PARAMS, use_tqdm=False, lora_request=[loras[n] for n in order])
    assert [o.token_ids for o in batch] == [o.token_ids for o in outs]


def _copy_adapter(src: str, dst: Path, config: Optional[dict] = None, tensors: Optional[dict] = None) -> str:
    dst.mkdir()
    cfg = json.loads((Path(src) / "adapter_config.json").read_text()) | (config or {})
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    weights = tensors if tensors is not None else load_file(str(Path(src) / "adapter_model.safetensors"))
    save_file({k: v.clone() for k, v in weights.items()}, str(dst / "adapter_model.safetensors"))
    return str(dst)


def test_bad_adapters_are_refused_by_name(files, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    base, loras = files
    llm = _llm(base, max_loras=2, max_lora_rank=8)
    good = loras[ADAPTERS[0].name]
    before = llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False, lora_request=good)[0].token_ids
    weights = load_file(str(Path(good.path) / "adapter_model.safetensors"))
    key = next(k for k in weights if "layers.0.self_attn.q_proj.lora_A" in k)
    layer7 = {k.replace("layers.0", "layers.7"): v for k, v in weights.items() if "layers.0.self_attn.q_proj" in k}
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((Path(good.path) / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"not loaded")
    cases = {
        "rank 16 exceeds lora.max_rank=8": loras[ADAPTERS[2].name].path,
        "'layers.7.self_attn.q_proj' does not exist": _copy_adapter(
            good.path, tmp_path / "layer7", tensors={**weights, **layer7}
        ),
        "the base model needs A": _copy_adapter(
            good.path, tmp_path / "shape", tensors={**weights, key: torch.zeros(8, 48)}
        ),
        "DoRA is not supported": _copy_adapter(good.path, tmp_path / "dora", config={"use_dora": True}),
        "pickled weights are never loaded": str(pickled),
        "no adapter_config.json": str(tmp_path / "missing"),
    }
    for message, path in cases.items():
        with pytest.raises(InvalidRequestError, match=f"LoRA adapter 'bad'.*{message}".replace("(", r"\(")):
            llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False, lora_request=LoRARequest("bad", path))
    assert llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False, lora_request=good)[0].token_ids == before
    plain = LLM(str(base), device="cpu", dtype="float32", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="lora.enable is false"):
        plain.generate([PROMPTS[0]], PARAMS, use_tqdm=False, lora_request=good)


def test_moe_experts_are_refused_by_name() -> None:
    from framework.models.lora.adapter import LoraAdapterError, LoraTargets, ProjectionShape, _parts
    from framework.models.lora.projection import lora_targets  # noqa: F401  (the table the check reads)

    targets = LoraTargets({(0, "q_proj"): ProjectionShape(8, 8)}, frozenset({0}))
    with pytest.raises(LoraAdapterError, match="mixture-of-experts layer: LoRA on MoE experts is not supported"):
        _parts("moe", 0, "mlp", "experts.3.gate_proj", targets)


def test_merged_qkv_and_gate_up_layout_equals_separate(files, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """PEFT on a model with merged projections (Phi-3's qkv_proj, gate_up_proj) saves one A and a stacked B; the
    same update written as separate q/k/v (gate/up) modules sharing that A must give the same tokens."""
    base, _ = files
    separate = save_adapter(
        SPEC,
        AdapterSpec("sep", ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), 4, 8.0, seed=31),
        tmp_path / "sep",
    )
    weights = load_file(str(separate / "adapter_model.safetensors"))
    merged: dict[str, torch.Tensor] = {}
    for layer in range(2):
        for group, parts, name in (
            ("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
            ("mlp", ("gate_proj", "up_proj"), "gate_up_proj"),
        ):
            prefix = f"base_model.model.model.layers.{layer}.{group}."
            shared_a = weights[prefix + parts[0] + ".lora_A.weight"]
            for p in parts:  # the separate adapter with every part reading the same A
                weights[prefix + p + ".lora_A.weight"] = shared_a
            merged[prefix + name + ".lora_A.weight"] = shared_a
            merged[prefix + name + ".lora_B.weight"] = torch.cat(
                [weights[prefix + p + ".lora_B.weight"] for p in parts]
            )
    sep_path = _copy_adapter(str(separate), tmp_path / "sep-shared-a", tensors=weights)
    merged_path = _copy_adapter(str(separate), tmp_path / "merged", tensors=merged)
    llm = _llm(base, max_loras=2)
    a = llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=LoRARequest("sep", sep_path))
    b = llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=LoRARequest("merged", merged_path))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_graph_replays_with_changing_adapters_equal_eager(files) -> None:  # type: ignore[no-untyped-def]
    """Full-step and decode graphs captured once (before any adapter is loaded) replay steps whose rows change
    adapters; `StaticInputsCapturer` fails a replay that reads a tensor it did not read at capture or reads the
    device from the host. Tokens equal the eager engine's."""
    from helpers.fake_graphs import StaticInputsCapturer
    from helpers.observed import counted

    base, loras = files
    kwargs = {"max_loras": 2, "max_num_seqs": 4, "async_scheduling": True}
    eager = _llm(base, cuda_graphs=False, **kwargs)
    graphed = _llm(base, full_step_cuda_graphs=True, **kwargs)
    graphed.engine.runner.capture_cuda_graphs(StaticInputsCapturer())
    counts = counted(graphed)
    names: list[Optional[str]] = [None, *loras]
    requests = [(n, i) for i in range(len(PROMPTS)) for n in names]
    args = ([PROMPTS[i] for _, i in requests], PARAMS)
    lora = [loras.get(n) for n, _ in requests]
    want = eager.generate(*args, use_tqdm=False, lora_request=lora)
    got = graphed.generate(*args, use_tqdm=False, lora_request=lora)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert counts.full_step_replays > 5, "the decode steps should replay the captured step"


def test_fused_launch_over_the_staged_layout_equals_the_default(files, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`FUSED_MAX_TOKENS` raised: every group runs the fused Triton launch (interpreter) over the layout `LoraState`
    staged for the step, under chunked prefill with prefill and decode rows of several adapters in one step; each
    forward's layout groups exactly its tokens with an adapter by slot, and the tokens equal the default pair's."""
    from framework.layers.kernels import lora_fused
    from framework.models.lora import projection

    base, loras = files
    kwargs = {"max_loras": 4, "max_num_batched_tokens": 24}
    names: list[Optional[str]] = [None, *loras]
    prompts, lora = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))], [loras.get(n) for n in names]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = _llm(base, **kwargs).generate(prompts, params, use_tqdm=False, lora_request=lora)
    checked: list[int] = []

    def fused(y, x, lora_a, lora_b, token_lora, sorted_rows, slot_bounds, backend, parts) -> None:  # type: ignore[no-untyped-def]
        bounds = slot_bounds.tolist()
        staged = [[r for r in sorted_rows[s:e].tolist() if r < x.shape[0]] for s, e in zip(bounds, bounds[1:])]
        rows, starts = lora_fused.lora_segments(token_lora.numpy(), len(bounds) - 1)
        assert staged == [rows[s:e].tolist() for s, e in zip(starts, starts[1:])], "layout != the step's token map"
        checked.append(int((token_lora >= 0).sum()))
        lora_fused.lora_shrink_expand(y, x, lora_a, lora_b, token_lora, sorted_rows, slot_bounds, "triton", parts)

    monkeypatch.setattr(lora_fused, "FUSED_MAX_TOKENS", 1 << 20)
    monkeypatch.setattr(projection, "lora_shrink_expand", fused)
    got = _llm(base, **kwargs).generate(prompts, params, use_tqdm=False, lora_request=lora)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert len(checked) > 8 and max(checked) > 12, f"adapter tokens per fused launch: {checked}"
