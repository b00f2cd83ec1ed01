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


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
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


def output_items(parts: ChatParts) -> list[dict[str, Any]]:
    """A finished turn's `output`: its reasoning, its answer text, then one item per tool call."""
    items: list[dict[str, Any]] = []
    if parts.reasoning:
        items.append(reasoning_item(_id("rs"), parts.reasoning))
    if parts.content:
        items.append(message_item(_id("msg"), parts.content))
    items += [call_item(_id("fc"), c.id, c.name, c.arguments) for c in parts.tool_calls]
    return items


def sse_event(event: dict[str, Any]) -> str:
    """One server-sent event of the Responses stream (its `event:` line names the type, as OpenAI sends it)."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class ResponseEvents:
    """Turns a stream's `ChatDelta`s into Responses events. One item is open at a time: reasoning, then the answer
    text, then each tool call; a new kind of part closes the open item (its `.done` events carry the whole item)."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # finished items, in output order
        self._open: Optional[dict[str, Any]] = None  # the item being streamed
        self._text = ""  # its text or arguments so far

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def feed(self, delta: ChatDelta) -> list[dict[str, Any]]:
        """The events for what a stream gained."""
        out: list[dict[str, Any]] = []
        if delta.reasoning:
            out += self._grow("reasoning", delta.reasoning)
        if delta.content:
            out += self._grow("message", delta.content)
        for call in delta.tool_calls:
            if "id" in call:  # a call starts: its name first
                out += self.close()
                function = call["function"]
                self._open = call_item(_id("fc"), call["id"], function["name"], "", status="in_progress")
                self._text = ""
                out.append(self.event("response.output_item.added", output_index=len(self.items), item=self._open))
            fragment = call["function"].get("arguments", "")
            if fragment and self._open is not None and self._open["type"] == "function_call":
                self._text += fragment
                out.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=self._open["id"],
                        output_index=len(self.items),
                        delta=fragment,
                    )
                )
        return out

    def _grow(self, kind: str, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            out += self.close()
            if kind == "reasoning":
                self._open = reasoning_item(_id("rs"), "", status="in_progress")
                self._open["content"] = []
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                self._open = message_item(_id("msg"), "", status="in_progress")
                self._open["content"] = []
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._text = ""
            index = len(self.items)
            out.append(self.event("response.output_item.added", output_index=index, item=self._open))
            where = {"item_id": self._open["id"], "output_index": index, "content_index": 0}
            out.append(self.event("response.content_part.added", **where, part=part))
        self._text += text
        kind_name = "reasoning_text" if kind == "reasoning" else "output_text"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(
            self.event(
                f"response.{kind_name}.delta",
                item_id=self._open["id"],
                output_index=len(self.items),
                content_index=0,
                delta=text,
                **extra,
            )
        )
        return out

    def close(self) -> list[dict[str, Any]]:
        """The `.done` events of the open item (none open: nothing)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, text = len(self.items), self._text
        out: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            done = call_item(item["id"], item["call_id"], item["name"], text)
            where = {"item_id": item["id"], "output_index": index}
            out.append(self.event("response.function_call_arguments.done", **where, arguments=text))
        else:
            if item["type"] == "reasoning":
                done = reasoning_item(item["id"], text)
                kind_name, extra = "reasoning_text", {}
            else:
                done = message_item(item["id"], text)
                kind_name, extra = "output_text", {"logprobs": []}
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(self.event(f"response.{kind_name}.done", **where, text=text, **extra))
            out.append(self.event("response.content_part.done", **where, part=done["content"][0]))
        out.append(self.event("response.output_item.done", output_index=index, item=done))
        self.items.append(done)
        return out
