"""Build a model from an HF directory (safetensors only) or from an embedded preset."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from framework.config.registry import MODELS
from framework.layers.parallel.context import ParallelContext
from framework.layers.parallel.linear import SINGLE, StackedPart, read_shard, shard_spec
from framework.layers.quantization import (
    QuantizationError,
    QuantScheme,
    is_quantized,
    quant_scheme,
    quantize_linears,
)
from framework.models.hf_config import text_model_config
from framework.models.interface import Model
from framework.models.materialise import build_materialised
from framework.models.random_weights import normal_weights

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some exporters save; recomputed from config
# Last name parts of tensors only quantized checkpoints carry (FP8 / INT8 scales, GPTQ / AWQ packing).
QUANTIZATION_TENSOR_NAMES = (
    "k_scale",
    "v_scale",
    "kv_scale",
    "weight_scale",
    "weight_scale_inv",
    "input_scale",
    "output_scale",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
)
UNQUANTIZED = (
    "config.json declares no quantization for this layer, so mrv2 reads float32 / float16 / bfloat16 there; "
    "`cache.kv_cache_dtype=fp8` stores the KV cache in FP8 without checkpoint scales"
)
QUANT_TENSOR_UNEXPECTED = (
    "the quantization config gives this layer no such tensor (a layer it keeps in 16 bits, or a scale of a "
    "scheme mrv2 does not read, such as checkpoint KV-cache scales)"
)


class CheckpointError(ValueError):
    """A checkpoint directory mrv2 refuses or cannot read; the message names the file and the problem."""


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json of a local HF directory."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"model directory '{root}' does not exist")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"'{root}' has no config.json")
    try:
        return text_model_config(json.loads(cfg_file.read_text()))  # a multimodal checkpoint's text model
    except json.JSONDecodeError as err:
        raise CheckpointError(f"'{cfg_file}' is not valid JSON: {err}") from None


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's safetensors shards; pickle-only checkpoints are refused, never unpickled."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise CheckpointError(f"'{root}' is missing shards listed in {index.name}: {', '.join(missing)}")
        return [root / n for n in names]
    files = sorted(root.glob("*.safetensors"))
    if files:
        return files
    pickles = [p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise CheckpointError(
            f"'{root}' offers weights only as pickle ({', '.join(sorted(pickles))}); mrv2 never unpickles "
            "checkpoints: convert them to safetensors"
        )
    raise CheckpointError(f"'{root}' has no *.safetensors weights")


def checkpoint_quantization(hf_config: dict[str, Any], online: Optional[str] = None) -> Optional[QuantScheme]:
    """The checkpoint's quantization scheme (config.json's `quantization_config`, or compressed-tensors'
    `compression_config`; `online`: `model.quantization`), None for a 16-bit model; a format mrv2 does not read
    raises `CheckpointError` naming it and the supported ones, before any weight is read."""
    try:
        return quant_scheme(hf_config, online)
    except QuantizationError as err:
        raise CheckpointError(f"config.json: {err}") from None


def refuse_quantized_tensor(where: str, name: str, dtype: torch.dtype, expected: Optional[torch.dtype] = None) -> None:
    """A tensor of a quantized checkpoint whose config did not say so: named, never cast silently. `expected`: the
    dtype of the parameter it fills, when that is a quantized one (FP8, packed int32): the tensor must have it."""
    if expected is not None and (expected.itemsize == 1 or not expected.is_floating_point):
        if dtype != expected:
            raise CheckpointError(
                f"{where}: tensor '{name}' is {str(dtype).removeprefix('torch.')}, the checkpoint's quantization "
                f"format stores it as {str(expected).removeprefix('torch.')}"
            )
        return
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return
    raise CheckpointError(f"{where}: tensor '{name}' is {str(dtype).removeprefix('torch.')}: {UNQUANTIZED}")


def build_model(
    hf_config: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    ctx: ParallelContext = SINGLE,
    quantization: Optional[str] = None,
) -> Model:
    """Instantiate the registered model class for the config's architecture (weights uninitialised).

    The weights are allocated once, in `dtype` on `device` (`build_materialised`): peak memory ~1x the weights.
    Under parallelism (`ctx`) the model holds this rank's part only; a class must say `supports_parallel`.
    A quantized checkpoint (or `quantization`, `model.quantization`'s online format) gives each quantized linear
    layer its method and the checkpoint's tensor layout (`framework.layers.quantization`); formats and model
    classes without support are refused here, before any weight is read.
    """
    scheme = checkpoint_quantization(hf_config, quantization)
    archs = hf_config.get("architectures") or []
    if not archs:
        raise CheckpointError("config.json has no 'architectures' entry")
    if archs[0] not in MODELS:
        raise CheckpointError(f"architecture '{archs[0]}' is not supported; registered: {', '.join(MODELS.names())}")
    cls = MODELS.get(archs[0])
    if not (isinstance(cls, type) and issubclass(cls, Model)):
        raise CheckpointError(f"architecture '{archs[0]}' is registered as {cls!r}, not a framework Model subclass")
    if ctx.world_size > 1 and not cls.supports_parallel:
        raise CheckpointError(f"architecture '{archs[0]}' does not support tensor or pipeline parallelism")
    if scheme is not None and not cls.supports_quantization:
        raise CheckpointError(
            f"config.json: architecture '{archs[0]}' does not support quantized weights ({scheme.format}) yet; "
            "dense Llama / Mistral / Qwen2 / Qwen3 decoders, Gemma 3 / Gemma 4, Qwen3-MoE / Qwen2-MoE / Mixtral, "
            "gpt-oss and Qwen3.5 / Qwen3-Next do"
        )
    if scheme is not None and scheme.architectures and archs[0] not in scheme.architectures:
        raise CheckpointError(
            f"config.json: quantization format '{scheme.format}' is read for {', '.join(scheme.architectures)} "
            f"only, not for architecture '{archs[0]}'"
        )

    def construct() -> Model:
        model = cls.from_hf_config(hf_config, ctx) if ctx.world_size > 1 else cls.from_hf_config(hf_config)
        if scheme is not None:
            try:
                quantize_linears(model, scheme)
            except QuantizationError as err:
                raise CheckpointError(f"config.json: {err}") from None
            model.quant_scheme = scheme
        return model

    return build_materialised(construct, dtype, device)


def _targets(model: Model) -> tuple[dict[str, nn.Parameter], dict[str, list[str]]]:
    """(parameters by name, checkpoint tensor name -> the parameter names it fills).

    Tied weights appear under both names; `model.checkpoint_aliases` (parameter -> checkpoint name) lets a
    parameter load from another tensor, e.g. a tied LM head on a pipeline stage without the embedding.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    aliases = model.checkpoint_aliases
    targets: dict[str, list[str]] = {}
    for name in params:
        targets.setdefault(name, []).append(name)
        if name in aliases:
            targets.setdefault(aliases[name], []).append(name)
    return params, targets


def _copy_into(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    names: list[str],
    source: Any,
    where: str,
    ckpt_name: str,
    filled_by: Optional[dict[int, str]] = None,
) -> None:
    """Copy this rank's shard of `source` (safetensors slice or tensor) into each parameter of `names`.

    `filled_by` (id of a parameter -> the checkpoint tensor that filled it) catches a tied parameter (the
    embedding and LM head of `tie_word_embeddings`) that the checkpoint fills twice with different values:
    copying the second over the first would silently change the other use of the weight."""
    for name in names:
        try:
            tensor = read_shard(source, shard_spec(model, name))
        except ValueError as err:  # sections that a scale grid or packed words cannot follow
            raise CheckpointError(f"{where}: '{ckpt_name}': {err}") from None
        refuse_quantized_tensor(where, ckpt_name, tensor.dtype, params[name].dtype)
        if tensor.numel() == 1 and params[name].numel() == 1:  # a per-tensor scale, stored as [] or [1]
            tensor = tensor.reshape(params[name].shape)
        if tensor.shape != params[name].shape:
            raise CheckpointError(
                f"{where}: '{ckpt_name}' has shape {tuple(tensor.shape)}, model expects "
                f"{tuple(params[name].shape)}" + ("" if tensor is source else " (this rank's part)")
            )
        first = None if filled_by is None else filled_by.setdefault(id(params[name]), ckpt_name)
        if first is not None and first != ckpt_name:
            if not torch.equal(params[name].detach(), tensor.to(params[name].device, params[name].dtype)):
                raise CheckpointError(
                    f"{where}: '{ckpt_name}' and '{first}' fill the same tied parameter but differ: config.json "
                    "says tie_word_embeddings=true while the checkpoint holds a separate LM head; set "
                    "tie_word_embeddings to false in config.json to use it (transformers 5 does not tie them)"
                )
            continue
        with torch.no_grad():
            params[name].copy_(tensor)


def _copy_part(param: nn.Parameter, part: StackedPart, source: Any, where: str, ckpt_name: str) -> None:
    """Copy this rank's shard of `source` into `param[part.index]` (one expert's projection, or all experts)."""
    if part.source_shape is not None:
        whole = source[:]
        if whole.numel() != math.prod(part.source_shape):
            raise CheckpointError(
                f"{where}: '{ckpt_name}' has shape {tuple(whole.shape)}, the model expects "
                f"{math.prod(part.source_shape)} elements (viewed as {part.source_shape})"
            )
        source = whole.reshape(part.source_shape)
    read_as = ""
    if part.rearrange is not None:
        whole = source[:]
        read_as = f" (stored as {tuple(whole.shape)})"
        try:
            source = part.rearrange(whole)
        except RuntimeError as err:  # a view that does not fit: the tensor's shape is wrong
            raise CheckpointError(f"{where}: '{ckpt_name}' has shape {tuple(whole.shape)}, which does not fit: {err}")
    tensor = read_shard(source, part.shard)

    refuse_quantized_tensor(where, ckpt_name, tensor.dtype, param.dtype)
    dest = param.data[part.index]
    if tensor.numel() == 1 and dest.numel() == 1:  # a per-tensor scale, stored as [] or [1]
        tensor = tensor.reshape(dest.shape)
    if tensor.shape != dest.shape:
        raise CheckpointError(
            f"{where}: '{ckpt_name}' has shape {tuple(tensor.shape)}{read_as}, the model expects "
            f"{tuple(dest.shape)}" + ("" if part.shard is None else " (this rank's part)")
        )
    with torch.no_grad():
        dest.copy_(tensor)


def mtp_tensor_prefixes(hf_config: dict[str, Any]) -> tuple[str, ...]:
    """`model.layers.{L + i}.` of a checkpoint with `num_nextn_predict_layers` MTP layers (the MTP speculator's)."""
    first, n = int(hf_config.get("num_hidden_layers") or 0), int(hf_config.get("num_nextn_predict_layers") or 0)
    return tuple(f"model.layers.{first + i}." for i in range(n))


def load_safetensors_weights(model: Model, path: str | Path, skip_prefixes: tuple[str, ...] = ()) -> None:
    """Copy every tensor of the checkpoint into the parameter of the same name; names are checked both ways.

    Under parallelism each rank reads only its slices (`safe_open(...).get_slice`) and skips the tensors of other
    pipeline stages (`model.owns_checkpoint_tensor`) without reading them. Tensors under `skip_prefixes` belong
    to someone else (the MTP layers of a checkpoint) and are not read.
    """
    from safetensors import SafetensorError, safe_open

    params, targets = _targets(model)
    quantized = any(is_quantized(m) for m in model.modules())
    loaded: set[str] = set()
    filled_by: dict[int, str] = {}  # tied parameters: which checkpoint tensor filled them first
    parts_loaded: dict[str, set[tuple[int, ...]]] = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if skip_prefixes and name.startswith(skip_prefixes):
                        continue
                    part = model.stacked_tensor_part(name)  # a tensor going elsewhere than its name (MoE experts)
                    if part is not None:
                        _copy_part(params[part.param], part, f.get_slice(name), file.name, name)
                        parts_loaded.setdefault(part.param, set()).add(part.index)
                        if len(parts_loaded[part.param]) == part.num_parts:
                            loaded.add(part.param)
                        continue
                    if name not in targets:
                        if name.endswith(IGNORED_TENSOR_SUFFIXES) or not model.owns_checkpoint_tensor(name):
                            continue
                        if name.rsplit(".", 1)[-1] in QUANTIZATION_TENSOR_NAMES:
                            raise CheckpointError(
                                f"{file.name}: tensor '{name}' is a quantization tensor: "
                                + (QUANT_TENSOR_UNEXPECTED if quantized else UNQUANTIZED)
                            )
                        raise CheckpointError(
                            f"{file.name}: tensor '{name}' matches no parameter of the model; the checkpoint "
                            "does not fit its config.json"
                        )
                    _copy_into(model, params, targets[name], f.get_slice(name), file.name, name, filled_by)
                    loaded.update(targets[name])
        except SafetensorError as err:
            raise CheckpointError(f"'{file}' is not a readable safetensors file: {err}") from None
    loaded_params = [params[n] for n in loaded]
    missing = sorted(n for n, p in params.items() if n not in loaded and not any(p is q for q in loaded_params))
    if missing:
        raise CheckpointError(
            f"checkpoint '{path}' lacks weights: {', '.join(missing[:5])}"
            + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        )


def _random_packed(model: nn.Module, name: str, noise: torch.Tensor, std: float) -> torch.Tensor:
    """Random values of packed (integer) parameter `name`, from float32 `noise`: its module's quantization method
    says how (`random_packed`), else `CheckpointError`."""
    owner, _, tensor = name.rpartition(".")
    method = getattr(model.get_submodule(owner), "quant_method", None)
    if method is None or not hasattr(method, "random_packed"):
        raise CheckpointError(f"random weights: '{name}' is packed and its layout has no random weights")
    return method.random_packed(tensor, noise, std)  # type: ignore[no-any-return]


def _whole_model(model: Model) -> nn.Module:
    """The single-process model of a parallel rank's `model`, on the meta device: its class rebuilt whole from its
    `config` and quantized as `build_model` quantized the rank (`quant_scheme`), so it has the quantized tensors a
    rank holds slices of (MXFP4 blocks, INT4 words) in the single-process parameter order."""
    with torch.device("meta"):
        full = type(model)(model.config)  # type: ignore[call-arg]
        if model.quant_scheme is not None:
            quantize_linears(full, model.quant_scheme)
    return full


def _listed(model: nn.Module, name: str, listing: str) -> bool:
    """Whether parameter `name` is one its module lists in `listing`: `random_ones` names a multiplicative scale
    (Gemma 4's `layer_scalar`) that random weights set to 1, as a norm weight, rather than shrinking the stream by
    `std`; `random_zeros` names a zero-centred norm's weight (the norm scales by `1 + weight`), set to 0 so that
    it, too, scales by 1."""
    owner, _, leaf = name.rpartition(".")
    return leaf in getattr(model.get_submodule(owner) if owner else model, listing, ())


def init_random_weights(model: Model, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights: N(0, std**2) for matrices and embeddings, 1 for norms (and the scales a
    module lists in `random_ones`), 0 for biases and zero-centred norms (a module's `random_zeros`): every norm
    scales by 1.

    `std` is the config's `initializer_range` (HF's name; 0.02 when absent). Parameter k (in `named_parameters`
    order of the whole model) is `normal_weights(shape, std, seed, k)`: the
    same numbers on every device (a `torch.Generator` would draw different ones on the CPU and on CUDA), so a
    CPU run and a GPU run of a preset compare the same model. A tensor- or pipeline-parallel rank draws the
    whole parameter and keeps its slice of exactly the single-process weights (`_whole_model`).
    """
    device = next(model.parameters()).device
    params, targets = _targets(model)
    full = _whole_model(model) if model.ctx.world_size > 1 else model
    with torch.no_grad():
        for stream, (name, param) in enumerate(full.named_parameters()):
            if _listed(full, name, "random_zeros") or name.endswith(".bias"):
                values = torch.zeros(param.shape, device=device)
            elif name.endswith("norm.weight") or _listed(full, name, "random_ones"):
                values = torch.ones(param.shape, device=device)
            else:
                values = normal_weights(param.shape, std, seed, stream, device)
                if not param.dtype.is_floating_point:  # a quantized layer's packed tensor: its method draws it
                    values = _random_packed(full, name, values, std)
            if name in targets:
                _copy_into(model, params, targets[name], values, "random weights", name)
