"""Load draft heads from local HF-style directories (config.json + safetensors), strictly.

Every tensor of the checkpoint must land in a parameter or buffer of the head (MTP read from the target's
own checkpoint skips the target's tensors), every parameter must be filled, shapes must agree, and the
head's geometry must fit the target (hidden size, vocabulary, layer count for MTP). Violations raise
`CheckpointError` naming the tensor or the config field. Pickle checkpoints are refused, never read.

A config.json that declares quantized weights (`quantization_config`: a Qwen3.5 / Qwen3-Next FP8 or INT4
checkpoint, whose MTP head sits beside the target's tensors) gives the head's linear layers and experts the same
methods as the target's (`framework.layers.quantization`), when the head class says `supports_quantization`;
other heads are refused by name rather than read as 16-bit weights without their scales. A tensor whose dtype is
not the one its parameter's format stores is refused by name.

Online quantization of the target (`quantization`, `model.quantization=fp8`) reaches the head too: a head class
that `supports_quantization` reads its 16-bit tensors, then its linear layers and experts become FP8 with one
scale per output channel, as the target's did; a head that reads 16-bit weights only stays in 16 bits.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional

import torch

from framework.layers.parallel.linear import StackedPart
from framework.layers.quantization import QuantizationError, QuantScheme, finish_quantization, quantize_linears
from framework.models.loader import (
    CheckpointError,
    checkpoint_quantization,
    read_hf_config,
    refuse_quantized_tensor,
    safetensors_files,
)
from framework.models.materialise import build_materialised
from speculators.draft_heads.base import DraftHead
from speculators.draft_heads.eagle import EagleHead
from speculators.draft_heads.eagle3 import Eagle3Head
from speculators.draft_heads.mtp import MTPHead, num_mtp_layers
from speculators.draft_heads.qwen3_next_mtp import Qwen3NextMTPHead, is_qwen3_next_family, num_qwen_mtp_layers

HEAD_CLASSES: dict[str, type[DraftHead]] = {"eagle": EagleHead, "eagle3": Eagle3Head, "mtp": MTPHead}
_TARGET_TENSOR = re.compile(r"^(model\.(embed_tokens|norm)\.|lm_head\.|model\.layers\.(\d+)\.)")


def _read_tensors(path: Path) -> dict[str, tuple[Path, Any]]:
    """name -> (file, shape) of every tensor in the directory's safetensors files (no data read)."""
    from safetensors import SafetensorError, safe_open

    found: dict[str, tuple[Path, Any]] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    found[name] = (file, f.get_slice(name).get_shape())
        except SafetensorError as err:
            raise CheckpointError(f"'{file}' is not a readable safetensors file: {err}") from None
    return found


def _is_target_tensor(name: str, num_target_layers: int) -> bool:
    m = _TARGET_TENSOR.match(name)
    return bool(m) and (m.group(3) is None or int(m.group(3)) < num_target_layers)


def head_class(kind: str, config: dict[str, Any]) -> type[DraftHead]:
    """The head class of `kind` for a checkpoint config: MTP of a Qwen3.5 / Qwen3-Next target is its `mtp.*` head."""
    if kind == "mtp" and is_qwen3_next_family(config):
        return Qwen3NextMTPHead
    return HEAD_CLASSES[kind]


def _check_geometry(kind: str, config: dict[str, Any], target: Optional[dict[str, Any]], path: Path) -> None:
    for key in ("hidden_size", "vocab_size"):
        if key not in config:
            raise CheckpointError(f"{kind} head '{path}': config.json lacks '{key}'")
        if target is not None and config[key] != target.get(key):
            raise CheckpointError(
                f"{kind} head '{path}': {key}={config[key]} does not match the target model's {key}={target.get(key)}"
            )
    if kind == "mtp" and is_qwen3_next_family(config):
        if num_qwen_mtp_layers(config) < 1:
            raise CheckpointError(
                f"mtp head '{path}': config.json has no mtp_num_hidden_layers >= 1 (the checkpoint has no MTP head)"
            )
    elif kind == "mtp":
        if num_mtp_layers(config) < 1:
            raise CheckpointError(f"mtp head '{path}': config.json has no num_nextn_predict_layers >= 1")
        if target is not None and config.get("num_hidden_layers") != target.get("num_hidden_layers"):
            raise CheckpointError(
                f"mtp head '{path}': num_hidden_layers={config.get('num_hidden_layers')} does not "
                f"match the target's {target.get('num_hidden_layers')} (MTP keys are "
                "model.layers.{num_hidden_layers + i})"
            )


