"""mrv2's OpenAI-compatible app as a Ray Serve deployment (docs/scaling-out.md): each replica runs its own API
server and engine core; Ray Serve balances HTTP requests over the replicas and scales them.

    pip install "ray[serve]"
    serve run examples.scaling_out.ray_serve_app:app      # then: openai client at http://127.0.0.1:8000/v1

Set MRV2_DEVICE=cpu to try it without GPUs.
"""

from __future__ import annotations

import os

from ray import serve

from framework.config.schema import load_config
from framework.entrypoints.serve.server import serving_app

CONFIG = load_config(
    {
        "model": {"preset": os.environ.get("MRV2_PRESET", "tiny")},
        "device": os.environ.get("MRV2_DEVICE", "auto"),
        "cache": {"enable_prefix_caching": True},
    }
)
fastapi_app = serving_app(CONFIG)


@serve.deployment(
    ray_actor_options={"num_gpus": 0 if CONFIG.device == "cpu" else 1},
    autoscaling_config={"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32},
)
@serve.ingress(fastapi_app)
class Mrv2Deployment:
    """One replica: mrv2's routes (its lifespan starts the engine core in the replica's process)."""


app = Mrv2Deployment.bind()  # type: ignore[attr-defined]
