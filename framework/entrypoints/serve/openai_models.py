"""Request bodies of the OpenAI-compatible endpoints, as pydantic models shaped like OpenAI's (plus vLLM's extra
sampling fields). Ranges are not checked here: `SamplingParams` checks them, so the server and the offline API
refuse the same values with the same messages. Unknown top-level fields are kept aside (`model_extra`) for the
route to name in a warning log line, then ignored: OpenAI clients send new ones, and a typo or a feature a client
expects should show in the server log."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

TokenIds = list[StrictInt]  # strict: JSON true/false are not token ids
PromptInput = Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _RequestBody(BaseModel):
    """A whole request body: its unknown fields stay in `model_extra` (see the module docstring)."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_RequestBody):
    """Fields both completion endpoints share (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM's extra sampling fields
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[TokenIds] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: Optional[int] = None
    allowed_token_ids: Optional[TokenIds] = None
    bad_words: Optional[list[StrictStr]] = None
    # structured outputs: OpenAI's response_format, or vLLM's structured_outputs {json|regex|choice|grammar}
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    # vLLM's older structured-output fields (since removed there), read only to refuse them with their replacement
    # named (`params.sampling_params`): ignored, the reply would silently be unconstrained.
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: PromptInput
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None  # refused when set: no fill-in-the-middle
    best_of: Optional[int] = None  # refused unless equal to n: choosing the best of several is not implemented


class ChatMessage(_Body):
    role: str
    content: Union[str, list[dict[str, Any]], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[Any]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None  # an earlier assistant turn's reasoning, as this server returns it


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # Tool calling (`framework.entrypoints.tool_calls`, docs/tool_calling.md).
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[Any]] = None  # OpenAI's older form of tools
    function_call: Union[str, dict[str, Any], None] = None
    # Reasoning models: end the thinking after this many tokens (default `serve.thinking_token_budget`).
    thinking_token_budget: Optional[int] = None
    # OpenAI's reasoning level: gpt-oss's harmony prompt (low, medium, high); a chat template gets it as a variable.
    reasoning_effort: Optional[str] = None


class EmbeddingRequest(_RequestBody):
    """POST /v1/embeddings."""

    input: PromptInput
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
