"""Tools and reasoning for POST /v1/chat/completions: the request's tool fields checked against the server's
parsers (`serve.tool_call_parser`, `serve.reasoning_parser`), and each choice's text turned into OpenAI message
parts (`framework.entrypoints.chat_output`). A model that chats in harmony (gpt-oss) is rendered by openai-harmony
and its tokens read by channel instead (`framework.entrypoints.harmony`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from framework.entrypoints.chat_output import ChatOutputParser, thinking_budget_for
from framework.entrypoints.chat_template import ChatTemplate
from framework.entrypoints.harmony.chat import HarmonyChat
from framework.entrypoints.harmony.render import reasoning_level
from framework.entrypoints.serve.errors import ApiError
from framework.entrypoints.serve.openai_models import ChatCompletionRequest
from framework.entrypoints.serve.params import engine_field_names
from framework.entrypoints.tool_calls import ToolRequestError, ToolSetup, tool_sampling, tool_setup
from framework.entrypoints.tool_parsers import detect_tool_parser
from framework.params.request_errors import InvalidRequestError
from framework.params.sampling_params import THINK_END, SamplingParams


@dataclass(frozen=True)
class ChatPlan:
    """What a chat request's tools and reasoning change: template variables, sampling, how the text is read."""

    tools: ToolSetup
    reasoning_parser: Optional[str]
    thinking_token_budget: Optional[int] = None  # the request's, else `serve.thinking_token_budget`
    prompt_text: str = ""  # the rendered prompt (`for_prompt`): whether the template opened the thinking
    harmony: Optional[HarmonyChat] = None  # the harmony format renders and reads this chat (gpt-oss)

    def for_prompt(self, prompt_text: str) -> "ChatPlan":
        """This plan for the rendered prompt its choices continue."""
        return dataclasses.replace(self, prompt_text=prompt_text)

    def template_kwargs(self, body: ChatCompletionRequest) -> dict[str, Any]:
        effort = {"reasoning_effort": body.reasoning_effort} if body.reasoning_effort is not None else {}
        return {**(body.chat_template_kwargs or {}), **effort, **self.tools.template_kwargs()}

    def harmony_prompt(self, messages: list[Any], body: ChatCompletionRequest, field: str) -> list[int]:
        """The harmony prompt's token ids (a 400 naming `field`, the request's messages, when they cannot be
        rendered); `reasoning_effort` comes from the request, else from `chat_template_kwargs`."""
        assert self.harmony is not None
        if body.continue_final_message or not body.add_generation_prompt:
            raise ApiError.invalid(
                "the harmony chat format (gpt-oss) always starts a new assistant turn: add_generation_prompt=false "
                "and continue_final_message are not supported",
                "continue_final_message" if body.continue_final_message else "add_generation_prompt",
            )
        effort = body.reasoning_effort
        if effort is None:
            effort = (body.chat_template_kwargs or {}).get("reasoning_effort")
        try:
            reasoning_level(effort)
        except InvalidRequestError as err:
            raise ApiError.invalid(str(err), "reasoning_effort") from None
        try:
            return self.harmony.render(messages, self.tools, effort)
        except InvalidRequestError as err:
            raise ApiError.invalid(str(err), field) from None

    def sampling(self, params: SamplingParams, prompt_text: str) -> SamplingParams:
        """`params` with the forced-call grammar, special tokens kept when the parser's markers are some, and the
        thinking budget (unless the template already closed the thinking). Harmony: its stop tokens and forced-call
        grammar."""
        if self.harmony is not None:
            try:  # the request's budget goes in, to be refused by name
                budgeted = dataclasses.replace(params, thinking_token_budget=self.thinking_token_budget)
                return self.harmony.sampling(budgeted, self.tools)
            except ToolRequestError as err:
                raise ApiError.invalid(str(err), err.param) from None
            except InvalidRequestError as err:
                raise ApiError.invalid(str(err), "thinking_token_budget") from None
        params = tool_sampling(params, self.tools)
        budget = thinking_budget_for(prompt_text, self.thinking_token_budget)
        if budget is None:
            return params
        try:
            return dataclasses.replace(params, thinking_token_budget=budget)
        except InvalidRequestError as err:
            raise ApiError.invalid(str(err), "thinking_token_budget") from None

    def reasoning_tokens(self, tokenizer: Any, outputs: list[tuple[list[int], str]]) -> Optional[int]:
        """Output tokens spent thinking over every choice's (token ids, text); None without a reasoning parser."""
        if self.reasoning_parser is None and self.harmony is None:
            return None
        end_ids = tokenizer.encode(THINK_END) if tokenizer is not None and self.harmony is None else []
        return sum(self.parser().reasoning_tokens(ids, text, end_ids) for ids, text in outputs)

    def field_names(self, body: ChatCompletionRequest) -> dict[str, str]:
        """Engine field names -> the request's (`params.engine_field_names`): a forced call's grammar is the tools'."""
        if self.tools.structured_outputs() is None:
            return engine_field_names(body)
        return {
            "SamplingParams.structured_outputs.grammar is invalid": "tools: a function's parameters schema does not "
            "compile (the forced call's grammar)",
            "SamplingParams.structured_outputs.grammar": "tool_choice's forced call",
            "SamplingParams.min_tokens": "min_tokens",
            "SamplingParams.thinking_token_budget": "thinking_token_budget",
        }

    def parser(self) -> ChatOutputParser:
        """A fresh parser for one choice."""
        if self.harmony is not None:
            return self.harmony.parser(self.tools)
        budgeted = thinking_budget_for(self.prompt_text, self.thinking_token_budget) is not None
        return ChatOutputParser(self.tools, self.reasoning_parser, self.prompt_text, budgeted)


