"""The trained `tiny` model shipped in the package (framework/models/embedded/tiny-code/).

The resolution tests always run. The tests of the shipped files skip, naming what to do, until the files
produced by `training/train_tiny.py` are copied into the package (see docs/embedded-model.md).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from framework import LLM, SamplingParams
from framework.models import embedded
from framework.models.embedded import resolve_model_source, shipped_draft_head_dir, shipped_model_dir

REPO = Path(__file__).resolve().parents[2]
SHIPPED = shipped_model_dir("tiny")
needs_shipped = pytest.mark.skipif(
    SHIPPED is None,
    reason="the trained tiny model is not in the package yet: run training/train_tiny.py on a GPU and copy its "
    "tiny-code* directories into framework/models/embedded/ (docs/embedded-model.md)",
)
# Python prompts in the style of the standard library (not copied from it).
PYTHON_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
# A code snippet the model never saw (written for this test); a trained code model predicts it far better
# than chance (ln 8192 = 9.0 nats/token).
UNSEEN_CODE = '''def count_words(path):
    """Return a dict mapping each word in the file to the number of times it occurs."""
    counts = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            for word in line.split():
                counts[word] = counts.get(word, 0) + 1
    return counts


class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def __repr__(self):
        return f"Point({self.x!r}, {self.y!r})"
'''


def _random_checkpoint(root: Path) -> dict:
    """An HF directory holding the random_tiny weights (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    from framework.models.loader import build_model, init_random_weights
    from framework.models.presets import preset_config

    cfg = preset_config("random_tiny")
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    init_random_weights(model, 7, cfg["initializer_range"])
    root.mkdir(parents=True)
    tensors = {n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(cfg))
    return cfg


def test_tiny_resolves_to_the_shipped_directory_when_present(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "EMBEDDED_ROOT", tmp_path)
    assert resolve_model_source(None, "tiny").preset == "random_tiny"  # nothing shipped: the random fallback
    assert resolve_model_source(None, "qwen3-0.6b").preset == "qwen3-0.6b"
    assert resolve_model_source("/some/dir", "tiny").path == "/some/dir"  # model.path always wins
    (tmp_path / "tiny-code").mkdir()
    (tmp_path / "tiny-code" / "config.json").write_text("{}")
    assert resolve_model_source(None, "tiny").preset == "random_tiny"  # incomplete (no weights): not used
    (tmp_path / "tiny-code").rename(tmp_path / "partial")

    _random_checkpoint(tmp_path / "tiny-code")
    source = resolve_model_source(None, "tiny")
    assert source.path == str(tmp_path / "tiny-code") and source.preset is None
    shipped = LLM("tiny", device="cpu", seed=0)
    assert shipped.engine.loaded.hf_config == json.loads((tmp_path / "tiny-code" / "config.json").read_text())
    weights = shipped.engine.runner.model.state_dict()
    reference = LLM(str(tmp_path / "tiny-code"), device="cpu", seed=0).engine.runner.model.state_dict()
    random = LLM("random_tiny", device="cpu", seed=0).engine.runner.model.state_dict()  # seed 0, not 7
    assert all(torch.equal(weights[n], reference[n]) for n in weights)
    assert not torch.equal(weights["model.embed_tokens.weight"], random["model.embed_tokens.weight"])


def test_unknown_preset_lists_the_shipped_names_too():
    with pytest.raises(
        ValueError,
        match="embedded presets: gemma-3-4b, gemma-4-default, gpt-oss-20b, gpt-oss-20b-mxfp4, jamba-1024, jamba-tiny, "
        "qwen3-0.6b, "
        "qwen3-30b-a3b, qwen3-8b, qwen3-moe-tiny, qwen3_5-0.8b, qwen3_5-35b-a3b, qwen3_5-tiny, random_tiny, tiny, "
        "whisper-base",
    ):
        LLM("nope", device="cpu")


def test_package_data_covers_the_shipped_directories():
    """`pip install .` (non-editable) must carry the shipped model: pyproject's package-data names its files."""
    text = (REPO / "pyproject.toml").read_text()
    assert '"models/embedded/*/*.json"' in text and '"models/embedded/*/*.safetensors"' in text


# ---- the shipped files ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped_llm() -> LLM:
    return LLM("tiny", device="cpu", dtype="float32", seed=0)


@needs_shipped
def test_shipped_files_load_through_the_hf_directory_path(shipped_llm):
    from safetensors.torch import load_file

    from framework.models.tokenizer import HFTokenizer

    assert isinstance(shipped_llm.tokenizer, HFTokenizer)
    config = json.loads((SHIPPED / "config.json").read_text())
    assert shipped_llm.engine.loaded.hf_config == config
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["tie_word_embeddings"]
    params = dict(shipped_llm.engine.runner.model.named_parameters())
    for name, tensor in load_file(str(SHIPPED / "model.safetensors")).items():
        assert torch.equal(params[name].detach(), tensor.float()), name
    eos = shipped_llm.tokenizer.eos_token_id
    assert shipped_llm.tokenizer.decode([eos], skip_special_tokens=False) == "<|endoftext|>"
    for text in PYTHON_PROMPTS:
        assert shipped_llm.tokenizer.decode(shipped_llm.tokenizer.encode(text)) == text


@needs_shipped
def test_shipped_model_is_within_the_size_limits():
    from safetensors.torch import load_file

    weights = sum(t.numel() for t in load_file(str(SHIPPED / "model.safetensors")).values())
    assert (SHIPPED / "model.safetensors").stat().st_size <= 30 * 10**6 and 5e6 <= weights <= 20e6


@needs_shipped
def test_shipped_model_predicts_unseen_code_far_better_than_chance(shipped_llm):
    ids = shipped_llm.tokenizer.encode(UNSEEN_CODE)
    out = shipped_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    nll = -sum(lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:])) / (len(ids) - 1)
    vocab = json.loads((SHIPPED / "config.json").read_text())["vocab_size"]
    assert nll < 0.3 * math.log(vocab), f"mean NLL {nll:.2f} nats/token on unseen code"


