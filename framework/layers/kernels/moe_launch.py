"""Tile sizes of the fused MoE kernels: a measured table for the GPU when one is shipped, a rule of thumb otherwise.

A table is one JSON file per GPU model in `moe_configs/` (package data), written by
`benchmarks/moe/tune_moe_tiles.py` on that GPU:

    {"format": 1, "device_name": "NVIDIA H100 80GB HBM3",
     "shapes": [{"dtype": "bfloat16", "experts": 128, "n": 768, "k": 2048, "top_k": 8,
                 "tokens": {"1": {"gate_up": TILES, "down": TILES}, "2": ..., "8192": ...}}]}

with `TILES = {"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}`; `n` is the
intermediate size of one expert on this rank (gate/up's output width, down's reduction) and `k` the hidden size.
A launch of M tokens takes the entry of the smallest tabled token count at or above M (the largest one past the
end): a tile set measured for more rows per expert than the launch has may waste padding but never runs out of
programs, the other way round it may. Shapes, dtypes or GPUs without a table keep `heuristic_launch_config`.

`launch_configs` lists every tile set a shape can take (`fused_moe.warm_moe_launches` compiles them all at the
shape's first launch). The lookup is host-side and cheap (each file parsed once per process) and never touches the
GPU, so a CUDA graph captured at a batch size keeps the tiles chosen at its capture.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

CONFIG_DIR = Path(__file__).with_name("moe_configs")
TABLE_FORMAT = 1
TILE_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
SHAPE_FIELDS = ("dtype", "experts", "n", "k", "top_k")


class MoeLaunchConfig(NamedTuple):
    """Tile sizes of one launch (no autotuning on the step path). `down`: the down kernel's own tiles when they
    differ from gate/up's (same `block_m`: both kernels walk the same expert-sorted row blocks); None: the same."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    down: Optional["MoeLaunchConfig"] = None

    def down_config(self) -> "MoeLaunchConfig":
        """The down kernel's tiles (`down` or these)."""
        return self if self.down is None else self.down

    def narrow_block_k(self, narrow: Callable[[int], int]) -> "MoeLaunchConfig":
        """Both kernels' `block_k` passed through `narrow` (quantized weights keep a tile inside one input group)."""
        down = None if self.down is None else self.down._replace(block_k=narrow(self.down.block_k))
        return self._replace(block_k=narrow(self.block_k), down=down)


class MoeShape(NamedTuple):
    """What a tuned table is keyed by besides the token count."""

    device_name: str  # torch.cuda.get_device_name()
    dtype: str  # the expert weights': "bfloat16", "float16", "float32" (quantized: "fp8", "int4", "mxfp4")
    experts: int  # E
    n: int  # I, one expert's intermediate size on this rank
    k: int  # H, the hidden size
    top_k: int


TableKey = tuple[str, int, int, int, int]  # MoeShape without the device: (dtype, experts, n, k, top_k)
DeviceTable = dict[TableKey, dict[int, MoeLaunchConfig]]  # shape -> token count -> tiles


# `heuristic_launch_config`'s tiles: up to 8 rows per expert, up to 64, more.
HEURISTIC_CONFIGS = (
    MoeLaunchConfig(16, 32, 128, 4, 4),
    MoeLaunchConfig(32, 64, 64, 4, 4),
    MoeLaunchConfig(64, 128, 64, 8, 3),
)


def heuristic_launch_config(num_rows: int, num_experts: int) -> MoeLaunchConfig:
    """Tiles for `num_rows = M * K` (token, choice) rows over `num_experts` experts when no table has the shape.

    Decode (few rows per expert) is bandwidth-bound: 16-row blocks waste the least padding, and 32-column tiles
    give a batch of one token (8 experts) 8 x 24 programs to spread the weight reads over the SMs. Prefill has
    hundreds of rows per expert: 64-row blocks keep Hopper's tensor cores fed.
    """
    decode, middle, prefill = HEURISTIC_CONFIGS
    rows_per_expert = num_rows / max(num_experts, 1)
    if rows_per_expert <= 8:
        return decode
    if rows_per_expert <= 64:
        return middle
    return prefill


