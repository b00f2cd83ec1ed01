"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status."""

from __future__ import annotations

import asyncio
import re
from typing import Any, Optional

from fastapi.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    503: "ServiceUnavailableError",
    500: "InternalServerError",
}
_FIELD = re.compile(r"(?:SamplingParams|PoolingParams)\.(\w+)|\b(response_format|structured_outputs)\b")


class ClientDisconnected(asyncio.CancelledError):
    """The client left before its response: the handler stops (its `finally` aborts the request in the engine)
    and the server logs one line for it (`GuardMiddleware`), not a traceback."""


def loggable(text: object, limit: int = 200) -> str:
    """Client-supplied text as it may appear in a log: quoted, with newlines, control and non-ASCII characters
    escaped (a client cannot forge a log line), and at most `limit` characters of it."""
    value = str(text)
    return ascii(value[:limit]) + ("..." if len(value) > limit else "")


class ApiError(Exception):
    """An error to send to the client as JSON with `status`."""

    def __init__(
        self, status: int, message: str, param: Optional[str] = None, headers: Optional[dict[str, str]] = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    @classmethod
    def invalid(cls, message: str, param: Optional[str] = None) -> "ApiError":
        """400; `param` defaults to the field an engine message names (`SamplingParams.top_p=...`)."""
        if param is None:
            found = _FIELD.search(message)
            param = (found.group(1) or found.group(2)) if found else None
        return cls(400, message, param)

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "Error"), "param": param, "code": status}}
