"""Paged drafting with EAGLE / EAGLE-3 / MTP heads equals the heads' full-sequence reference forward.

A fake target (a fixed random hidden state per request and position) drives the real per-step machinery:
RequestState, BlockTables, build_input_batch, the attention metadata and post_update. Acceptance is chosen
by the test (every count from 0 to k occurs), prompts are chunked, one request is preempted and resumed.
After every step each request's drafts must equal what the head's full-sequence forward predicts from the
request's true history.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_draft_heads import KINDS, TARGET, hidden_width, random_head

from framework.batch.block_tables import BlockTables
from framework.batch.input_batch import build_input_batch
from framework.batch.request_state import RequestState
from framework.layers.kernels.input_prep import post_update
from framework.params.sampling_params import SamplingParams
from framework.params.scheduler_output import NewRequestData, SchedulerOutput
from model_states.default import DefaultModelState
from speculators.draft_graphs import DraftStepGraphs
from speculators.draft_heads import DraftHead, Eagle3Head
from speculators.draft_inputs import prepare_draft_inputs_reference, prepare_draft_inputs_triton
from speculators.head_drafter import HeadDrafter
from speculators.interface import ProposeInputs

K, BLOCK_SIZE, MAX_LEN, VOCAB = 3, 4, 64, TARGET["vocab_size"]


class FakeTargetRun:
    """Requests whose target hidden state at position p is a fixed random vector; tokens are the truth."""

    def __init__(self, head: DraftHead, seed: int, graph_sizes: tuple[int, ...] = ()) -> None:
        self.head, self.rng = head, random.Random(seed)
        self.width = hidden_width(head)
        self.state = RequestState(4, MAX_LEN, K, torch.device("cpu"))
        self.tables = BlockTables(4, MAX_LEN // BLOCK_SIZE, BLOCK_SIZE, torch.device("cpu"))
        self.model_state = DefaultModelState(None, {}, 4, torch.device("cpu"))  # type: ignore[arg-type]
        self.kv = torch.zeros(head.kv_cache_shape(4 * MAX_LEN // BLOCK_SIZE, BLOCK_SIZE))
        aux = (0, 1, 2) if isinstance(head, Eagle3Head) else ()
        self.drafter = HeadDrafter(head, 4, MAX_LEN, torch.device("cpu"), aux_layer_ids=aux)
        self.drafter.bind_kv_cache(self.kv)
        if graph_sizes:
            self.drafter.graphs = eager_draft_graphs(self.drafter, list(graph_sizes), [K], MAX_LEN // BLOCK_SIZE)
        gen = torch.Generator().manual_seed(seed)
        self.true_hidden = {r: torch.randn(MAX_LEN, self.width, generator=gen) for r in "abc"}
        self.seq: dict[str, list[int]] = {}  # true tokens (prompt, then output)
        self.computed: dict[str, int] = {}
        self.drafts: dict[str, list[int]] = {}
        self.blocks = {
            r: list(range(i * MAX_LEN // BLOCK_SIZE, (i + 1) * MAX_LEN // BLOCK_SIZE)) for i, r in enumerate("abc")
        }

    def add(self, rid: str, prompt: list[int]) -> NewRequestData:
        self.seq[rid], self.computed[rid], self.drafts[rid] = list(prompt), 0, []
        return NewRequestData(rid, list(prompt), len(prompt), SamplingParams(), 0, self.blocks[rid], 0)

    def step(self, rows: list[tuple[str, int]], new: list[NewRequestData], finished: set[str] = frozenset()) -> None:
        """Run one step: rows are (request, prefill chunk size) or (request, 0) for a decode with K drafts."""
        for rid in finished:
            slot = self.state.remove_request(rid)
            self.tables.remove_request(slot)
        for data in new:
            slot = self.state.add_request(data)
            self.tables.add_request(slot, data.block_ids)
        self.state.apply_staged_writes()
        self.tables.apply_staged_writes()
        ids = [r for r, _ in rows]
        decode = [n == 0 for _, n in rows]
        num_draft = [K if d else 0 for d in decode]
        num_sched = [1 + K if d else n for (_, n), d in zip(rows, decode)]
        out = SchedulerOutput(ids, num_sched, num_draft, new, [], num_propose_tokens=K)
        batch = build_input_batch(out, self.state, torch.device("cpu"))
        meta = self.model_state.prepare_attn_metadata(batch, self.tables)
        hidden = torch.cat(
            [self.true_hidden[r][self.computed[r] : self.computed[r] + n] for r, n in zip(ids, num_sched)]
        )
        sampled = torch.zeros(len(ids), K + 1, dtype=torch.int64)
        num_sampled, num_rejected = [], []
        for i, (rid, n) in enumerate(zip(ids, num_sched)):
            seq = self.seq[rid]
            if decode[i]:  # accept a chosen number of drafts; the next true token differs from the next draft
                accepted = self.rng.randint(0, K)
                drafts = self.drafts[rid]
                bonus = self.rng.choice([t for t in range(VOCAB) if accepted == K or t != drafts[accepted]])
                tokens = drafts[:accepted] + [bonus]
                num_rejected.append(K - accepted)
            else:
                done = self.computed[rid] + n >= len(seq)
                tokens = [self.rng.randrange(VOCAB)] if done else []
                num_rejected.append(0)
            sampled[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            num_sampled.append(len(tokens))
            self.computed[rid] += n - num_rejected[-1]
            seq.extend(tokens)
        ns, nr = torch.tensor(num_sampled, dtype=torch.int32), torch.tensor(num_rejected, dtype=torch.int32)
        rs = self.state
        post_update(
            batch.idx_mapping,
            batch.query_lens,
            sampled,
            ns,
            nr,
            rs.all_token_ids,
            rs.total_len,
            rs.num_computed,
            rs.last_sampled,
        )
        aux = tuple(hidden.chunk(3, dim=-1)) if self.drafter.aux_layer_ids else ()
        capacity = torch.full((len(ids),), MAX_LEN, dtype=torch.int32)  # every request holds all its blocks
        inputs = ProposeInputs(batch, hidden, aux, sampled, ns, nr, rs, K, meta, capacity)
        drafts = self.drafter.propose(inputs, meta)
        rs.draft_tokens[batch.idx_mapping.long()] = drafts.to(torch.int32)
        for i, rid in enumerate(ids):
            if num_sampled[i]:
                self.drafts[rid] = drafts[i].tolist()
                assert self.drafts[rid] == self.reference_drafts(rid), (rid, len(self.seq[rid]))

    @torch.no_grad()
    def reference_drafts(self, rid: str) -> list[int]:
        """Drafts of the full-sequence forward: (token p+1, target hidden p) for every known p, then feedback."""
        seq = self.seq[rid]
        ids = list(seq[1:])
        target = self.true_hidden[rid][: len(seq) - 1]
        if isinstance(self.head, Eagle3Head):  # fc once, so target rows and fed-back rows share one width
            target = self.head.fc(target)
        hid = list(target)
        drafts: list[int] = []
        for i in range(K):
            out = self.head(torch.tensor([ids]), torch.stack(hid)[None])[0, -1]
            tok = int(self.head.draft_token_ids(out, 0))
            drafts.append(tok)
            ids.append(tok)
            hid.append(out)
        return drafts


class ReplayEagerly:
    """Stands in for a captured CUDA graph on the CPU: replay reruns the steps into the captured output."""

    def __init__(self, graphs: DraftStepGraphs, size: int, k: int, out: torch.Tensor) -> None:
        self.graphs, self.size, self.k, self.out = graphs, size, k, out

    def replay(self) -> None:
        self.out.copy_(self.graphs._steps(self.size, self.k))


def eager_draft_graphs(drafter: HeadDrafter, sizes: list[int], ks: list[int], max_blocks: int) -> DraftStepGraphs:
    """`DraftStepGraphs` with eager replays: checks its static buffers, padding rows and slicing on the CPU."""
    graphs = DraftStepGraphs(drafter, sizes, ks, BLOCK_SIZE, max_blocks, torch.float32)
    for k in ks:
        for size in sizes:
            out = graphs._steps(size, k)
            graphs.graphs[(size, k)] = (ReplayEagerly(graphs, size, k, out), out)  # type: ignore[assignment]
    return graphs


GRAPH_CASES = [(kind, kwargs, ()) for kind, kwargs in KINDS] + [("mtp", {}, (2, 4))]


@pytest.mark.parametrize("kind,kwargs,graph_sizes", GRAPH_CASES, ids=[k for k, _ in KINDS] + ["mtp-graph-buffers"])
def test_paged_drafting_equals_full_sequence_reference(kind: str, kwargs: dict, graph_sizes: tuple) -> None:
    run_scenario(FakeTargetRun(random_head(kind, seed=3, **kwargs), seed=11, graph_sizes=graph_sizes))


def run_scenario(run: FakeTargetRun) -> None:
    """Chunked prefills, decodes with every acceptance count, a preemption and a resume in two chunks; every
    step's drafts are checked against the full-sequence reference (`FakeTargetRun.step`)."""
    rnd = random.Random(5)
    prompts = {r: [rnd.randrange(VOCAB) for _ in range(n)] for r, n in zip("abc", (7, 13, 5))}
    run.step([("a", 7), ("b", 5)], [run.add("a", prompts["a"]), run.add("b", prompts["b"])])
    run.step([("a", 0), ("b", 8), ("c", 5)], [run.add("c", prompts["c"])])
    for _ in range(3):
        run.step([("a", 0), ("b", 0), ("c", 0)], [])
    # Preempt b, resume it with its whole history as the prefill (in two chunks), while a and c decode.
    history = list(run.seq["b"])
    run.step([("a", 0), ("c", 0)], [], finished={"b"})
    resumed = run.add("b", history)
    run.step([("a", 0), ("b", 10), ("c", 0)], [resumed])
    run.step([("b", len(history) - 10), ("a", 0)], [])
    for _ in range(2):
        run.step([("c", 0), ("b", 0), ("a", 0)], [])


