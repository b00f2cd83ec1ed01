"""The harmony chat format of one served model: which models chat in it, and what it changes in a chat request.

`serve.chat_format` picks the format: `auto` (the default) chats in harmony with a checkpoint whose architecture
is `GptOssForCausalLM` and through the chat template with any other; `harmony` and `template` force one. A request
that brings its own `chat_template` is rendered by that template.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from framework.entrypoints.harmony.output import HarmonyOutputParser
from framework.entrypoints.harmony.render import render_prompt
from framework.entrypoints.harmony.vocab import HarmonyUnavailable, load_encoding
from framework.entrypoints.tool_calls import ToolSetup, tool_sampling
from framework.params.request_errors import InvalidRequestError
from framework.params.sampling_params import SamplingParams

HARMONY_ARCHITECTURES = ("GptOssForCausalLM",)


def uses_harmony(chat_format: str, hf_config: dict[str, Any]) -> bool:
    """Whether chat requests to this model render and parse in harmony (`serve.chat_format`)."""
    if chat_format != "auto":
        return chat_format == "harmony"
    return any(a in HARMONY_ARCHITECTURES for a in hf_config.get("architectures") or [])


@dataclass(frozen=True)
class HarmonyChat:
    """openai-harmony's gpt-oss encoding, and the verbs a chat request uses: render, sampling, parser."""

    encoding: Any  # openai_harmony.HarmonyEncoding

    @classmethod
    def load(cls, model_dir: Optional[str]) -> "HarmonyChat":
        """The format for the checkpoint at `model_dir`; raises `HarmonyUnavailable` (framework.entrypoints.harmony
        .vocab says where the vocabulary comes from)."""
        return cls(load_encoding(model_dir))

    @property
    def stop_token_ids(self) -> list[int]:
        """`<|return|>` and `<|call|>`: the assistant's turn ends with its answer or with a call."""
        return list(self.encoding.stop_tokens_for_assistant_actions())

    def render(
        self,
        messages: Sequence[Any],
        tools: ToolSetup,
        reasoning_effort: Optional[str] = None,
        today: Optional[str] = None,
    ) -> list[int]:
        """The prompt's token ids (framework.entrypoints.harmony.render)."""
        return render_prompt(self.encoding, messages, tools, reasoning_effort, today)

    def sampling(self, params: SamplingParams, tools: ToolSetup) -> SamplingParams:
        """`params` that stop at the turn's end and force a call as `tool_choice` asks; a thinking budget is
        refused (it would force `</think>`, which harmony does not write)."""
        if params.thinking_token_budget is not None:
            raise InvalidRequestError(
                "thinking_token_budget is not supported in the harmony chat format (gpt-oss): use reasoning_effort"
            )
        params = tool_sampling(params, tools)
        stops = [t for t in self.stop_token_ids if t not in params.stop_token_ids]
        return dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *stops]) if stops else params

    def parser(self, tools: ToolSetup) -> HarmonyOutputParser:
        """A fresh output parser for one generated sequence."""
        return HarmonyOutputParser(self.encoding, tools)


def harmony_chat_for(chat_format: str, hf_config: dict[str, Any], model_dir: Optional[str]) -> Optional[HarmonyChat]:
    """The harmony format when this model chats in it (None otherwise); raises `HarmonyUnavailable` when it should
    and cannot."""
    if not uses_harmony(chat_format, hf_config):
        return None
    return HarmonyChat.load(model_dir)


__all__ = ["HARMONY_ARCHITECTURES", "HarmonyChat", "HarmonyUnavailable", "harmony_chat_for", "uses_harmony"]
