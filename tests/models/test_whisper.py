"""Whisper through mrv2 against HF `WhisperForConditionalGeneration.generate` on a tiny random checkpoint.

Greedy decoder tokens must equal HF's for several audio lengths and batch sizes, with requests joining and
leaving mid-run (few slots, staggered arrivals through the engine), chunked decoder prompts, preemption under a
small KV cache (the encoder runs again on resume), and on both runners. How the HF side is made comparable
(no suppress tokens, language and task given) is in `whisper_models`. HF drops a final eos from what it
returns; mrv2 reports it (as for every model), so it is stripped before comparing.
"""

from __future__ import annotations

import re
from pathlib import Path

import helpers.whisper_models as wm
import numpy as np
import pytest
import torch
from helpers.hf_models import cache_kwarg, fp8_rounding_cache

from framework.engine.core import EngineCore
from framework.engine.request import RequestOutput
from framework.entrypoints.llm import LLM
from framework.params.sampling_params import InvalidRequestError, SamplingParams

MAX_TOKENS = 12
AUDIO_SECONDS = [0.15, 0.4, 0.7, 1.0, 0.25]  # padded to the 1 s encoder window by the feature extractor
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


class Checkpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.hf = wm.save_tiny_whisper(path, seed=2)
        self.audio = [wm.synthetic_audio(s, seed=i) for i, s in enumerate(AUDIO_SECONDS)]
        self.features = [wm.hf_features(a) for a in self.audio]  # [1, mel, frames] each
        self.expected = [wm.hf_transcribe(self.hf, f, MAX_TOKENS) for f in self.features]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    return Checkpoint(tmp_path_factory.mktemp("whisper"))


