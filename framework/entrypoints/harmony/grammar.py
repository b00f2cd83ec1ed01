"""The grammar of a forced call (`tool_choice` `required` or named) in the harmony format.

The assistant turn is one commentary message to `functions.<name>` whose JSON arguments follow that function's
schema, ended by `<|call|>`: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`.
The special tokens are written as llguidance's special-token references (`<|channel|>`), which match only the
token itself, never its spelling as text. Harmony writes one call per turn, so `parallel_tool_calls` has nothing
to add. There is no analysis message before a forced call: a free-text section a grammar cannot bound would let
a model that never ends it spend `max_tokens` before the call.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from framework.params.structured_outputs import StructuredOutputsParams


def forced_call_grammar(
    functions: Sequence[Mapping[str, Any]], json_options: Mapping[str, Any]
) -> StructuredOutputsParams:
    """A grammar allowing exactly one call of one of `functions` (OpenAI function definitions with `name` and
    `parameters`); `json_options` are llguidance's JSON options (`x-guidance`) for the arguments."""
    calls = [
        f'{json.dumps(f["name"])} " " <|constrain|> "json" <|message|> '
        f"%json {json.dumps({**f['parameters'], 'x-guidance': dict(json_options)})}"
        for f in functions
    ]
    body = "\n    | ".join(calls)
    grammar = f'start: <|channel|> "commentary to=functions." call <|call|>\ncall: {body}'
    return StructuredOutputsParams(grammar=grammar)
