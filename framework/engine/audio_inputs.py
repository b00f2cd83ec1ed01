"""Audio prompts for encoder-decoder (Whisper) models: raw audio or log-mel features in, decoder prompt out.

A prompt is a dict: `{"audio": (array, sampling_rate)}` (features computed with transformers'
`WhisperFeatureExtractor`) or `{"input_features": tensor [mel_bins, frames]}`, plus optionally
`"decoder_prompt"` (token ids, used as given), `"language"` (`"en"`, `"<|fr|>"`, ...) and `"task"`
(`"transcribe"` or `"translate"`). Without `decoder_prompt` the decoder starts as HF Whisper's `generate`
starts it: start-of-transcript, the language token and the task token (multilingual models), then
no-timestamps. mrv2 does not detect the language: a multilingual model gets the generation config's language,
else English.
"""

from __future__ import annotations

import json
import numbers
import reprlib
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import torch

from framework.models.whisper import WhisperGeometry
from framework.params.encoder_input import EncoderInput
from framework.params.sampling_params import InvalidRequestError

PROMPT_KEYS = ("audio", "input_features", "decoder_prompt", "language", "task")
_HOP_LENGTH = 160  # Whisper's 10 ms hop at 16 kHz: mel frames = samples / 160
_SAMPLING_RATE = 16000


def audio_prompt_help(num_mel_bins: int = 80, frames: int = 3000) -> str:
    return (
        f"pass each prompt as {{'audio': (array, sampling_rate)}} or {{'input_features': tensor "
        f"[{num_mel_bins}, {frames}]}}, optionally with 'decoder_prompt' (token ids), 'language', 'task'"
    )