def _llm(ckpt: Checkpoint, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    kwargs.setdefault("max_model_len", 32)
    return LLM(str(ckpt.path), device="cpu", dtype="float32", seed=0, **kwargs)


def _tokens(out: RequestOutput) -> list[int]:
    ids = list(out.token_ids)
    return ids[:-1] if ids and ids[-1] == wm.EOS_ID and out.finish_reason == "stop" else ids


def test_hf_reference_is_varied(ckpt: Checkpoint) -> None:
    """The comparison means something: HF's outputs differ between audios and are not one repeated token."""
    assert len({tuple(e) for e in ckpt.expected}) == len(ckpt.expected)
    assert all(len(set(e)) > 2 for e in ckpt.expected if len(e) >= 6)


SCENARIOS = {
    "batch": {},  # every request at once
    "two_slots": {"max_num_seqs": 2},  # requests join as others leave; slots are reused
    # 4-token decoder prompts prefilled 3 + 1, one request admitted per step (encoder budget = 3 < 50 positions)
    "chunked": {"max_num_batched_tokens": 3},
    # 10 blocks of 4 tokens: a request needs 4 (16 tokens), 5 of them do not fit -> preemption and re-encoding
    "preempt": {"block_size": 4, "num_kv_blocks": 10},
    "v1": {"runner": "v1", "max_num_seqs": 3},
    "v1_preempt": {"runner": "v1", "block_size": 4, "num_kv_blocks": 10},
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_equals_hf(ckpt: Checkpoint, scenario: str) -> None:
    llm = _llm(ckpt, **SCENARIOS[scenario])
    prompts = [{"audio": (a, wm.SAMPLING_RATE)} for a in ckpt.audio]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.prompt_token_ids == [wm.START_ID, wm.EN_ID, wm.TRANSCRIBE_ID, wm.NO_TIMESTAMPS_ID]
        assert _tokens(out) == ckpt.expected[i], f"request {i} ({AUDIO_SECONDS[i]} s)"
    state = llm.engine.runner.model_state
    if "preempt" in scenario:
        assert sum(o.num_preemptions for o in outs) > 0, "the scenario must preempt"
        assert state.num_encoder_runs == len(outs) + sum(o.num_preemptions for o in outs)  # re-encoded on resume
    else:
        assert state.num_encoder_runs == len(outs)  # once per request, whatever the chunking
    assert llm.engine.is_idle()


@torch.no_grad()
def _hf_decoder_logits(ckpt: Checkpoint, i: int, decoder_ids: list[int], fp8: bool) -> torch.Tensor:
    """[len, vocab]: HF's decoder logits over `decoder_ids` for audio i, its self-attention K / V rounded to FP8
    (`fp8`; cross-attention unrounded, as mrv2 keeps it)."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    enc = ckpt.hf.model.encoder(ckpt.features[i]).last_hidden_state
    self_cache = fp8_rounding_cache(ckpt.hf.config.decoder_layers) if fp8 else DynamicCache()
    cache = EncoderDecoderCache(self_cache, DynamicCache())
    return ckpt.hf(
        encoder_outputs=(enc,),
        decoder_input_ids=torch.tensor([decoder_ids]),
        use_cache=True,
        **{cache_kwarg(ckpt.hf): cache},
    ).logits[0]


def test_fp8_self_attention_cache_against_hf(ckpt: Checkpoint) -> None:
    """`kv_cache_dtype=fp8`: the decoder's self-attention cache is FP8, the cross-attention K / V keep the model's
    dtype, and every greedy token is HF's argmax with the self-attention K / V rounded the same way (where HF's
    top two differ by more than 1e-3); without the rounding HF disagrees somewhere (this model is sensitive)."""
    llm = _llm(ckpt, kv_cache_dtype="fp8")
    assert {c.dtype for c in llm.engine.runner.kv_caches} == {torch.float8_e4m3fn}
    assert llm.engine.runner.model_state.cross_kv.dtype == torch.float32
    outs = llm.generate([{"audio": (a, wm.SAMPLING_RATE)} for a in ckpt.audio], GREEDY, use_tqdm=False)
    checked, disagree_unrounded = 0, 0
    for i, out in enumerate(outs):
        ids = out.prompt_token_ids + list(out.token_ids)
        start = len(out.prompt_token_ids) - 1  # the logits row that chose the first output token
        for fp8 in (True, False):
            logits = _hf_decoder_logits(ckpt, i, ids[:-1], fp8)[start:]
            top2 = logits.topk(2, dim=-1).values
            for j, token in enumerate(out.token_ids):
                if fp8 and top2[j, 0] - top2[j, 1] > 1e-3:
                    assert int(logits[j].argmax()) == token, f"audio {i}, output token {j}"
                    checked += 1
                disagree_unrounded += (not fp8) and int(logits[j].argmax()) != token
    assert checked >= 0.9 * sum(len(o.token_ids) for o in outs)
    assert disagree_unrounded > 0


def test_staggered_arrivals_through_the_engine(ckpt: Checkpoint) -> None:
    """Requests arrive between steps and stop at different lengths; each equals HF's prefix."""
    llm = _llm(ckpt, max_num_seqs=3)
    engine: EngineCore = llm.engine
    assert engine.audio is not None
    arrivals = {0: [0, 1], 2: [2], 3: [3], 6: [4]}  # step -> requests added before it
    max_tokens = [5, MAX_TOKENS, 8, 3, MAX_TOKENS]
    done: dict[str, RequestOutput] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            ids, encoder_input = engine.audio.process({"audio": (ckpt.audio[i], wm.SAMPLING_RATE)})
            engine.add_request(
                f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens[i]), encoder_input=encoder_input
            )
        done.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    for i in range(len(AUDIO_SECONDS)):
        got = _tokens(done[f"r{i}"])
        assert got == ckpt.expected[i][: max_tokens[i]], f"request {i}"


