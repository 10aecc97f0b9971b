"""A corpus that exists on every machine with Python: the standard library's source files.

The tokenizer is word-level: identifiers, numbers, runs of spaces and single punctuation marks
are tokens. The vocabulary is the ``vocab - 256`` most frequent of them plus 256 byte tokens, so
any text round-trips: a word outside the vocabulary is spelled in its UTF-8 bytes. Everything
is deterministic (sorted files, frequency then lexical order) and cached on disk.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import pathlib
import re
import sys
import sysconfig

import torch

BYTE_TOKENS = 256
_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+| +|\n|\t|[^\sA-Za-z0-9_]|[^\S\n\t ]")


@functools.cache
def stdlib_files() -> tuple[pathlib.Path, ...]:
    """The interpreter's standard-library .py files, sorted (no site-packages); walked once
    per process (the banner, the cache key and the corpus all list them)."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return tuple(sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts))


def read_corpus(max_bytes: int | None = None) -> str:
    parts, total = [], 0
    for path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            break
    return "\n".join(parts)


def split_words(text: str) -> list[str]:
    return _TOKEN.findall(text)


class Tokenizer:
    """Word-level vocabulary of the most frequent tokens, with a 256-byte fallback."""

    def __init__(self, words: list[str]):
        self.words = words  # ids BYTE_TOKENS.. are words; ids 0..255 are bytes
        self.index = {w: i + BYTE_TOKENS for i, w in enumerate(words)}

    @property
    def vocab_size(self) -> int:
        return BYTE_TOKENS + len(self.words)

    @classmethod
    def train(cls, words: list[str], vocab: int) -> Tokenizer:
        if vocab <= BYTE_TOKENS:
            raise ValueError(f"vocab must exceed the {BYTE_TOKENS} byte tokens, got {vocab}")
        counts = collections.Counter(words)
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        return cls([w for w, _ in ranked[: vocab - BYTE_TOKENS]])

    def encode(self, text: str) -> list[int]:
        return self.encode_words(split_words(text))

    def encode_words(self, words: list[str]) -> list[int]:
        """The ids of text already split by :func:`split_words`."""
        ids: list[int] = []
        for word in words:
            known = self.index.get(word)
            if known is None:
                ids.extend(word.encode("utf-8"))
            else:
                ids.append(known)
        return ids

    def decode(self, ids: list[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if i < BYTE_TOKENS:
                pending.append(i)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending = bytearray()
            out.append(self.words[i - BYTE_TOKENS])
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


def _cache_key(vocab: int, max_bytes: int | None) -> str:
    digest = hashlib.sha256()
    digest.update(f"{sys.version_info[:3]}:{vocab}:{max_bytes}".encode())
    for path in stdlib_files():
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def load(
    vocab: int, cache_dir: pathlib.Path, max_bytes: int | None = None
) -> tuple[Tokenizer, torch.Tensor]:
    """(tokenizer, token ids as int32) for the stdlib corpus, from the cache when present."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"stdlib-{_cache_key(vocab, max_bytes)}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        return Tokenizer(saved["words"]), saved["ids"]
    words = split_words(read_corpus(max_bytes))  # split once: counted, then encoded
    tokenizer = Tokenizer.train(words, vocab)
    ids = torch.tensor(tokenizer.encode_words(words), dtype=torch.int32)
    torch.save({"words": tokenizer.words, "ids": ids}, path)
    return tokenizer, ids
