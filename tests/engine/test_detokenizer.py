"""Incremental detokenization against one `tokenizer.decode(all_ids)`, with characters split across tokens."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from framework.engine.detokenizer import (
    REPLACEMENT_CHAR,
    ByteStreamDetokenizer,
    IncrementalDetokenizer,
    make_detokenizer,
)
from framework.models.tokenizer import ByteTokenizer

TEXT = "naïve café: 日本語 🙂 ok, Größe — 𝔘𝔫𝔦 end"


def _byte_level_bpe() -> PreTrainedTokenizerFast:
    """A small byte-level BPE (the GPT-2 / Qwen kind) trained here on ASCII only: every non-ASCII character is
    two to four byte tokens, so each is split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the naive cafe ok end size uni " * 20], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("kind", ["bytes", "byte-level-bpe"])
def test_incremental_text_equals_one_decode_of_all_ids(kind):
    tokenizer = ByteTokenizer() if kind == "bytes" else _byte_level_bpe()
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    split = [i for i in range(1, len(ids)) if REPLACEMENT_CHAR in tokenizer.decode(ids[:i])]
    assert len(split) >= 5, "the case must split characters across tokens"
    detok = IncrementalDetokenizer(tokenizer)
    released = []
    for i, token in enumerate(ids):
        released.append(detok.append(token))
        assert REPLACEMENT_CHAR not in detok.text, f"half a character released after token {i}"
        assert TEXT.startswith(detok.text)
    released.append(detok.flush())
    assert "".join(released) == detok.text == tokenizer.decode(ids)


def test_an_incomplete_last_character_is_released_by_flush_as_decode_does():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("ok 🙂")[:-2]  # the emoji's last two bytes never come
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.append(t) for t in ids) == "ok "
    detok.flush()
    assert detok.text == tokenizer.decode(ids)


def test_the_byte_stream_detokenizer_releases_what_the_windowed_one_does():
    """`make_detokenizer` picks the byte stream for the byte tokenizer; on valid text with split characters it
    releases the same text at the same tokens as `IncrementalDetokenizer`, and on any ids (invalid bytes,
    ids without text, a character cut at the end) its flushed text is `tokenizer.decode(ids)`."""
    import random

    tokenizer = ByteTokenizer()
    assert isinstance(make_detokenizer(tokenizer), ByteStreamDetokenizer)
    assert isinstance(make_detokenizer(_byte_level_bpe()), IncrementalDetokenizer)
    ids = tokenizer.encode(TEXT)
    fast, windowed = ByteStreamDetokenizer(), IncrementalDetokenizer(tokenizer)
    assert [fast.append(t) for t in ids] == [windowed.append(t) for t in ids]
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice([rng.randrange(0, 128), rng.randrange(128, 258), 0xF0, 0x9F]) for _ in range(12)]
        fast = ByteStreamDetokenizer()
        released = [fast.append(t) for t in ids] + [fast.flush()]
        assert "".join(released) == fast.text == tokenizer.decode(ids), ids
