"""From config.json's `quantization_config` (or compressed-tensors' `compression_config`) to a method per layer.

`quant_scheme(hf_config, online)` reads the config before any weight is read: a format mrv2 does not read
(NVFP4, GGUF, bitsandbytes, 8-bit GPTQ, ...) is refused there, naming it and the formats that are read.
The formats are a registry keyed by `quant_method` (`QUANT_FORMATS`); each entry parses its config into a
`QuantScheme`, which picks the method of each linear layer by its name (layers a checkpoint keeps in 16 bits,
`modules_to_not_convert` / `ignore`, get None).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from framework.config.registry import Registry
from framework.layers.quantization.base import QuantizationError, QuantMethod
from framework.layers.quantization.fp8 import Fp8LinearMethod, OnlineFp8Method
from framework.layers.quantization.int4 import Int4Method
from framework.layers.quantization.moe import Mxfp4Method

SUPPORTED = (
    "'fp8' (HF block FP8: float8_e4m3fn weights, weight_block_size [128, 128], weight_scale_inv), "
    "'compressed-tensors' format 'float-quantized' (8-bit float weights, per-channel, per-tensor or block scales) "
    "and format 'pack-quantized' (symmetric 4-bit int weights, W4A16), 'gptq' (4-bit, v1 checkpoints), "
    "'awq' (4-bit, GEMM packing), 'mxfp4' (gpt-oss's experts), and model.quantization=fp8 (online FP8 of a "
    "16-bit checkpoint)"
)


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's quantization: `targets` [(matches layer name, method)], first match wins; layers `ignored`
    (or matching no target) stay in the model dtype. `format` names it in logs and errors. A format made for some
    architectures only names them in `architectures` (empty: any that supports quantization)."""

    format: str
    targets: list[tuple[Callable[[str], bool], QuantMethod]] = field(default_factory=list)
    ignored: Callable[[str], bool] = lambda _prefix: False
    architectures: tuple[str, ...] = ()

    def method_for(self, prefix: str) -> Optional[QuantMethod]:
        """The method of linear layer `prefix` (e.g. `model.layers.0.self_attn.q_proj`), None: not quantized."""
        if self.ignored(prefix):
            return None
        return next((method for matches, method in self.targets if matches(prefix)), None)


def _every_layer(_prefix: str) -> bool:
    return True


QUANT_FORMATS: Registry[Callable[[dict[str, Any]], QuantScheme]] = Registry(
    "quantization format", "mrv2.quantization_formats"
)


def _refuse(what: str) -> QuantizationError:
    return QuantizationError(f"quantization format {what} is not supported; mrv2 reads {SUPPORTED}")


def _describe(quant: dict[str, Any]) -> str:
    """How an unsupported config is named: its quant_method plus the detail that tells its variant."""
    method = str(quant.get("quant_method") or quant.get("format") or "unnamed")
    detail = [f"{quant['bits']}-bit"] if "bits" in quant else []
    for key in ("quant_algo", "format", "fmt"):
        if quant.get(key) and str(quant[key]) != method:
            detail.append(f"{key} {quant[key]}")
    return f"'{method}'" + (f" ({', '.join(detail)})" if detail else "")


def quant_scheme(hf_config: dict[str, Any], online: Optional[str] = None) -> Optional[QuantScheme]:
    """The checkpoint's `QuantScheme` (None: a 16-bit checkpoint and no online quantization), or
    `QuantizationError` naming what is refused. `online` is `model.quantization` ("fp8" or None)."""
    quant = hf_config.get("quantization_config") or hf_config.get("compression_config")
    if online is not None and online != "fp8":
        raise QuantizationError(f"model.quantization={online} is not supported; online quantization offers fp8")
    if quant and online:
        raise QuantizationError(
            f"model.quantization={online} quantizes a 16-bit checkpoint, but config.json declares a quantized one "
            f"(quant_method {_describe(quant) if isinstance(quant, dict) else repr(quant)}): leave it unset"
        )
    if online:
        return QuantScheme("online-fp8", [(_every_layer, OnlineFp8Method())])
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise QuantizationError(f"config.json's quantization_config is not an object: {quant!r}")
    method = str(quant.get("quant_method") or "").lower()
    if not method and "config_groups" in quant:  # an older compressed-tensors `compression_config`
        method = "compressed-tensors"
    if method not in QUANT_FORMATS:
        raise _refuse(_describe(quant))
    return QUANT_FORMATS.get(method)(quant)


