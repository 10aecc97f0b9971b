"""Compaction's kept-first order in one launch: the rows whose target counts, ascending, then the
ignored rows, ascending, and how many are kept; nothing is read back on the host.

Fast mode queues its first GEMM before it waits for the count (op/compaction.py), so this runs
while the host still has the GPU's next work to launch: one program, one launch, against
torch's seven (a running sum and the slot arithmetic) or ``nonzero``'s launches and host
synchronisation. The single program walks the rows twice, BLOCK at a time: first it counts the
kept rows, then it gives each row its slot (a kept row: the kept rows before it; an ignored
row: the count plus the ignored rows before it) and writes ``order[slot] = row``. Its time is
linear in the rows and small next to a chunk's GEMM (16,384 rows: two passes of 4 blocks of
4,096).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kept_first_kernel(valid, order, count, n_rows, BLOCK: tl.constexpr):
    total = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        total += tl.sum(tl.load(valid + rows, mask=rows < n_rows, other=0).to(tl.int64), axis=0)
    tl.store(count, total)
    kept_before = tl.sum(tl.zeros([BLOCK], dtype=tl.int64), axis=0)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        inside = rows < n_rows
        kept = tl.load(valid + rows, mask=inside, other=0).to(tl.int64)
        kept_through = kept_before + tl.cumsum(kept, axis=0)
        slot = tl.where(kept != 0, kept_through - 1, total + rows - kept_through)
        tl.store(order + slot, rows.to(tl.int64), mask=inside)
        kept_before += tl.sum(kept, axis=0)


def kept_first(valid: torch.Tensor, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, count) of a contiguous 1-D bool ``valid``: ``order`` (N,) int64 the indices of
    the True entries ascending, then of the False ones ascending; ``count`` 0-d int64, the
    number of True entries. ``block``: rows per step of the program (a power of two)."""
    if valid.dim() != 1 or valid.dtype != torch.bool or not valid.is_contiguous():
        raise ValueError("valid must be a contiguous 1-D bool tensor")
    if valid.numel() >= 2**31:
        raise ValueError("valid must have fewer than 2**31 rows")
    order = torch.empty(valid.shape, dtype=torch.int64, device=valid.device)
    count = torch.zeros((), dtype=torch.int64, device=valid.device)
    if valid.numel():
        _kept_first_kernel[(1,)](valid.view(torch.uint8), order, count, valid.numel(), BLOCK=block)
    return order, count