@pytest.mark.parametrize("seed", [0, 1])
def test_prepare_draft_inputs_triton_matches_reference(seed: int) -> None:
    """Rows that decode with rejections, finish a prefill, or stop mid-prefill (next token from the history)."""
    gen = torch.Generator().manual_seed(seed)
    num_rows, slots, max_len = 5, 8, 40
    query_lens = torch.tensor([4, 1, 7, 4, 3], dtype=torch.int32)
    qsl = torch.zeros(num_rows + 1, dtype=torch.int32)
    qsl[1:] = query_lens.cumsum(0)
    num_tokens = int(qsl[-1])
    idx_mapping = torch.randperm(slots, generator=gen)[:num_rows].int()
    seq_lens = torch.tensor([20, 9, 7, 39, 40], dtype=torch.int32)  # row 4 ends at max_len (no history read)
    num_sampled = torch.tensor([2, 1, 0, 4, 0], dtype=torch.int32)
    num_rejected = torch.tensor([2, 0, 0, 0, 0], dtype=torch.int32)
    sampled = torch.randint(0, 100, (num_rows, 4), generator=gen)
    history = torch.randint(0, 100, (slots, max_len), generator=gen).int()
    input_ids = torch.randint(0, 100, (num_tokens,), generator=gen)
    args = (input_ids, qsl, idx_mapping, seq_lens, sampled, num_sampled, num_rejected, history)
    ref = prepare_draft_inputs_reference(*args)
    tri = prepare_draft_inputs_triton(*args)
    assert torch.equal(ref.last_token_index, tri.last_token_index)
    assert ref.last_token_index.tolist() == [1, 4, 11, 15, 18]
    assert torch.equal(ref.input_ids, tri.input_ids)
    assert int(ref.input_ids[1]) == int(sampled[0, 1])  # row 0: 2 sampled, 2 rejected
    assert int(ref.input_ids[11]) == int(history[idx_mapping[2], 7])  # row 2: next prompt token
    assert ref.input_ids[:1].tolist() == input_ids[1:2].tolist()
