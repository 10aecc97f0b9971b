"""Choosing between the op's two modes.

* lean: the forward keeps only the per-row lse; the backward recomputes the logits in vocabulary
  slabs. Extra memory: a float32 hidden-gradient accumulator (N x D) and one slab.
* fast: the forward computes the gradients in token chunks (three GEMMs, the minimum) and the
  backward only scales them by the upstream gradient, so it needs a scalar loss ('mean' or
  'sum'). Extra memory: a float32 classifier-gradient accumulator (V x D) and one chunk.

'auto' takes fast whenever it is valid and its accumulator plus one chunk of FAST_CHUNK_ROWS
rows fits the budget (``memory_budget_mb``, 4 GiB by default), else lean. The measurements
behind it are in bench/results/.
"""

from __future__ import annotations

import logging

log = logging.getLogger("cce_compile")

# Rows per fast-mode chunk. Each chunk re-reads and re-writes the float32 classifier
# accumulator (8 V D bytes) against 6 n V D FLOPs of GEMMs: at 700 TFLOP/s and ~4 TB/s that
# overhead is about 230 / n of the chunk's time, ~5% at 4096 rows. More rows buy little speed
# (bench/results/tune.md) and cost chunk memory, which is the point of the op.
FAST_CHUNK_ROWS = 4096


def fast_accumulator_bytes(vocab: int, dim: int, needs_classifier: bool) -> int:
    """Fast mode's float32 classifier-gradient accumulator (bytes)."""
    return vocab * dim * 4 if needs_classifier else 0


def fast_chunk_rows(
    vocab: int, dim: int, elem_bytes: int, needs_classifier: bool, budget_bytes: int
) -> int:
    """Rows of logits per fast-mode chunk: FAST_CHUNK_ROWS, or fewer if the budget (after
    the accumulator) cannot hold that many; at least one."""
    left = budget_bytes - fast_accumulator_bytes(vocab, dim, needs_classifier)
    return max(1, min(FAST_CHUNK_ROWS, left // (vocab * elem_bytes)))


def fast_extra_bytes(vocab: int, dim: int, needs_classifier: bool) -> int:
    """Extra memory of fast mode beyond inputs and gradients: accumulator and one chunk
    (estimated in 16-bit logits: the choice is made before the dtype matters)."""
    chunk = FAST_CHUNK_ROWS * vocab * 2
    return fast_accumulator_bytes(vocab, dim, needs_classifier) + chunk


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