def moe_launch_config(
    num_rows: int, num_experts: int, shape: Optional[MoeShape] = None, folder: Optional[Path] = None
) -> MoeLaunchConfig:
    """Tiles for `num_rows = M * K` rows over `num_experts` experts: the tuned table's entry for `shape` (module
    docstring) when `folder` (default `CONFIG_DIR`) has one, else `heuristic_launch_config`."""
    if shape is not None and num_rows > 0:
        tuned = _tuned_launch_config(shape, -(-num_rows // shape.top_k), CONFIG_DIR if folder is None else folder)
        if tuned is not None:
            return tuned
    return heuristic_launch_config(num_rows, num_experts)


def tuned_launch_config(shape: MoeShape, tokens: int, folder: Optional[Path] = None) -> Optional[MoeLaunchConfig]:
    """The table entry for the smallest token count >= `tokens` (the largest past the end); None without one."""
    path = (CONFIG_DIR if folder is None else folder) / table_file_name(shape.device_name)
    table = load_device_table(str(path), shape.device_name)
    by_tokens = table.get(shape[1:])
    if not by_tokens:
        return None
    at_or_above = [count for count in by_tokens if count >= tokens]
    return by_tokens[min(at_or_above) if at_or_above else max(by_tokens)]


def launch_configs(shape: MoeShape, folder: Optional[Path] = None) -> list[MoeLaunchConfig]:
    """Every tile set `moe_launch_config` can return for `shape` at some token count, each once, in table order:
    the table's entries when `folder` (default `CONFIG_DIR`) has the shape, else the heuristic's."""
    path = (CONFIG_DIR if folder is None else folder) / table_file_name(shape.device_name)
    by_tokens = load_device_table(str(path), shape.device_name).get(shape[1:])
    tiles = [by_tokens[count] for count in sorted(by_tokens)] if by_tokens else HEURISTIC_CONFIGS
    return list(dict.fromkeys(tiles))


# Once per (shape, token count): the layers of a model ask the same question every step.
_tuned_launch_config = functools.lru_cache(maxsize=16384)(tuned_launch_config)


def table_file_name(device_name: str) -> str:
    """`NVIDIA H100 80GB HBM3` -> `NVIDIA_H100_80GB_HBM3.json`."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json"


@functools.lru_cache(maxsize=None)
def load_device_table(path: str, device_name: str) -> DeviceTable:
    """The parsed table at `path` (empty when there is none); `ValueError` naming the file if it is malformed or
    tabulates another GPU. Cached: read once per process."""
    file = Path(path)
    if not file.is_file():
        return {}
    try:
        document = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"MoE tile table {file}: not valid JSON ({exc})") from exc
    return parse_device_table(document, str(file), device_name)


def parse_device_table(document: object, source: str, device_name: str) -> DeviceTable:
    """The table of a parsed JSON document (module docstring); `ValueError` naming `source` on any defect."""

    def fail(problem: str) -> ValueError:
        return ValueError(f"MoE tile table {source}: {problem}")

    if not isinstance(document, dict) or document.get("format") != TABLE_FORMAT:
        raise fail(f'expected an object with "format": {TABLE_FORMAT}')
    if document.get("device_name") != device_name:
        raise fail(f"tabulates {document.get('device_name')!r}, looked up for {device_name!r}")
    shapes = document.get("shapes")
    if not isinstance(shapes, list):
        raise fail('"shapes" must be a list')
    table: DeviceTable = {}
    for number, entry in enumerate(shapes):
        if not isinstance(entry, dict) or not isinstance(entry.get("tokens"), dict) or not entry["tokens"]:
            raise fail(f'shapes[{number}] must be an object with a non-empty "tokens" object')
        key = _shape_key(entry, lambda problem: fail(f"shapes[{number}]: {problem}"))
        if key in table:
            raise fail(f"shapes[{number}] repeats the shape {dict(zip(SHAPE_FIELDS, key))}")
        table[key] = {}
        for count, tiles in entry["tokens"].items():
            where = f"shapes[{number}].tokens[{count!r}]"
            if not str(count).isdigit() or int(count) < 1:
                raise fail(f"{where}: token counts must be positive integers")
            table[key][int(count)] = _launch_config(tiles, lambda problem: fail(f"{where}: {problem}"))
    return table


def _shape_key(entry: dict, fail: Callable[[str], ValueError]) -> TableKey:
    if not isinstance(entry.get("dtype"), str):
        raise fail('"dtype" must be a string')
    sizes = [entry.get(name) for name in SHAPE_FIELDS[1:]]
    if not all(isinstance(size, int) and size > 0 for size in sizes):
        raise fail(f"{', '.join(SHAPE_FIELDS[1:])} must be positive integers")
    return (entry["dtype"], *sizes)  # type: ignore[return-value]


def _launch_config(tiles: object, fail: Callable[[str], ValueError]) -> MoeLaunchConfig:
    if not isinstance(tiles, dict) or set(tiles) - {"measured"} != {"gate_up", "down"}:
        raise fail('expected {"gate_up": tiles, "down": tiles}')
    gate_up = _tiles(tiles["gate_up"], lambda problem: fail(f"gate_up: {problem}"))
    down = _tiles(tiles["down"], lambda problem: fail(f"down: {problem}"))
    if gate_up.block_m != down.block_m:
        raise fail(f"gate_up and down must share block_m (the row blocks), got {gate_up.block_m} and {down.block_m}")
    return gate_up if down == gate_up else gate_up._replace(down=down)


def _tiles(tiles: object, fail: Callable[[str], ValueError]) -> MoeLaunchConfig:
    if not isinstance(tiles, dict) or set(tiles) != set(TILE_FIELDS):
        raise fail(f"expected exactly the keys {', '.join(TILE_FIELDS)}")
    values = [tiles[name] for name in TILE_FIELDS]
    if not all(isinstance(value, int) and value > 0 for value in values):
        raise fail(f"{', '.join(TILE_FIELDS)} must be positive integers")
    cfg = MoeLaunchConfig(*values)
    if min(cfg.block_m, cfg.block_n, cfg.block_k) < 16 or any(v & (v - 1) for v in values[:4]):
        raise fail("block sizes must be powers of two >= 16 and num_warps a power of two (tl.dot's tiles)")
    return cfg


def tiles_json(cfg: MoeLaunchConfig) -> dict[str, int]:
    """One kernel's tiles as a table writes them."""
    return dict(zip(TILE_FIELDS, cfg[:5]))


def device_table_json(device_name: str, table: DeviceTable) -> dict:
    """The JSON document of `table` (the inverse of `parse_device_table`), shapes and token counts in order."""
    shapes = []
    for key in sorted(table):
        tokens = {
            str(count): {"gate_up": tiles_json(cfg), "down": tiles_json(cfg.down_config())}
            for count, cfg in sorted(table[key].items())
        }
        shapes.append({**dict(zip(SHAPE_FIELDS, key)), "tokens": tokens})
    return {"format": TABLE_FORMAT, "device_name": device_name, "shapes": shapes}


@functools.lru_cache(maxsize=None)
def _cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def moe_shape(device: torch.device, dtype: str, experts: int, n: int, k: int, top_k: int) -> Optional[MoeShape]:
    """The table key of a launch on `device` (None off CUDA: the interpreter keeps the heuristic's tiles)."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    return MoeShape(_cuda_device_name(index), dtype, experts, n, k, top_k)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bfloat16` (a table's `dtype`)."""
    return str(dtype).removeprefix("torch.")
