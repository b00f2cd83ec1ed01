"""Two "nodes" on localhost, each a `torchrun --nnodes=2 --nproc-per-node=1` launcher (static rendezvous through
MASTER_ADDR / MASTER_PORT, gloo): mrv2 joins the ranks torchrun started, the driver on rank 0, and tensor
parallel over the two equals one process token for token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.hf_models import SPEC_BY_NAME, random_prompts, save_tiny_checkpoint

from framework.entrypoints.llm import LLM
from framework.executor.launch import free_port
from framework.params.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=64, seed=0)
PARAMS = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_two_torchrun_nodes_tensor_parallel_equals_one_process(tmp_path: Path) -> None:
    checkpoint = tmp_path / "qwen3"
    save_tiny_checkpoint(SPEC_BY_NAME["qwen3"], checkpoint)
    prompts = random_prompts(3, 5, 20, seed=7)
    llm = LLM(str(checkpoint), **ENGINE)
    single = [o.token_ids for o in llm.generate(prompts, SamplingParams(**PARAMS), use_tqdm=False)]
    llm.shutdown()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"engine": ENGINE, "prompts": prompts, "params": PARAMS}))
    out = tmp_path / "out.json"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(REPO / "tests" / "helpers" / "torchrun_generate.py"),
                str(checkpoint),
                str(spec),
                str(out),
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    logs = []
    for proc in nodes:
        try:
            logs.append(proc.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            logs.append(proc.communicate()[0])
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(log[-2000:] for log in logs)
    assert json.loads(out.read_text()) == single
