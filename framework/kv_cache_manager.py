"""The paged KV cache's block pool: which physical blocks each request holds."""

from __future__ import annotations

from collections import deque


class KVCacheManager:
    """A free list of KV blocks and, per request id, the list of blocks it holds (in position order).

    Block ids here are indices into the physical KV cache tensors; token position `p` of a request lives in
    block `blocks[p // block_size]`, offset `p % block_size` (its *KV slot* is `block * block_size + offset`).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return sum(len(b) for b in self._blocks.values())

    def blocks_of(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks a request needs so that `num_tokens` positions have a KV slot."""
        have = len(self._blocks.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request to cover `num_tokens` positions; the new block ids, or None if too few are free."""
        held = self._blocks.get(request_id)
        if held is not None and num_tokens <= len(held) * self.block_size:
            return []  # the common decode step: the next token fits in the last block
        need = self.blocks_needed(request_id, num_tokens)
        if need > len(self._free):
            return None
        new = [self._free.popleft() for _ in range(need)]
        self._blocks.setdefault(request_id, []).extend(new)
        return new

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool (finish, abort, preemption)."""
        self._free.extend(self._blocks.pop(request_id, ()))

    def holders(self) -> set[str]:
        """Ids of the requests that hold at least one block."""
        return {request_id for request_id, blocks in self._blocks.items() if blocks}

    def check_conservation(self) -> None:
        """Raise `AssertionError` unless every block is either free or held by exactly one request."""
        held = [b for blocks in self._blocks.values() for b in blocks]
        if len(self._free) + len(held) != self.num_blocks or set(self._free) | set(held) != set(range(self.num_blocks)):
            raise AssertionError(
                f"KV block pool leak: {len(self._free)} free + {len(held)} in use != {self.num_blocks} total "
                f"(or a block is both free and held, or held twice)"
            )
