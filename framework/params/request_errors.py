"""The error a request that cannot be served raises (kept apart so that plain parameter types can share it)."""


class InvalidRequestError(ValueError):
    """A request that cannot be served; the message names the offending field and its allowed range."""
