"""The error a request that cannot be served raises (kept apart so that plain parameter types can share it)."""


class InvalidRequestError(ValueError):
    """A request that cannot be served; the message names the offending field and its allowed range."""


class RequestStepError(RuntimeError):
    """An error raised inside a step by the host-side code of one request (a per-slot owner taking it on, such
    as a custom logits processor's `add_request`): the engine ends that request alone with this message, and
    recomputes the others of the step (`framework.engine.failure`)."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(f"request '{request_id}': {type(cause).__name__}: {cause}")
        self.request_id = request_id


class SlotWriteError(RuntimeError):
    """A batched apply of staged per-slot writes failed on the values one slot staged (`StagedWrites`,
    `SlotLists`): the runner names the request holding `req_slot` in a `RequestStepError`."""

    def __init__(self, req_slot: int, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.req_slot = req_slot
        self.cause = cause
