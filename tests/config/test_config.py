"""Config validation: typos, unknown options and invalid values fail early with a message that names them."""

from __future__ import annotations

import pytest

from framework.config.overrides import check_overrides
from framework.config.schema import ConfigError, Mrv2Config, load_config
from framework.entrypoints.cli import conf_dir


def test_defaults_validate():
    cfg = load_config({})
    assert cfg.model.preset == "tiny" and cfg.runner.kind == "auto"


def test_unknown_key_names_key_and_allowed_keys():
    with pytest.raises(ConfigError) as err:
        load_config({"sampler": {"temprature": 1.0}})
    msg = str(err.value)
    assert "sampler.temprature: unknown key" in msg
    assert "did you mean 'temperature'" in msg
    assert "top_p" in msg  # the allowed keys are listed


def test_out_of_range_value():
    with pytest.raises(
        ConfigError, match=r"scheduler.max_num_seqs: Input should be greater than or equal to 1 \(got -3\)"
    ):
        load_config({"scheduler": {"max_num_seqs": -3}})


def test_wrong_type():
    with pytest.raises(ConfigError, match=r"cache.block_size: Input should be a valid integer"):
        load_config({"cache": {"block_size": "big"}})


def test_literal_choices_are_listed():
    with pytest.raises(ConfigError, match=r"runner.kind: Input should be 'auto', 'v2' or 'v1'"):
        load_config({"runner": {"kind": "v3"}})


def test_cross_field_check_cache_too_small():
    with pytest.raises(ConfigError, match=r"fewer than one request of model.max_model_len=512"):
        load_config({"model": {"max_model_len": 512}, "cache": {"num_blocks": 4, "block_size": 16}})


def test_speculator_tokens_need_a_method():
    with pytest.raises(ConfigError, match="num_speculative_tokens must be 0 when speculator.method is none"):
        load_config({"speculator": {"num_speculative_tokens": 3}})


def test_bench_ranges_checked():
    with pytest.raises(ConfigError, match=r"bench.input_len must be \[lo, hi\]"):
        load_config({"bench": {"input_len": [10, 5]}})


@pytest.mark.parametrize(
    "override, expected",
    [
        ("sampler.temprature=1", "did you mean 'temperature'"),
        (
            "model=nope",
            "available model options: gemma-3-4b, gemma-4-default, gpt-oss-20b, gpt-oss-20b-mxfp4, hf, jamba-1024, "
            "jamba-tiny, "
            "qwen3-0.6b, qwen3-30b-a3b, qwen3-moe-tiny, qwen3_5-0.8b, qwen3_5-35b-a3b, qwen3_5-tiny, random_tiny, "
            "tiny, whisper-tiny",
        ),
        ("runner=v9", "available runner options: auto, v1, v2"),
        ("scheduler.max_num_seqs.x=1", "has no sub-keys"),
        ("+nothing=1", "allowed keys at the top level"),
        ("model=tiny,nope", "model=nope: unknown option"),
    ],
)
def test_cli_override_checks(override, expected):
    with pytest.raises(ConfigError, match=expected):
        check_overrides([override], conf_dir())


def test_cli_override_checks_accept_valid_ones():
    check_overrides(["model=tiny", "sampler.temperature=0.5", "hydra.verbose=true"], conf_dir())


def test_composed_yaml_matches_schema(tmp_path):
    """Every YAML option of every group composes into a valid config (no drift between conf/ and schema)."""
    from hydra import compose, initialize_config_dir

    (tmp_path / "config.json").write_text("{}")  # a draft head directory for the eagle / eagle3 options
    needs = {
        "hf": ["model.path=/x"],
        "eagle": [f"speculator.model={tmp_path}"],
        "eagle3": [f"speculator.model={tmp_path}"],
    }
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        for group in ("model", "runner", "sampler", "speculator", "scheduler", "cache", "experiment"):
            for option in sorted(p.stem for p in (conf_dir() / group).glob("*.yaml")):
                overrides = [f"{group}={option}"] + needs.get(option, [])
                cfg = compose(config_name="run", overrides=overrides)
                assert isinstance(load_config(cfg), Mrv2Config), (group, option)


def test_missing_mandatory_value_is_named():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="run", overrides=["model=hf"])
    with pytest.raises(ConfigError, match=r"model.path is required when model.preset is null"):
        load_config(cfg)


def test_cross_field_error_does_not_dump_the_section():
    with pytest.raises(ConfigError) as err:
        load_config({"speculator": {"num_speculative_tokens": 3}})
    assert "{" not in str(err.value)


