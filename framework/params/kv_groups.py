"""KV-cache groups: how a model mixing full-attention and sliding-window layers splits its KV memory.

Every layer of a group reads the same block table; a request holds one block list per group. Full groups keep
every block; a window group gives back the blocks its window no longer reads. One pool of block ids serves every
group: physical tensor `t` holds, at block `b`, the K/V of the one layer of `b`'s current group whose
`layer_tensor` is `t`. So a block id costs `num_tensors` layers of KV, whichever group holds it, and groups hold
at most `num_tensors` layers each (docs/sliding-window.md#kv-memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class KVGroupLayout:
    """Which group and which physical KV tensor each layer uses. Group 0 is a full-attention group."""

    layer_group: tuple[int, ...]  # per layer: its KV group
    layer_tensor: tuple[int, ...]  # per layer: the physical KV tensor it reads and writes
    group_windows: tuple[int, ...]  # per group: its layers' window in keys (0: full attention, keeps every block)
    num_tensors: int  # physical KV tensors (layers per group at most)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)


def kv_group_layout(layer_windows: Sequence[int]) -> Optional[KVGroupLayout]:
    """The groups of a model whose layer `i` attends through a window of `layer_windows[i]` keys (0: full), or
    None when its layers are all full or all windowed (one group: nothing to gain, or every layer frees).

    Layers of one kind (one window size, or full) are cut in order into groups of `S` = the smaller of the number
    of full layers and the number of window layers, so the groups of the more common kind are as large as the
    rarer kind's whole count (gpt-oss: 12 full and 12 window layers, two groups of 12; Gemma 3: five window
    layers to one full, groups of the full layers' count). Full groups come first.
    """
    full = [i for i, w in enumerate(layer_windows) if w <= 0]
    windowed = [i for i, w in enumerate(layer_windows) if w > 0]
    if not full or not windowed:
        return None
    size = min(len(full), len(windowed))
    kinds: dict[int, list[int]] = {0: full}
    for i in windowed:
        kinds.setdefault(int(layer_windows[i]), []).append(i)
    layer_group = [0] * len(layer_windows)
    layer_tensor = [0] * len(layer_windows)
    windows: list[int] = []
    for window, layers in kinds.items():
        for start in range(0, len(layers), size):
            for tensor, layer in enumerate(layers[start : start + size]):
                layer_group[layer], layer_tensor[layer] = len(windows), tensor
            windows.append(window)
    return KVGroupLayout(tuple(layer_group), tuple(layer_tensor), tuple(windows), size)
