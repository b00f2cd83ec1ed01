"""Decode graphs vs eager on the same requests, step by step (shared by the CPU and GPU tests).

Two engines get the same arrivals; after every step their outputs must be equal and every real slot's Mamba
state (and the snapshot pools, with prefix caching) close. The helpers also record what the graphed engine did
(replays with their padding, snapshots copied around replays, preemptions), so a test can assert that the
claim was exercised and not passed vacuously.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from framework.entrypoints.llm import LLM
from framework.params.sampling_params import SamplingParams

Arrival = tuple[int, list[int], SamplingParams]  # (step, prompt, params)


def hybrid_scenarios(block_size: int) -> dict[str, dict[str, Any]]:
    """LLM keyword arguments per scenario; the preemption one holds 1.5 requests of max_model_len=32."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    return {
        "join_leave": {},
        "preempt": {"block_size": block_size, "num_kv_blocks": 48 // block_size, "max_model_len": 32},
        "ngram": {"speculative_config": ngram},
        "prefix": {"block_size": block_size, "enable_prefix_caching": True},
        "prefix_ngram": {
            "block_size": block_size,
            "enable_prefix_caching": True,
            "speculative_config": {**ngram, "num_speculative_tokens": 2},
        },
    }


def workload(scenario: str, block_size: int = 4, max_tokens: tuple[int, int] = (4, 14)) -> list[Arrival]:
    """Nine requests with staggered arrivals (quick ones with drafts), different lengths (`max_tokens` in
    [lo, hi)), greedy and seeded rows; the prefix scenarios share more than one block."""
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 250, 3 * block_size).tolist()
    repeats = [7, 8, 9, 10] * (-(-(block_size + 4) // 4))  # > one block
    out = []
    for i in range(9):
        suffix = rng.integers(0, 250, int(rng.integers(1, 6))).tolist()
        if scenario == "ngram":
            prompt = [7, 8, 9, 10] * 3 + [7, 8]  # repeats: ngram proposes drafts
        elif scenario == "prefix_ngram":
            prompt = repeats + suffix + [7, 8]
        elif scenario == "prefix":
            prompt = shared + suffix
        else:
            prompt = rng.integers(0, 250, int(rng.integers(3, 14))).tolist()
        params = SamplingParams(
            temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=int(rng.integers(*max_tokens)), ignore_eos=True
        )
        quick = scenario in ("ngram", "preempt")  # many rows at once: padded draft rows, a full KV cache
        out.append(((i if quick else 2 * i) if i < 6 else 12 + i, prompt, params))
    return out


def record_replays(llm: LLM) -> list[tuple[int, int, int]]:
    """(real rows, padded rows, tokens per row) of every replay from now on."""
    graphs = llm.engine.runner.graphs.cuda_graphs
    assert graphs is not None, "no decode graphs were captured"
    log: list[tuple[int, int, int]] = []
    run = graphs.run

    def recorded(size, ids, pos, meta, **kw):  # type: ignore[no-untyped-def]
        log.append((meta.num_rows, size, meta.num_tokens // meta.num_rows))
        return run(size, ids, pos, meta, **kw)

    graphs.run = recorded  # type: ignore[method-assign]
    return log


def record_snapshot_copies(llm: LLM) -> list[int]:
    """[from slots, from tails]: snapshots the hybrid state copies around replays, from now on."""
    state = llm.engine.runner.model_state
    counts = [0, 0]
    copy = state._copy_snapshots

    def counted(batch, snapshots, tails):  # type: ignore[no-untyped-def]
        counts[tails is not None] += len(snapshots)
        copy(batch, snapshots, tails)

    state._copy_snapshots = counted
    return counts


def record_preemptions(llm: LLM) -> list[str]:
    scheduler, log = llm.engine.scheduler, []
    preempt = scheduler._preempt
    scheduler._preempt = lambda request: (log.append(request.request_id), preempt(request))[1]
    return log


# (step, the eager engine's outputs of the step, the graphed engine's): asserts whatever must agree.
StepCheck = Callable[[int, list, list], None]


def run_in_lockstep(eager: LLM, graphed: LLM, work: list[Arrival], check: StepCheck) -> dict[str, list[int]]:
    """Both engines get the arrivals of `work` at their steps and step together; `check` compares every step.
    Returns each request's tokens as of its last output."""
    a, b = eager.engine, graphed.engine
    tokens: dict[str, list[int]] = {}
    step = 0
    while step < 300 and (work or a.has_unfinished_requests() or b.has_unfinished_requests()):
        for arrival, prompt, params in [w for w in work if w[0] == step]:
            for engine in (a, b):
                engine.add_request(f"r{arrival}", prompt, params)
        work = [w for w in work if w[0] != step]
        outs = [engine.step() for engine in (a, b)]
        check(step, outs[0], outs[1])
        tokens.update({o.request_id: list(o.token_ids) for o in outs[0]})
        step += 1
    assert not work and not a.has_unfinished_requests(), "the run did not finish"
    return tokens


def lockstep(
    eager: LLM, graphed: LLM, work: list[Arrival], rtol: float = 1e-5, atol: float = 1e-6
) -> dict[str, list[int]]:
    """Run both engines through `work`: equal tokens and close recurrent state after every step; returns the tokens."""
    sa, sb = eager.engine.runner.model_state, graphed.engine.runner.model_state
    real = slice(0, sa.max_num_reqs)  # the dummy slot is nobody's: it may differ
    close = dict(rtol=rtol, atol=atol)

    def check(step: int, outs_a: list, outs_b: list) -> None:
        tokens = [{o.request_id: list(o.token_ids) for o in outs} for outs in (outs_a, outs_b)]
        assert tokens[0] == tokens[1], f"step {step}: tokens differ"
        for slab_b, slab_a in zip(sb.slabs, sa.slabs):
            torch.testing.assert_close(slab_b[:, real], slab_a[:, real], **close)
        for pool_b, pool_a in zip(sb.snapshot_pools or [], sa.snapshot_pools or []):
            torch.testing.assert_close(pool_b, pool_a, **close)

    return run_in_lockstep(eager, graphed, work, check)


def check_exercised(
    scenario: str,
    eager: LLM,
    graphed: LLM,
    tokens: dict[str, list[int]],
    replays: list[tuple[int, int, int]],
    snapshots: list[int],
    preempted: list[str],
    tail_snapshots: bool = True,
) -> None:
    """The run did what the scenario is about: replays with padding, drafts, preemption, snapshots, hits.

    A snapshot after the first token of a row verifying drafts needs a block to end exactly there while the
    row's tokens are on the host, which depends on how many drafts were accepted: `tail_snapshots=False` where
    the tokens (and so the acceptance) are not known in advance, as on a GPU."""
    assert len(tokens) == 9 and all(tokens.values())
    assert graphed.engine.runner.eager_forwards < eager.engine.runner.eager_forwards
    assert any(rows < size for rows, size, _ in replays), "no replay had padding rows"
    if "ngram" in scenario:
        assert any(q > 1 and rows < size for rows, size, q in replays), "no padded replay verified drafts"
        assert graphed.get_metrics()["spec_decode"]["num_accepted_tokens"] > 0
    assert bool(preempted) == (scenario == "preempt")
    if scenario == "prefix":
        assert snapshots[0] > 0, "no snapshot was copied from a slot around a replay"
    if scenario == "prefix_ngram" and tail_snapshots:  # after the first token of a row verifying drafts
        assert snapshots[1] > 0, "no snapshot was copied from a tail"
    if "prefix" in scenario:
        assert graphed.engine.prefix_cache_stats.hits > 0
