"""SteeringModelState: a per-slot steering token and scale, handed to the model as extra forward inputs."""

from __future__ import annotations

import torch

from framework.batch.staged_writes import StagedWrites
from model_states.default import DefaultModelState


class SteeringModelState(DefaultModelState):
    """Paged self-attention (as the default state), plus per request slot a steering token and a scale.

    A request asks for steering with `SamplingParams(extra_args={"steering": {"token_id": 7, "scale": 2.0}})`;
    the model adds `scale * embedding(token_id)` to every input embedding of that request. Requests without
    it get scale 0 and run exactly as with the default state.

    Decode CUDA graphs: `prepare_graph_inputs` builds the same two inputs from the graph's static idx_mapping,
    inside the graph, so decode steps replay captured graphs. Padding rows of a graph map to the extra slot
    `graph_dummy_slot` (scale 0), which no request owns.
    """

    name = "steering"

    def __init__(self, model, hf_config, max_num_reqs, device):
        super().__init__(model, hf_config, max_num_reqs, device)
        self.vocab_size = int(hf_config["vocab_size"])
        # [S+1] by req_slot; the last slot is the dummy of decode graphs' padding rows
        self.token_id = torch.zeros(max_num_reqs + 1, dtype=torch.int64, device=device)
        self.scale = torch.zeros(max_num_reqs + 1, dtype=torch.float32, device=device)
        self._staged = (StagedWrites(self.token_id), StagedWrites(self.scale))
        self.num_steered_requests = 0  # how many requests asked for steering (host counter, for tests)

    def add_request(self, req_slot, request):
        steering = (request.sampling_params.extra_args or {}).get("steering") or {}
        token_id, scale = steering.get("token_id", 0), float(steering.get("scale", 0.0))
        if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"extra_args['steering']['token_id'] must be a token id in [0, {self.vocab_size}), got {token_id!r}"
            )
        self.num_steered_requests += scale != 0.0
        # Every field of the slot is written, so a reused slot keeps nothing of its previous owner.
        self._staged[0].stage(req_slot, token_id)
        self._staged[1].stage(req_slot, scale)

    def apply_staged_writes(self):
        for staged in self._staged:
            staged.apply()

    def prepare_inputs(self, batch):
        return self._inputs(batch.idx_mapping, batch.token_rows)

    def prepare_graph_inputs(self, graph):
        # The same gathers, captured: every replay reads the slots the graph's idx_mapping holds then.
        return self._inputs(graph.idx_mapping, graph.token_rows)

    def _inputs(self, idx_mapping, token_rows):
        # token -> batch_row -> req_slot, all on the device: no host sync.
        token_slots = idx_mapping.long()[token_rows]
        return {"steer_token_ids": self.token_id[token_slots], "steer_scales": self.scale[token_slots]}
