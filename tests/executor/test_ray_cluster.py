"""Ray on one local CPU cluster (docs/scaling-out.md): the placement-group launcher starts two ranks (one bundle
each, env rendezvous, gloo) and tensor parallel over them equals one process token for token; Ray Serve runs two
replicas of mrv2's app (examples/scaling_out/ray_serve_app.py) and the official openai client gets completions
and streams through Ray's HTTP proxy on 127.0.0.1. Also: a launcher's rank checks only its own device."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers.hf_models import SPEC_BY_NAME, random_prompts, save_tiny_checkpoint

from framework.config.schema import ConfigError, load_config
from framework.entrypoints.llm import LLM
from framework.executor.launch import check_parallel_config, free_port
from framework.executor.ray_launch import rank_envs
from framework.models.presets import preset_config
from framework.params.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=64, seed=0)
PARAMS = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_rank_envs_and_a_launched_ranks_device_check(monkeypatch: pytest.MonkeyPatch) -> None:
    envs = rank_envs(["10.0.0.1", "10.0.0.2", "10.0.0.1"], 29500, gpus_per_rank=0)
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0", "1"]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.1"} and [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert [e["LOCAL_RANK"] for e in rank_envs(["a", "a"], 1, gpus_per_rank=1)] == ["0", "0"]  # Ray's own GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = load_config({"device": "cuda", "parallel": {"tensor_parallel_size": 2}})
    with pytest.raises(ConfigError, match="2 ranks, but only 1 CUDA devices"):
        check_parallel_config(cfg, preset_config("random_tiny"))  # mrv2 spawns both ranks on this node
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    check_parallel_config(cfg, preset_config("random_tiny"))  # a launcher's rank: one device of its own
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ConfigError, match="LOCAL_RANK=1 needs device cuda:1"):
        check_parallel_config(cfg, preset_config("random_tiny"))


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    examples = str(REPO / "examples" / "scaling_out")
    saved = dict(os.environ)
    path = [examples, str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    os.environ.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", MRV2_DEVICE="cpu")
    sys.path.insert(0, examples)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        _node_ip_address="127.0.0.1",  # the local cluster listens on loopback only
    )
    try:
        yield ray
    finally:
        ray.shutdown()
        sys.path.remove(examples)
        os.environ.clear()
        os.environ.update(saved)


def test_placement_group_ranks_tensor_parallel_equals_one_process(ray_cluster, tmp_path: Path) -> None:
    from framework.executor.ray_launch import launch

    checkpoint = tmp_path / "qwen3"
    save_tiny_checkpoint(SPEC_BY_NAME["qwen3"], checkpoint)
    prompts = random_prompts(3, 5, 20, seed=7)
    llm = LLM(str(checkpoint), **ENGINE)
    single = [o.token_ids for o in llm.generate(prompts, SamplingParams(**PARAMS), use_tqdm=False)]
    llm.shutdown()
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"engine": ENGINE, "prompts": prompts, "params": PARAMS}))
    script = REPO / "tests" / "helpers" / "torchrun_generate.py"
    command = [sys.executable, str(script), str(checkpoint), str(spec), str(out)]
    codes = launch(command, world_size=2, gpus_per_rank=0, cpus_per_rank=0.5, timeout_s=240)
    assert codes == [0, 0]
    assert json.loads(out.read_text()) == single


def test_ray_serve_two_replicas_complete_and_stream(ray_cluster) -> None:
    import openai
    import ray_serve_app  # examples/scaling_out (on PYTHONPATH: Ray's workers import it by name)
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        app = ray_serve_app.Mrv2Deployment.options(num_replicas=2, autoscaling_config=None).bind()
        serve.run(app, name="mrv2", route_prefix="/")
        status = serve.status().applications["mrv2"].deployments["Mrv2Deployment"]
        assert status.replica_states == {"RUNNING": 2}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        want = LLM("tiny", device="cpu").generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=8))[0].text
        got = [client.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, temperature=0) for _ in "ab"]
        assert [g.choices[0].text for g in got] == [want, want]
        stream = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
    finally:
        serve.shutdown()