def test_language_task_and_features_given_directly(ckpt: Checkpoint) -> None:
    llm = _llm(ckpt)
    feats = ckpt.features[1][0]
    outs = llm.generate(
        [
            {"audio": (ckpt.audio[1], wm.SAMPLING_RATE), "language": "fr", "task": "translate"},
            {"input_features": feats},
            {"input_features": feats.numpy(), "decoder_prompt": [wm.START_ID, wm.EN_ID]},
        ],
        GREEDY,
        use_tqdm=False,
    )
    assert outs[0].prompt_token_ids == [wm.START_ID, wm.FR_ID, wm.TRANSLATE_ID, wm.NO_TIMESTAMPS_ID]
    assert _tokens(outs[0]) == wm.hf_transcribe(ckpt.hf, ckpt.features[1], MAX_TOKENS, language="fr", task="translate")
    assert _tokens(outs[1]) == ckpt.expected[1]
    assert outs[2].prompt_token_ids == [wm.START_ID, wm.EN_ID]
    assert list(outs[2].token_ids) == wm.hf_greedy_after(ckpt.hf, ckpt.features[1], [wm.START_ID, wm.EN_ID], MAX_TOKENS)


def test_reused_slot_holds_only_the_new_owner(ckpt: Checkpoint) -> None:
    """One slot, two requests in turn: the second one's cross-K/V row is exactly its own encoder output."""
    llm = _llm(ckpt, max_num_seqs=1)
    outs = llm.generate([{"audio": (ckpt.audio[i], wm.SAMPLING_RATE)} for i in (3, 0)], GREEDY, use_tqdm=False)
    assert [_tokens(o) for o in outs] == [ckpt.expected[3], ckpt.expected[0]]
    runner = llm.engine.runner
    fresh = runner.model.encode(ckpt.features[0])
    torch.testing.assert_close(runner.model_state.slot_cross_kv(0), fresh[0], rtol=0, atol=0)
    # A request without encoder input (as in the profiling run) gets a zeroed row, not the previous owner's.
    from framework.params.scheduler_output import NewRequestData

    runner.model_state.add_request(0, NewRequestData("x", [wm.START_ID], 1, GREEDY, 0, [0], 0))
    runner.model_state._encode_staged()
    assert not runner.model_state.cross_kv.any()  # slot 0 is the only slot (the graphs' dummy slot stays zero)


def test_encoder_budget_bounds_admissions_per_step(ckpt: Checkpoint) -> None:
    llm = _llm(ckpt, max_num_batched_tokens=64)
    engine = llm.engine
    engine.scheduler.config.max_num_encoder_tokens = 100  # two requests of 50 encoder positions per step
    assert engine.audio is not None
    for i, audio in enumerate(ckpt.audio):
        ids, enc = engine.audio.process({"audio": (audio, wm.SAMPLING_RATE)})
        engine.add_request(f"r{i}", ids, GREEDY, encoder_input=enc)
    admitted = []
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        admitted.append(len(out.new_requests))
        engine.runner.execute_model(out)
        engine.scheduler.update_from_output(out, engine.runner.sample_tokens().get().sampled_token_ids)
    assert admitted[:3] == [2, 2, 1]
    engine.scheduler.config.max_num_encoder_tokens = 10  # smaller than one request: still one per step
    ids, enc = engine.audio.process({"audio": (ckpt.audio[0], wm.SAMPLING_RATE)})
    engine.add_request("big", ids, GREEDY, encoder_input=enc)
    assert len(engine.scheduler.schedule().new_requests) == 1


