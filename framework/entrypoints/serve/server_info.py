"""What SGLang's Model Gateway (`sglang-router`) asks a worker when it registers it: `GET /server_info` and
`GET /model_info` (older gateways: `/get_server_info` and `/get_model_info`, which newer ones fall back to on a 404).

The gateway turns the answers into the worker's labels: `served_model_name` (or `model_path`) becomes the worker's
model id, which it matches against a request's `model`; `model_path` / `tokenizer_path` tell it where to load a
tokenizer for the policies that tokenize (a local directory only: an embedded preset without one reports null,
so the gateway never reaches for a hub); `tp_size`, `dp_size`, `load_balance_method` and `disaggregation_mode`
describe the worker; `model_type` and `architectures` the model. The fields keep SGLang's names; the sizes are
mrv2's (`max_total_num_tokens`: KV-cache tokens of one engine core, `max_running_requests`: its request slots).
docs/scaling-out.md lists them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from framework.entrypoints.serve.state import VERSION, ServerState
from framework.models.embedded import resolve_model_source
from framework.models.setup import read_model_config

server_info_router = APIRouter()


class ServerInfo(BaseModel):
    """`GET /server_info`: the server's setup, under the names SGLang's `/server_info` uses."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model_path: Optional[str]  # the checkpoint's local directory (null: an embedded preset's random weights)
    tokenizer_path: Optional[str]  # the directory holding its tokenizer.json (null: none)
    served_model_name: str
    is_embedding: bool  # false: generation and embedding requests share one engine
    tp_size: int
    pp_size: int
    dp_size: int
    load_balance_method: str  # how the API server spreads requests over its data-parallel engine cores
    disaggregation_mode: str  # "null": prefill and decode in one server
    context_length: int  # longest prompt + output (`max_model_len`)
    max_total_num_tokens: int  # KV-cache tokens of one engine core (blocks x block size)
    max_running_requests: int  # request slots of one engine core (`scheduler.max_num_seqs`)
    max_prefill_tokens: int  # tokens one step computes at most (`scheduler.max_num_batched_tokens`)
    page_size: int  # tokens per KV block
    version: str


class ModelInfo(BaseModel):
    """`GET /model_info`: the model, under the names SGLang's `/model_info` uses."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model_path: Optional[str]
    tokenizer_path: Optional[str]
    is_generation: bool
    model_type: Optional[str]  # config.json's
    architectures: Optional[list[str]]  # config.json's
    max_context_length: int
    vocab_size: int
    eos_token_id: Optional[int]


def _paths(state: ServerState) -> tuple[Optional[str], Optional[str]]:
    """(model_path, tokenizer_path): the checkpoint's local directory, and it again when it has tokenizer.json."""
    source = resolve_model_source(state.config.model.path, state.config.model.preset)
    if source.path is None:
        return None, None
    root = Path(source.path).resolve()
    return str(root), str(root) if (root / "tokenizer.json").is_file() else None


def server_info(state: ServerState) -> ServerInfo:
    """The body of `/server_info` for the running server."""
    config, (model_path, tokenizer_path) = state.config, _paths(state)
    stats = state.client.info.stats if state.client.info is not None else None
    return ServerInfo(
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        served_model_name=state.model_name,
        is_embedding=False,
        tp_size=config.parallel.tensor_parallel_size,
        pp_size=config.parallel.pipeline_parallel_size,
        dp_size=config.parallel.data_parallel_size,
        load_balance_method="shortest_queue",
        disaggregation_mode="null",
        context_length=state.max_model_len,
        max_total_num_tokens=(stats.num_blocks if stats is not None else 0) * config.cache.block_size,
        max_running_requests=config.scheduler.max_num_seqs,
        max_prefill_tokens=config.scheduler.max_num_batched_tokens,
        page_size=config.cache.block_size,
        version=VERSION,
    )


def model_info(state: ServerState) -> ModelInfo:
    """The body of `/model_info` for the running server."""
    hf: dict[str, Any] = read_model_config(state.config)
    model_path, tokenizer_path = _paths(state)
    assert state.client.info is not None
    return ModelInfo(
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        is_generation=True,
        model_type=hf.get("model_type"),
        architectures=hf.get("architectures"),
        max_context_length=state.max_model_len,
        vocab_size=state.vocab_size,
        eos_token_id=state.client.info.eos_token_id,
    )


@server_info_router.get("/server_info", response_model=ServerInfo)
@server_info_router.get("/get_server_info", response_model=ServerInfo)
async def get_server_info(request: Request) -> ServerInfo:
    return server_info(request.app.state.server)


@server_info_router.get("/model_info", response_model=ModelInfo)
@server_info_router.get("/get_model_info", response_model=ModelInfo)
async def get_model_info(request: Request) -> ModelInfo:
    return model_info(request.app.state.server)
