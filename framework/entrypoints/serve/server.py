"""`mrv2 serve`: bind the socket, start the engine-core process, run the HTTP app, shut down on SIGTERM.

Start-up prints one line on stdout, the URL, once the engine is ready (with `serve.port=0` it names the port
the system chose). SIGTERM or Ctrl-C: stop accepting, end the requests in flight (streams get a final error
event, others a 503), stop the engine process, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional

import uvicorn
from fastapi import FastAPI

from framework.config.schema import ConfigError, Mrv2Config
from framework.entrypoints.chat_template import ChatTemplate
from framework.entrypoints.harmony.chat import HarmonyUnavailable, harmony_chat_for
from framework.entrypoints.serve.app import build_app
from framework.entrypoints.serve.client_interface import ServingClient
from framework.entrypoints.serve.dp_client import DataParallelClient
from framework.entrypoints.serve.engine_client import EngineClient, EngineStartError
from framework.entrypoints.serve.lora import ServedLoras, parse_lora_modules
from framework.entrypoints.serve.metrics import ServerMetrics
from framework.entrypoints.serve.state import ServerState
from framework.models.embedded import resolve_model_source
from framework.models.lora.adapter import LoraAdapterError
from framework.models.setup import read_model_config
from framework.models.tokenizer import load_tokenizer
from framework.params.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)
GRACEFUL_SHUTDOWN_S = 10


def served_model_name(config: Mrv2Config) -> str:
    """`serve.served_model_name`, else the checkpoint directory's name, else the preset's."""
    if config.serve.served_model_name:
        return config.serve.served_model_name
    if config.model.path:
        return Path(config.model.path).resolve().name
    return config.model.preset or "mrv2"


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the engine loads (a busy port fails at once, with its number)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"serve: cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn, plus: on SIGTERM/SIGINT first end every request in flight, so that shutdown never waits on them;
    and exit 0 after a clean shutdown (uvicorn would re-raise the signal)."""

    def __init__(self, config: uvicorn.Config, client: ServingClient) -> None:
        super().__init__(config)
        self.client = client
        self.loop: Optional[asyncio.AbstractEventLoop] = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.client.begin_shutdown)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for connections
        self.should_exit = True


def _state(config: Mrv2Config, client_factory: Optional[Callable[[Mrv2Config], ServingClient]] = None) -> ServerState:
    source = resolve_model_source(config.model.path, config.model.preset)
    hf_config = read_model_config(config)
    tokenizer = load_tokenizer(source.path, hf_config)
    template, why = None, None
    try:
        template = ChatTemplate.load(config)
    except InvalidRequestError as err:
        why = str(err)
    harmony, harmony_why = None, None
    try:
        harmony = harmony_chat_for(config.serve.chat_format, hf_config, source.path)
    except HarmonyUnavailable as err:
        harmony_why = str(err)
        logger.warning("chat requests will be refused: %s", err)
    if client_factory is None:  # one engine core, or one per data-parallel rank
        client_factory = DataParallelClient if config.parallel.data_parallel_size > 1 else EngineClient
    client = client_factory(config)
    name = served_model_name(config)
    metrics = ServerMetrics(
        name, lambda: client.stats, config.serve.metrics_names, client.ranks, config.cache.block_size
    )
    return ServerState(
        config,
        name,
        client,
        tokenizer,
        metrics,
        template,
        why,
        loras=ServedLoras(config),
        harmony=harmony,
        harmony_error=harmony_why,
    )


def serving_app(config: Mrv2Config) -> FastAPI:
    """mrv2's FastAPI app for another ASGI host (Ray Serve, a test client): its lifespan starts the engine
    cores (raising `EngineStartError` when they cannot start) and stops them."""
    state = _state(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        await state.client.start(config.serve.engine_start_timeout_s)
        register_lora_modules(state)
        try:
            yield
        finally:
            await state.client.close()

    return build_app(state, lifespan)


def register_lora_modules(state: ServerState) -> None:
    """Check and list `serve.lora_modules` against the started engine's projections; raises naming the problem."""
    info = state.client.info
    assert info is not None
    modules = parse_lora_modules(state.config.serve.lora_modules)
    if modules and not state.config.lora.enable:
        raise ValueError("serve.lora_modules needs lora.enable=true")
    state.loras.bind(info.lora_targets, info.lora_moe_layers)
    for lora_name, path in modules.items():
        state.loras.add(lora_name, path, state.model_name)


def serve_command(config: Mrv2Config, client_factory: Optional[Callable[[Mrv2Config], ServingClient]] = None) -> None:
    """Run the server until SIGTERM / Ctrl-C; raises `ConfigError` when it cannot start. `client_factory` makes
    the engine client (default: one engine core, or one per data-parallel rank; a stand-in core for the
    API-server harness)."""
    host, port = config.serve.host, config.serve.port
    sock = bind_socket(host, port)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}"
    state = _state(config, client_factory)
    failure: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        server.loop = asyncio.get_running_loop()
        try:
            await state.client.start(config.serve.engine_start_timeout_s)
            register_lora_modules(state)
        except (EngineStartError, LoraAdapterError, ValueError) as err:
            failure.append(str(err))
            server.should_exit = True
        else:
            print(f"mrv2 serve: {url} (model '{state.model_name}')", flush=True)
        try:
            yield
        finally:
            await state.client.close()

    app = build_app(state, lifespan)
    server = _Server(
        uvicorn.Config(
            app, log_level="warning", lifespan="on", access_log=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S
        ),
        state.client,
    )
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if failure:
        raise ConfigError(failure[0])


def main(argv: Optional[list[str]] = None) -> None:
    """`python -m framework.entrypoints.serve.server CONFIG_JSON`: serve a config written as JSON (serving bench)."""
    import json
    import sys

    from framework.config.schema import load_config

    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    serve_command(load_config(json.loads(Path(args[0]).read_text())))


if __name__ == "__main__":
    main()
