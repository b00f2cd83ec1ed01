"""Where the engine client drops one HTTP request's engine items: a list and at most one waiting future.

An `asyncio.Queue` costs a deque, a getter future per `get` and several method calls per item; under full load
the engine client puts 256 items per engine step and every stream takes its items once per step, so that
overhead is paid 256 times a step. The inbox keeps only what a single consumer needs: `put_nowait` appends and
wakes the consumer if it waits, `take` hands over everything that came since its last call.
"""

from __future__ import annotations

import asyncio
from typing import Generic, Optional, Protocol, TypeVar

T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)


class ItemSink(Protocol[T_contra]):
    """What the engine client puts a request's items into (an `asyncio.Queue` is one too)."""

    def put_nowait(self, item: T_contra) -> None: ...


class StreamInbox(Generic[T]):
    """Items from the engine client for one consumer task (not thread-safe: the event loop's thread only)."""

    def __init__(self) -> None:
        self._items: list[T] = []
        self._waiter: Optional[asyncio.Future[None]] = None

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    def take_nowait(self) -> list[T]:
        """Every item that came since the last take (possibly none)."""
        items, self._items = self._items, []
        return items

    async def take(self, timeout_s: Optional[float] = None) -> list[T]:
        """Every item that came since the last take, waiting for one if there is none; [] after `timeout_s`."""
        if not self._items:
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                if timeout_s is None:
                    await waiter
                else:
                    await asyncio.wait_for(waiter, timeout_s)
            except asyncio.TimeoutError:
                pass
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        return self.take_nowait()