def test_bad_inputs_have_clear_errors(ckpt: Checkpoint) -> None:
    llm = _llm(ckpt)
    audio = ckpt.audio[0]
    cases = [
        ([1, 2, 3], "encoder-decoder speech model"),
        ({"audio": (audio, 8000)}, "needs 16000 Hz"),
        ({"audio": (np.zeros(3 * wm.SAMPLING_RATE, np.float32), wm.SAMPLING_RATE)}, "no long-form"),
        ({"input_features": torch.zeros(3, 100)}, "shape [16, 100]"),
        ({"audio": (audio, wm.SAMPLING_RATE), "input_features": ckpt.features[0]}, "exactly one of"),
        ({"audio": (audio, wm.SAMPLING_RATE), "lang": "en"}, "unknown audio prompt key"),
        ({"audio": (audio, wm.SAMPLING_RATE), "language": "xx"}, "not one of this model's languages"),
    ]
    for prompt, message in cases:
        with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[")):
            llm.generate([prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    text_llm = LLM("tiny", device="cpu", max_num_seqs=2)
    with pytest.raises(InvalidRequestError, match="need an encoder-decoder model"):
        text_llm.generate([{"audio": (audio, wm.SAMPLING_RATE)}], GREEDY, use_tqdm=False)
    ids, enc = llm.engine.audio.process({"audio": (audio, wm.SAMPLING_RATE)})  # type: ignore[union-attr]
    with pytest.raises(InvalidRequestError, match="needs an encoder-decoder model"):
        text_llm.engine.add_request("x", ids, GREEDY, encoder_input=enc)


def test_malformed_audio_prompts_are_refused_by_name(ckpt: Checkpoint) -> None:
    """Values of the wrong type or out of range in an audio prompt raise `InvalidRequestError` naming the key (they
    were TypeError / ValueError / AttributeError from inside, or silently changed: 16-bit PCM read as floats,
    a rate of 16000.5 Hz taken for 16000, decoder ids 90.7 -> 90 and True -> 1), and queue nothing."""
    llm = _llm(ckpt)
    audio = ckpt.audio[0]
    with_nan = audio.copy()
    with_nan[7] = np.nan
    cases = [
        ({"audio": (audio, None)}, "'audio' sampling_rate must be a number of Hz, got None"),
        ({"audio": (audio, "16k")}, "'audio' sampling_rate must be a number of Hz, got '16k'"),
        ({"audio": (audio, 16000.5)}, "audio sampled at 16000.5 Hz; this model needs 16000 Hz"),
        ({"audio": (with_nan, wm.SAMPLING_RATE)}, "'audio' samples contain NaN or infinite values"),
        ({"audio": ((audio * 32767).astype(np.int16), wm.SAMPLING_RATE)}, "'audio' samples must be floats"),
        ({"audio": ("clip.wav", wm.SAMPLING_RATE)}, "'audio' samples must be floats"),
        ({"input_features": "clip.wav"}, "'input_features' must be a float tensor of shape [16, 100]"),
        ({"input_features": None}, "'input_features' must be a float tensor of shape [16, 100]"),
        ({"audio": (audio, wm.SAMPLING_RATE), "language": 5}, "'language' must be a string, got 5"),
        ({"audio": (audio, wm.SAMPLING_RATE), "task": ["translate"]}, "'task' must be a string, got ['translate']"),
        (
            {"audio": (audio, wm.SAMPLING_RATE), "decoder_prompt": "hello"},
            "'decoder_prompt' must be a list of token ids",
        ),
        (
            {"audio": (audio, wm.SAMPLING_RATE), "decoder_prompt": [wm.START_ID, 90.7]},
            "'decoder_prompt' must be a list",
        ),
        (
            {"audio": (audio, wm.SAMPLING_RATE), "decoder_prompt": [True]},
            "'decoder_prompt' must be a list of token ids",
        ),
    ]
    for prompt, message in cases:
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            llm.generate([{"audio": (audio, wm.SAMPLING_RATE)}, prompt], GREEDY, use_tqdm=False)
    assert llm.engine.is_idle()
    # What is well-formed still passes: ids as an array or tensor, and a None language beside a decoder prompt.
    ids = [wm.START_ID, wm.EN_ID]
    outs = llm.generate(
        [
            {"input_features": ckpt.features[1][0], "decoder_prompt": np.array(ids)},
            {"input_features": ckpt.features[1][0], "decoder_prompt": torch.tensor(ids), "language": None},
        ],
        GREEDY,
        use_tqdm=False,
    )
    want = wm.hf_greedy_after(ckpt.hf, ckpt.features[1], ids, MAX_TOKENS)
    assert [o.prompt_token_ids for o in outs] == [ids, ids] and [list(o.token_ids) for o in outs] == [want, want]


def test_model_state_selection_and_preset() -> None:
    from framework.config.schema import load_config
    from framework.engine.runner_selection import configured_model_state
    from model_states.encoder_decoder import EncoderDecoderModelState

    config = load_config({"model": {"preset": "whisper-tiny"}, "device": "cpu"})
    assert configured_model_state(config) is EncoderDecoderModelState
    llm = LLM("whisper-tiny", device="cpu", max_num_seqs=1, max_model_len=16)
    feats = torch.randn(80, 3000, generator=torch.Generator().manual_seed(0))
    (out,) = llm.generate(
        [{"input_features": feats}], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False
    )
    assert out.prompt_token_ids == [50258, 50259, 50359, 50363] and len(out.token_ids) == 3


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_cross_attention_on_paged_kernels_equals_dense(ckpt: Checkpoint, backend: str) -> None:
    """Each token's row over its slot's cross blocks equals dense attention over that request's encoder K/V."""
    from types import SimpleNamespace

    from framework.layers.attention.paged import paged_attention_reference
    from framework.params.scheduler_output import NewRequestData
    from model_states.encoder_decoder import EncoderDecoderModelState

    llm = _llm(ckpt, max_num_seqs=3)
    model = llm.engine.runner.model
    state = EncoderDecoderModelState(model, {}, 3, torch.device("cpu"))
    for slot, i in ((2, 0), (0, 3)):
        _, enc = llm.engine.audio.process({"audio": (ckpt.audio[i], wm.SAMPLING_RATE)})  # type: ignore[union-attr]
        state.add_request(slot, NewRequestData(f"r{slot}", [1], 1, GREEDY, 0, [0], 0, encoder_input=enc))
    state._encode_staged()
    batch = SimpleNamespace(
        num_tokens=4, idx_mapping=torch.tensor([2, 0], dtype=torch.int32), token_rows=torch.tensor([0, 0, 0, 1])
    )  # row 0 (slot 2) has 3 tokens, row 1 one
    meta = state._cross_metadata(batch.idx_mapping, batch.token_rows)
    query = torch.randn(4, 4, 16, generator=torch.Generator().manual_seed(0))
    layer = 1
    if backend == "triton":
        from framework.layers.attention.triton_paged_attention import paged_attention as attention
    else:
        attention = paged_attention_reference
    got = attention(query, state.cross_kv[layer], meta, 1.0)
    for token, slot in enumerate([2, 2, 2, 0]):
        k, v = state.slot_cross_kv(slot)[layer]  # [L, H, D] each
        want = torch.nn.functional.scaled_dot_product_attention(
            query[token].unsqueeze(1), k.transpose(0, 1), v.transpose(0, 1), scale=1.0
        ).squeeze(1)
        torch.testing.assert_close(got[token], want, rtol=1e-4, atol=1e-5)


def test_encode_on_whisper_says_embeddings_need_a_text_model(ckpt: Checkpoint) -> None:
    """Whisper embeds nothing: `encode` says so (it told the caller to pass audio, which `encode` refuses too)."""
    llm = _llm(ckpt)
    for prompt in ([wm.START_ID, wm.EN_ID], {"audio": (ckpt.audio[0], wm.SAMPLING_RATE)}):
        with pytest.raises(
            InvalidRequestError,
            match="embeddings need a decoder-only text model; this model "
            r"\(WhisperForConditionalGeneration\) is an encoder-decoder",
        ):
            llm.encode([prompt], use_tqdm=False)
    assert llm.engine.is_idle()
