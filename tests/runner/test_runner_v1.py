"""The V1 runner: its persistent batch moves rows correctly, and it generates exactly what V2 generates.

V2 is checked against HF transformers in test_hf_parity.py; here V1 is checked against V2 on the same
checkpoints and settings (greedy and seeded sampling, preemption, chunked prefill, many joins and leaves).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.fake_graphs import EagerReplayCapturer
from helpers.hf_models import SPECS, save_tiny_checkpoint
from test_hf_parity import PROMPTS, SCENARIOS, run_mrv2

from framework import SamplingParams
from framework.config.registry import MODEL_STATES
from framework.params.sampling_params import SamplingParams as Params
from framework.params.scheduler_output import NewRequestData
from framework.runner.v1 import PersistentBatch
from model_states.default import DefaultModelState


# ---- the persistent batch ------------------------------------------------------------------------------
def _new_request(i: int) -> NewRequestData:
    """Request `r{i}`: every per-row field gets a value that names i, so a mixed-up row shows."""
    n = 3 + i % 5
    return NewRequestData(
        request_id=f"r{i}",
        prefill_token_ids=[1000 * i + k for k in range(n)],
        prompt_len=n - 1,
        sampling_params=Params(temperature=0.1 * (i % 9) + 0.05, top_k=i, top_p=0.5 + 0.001 * i, min_p=0.001 * i),
        sampling_seed=7000 + i,
        block_ids=[100 * i + k for k in range(1 + i % 3)],
        num_computed_tokens=i % 2,
    )


def _expected_row(i: int) -> dict[str, object]:
    new = _new_request(i)
    return {
        "token_ids": new.prefill_token_ids,
        "num_tokens": len(new.prefill_token_ids),
        "prompt_len": new.prompt_len,
        "prefill_len": len(new.prefill_token_ids),
        "num_computed": new.num_computed_tokens,
        "block_table": new.block_ids,
        "num_blocks": len(new.block_ids),
        "state_slot": 500 + i,
    }


def _check_rows(pb: PersistentBatch) -> None:
    """Every request's row holds its own values in every per-row array, and there are no holes."""
    assert pb.num_rows == pb.num_reqs and sorted(pb.req_id_to_row.values()) == list(range(pb.num_reqs))
    arrays = pb.row_arrays()
    assert set(arrays) == set(_expected_row(0)), "a per-row array is not covered by this test"
    for request_id, row in pb.req_id_to_row.items():
        assert pb.req_ids[row] == request_id
        expected = _expected_row(int(request_id[1:]))
        for name, array in arrays.items():
            value = expected[name]
            got = array[row, : len(value)].tolist() if isinstance(value, list) else array[row]
            assert got == value, f"{name} of {request_id} (row {row})"


def test_condense_and_reorder_move_every_array_of_a_row_together() -> None:
    pb = PersistentBatch(max_num_reqs=8, max_model_len=16, max_blocks_per_req=4)
    for i in range(6):
        assert pb.add_request(_new_request(i), state_slot=500 + i) == i
    pb.remove_request("r1")  # holes in the middle
    pb.remove_request("r3")
    pb.condense()  # the last rows fill the holes: r5 -> row 1, r4 -> row 3
    assert pb.req_ids[:4] == ["r0", "r5", "r2", "r4"] and pb.num_moves == 2
    _check_rows(pb)
    pb.reorder(["r4", "r0", "r2"])  # the scheduler's order first; r5 (not scheduled) after them
    assert pb.req_ids[:4] == ["r4", "r0", "r2", "r5"] and pb.num_swaps == 2
    _check_rows(pb)
    pb.remove_request("r0")
    assert pb.add_request(_new_request(7), state_slot=507) == 1  # a new request fills the hole first
    _check_rows(pb)


def test_random_joins_leaves_and_reorders_keep_rows_intact() -> None:
    rng = random.Random(0)
    pb = PersistentBatch(max_num_reqs=8, max_model_len=16, max_blocks_per_req=4)
    live: list[int] = []
    for i in range(300):
        if live and (len(live) == 8 or rng.random() < 0.4):
            pb.remove_request(f"r{live.pop(rng.randrange(len(live)))}")
        else:
            live.append(i)
            pb.add_request(_new_request(i), state_slot=500 + i)
        if rng.random() < 0.6:
            pb.condense()
            order = [f"r{j}" for j in rng.sample(live, rng.randint(0, len(live)))]
            pb.reorder(order)
            assert pb.req_ids[: len(order)] == order
            _check_rows(pb)
    assert pb.num_moves > 20 and pb.num_swaps > 50


