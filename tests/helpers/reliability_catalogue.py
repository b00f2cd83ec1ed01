"""The catalogue of bad inputs: each case, how to trigger it, the error type and (a fragment of) its message.

`tests/engine/test_reliability.py` runs every case and checks that `docs/reliability.md` lists exactly these rows
(`markdown_table()`), so the page and the behaviour cannot drift apart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from framework import (
    LLM,
    ConfigError,
    load_config,
)
from framework.config.registry import MODEL_STATES, RegistryError
from framework.models import CheckpointError
from helpers.reliability_case import Case, tiny
from helpers.reliability_requests import REQUEST_CASES


def _checkpoint(ctx: Any, keep: tuple[str, ...], extra: Optional[dict[str, bytes]] = None) -> Path:
    """A copy of ctx.ckpt with only the files named in `keep`, plus `extra` files."""
    root = ctx.tmp
    for name in keep:
        (root / name).write_bytes((ctx.ckpt / name).read_bytes())
    for name, data in (extra or {}).items():
        (root / name).write_bytes(data)
    return root


def _not_a_model_state(ctx: Any) -> LLM:
    """`model.model_state` naming a registered object that is no ModelState (a plugin's wrong entry point)."""
    MODEL_STATES.register("not-a-state", "collections:deque")
    try:
        return tiny(model_state="not-a-state")
    finally:
        MODEL_STATES.unregister("not-a-state")


def _with_config(ctx: Any, **fields: Any) -> Path:
    """A copy of ctx.ckpt whose config.json has `fields` set."""
    root = _checkpoint(ctx, ("model.safetensors",))
    cfg = json.loads((ctx.ckpt / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**cfg, **fields}))
    return root


