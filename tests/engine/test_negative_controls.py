"""Negative controls: plant the bug an isolation or equivalence test guards against, and that test must fail.

An equivalence claim (batched == alone, prefix caching on == off, V1 == V2, async == sync) is only as strong as
the model it runs on; before `random_tiny` needed its context, every row reading row 0's KV blocks passed them
all. Each control here plants one fault of `planted_faults.py` through monkeypatch and runs the guarding test's
own code (the test function, or the helper its body is), expecting an AssertionError. Outcomes are
deterministic: the faults, prompts and seeds are fixed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import helpers.planted_faults as faults
import pytest
import test_attention_triton
import test_context_model
import test_engine
import test_fuzz_engine
import test_prefix_caching
import test_reliability
import test_runner_v1
import test_sampler_engine
import test_spec_probs_distribution

from framework import LLM

PlantFn = Callable[[pytest.MonkeyPatch], None]


@pytest.fixture(autouse=True)
def _no_fault_outlives_its_control():
    before = faults.planted_targets()
    yield
    after = faults.planted_targets()
    assert after == before, f"planted faults left behind: {[k for k in before if after[k] is not before[k]]}"


def _fails_with(plant: PlantFn, check: Callable[[], None], where: str) -> None:
    """`check` fails an assertion of test file `where` while `plant`'s fault is in place (engines are built
    inside `check`); an assertion elsewhere (an engine invariant, a crash) would be another failure."""
    with pytest.MonkeyPatch.context() as mp:
        plant(mp)
        with pytest.raises(AssertionError) as failure:
            check()
    raised_in = Path(str(failure.traceback[-1].path)).name
    assert raised_in == where, f"the planted fault failed an assertion in {raised_in}, not {where}: {failure.value}"


# ---- requests leaking into each other: a row reads row 0's KV blocks ---------------------------------------
LEAK = faults.plant_rows_read_row0_kv


def test_kv_leak_fails_batched_greedy_equals_alone(tiny_llm_factory, hf_greedy_reference):
    _fails_with(
        LEAK,
        lambda: test_engine.test_batched_greedy_equals_alone(tiny_llm_factory, hf_greedy_reference),
        "test_engine.py",
    )


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_kv_leak_fails_the_fuzz_schedule_check(runner, monkeypatch, one_thread):
    """The fuzz test's body (`drive`: greedy requests among others equal their runs alone) on a fixed schedule
    of overlapping requests, with engines and reference runs of its own (the fuzz module's caches untouched)."""
    monkeypatch.setattr(test_fuzz_engine, "_engines", {})
    monkeypatch.setattr(test_fuzz_engine, "_alone", {})
    monkeypatch.setattr(test_fuzz_engine, "FIGURES", dict(test_fuzz_engine.FIGURES))
    ops = [("add", 20, 8, True), ("add", 30, 8, True), ("steps", 2), ("add", 12, 8, True), ("add", 25, 6, False)]

    def schedule() -> None:
        test_fuzz_engine.drive(test_fuzz_engine._engine(runner, True), runner, ops, seed=3)

    _fails_with(LEAK, schedule, "test_fuzz_engine.py")


def test_kv_leak_fails_a_reliability_catalogue_case(tmp_path, one_thread):
    """A bad request arrives while three good ones run: they must still give their tokens alone."""
    case = next(c for c in test_reliability.CASES if c.id == "token-above-vocab")

    def check() -> None:
        running = LLM("random_tiny", device="cpu")
        test_reliability.test_catalogue_case(case, None, running, test_reliability.alone_reference(), tmp_path, None)

    _fails_with(LEAK, check, "test_reliability.py")


def test_kv_leak_fails_preemption_and_async_equivalences(tiny_llm_factory):
    _fails_with(
        LEAK,
        lambda: test_engine.test_preemption_and_chunked_prefill_do_not_change_outputs(tiny_llm_factory),
        "test_engine.py",
    )
    _fails_with(
        LEAK, lambda: test_engine.test_async_scheduling_gives_the_same_outputs(tiny_llm_factory, True), "test_engine.py"
    )


def test_kv_leak_fails_prefix_caching_on_equals_off(tmp_path):
    from helpers.hf_models import SPEC_BY_NAME, save_tiny_checkpoint

    arch, runner, async_scheduling, block_size, num_blocks = test_prefix_caching.CASES[0]
    save_tiny_checkpoint(SPEC_BY_NAME[arch], tmp_path / arch)

    def check() -> None:
        test_prefix_caching.test_same_tokens_with_and_without_prefix_caching(
            {arch: tmp_path / arch}, None, arch, runner, async_scheduling, block_size, num_blocks
        )

    _fails_with(LEAK, check, "test_prefix_caching.py")


def test_v2_only_block_table_fault_fails_v1_equals_v2(tiny_llm_factory):
    """The fault is in V2's device-side gather only: V1 (tables built on the CPU) is the reference it misses."""
    _fails_with(
        faults.plant_v2_gathers_row0_block_table,
        lambda: test_runner_v1.test_thirty_requests_through_four_rows_match_v2(tiny_llm_factory),
        "test_runner_v1.py",
    )


def test_kv_leak_fails_engine_equals_hf():
    _fails_with(LEAK, lambda: test_context_model.check_engine_equals_hf(*_llm_and_hf()), "test_context_model.py")


# ---- attention output zeroed ---------------------------------------------------------------------------------
def _llm_and_hf() -> tuple[LLM, object]:
    from framework.entrypoints.bench.hf_reference import hf_model_from_mrv2

    llm = LLM("random_tiny", device="cpu")
    return llm, hf_model_from_mrv2(llm.engine.loaded)


def test_zeroed_attention_fails_the_context_checks():
    """mrv2 against mrv2 cannot see it (both arms lose the context alike); the context model's checks do."""
    _fails_with(
        faults.plant_zero_attention,
        lambda: test_context_model.check_early_token_changes_later_tokens(LLM("random_tiny", device="cpu")),
        "test_context_model.py",
    )
    _fails_with(
        faults.plant_zero_attention,
        lambda: test_context_model.check_engine_equals_hf(*_llm_and_hf()),
        "test_context_model.py",
    )


def test_zeroed_attention_fails_the_engine_tests_themselves(tiny_llm_factory, hf_greedy_reference):
    """The engine tests compare with HF's greedy tokens too, so they see what batched == alone cannot."""
    _fails_with(
        faults.plant_zero_attention,
        lambda: test_engine.test_batched_greedy_equals_alone(tiny_llm_factory, hf_greedy_reference),
        "test_engine.py",
    )
    _fails_with(
        faults.plant_rows_read_row0_kv,
        lambda: test_engine.test_greedy_under_preemption_and_chunked_prefill_equals_hf(
            tiny_llm_factory, hf_greedy_reference
        ),
        "test_engine.py",
    )


def test_zeroed_triton_attention_fails_the_triton_end_to_end_test(tiny_llm_factory, monkeypatch):
    if test_attention_triton.COMPILED_FIRST:  # its tests report a fresh process's outcome: plant there instead
        monkeypatch.setenv("MRV2_PLANTED_FAULT", "zero_triton_attention")
        monkeypatch.setattr(test_attention_triton, "_fresh_outcomes", {})

    def check() -> None:
        # The test's own monkeypatch is undone inside the planted fault's: undone after it, it would restore the
        # zeroed kernel entry it saw (and leave it for every later test).
        inner = pytest.MonkeyPatch()
        try:
            test_attention_triton.test_tiny_model_generates_the_same_tokens_with_triton(tiny_llm_factory, inner)
        finally:
            inner.undo()

    _fails_with(faults.plant_zero_triton_attention, check, "test_attention_triton.py")


def test_old_random_tiny_fails_the_context_check():
    """The model these tests replaced: its greedy output ignored everything but the last prompt token."""
    _fails_with(
        faults.plant_old_random_tiny,
        lambda: test_context_model.check_early_token_changes_later_tokens(LLM("random_tiny", device="cpu")),
        "test_context_model.py",
    )


# ---- a reused request slot keeps its previous owner's sampling parameters --------------------------------------
@pytest.mark.parametrize(
    "module, name",
    [
        (test_engine, "test_reused_slot_carries_nothing_of_previous_owner"),
        (test_engine, "test_profile_run_leaves_no_state_behind"),
        (test_sampler_engine, "test_reused_slot_keeps_nothing_of_a_fully_parameterised_owner"),
    ],
)
def test_stale_slot_fails_the_slot_reuse_tests(module, name, tiny_llm_factory):
    _fails_with(
        faults.plant_reused_slot_keeps_sampling_params,
        lambda: getattr(module, name)(tiny_llm_factory),
        Path(module.__file__).name,
    )


# ---- drafts with probabilities always accepted ---------------------------------------------------------------
def test_always_accepted_drafts_fail_the_distribution_check(tmp_path: Path):
    spec = test_spec_probs_distribution
    path, joint = spec.build_target(tmp_path / "llama")
    with spec.drawn_from_q_registered(joint):
        _fails_with(
            faults.plant_accept_every_draft_with_probs,
            lambda: spec.check_spec_probs_keep_the_target_distribution(path, joint, num_requests=300),
            "test_spec_probs_distribution.py",
        )
