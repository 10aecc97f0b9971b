"""Gradient filtering with a proven bound: which blocks of classes a row's gradient may skip.

The lean backward recomputes the logits tile by tile. Where a row's softmax puts almost no
mass on a block of classes, that block's softmax term is below what bf16 can carry, and a tile
whose rows all skip it needs no recompute at all. cce_compile decides this exactly, before the
backward, from statistics the lean forward computes anyway:

* classes are grouped in blocks of ``FILTER_BLOCK`` (256); the forward keeps each row's
  log-sum-exp per block, so the mass of block b in row r is m_rb = exp(lse_rb - lse_r);
* row r skips its lightest blocks while their total mass stays at most beta (the blocks sorted
  by mass, skipped while the running sum is <= beta); the block that holds the row's target is
  never skipped;
* in a skipped (row, block), the softmax term coef_p * p_rj of the gradient is dropped; the
  target and label-smoothing terms are kept exactly.

The bound. Let S_r <= beta be row r's skipped mass, s the logit scale, coef_p,r the row's
softmax coefficient (``loss_math``: the upstream gradient, the z-loss and the lse's own
gradient included) and C_j the classifier's rows. The softcap's derivative is at most 1. Then

    ||error of d hidden_r||_2  <= |s| * |coef_p,r| * S_r * max_j ||C_j||_2
    ||error of d classifier||_F <= |s| * sum_r |coef_p,r| * S_r * ||h_r||_2
    ||error of d bias||_1       <= |s| * sum_r |coef_p,r| * S_r

and the loss and the returned lse are not changed at all. For the mean loss coef_p,r is the
upstream gradient over the number of counted rows, so beta is the largest relative share of a
row's softmax term that the gradient may lose.

Filtering drops both the hidden's and the classifier's shares of a skipped block: in this
implementation the classifier's gradient is a GEMM over the same recomputed tiles, so dropping
only the hidden's share would save no work. Rare classes get no gradient from rows that give
them less than the skipped mass: use it for fine-tuning, not for pretraining.

Statistics of the last filtered call (fraction of blocks and of tiles kept, the largest skipped
mass) are kept on the device, without a host synchronisation; :func:`report` reads them.
"""

from __future__ import annotations

import dataclasses

import torch

FILTER_BLOCK = 256


def block_count(vocab: int) -> int:
    return -(-vocab // FILTER_BLOCK)


def block_lse_from_partials(partial_lse: torch.Tensor, granularity: int) -> torch.Tensor:
    """(P, N) log-sum-exps over groups of ``granularity`` classes -> (blocks, N) over
    ``FILTER_BLOCK`` classes (``granularity`` divides it)."""
    if FILTER_BLOCK % granularity:
        raise ValueError(f"partials of {granularity} classes do not tile {FILTER_BLOCK}")
    per_block = FILTER_BLOCK // granularity
    parts, rows = partial_lse.shape
    padded = -(-parts // per_block) * per_block
    if padded != parts:
        fill = partial_lse.new_full((padded - parts, rows), float("-inf"))
        partial_lse = torch.cat([partial_lse, fill])
    return torch.logsumexp(partial_lse.view(padded // per_block, per_block, rows), dim=1)


def block_lse_of_logits(z: torch.Tensor) -> torch.Tensor:
    """(n, V) logits -> (n, blocks) log-sum-exp per block of classes."""
    n, vocab = z.shape
    blocks = block_count(vocab)
    if blocks * FILTER_BLOCK != vocab:
        z = torch.cat([z, z.new_full((n, blocks * FILTER_BLOCK - vocab), float("-inf"))], 1)
    return torch.logsumexp(z.view(n, blocks, FILTER_BLOCK), dim=-1)


@dataclasses.dataclass
class Stats:
    """Device scalars of one filtered call."""

    kept_blocks: torch.Tensor  # fraction of (row, block) pairs computed
    kept_tiles: torch.Tensor  # fraction of (row tile, block) pairs computed
    max_skipped_mass: torch.Tensor  # max over rows of the mass skipped (<= beta)


_last: list[Stats] = []


def keep_blocks(
    block_lse: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, beta: float
) -> torch.Tensor:
    """(N, blocks) uint8, 1 where row r computes block b. ``block_lse`` is (blocks, N),
    ``lse`` (N,) and ``targets`` (N,) the rows' class ids (any value outside the vocabulary,
    e.g. ignore_index, marks no target)."""
    blocks, rows = block_lse.shape
    mass = torch.exp(block_lse.t() - lse[:, None])  # (N, blocks); NaN rows keep everything
    target_block = torch.div(targets.long(), FILTER_BLOCK, rounding_mode="floor")
    block_ids = torch.arange(blocks, device=mass.device)
    mass = torch.where(block_ids == target_block[:, None], float("inf"), mass)  # never skipped
    ordered, order = mass.sort(dim=1)
    skipped_sorted = ordered.cumsum(1) <= beta
    keep = torch.ones_like(mass, dtype=torch.uint8)
    keep.scatter_(1, order, (~skipped_sorted).to(torch.uint8))
    skipped_mass = torch.where(skipped_sorted, ordered, 0.0).sum(1)
    _record(keep, skipped_mass)
    return keep


def _record(keep: torch.Tensor, skipped_mass: torch.Tensor, tile_rows: int = 128) -> None:
    rows, blocks = keep.shape
    tiles = -(-rows // tile_rows)
    padded = torch.zeros((tiles * tile_rows, blocks), dtype=keep.dtype, device=keep.device)
    padded[:rows] = keep
    kept_tiles = padded.view(tiles, tile_rows, blocks).amax(1).float().mean()
    stats = Stats(
        keep.float().mean(),
        kept_tiles,
        skipped_mass.max() if rows else skipped_mass.new_zeros(()),
    )
    _last[:] = [stats]


def report() -> dict[str, float] | None:
    """Statistics of the last call with gradient filtering, as Python floats (this reads the
    device: call it after the step, not inside it): ``kept_blocks`` (fraction of (row, block)
    pairs whose softmax term was computed), ``kept_tiles`` (fraction of 128-row tiles per block
    that needed a recompute), ``max_skipped_mass`` (the largest mass any row skipped; the bound
    holds with it in place of beta). None before any filtered call."""
    if not _last:
        return None
    return {name: float(value) for name, value in dataclasses.asdict(_last[0]).items()}


def keep_columns(keep: torch.Tensor, vocab: int) -> torch.Tensor:
    """(n, blocks) mask -> (n, V) bool, for the PyTorch path."""
    return keep.bool().repeat_interleave(FILTER_BLOCK, dim=1)[:, :vocab]