def load_draft_head(
    path: str | Path,
    kind: str,
    target_config: Optional[dict[str, Any]] = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quantization: Optional[str] = None,
) -> DraftHead:
    """The `kind` ('eagle', 'eagle3', 'mtp') head saved in directory `path`, checked against `target_config`;
    `quantization`: the target's online format (`model.quantization`), None for the checkpoint's own.

    Checked on the meta device first (no storage), then built with each weight allocated once in `dtype` on
    `device` (`build_materialised`) and filled from the checkpoint one tensor at a time."""
    if kind not in HEAD_CLASSES:
        raise CheckpointError(f"unknown draft head kind '{kind}'; known: {', '.join(HEAD_CLASSES)}")
    root = Path(path)
    config = read_hf_config(root)
    _check_geometry(kind, config, target_config, root)
    tensors = _read_tensors(root)
    cls = head_class(kind, config)
    if cls is Qwen3NextMTPHead:  # the head is the checkpoint's mtp.* tensors; everything else is the target's
        tensors = {n: v for n, v in tensors.items() if n.startswith("mtp.")}
    elif kind == "mtp":  # the target's own checkpoint may hold the MTP layers: skip the target's tensors
        tensors = {n: v for n, v in tensors.items() if not _is_target_tensor(n, int(config["num_hidden_layers"]))}
    names = set(tensors)
    scheme = _head_quantization(cls, kind, config, root, quantization)

    def construct() -> DraftHead:
        head: DraftHead = cls.from_tensor_names(config, names)  # type: ignore[attr-defined]
        if scheme is not None:
            quantize_linears(head, scheme)
        return head

    try:
        with torch.device("meta"):  # shapes only: the checks below allocate nothing
            meta_head = construct()
            expected = meta_head.state_dict()
    except (ValueError, KeyError) as err:  # QuantizationError included
        raise CheckpointError(f"{kind} head '{root}': {err}") from None
    parts = _stacked_parts(meta_head, tensors, expected, f"{kind} head '{root}'")
    direct = {n: v for n, v in tensors.items() if n not in parts}
    unmatched = sorted(set(direct) - set(expected))
    if unmatched:
        hint = (
            " (an EAGLE-3 checkpoint? use speculator.method=eagle3)"
            if any(n.startswith("midlayer.") for n in unmatched)
            else ""
        )
        raise CheckpointError(
            f"{kind} head '{root}': tensors matching no parameter of the head: "
            f"{', '.join(unmatched[:8])}{' ...' if len(unmatched) > 8 else ''}{hint}"
        )
    optional = {"d2t", "t2d"} if kind == "eagle3" else set()
    missing = sorted(set(expected) - set(direct) - _complete(parts) - optional)
    if missing:
        raise CheckpointError(
            f"{kind} head '{root}': checkpoint lacks tensors: {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}"
        )
    for name, (file, shape) in direct.items():
        if tuple(shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{kind} head '{root}': {file.name}: '{name}' has shape {tuple(shape)}, the head "
                f"expects {tuple(expected[name].shape)} from config.json"
            )
    # Each weight allocated once, in `dtype` on `device`, then filled from the checkpoint: peak ~1x the head.
    head = build_materialised(construct, dtype, torch.device(device))
    _copy_tensors(head, tensors, parts, f"{kind} head '{root}'")
    try:  # quantized layers: scale checks, the kernels' layouts
        finish_quantization(head)
    except QuantizationError as err:
        raise CheckpointError(f"{kind} head '{root}': {err}") from None
    if isinstance(head, Eagle3Head):
        _check_draft_vocab(head, tensors, root)
    return head.eval()


def _head_quantization(
    cls: type[DraftHead], kind: str, config: dict[str, Any], root: Path, online: Optional[str]
) -> Optional[QuantScheme]:
    """The quantization config.json declares for the head's weights, or the target's `online` one (None: 16-bit);
    a declared one is refused for a head class that reads 16-bit weights only, an online one leaves it 16-bit."""
    scheme = checkpoint_quantization(config, online)
    if scheme is not None and not cls.supports_quantization and online is not None:
        return None  # its 16-bit weights serve as they are; the target's layers alone became FP8
    if scheme is not None and not cls.supports_quantization:
        raise CheckpointError(
            f"{kind} head '{root}': config.json declares quantized weights ({scheme.format}), which the "
            f"{cls.__name__} head does not read (only 16-bit weights)"
        )
    return scheme


