"""LoRA adapters behind the server: which names it serves (`serve.lora_modules`, run-time loads), how a request's
`model` selects one, and the load / unload endpoints (`serve.allow_runtime_lora`).

An adapter is checked here before it is listed (config, rank, target modules and shapes against the engine's
projections, which the engine sends once it is ready), so a bad one is refused by name at load and nothing
already served is disturbed. The engine loads its weights when a request first uses it.
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from framework.config.schema import Mrv2Config
from framework.entrypoints.serve.errors import ApiError
from framework.models.lora.adapter import LoraAdapterError, LoraTargets, ProjectionShape, read_adapter
from framework.params.lora_request import LoRARequest

lora_router = APIRouter()


def parse_lora_modules(modules: list[str]) -> dict[str, str]:
    """`serve.lora_modules` entries `name=path` -> {name: path}; a malformed or repeated entry names itself."""
    out: dict[str, str] = {}
    for entry in modules:
        name, sep, path = str(entry).partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"serve.lora_modules: '{entry}' is not name=path")
        if name.strip() in out:
            raise ValueError(f"serve.lora_modules: the name '{name.strip()}' is given twice")
        out[name.strip()] = path.strip()
    return out


class ServedLoras:
    """The adapters served by name, and the engine's projections they are checked against."""

    def __init__(self, config: Optional[Mrv2Config] = None) -> None:
        self.enabled = config is not None and config.lora.enable
        self.max_rank = config.lora.max_rank if config is not None else 0
        self.allow_runtime = config is not None and config.serve.allow_runtime_lora
        self.adapters: dict[str, LoRARequest] = {}
        self.targets: Optional[LoraTargets] = None

    def bind(self, shapes: list[tuple[int, str, int, int]], moe_layers: list[int]) -> None:
        """The engine's projections (from its ready message): what adapters are checked against."""
        table = {(layer, part): ProjectionShape(i, o) for layer, part, i, o in shapes}
        self.targets = LoraTargets(table, frozenset(moe_layers))

    def add(self, name: str, path: str, base_name: str) -> LoRARequest:
        """Check and list an adapter; `LoraAdapterError` / `ValueError` name the problem."""
        if not self.enabled:
            raise ValueError(f"LoRA adapter '{name}': this server runs without lora.enable=true")
        if name == base_name or name in self.adapters:
            raise ValueError(f"LoRA adapter '{name}': the name is already served")
        lora = LoRARequest(name, path)
        assert self.targets is not None, "bind() first"
        read_adapter(lora, self.targets, self.max_rank, load=False)
        self.adapters[name] = lora
        return lora

    def select(self, model: Optional[str], base_name: str) -> Optional[LoRARequest]:
        """The adapter a request's `model` names (None: the base); 404 for a name this server does not serve."""
        if model is None or model == base_name:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            served = ", ".join([base_name, *self.adapters])
            raise ApiError(404, f"the model '{model}' does not exist; this server serves: {served}", "model")
        return lora

    def cards(self, base_name: str, max_model_len: int) -> list[dict[str, Any]]:
        """/v1/models entries of the adapters: each with the base as parent."""
        return [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "mrv2",
                "root": lora.path,
                "parent": base_name,
                "max_model_len": max_model_len,
            }
            for name, lora in self.adapters.items()
        ]


class LoadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


def _runtime_allowed(loras: ServedLoras, endpoint: str) -> None:
    if not loras.allow_runtime:
        raise ApiError(
            403, f"{endpoint} is off: start the server with serve.allow_runtime_lora=true to load adapters at run time"
        )


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraBody, request: Request) -> dict[str, Any]:
    state = request.app.state.server
    _runtime_allowed(state.loras, "/v1/load_lora_adapter")
    try:
        state.loras.add(body.lora_name, body.lora_path, state.model_name)
    except (LoraAdapterError, ValueError, OSError) as err:
        raise ApiError.invalid(str(err), "lora_path") from None
    return {"object": "lora_adapter", "id": body.lora_name, "status": "loaded"}


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraBody, request: Request) -> dict[str, Any]:
    state = request.app.state.server
    _runtime_allowed(state.loras, "/v1/unload_lora_adapter")
    if state.loras.adapters.pop(body.lora_name, None) is None:
        raise ApiError(404, f"the LoRA adapter '{body.lora_name}' is not loaded", "lora_name")
    return {"object": "lora_adapter", "id": body.lora_name, "status": "unloaded"}
