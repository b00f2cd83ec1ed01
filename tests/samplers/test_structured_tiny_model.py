"""Structured outputs on the trained embedded model (skipped where it is not in the package): greedy equals the
argmax over the allowed tokens of HF transformers' logits, step by step, and the EAGLE and MTP draft heads keep
the greedy tokens and the sampled outputs valid."""

from __future__ import annotations

import json
from typing import Any, Optional

import jsonschema
import llguidance
import pytest
import torch
from test_structured_engine import _check

from framework import SamplingParams, StructuredOutputsParams
from framework.entrypoints.llm import LLM
from framework.models.embedded import shipped_draft_head_dir, shipped_model_dir

# ---- the trained embedded model: HF reference loop, EAGLE and MTP ------------------------------------------
TINY = shipped_model_dir("tiny")


needs_tiny = pytest.mark.skipif(TINY is None, reason="the trained embedded model is not in the package")


CODE_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["function", "class", "module"]},
    },
    "required": ["name", "count", "kind"],
    "additionalProperties": False,
}


CODE_PROMPTS = ["config = ", "def parse(data):\n    return ", "settings = dict(", "# JSON record\nrecord = "]


def _tiny(speculator: Optional[dict] = None, **kwargs: Any) -> LLM:
    if speculator is not None:
        kwargs["speculative_config"] = speculator
    return LLM("tiny", device="cpu", dtype="float32", **kwargs)


@needs_tiny
def test_greedy_is_argmax_over_allowed_tokens_of_hf_logits() -> None:
    """The reference loop: HF transformers' logits on the same weights, llguidance's mask of the tokens so far,
    argmax over the allowed ones, step by step, until end of sequence."""
    from transformers import AutoModelForCausalLM

    llm = _tiny()
    so = StructuredOutputsParams(json=CODE_SCHEMA, disable_any_whitespace=True)
    outs = llm.generate(
        CODE_PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so), use_tqdm=False
    )
    hf = AutoModelForCausalLM.from_pretrained(str(TINY), dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    lltok = llguidance.LLTokenizer(
        (TINY / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=llm.engine.loaded.eos_token_id
    )
    grammar = llguidance.LLMatcher.grammar_from_json_schema(CODE_SCHEMA, defaults={"whitespace_flexible": False})
    for out in outs:
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        ids = list(out.prompt_token_ids)
        expected: list[int] = []
        while len(expected) < len(out.token_ids):
            with torch.no_grad():
                logits = hf(torch.tensor([ids + expected])).logits[0, -1]
            bits = matcher.compute_bitmask()
            allowed = torch.tensor([bits[t // 8] >> (t % 8) & 1 for t in range(vocab)], dtype=torch.bool)
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            expected.append(token)
            assert matcher.consume_token(token)
            if token == llm.engine.loaded.eos_token_id:
                break
        assert out.token_ids == expected
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), CODE_SCHEMA)


@needs_tiny
@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_draft_heads_with_grammars(method: str) -> None:
    head = shipped_draft_head_dir(method)
    if head is None:
        pytest.skip(f"the {method} head is not in the package")
    spec = {"method": method, "num_speculative_tokens": 3 if method == "eagle" else 1, "model": str(head)}
    so = StructuredOutputsParams(json=CODE_SCHEMA, disable_any_whitespace=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)
    plain = [o.token_ids for o in _tiny().generate(CODE_PROMPTS[:2], greedy, use_tqdm=False)]
    llm = _tiny(spec)
    assert [o.token_ids for o in llm.generate(CODE_PROMPTS[:2], greedy, use_tqdm=False)] == plain
    sampled = [SamplingParams(temperature=0.8, seed=s, max_tokens=40, structured_outputs=so) for s in range(4)]
    pairs = list(zip([so] * 4, llm.generate(CODE_PROMPTS, sampled, use_tqdm=False)))
    _check(pairs)
    assert llm.get_metrics()["spec_decode"]["num_accepted_tokens"] > 0
