"""What the endpoints need of the engine side: `EngineClient` (one engine core) and `DataParallelClient` (N of
them) both have it."""

from __future__ import annotations

from typing import Literal, Optional, Protocol

from framework.entrypoints.serve.engine_client import RankState, StreamItem
from framework.entrypoints.serve.protocol import EngineReady, EngineStats
from framework.entrypoints.serve.stream_inbox import ItemSink
from framework.params.lora_request import LoRARequest
from framework.params.pooling_params import PoolingParams
from framework.params.sampling_params import SamplingParams


class ServingClient(Protocol):
    """The engine side of `mrv2 serve`, as the API server uses it."""

    @property
    def info(self) -> Optional[EngineReady]: ...

    @property
    def stats(self) -> Optional[EngineStats]: ...

    @property
    def dead(self) -> Optional[str]: ...

    @property
    def num_in_flight(self) -> int: ...

    def ranks(self) -> list[RankState]: ...

    async def start(self, timeout_s: float) -> EngineReady: ...

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        queue: ItemSink[StreamItem],
        sampling_params: Optional[SamplingParams] = None,
        pooling_params: Optional[PoolingParams] = None,
        lora: Optional[LoRARequest] = None,
    ) -> None: ...

    def abort(self, engine_ids: list[str]) -> None: ...

    def release(self, request_id: str) -> None: ...

    def fail_all(self, message: str, kind: Literal["dead", "shutdown"]) -> None: ...

    def begin_shutdown(self) -> None: ...

    async def close(self, timeout_s: float = 5.0) -> None: ...
