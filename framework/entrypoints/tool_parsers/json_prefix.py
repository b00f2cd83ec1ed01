"""The certain part of JSON text that is still being written: the prefix of its normal form (`json.dumps(value,
ensure_ascii=False)`: `", "` and `": "` separators, strings re-escaped, numbers as Python writes them) that no
continuation can change. Streamed tool-call arguments are these prefixes, so their fragments add up to the
arguments a whole output gives. A string's characters are certain as they arrive; a number or `true` only once
a delimiter follows it. Text that is not JSON stops the prefix where it goes wrong."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = re.compile(r"[-+0-9.eE]+")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


@dataclass
class JsonPrefix:
    """`text`: the certain normal-form prefix; `end`: where the value ended in the raw text (None: not yet);
    `valid`: False when the raw text stopped being JSON (at the point `text` covers)."""

    text: str
    end: Optional[int] = None
    valid: bool = True


def _string(raw: str, i: int) -> tuple[str, Optional[int], bool]:
    """(decoded characters certain so far, index after the closing quote or None, valid) of the string at `i`."""
    chars: list[str] = []
    j = i + 1
    while j < len(raw):
        c = raw[j]
        if c == '"':
            return "".join(chars), j + 1, True
        if c == "\\":
            if j + 1 >= len(raw):
                break
            e = raw[j + 1]
            if e in _ESCAPES:
                chars.append(_ESCAPES[e])
                j += 2
                continue
            if e != "u":
                return "".join(chars), None, False
            if j + 6 > len(raw):
                break
            code = raw[j + 2 : j + 6]
            if not re.fullmatch(r"[0-9a-fA-F]{4}", code):
                return "".join(chars), None, False
            value = int(code, 16)
            if 0xD800 <= value < 0xDC00:  # a surrogate pair: both halves before the character is certain
                if j + 12 > len(raw):
                    break
                try:
                    chars.append(json.loads(f'"{raw[j : j + 12]}"'))
                except ValueError:
                    return "".join(chars), None, False
                j += 12
                continue
            chars.append(chr(value))
            j += 6
            continue
        if c < " ":
            return "".join(chars), None, False
        chars.append(c)
        j += 1
    return "".join(chars), None, True


def json_prefix(raw: str, start: int = 0) -> JsonPrefix:
    """The certain normal-form prefix of the JSON value that begins at `raw[start:]` (after any whitespace)."""
    out: list[str] = []
    stack: list[list[str]] = []  # [container, what it expects next]
    i = start
    while i < len(raw):
        c = raw[i]
        if c in " \t\r\n":
            i += 1
            continue
        expect = stack[-1][1] if stack else "value"
        if c in ",:":
            if (c == "," and expect != "comma") or (c == ":" and expect != "colon"):
                return JsonPrefix("".join(out), valid=False)
            out.append(c + " ")
            stack[-1][1] = "value" if c == ":" or stack[-1][0] == "[" else "key"
            i += 1
            continue
        if c in "}]":
            want = "{" if c == "}" else "["
            if not stack or stack[-1][0] != want or expect not in ("comma", "key_or_close", "value_or_close"):
                return JsonPrefix("".join(out), valid=False)
            out.append(c)
            stack.pop()
            i += 1
        elif expect in ("key", "key_or_close"):
            if c != '"':
                return JsonPrefix("".join(out), valid=False)
            chars, after, ok = _string(raw, i)
            if after is None:
                return JsonPrefix("".join(out) + json.dumps(chars, ensure_ascii=False)[:-1], valid=ok)
            out.append(json.dumps(chars, ensure_ascii=False))
            stack[-1][1] = "colon"
            i = after
            continue
        elif expect not in ("value", "value_or_close"):
            return JsonPrefix("".join(out), valid=False)
        elif c in "{[":
            out.append(c)
            stack.append([c, "key_or_close" if c == "{" else "value_or_close"])
            i += 1
            continue
        elif c == '"':
            chars, after, ok = _string(raw, i)
            if after is None:
                return JsonPrefix("".join(out) + json.dumps(chars, ensure_ascii=False)[:-1], valid=ok)
            out.append(json.dumps(chars, ensure_ascii=False))
            i = after
        else:
            literal = next((w for w in _LITERALS if raw.startswith(w, i) or w.startswith(raw[i:])), None)
            token = _NUMBER_CHARS.match(raw, i)
            if literal is not None and not raw.startswith(literal, i):
                return JsonPrefix("".join(out))  # a literal still being written
            if literal is not None:
                out.append(literal)
                i += len(literal)
            elif token is None:
                return JsonPrefix("".join(out), valid=False)
            elif token.end() == len(raw) and stack:
                return JsonPrefix("".join(out))  # the number may go on
            elif not _NUMBER.fullmatch(token.group()):
                return JsonPrefix("".join(out), valid=False)
            else:
                out.append(json.dumps(json.loads(token.group())))
                i = token.end()
        if not stack:
            return JsonPrefix("".join(out), end=i)
        stack[-1][1] = "comma"
    return JsonPrefix("".join(out))


@dataclass
class PartialCall:
    """A call as far as it is written: `name` once certain (None before), `arguments` the certain prefix of its
    arguments' normal form, `end` where the call's text ended (None: not yet)."""

    name: Optional[str]
    arguments: str = ""
    end: Optional[int] = None


def _skip(raw: str, i: int, chars: str = " \t\r\n") -> int:
    while i < len(raw) and raw[i] in chars:
        i += 1
    return i


def scan_call_object(
    raw: str, i: int, args_keys: tuple[str, ...] = ("arguments", "parameters")
) -> Optional[PartialCall]:
    """The call object `{"name": ..., "arguments": {...}}` written so far from `raw[i]`; None when it is not
    (yet) one. Arguments given as JSON text inside a string are not streamed (the whole call gives them)."""
    i = _skip(raw, i)
    if i >= len(raw) or raw[i] != "{":
        return None
    call = PartialCall(None)
    i += 1
    while True:
        i = _skip(raw, i)
        if i >= len(raw):
            return call
        if raw[i] == "}":
            call.end = i + 1
            return call
        if raw[i] != '"':
            return call
        key, after, _ = _string(raw, i)
        if after is None:
            return call
        i = _skip(raw, after)
        if i >= len(raw) or raw[i] != ":":
            return call
        value = json_prefix(raw, i + 1)
        if key == "name" and value.end is not None and value.text.startswith('"'):
            call.name = json.loads(value.text)
        if key in args_keys and raw[_skip(raw, i + 1) : _skip(raw, i + 1) + 1] == "{":
            call.arguments = value.text
        if value.end is None:
            return call
        i = _skip(raw, value.end)
        if i < len(raw) and raw[i] == ",":
            i += 1
        elif i < len(raw) and raw[i] != "}":
            return call