def test_unknown_speculator_is_named():
    from framework.engine.runner_selection import select_runner

    with pytest.raises(ConfigError, match="speculator.method=medusa: unknown speculator; registered: .*ngram"):
        select_runner(load_config({"speculator": {"method": "medusa", "num_speculative_tokens": 2}}))
    with pytest.raises(ConfigError, match="speculator.method=medusa: unknown speculator"):
        select_runner(load_config({"speculator": {"method": "medusa", "num_speculative_tokens": 2, "dynamic_k": True}}))


def test_speculator_fields_are_validated():
    with pytest.raises(ConfigError, match="num_speculative_tokens must be >= 1 with speculator.method=ngram"):
        load_config({"speculator": {"method": "ngram"}})
    with pytest.raises(ConfigError, match="prompt_lookup_min=4 exceeds speculator.prompt_lookup_max=3"):
        load_config(
            {
                "speculator": {
                    "method": "ngram",
                    "num_speculative_tokens": 2,
                    "prompt_lookup_min": 4,
                    "prompt_lookup_max": 3,
                }
            }
        )
    with pytest.raises(ConfigError, match="dynamic_k=true needs a drafting speculator.method"):
        load_config({"speculator": {"dynamic_k": True}})


@pytest.mark.parametrize(
    "spec, suggested",
    [
        ({"method": "dynamic", "num_speculative_tokens": 2}, "speculator.method=ngram speculator.dynamic_k=true"),
        (
            {"method": "dynamic", "num_speculative_tokens": 2, "dynamic": {"method": "eagle"}},
            "speculator.method=eagle speculator.dynamic_k=true",
        ),
        (
            {"method": "mtp", "num_speculative_tokens": 1, "dynamic": {"method": "mtp"}},
            "speculator.method=mtp speculator.dynamic_k=true",
        ),
    ],
)
def test_the_removed_dynamic_method_says_to_use_dynamic_k(spec, suggested):
    """`method: dynamic` (wrapping `dynamic.method`) was replaced by the `dynamic_k` flag on any method: an old
    config fails with one message naming the replacement."""
    with pytest.raises(ConfigError, match="speculator.method=dynamic and speculator.dynamic.method are gone") as err:
        load_config({"speculator": spec})
    assert suggested in str(err.value)


def test_v1_refuses_speculation():
    from framework.engine.runner_selection import select_runner

    config = load_config({"runner": {"kind": "v1"}, "speculator": {"method": "ngram", "num_speculative_tokens": 2}})
    with pytest.raises(ConfigError, match="the V1 runner does not verify drafts"):
        select_runner(config)


def test_draft_head_directory_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="speculator.method=eagle needs speculator.model"):
        load_config({"speculator": {"method": "eagle", "num_speculative_tokens": 2}})
    with pytest.raises(ConfigError, match=f"speculator.model '{tmp_path / 'nope'}' is not a directory"):
        load_config({"speculator": {"method": "eagle3", "num_speculative_tokens": 2, "model": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match="has no config.json"):
        load_config({"speculator": {"method": "mtp", "num_speculative_tokens": 1, "model": str(tmp_path)}})
    (tmp_path / "config.json").write_text("{}")
    assert load_config({"speculator": {"method": "mtp", "num_speculative_tokens": 1, "model": str(tmp_path)}})


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"model": {"small_batch_kernels": "on"}}, r"model.small_batch_kernels: moved to kernels.small_batch"),
        ({"model": {"programmatic_launch": "off"}}, r"moved to kernels.programmatic_launch"),
        ({"model": {"longest_rows_first": False}}, r"moved to kernels.longest_rows_first"),
        ({"model": {"small_batch_max_tokens": 8}}, r"model.small_batch_max_tokens: removed"),
        ({"sampler": {"structured_outputs_backend": "auto"}}, r"structured_outputs_backend: removed"),
    ],
)
def test_retired_keys_say_where_they_went(data, expected):
    with pytest.raises(ConfigError, match=expected) as err:
        load_config(data)
    assert "Extra inputs" not in str(err.value)


def test_retired_keys_on_the_command_line():
    with pytest.raises(ConfigError, match="moved to kernels.small_batch"):
        check_overrides(["model.small_batch_kernels=on"], conf_dir())
    check_overrides(["kernels.backend=reference"], conf_dir())


def test_retired_keys_name_real_schema_keys():
    from framework.config.retired import RETIRED_KEYS

    for old, new in RETIRED_KEYS.items():
        assert new.startswith("removed:") or new.split(".")[0] in Mrv2Config.model_fields, (old, new)
        if not new.startswith("removed:"):
            section, key = new.split(".")
            assert key in Mrv2Config.model_fields[section].annotation.model_fields, (old, new)