def _names_matcher(names: list[str], substring: bool) -> Callable[[str], bool]:
    """Layer-name test for a list of names: `re:` entries are regular expressions (compressed-tensors), the others
    exact names or `.`-separated suffixes, or (HF's `modules_to_not_convert`, `substring`) parts of the name."""
    patterns = [re.compile(n[3:]) for n in names if n.startswith("re:")]
    plain = [n for n in names if not n.startswith("re:")]

    def matches(prefix: str) -> bool:
        if any(p.match(prefix) for p in patterns):
            return True
        if substring:
            return any(n in prefix for n in plain)
        return any(prefix == n or prefix.endswith("." + n) for n in plain)

    return matches


def _hf_fp8(quant: dict[str, Any]) -> QuantScheme:
    """HF's `quant_method: fp8` (Qwen3-*-FP8, DeepSeek-V3): block-scaled e4m3 weights, `weight_scale_inv`."""
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _refuse(f"'fp8' without a [n, k] weight_block_size (got {block!r})")
    if block[1] % 16:
        raise _refuse(f"'fp8' with weight_block_size {block} (k must be a multiple of 16)")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise _refuse(f"'fp8' (fmt {quant['fmt']})")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(f"'fp8' (activation_scheme {quant['activation_scheme']})")
    keep = list(quant.get("modules_to_not_convert") or [])
    method = Fp8LinearMethod("fp8-block", "weight_scale_inv", (block[0], block[1]), activation="group")
    return QuantScheme("fp8", [(_every_layer, method)], _names_matcher(keep, substring=True))


def _ct_int4(what: str, weights: dict[str, Any]) -> QuantMethod:
    """A compressed-tensors `pack-quantized` group: symmetric 4-bit int weights, group or channel scales."""
    if weights.get("type") != "int" or weights.get("num_bits") != 4:
        raise _refuse(f"{what} ({weights.get('num_bits')}-bit {weights.get('type')} packed weights)")
    if not weights.get("symmetric", True) or weights.get("actorder") == "group":
        raise _refuse(f"{what} (asymmetric or group act-order 4-bit weights)")
    strategy = weights.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse(f"{what} (4-bit weight strategy {strategy!r})")
    return Int4Method("ct", int(weights.get("group_size") or -1) if strategy == "group" else -1)


def _ct_method(group_name: str, scheme: dict[str, Any], fmt: str) -> QuantMethod:
    """One compressed-tensors config group's method (8-bit float weights, or packed 4-bit ints)."""
    weights = scheme.get("weights") or {}
    what = f"'compressed-tensors' group '{group_name}'"
    if fmt == "pack-quantized":
        return _ct_int4(what, weights)
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise _refuse(f"{what} ({weights.get('num_bits')}-bit {weights.get('type')} weights)")
    if weights.get("dynamic") or not weights.get("symmetric", True):
        raise _refuse(f"{what} (dynamic or asymmetric weight scales)")
    strategy = weights.get("strategy")
    inputs = scheme.get("input_activations") or {}
    static_inputs = bool(inputs) and not inputs.get("dynamic", False)
    if strategy == "channel":
        return Fp8LinearMethod("fp8-channel", "weight_scale", (1, None), static_inputs)
    if strategy == "tensor":
        return Fp8LinearMethod("fp8-tensor", "weight_scale", (None, None), static_inputs)
    if strategy == "block":
        block = weights.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and block[1] % 16 == 0):
            raise _refuse(f"{what} (block_structure {block!r})")
        return Fp8LinearMethod("fp8-block", "weight_scale", (int(block[0]), int(block[1])), static_inputs, "group")
    raise _refuse(f"{what} (weight strategy {strategy!r})")


