"""PEFT LoRA adapters read from a directory: `adapter_config.json` + `adapter_model.safetensors` (never a pickle).

An adapter is checked against the model's projections before any of it is used: every tensor must name a
projection the model has (q/k/v/o of attention, gate/up/down of a dense MLP; also PEFT's merged `qkv_proj` /
`gate_up_proj`, split here into their parts), with the base's input and output sizes, and a rank of at most
`lora.max_rank`. MoE experts, DoRA, bias training, `modules_to_save` and embedding adapters are refused by name.
The scaling (`lora_alpha / r`, or `lora_alpha / sqrt(r)` with rsLoRA) is folded into B.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from framework.params.lora_request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
MERGED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(.+)\.lora_([AB])\.weight$")


class LoraAdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the problem."""


class ProjectionShape(NamedTuple):
    """The base projection an adapter module updates: (input features, output features)."""

    in_features: int
    out_features: int


class LoraTargets(NamedTuple):
    """What an adapter may update: `shapes[(layer, part)]`, and the layers whose MLP is a mixture of experts."""

    shapes: dict[tuple[int, str], ProjectionShape]
    moe_layers: frozenset[int]


@dataclass
class LoraAdapter:
    """One adapter's weights on the CPU: per (layer, part) `A [r, in]` and `B [out, r]` (scaling folded in)."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _read_config(name: str, path: Path, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) from `adapter_config.json`, refusing what is not plain LoRA."""
    if not (path / CONFIG_FILE).is_file():
        raise LoraAdapterError(f"LoRA adapter '{name}': no {CONFIG_FILE} in {path}")
    if not (path / WEIGHTS_FILE).is_file():
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        extra = f" (found {', '.join(pickles)}: pickled weights are never loaded)" if pickles else ""
        raise LoraAdapterError(f"LoRA adapter '{name}': no {WEIGHTS_FILE} in {path}{extra}")
    cfg: dict[str, Any] = json.loads((path / CONFIG_FILE).read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"LoRA adapter '{name}': peft_type {cfg.get('peft_type')!r} is not LORA")
    refused = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save",
        "rank_pattern": "rank_pattern",
        "alpha_pattern": "alpha_pattern",
        "layers_to_transform": "layers_to_transform",
    }
    for key, what in refused.items():
        if cfg.get(key):
            raise LoraAdapterError(f"LoRA adapter '{name}': {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraAdapterError(f"LoRA adapter '{name}': bias={cfg['bias']!r} is not supported (only 'none')")
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    if not 1 <= rank <= max_rank:
        raise LoraAdapterError(f"LoRA adapter '{name}': rank {rank} exceeds lora.max_rank={max_rank}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, scaling


def _parts(name: str, layer: int, group: str, module: str, targets: LoraTargets) -> tuple[str, ...]:
    """The base projections a checkpoint module updates (two or three for a merged one)."""
    if layer in targets.moe_layers and group == "mlp":
        raise LoraAdapterError(
            f"LoRA adapter '{name}': module 'layers.{layer}.mlp.{module}' is a mixture-of-experts layer: LoRA on "
            "MoE experts is not supported"
        )
    parts = MERGED_PARTS.get(module, (module,))
    if any((layer, part) not in targets.shapes for part in parts):
        raise LoraAdapterError(f"LoRA adapter '{name}': target module 'layers.{layer}.{group}.{module}' does not exist")
    return parts


def read_adapter(request: LoRARequest, targets: LoraTargets, max_rank: int, load: bool = True) -> LoraAdapter:
    """Check the adapter at `request.path` against `targets` and (with `load`) read its weights, float32 on the
    CPU; with `load=False` only shapes are read (a quick check) and `weights` stays empty."""
    name, path = request.name, Path(request.path)
    rank, scaling = _read_config(name, path, max_rank)
    pairs: dict[tuple[int, str, str], dict[str, Any]] = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            match = _KEY.match(key)
            if match is None:
                raise LoraAdapterError(f"LoRA adapter '{name}': tensor '{key}' is not a supported LoRA weight")
            layer, group, module, which = int(match[1]), match[2], match[3], match[4]
            tensor = f.get_tensor(key) if load else f.get_slice(key)
            pairs.setdefault((layer, group, module), {})[which] = tensor
    adapter = LoraAdapter(name, rank, {})
    for (layer, group, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraAdapterError(f"LoRA adapter '{name}': 'layers.{layer}.{group}.{module}' lacks lora_A or lora_B")
        parts = _parts(name, layer, group, module, targets)
        a_shape = list(ab["A"].shape if load else ab["A"].get_shape())
        b_shape = list(ab["B"].shape if load else ab["B"].get_shape())
        shapes = [targets.shapes[(layer, p)] for p in parts]
        want_a, want_b = [rank, shapes[0].in_features], [sum(s.out_features for s in shapes), rank]
        if a_shape != want_a or b_shape != want_b:
            raise LoraAdapterError(
                f"LoRA adapter '{name}': 'layers.{layer}.{group}.{module}' has A {a_shape} and B {b_shape}, the base "
                f"model needs A {want_a} and B {want_b}"
            )
        if load:
            a, b = ab["A"].float(), ab["B"].float() * scaling
            for part, rows in zip(parts, b.split([s.out_features for s in shapes])):
                adapter.weights[(layer, part)] = (a, rows)
    if not pairs:
        raise LoraAdapterError(f"LoRA adapter '{name}': {WEIGHTS_FILE} holds no LoRA weights")
    return adapter
