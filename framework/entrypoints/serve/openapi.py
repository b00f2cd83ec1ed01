"""The server's `/openapi.json`, made true: the statuses it sends, its response bodies, its content types and the
ranges `SamplingParams` enforces.

FastAPI derives the schema from the routes, which declare only their request bodies (`openai_models`); it would
document a 422 the server never sends (bad bodies are 400s, `app.py`) and JSON for `/health` and `/metrics`.
`install_openapi` replaces that with a schema built once from FastAPI's and corrected here. A test runs
schemathesis against it (tests/entrypoints/serve/test_serve_openapi.py): every response must conform.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from framework.params.sampling_params import MAX_N, SEED_RANGE


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # the server may send more fields than documented (vLLM's extras)


class ErrorDetail(_Open):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(_Open):
    """OpenAI's error body, sent with every 4xx and 5xx."""

    error: ErrorDetail


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class CompletionResponse(_Open):
    """POST /v1/completions without `stream` (with it: `text/event-stream` of such objects, then `[DONE]`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class AssistantMessage(_Open):
    role: str
    content: Optional[str] = None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(_Open):
    """POST /v1/chat/completions without `stream`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None


class ResponseObject(_Open):
    """POST /v1/responses without `stream` (with it: `text/event-stream` of typed events)."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: str
    output: list[dict[str, Any]]
    usage: Optional[dict[str, Any]] = None


class Embedding(_Open):
    object: Literal["embedding"]
    index: int
    embedding: Union[list[float], str]  # a list of floats, or base64 little-endian float32 (`encoding_format`)


class EmbeddingResponse(_Open):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelCard]


class Version(_Open):
    version: str


class RankLoad(_Open):
    rank: int
    alive: bool
    error: Optional[str]
    server_load: int
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: Optional[float]


class Load(_Open):
    server_load: int
    num_requests_running: int
    num_requests_waiting: int
    data_parallel: list[RankLoad]


class LoraAdapterStatus(_Open):
    object: Literal["lora_adapter"]
    id: str
    status: Literal["loaded", "unloaded"]


_ERRORS = {
    "400": "the request is invalid (a field, its range, or constraints that contradict each other)",
    "401": "`serve.api_key` is set and the request lacks `Authorization: Bearer <key>`",
    "403": "run-time LoRA loading is off (`serve.allow_runtime_lora`)",
    "404": "the `model` (or LoRA adapter) asked for is not one this server serves",
    "413": "the body is larger than `serve.max_request_bytes`",
    "500": "the engine failed this request while running it",
    "503": "the engine is not running, or the queue is full (`serve.max_queued_requests`)",
}
_POST_BODIES = {
    "/v1/completions": ("CompletionResponse", True),
    "/v1/chat/completions": ("ChatCompletionResponse", True),
    "/v1/embeddings": ("EmbeddingResponse", False),
    "/v1/responses": ("ResponseObject", True),
    "/v1/load_lora_adapter": ("LoraAdapterStatus", False),
    "/v1/unload_lora_adapter": ("LoraAdapterStatus", False),
}
_POST_ERRORS = {"/v1/load_lora_adapter": "403", "/v1/unload_lora_adapter": "403"}  # beyond every POST's errors
_MODELS = (
    ErrorResponse,
    CompletionResponse,
    ChatCompletionResponse,
    EmbeddingResponse,
    ResponseObject,
    LoraAdapterStatus,
    ModelList,
    Version,
    Load,
)


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref("ErrorResponse")}}}


def _bound(prop: dict[str, Any], **bounds: Any) -> None:
    """Set JSON-schema bounds on a property, inside its numeric branch when it is Optional (`anyOf`)."""
    branches = prop.get("anyOf", [prop])
    for branch in branches:
        if branch.get("type") in ("integer", "number"):
            branch.update(bounds)


def _ranges(max_logprobs: int) -> dict[str, dict[str, Any]]:
    """The ranges `SamplingParams.validate` and the engine enforce, by request field."""
    return {
        "n": {"minimum": 1, "maximum": MAX_N},
        "temperature": {"minimum": 0},
        "top_p": {"exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"minimum": -1},
        "min_p": {"minimum": 0, "maximum": 1},
        "presence_penalty": {"minimum": -2, "maximum": 2},
        "frequency_penalty": {"minimum": -2, "maximum": 2},
        "repetition_penalty": {"exclusiveMinimum": 0},
        "seed": {"minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1]},
        "min_tokens": {"minimum": 0},
        "max_tokens": {"minimum": 1},
        "max_completion_tokens": {"minimum": 1},
        "max_output_tokens": {"minimum": 1},
        "thinking_token_budget": {"minimum": 0},
        "logprobs": {"minimum": 0, "maximum": max_logprobs},  # completions' int (chat's is a bool: untouched)
        "top_logprobs": {"minimum": 0, "maximum": max_logprobs},
        "prompt_logprobs": {"minimum": 0, "maximum": max_logprobs},
    }


def build_openapi(app: FastAPI, max_logprobs: int) -> dict[str, Any]:
    """FastAPI's schema for `app`, corrected (see the module docstring)."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for model in _MODELS:
        model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(model_schema.pop("$defs", {}))
        components[model.__name__] = model_schema
    ranges = _ranges(max_logprobs)
    for name in ("CompletionRequest", "ChatCompletionRequest", "EmbeddingRequest", "ResponsesRequest"):
        for field, prop in components.get(name, {}).get("properties", {}).items():
            if field in ranges:
                _bound(prop, **ranges[field])
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            responses = op["responses"]
            responses.pop("422", None)
            if path.startswith("/v1"):
                responses["401"] = _error(_ERRORS["401"])
            if method == "post" and path in _POST_BODIES:
                body, streams = _POST_BODIES[path]
                content: dict[str, Any] = {"application/json": {"schema": _ref(body)}}
                if streams:  # with "stream": true, server-sent events
                    content["text/event-stream"] = {"schema": {"type": "string"}}
                responses["200"] = {"description": "the result", "content": content}
                for status in ("400", "404", "413", "500", "503", *_POST_ERRORS.get(path, "").split()):
                    responses[status] = _error(_ERRORS[status])
    paths = schema["paths"]
    paths["/health"]["get"]["responses"] = {
        "200": {
            "description": "the engine is running (empty body; header X-Mrv2-Degraded names dead data-parallel ranks)"
        },
        "503": _error("the engine is not running"),
    }
    metrics_text = {"text/plain": {"schema": {"type": "string"}}}
    paths["/metrics"]["get"]["responses"] = {
        "200": {"description": "Prometheus text format (names prefixed `mrv2:` or `vllm:`)", "content": metrics_text}
    }
    paths["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] = _ref("ModelList")
    paths["/version"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] = _ref("Version")
    paths["/load"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] = _ref("Load")
    return schema


def install_openapi(app: FastAPI, max_logprobs: Callable[[], int]) -> None:
    """Serve `build_openapi`'s schema at /openapi.json (built on first request, then cached); `max_logprobs`
    gives the engine's `sampler.max_logprobs` then."""
    built: dict[str, Any] = {}

    def openapi() -> dict[str, Any]:
        if not built:
            built.update(build_openapi(app, max_logprobs()))
        return built

    app.openapi = openapi  # type: ignore[method-assign]
