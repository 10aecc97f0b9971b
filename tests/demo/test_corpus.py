"""The stdlib corpus and the word-level tokenizer with byte fallback."""

from __future__ import annotations

import pytest
import torch

from cce_compile.demo import corpus


@pytest.fixture(scope="module")
def small_text():
    return corpus.read_corpus(max_bytes=200_000)


def test_corpus_is_deterministic_real_text(small_text):
    assert corpus.read_corpus(max_bytes=200_000) == small_text
    assert len(small_text) >= 200_000 and "def " in small_text and "import" in small_text


def test_vocabulary_deterministic_and_sized(small_text):
    words = corpus.split_words(small_text)
    first, second = corpus.Tokenizer.train(words, 1000), corpus.Tokenizer.train(words, 1000)
    assert first.words == second.words and first.vocab_size == 1000
    with pytest.raises(ValueError, match="vocab"):
        corpus.Tokenizer.train(words, 256)


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return x  # ünïcödé ✓",
        "\t\t  \n",
        "λ→∞",
        "zzqx_never_seen_identifier = 0x1F",
    ],
    ids=["code", "whitespace", "symbols", "unknown-word"],
)
def test_byte_fallback_round_trip(small_text, text):
    tokenizer = corpus.Tokenizer.train(corpus.split_words(small_text), 600)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert all(0 <= i < tokenizer.vocab_size for i in ids)


def test_unknown_words_fall_back_to_bytes(small_text):
    tokenizer = corpus.Tokenizer.train(corpus.split_words(small_text), 600)
    ids = tokenizer.encode("zzqx_never_seen_identifier")
    assert all(i < corpus.BYTE_TOKENS for i in ids)
    assert len(ids) == len("zzqx_never_seen_identifier")


def test_cache_round_trip(tmp_path):
    tokenizer, ids = corpus.load(700, tmp_path, max_bytes=50_000)
    files = list(tmp_path.glob("stdlib-*.pt"))
    assert len(files) == 1
    again, ids_again = corpus.load(700, tmp_path, max_bytes=50_000)
    assert again.words == tokenizer.words and torch.equal(ids, ids_again)
    assert ids.dtype == torch.int32 and int(ids.max()) < tokenizer.vocab_size


def test_load_encodes_the_text_it_read(tmp_path):
    """load() splits the text once for both the counting and the encoding: the ids are those
    of encoding the text."""
    tokenizer, ids = corpus.load(700, tmp_path, max_bytes=50_000)
    assert ids.tolist() == tokenizer.encode(corpus.read_corpus(max_bytes=50_000))
