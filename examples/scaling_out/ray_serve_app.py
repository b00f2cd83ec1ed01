"""mrv2's OpenAI-compatible app as a Ray Serve deployment (docs/scaling-out.md): each replica runs its own API
server and engine core; Ray Serve balances HTTP requests over the replicas and scales them.

    pip install "ray[serve]"
    serve run examples.scaling_out.ray_serve_app:app      # then: openai client at http://127.0.0.1:8000/v1

Set MRV2_DEVICE=cpu to try it without GPUs, MRV2_PRESET / MRV2_MODEL_PATH for the model. The app is built in each
replica (`build_app`, a builder Ray Serve calls there): mrv2's app holds sockets and encoders that do not travel.
"""

from __future__ import annotations

import os

from fastapi import FastAPI
from ray import serve

from framework.config.schema import load_config
from framework.entrypoints.serve.server import serving_app

DEVICE = os.environ.get("MRV2_DEVICE", "auto")


def build_app() -> FastAPI:
    """mrv2's app for this replica; its lifespan (run by Ray Serve in the replica) starts the engine core."""
    model = {"path": os.environ["MRV2_MODEL_PATH"], "preset": None} if "MRV2_MODEL_PATH" in os.environ else {}
    config = load_config(
        {
            "model": model or {"preset": os.environ.get("MRV2_PRESET", "tiny")},
            "device": DEVICE,
            "cache": {"enable_prefix_caching": True},
        }
    )
    return serving_app(config)


@serve.deployment(
    ray_actor_options={"num_gpus": 0 if DEVICE == "cpu" else 1, "num_cpus": 0},
    autoscaling_config={"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32},
)
@serve.ingress(build_app)
class Mrv2Deployment:
    """One replica: mrv2's routes."""


app = Mrv2Deployment.bind()  # type: ignore[attr-defined]
