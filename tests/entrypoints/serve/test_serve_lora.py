"""LoRA adapters through `mrv2 serve` and the official openai client: selection by `model`, /v1/models,
run-time load / unload, 404 for unknown names. Each answer's greedy tokens equal HF transformers + PEFT's on the
same base and adapter (the tiny checkpoint has no tokenizer, so the token ids come back as the logprob tokens)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from helpers.hf_models import SPEC_BY_NAME, build_hf_model, hf_greedy, random_prompts, save_tiny_checkpoint
from helpers.lora_adapters import ADAPTERS, AdapterSpec, hf_peft_model, save_adapter
from helpers.serve_helpers import ServerProcess, openai_client

from framework.config.schema import load_config
from framework.entrypoints.serve.errors import ApiError
from framework.entrypoints.serve.lora import ServedLoras, _runtime_allowed, parse_lora_modules

SPEC = SPEC_BY_NAME["qwen3"]
PROMPT = random_prompts(1, 12, 12, seed=5)[0]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("serve-lora")
    save_tiny_checkpoint(SPEC, root / "base")
    paths = {a.name: save_adapter(SPEC, a, root / a.name) for a in ADAPTERS[:3]}
    paths["too-big"] = save_adapter(SPEC, AdapterSpec("too-big", ("q_proj",), 32, 8.0, seed=3), root / "too-big")
    expected = {"base": hf_greedy(build_hf_model(SPEC), PROMPT, MAX_TOKENS)}
    expected |= {n: hf_greedy(hf_peft_model(SPEC, paths[n]), PROMPT, MAX_TOKENS) for n in list(paths)[:3]}
    first, second, _ = ADAPTERS[:3]
    overrides = (
        f"model.path={root / 'base'}",
        "model.dtype=float32",
        "serve.served_model_name=base",
        "lora.enable=true",
        "lora.max_loras=2",
        f"serve.lora_modules=['{first.name}={paths[first.name]}','{second.name}={paths[second.name]}']",
        "serve.allow_runtime_lora=true",
    )
    with ServerProcess(*overrides) as server:
        yield server, paths, expected


def _tokens(client: openai.OpenAI, model: str) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
    return [int(t) for t in out.choices[0].logprobs.tokens]


def test_models_lists_adapters_with_the_base_as_parent(setup) -> None:  # type: ignore[no-untyped-def]
    server, paths, _ = setup
    cards = {m.id: m for m in openai_client(server).models.list().data}
    assert set(cards) == {"base", ADAPTERS[0].name, ADAPTERS[1].name}
    for name in (ADAPTERS[0].name, ADAPTERS[1].name):
        assert cards[name].model_extra["parent"] == "base"
        assert cards[name].model_extra["root"] == str(paths[name])


def test_model_field_selects_the_adapter(setup) -> None:  # type: ignore[no-untyped-def]
    server, _, expected = setup
    client = openai_client(server)
    for name in ("base", ADAPTERS[0].name, ADAPTERS[1].name):
        assert _tokens(client, name) == expected[name], name
    assert expected[ADAPTERS[0].name] != expected["base"]


def test_unknown_model_is_404(setup) -> None:  # type: ignore[no-untyped-def]
    server, _, _ = setup
    with pytest.raises(openai.NotFoundError, match="no-such-adapter"):
        _tokens(openai_client(server), "no-such-adapter")


def test_load_and_unload_at_run_time(setup) -> None:  # type: ignore[no-untyped-def]
    server, paths, expected = setup
    client, name = openai_client(server), ADAPTERS[2].name
    with pytest.raises(openai.NotFoundError):
        _tokens(client, name)
    loaded = server.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(paths[name])})
    assert loaded.status_code == 200, loaded.text
    assert name in {m.id for m in client.models.list().data}
    assert _tokens(client, name) == expected[name]
    # 3 adapters through 2 GPU slots: the earlier ones still give their own outputs after the eviction
    assert _tokens(client, ADAPTERS[0].name) == expected[ADAPTERS[0].name]
    again = server.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(paths[name])})
    assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
    assert server.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _tokens(client, name)
    missing = server.post("/v1/unload_lora_adapter", json={"lora_name": name})
    assert missing.status_code == 404


def test_bad_adapters_are_refused_by_name_and_disturb_nothing(setup, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server, paths, expected = setup
    big = server.post("/v1/load_lora_adapter", json={"lora_name": "too-big", "lora_path": str(paths["too-big"])})
    assert big.status_code == 400 and "rank 32 exceeds lora.max_rank=16" in big.json()["error"]["message"]
    empty = server.post("/v1/load_lora_adapter", json={"lora_name": "nothing", "lora_path": str(tmp_path)})
    assert empty.status_code == 400 and "adapter_config.json" in empty.json()["error"]["message"]
    assert _tokens(openai_client(server), ADAPTERS[1].name) == expected[ADAPTERS[1].name]


def test_runtime_loading_is_refused_unless_allowed() -> None:
    config = load_config({"lora": {"enable": True}})
    with pytest.raises(ApiError) as err:
        _runtime_allowed(ServedLoras(config), "/v1/load_lora_adapter")
    assert err.value.status == 403 and "serve.allow_runtime_lora" in str(err.value)


def test_lora_modules_parse() -> None:
    assert parse_lora_modules(["a=/x", " b = /y/z "]) == {"a": "/x", "b": "/y/z"}
    for bad in (["a"], ["=x"], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="serve.lora_modules"):
            parse_lora_modules(bad)