class WhisperPromptProcessor:
    """Turns audio prompts into (decoder prompt ids, `EncoderInput`) for one Whisper model.

    Reads `generation_config.json` and `preprocessor_config.json` of the model directory when present
    (an embedded preset carries the generation fields in its config instead).
    """

    def __init__(self, hf_config: dict[str, Any], path: Optional[str]) -> None:
        self.geometry = WhisperGeometry.from_hf(hf_config)
        root = Path(path) if path else None
        gen_file = root / "generation_config.json" if root else None
        self.generation = json.loads(gen_file.read_text()) if gen_file and gen_file.is_file() else dict(hf_config)
        start = self.generation.get("decoder_start_token_id", hf_config.get("decoder_start_token_id"))
        if start is None:
            raise ValueError("the Whisper model has no decoder_start_token_id (generation_config.json or config.json)")
        self.decoder_start_token_id = int(start)
        self._preprocessor_dir = root if root and (root / "preprocessor_config.json").is_file() else None
        self._extractor: Any = None

    # ---- decoder prompt ------------------------------------------------------------------------------
    def default_decoder_prompt(self, language: Optional[str] = None, task: Optional[str] = None) -> list[int]:
        """[start] + [language, task] (multilingual models) + [no-timestamps], as HF's `generate` builds it."""
        gen = self.generation
        ids = [self.decoder_start_token_id]
        lang_to_id: dict[str, int] = gen.get("lang_to_id") or {}
        task_to_id: dict[str, int] = gen.get("task_to_id") or {}
        for key, value in (("language", language), ("task", task)):
            if value is not None and not isinstance(value, str):
                raise InvalidRequestError(f"'{key}' must be a string, got {value!r}")
        if lang_to_id:
            language = language or gen.get("language") or "en"
            token = language if language.startswith("<|") else f"<|{language.lower()}|>"
            if token not in lang_to_id:
                raise InvalidRequestError(
                    f"language {language!r} is not one of this model's languages "
                    f"({', '.join(sorted(lang_to_id)[:8])}, ...)"
                )
            ids.append(int(lang_to_id[token]))
        elif language is not None:
            raise InvalidRequestError(f"language={language!r}: this Whisper model is not multilingual")
        if task_to_id:
            task = task or gen.get("task") or "transcribe"
            if task not in task_to_id:
                raise InvalidRequestError(f"task {task!r} is not one of {', '.join(sorted(task_to_id))}")
            ids.append(int(task_to_id[task]))
        elif task is not None:
            raise InvalidRequestError(f"task={task!r}: this Whisper model has no task tokens")
        no_timestamps = gen.get("no_timestamps_token_id")
        if no_timestamps is not None:
            ids.append(int(no_timestamps))
        return ids

    # ---- encoder input -------------------------------------------------------------------------------
    @property
    def feature_extractor(self) -> Any:
        """transformers' `WhisperFeatureExtractor` (the checkpoint's preprocessor config, else from the geometry)."""
        if self._extractor is None:
            from transformers import WhisperFeatureExtractor

            if self._preprocessor_dir is not None:
                self._extractor = WhisperFeatureExtractor.from_pretrained(str(self._preprocessor_dir))
            else:
                samples = self.geometry.num_mel_frames * _HOP_LENGTH
                if samples % _SAMPLING_RATE:
                    raise InvalidRequestError(
                        "this model has no preprocessor_config.json and its encoder length is "
                        "not a whole number of seconds: pass 'input_features'"
                    )
                self._extractor = WhisperFeatureExtractor(
                    feature_size=self.geometry.num_mel_bins, chunk_length=samples // _SAMPLING_RATE
                )
        return self._extractor

    def features_from_audio(self, audio: Any) -> torch.Tensor:
        """(array, sampling_rate) -> [mel_bins, frames] float32 log-mel features (padded to the encoder length)."""
        if not (isinstance(audio, (tuple, list)) and len(audio) == 2):
            raise InvalidRequestError("'audio' must be a pair (array of samples, sampling_rate)")
        samples, rate = audio
        if not isinstance(rate, numbers.Real) or isinstance(rate, bool):
            raise InvalidRequestError(f"'audio' sampling_rate must be a number of Hz, got {rate!r}")
        samples = _float_array(samples)
        if samples.ndim != 1 or samples.size == 0:
            raise InvalidRequestError(
                f"'audio' samples must be a non-empty 1-D array (mono), got shape {samples.shape}"
            )
        if not np.isfinite(samples).all():  # else the features, and the message, would blame 'input_features'
            raise InvalidRequestError("'audio' samples contain NaN or infinite values")
        extractor = self.feature_extractor
        if rate != extractor.sampling_rate:
            raise InvalidRequestError(
                f"audio sampled at {rate} Hz; this model needs {extractor.sampling_rate} Hz (resample it first)"
            )
        if samples.size > extractor.n_samples:
            raise InvalidRequestError(
                f"audio is {samples.size / extractor.sampling_rate:.1f} s long; a request holds at most "
                f"{extractor.n_samples / extractor.sampling_rate:.0f} s (no long-form chunking): split it"
            )
        out = extractor(samples.astype(np.float32), sampling_rate=extractor.sampling_rate, return_tensors="np")
        return torch.from_numpy(out["input_features"][0]).float()

    def check_features(self, features: Any) -> torch.Tensor:
        """Features given directly: a [mel_bins, frames] float tensor or array of the encoder's shape."""
        g = self.geometry
        want = (g.num_mel_bins, g.num_mel_frames)
        try:
            tensor = features if isinstance(features, torch.Tensor) else torch.as_tensor(np.asarray(features))
        except (TypeError, ValueError):  # None, a string, ragged lists: no numeric array at all
            raise InvalidRequestError(
                f"'input_features' must be a float tensor of shape {list(want)} (mel bins, "
                f"frames), got {reprlib.repr(features)}"
            ) from None
        if tensor.dim() == 3 and tensor.shape[0] == 1:
            tensor = tensor[0]
        if tuple(tensor.shape) != want or not tensor.is_floating_point():
            raise InvalidRequestError(
                f"'input_features' must be a float tensor of shape {list(want)} "
                f"(mel bins, frames), got {tensor.dtype} {list(tensor.shape)}"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise InvalidRequestError("'input_features' contains NaN or infinite values")
        return tensor.detach().to("cpu", torch.float32)

    # ---- one prompt ----------------------------------------------------------------------------------
    def process(self, prompt: Mapping[str, Any]) -> tuple[list[int], EncoderInput]:
        """(decoder prompt ids, encoder input) of one audio prompt; `InvalidRequestError` names what is wrong."""
        unknown = sorted(set(prompt) - set(PROMPT_KEYS))
        if unknown:
            raise InvalidRequestError(
                f"unknown audio prompt key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(PROMPT_KEYS)}"
            )
        if ("audio" in prompt) == ("input_features" in prompt):
            raise InvalidRequestError("an audio prompt needs exactly one of 'audio' and 'input_features'")
        if "audio" in prompt:
            features = self.features_from_audio(prompt["audio"])
        else:
            features = self.check_features(prompt["input_features"])
        decoder_prompt = prompt.get("decoder_prompt")
        if decoder_prompt is None:
            ids = self.default_decoder_prompt(prompt.get("language"), prompt.get("task"))
        else:
            if prompt.get("language") is not None or prompt.get("task") is not None:
                raise InvalidRequestError("give either 'decoder_prompt' or 'language'/'task', not both")
            ids = _token_ids(decoder_prompt)
        return ids, EncoderInput(features, self.geometry.max_source_positions)


def _float_array(samples: Any) -> np.ndarray:
    """Audio samples as a float array; integers (16-bit PCM read as is would be 32768 times too loud), strings
    (a file name) and other non-float values are refused."""
    if isinstance(samples, torch.Tensor):
        samples = samples.detach().cpu()
        samples = samples.float() if samples.is_floating_point() else samples  # numpy has no bfloat16
    try:
        array = np.asarray(samples)
    except (TypeError, ValueError):  # ragged lists
        array = np.asarray(None)
    if array.dtype.kind != "f":
        hint = " (16-bit PCM: divide by 32768)" if array.dtype == np.int16 else ""
        raise InvalidRequestError(
            f"'audio' samples must be floats in [-1, 1], got {reprlib.repr(samples)} of dtype {array.dtype}{hint}"
        )
    return array


def _token_ids(decoder_prompt: Any) -> list[int]:
    """The decoder prompt as ints: a list, array or tensor of integers (bools and floats are refused, not cast)."""
    if isinstance(decoder_prompt, (torch.Tensor, np.ndarray)):
        decoder_prompt = decoder_prompt.tolist()
    ids = list(decoder_prompt) if isinstance(decoder_prompt, (list, tuple)) else None
    if ids is None or any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
        raise InvalidRequestError(
            f"'decoder_prompt' must be a list of token ids (ints), got {reprlib.repr(decoder_prompt)}"
        )
    return [int(t) for t in ids]