@needs_shipped
def test_hf_transformers_loads_the_shipped_files_and_agrees_greedily(shipped_llm):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(SHIPPED))
    hf = AutoModelForCausalLM.from_pretrained(str(SHIPPED), dtype=torch.float32).eval()
    assert hf_tok.eos_token_id == shipped_llm.tokenizer.eos_token_id
    for text in PYTHON_PROMPTS:
        ids = shipped_llm.tokenizer.encode(text)
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids
        ours = shipped_llm.generate([text], GREEDY, use_tqdm=False)[0]
        with torch.no_grad():
            theirs = hf.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=len(ours.token_ids),
                pad_token_id=hf_tok.pad_token_id,
            )[0, len(ids) :].tolist()
        assert ours.token_ids == theirs, text
        assert ours.text == hf_tok.decode(theirs, skip_special_tokens=True)


@needs_shipped
def test_mrv2_run_prints_a_python_continuation(tmp_path):
    prompt = "def is_even(n):"
    env = dict(os.environ, HYDRA_FULL_ERROR="0", TMPDIR=str(tmp_path))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "framework.entrypoints.cli",
            "run",
            f"run.prompts=[{json.dumps(prompt)}]",
            "sampler.max_tokens=24",
            "run.show_progress=false",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    header, body = res.stdout.split("\n", 1)
    assert header.startswith("--- completion 0 (")
    assert body.startswith(prompt)
    continuation = body[len(prompt) :]
    assert continuation.strip(), "no continuation printed"
    assert "\\x" not in continuation and "\ufffd" not in continuation  # text, not escaped bytes


@needs_shipped
@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_shipped_draft_heads_load_for_the_shipped_model(kind):
    from speculators.draft_heads import load_draft_head

    path = shipped_draft_head_dir(kind)
    assert path is not None, f"{kind} head directory missing next to the shipped model"
    config = json.loads((SHIPPED / "config.json").read_text())
    head = load_draft_head(path, kind, config)
    assert head.hidden_size == config["hidden_size"]