def _stacked_parts(
    head: DraftHead, tensors: dict[str, tuple[Path, Any]], expected: dict[str, torch.Tensor], where: str
) -> dict[str, StackedPart]:
    """name -> its place in a stacked parameter (a MoE block's experts), for the checkpoint tensors that fill
    part of one; each tensor's shape is checked against its slice."""
    parts: dict[str, StackedPart] = {}
    for name, (file, shape) in tensors.items():
        part = head.stacked_tensor_part(name)
        if part is None or part.param not in expected:
            continue  # a plain tensor, or one matching no parameter (reported by the caller)
        want = tuple(expected[part.param][part.index].shape)
        viewed = tuple(shape) if part.source_shape is None else tuple(part.source_shape)
        fits = viewed == want and (
            part.source_shape is None
            or (math.prod(shape) == math.prod(viewed) and shape[0] == viewed[0] and shape[-1] == viewed[-1])
        )
        if not fits:
            raise CheckpointError(
                f"{where}: {file.name}: '{name}' has shape {tuple(shape)}, the head expects "
                f"{want if part.source_shape is None else viewed} from config.json"
            )
        parts[name] = part
    return parts


def _complete(parts: dict[str, StackedPart]) -> set[str]:
    """The stacked parameters whose every part is among `parts`."""
    seen: dict[str, set[tuple[int, ...]]] = {}
    needed: dict[str, int] = {}
    for part in parts.values():
        seen.setdefault(part.param, set()).add(part.index)
        needed[part.param] = part.num_parts
    return {param for param, indices in seen.items() if len(indices) == needed[param]}


def _copy_tensors(
    head: DraftHead,
    tensors: dict[str, tuple[Path, Any]],
    parts: Optional[dict[str, StackedPart]] = None,
    where: str = "draft head",
) -> None:
    """Fill the head's parameters from the checkpoint; `parts`: the tensors filling a slice of a stacked one. A
    quantized tensor (FP8, packed integers) fills only a parameter of its own dtype, never one cast from it."""
    from safetensors import safe_open

    parts = parts or {}
    state = head.state_dict(keep_vars=True)
    by_file: dict[Path, list[str]] = {}
    for name, (file, _) in tensors.items():
        by_file.setdefault(file, []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                for name in names:
                    tensor, part = f.get_tensor(name), parts.get(name)
                    dest = state[name if part is None else part.param]
                    refuse_quantized_tensor(f"{where}: {file.name}", name, tensor.dtype, dest.dtype)
                    if part is None:
                        dest.copy_(tensor)
                    else:  # one expert's projection, or every expert's viewed as the stacked shape
                        view = tensor if part.source_shape is None else tensor.reshape(part.source_shape)
                        state[part.param][part.index].copy_(view)


def _check_draft_vocab(head: Eagle3Head, tensors: dict[str, Any], root: Path) -> None:
    if "d2t" not in tensors:
        if head.draft_vocab_size != head.vocab_size:
            raise CheckpointError(
                f"eagle3 head '{root}': draft_vocab_size={head.draft_vocab_size} < vocab_size="
                f"{head.vocab_size} but the checkpoint has no 'd2t' draft-to-target id map"
            )
        return
    target_ids = torch.arange(head.draft_vocab_size, device=head.d2t.device) + head.d2t  # on the head's device
    if target_ids.min() < 0 or target_ids.max() >= head.vocab_size:
        raise CheckpointError(
            f"eagle3 head '{root}': 'd2t' maps draft ids outside the target vocabulary [0, {head.vocab_size})"
        )
    if "t2d" in tensors and (int(head.t2d.sum()) != head.draft_vocab_size or not bool(head.t2d[target_ids].all())):
        raise CheckpointError(f"eagle3 head '{root}': 't2d' does not mark exactly the target ids that 'd2t' maps to")
    if "t2d" not in tensors:
        head.t2d.zero_()
        head.t2d[target_ids] = True