CASES = [
    # ---- config -----------------------------------------------------------------------------------------
    Case(
        "unknown-key",
        "config",
        "`scheduler.max_num_seq=4` (typo)",
        ConfigError,
        "scheduler.max_num_seq: unknown key (did you mean 'max_num_seqs'?)",
        lambda ctx: load_config({"scheduler": {"max_num_seq": 4}}),
    ),
    Case(
        "wrong-type",
        "config",
        "`cache.block_size=big`",
        ConfigError,
        "cache.block_size: Input should be a valid integer",
        lambda ctx: load_config({"cache": {"block_size": "big"}}),
    ),
    Case(
        "out-of-range",
        "config",
        "`scheduler.max_num_seqs=0`",
        ConfigError,
        "scheduler.max_num_seqs: Input should be greater than or equal to 1 (got 0)",
        lambda ctx: load_config({"scheduler": {"max_num_seqs": 0}}),
    ),
    Case(
        "unknown-choice",
        "config",
        "`runner.kind=v3`",
        ConfigError,
        "runner.kind: Input should be 'auto', 'v2' or 'v1'",
        lambda ctx: load_config({"runner": {"kind": "v3"}}),
    ),
    Case(
        "unknown-logits-processor",
        "config",
        "`sampler.logits_processors=[nope]`",
        ConfigError,
        "sampler.logits_processors: unknown logits processor 'nope'",
        lambda ctx: tiny(logits_processors=["nope"]),
    ),
    Case(
        "unknown-speculator",
        "config",
        "`speculator.method=medusa` (not registered)",
        ConfigError,
        "speculator.method=medusa: unknown speculator",
        lambda ctx: tiny(
            runner="v2",
            config=load_config({"device": "cpu", "speculator": {"method": "medusa", "num_speculative_tokens": 2}}),
        ),
    ),
    Case(
        "unknown-preset",
        "config",
        '`LLM("nope")`: neither a directory nor a preset',
        ConfigError,
        "unknown model.preset 'nope'; embedded presets:",
        lambda ctx: LLM("nope", device="cpu"),
    ),
    Case(
        "model-state-not-a-class",
        "config",
        "`model.model_state` names a registered object that is not a ModelState",
        RegistryError,
        "model state 'not-a-state' is <class 'collections.deque'>, not a ModelState subclass",
        _not_a_model_state,
    ),
    Case(
        "max-model-len-too-long",
        "config",
        "`model.max_model_len` above the model's limit",
        ConfigError,
        "model.max_model_len=4096 exceeds the model's max_position_embeddings=1024",
        lambda ctx: tiny(max_model_len=4096),
    ),
    Case(
        "unknown-llm-argument",
        "config",
        "`LLM(max_num_seq=4)`",
        TypeError,
        "LLM() got an unknown argument 'max_num_seq'",
        lambda ctx: tiny(max_num_seq=4),
    ),
    # ---- start-up -----------------------------------------------------------------------------------------
    Case(
        "kv-cache-too-small",
        "start-up",
        "`cache.num_blocks=8` (a request needs 64 blocks)",
        ConfigError,
        "too small for one request of max_model_len=1024",
        lambda ctx: tiny(num_kv_blocks=8),
    ),
    Case(
        "kv-cache-too-small-config",
        "start-up",
        "`num_blocks x block_size < max_model_len` in the config",
        ConfigError,
        "fewer than one request of model.max_model_len=512",
        lambda ctx: load_config({"model": {"max_model_len": 512}, "cache": {"num_blocks": 4}}),
    ),
    # ---- checkpoint ---------------------------------------------------------------------------------------
    Case(
        "missing-directory",
        "checkpoint",
        "a model path that does not exist",
        CheckpointError,
        "does not exist",
        lambda ctx: LLM(
            str(ctx.tmp / "nowhere"),
            device="cpu",
            config=load_config({"device": "cpu", "model": {"path": str(ctx.tmp / "nowhere"), "preset": None}}),
        ),
    ),
    Case(
        "missing-config",
        "checkpoint",
        "directory without config.json",
        CheckpointError,
        "has no config.json",
        lambda ctx: LLM(str(_checkpoint(ctx, ("model.safetensors",))), device="cpu"),
    ),
    Case(
        "missing-weights-file",
        "checkpoint",
        "config.json but no *.safetensors",
        CheckpointError,
        "has no *.safetensors weights",
        lambda ctx: LLM(str(_checkpoint(ctx, ("config.json",))), device="cpu"),
    ),
    Case(
        "missing-shard",
        "checkpoint",
        "index lists a shard that is absent",
        CheckpointError,
        "is missing shards listed in model.safetensors.index.json",
        lambda ctx: LLM(
            str(
                _checkpoint(
                    ctx,
                    ("config.json",),
                    {
                        "model.safetensors.index.json": json.dumps(
                            {"weight_map": {"lm_head.weight": "model-00002.safetensors"}}
                        ).encode()
                    },
                )
            ),
            device="cpu",
        ),
    ),
    Case(
        "corrupt-safetensors",
        "checkpoint",
        "a truncated / garbage *.safetensors",
        CheckpointError,
        "is not a readable safetensors file",
        lambda ctx: LLM(
            str(_checkpoint(ctx, ("config.json",), {"model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!"})),
            device="cpu",
        ),
    ),
    Case(
        "pickle-only",
        "checkpoint",
        "only pytorch_model.bin (pickle)",
        CheckpointError,
        "only as pickle (pytorch_model.bin); mrv2 never unpickles",
        lambda ctx: LLM(str(_checkpoint(ctx, ("config.json",), {"pytorch_model.bin": b"not unpickled"})), device="cpu"),
    ),
    Case(
        "bad-config-json",
        "checkpoint",
        "config.json that is not JSON",
        CheckpointError,
        "is not valid JSON",
        lambda ctx: LLM(str(_checkpoint(ctx, ("model.safetensors",), {"config.json": b"{not json"})), device="cpu"),
    ),
    Case(
        "unsupported-architecture",
        "checkpoint",
        "`architectures: [GPT2LMHeadModel]`",
        CheckpointError,
        "architecture 'GPT2LMHeadModel' is not supported; registered:",
        lambda ctx: LLM(str(_with_config(ctx, architectures=["GPT2LMHeadModel"])), device="cpu"),
    ),
    Case(
        "quantized-checkpoint",
        "checkpoint",
        "config.json with a `quantization_config` mrv2 does not read (8-bit GPTQ)",
        CheckpointError,
        "quantization format 'gptq' (8-bit) is not supported; mrv2 reads 'fp8'",
        lambda ctx: LLM(str(_with_config(ctx, quantization_config={"quant_method": "gptq", "bits": 8})), device="cpu"),
    ),
] + REQUEST_CASES


def markdown_table() -> str:
    """The catalogue as the table in docs/reliability.md."""
    rows = ["| id | area | bad input | raises | message contains |", "|---|---|---|---|---|"]
    for case in CASES:
        error = f"`{case.error.__name__}`" if case.error is not None else "nothing"
        message = case.message.replace("|", "\\|")
        rows.append(f"| `{case.id}` | {case.area} | {case.bad_input} | {error} | `{message}` |")
    return "\n".join(rows)