def _compressed_tensors(quant: dict[str, Any]) -> QuantScheme:
    """llm-compressor's compressed-tensors, format `float-quantized` (FP8_DYNAMIC, FP8, FP8_BLOCK schemes)."""
    if quant.get("kv_cache_scheme"):
        raise _refuse("'compressed-tensors' with a kv_cache_scheme (checkpoint KV-cache scales)")
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _refuse("'compressed-tensors' without config_groups")
    targets = []
    for group_name, scheme in groups.items():
        fmt = scheme.get("format") or quant.get("format")
        if fmt not in ("float-quantized", "pack-quantized"):
            raise _refuse(f"'compressed-tensors' (format {fmt})")
        names = [t for t in scheme.get("targets") or [] if t != "Linear"]
        matches = _every_layer if "Linear" in (scheme.get("targets") or []) else _names_matcher(names, False)
        targets.append((matches, _ct_method(group_name, scheme, fmt)))
    return QuantScheme("compressed-tensors", targets, _names_matcher(list(quant.get("ignore") or []), False))


def _gptq(quant: dict[str, Any]) -> QuantScheme:
    """AutoGPTQ / GPTQModel checkpoints (v1 format): 4 bits, any group size, symmetric or not, act-order."""
    if quant.get("bits") != 4:
        raise _refuse(_describe(quant))
    if quant.get("checkpoint_format", "gptq") != "gptq" or quant.get("lm_head"):
        raise _refuse(
            f"{_describe(quant)} (checkpoint_format {quant.get('checkpoint_format')}, or a quantized lm_head)"
        )
    method = Int4Method("gptq", int(quant.get("group_size", 128)), bool(quant.get("sym", True)))
    return QuantScheme(
        "gptq", [(_every_layer, method)], _names_matcher(quant.get("modules_to_not_convert") or [], True)
    )


def _awq(quant: dict[str, Any]) -> QuantScheme:
    """AutoAWQ checkpoints with GEMM packing: 4 bits, zero points, group size from the config."""
    if quant.get("bits", quant.get("w_bit")) != 4 or str(quant.get("version", "gemm")).lower() != "gemm":
        raise _refuse(f"{_describe(quant)} (version {quant.get('version')})")
    if not quant.get("zero_point", True):
        raise _refuse(f"{_describe(quant)} without zero points")
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    method = Int4Method("awq", group, sym=False, zero_offset=0)
    keep = _names_matcher(quant.get("modules_to_not_convert") or [], True)
    return QuantScheme("awq", [(_every_layer, method)], keep)


def _experts_only(prefix: str) -> bool:
    return prefix.endswith(".experts.0.gate_proj")  # the name quantize_linears asks for a stacked-experts module


def _mxfp4(quant: dict[str, Any]) -> QuantScheme:
    """HF's `quant_method: mxfp4` (gpt-oss's releases): MXFP4 experts, every other layer in 16 bits."""
    keep = [str(name) for name in quant.get("modules_to_not_convert") or []]

    def ignored(prefix: str) -> bool:
        return any(fnmatch.fnmatch(prefix, name) or fnmatch.fnmatch(prefix, f"{name}.*") for name in keep)

    return QuantScheme("mxfp4", [(_experts_only, Mxfp4Method())], ignored, ("GptOssForCausalLM",))


QUANT_FORMATS.register("gptq", _gptq, source="mrv2")
QUANT_FORMATS.register("mxfp4", _mxfp4, source="mrv2")
QUANT_FORMATS.register("awq", _awq, source="mrv2")
QUANT_FORMATS.register("fp8", _hf_fp8, source="mrv2")
QUANT_FORMATS.register("compressed-tensors", _compressed_tensors, source="mrv2")
