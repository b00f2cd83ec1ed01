"""Tensor-parallel building blocks: column/row-parallel linear layers, a vocabulary-parallel embedding and LM head.

Each layer keeps the HF parameter names (`weight`, `bias`) with this rank's part of the full tensor, and says
through `shard_dims` which dimension of which parameter is split, so the loader reads only this rank's slice of
the checkpoint. With `tp_size == 1` every layer is the plain one: same shapes, no communication.

- `ColumnParallelLinear`: output features split (q/k/v, gate/up); its output stays sharded. Where the output is a
  concatenation of sections each split over the ranks (Qwen3.5's `in_proj_qkv`: q, k, v heads), `sections` names
  them and a rank holds its block of every section, in order.
- `RowParallelLinear`: input features split (o_proj, down_proj); partial outputs are summed over the ranks
  (all-reduce), then the bias (kept whole on every rank) is added once.
- `VocabParallelEmbedding` / `ParallelLMHead`: vocabulary rows split in `ceil(vocab / tp)` blocks (the last one
  padded with zero rows); the embedding sums the ranks' lookups, the LM head all-gathers the logits.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn
from torch.nn import functional as F

from framework.layers.parallel.context import ParallelContext

SINGLE = ParallelContext()


class ShardSpec(NamedTuple):
    """This rank's part of a checkpoint tensor: block `rank` of `num_shards` equal blocks along `dim`; with
    `sections` (sizes in the layer's features) the dim is their concatenation, and the part is block `rank` of
    every section, concatenated. A tensor whose dim is shorter than the features (a scale per 128 rows, eight
    packed values per int32) has sections of the same proportions."""

    dim: int
    rank: int
    num_shards: int
    sections: tuple[int, ...] = ()


class StackedPart(NamedTuple):
    """Where one checkpoint tensor goes inside a stacked parameter (an MoE layer's experts): `param[index]`,
    which holds `shard` of the tensor (None: all of it); `param` is complete once `num_parts` parts arrived.
    With `source_shape` the tensor is read whole and viewed as that shape before `shard` is taken; with
    `rearrange` it is read whole and rearranged (e.g. gpt-oss's interleaved gate/up columns put in two halves)."""

    param: str
    index: tuple[int, ...]
    shard: Optional[ShardSpec]
    num_parts: int
    source_shape: Optional[tuple[int, ...]] = None
    rearrange: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what}={n} does not divide by parallel.tensor_parallel_size={parts}")
    return n // parts


class ColumnParallelLinear(nn.Linear):
    """y[..., this rank's out features] = x @ W_shard^T + b_shard; W split along its output dimension.

    `quant_method` (set by `framework.layers.quantization.quantize_linears`): the layer's weight is quantized and
    that method computes the product from the checkpoint's tensors."""

    quant_method: Any = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        ctx: ParallelContext = SINGLE,
        sections: tuple[int, ...] = (),
    ) -> None:
        super().__init__(in_features, _divide(out_features, ctx.tp_size, "output features"), bias=bias)
        self.shard_dims = {"weight": 0, "bias": 0}
        self.ctx = ctx
        if sections:
            if sum(sections) != out_features:
                raise ValueError(f"sections {sections} do not add up to the {out_features} output features")
            for size in sections:
                _divide(size, ctx.tp_size, "a section of the output features")
        self.output_sections = sections  # every split tensor of the layer (weight, bias, scales) splits by section

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return super().forward(x)


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x_shard @ W_shard^T, + b; W split along its input dimension, b whole (`quant_method`:
    as `ColumnParallelLinear`'s)."""

    quant_method: Any = None

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext = SINGLE) -> None:
        super().__init__(_divide(in_features, ctx.tp_size, "input features"), out_features, bias=bias)
        self.shard_dims = {"weight": 1}
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return super().forward(x) if self.quant_method is None else self.quant_method.apply(self, x, self.bias)
        partial = F.linear(x, self.weight) if self.quant_method is None else self.quant_method.apply(self, x, None)
        y = self.ctx.tp_all_reduce(partial)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose vocabulary rows are split over the tensor ranks; `weight` [ceil(V/tp), hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.vocab_size, self.ctx = vocab_size, ctx
        self.rows_per_rank = -(-vocab_size // ctx.tp_size)
        self.vocab_start = ctx.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))
        self.shard_dims = {"weight": 0}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.ctx.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.ctx.tp_all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits over the vocabulary rows of this rank, all-gathered: [L, hidden] -> [L, vocab] in the model dtype
    (rows strided when the vocabulary does not split evenly: the padding columns are sliced off, not copied)."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.vocab_size, self.ctx = vocab_size, ctx
        self.weight = nn.Parameter(torch.empty(-(-vocab_size // ctx.tp_size), hidden_size))
        self.shard_dims = {"weight": 0}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ctx.tp_all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[..., : self.vocab_size]


class MissingLayer(nn.Module):
    """Stands where a layer of another pipeline stage would be, so parameter names keep their layer index."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a layer of another pipeline stage was called")


def shard_parameters(
    module: nn.Module, ctx: ParallelContext, dims: dict[str, int], sections: tuple[int, ...] = ()
) -> None:
    """Mark parameters of a plain module (a depthwise conv, per-head vectors) as split over the tensor ranks:
    `dims` names the split dim of each, `sections` as `ColumnParallelLinear`'s. The module must already hold
    this rank's part (shapes divided by `ctx.tp_size`)."""
    module.shard_dims = dims  # type: ignore[assignment]
    module.ctx = ctx  # type: ignore[assignment]
    module.output_sections = sections  # type: ignore[assignment]


def shard_spec(model: nn.Module, param_name: str) -> Optional[ShardSpec]:
    """How `param_name` of `model` is split over the tensor ranks, or None when every rank holds it whole."""
    module_name, _, leaf = param_name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    dims = getattr(module, "shard_dims", None)
    ctx: Optional[ParallelContext] = getattr(module, "ctx", None)
    if not dims or leaf not in dims or ctx is None or ctx.tp_size == 1:
        return None
    return ShardSpec(dims[leaf], ctx.tp_rank, ctx.tp_size, tuple(getattr(module, "output_sections", ())))


def _section_bounds(spec: ShardSpec, full: int) -> list[tuple[int, int]]:
    """[start, stop) of this rank's block in each section of a dim of length `full` (sections scaled to it)."""
    total = sum(spec.sections)
    bounds, start = [], 0
    for size in spec.sections:
        length, rest = divmod(size * full, total)
        if rest or length % spec.num_shards:
            raise ValueError(
                f"a tensor of length {full} along dim {spec.dim} cannot be cut into the sections {spec.sections} "
                f"of its layer, {spec.num_shards} tensor-parallel blocks each (a scale or packed word would straddle "
                "two ranks)"
            )
        per_rank = length // spec.num_shards
        bounds.append((start + spec.rank * per_rank, start + (spec.rank + 1) * per_rank))
        start += length
    return bounds


def read_shard(source: Any, spec: Optional[ShardSpec]) -> torch.Tensor:
    """This rank's block of `source` (a safetensors slice from `get_slice`, or a tensor), zero-padded at the end
    (with `sections`: its block of each section, concatenated; a section that cannot be cut raises `ValueError`).

    Only the block is read: a safetensors slice reads just those bytes of the file.
    """
    if spec is None:
        return source[:] if not isinstance(source, torch.Tensor) else source
    shape = list(source.get_shape() if hasattr(source, "get_shape") else source.shape)
    full = shape[spec.dim]
    if spec.sections:
        lead, rest = (slice(None),) * spec.dim, (slice(None),) * (len(shape) - spec.dim - 1)
        parts = [source[(*lead, slice(a, b), *rest)] for a, b in _section_bounds(spec, full)]
        return torch.cat(parts, dim=spec.dim)
    per_rank = -(-full // spec.num_shards)
    start = min(spec.rank * per_rank, full)
    stop = min(start + per_rank, full)
    index = tuple(slice(start, stop) if d == spec.dim else slice(None) for d in range(len(shape)))
    block = source[index]
    if stop - start < per_rank:  # the last vocabulary block: pad with zero rows (their logits are cut off)
        pad = list(block.shape)
        pad[spec.dim] = per_rank - (stop - start)
        block = torch.cat([block, torch.zeros(pad, dtype=block.dtype)], dim=spec.dim)
    return block
