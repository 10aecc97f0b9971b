"""Choosing between the op's two modes.

* lean: the forward keeps only the per-row lse; the backward recomputes the logits in vocabulary
  slabs. Extra memory: a float32 hidden-gradient accumulator (N x D) and one slab.
* fast: the forward computes the gradients in token chunks (three GEMMs, the minimum) and the
  backward only scales them by the upstream gradient, so it needs a scalar loss ('mean' or
  'sum'). Extra memory: a float32 classifier-gradient accumulator (V x D) and one chunk.

'auto' takes fast whenever it is valid and its accumulator plus a chunk of at least
MIN_FAST_CHUNK_BYTES fits the budget (``memory_budget_mb``, 4 GiB by default), else lean; fast
mode then gives its chunk whatever the accumulator leaves of the budget. The measurements
behind it are in bench/results/.
"""

from __future__ import annotations

import logging

log = logging.getLogger("cce_compile")

# The smallest chunk of logits worth running fast mode with: below it the float32 classifier
# accumulator is re-read so often that lean mode is as fast (bench/results/tune.md).
MIN_FAST_CHUNK_BYTES = 256 * 2**20


def fast_accumulator_bytes(vocab: int, dim: int, needs_classifier: bool) -> int:
    """Fast mode's float32 classifier-gradient accumulator (bytes)."""
    return vocab * dim * 4 if needs_classifier else 0


def fast_chunk_bytes(vocab: int, dim: int, needs_classifier: bool, budget_bytes: int) -> int:
    """Bytes for one chunk of logits: what the budget leaves after the accumulator."""
    left = budget_bytes - fast_accumulator_bytes(vocab, dim, needs_classifier)
    return max(left, MIN_FAST_CHUNK_BYTES)


def fast_extra_bytes(vocab: int, dim: int, needs_classifier: bool) -> int:
    """The least extra memory fast mode needs beyond inputs and gradients (bytes)."""
    return fast_accumulator_bytes(vocab, dim, needs_classifier) + MIN_FAST_CHUNK_BYTES


def choose_mode(
    requested: str,
    *,
    reduction: str,
    needs_grad: bool,
    needs_classifier: bool,
    lse_has_grad: bool,
    vocab: int,
    dim: int,
    budget_bytes: int,
    explicit: bool = False,
) -> str:
    """The concrete mode ('lean' or 'fast') for one call.

    ``explicit`` marks a mode the caller passed as an argument: asking for 'fast' where it
    cannot apply is then an error rather than a quiet fall-back to 'lean'.
    """
    if requested == "fast" and reduction == "none":
        if explicit:
            raise ValueError("mode='fast' needs reduction 'mean' or 'sum' (got 'none')")
        log.debug("mode 'fast' needs a scalar loss; using 'lean' for reduction='none'")
        return "lean"
    if requested in ("lean", "fast"):
        return requested
    if not needs_grad or reduction == "none" or lse_has_grad:
        return "lean"
    if fast_extra_bytes(vocab, dim, needs_classifier) <= budget_bytes:
        return "fast"
    return "lean"
