"""Griffe extension: a trailing `# comment` documents the attribute or parameter it follows.

mrv2 writes the shape, dtype and index space of every tensor field and parameter in a comment on the same
line (`idx_mapping: torch.Tensor  # [R] int32: batch_row -> req_slot`). Griffe reads docstrings only, so
without this extension the API reference would drop exactly that information. Loaded by mkdocstrings
(`extensions` in mkdocs.yml); the engine code is not changed.

- An attribute without a docstring takes the comment at the end of its statement (or of its first line).
- A function whose docstring has no parameter section gets an `Args:` section built from the comments at
  the end of its parameters' lines (only lines that hold a single parameter).

It also renders the few Sphinx habits found in docstrings as Markdown: a role such as
``:class:`ConfigError` `` becomes `` `ConfigError` ``, and a paragraph ending in `::` (a literal block
follows) ends in `:`.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from typing import Any

import griffe

_SKIP_PREFIXES = ("type:", "noqa", "pragma", "fmt:", "pyright:", "mypy:")
_PARAM_SECTIONS = ("Args:", "Arguments:", "Parameters:", "Params:")
_SPHINX_ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):`~?([^`]+)`")
_LITERAL_MARKER = re.compile(r"(?<=\w)::$", re.MULTILINE)


def _markdown(text: str) -> str:
    return _LITERAL_MARKER.sub(":", _SPHINX_ROLE.sub(r"`\1`", text))


def _trailing_comments(source: str) -> dict[int, str]:
    """Line number -> text of a comment that follows code on that line."""
    comments: dict[int, str] = {}
    code_lines: set[int] = set()
    ignored = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENCODING,
        tokenize.ENDMARKER,
    }
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                text = tok.string.lstrip("#").strip()
                if tok.start[0] in code_lines and text and not text.startswith(_SKIP_PREFIXES):
                    comments[tok.start[0]] = text
            elif tok.type not in ignored:
                code_lines.update(range(tok.start[0], tok.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        return {}
    return comments


class TrailingComments(griffe.Extension):
    """Turn same-line comments into attribute docstrings and parameter descriptions."""

    def __init__(self) -> None:
        self._cache: dict[str, dict[int, str]] = {}

    def _comments(self, obj: griffe.Object) -> dict[int, str]:
        module = obj.module
        key = str(module.filepath)
        if key not in self._cache:
            try:
                self._cache[key] = _trailing_comments(module.source)
            except (OSError, ValueError, AttributeError):
                self._cache[key] = {}
        return self._cache[key]

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _markdown(obj.docstring.value)

    def on_attribute_instance(self, *, node: Any, attr: griffe.Attribute, agent: Any, **kwargs: Any) -> None:
        if attr.docstring is not None or not isinstance(node, ast.stmt):
            return
        comments = self._comments(attr)
        text = comments.get(node.end_lineno or node.lineno) or comments.get(node.lineno)
        if text:
            attr.docstring = griffe.Docstring(
                text,
                lineno=node.lineno,
                endlineno=node.lineno,
                parent=attr,
                parser=getattr(agent, "docstring_parser", None),
                parser_options=getattr(agent, "docstring_options", None),
            )

    def on_function_instance(self, *, node: Any, func: griffe.Function, agent: Any, **kwargs: Any) -> None:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return
        existing = func.docstring.value if func.docstring else ""
        if any(line.strip() in _PARAM_SECTIONS for line in existing.splitlines()):
            return
        comments = self._comments(func)
        args = node.args
        all_args = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
        all_args = [a for a in all_args if a is not None and a.arg not in ("self", "cls")]
        lines_used: dict[int, int] = {}
        for a in all_args:
            lines_used[a.end_lineno or a.lineno] = lines_used.get(a.end_lineno or a.lineno, 0) + 1
        described = []
        for a in all_args:
            line = a.end_lineno or a.lineno
            if lines_used[line] == 1 and line != node.lineno and comments.get(line):
                described.append(f"    {a.arg}: {comments[line]}")
        if not described:
            return
        value = (existing.rstrip() + "\n\n" if existing else "") + "Args:\n" + "\n".join(described)
        if func.docstring:
            func.docstring.value = value
        else:
            func.docstring = griffe.Docstring(
                value,
                lineno=node.lineno,
                endlineno=node.lineno,
                parent=func,
                parser=getattr(agent, "docstring_parser", None),
                parser_options=getattr(agent, "docstring_options", None),
            )
