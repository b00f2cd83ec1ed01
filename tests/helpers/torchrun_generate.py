"""Run under `torchrun`: build a tensor-parallel `LLM` over the ranks torchrun started (env rendezvous), generate
greedily, and on the driver (rank 0) write the token ids as JSON. Usage: `torchrun ... torchrun_generate.py
CHECKPOINT PROMPTS_JSON OUT_JSON` (the other ranks serve the driver inside `LLM(...)` and exit there)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    checkpoint, prompts_path, out_path = sys.argv[1:4]
    from framework.entrypoints.llm import LLM
    from framework.params.sampling_params import SamplingParams

    spec = json.loads(Path(prompts_path).read_text())
    llm = LLM(checkpoint, tensor_parallel_size=2, **spec["engine"])
    outs = llm.generate(spec["prompts"], SamplingParams(**spec["params"]), use_tqdm=False)
    Path(out_path).write_text(json.dumps([o.token_ids for o in outs]))
    llm.shutdown()


if __name__ == "__main__":
    main()
