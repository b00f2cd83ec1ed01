"""Chat templates: a checkpoint's Jinja template turns a list of messages into one prompt string.

The template comes from the model directory (`chat_template.jinja`, else the `chat_template` key of
`tokenizer_config.json`) and renders in Jinja's immutable sandbox, as transformers renders it: templates are
data from the checkpoint, so they may not touch Python objects beyond what the sandbox allows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from framework.params.sampling_params import InvalidRequestError

TEMPLATE_FILE = "chat_template.jinja"
ROLES = ("system", "user", "assistant", "tool", "developer")
# What `ChatTemplate.render` passes to the template itself: extra template variables may not repeat them.
RENDER_ARGUMENTS = ("messages", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token")


def _special_token(value: Any) -> str:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _template_from_tokenizer_config(config: Mapping[str, Any]) -> Optional[str]:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _content_text(content: Any, where: str) -> str:
    """A message's content: a string, or OpenAI content parts of which only text parts are supported (joined by
    newlines, as vLLM joins them)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise InvalidRequestError(
                    f"{where}.content: only text parts are supported (got a part of type {kind!r})"
                )
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM flattens text parts for string-content templates
    raise InvalidRequestError(f"{where}.content must be a string or a list of text parts")


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as plain dicts with string content; raises `InvalidRequestError` naming the bad message."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequestError('messages must be a non-empty list of {"role", "content"} objects')
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"{where} must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{where}.role={role!r} is invalid: must be one of {', '.join(ROLES)}")
        clean = {k: v for k, v in message.items() if v is not None}
        clean["content"] = _content_text(message.get("content"), where)
        if clean.get("tool_calls") is not None:
            clean["tool_calls"] = _tool_calls(clean["tool_calls"], where)
        out.append(clean)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI `tool_calls` with `arguments` decoded from their JSON text: templates (as
    transformers feeds them) write the arguments as an object."""
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise InvalidRequestError(f"{where}.tool_calls must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"{where}.tool_calls[{j}] must have a function with a name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise InvalidRequestError(f"{where}.tool_calls[{j}].function.arguments is not JSON text") from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    _template: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_template", _compile(self.source))  # a template that does not parse fails here

    @classmethod
    def from_model_dir(cls, path: Optional[Path], override: Optional[str] = None) -> "ChatTemplate":
        """The template of the checkpoint at `path` (or `override`, a template string); raises
        `InvalidRequestError` when there is none."""
        tokenizer_config: dict[str, Any] = {}
        if path is not None and (path / "tokenizer_config.json").is_file():
            tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        source = override
        if source is None and path is not None and (path / TEMPLATE_FILE).is_file():
            source = (path / TEMPLATE_FILE).read_text()
        if source is None:
            source = _template_from_tokenizer_config(tokenizer_config)
        if source is None:
            where = f"the checkpoint at {path}" if path is not None else "this model (a random-weight preset)"
            raise InvalidRequestError(
                f"{where} has no chat template ({TEMPLATE_FILE} or tokenizer_config.json "
                "'chat_template'): chat needs one; use completions with a text prompt"
            )
        return cls(
            source, _special_token(tokenizer_config.get("bos_token")), _special_token(tokenizer_config.get("eos_token"))
        )

    @classmethod
    def load(cls, config: Any, override: Optional[str] = None) -> "ChatTemplate":
        """The template of the model an `Mrv2Config` names (its `model.path`, or the shipped directory)."""
        from framework.models.embedded import resolve_model_source

        source = resolve_model_source(config.model.path, config.model.preset)
        return cls.from_model_dir(Path(source.path) if source.path else None, override)

    def render(
        self,
        messages: Sequence[Any],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`. `continue_final_message` ends the text inside the last message (no
        end-of-turn after it), so generation continues it; it excludes `add_generation_prompt`."""
        messages = normalize_messages(messages)
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true")
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **kwargs,
            )
        except InvalidRequestError:
            raise
        except Exception as err:  # a template error names the template's own complaint
            raise InvalidRequestError(f"the chat template failed on these messages: {err}") from None
        if continue_final_message:
            text = _cut_after_final(text, messages[-1]["content"])
        return text


def _cut_after_final(text: str, final: str) -> str:
    """`text` up to the end of the final message's content, as transformers' `continue_final_message` cuts it:
    templates often trim content (`| trim`), so the content is found stripped, and its trailing whitespace is kept
    only where the template kept it."""
    stripped = final.strip()
    cut = text.rfind(stripped) if stripped else -1
    if cut < 0:
        raise InvalidRequestError(
            "continue_final_message: the rendered template does not contain the final message's content"
        )
    kept = final.lstrip()
    return text[: cut + (len(kept) if text.startswith(kept, cut) else len(stripped))]


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"the chat template refused these messages: {message}")


def _tojson(value: Any, indent: Optional[int] = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _compile(source: str):  # type: ignore[no-untyped-def]
    """Compile in the immutable sandbox (no access to unsafe Python internals, no mutation of arguments)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as err:
        raise InvalidRequestError(f"the chat template does not parse: {err}") from None
