"""The Responses API's output: a chat turn's parts (reasoning, answer text, tool calls) as OpenAI `output` items,
whole (`output_items`) or as the stream of typed events the official client accumulates (`ResponseEvents`):
`response.output_item.added`, the item's deltas, `response.output_item.done`, each with a `sequence_number`."""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from framework.entrypoints.chat_output import ChatDelta, ChatParts


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def message_item(
    item_id: str, text: str, status: str = "completed", logprobs: Optional[list[dict[str, Any]]] = None
) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": [part]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(parts: ChatParts, logprobs: Optional[list[dict[str, Any]]] = None) -> list[dict[str, Any]]:
    """A finished turn's `output`: its reasoning, its answer text (with its tokens' `logprobs` when asked for),
    then one item per tool call."""
    items: list[dict[str, Any]] = []
    if parts.reasoning:
        items.append(reasoning_item(_id("rs"), parts.reasoning))
    if parts.content:
        items.append(message_item(_id("msg"), parts.content, logprobs=logprobs))
    items += [call_item(_id("fc"), c.id, c.name, c.arguments) for c in parts.tool_calls]
    return items


def sse_event(event: dict[str, Any]) -> str:
    """One server-sent event of the Responses stream (its `event:` line names the type, as OpenAI sends it)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class ResponseEvents:
    """Turns a stream's `ChatDelta`s into Responses events. Reasoning and answer text are one open item at a
    time (a new kind of part closes it; its `.done` events carry the whole item). Each tool call is an item of its
    own from its announcement to the end of the stream, since a call's last fragment comes once the whole output
    confirms it; one the output abandons ends with status "incomplete"."""

    def __init__(self) -> None:
        self.sequence = 0
        self._done: dict[int, dict[str, Any]] = {}  # output_index -> finished item
        self._next = 0  # output_index of the next item
        self._open: Optional[dict[str, Any]] = None  # the text item being streamed
        self._open_index = 0
        self._text = ""  # its text so far
        self._logprobs: list[dict[str, Any]] = []  # the open message's token logprobs so far
        self._calls: dict[int, tuple[int, dict[str, Any]]] = {}  # call index -> (output_index, open item)

    @property
    def items(self) -> list[dict[str, Any]]:
        """Finished items, in output order."""
        return [self._done[i] for i in sorted(self._done)]

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def feed(self, delta: ChatDelta, logprobs: Optional[list[dict[str, Any]]] = None) -> list[dict[str, Any]]:
        """The events for what a stream gained (`logprobs`: those of the tokens its content came with)."""
        out: list[dict[str, Any]] = []
        if delta.reasoning:
            out += self._grow("reasoning", delta.reasoning)
        if delta.content:
            out += self._grow("message", delta.content, logprobs or [])
        for call in delta.tool_calls:
            if "id" in call:  # a call starts: its name first
                out += self._close_text()
                function = call["function"]
                item = call_item(_id("fc"), call["id"], function["name"], "", status="in_progress")
                self._calls[call["index"]] = (self._next, item)
                out.append(self.event("response.output_item.added", output_index=self._next, item=item))
                self._next += 1
            fragment = call["function"].get("arguments", "")
            if fragment and call["index"] in self._calls:
                index, item = self._calls[call["index"]]
                item["arguments"] += fragment
                where = {"item_id": item["id"], "output_index": index}
                out.append(self.event("response.function_call_arguments.delta", **where, delta=fragment))
        return out

    def _grow(self, kind: str, text: str, logprobs: Optional[list[dict[str, Any]]] = None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            out += self._close_text()
            if kind == "reasoning":
                self._open = reasoning_item(_id("rs"), "", status="in_progress")
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                self._open = message_item(_id("msg"), "", status="in_progress")
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._open["content"] = []
            self._text, self._logprobs = "", []
            self._open_index, self._next = self._next, self._next + 1
            out.append(self.event("response.output_item.added", output_index=self._open_index, item=self._open))
            where = {"item_id": self._open["id"], "output_index": self._open_index, "content_index": 0}
            out.append(self.event("response.content_part.added", **where, part=part))
        self._text += text
        self._logprobs += logprobs or []
        kind_name = "reasoning_text" if kind == "reasoning" else "output_text"
        extra = {} if kind == "reasoning" else {"logprobs": logprobs or []}
        where = {"item_id": self._open["id"], "output_index": self._open_index, "content_index": 0}
        out.append(self.event(f"response.{kind_name}.delta", **where, delta=text, **extra))
        return out

    def _close_text(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index, text = self._open_index, self._text
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], text)
            kind_name, extra = "reasoning_text", {}
        else:
            done = message_item(item["id"], text, logprobs=self._logprobs)
            kind_name, extra = "output_text", {"logprobs": self._logprobs}
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        out = [self.event(f"response.{kind_name}.done", **where, text=text, **extra)]
        out.append(self.event("response.content_part.done", **where, part=done["content"][0]))
        out.append(self.event("response.output_item.done", output_index=index, item=done))
        self._done[index] = done
        return out

    def close(self, confirmed: Optional[set[str]] = None) -> list[dict[str, Any]]:
        """The `.done` events of every open item; a call whose id is not in `confirmed` (None: all are) ends
        "incomplete"."""
        out = self._close_text()
        for index, item in sorted(self._calls.values(), key=lambda x: x[0]):
            ok = confirmed is None or item["call_id"] in confirmed
            done = call_item(
                item["id"], item["call_id"], item["name"], item["arguments"], "completed" if ok else "incomplete"
            )
            where = {"item_id": item["id"], "output_index": index}
            out.append(self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
            out.append(self.event("response.output_item.done", output_index=index, item=done))
            self._done[index] = done
        self._calls = {}
        return out
