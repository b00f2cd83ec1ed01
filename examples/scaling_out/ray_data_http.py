"""Ray Data batch inference through mrv2's HTTP API (docs/scaling-out.md): a dataset of prompts mapped in
batches through an OpenAI-compatible endpoint (one `mrv2 serve`, a router in front of several, or the Ray Serve
app of `ray_serve_app.py`).

    pip install "ray[data]" openai
    python examples/scaling_out/ray_data_http.py http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import sys
from typing import Any

import ray


class Complete:
    """A Ray Data map_batches callable: one completion request per prompt of the batch."""

    def __init__(self, base_url: str) -> None:
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=3)
        self.model = self.client.models.list().data[0].id

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        texts = []
        for prompt in batch["prompt"]:
            out = self.client.completions.create(model=self.model, prompt=str(prompt), max_tokens=32, temperature=0)
            texts.append(out.choices[0].text)
        return {"prompt": batch["prompt"], "completion": texts}


def main(base_url: str) -> None:
    prompts = ray.data.from_items([{"prompt": f"def task_{i}(x):"} for i in range(64)])
    results = prompts.map_batches(Complete, fn_constructor_args=(base_url,), batch_size=8, concurrency=2)
    for row in results.take(4):
        print(repr(row["prompt"]), "->", repr(row["completion"]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1")
