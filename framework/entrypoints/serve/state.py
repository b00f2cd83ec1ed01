"""What every endpoint of the server reads: `ServerState`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from framework.config.schema import Mrv2Config
from framework.entrypoints.chat_template import ChatTemplate
from framework.entrypoints.harmony.chat import HarmonyChat
from framework.entrypoints.serve.client_interface import ServingClient
from framework.entrypoints.serve.errors import ApiError
from framework.entrypoints.serve.lora import ServedLoras
from framework.entrypoints.serve.metrics import ServerMetrics
from framework.params.sampling_params import InvalidRequestError

VERSION = "0.1.0"


@dataclass
class ServerState:
    """What every endpoint reads: the config, the engine client, the tokenizer, the chat template, metrics."""

    config: Mrv2Config
    model_name: str
    client: ServingClient
    tokenizer: Any
    metrics: ServerMetrics
    chat_template: Optional[ChatTemplate]
    chat_template_error: Optional[str] = None  # why chat is refused when there is no template
    loras: ServedLoras = field(default_factory=ServedLoras)  # LoRA adapters served by name (serve/lora.py)
    harmony: Optional[HarmonyChat] = None  # the harmony chat format, where this model chats in it
    harmony_error: Optional[str] = None  # why chat is refused when the model chats in harmony and it cannot load

    @property
    def max_model_len(self) -> int:
        assert self.client.info is not None
        return self.client.info.max_model_len

    @property
    def vocab_size(self) -> int:
        assert self.client.info is not None
        return self.client.info.vocab_size

    @property
    def max_logprobs(self) -> int:
        assert self.client.info is not None
        return self.client.info.max_logprobs

    def check_capacity(self, num_requests: int) -> None:
        """503 with Retry-After when the engine is dead or the queue beyond the running requests is full."""
        if self.client.dead is not None:
            raise ApiError(503, f"the engine is not running: {self.client.dead}")
        limit = self.config.scheduler.max_num_seqs + self.config.serve.max_queued_requests
        if self.client.num_in_flight + num_requests > limit:
            raise ApiError(
                503,
                f"the server is at capacity ({self.client.num_in_flight} requests in flight, "
                f"serve.max_queued_requests={self.config.serve.max_queued_requests} beyond "
                f"scheduler.max_num_seqs={self.config.scheduler.max_num_seqs}); retry later",
                headers={"Retry-After": "1"},
            )

    def harmony_for(self, template_override: Optional[str]) -> Optional[HarmonyChat]:
        """The harmony format a chat request is rendered in (None: the chat template; a request's own template
        wins); a 400 naming why when this model chats in harmony and it could not be loaded."""
        if template_override is not None:
            return None
        if self.harmony_error is not None:
            raise ApiError.invalid(self.harmony_error, "messages")
        return self.harmony

    def template(self, override: Optional[str]) -> ChatTemplate:
        if override is not None:
            try:
                return ChatTemplate(override)
            except InvalidRequestError as err:
                raise ApiError.invalid(str(err), "chat_template") from None
        if self.chat_template is None:
            raise ApiError.invalid(self.chat_template_error or "this model has no chat template", "messages")
        return self.chat_template
