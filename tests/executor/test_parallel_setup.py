"""Parallelism without processes: config validation, stage split, sharded loading and sharded random weights.

Loading needs no process group: a `ParallelContext(tp_size=2, rank=r)` builds rank r's part of the model, and
the loader fills it from the same HF safetensors, reading only that rank's slices.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.hf_models import SPEC_BY_NAME, save_tiny_checkpoint

from framework.config.overrides import check_overrides
from framework.config.schema import ConfigError, load_config
from framework.entrypoints.cli import conf_dir
from framework.executor.launch import check_parallel_config, torchrun_place
from framework.layers.parallel.context import ParallelContext, stage_layers
from framework.layers.parallel.linear import MissingLayer
from framework.models.loader import build_model, init_random_weights, load_safetensors_weights, read_hf_config
from framework.models.presets import preset_config

CPU = torch.device("cpu")


# ---- config ----------------------------------------------------------------------------------------------
def test_parallel_keys_validate_and_override_from_the_cli() -> None:
    cfg = load_config({"parallel": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}})
    assert cfg.parallel.world_size == 4
    check_overrides(["parallel.tensor_parallel_size=2", "parallel=tp2"], conf_dir())
    with pytest.raises(ConfigError, match="did you mean 'tensor_parallel_size'"):
        check_overrides(["parallel.tensor_paralel_size=2"], conf_dir())
    with pytest.raises(ConfigError, match=r"parallel.tensor_parallel_size: Input should be greater than or equal to 1"):
        load_config({"parallel": {"tensor_parallel_size": 0}})
    with pytest.raises(ConfigError, match="runs on the V2 runner only"):
        load_config({"runner": {"kind": "v1"}, "parallel": {"tensor_parallel_size": 2}})
    with pytest.raises(ConfigError, match="parallel.backend=nccl needs GPUs"):
        load_config({"device": "cpu", "parallel": {"pipeline_parallel_size": 2, "backend": "nccl"}})


@pytest.mark.parametrize(
    "tp, pp, message",
    [
        (3, 1, "4 attention heads do not divide by parallel.tensor_parallel_size=3"),
        (4, 1, "2 KV heads do not divide by parallel.tensor_parallel_size=4"),
        (1, 3, "2 layers, fewer than parallel.pipeline_parallel_size=3 stages"),
    ],
)
def test_layouts_the_model_cannot_split_are_refused(tp: int, pp: int, message: str) -> None:
    cfg = load_config({"device": "cpu", "parallel": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}})
    with pytest.raises(ConfigError, match=message):
        check_parallel_config(cfg, preset_config("random_tiny"))


def test_more_ranks_than_devices_and_torchrun_mismatch_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config({"device": "cuda", "parallel": {"tensor_parallel_size": 2}})
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device is available"):
            check_parallel_config(cfg, preset_config("random_tiny"))
    elif torch.cuda.device_count() < 2:
        with pytest.raises(ConfigError, match="only 1 CUDA devices are visible"):
            check_parallel_config(cfg, preset_config("random_tiny"))
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="torchrun started 3 processes but .* = 2"):
        torchrun_place(cfg)


def test_stage_layers_split_evenly_in_order() -> None:
    assert [list(stage_layers(7, r, 3)) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(stage_layers(28, r, 2)) for r in range(2)] == [list(range(14)), list(range(14, 28))]


# ---- sharded loading ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    paths = {}
    for name in ("llama", "qwen2", "qwen3"):  # untied MHA; q/k/v bias + GQA; tied + q/k norm + GQA
        paths[name] = tmp_path_factory.mktemp(f"shard-{name}")
        save_tiny_checkpoint(SPEC_BY_NAME[name], paths[name])
    return paths


def _full_state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def _spy_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple]]:
    """Record (tensor name, shape actually read) for every slice the loader reads; fail on whole-tensor reads."""
    import safetensors

    reads: list[tuple[str, tuple]] = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.f = real_open(*args, **kwargs)

        def __enter__(self):  # type: ignore[no-untyped-def]
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):  # type: ignore[no-untyped-def]
            return self.f.__exit__(*exc)

        def keys(self):  # type: ignore[no-untyped-def]
            return self.inner.keys()

        def get_tensor(self, name):  # type: ignore[no-untyped-def]
            raise AssertionError(f"whole tensor {name} read")

        def get_slice(self, name):  # type: ignore[no-untyped-def]
            sl = self.inner.get_slice(name)

            class Slice:
                def get_shape(self):  # type: ignore[no-untyped-def]
                    return sl.get_shape()

                def __getitem__(self, index):  # type: ignore[no-untyped-def]
                    t = sl[index]
                    reads.append((name, tuple(t.shape)))
                    return t

            return Slice()

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    return reads


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tensor_parallel_ranks_read_only_their_slices(
    arch: str, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoints[arch]
    hf = read_hf_config(path)
    full = _full_state(path)
    heads, kv_heads, hd = hf["num_attention_heads"], hf["num_key_value_heads"], hf.get("head_dim") or 16
    reads = _spy_reads(monkeypatch)
    for rank in range(2):
        reads.clear()
        model = build_model(hf, torch.float32, CPU, ParallelContext(tp_size=2, rank=rank))
        load_safetensors_weights(model, path)
        attn = model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (heads // 2, kv_heads // 2)
        assert model.kv_cache_shape(3, 4) == (2, 3, 4, kv_heads // 2, hd)
        params = dict(model.named_parameters())
        p = "model.layers.1."
        expect = {  # name -> (dim split, or None when whole)
            p + "self_attn.q_proj.weight": 0,
            p + "self_attn.k_proj.weight": 0,
            p + "self_attn.v_proj.weight": 0,
            p + "self_attn.o_proj.weight": 1,
            p + "mlp.gate_proj.weight": 0,
            p + "mlp.up_proj.weight": 0,
            p + "mlp.down_proj.weight": 1,
            "model.embed_tokens.weight": 0,
            p + "input_layernorm.weight": None,
        }
        if arch == "qwen2":
            expect[p + "self_attn.k_proj.bias"] = 0
        if arch == "llama":
            expect["lm_head.weight"] = 0
        for name, dim in expect.items():
            whole = full[name]
            part = whole if dim is None else whole.chunk(2, dim=dim)[rank]
            assert torch.equal(params[name], part), name
        # Sliced tensors were read as this rank's half only.
        read = dict(reads)
        assert read[p + "self_attn.o_proj.weight"] == tuple(full[p + "self_attn.o_proj.weight"].chunk(2, 1)[0].shape)
        assert read["model.embed_tokens.weight"][0] == full["model.embed_tokens.weight"].shape[0] // 2


def test_pipeline_stages_read_only_their_layers_and_a_tied_head(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = checkpoints["qwen3"]  # tied embeddings: the last stage loads its LM head from the embedding tensor
    hf = read_hf_config(path)
    full = _full_state(path)
    reads = _spy_reads(monkeypatch)
    first = build_model(hf, torch.float32, CPU, ParallelContext(pp_size=2, rank=0))
    load_safetensors_weights(first, path)
    assert {n.split(".")[2] for n, _ in reads if n.startswith("model.layers.")} == {"0"}
    assert isinstance(first.model.layers[1], MissingLayer) and not hasattr(first, "lm_head")
    assert first.num_kv_layers == 1
    reads.clear()
    last = build_model(hf, torch.float32, CPU, ParallelContext(pp_size=2, rank=1))
    load_safetensors_weights(last, path)
    assert {n.split(".")[2] for n, _ in reads if n.startswith("model.layers.")} == {"1"}
    assert isinstance(last.model.layers[0], MissingLayer) and not hasattr(last.model, "embed_tokens")
    assert torch.equal(last.lm_head.weight, full["model.embed_tokens.weight"])
    assert torch.equal(last.model.norm.weight, full["model.norm.weight"])


def test_sharded_random_weights_are_slices_of_the_single_process_weights() -> None:
    hf = preset_config("random_tiny")
    single = build_model(hf, torch.float32, CPU)
    init_random_weights(single, seed=3)
    whole = dict(single.named_parameters())
    for rank in range(2):
        part = build_model(hf, torch.float32, CPU, ParallelContext(tp_size=2, pp_size=2, rank=rank * 2 + 1))
        init_random_weights(part, seed=3)
        for name, param in part.named_parameters():
            source = whole["model.embed_tokens.weight" if name == "lm_head.weight" else name]
            dims = [d for d in range(param.dim()) if param.shape[d] != source.shape[d]]
            expected = source if not dims else source.chunk(2, dim=dims[0])[1]
            assert torch.equal(param, expected), name


def test_spawned_workers_get_the_config_as_json_and_no_object_of_ours(monkeypatch) -> None:
    """`spawn_workers` hands each rank only str/int arguments (multiprocessing pickles them): the config as its
    JSON text, which the worker validates back into an equal config."""
    import torch.multiprocessing as mp

    from framework.config.schema import Mrv2Config
    from framework.executor.driver import spawn_workers

    started: list[tuple] = []

    class FakeProcess:
        def __init__(self, target, args, name, daemon):  # type: ignore[no-untyped-def]
            self.target, self.args = target, args

        def start(self) -> None:
            started.append(self.args)

    class FakeContext:
        Process = FakeProcess

    monkeypatch.setattr(mp, "get_context", lambda method: FakeContext())
    config = load_config(
        {
            "device": "cpu",
            "parallel": {"tensor_parallel_size": 4},
            "speculator": {"method": "ngram", "num_speculative_tokens": 2},
        }
    )
    spawn_workers(config, driver_rank=1, port=1234)
    assert [args[1:] for args in started] == [(r, r, "tcp://127.0.0.1:1234") for r in (0, 2, 3)]
    for args in started:
        assert [type(a) for a in args] == [str, int, int, str]
        assert Mrv2Config.model_validate_json(args[0]) == config


@pytest.mark.parametrize("name,value", [("kv_groups", object()), ("num_draft_kv_layers", 3)])
def test_driver_runner_shows_its_local_runners_per_instance_values(name: str, value: object) -> None:
    """The driver rank's runner forwards unknown attributes to its local runner, but the interface's class defaults
    (`kv_groups = None`, `num_draft_kv_layers = 0`) are not unknown: without explicit forwarding the engine would
    read the defaults (it once built the ungrouped KV manager under tensor parallelism that way)."""
    from types import SimpleNamespace

    from framework.executor.driver import DriverRunner

    driver = object.__new__(DriverRunner)
    driver.__dict__["local"] = SimpleNamespace(**{name: value})
    assert getattr(driver, name) is value
