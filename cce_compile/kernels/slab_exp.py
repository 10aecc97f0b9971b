"""Fast mode over slabs of classes, pass 1: a slab of float32 logits -> scaled exponentials.

A token chunk's logits are computed one slab of ``S`` classes at a time into a small float32
buffer (n x S). One program per row streams its slab in blocks of ``BLOCK`` classes and, per
block, writes

    e = exp(z - m_b),  z = logit_scale * (y + b),  m_b = the block's largest z,

rounded once to the chunk's gradient buffer (n x V, the compute dtype) at the slab's columns,
with m_b into ``block_max`` (n x ceil(V / BLOCK), float32); it merges the slab's max and sum of
exp(z) into the row's running pair, and adds the slab's target logit and, with label
smoothing, sum_j w_j z_j. ``scaled_exp_grad`` then turns e into the gradient with the row's
lse. So the chunk never holds more than a slab of float32 logits: two bytes a logit (bf16)
plus the slab, where whole float32 rows took four, and twice the rows fit a budget (each fast
chunk re-reads the classifier's gradient: fewer chunks, less traffic).

Accuracy: e is rounded once (relative 2^-8 at worst, as the gradient itself), then scaled by
exp(m_b - lse) in float32 and rounded again in pass 2; the target's entry is recomputed there
from its float32 logit, so the large (p_t - 1) term is never built from a rounded e.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import merge_max_sum

# Classes per block: the granularity of ``block_max``. Both passes use it.
SLAB_BLOCK = 2048


@triton.jit
def _slab_exp_kernel(
    logits,
    exps,
    block_max,
    bias,
    targets,
    class_weights,
    run_max,
    run_sum,
    target_out,
    wsum_out,
    slab_cols,
    col_start,
    stride_logits,
    stride_exps,
    stride_block_max,
    logit_scale,
    HAS_BIAS: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    FIRST: tl.constexpr,  # the row's first slab: write the running values, do not merge
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits + row * stride_logits
    exp_ptr = exps + row * stride_exps + col_start
    max_ptr = block_max + row * stride_block_max + col_start // BLOCK
    tgt = tl.load(targets + row) - col_start
    offs = tl.arange(0, BLOCK)
    zero = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
    slab_max = zero + float("-inf")
    slab_sum = zero
    target_acc = zero
    wsum_acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, slab_cols, BLOCK):
        cols = start + offs
        ok = cols < slab_cols
        y = tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias + col_start + cols, mask=ok, other=0.0).to(tl.float32)
        z = tl.where(ok, y * logit_scale, float("-inf"))
        block_top = tl.max(z, axis=0)
        # A block of -inf logits (e.g. a -inf bias) stores m_b = 0 and e = 0.
        offset = tl.where(block_top == float("-inf"), 0.0, block_top)
        e = tl.where(z == float("-inf"), 0.0, tl.exp(z - offset))
        tl.store(exp_ptr + cols, e.to(exps.dtype.element_ty), mask=ok)
        tl.store(max_ptr + start // BLOCK, offset)
        slab_max, slab_sum = merge_max_sum(slab_max, slab_sum, block_top, tl.sum(e, axis=0))
        target_acc += tl.sum(tl.where(cols == tgt, z, 0.0), axis=0)
        if HAS_SMOOTHING:
            if HAS_WEIGHTS:
                w = tl.load(class_weights + col_start + cols, mask=ok, other=0.0).to(tl.float32)
            else:
                w = tl.where(ok, 1.0, 0.0)
            wsum_acc += tl.where(ok, w * z, 0.0)
    if FIRST:
        tl.store(run_max + row, slab_max)
        tl.store(run_sum + row, slab_sum)
        tl.store(target_out + row, target_acc)
        if HAS_SMOOTHING:
            tl.store(wsum_out + row, tl.sum(wsum_acc, axis=0))
    else:
        m, s = merge_max_sum(tl.load(run_max + row), tl.load(run_sum + row), slab_max, slab_sum)
        tl.store(run_max + row, m)
        tl.store(run_sum + row, s)
        tl.store(target_out + row, tl.load(target_out + row) + target_acc)
        if HAS_SMOOTHING:
            tl.store(wsum_out + row, tl.load(wsum_out + row) + tl.sum(wsum_acc, axis=0))


def slab_blocks(vocab: int, block: int = SLAB_BLOCK) -> int:
    """Columns of ``block_max`` for ``vocab`` classes in blocks of ``block``."""
    return -(-vocab // block)


def slab_exp(
    logits: torch.Tensor,
    exps: torch.Tensor,
    block_max: torch.Tensor,
    targets: torch.Tensor,
    running: tuple[torch.Tensor, torch.Tensor],
    stats: tuple[torch.Tensor, torch.Tensor | None],
    *,
    col_start: int,
    first: bool,
    logit_scale: float,
    bias: torch.Tensor | None = None,
    class_weights: torch.Tensor | None = None,
    block: int = SLAB_BLOCK,
    num_warps: int = 8,
) -> None:
    """Pass 1 over the slab of classes [col_start, col_start + S) of n rows.

    ``logits`` (n, S) float32, unit column stride: the slab's logits. ``exps`` (n, V): the
    chunk's gradient buffer, any float dtype, written at the slab's columns. ``block_max``
    (n, ceil(V / block)) float32 (``block``: a power of two, the same in both passes).
    ``targets`` (n,) int64, whole-vocabulary columns.
    ``running``: the rows' (max, sum of exp) over the slabs so far, (n,) float32 each,
    written (``first``) or merged into; ``stats``: the rows' target logit and wsum (None
    without label smoothing), (n,) float32, written or added to. ``bias`` and
    ``class_weights``: the whole vocabulary's (V,). ``col_start`` must start a block."""
    n_rows, slab_cols = logits.shape
    vocab = exps.shape[1]
    if logits.stride(1) != 1 or exps.stride(1) != 1 or exps.shape[0] != n_rows:
        raise ValueError("logits (n, S) and exps (n, V) need unit column strides")
    if col_start % block or col_start + slab_cols > vocab:
        raise ValueError(f"the slab [{col_start}, +{slab_cols}) must start a block within V")
    blocks = slab_blocks(vocab, block)
    if block_max.shape != (n_rows, blocks) or block_max.dtype != torch.float32:
        raise ValueError(f"block_max must be float32 ({n_rows}, {blocks})")
    if block_max.stride(1) != 1:
        raise ValueError("block_max needs a unit column stride")
    # (the program indexes every row vector by its row alone: a strided view would be misread)
    if targets.shape != (n_rows,) or targets.dtype != torch.int64 or not targets.is_contiguous():
        raise ValueError(f"targets must be contiguous int64 ({n_rows},)")
    for name, vector in (("bias", bias), ("class_weights", class_weights)):
        if vector is not None and vector.shape != (vocab,):
            raise ValueError(f"{name} must be ({vocab},)")
    target_logit, wsum = stats
    for t in (*running, target_logit, wsum):
        if t is not None and (
            t.shape != (n_rows,) or t.dtype != torch.float32 or not t.is_contiguous()
        ):
            raise ValueError(f"running values and stats must be contiguous float32 ({n_rows},)")
    if n_rows == 0 or slab_cols == 0:
        return
    placeholder = running[0]
    _slab_exp_kernel[(n_rows,)](
        logits,
        exps,
        block_max,
        bias.contiguous() if bias is not None else placeholder,
        targets,
        class_weights.contiguous() if class_weights is not None else placeholder,
        *running,
        target_logit,
        wsum if wsum is not None else placeholder,
        slab_cols,
        col_start,
        logits.stride(0),
        exps.stride(0),
        block_max.stride(0),
        float(logit_scale),
        HAS_BIAS=bias is not None,
        HAS_WEIGHTS=class_weights is not None,
        HAS_SMOOTHING=wsum is not None,
        FIRST=first,
        BLOCK=block,
        num_warps=num_warps,
    )