def test_append_sampled_skips_unfinished_prefill_chunks() -> None:
    pb = PersistentBatch(max_num_reqs=2, max_model_len=16, max_blocks_per_req=4)
    pb.add_request(_new_request(0), 500)  # 3 prefill tokens
    pb.add_request(_new_request(2), 502)  # 5 prefill tokens
    num_sampled = pb.append_sampled(np.array([3, 4]), np.array([11, 22]))  # row 1 is mid-prefill
    assert num_sampled.tolist() == [1, 0]
    assert pb.token_ids[0, :4].tolist() == [0, 1, 2, 11] and pb.num_tokens.tolist() == [4, 5]


# ---- V1 against V2 on the HF-parity checkpoints --------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_v1_greedy_equals_v2_with_preemption_and_chunked_prefill(spec, tmp_path: Path) -> None:
    save_tiny_checkpoint(spec, tmp_path)
    settings = SCENARIOS["chunked_preempt"]
    v2 = run_mrv2(tmp_path, PROMPTS, runner="v2", **settings)
    v1 = run_mrv2(tmp_path, PROMPTS, runner="v1", **settings)
    assert [o.token_ids for o in v1.outputs] == [o.token_ids for o in v2.outputs]
    assert sum(o.num_preemptions for o in v1.outputs) > 0
    assert any(seq_len < len(PROMPTS[i]) for i, seq_len, _ in v1.logits), "no prefill was chunked"
    # Same batches, same rows: every logits row agrees.
    assert [(i, n) for i, n, _ in v1.logits] == [(i, n) for i, n, _ in v2.logits]
    for (_, _, a), (_, _, b) in zip(v1.logits, v2.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---- many requests through a small batch ---------------------------------------------------------------
def _mixed_params(n: int, seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    kinds = [
        lambda: {"temperature": 0.0},
        lambda: {"temperature": 0.8},
        lambda: {"temperature": 1.0, "top_k": 7},
        lambda: {"temperature": 0.7, "top_p": 0.8},
        lambda: {"temperature": 1.2, "min_p": 0.05},
        lambda: {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.02},
    ]
    return [
        SamplingParams(seed=1000 + i, max_tokens=rng.randint(1, 24), ignore_eos=True, **kinds[i % len(kinds)]())
        for i in range(n)
    ]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def _check_batch_matches_scheduler(engine) -> None:  # type: ignore[no-untyped-def]
    """After a step, each running request's row holds its whole history and its KV blocks."""
    pb = engine.runner.batch
    for request in engine.scheduler.running:
        row = pb.req_id_to_row[request.request_id]
        assert pb.token_ids[row, : pb.num_tokens[row]].tolist() == request.all_token_ids
        assert pb.num_computed[row] == request.num_computed_tokens
        blocks = list(engine.kv_cache.blocks_of(request.request_id))
        assert pb.block_table[row, : pb.num_blocks[row]].tolist() == blocks


def test_thirty_requests_through_four_rows_match_v2(tiny_llm_factory) -> None:
    prompts, params = _prompts(30, seed=11), _mixed_params(30, seed=12)
    settings = {
        "max_num_seqs": 4,
        "max_num_batched_tokens": 24,
        "block_size": 4,
        "num_kv_blocks": 40,
        "max_model_len": 80,
    }
    v2 = tiny_llm_factory(runner="v2", **settings).generate(prompts, params, use_tqdm=False)
    # Synchronous steps: the check below compares the runner's rows with the scheduler's view after each step,
    # which async scheduling keeps one token apart by design (outputs are compared with V2's, async, above).
    llm = tiny_llm_factory(runner="v1", async_scheduling=False, **settings)
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"q{i}", prompt, p)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
        _check_batch_matches_scheduler(engine)
    v1 = [outputs[f"q{i}"] for i in range(30)]
    assert [o.token_ids for o in v1] == [o.token_ids for o in v2]
    assert [len(o.token_ids) for o in v1] == [p.max_tokens for p in params]
    pb = engine.runner.batch
    assert pb.num_moves > 0 and pb.num_swaps > 0, (pb.num_moves, pb.num_swaps)
    engine.step()  # nothing to run: the runner frees the rows of the last finished requests
    assert pb.num_reqs == 0 and pb.num_rows == 0 and engine.is_idle()


def test_request_finishing_mid_batch_moves_the_last_row_into_its_place(tiny_llm_factory) -> None:
    engine = tiny_llm_factory(runner="v1", max_num_seqs=4, async_scheduling=False).engine
    for i, n in enumerate([20, 3, 20, 20]):  # r1 finishes first, in the middle of the batch
        engine.add_request(f"r{i}", [10 + i, 20, 30], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    engine.step()
    pb = engine.runner.batch
    assert pb.req_ids[:4] == ["r0", "r1", "r2", "r3"]
    slots = {r: int(pb.state_slot[pb.req_id_to_row[r]]) for r in ("r0", "r2", "r3")}
    while "r1" not in [o.request_id for o in engine.step()]:
        pass
    engine.step()  # the runner frees r1's row at the next step: r3 moves into it, then rows follow the scheduler
    assert pb.num_moves == 1 and pb.req_ids[:3] == ["r0", "r2", "r3"] and pb.num_rows == 3
    _check_batch_matches_scheduler(engine)
    assert {r: int(pb.state_slot[pb.req_id_to_row[r]]) for r in slots} == slots  # ModelState slots never move


def test_seeded_sampling_equals_v2_with_preemption_chunking_and_aborts(tiny_llm_factory) -> None:
    prompts, params = _prompts(8, seed=3), _mixed_params(8, seed=4)
    settings = {
        "max_num_seqs": 4,
        "num_kv_blocks": 16,
        "block_size": 4,
        "max_model_len": 64,
        "max_num_batched_tokens": 8,
    }
    results = {}
    for runner in ("v2", "v1"):
        engine = tiny_llm_factory(runner=runner, **settings).engine
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(f"s{i}", prompt, p)
        outputs, steps = {}, 0
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step())
            steps += 1
            if steps == 6:  # abort a running request in the middle of the batch
                aborted = engine.abort_request(engine.scheduler.running[1].request_id)
                outputs[aborted.request_id] = aborted
        results[runner] = {r: (o.token_ids, o.finish_reason, o.num_preemptions) for r, o in outputs.items()}
    assert results["v1"] == results["v2"]
    reasons = [r[1] for r in results["v1"].values()]
    assert reasons.count("abort") == 1 and sum(r[2] for r in results["v1"].values()) > 0


def test_stop_tokens_end_requests_the_same_way(tiny_llm_factory) -> None:
    prompts = _prompts(6, seed=5)
    free = tiny_llm_factory(runner="v2").generate(
        prompts, SamplingParams(temperature=1.0, seed=9, max_tokens=12), use_tqdm=False
    )
    stop = SamplingParams(temperature=1.0, seed=9, max_tokens=12, stop_token_ids=[free[0].token_ids[3]])
    outs = {r: tiny_llm_factory(runner=r, max_num_seqs=3).generate(prompts, stop, use_tqdm=False) for r in ("v1", "v2")}
    assert [(o.token_ids, o.finish_reason) for o in outs["v1"]] == [(o.token_ids, o.finish_reason) for o in outs["v2"]]
    assert outs["v1"][0].finish_reason == "stop"


# ---- a stateful ModelState under V1 --------------------------------------------------------------------
class _TallyModelState(DefaultModelState):
    """Counts, per slot and on the device, the tokens each request sampled (V2-style slot indexing)."""

    name = "v1_test_tally"

    def __init__(self, model, hf_config, max_num_reqs, device):  # type: ignore[no-untyped-def]
        super().__init__(model, hf_config, max_num_reqs, device)
        self.counts = torch.zeros(max_num_reqs, dtype=torch.int32, device=device)
        self.slot_owner: dict[int, str] = {}
        self.final: dict[str, int] = {}

    def add_request(self, req_slot, request):  # type: ignore[no-untyped-def]
        assert req_slot not in self.slot_owner
        self.slot_owner[req_slot] = request.request_id
        self.counts[req_slot] = 0

    def remove_request(self, req_slot):  # type: ignore[no-untyped-def]
        self.final[self.slot_owner.pop(req_slot)] = int(self.counts[req_slot])

    def postprocess(self, batch, num_sampled, num_rejected):  # type: ignore[no-untyped-def]
        owners = [self.slot_owner[int(s)] for s in batch.idx_mapping.tolist()]
        assert owners == batch.request_ids  # batch rows map to the slots their requests were given
        self.counts[batch.idx_mapping.long()] += num_sampled


@pytest.fixture
def tally_state():
    MODEL_STATES.register(_TallyModelState.name, _TallyModelState)
    yield _TallyModelState
    MODEL_STATES.unregister(_TallyModelState.name)


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_model_state_keeps_stable_slots_while_v1_rows_move(tiny_llm_factory, tally_state, runner: str) -> None:
    prompts, params = _prompts(12, seed=6), _mixed_params(12, seed=7)
    llm = tiny_llm_factory(
        runner=runner, model_state=tally_state.name, max_num_seqs=3, max_num_batched_tokens=16, async_scheduling=False
    )  # synchronous steps make the row moves of this schedule certain
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.generate([[1, 2]], SamplingParams(max_tokens=1), use_tqdm=False)  # frees the last rows
    state = llm.engine.runner.model_state
    assert {o.request_id: len(o.token_ids) for o in outs}.items() <= state.final.items()
    if runner == "v1":
        assert llm.engine.runner.batch.num_moves > 0


# ---- decode graphs, their replay stood in for on the CPU -----------------------------------------------
def test_v1_decode_steps_replay_graphs_with_the_eager_tokens(tiny_llm_factory) -> None:
    """V1 routes pure decode batches (one token per row) that fit a captured size to `DecodeCudaGraphs.run`,
    padded to that size, and everything else to the eager forward; the tokens are the eager run's."""
    prompts, params = _prompts(7, seed=21), _mixed_params(7, seed=22)
    settings = {"max_num_seqs": 8, "max_num_batched_tokens": 32}
    eager = tiny_llm_factory(runner="v1", **settings).generate(prompts, params, use_tqdm=False)
    llm = tiny_llm_factory(runner="v1", **settings)
    runner = llm.engine.runner
    assert runner.cuda_graphs is None  # (no graphs on the CPU: captured below by running each step again)
    runner.capture_cuda_graphs(EagerReplayCapturer())
    assert runner.cuda_graphs is not None and runner.cuda_graphs.sizes == [1, 2, 4, 8]
    replayed = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in replayed] == [o.token_ids for o in eager]
    replays = {size: graph.num_replays for (size, _), graph in runner.cuda_graphs.graphs.items()}
    assert replays[8] > 0 and replays[2] > 0 and sum(replays.values()) > runner.eager_forwards, replays


