"""A tiny random HF Whisper checkpoint (config, safetensors weights, generation and preprocessor configs).

Geometry: 16 mel bins, 1 s of audio (100 frames -> 50 encoder positions), d_model 64, 2 encoder and 2 decoder
layers of 4 heads, vocab 96. The generation config is controlled so that HF `generate` and mrv2 greedy decoding
are comparable token for token: HF's Whisper `generate` adds logits processors from the generation config
(`suppress_tokens`, `begin_suppress_tokens`) and language detection when no language is given; here both
suppress lists are empty, and tests pass `language`/`task` to HF, so HF computes exactly argmax decoding after
the same start-of-transcript / language / task / no-timestamps prompt that mrv2 derives by default.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SAMPLING_RATE = 16000
CHUNK_SECONDS = 1
NUM_MEL_BINS = 16
VOCAB_SIZE = 96
# Special tokens at the top of the vocabulary (Whisper's layout, shrunk).
EOS_ID, START_ID, EN_ID, FR_ID, TRANSCRIBE_ID, TRANSLATE_ID, NO_TIMESTAMPS_ID = 89, 90, 91, 92, 93, 94, 95


def build_hf_whisper(seed: int = 0):  # type: ignore[no-untyped-def]
    """The HF `WhisperForConditionalGeneration` (fp32, eval) with randomised norms and biases."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB_SIZE,
        num_mel_bins=NUM_MEL_BINS,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=CHUNK_SECONDS * SAMPLING_RATE // 160 // 2,
        max_target_positions=64,
        decoder_start_token_id=START_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        bos_token_id=EOS_ID,
        begin_suppress_tokens=None,
        suppress_tokens=None,
        init_std=0.5,  # 0.02 repeats one token forever
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layer_norm" in name:  # HF initialises norms to 1 and biases to 0: randomise so a misplaced one shows
                param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    g = model.generation_config
    g.decoder_start_token_id, g.eos_token_id, g.pad_token_id = START_ID, EOS_ID, EOS_ID
    g.lang_to_id = {"<|en|>": EN_ID, "<|fr|>": FR_ID}
    g.task_to_id = {"transcribe": TRANSCRIBE_ID, "translate": TRANSLATE_ID}
    g.no_timestamps_token_id = NO_TIMESTAMPS_ID
    g.is_multilingual = True
    g.suppress_tokens, g.begin_suppress_tokens, g.forced_decoder_ids = None, None, None
    return model


def save_tiny_whisper(path: Path, seed: int = 0):  # type: ignore[no-untyped-def]
    """Write the tiny checkpoint (safetensors) with its generation and preprocessor configs; returns the HF model."""
    from transformers import WhisperFeatureExtractor

    model = build_hf_whisper(seed)
    model.save_pretrained(path, safe_serialization=True)
    WhisperFeatureExtractor(feature_size=NUM_MEL_BINS, chunk_length=CHUNK_SECONDS).save_pretrained(path)
    assert list(path.glob("*.safetensors")) and not list(path.glob("*.bin"))
    return model


def synthetic_audio(seconds: float, seed: int) -> np.ndarray:
    """Mono 16 kHz float32: a few random tones plus noise (different per seed)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    tones = sum(rng.uniform(0.1, 0.5) * np.sin(2 * np.pi * rng.uniform(100, 4000) * t) for _ in range(3))
    return (tones + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def hf_features(audio: np.ndarray) -> torch.Tensor:
    """[1, mel_bins, frames] log-mel features as HF's feature extractor computes them."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=NUM_MEL_BINS, chunk_length=CHUNK_SECONDS)
    return torch.from_numpy(fe(audio, sampling_rate=SAMPLING_RATE, return_tensors="np")["input_features"])


@torch.no_grad()
def hf_transcribe(
    model,
    features: torch.Tensor,
    max_new_tokens: int,
    language: str = "en",  # type: ignore[no-untyped-def]
    task: str = "transcribe",
) -> list[int]:
    """HF greedy `generate` of one request: the generated tokens after the decoder prompt (eos included)."""
    out = model.generate(
        features,
        language=language,
        task=task,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        return_dict_in_generate=False,
    )
    tokens = out[0].tolist()
    return tokens  # transformers 5 returns the generated tokens only, without a final eos


@torch.no_grad()
def hf_greedy_after(model, features: torch.Tensor, decoder_prompt: list[int], max_new_tokens: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Argmax decoding with HF's forward after an arbitrary decoder prompt (eos included if produced)."""
    enc = model.model.encoder(features).last_hidden_state
    ids, out = torch.tensor([decoder_prompt]), []
    for _ in range(max_new_tokens):
        token = int(model(encoder_outputs=(enc,), decoder_input_ids=ids).logits[0, -1].argmax())
        out.append(token)
        if token == EOS_ID:
            break
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out
