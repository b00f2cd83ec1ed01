"""The fused sampling path on bfloat16 logits (the LM head's dtype, read as they are): the tokens of their float32
copy on every path of the fused sampler, and the Sampler handing the fused kernels bf16 logits only when no stage
before them reads the logits. Negative control: a widening one ulp off is caught.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from helpers.sampler_cases import Slot, make_sampler
from test_sampler_fused import DEVICE, _check, _logits, _params, small_blocks  # noqa: F401 (autouse fixture)

import samplers.fused_sampling
import samplers.triton_utils
from framework import SamplingParams
from samplers.fused_sampling import sample_fused_triton


def _check_bf16(logits, idx, positions, params, **kwargs):
    """`logits` rounded to bf16 (the LM head's dtype), with a one-ulp near tie on the rows of greedy slot 0 and of
    k = 1 slot 2 (token V-1 at 12.0625 beats token 3 at 12.0): the fused path on the bf16 logits themselves samples
    the tokens and errors of their `.float()` copy, which `_check` holds to the reference."""
    x = logits.bfloat16()
    near_tie = ((idx == 0) | (idx == 2)).nonzero().flatten()
    if x.shape[1] > 4:
        x[near_tie, 3], x[near_tie, -1] = 12.0, 12.0625  # both exact in bf16, one ulp apart
    expected = _check(x.float(), idx, positions, params, **kwargs)
    got = sample_fused_triton(x, idx, positions, params, **kwargs)
    assert got.sampled.tolist() == expected.sampled.tolist()
    assert got.errors.tolist() == expected.errors.tolist()


@pytest.mark.parametrize("vocab,ties", [(37, False), (130, True)])
def test_bf16_logits_sample_the_tokens_of_their_float32_copy(vocab, ties):
    """The LM head's bf16 logits read by the fused kernels as they are (widened in registers): every slot of
    `_params` (greedy, temperature, top-k, top-p, min-p, both filters), NaN / +inf / all -inf rows."""
    rows = 16
    params = _params(vocab)
    idx = (torch.arange(rows, device=DEVICE) * 5 % len(params.seed)).int()
    positions = torch.arange(rows, device=DEVICE) * 1001 + 3
    _check_bf16(_logits(rows, vocab, seed=vocab + ties, ties=ties), idx, positions, params)


def test_bf16_logits_on_every_path_of_the_fused_sampler(monkeypatch):
    """bf16 logits through the paths but the default one: every row gathering (no sample kernel), no plan, and the
    exact slow path (a buffer of 16: overflowing rows, flat top-p rows), which reads the row itself."""
    vocab, rows = 130, 12
    params = _params(vocab)
    positions = torch.arange(rows, device=DEVICE) * 13 + 2
    logits = _logits(rows, vocab, seed=6, ties=False)
    gather = torch.tensor([2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 2], dtype=torch.int32, device=DEVICE)
    _check_bf16(logits, gather, positions, params, all_gather=True)
    _check_bf16(logits, torch.arange(rows, device=DEVICE).int() % 2, positions, params, need_plan=False)
    monkeypatch.setattr(samplers.fused_sampling, "CAP", 16)
    monkeypatch.setattr(samplers.fused_sampling, "GROUP", 16)
    _check_bf16(
        logits / 4, torch.tensor([11, 10, 13, 12, 8, 4] * 2, dtype=torch.int32, device=DEVICE), positions, params
    )


@triton.jit
def _lossy_load_x(row_ptr, offs, mask, SANITIZE: tl.constexpr):
    """A planted fault: a widening that drops the last bit of every bf16 mantissa (NaN and +-inf unchanged)."""
    x = tl.load(row_ptr + offs, mask=mask, other=-float("inf")).to(tl.float32)
    return samplers.fused_sampling._sanitized(
        (x.to(tl.int32, bitcast=True) & ~0x10000).to(tl.float32, bitcast=True), SANITIZE
    )


def test_bf16_check_catches_an_inexact_widening(monkeypatch):
    """Negative control of `_check_bf16`: kernels that read the bf16 logits one ulp off sample another token on
    the near-tie rows."""
    monkeypatch.setattr(samplers.fused_sampling, "_load_x", _lossy_load_x)
    params = _params(37)
    idx = torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError):
        _check_bf16(_logits(6, 37, seed=2, ties=False), idx, torch.arange(6, device=DEVICE), params)


BF16_SLOTS = [  # greedy, temperature, top-k, top-p, min-p, all of them
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.0, top_k=5, seed=2),
    SamplingParams(temperature=0.7, top_p=0.6, seed=3),
    SamplingParams(temperature=1.2, min_p=0.2, seed=4),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("extra", [{}, dict(logprobs=3), dict(logit_bias={17: 0.01}, repetition_penalty=1.3)])
def test_sampler_gives_bf16_logits_to_the_fused_kernels_only_when_nothing_reads_them_before(monkeypatch, extra):
    """The Sampler on bf16 logits against the same logits `.float()`: the same tokens, errors and logprobs. The
    fused kernels read the bf16 logits themselves when no stage before them reads the logits; logprobs, bias and
    penalties (float32 arithmetic) get a float32 copy: the bias of 0.01 on token 17, below bf16's ulp at 10, breaks
    its tie with token 11 on the greedy rows. Negative control: with the copy skipped (planted), the logprobs differ
    (rounded to bf16) and the CPU's bias reference refuses bf16."""
    import samplers.sampler
    from samplers.states import SamplingStages

    vocab = 90
    fields = ("temperature", "top_k", "top_p", "min_p", "seed")
    slots = [
        Slot(SamplingParams(**{k: getattr(p, k) for k in fields}, **extra), prompt=[1, 2, 3], output=[4, 4], seed=i)
        for i, p in enumerate(BF16_SLOTS)
    ]
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(3)) * 3
    logits[:, 11] = logits[:, 17] = 10.0  # an exact tie above the rest (neither a seen token)
    logits[5, 9] = float("nan")
    logits[6, 1] = float("inf")
    x = logits.bfloat16()
    idx = torch.tensor([0, 1, 2, 3, 4, 5, 0, 5], dtype=torch.int32)
    positions = torch.arange(8) + 5
    fed: list[torch.dtype] = []
    real = samplers.sampler.sample_fused_triton
    monkeypatch.setattr(
        samplers.sampler,
        "sample_fused_triton",
        lambda logits, *a, **k: fed.append(logits.dtype) or real(logits, *a, **k),
    )

    def run(values):
        sampler, _ = make_sampler(slots, vocab)
        sampler.fused = True
        return sampler(values.clone(), idx, positions, sampler.states.stages_for(np.arange(len(slots))))

    def same(a, b):
        return (
            a.sampled_token_ids.tolist() == b.sampled_token_ids.tolist()
            and a.errors.tolist() == b.errors.tolist()
            and (a.logprobs is None) == (b.logprobs is None)
            and (a.logprobs is None or all(torch.equal(u, v) for u, v in zip(a.logprobs, b.logprobs)))
        )

    want = run(x.float())
    assert same(run(x), want)
    assert want.errors.tolist() == [0, 0, 0, 0, 0, 1, 1, 0]
    assert want.sampled_token_ids[0] == (17 if "logit_bias" in extra else 11)
    assert (want.logprobs is not None) == ("logprobs" in extra)
    assert fed == [torch.float32, torch.bfloat16 if not extra else torch.float32]
    if extra:  # the planted fault: no float32 copy before the stages that read the logits
        monkeypatch.setattr(SamplingStages, "any_logits_read", property(lambda self: False))
        try:
            assert not same(run(x), want)
        except RuntimeError as error:  # on the CPU the bias reference refuses bf16 outright
            assert "dtype" in str(error) and "logit_bias" in extra
