"""config.json of a new draft head for a given target config (what a trainer saves next to the weights)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from speculators.draft_heads.layers import family_of


def head_config(
    kind: str,
    target_config: dict[str, Any],
    *,
    num_mtp_layers: int = 1,
    draft_vocab_size: Optional[int] = None,
    aux_layer_ids: Optional[Sequence[int]] = None,
) -> dict[str, Any]:
    """The config.json of a `kind` ('eagle', 'eagle3', 'mtp') head for the target whose config is given.

    EAGLE: the target's config with `num_hidden_layers: 1` and architectures `Eagle<Family>ForCausalLM`.
    EAGLE-3: the target's geometry, architectures `LlamaForCausalLMEagle3` (a Llama midlayer, as the public
    heads), `draft_vocab_size` (default: the full vocabulary) and `eagle_aux_hidden_state_layer_ids`
    (default `(2, L // 2, L - 3)` when the target has at least 4 layers). MTP: the target's config with
    `num_nextn_predict_layers`.
    """
    arch = (target_config.get("architectures") or [""])[0]
    family = family_of(arch)
    if family is None:
        raise ValueError(f"target architecture {arch!r} is not of a supported family (Llama, Mistral, Qwen2, Qwen3)")
    cfg = {k: v for k, v in target_config.items() if k not in ("num_nextn_predict_layers",)}
    if kind == "eagle":
        return {**cfg, "architectures": [f"Eagle{family}ForCausalLM"], "num_hidden_layers": 1}
    if kind == "eagle3":
        n = int(target_config["num_hidden_layers"])
        ids = list(aux_layer_ids) if aux_layer_ids is not None else [2, n // 2, n - 3]
        return {
            **cfg,
            "architectures": ["LlamaForCausalLMEagle3"],
            "num_hidden_layers": 1,
            "target_num_hidden_layers": n,
            "draft_vocab_size": draft_vocab_size or cfg["vocab_size"],
            "eagle_aux_hidden_state_layer_ids": ids,
        }
    if kind == "mtp":
        return {**cfg, "num_nextn_predict_layers": num_mtp_layers}
    raise ValueError(f"unknown draft head kind '{kind}' (eagle, eagle3, mtp)")
