"""A chat request's tools: OpenAI `tools` / `tool_choice` (and the older `functions` / `function_call`) made into
what the chat template receives, the grammar that forces a call, and the parser that reads calls back.

- `none`: the template gets no tools and the output is plain content.
- `auto` (the default when tools are given): the template gets the tools; the model decides, and its tool-call
  text is parsed by the configured parser (`serve.tool_call_parser`, detected from the template when unset).
- `required` / a named function: the output is constrained by a grammar to `<tool_call>{"name": ..., "arguments":
  ...}</tool_call>` blocks (one, or up to MAX_PARALLEL_CALLS with `parallel_tool_calls`) whose arguments follow
  the function's JSON schema, so they always parse and validate; the Hermes parser reads them back.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Sequence

from framework.entrypoints.harmony.grammar import forced_call_grammar
from framework.entrypoints.tool_parsers import ToolParser, make_tool_parser, tool_parser_class
from framework.params.request_errors import InvalidRequestError
from framework.params.sampling_params import SamplingParams
from framework.params.structured_outputs import StructuredOutputsParams

MAX_PARALLEL_CALLS = 4  # calls a forced turn may hold with parallel_tool_calls (a bound, so the grammar ends)
FORCED_FORMAT = "hermes"  # the grammar writes Hermes blocks, whatever the model's own format
# JSON inside forced calls: at most one space between tokens (no free-running whitespace, see structured outputs).
COMPACT_JSON = {"whitespace_flexible": False, "whitespace_pattern": " ?"}
Choice = Literal["none", "auto", "required", "named"]
CallFormat = Literal["text", "harmony"]


class ToolRequestError(InvalidRequestError):
    """A malformed tools request; `param` is the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _function_of(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise ToolRequestError(f"{where} must be a {{'type': 'function', 'function': {{...}}}} object", where)
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolRequestError(f"{where}.function must be an object with a non-empty 'name'", where)
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping):
        raise ToolRequestError(f"{where}.function.parameters must be a JSON schema object", where)
    return {**function, "parameters": dict(parameters)}


@dataclass(frozen=True)
class ToolSetup:
    """What one chat request asks of tools. Build with `tool_setup`."""

    tools: tuple[dict[str, Any], ...] = ()  # OpenAI tool definitions {"type": "function", "function": {...}}
    choice: Choice = "none"
    named: Optional[str] = None
    parallel: bool = True
    legacy: bool = False  # asked through `functions` / `function_call`: answer with `function_call`
    parser: Optional[str] = None  # the registered parser that reads the output, None = no tool parsing
    call_format: CallFormat = "text"  # "harmony": calls are harmony messages, read by the harmony output parser

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template receives (`tools`, as transformers passes them)."""
        return {"tools": [dict(t) for t in self.tools]} if self.active else {}

    def new_parser(self) -> Optional[ToolParser]:
        return make_tool_parser(self.parser, self.tools) if self.active and self.parser else None

    @property
    def needs_special_tokens(self) -> bool:
        """The parser's markers are special tokens, so the output text must keep them."""
        return self.active and self.parser is not None and tool_parser_class(self.parser).needs_special_tokens

    def structured_outputs(self) -> Optional[StructuredOutputsParams]:
        """The grammar forcing the call(s) for `required` and named choices; None otherwise."""
        if self.choice not in ("required", "named"):
            return None
        functions = [t["function"] for t in self.tools if self.named in (None, t["function"]["name"])]
        if self.call_format == "harmony":
            return forced_call_grammar(functions, COMPACT_JSON)
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
        schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {**schema, "x-guidance": COMPACT_JSON}
        repeat = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if self.parallel and self.named is None else ""
        grammar = f'start: call{repeat}\ncall: "<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"'
        return StructuredOutputsParams(grammar=grammar)