def chat_plan(
    config: Any, body: ChatCompletionRequest, template: Optional[ChatTemplate], harmony: Optional[HarmonyChat] = None
) -> ChatPlan:
    """Check the request's tool fields (400 naming the field) and pick the parsers: the `template`'s, or the
    `harmony` format's own."""
    parser = None
    if harmony is None:
        assert template is not None
        parser = config.serve.tool_call_parser or detect_tool_parser(template.source)
    try:
        tools = tool_setup(
            body.tools,
            body.tool_choice,
            functions=body.functions,
            function_call=body.function_call,
            parallel_tool_calls=body.parallel_tool_calls,
            parser=parser,
            call_format="text" if harmony is None else "harmony",
        )
    except ToolRequestError as err:
        raise ApiError.invalid(str(err), err.param) from None
    except InvalidRequestError as err:
        raise ApiError.invalid(str(err), "tools") from None
    if tools.structured_outputs() is not None and (body.response_format or body.structured_outputs):
        field = "response_format" if body.response_format else "structured_outputs"
        raise ApiError.invalid(
            f"{field} cannot be combined with a forced tool call (tool_choice={body.tool_choice!r}): the call's "
            "arguments already follow the function's schema",
            field,
        )
    budget = body.thinking_token_budget
    if harmony is not None:  # harmony has no `</think>` to force: only a request's own budget, which is refused
        return ChatPlan(tools, None, budget, harmony=harmony)
    return ChatPlan(
        tools, config.serve.reasoning_parser, budget if budget is not None else config.serve.thinking_token_budget
    )


def streamed(
    parser: ChatOutputParser, text: str, finish_reason: Optional[str], token_ids: Sequence[int] = ()
) -> tuple[dict[str, Any], Any]:
    """A stream chunk's `delta` and `finish_reason` for a choice that gained `text` (its tokens: `token_ids`)."""
    part = parser.feed(text, finish_reason is not None, token_ids)
    return parser.delta(part), parser.finish_reason(finish_reason, bool(parser.streamed_calls))


def finished(
    parser: ChatOutputParser, text: str, finish_reason: Optional[str], token_ids: Sequence[int] = ()
) -> tuple[dict[str, Any], Any]:
    """A non-streaming choice's `message` and `finish_reason`."""
    parts = parser.parse(text, token_ids)
    return parser.message(parts), parser.finish_reason(finish_reason, bool(parts.tool_calls))