def test_step_inputs_packed_into_one_copy_come_back_as_each_array() -> None:
    """`HostToDevice.many` sends a step's arrays as one byte buffer (on CUDA): packed at 16-byte offsets and
    viewed back with each dtype and shape, every value survives (mixed dtypes, odd sizes, 2-D, empty)."""
    from framework.runner.v1.inputs import pack, pack_layout, unpack

    rng = np.random.default_rng(0)
    hosts = {
        "a": rng.integers(-(2**40), 2**40, 7),
        "b": rng.integers(-9, 9, (3, 5)).astype(np.int32),
        "c": np.zeros(0, dtype=np.int64),
        "d": rng.integers(0, 2**31 - 1, 1).astype(np.int32),
        "e": rng.random(6).astype(np.float32),
    }
    offsets, total = pack_layout(hosts, 16)
    assert all(o % 16 == 0 for o in offsets.values()) and total % 16 == 0
    assert total >= sum(h.nbytes for h in hosts.values())
    staged = torch.full((total,), 255, dtype=torch.uint8)
    pack(hosts, offsets, staged.numpy())
    views = unpack(staged.clone(), hosts, offsets)
    for name, host in hosts.items():
        assert views[name].shape == host.shape and views[name].numpy().dtype == host.dtype, name
        assert np.array_equal(views[name].numpy(), host), name