def _choice_of(value: Any, field: str, names: Sequence[str]) -> tuple[Choice, Optional[str]]:
    if value is None:
        return ("auto" if names else "none"), None
    if value in ("none", "auto", "required"):
        if value != "none" and not names:
            raise ToolRequestError(f"{field}={value!r} needs tools (none were given)", field)
        return value, None
    name = None
    if isinstance(value, Mapping):
        inner = value.get("function", value)  # tool_choice {"type": "function", "function": {"name"}}; legacy {"name"}
        name = inner.get("name") if isinstance(inner, Mapping) else None
    if not isinstance(name, str):
        raise ToolRequestError(
            f"{field} must be 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': ...}}}}", field
        )
    if name not in names:
        raise ToolRequestError(
            f"{field} names the function {name!r}, which is not among the tools ({', '.join(names) or 'none'})", field
        )
    return "named", name


def tool_setup(
    tools: Optional[Sequence[Any]] = None,
    tool_choice: Any = None,
    *,
    functions: Optional[Sequence[Any]] = None,
    function_call: Any = None,
    parallel_tool_calls: Optional[bool] = None,
    parser: Optional[str] = None,
    call_format: CallFormat = "text",
) -> ToolSetup:
    """Validate a request's tool fields; raises `ToolRequestError` naming the field. `parser`: the configured
    tool-call parser (needed for `auto`; forced calls use the Hermes parser). `call_format="harmony"`: the chat
    format reads and forces calls itself, so no text parser is used."""
    if tools and functions:
        raise ToolRequestError("give tools or the older functions, not both", "functions")
    legacy = bool(functions) or (function_call is not None and not tools)
    if legacy and tool_choice is not None:
        raise ToolRequestError("tool_choice goes with tools; functions go with function_call", "tool_choice")
    field = "functions" if legacy else "tools"
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise ToolRequestError("tools must be a list of tool definitions", "tools")
    items = [{"type": "function", "function": f} for f in functions or []] if legacy else list(tools or [])
    defined = tuple({"type": "function", "function": _function_of(t, f"{field}[{i}]")} for i, t in enumerate(items))
    names = [t["function"]["name"] for t in defined]
    if len(set(names)) != len(names):
        raise ToolRequestError(f"{field}: two functions have the same name", field)
    choice_field = "function_call" if legacy else "tool_choice"
    choice, named = _choice_of(function_call if legacy else tool_choice, choice_field, names)
    parallel = (True if parallel_tool_calls is None else bool(parallel_tool_calls)) and not legacy
    if call_format == "harmony":
        return ToolSetup(defined, choice, named, parallel, legacy, None, call_format)
    if choice == "auto" and parser is None:
        raise ToolRequestError(
            f"{choice_field}='auto' needs a tool-call parser, and this model's chat template names no known format: "
            "set serve.tool_call_parser (hermes, qwen3_coder, llama3_json, mistral) or use 'required' or a named "
            "function",
            choice_field,
        )
    reader = FORCED_FORMAT if choice in ("required", "named") else parser
    if reader is not None:
        tool_parser_class(reader)  # an unknown configured name fails here, by name
    return ToolSetup(defined, choice, named, parallel, legacy, reader if choice != "none" else None)


def tool_sampling(params: SamplingParams, tools: ToolSetup) -> SamplingParams:
    """`params` with the forced-call grammar (`required` / named; a request's own constraint clashes with it) and
    special tokens kept when the parser's markers are special tokens."""
    changes: dict[str, Any] = {}
    grammar = tools.structured_outputs()
    if grammar is not None:
        if params.structured_outputs is not None:
            raise ToolRequestError(
                f"structured outputs cannot be combined with a forced tool call (tool_choice={tools.choice!r}): the "
                "call's arguments already follow the function's schema",
                "structured_outputs",
            )
        changes["structured_outputs"] = grammar
    if tools.needs_special_tokens:
        changes["skip_special_tokens"] = False
    return dataclasses.replace(params, **changes) if changes else params
