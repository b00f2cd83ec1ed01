"""The attention launch rules (framework/layers/attention/launch_config.py) on modelled costs and the measured tile
choices: KV splits with no batch-size cliff, decode tiles by programs per SM. Pure Python: no kernel runs.
"""

from __future__ import annotations

from framework.layers.attention import launch_config as lc


def test_split_rule_has_no_batch_size_cliff():
    """Modelled decode time with the chosen splits never grows faster than the batch.

    The trap this guards against: a rule like "split while rows x heads < SMs, else not" makes decode
    time nearly double at the batch size where splitting stops (shown below to fail the same check).
    """
    num_sms, num_kv_heads, block_n = 132, 8, 128

    def worst_growth(rule, max_seq_len):
        costs = [
            lc.modelled_split_cost(r, num_kv_heads, max_seq_len, num_sms, block_n, rule(r, max_seq_len))
            for r in range(1, 1025)
        ]
        assert all(a <= b for a, b in zip(costs, costs[1:]))  # more rows never get faster
        return max(b / a * r / (r + 1) for r, (a, b) in enumerate(zip(costs, costs[1:]), 1))

    def chosen(r, n):
        return lc.num_kv_splits(r, num_kv_heads, n, num_sms, block_n)

    def trap(r, n):
        return 8 if r * num_kv_heads < num_sms else 1

    for max_seq_len in (512, 1024, 4096, 32768):
        assert worst_growth(chosen, max_seq_len) <= 1.05, max_seq_len
        assert lc.num_kv_splits(1, num_kv_heads, max_seq_len, num_sms, block_n) > 1  # one long row is split
    assert worst_growth(trap, 4096) >= 1.5
    assert lc.num_kv_splits(1024, 8, 4096, 132, block_n) == 1  # a full batch is not
    assert lc.num_kv_splits(1, 8, 128, 132, block_n) == 1  # nor a sequence of one tile (MIN_SPLIT_TOKENS)
    # The rule's choices (bf16, 8 KV heads, 128-key tiles). On an H200 at 4,096 keys one row measured 16
    # splits ~2 % faster than these 32 in the batch-1 chain (docs/benchmarks.md): the model has no merge term.
    assert [lc.num_kv_splits(b, 8, 4096, 132, block_n) for b in (1, 16, 64, 256)] == [32, 2, 1, 1]
    assert lc.num_kv_splits(1, 8, 2048, 132, block_n) == 16  # nano's max_model_len: one 128-key tile a split


def test_decode_tiles_rule():
    """By programs per SM, for batches of short rows (launch_config.decode_tiles, from the H200 sweep at
    nano's draining batches): 64/2/3 from 7 a SM (128+ rows of 8 KV heads on 132 SMs), 64/4/2 from 5 (83-127
    rows), 128/4/2 below and for long contexts."""

    def tiles(batch, max_seq_len, num_kv_heads=8, group=2):
        t = lc.decode_tiles(
            128, group, True, 2, num_programs=batch * num_kv_heads, max_seq_len=max_seq_len, num_sms=132
        )
        return t.block_n, t.num_warps, t.num_stages

    for batch, max_seq_len in ((256, 640), (256, 2048), (192, 1355), (128, 1200), (116, 1590)):
        assert tiles(batch, max_seq_len) == (64, 2, 3), (batch, max_seq_len)
        assert tiles(batch, max_seq_len, group=4) == (64, 2, 3), (batch, max_seq_len)  # the 8B's GQA group
        assert lc.num_kv_splits(batch, 8, max_seq_len, 132, 64) == 1  # the rule's regime: one split
    for batch, max_seq_len in ((115, 1700), (96, 1700), (83, 2048)):
        assert tiles(batch, max_seq_len) == (64, 4, 2), (batch, max_seq_len)
    for batch, max_seq_len in (
        (82, 1820),
        (64, 1500),
        (48, 1870),
        (33, 2048),
        (32, 2048),
        (16, 1800),
        (4, 1900),
        (1, 1900),
        (256, 4096),
        (64, 2049),
        (128, 2049),
    ):
        assert tiles(batch, max_seq_len) == (128, 4, 2), (batch, max_seq_len)
    assert tiles(256, 1024, group=32) == (128, 4, 2)  # 32-row query tiles: not measured
    assert lc.decode_tiles(128, 2, True) == lc.AttentionTiles(16, 128, 4, 2)  # no shape given: as before
