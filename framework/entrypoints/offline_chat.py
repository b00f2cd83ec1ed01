"""`LLM.chat`'s conversations made into prompts and sampling parameters, and its outputs read back: through the
checkpoint's chat template and the text parsers, or through the harmony format (gpt-oss)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from framework.engine.request import RequestOutput
from framework.entrypoints.chat_output import parse_chat_outputs, thinking_budget_for
from framework.entrypoints.chat_template import ChatTemplate
from framework.entrypoints.harmony.chat import HarmonyChat
from framework.entrypoints.tool_calls import tool_sampling, tool_setup
from framework.entrypoints.tool_parsers import detect_tool_parser
from framework.params.request_errors import InvalidRequestError
from framework.params.sampling_params import SamplingParams


@dataclass(frozen=True)
class ChatOptions:
    """`LLM.chat`'s keyword arguments (its docstring says what each does)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[Mapping[str, Any]] = None
    tools: Optional[Sequence[Mapping[str, Any]]] = None
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None
    tool_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None
    reasoning_effort: Optional[str] = None


@dataclass(frozen=True)
class PreparedChat:
    """What `LLM.chat` generates (a prompt and its sampling parameters per conversation) and how it reads the
    outputs back (`parse`)."""

    prompts: list[Union[str, list[int]]]
    params: list[SamplingParams]
    parse: Callable[[list[RequestOutput]], list[RequestOutput]]


def prepare_chat(
    config: Any,
    encode: Optional[Callable[[str], list[int]]],
    harmony: Callable[[], Optional[HarmonyChat]],
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    params: list[SamplingParams],
    options: ChatOptions,
) -> PreparedChat:
    """The prompts of `conversations` (one `params` each); `harmony()` gives the harmony format where this model
    chats in it (asked only when the options bring no template of their own)."""
    kwargs = dict(options.chat_template_kwargs or {})
    if options.reasoning_effort is not None:
        kwargs["reasoning_effort"] = options.reasoning_effort
    chat = harmony() if options.chat_template is None else None
    if chat is not None:
        return _harmony(chat, conversations, params, options, kwargs.get("reasoning_effort"))
    template = ChatTemplate.load(config, options.chat_template)
    parser = options.tool_parser or config.serve.tool_call_parser or detect_tool_parser(template.source)
    setup = tool_setup(
        options.tools, options.tool_choice, parallel_tool_calls=options.parallel_tool_calls, parser=parser
    )
    reasoning = options.reasoning_parser or config.serve.reasoning_parser
    texts = [
        template.render(
            c,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **{**kwargs, **setup.template_kwargs()},
        )
        for c in conversations
    ]
    default_budget = config.serve.thinking_token_budget
    params = [_with_thinking_budget(tool_sampling(p, setup), text, default_budget) for p, text in zip(params, texts)]
    return PreparedChat(
        list(texts),
        params,
        lambda outputs: parse_chat_outputs(outputs, setup, reasoning, encode, prompt_texts=texts, params=params),
    )


def _harmony(
    chat: HarmonyChat,
    conversations: Sequence[Sequence[Mapping[str, Any]]],
    params: list[SamplingParams],
    options: ChatOptions,
    effort: Optional[str],
) -> PreparedChat:
    if options.continue_final_message or not options.add_generation_prompt:
        raise InvalidRequestError(
            "the harmony chat format (gpt-oss) always starts a new assistant turn: add_generation_prompt=False and "
            "continue_final_message are not supported"
        )
    setup = tool_setup(
        options.tools, options.tool_choice, parallel_tool_calls=options.parallel_tool_calls, call_format="harmony"
    )
    prompts: list[Union[str, list[int]]] = [chat.render(c, setup, effort) for c in conversations]
    return PreparedChat(
        prompts,
        [chat.sampling(p, setup) for p in params],
        lambda outputs: parse_chat_outputs(outputs, setup, None, make_parser=lambda: chat.parser(setup)),
    )


def _with_thinking_budget(params: SamplingParams, prompt_text: str, default: Optional[int]) -> SamplingParams:
    requested = params.thinking_token_budget
    budget = thinking_budget_for(prompt_text, requested if requested is not None else default)
    return params if budget == requested else dataclasses.replace(params, thinking_token_budget=budget)
