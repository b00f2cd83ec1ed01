"""The hybrid recurrent state under its Mamba-era name, with the Mamba slabs by name (Jamba, tests, benchmarks)."""

from __future__ import annotations

import torch

from model_states.hybrid_recurrent import HybridRecurrentModelState


class MambaHybridModelState(HybridRecurrentModelState):
    """`HybridRecurrentModelState` for a model whose first recurrent kind is Mamba: `conv_state` and `ssm_state`
    are that kind's slabs, `[L, S+1, d_inner, d_conv-1]` and `[L, S+1, d_inner, d_state]` float32."""

    name = "mamba_hybrid"

    @property
    def conv_state(self) -> torch.Tensor:
        return self.slabs[0]

    @property
    def ssm_state(self) -> torch.Tensor:
        return self.slabs[1]
