"""The FastAPI application: auth and body-size limits, error handlers, the small endpoints.

The generation and embedding endpoints live in `framework.entrypoints.serve.openai_routes`.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from framework.entrypoints.serve.errors import ApiError, ClientDisconnected, error_body, loggable
from framework.entrypoints.serve.load import health_problem, load_report
from framework.entrypoints.serve.lora import lora_router
from framework.entrypoints.serve.openai_routes import router
from framework.entrypoints.serve.openapi import install_openapi
from framework.entrypoints.serve.responses_api import router as responses_router
from framework.entrypoints.serve.server_info import server_info_router
from framework.entrypoints.serve.state import VERSION, ServerState

logger = logging.getLogger(__name__)


class GuardMiddleware:
    """Pure ASGI: 413 for bodies over the limit, 401 for /v1 requests without the API key (when one is set), and
    one log line for a client that left before its response (`ClientDisconnected`)."""

    def __init__(self, app: Any, api_key: Optional[str], max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def _reject(self, send: Any, status: int, message: str, headers: tuple = ()) -> None:
        response = JSONResponse(error_body(status, message), status_code=status, headers=dict(headers))
        await response({"type": "http"}, None, send)  # type: ignore[arg-type]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"].startswith("/v1"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return await self._reject(
                    send,
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer <key>')",
                    (("WWW-Authenticate", "Bearer"),),
                )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._reject(
                send,
                413,
                f"the request body has {length} bytes; the limit is {self.max_body_bytes} (serve.max_request_bytes)",
            )
        if length is None and scope.get("method") == "POST":  # chunked: count the bytes as they come
            receive = await self._bounded_body(receive)
            if receive is None:
                return await self._reject(
                    send, 413, f"the request body exceeds {self.max_body_bytes} bytes (serve.max_request_bytes)"
                )
        try:
            await self.app(scope, receive, send)
        except ClientDisconnected:  # nobody is left to answer: one log line, not an ASGI traceback
            logger.info(
                "mrv2 serve: %s %s: the client disconnected before its response; its request was aborted",
                scope.get("method"),
                loggable(scope.get("path", "")),
            )

    async def _bounded_body(self, receive: Any) -> Any:
        """Read a body of unknown length up to the limit; a receive that replays it (None when over the limit)."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away: the app sees the disconnect
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                return None
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> Any:
            return replay.pop() if replay else await receive()

        return replayed


def _validation_message(err: RequestValidationError) -> tuple[str, Optional[str]]:
    first = err.errors()[0] if err.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    return f"{field or 'body'}: {first.get('msg', 'invalid value')}", (loc[0] if loc else None)


def build_app(state: ServerState, lifespan: Any = None) -> FastAPI:
    """The application for `state` (its engine client already started)."""
    app = FastAPI(title="mrv2", version=VERSION, lifespan=lifespan)
    app.state.server = state
    app.add_middleware(
        GuardMiddleware, api_key=state.config.serve.api_key, max_body_bytes=state.config.serve.max_request_bytes
    )

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        return err.response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, err: HTTPException) -> JSONResponse:  # no such path (404) or method (405)
        return JSONResponse(
            error_body(err.status_code, str(err.detail)), status_code=err.status_code, headers=err.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> JSONResponse:  # a bug: still an OpenAI error (and logged)
        return JSONResponse(error_body(500, f"internal error ({type(err).__name__}): {err}"), status_code=500)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(err)
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.get("/health")
    async def health() -> Response:
        down, degraded = health_problem(state.client.ranks())
        if down is not None:
            return JSONResponse(error_body(503, down), status_code=503)
        # a router keeps a degraded server (its live ranks serve); the header names the dead ranks
        return Response(status_code=200, headers={"X-Mrv2-Degraded": loggable(degraded)} if degraded else None)

    @app.get("/load")
    async def load() -> dict[str, Any]:
        return load_report(state.client.ranks())

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "mrv2",
            "max_model_len": state.max_model_len,
        }
        return {"object": "list", "data": [card, *state.loras.cards(state.model_name, state.max_model_len)]}

    app.include_router(router)
    app.include_router(lora_router)
    app.include_router(responses_router)
    app.include_router(server_info_router)  # what SGLang's gateway asks a worker
    install_openapi(app, lambda: state.config.sampler.max_logprobs)
    return app
