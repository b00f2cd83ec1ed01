"""An FP8 checkpoint behind `mrv2 serve`, through the official `openai` client: the completion equals the offline
`LLM.generate` of the same checkpoint (token ids in, greedy). The tiny checkpoint has no tokenizer (its text is
empty), so the sampled tokens are compared through their logprobs: same values, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.quant_checkpoints import write_quantized
from helpers.serve_helpers import ServerProcess, openai_client

from framework.entrypoints.llm import LLM
from framework.params.sampling_params import SamplingParams

PROMPT = [5, 17, 200, 31, 9]


def test_served_fp8_checkpoint_matches_offline(tmp_path: Path) -> None:
    write_quantized("fp8-block", tmp_path)
    offline = LLM(str(tmp_path), device="cpu", dtype="float32").generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1), use_tqdm=False
    )[0]
    with ServerProcess(f"model.path={tmp_path}", "model.dtype=float32") as server:
        client = openai_client(server)
        served = client.completions.create(
            model=client.models.list().data[0].id,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0.0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
    assert served.usage is not None and served.usage.completion_tokens == 6
    token_logprobs = served.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
    expected = [step[token].logprob for step, token in zip(offline.logprobs, offline.token_ids)]  # type: ignore[arg-type]
    assert token_logprobs == pytest.approx(expected, abs=1e-4)
    assert len(set(offline.token_ids)) > 1
