"""Fast mode, pass 2: scaled exponentials -> the logits' gradient.

After pass 1 (``logits_exp``, fused into the logits GEMM) each row of a token chunk holds
e = exp(z - m_b) per class (the chunk's gradient buffer), and per block of classes (a GEMM
tile) m_b and the block's partial lse (and, with label smoothing, its partial weighted sum).
One program per row reduces the row's partials to its lse (and weighted sum), stores them,
then streams the row and writes, over e in place,

    d loss / d y = (coef_p * p - coef_t * onehot - coef_w * w) * logit_scale,
    p = e * exp(m_b - lse),  coef_p = p_base + p_per_lse * lse,

except at the target, where p is exp(z_t - lse) from the float32 target logit: the one large
entry, p_t - 1, is never built from a rounded e. Bytes per logit: one read and one write of
the compute dtype. Over a vocabulary shard the rows' lse is the whole vocabulary's, combined
over the ranks from each shard's partials before the launch: the program reads it
(``lse_given``) instead of reducing its own partials. Reducing the partials here, not in a
``torch.logsumexp`` before the launch, spares each chunk several small kernels and their
launches (no speed change was resolvable on an H200: bench/results/gpu_tests.md, 754105e).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import next_power_of_2, row_coefficients

# Classes per program loop step (a power of two: a multiple of ``max_block``).
BLOCK = 2048


@triton.jit
def _row_lse(
    partial_lse,
    partial_wsum,
    row_lse,
    row_wsum,
    row,
    stride,
    blocks,
    HAS_WSUM: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """The row's lse from its blocks' partial lse (as ``torch.logsumexp``: -inf where every
    block is -inf, inf where one is, NaN where one is NaN), stored with its weighted sum."""
    offs = tl.arange(0, BLOCKS)
    ok = offs < blocks
    parts = tl.load(partial_lse + row * stride + offs, mask=ok, other=float("-inf"))
    top = tl.max(parts, axis=0)
    top = tl.where((top == float("-inf")) | (top == float("inf")), 0.0, top)
    lse = top + tl.log(tl.sum(tl.exp(parts - top), axis=0))
    tl.store(row_lse + row, lse)
    if HAS_WSUM:
        wsum = tl.sum(tl.load(partial_wsum + row * stride + offs, mask=ok, other=0.0), axis=0)
        tl.store(row_wsum + row, wsum)
    return lse


@triton.jit
def _scaled_exp_grad_kernel(
    exps,
    block_max,
    partial_lse,
    partial_wsum,
    targets,
    class_weights,
    target_logit,
    p_base,
    p_per_lse,
    coef_t,
    coef_w,
    row_lse,
    row_wsum,
    vocab,
    stride_exps,
    stride_block_max,
    stride_partials,
    logit_scale,
    HAS_WEIGHTS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_WSUM: tl.constexpr,
    LSE_GIVEN: tl.constexpr,
    BLOCK: tl.constexpr,
    MAX_BLOCK: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    exp_ptr = exps + row * stride_exps
    max_ptr = block_max + row * stride_block_max
    blocks = tl.cdiv(vocab, MAX_BLOCK)
    if LSE_GIVEN:
        lse = tl.load(row_lse + row)
    else:
        lse = _row_lse(
            partial_lse,
            partial_wsum,
            row_lse,
            row_wsum,
            row,
            stride_partials,
            blocks,
            HAS_WSUM,
            BLOCKS,
        )
    tgt = tl.load(targets + row)
    p_target = tl.exp(tl.load(target_logit + row) - lse)
    c_p, c_t, c_w, active = row_coefficients(
        row, lse, p_base, p_per_lse, coef_t, coef_w, HAS_Z_LOSS
    )
    offs = tl.arange(0, BLOCK)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        ok = cols < vocab
        e = tl.load(exp_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        # one maximum per MAX_BLOCK classes (``logits_exp``'s tiles): gathered, from L1
        m_b = tl.load(max_ptr + cols // MAX_BLOCK, mask=ok, other=0.0)
        p = e * tl.exp(m_b - lse)
        is_target = cols == tgt
        p = tl.where(is_target, p_target, p)
        g = c_p * p - tl.where(is_target, c_t, 0.0)
        if HAS_SMOOTHING:
            if HAS_WEIGHTS:
                g -= c_w * tl.load(class_weights + cols, mask=ok, other=0.0).to(tl.float32)
            else:
                g -= c_w
        g = tl.where(active, g * logit_scale, 0.0)
        tl.store(exp_ptr + cols, g.to(exps.dtype.element_ty), mask=ok)


def _check_buffers(buffers: tuple, wsum, block: int, max_block: int) -> None:
    """(exps, block_max, partial_lse, partial_wsum or None) of one row count."""
    exps, block_max, partial_lse, partial_wsum = buffers
    rows, vocab = exps.shape
    if exps.stride(1) != 1 or not exps.dtype.is_floating_point:
        raise ValueError("exps must be floating (n, V) with unit column stride")
    if block % max_block:
        raise ValueError(f"max_block {max_block} must divide block {block}")
    blocks = -(-vocab // max_block)
    for name, t in (("block_max", block_max), ("partial_lse", partial_lse)):
        if t.shape != (rows, blocks) or t.dtype != torch.float32 or t.stride(1) != 1:
            raise ValueError(f"{name} must be float32 ({rows}, {blocks}), unit column stride")
    if (partial_wsum is None) != (wsum is None):
        raise ValueError("partial_wsum and wsum come together")
    if partial_wsum is not None and (
        partial_wsum.shape != partial_lse.shape
        or partial_wsum.dtype != torch.float32
        or partial_wsum.stride() != partial_lse.stride()
    ):
        raise ValueError("partial_wsum must be float32 like partial_lse, with its strides")


def _check_rows(n_rows: int, targets, vectors: tuple, class_weights, vocab: int) -> None:
    """The per-row vectors: the program indexes each by its row alone, so a strided view
    would be misread."""
    if targets.shape != (n_rows,) or targets.dtype != torch.int64 or not targets.is_contiguous():
        raise ValueError(f"targets must be contiguous int64 ({n_rows},)")
    if class_weights is not None and class_weights.shape != (vocab,):
        raise ValueError(f"class_weights must be ({vocab},)")
    for t in vectors:
        if t is not None and (
            t.shape != (n_rows,) or t.dtype != torch.float32 or not t.is_contiguous()
        ):
            raise ValueError(f"row vectors must be contiguous float32 ({n_rows},)")


class ScaledExpGradLaunch:
    """``scaled_exp_grad`` over the chunks of one call, its operands checked once: fast mode
    launches it once a chunk, and the host's per-launch checks and slicing add up where the
    GPU waits for the host (shape C, issue 41).

    ``buffers`` = (exps, block_max, partial_lse, partial_wsum or None), for any chunk's rows
    from their first row on (at least the longest chunk's); ``targets``, ``target_logit``,
    ``coefs``, ``lse`` and ``wsum``: the call's rows, of which a chunk takes [start, stop).
    ``lse_given``: ``lse`` already holds each row's lse (a shard's rows: the whole
    vocabulary's), which the launch reads and neither ``lse`` nor ``wsum`` is written. The
    other arguments are ``scaled_exp_grad``'s."""

    def __init__(
        self,
        buffers: tuple,
        targets: torch.Tensor,
        target_logit: torch.Tensor,
        coefs: tuple,
        lse: torch.Tensor,
        *,
        wsum: torch.Tensor | None = None,
        logit_scale: float,
        smoothing: bool,
        class_weights: torch.Tensor | None = None,
        max_block: int,
        block: int = BLOCK,
        num_warps: int = 8,
        lse_given: bool = False,
    ):
        _check_buffers(buffers, wsum, block, max_block)
        exps, block_max, partial_lse, partial_wsum = buffers
        if targets.dim() != 1:
            raise ValueError("targets must be contiguous int64 (n,)")
        self.n_rows, self.rows, self.vocab = targets.shape[0], exps.shape[0], exps.shape[1]
        vectors = (target_logit, *coefs, lse, wsum)
        _check_rows(self.n_rows, targets, vectors, class_weights, self.vocab)
        self.buffers = buffers
        self.vectors = (targets, *vectors)  # targets, target_logit, 4 coefficients, lse, wsum
        self.class_weights = class_weights.contiguous() if class_weights is not None else None
        self.strides = (exps.stride(0), block_max.stride(0), partial_lse.stride(0))
        self.logit_scale = float(logit_scale)
        self.flags = dict(
            HAS_WEIGHTS=class_weights is not None,
            HAS_SMOOTHING=smoothing,
            HAS_Z_LOSS=coefs[1] is not None,
            HAS_WSUM=partial_wsum is not None,
            LSE_GIVEN=lse_given,
            BLOCK=block,
            MAX_BLOCK=max_block,
            BLOCKS=next_power_of_2(block_max.shape[1]),
            num_warps=num_warps,
        )
        self._chunk_buffers: dict[int, tuple] = {}  # by row count: at most two a call

    def launch(self, start: int, stop: int) -> None:
        """The chunk of rows [start, stop), in the buffers' first stop - start rows."""
        n = stop - start
        if not 0 <= start <= stop <= self.n_rows or n > self.rows:
            raise ValueError(f"chunk [{start}, {stop}) outside {self.n_rows} rows or its buffers")
        sliced = [None if t is None else t[start:stop] for t in self.vectors]
        targets, target_logit, p_base, p_per_lse, coef_t, coef_w, lse, wsum = sliced
        if self.vocab == 0 and self.flags["LSE_GIVEN"]:  # no gradient to write
            return
        if self.vocab == 0:  # no classes: each row's lse is log(0), as torch.logsumexp's
            lse.fill_(float("-inf"))
            if wsum is not None:
                wsum.zero_()
            return
        if n == 0:
            return
        exps, block_max, partial_lse, partial_wsum = self._buffers(n)
        _scaled_exp_grad_kernel[(n,)](
            exps,
            block_max,
            partial_lse,
            partial_wsum if partial_wsum is not None else partial_lse,
            targets,
            self.class_weights if self.class_weights is not None else p_base,
            target_logit,
            p_base,
            p_per_lse if p_per_lse is not None else p_base,
            coef_t,
            coef_w,
            lse,
            wsum if wsum is not None else lse,
            self.vocab,
            *self.strides,
            self.logit_scale,
            **self.flags,
        )

    def _buffers(self, n: int) -> tuple:
        parts = self._chunk_buffers.get(n)
        if parts is None:
            parts = tuple(None if t is None else t[:n] for t in self.buffers)
            self._chunk_buffers[n] = parts
        return parts


def scaled_exp_grad(
    exps: torch.Tensor,
    block_max: torch.Tensor,
    partial_lse: torch.Tensor,
    targets: torch.Tensor,
    target_logit: torch.Tensor,
    coefs: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor],
    lse: torch.Tensor,
    *,
    partial_wsum: torch.Tensor | None = None,
    wsum: torch.Tensor | None = None,
    logit_scale: float,
    smoothing: bool,
    class_weights: torch.Tensor | None = None,
    max_block: int,
    block: int = BLOCK,
    num_warps: int = 8,
    lse_given: bool = False,
) -> None:
    """Pass 2 over a chunk's n rows: ``exps`` (n, V), as ``logits_exp`` left it, becomes the
    logits' gradient in place, and each row's lse is written to ``lse`` (and, with
    ``partial_wsum``, its weighted sum to ``wsum``).

    ``block_max``, ``partial_lse`` and ``partial_wsum`` (n, ceil(V / max_block)) float32 with a
    unit column stride, one value per ``max_block`` classes (a power of two dividing
    ``block``, the classes per loop step): ``logits_exp`` writes one per GEMM tile; the two
    partials share a row stride. ``target_logit`` (read), ``lse`` and ``wsum`` (written) (n,)
    float32; ``targets`` (n,) int64, each row's target column (clamped for rows without a
    loss: their coefficients are 0); ``coefs`` = (p_base, p_per_lse or None, coef_t, coef_w),
    float32 (n,) each, as ``chunk_softmax_grad`` takes them. ``lse_given``: ``lse`` is read,
    the rows' lse over the whole vocabulary of which the chunk's classes are a shard, and
    neither ``lse`` nor ``wsum`` is written."""
    n_rows = exps.shape[0]
    if lse.shape[:1] != (n_rows,):
        raise ValueError(f"row vectors must be contiguous float32 ({n_rows},)")
    ScaledExpGradLaunch(
        (exps, block_max, partial_lse, partial_wsum),
        targets,
        target_logit,
        coefs,
        lse,
        wsum=wsum,
        logit_scale=logit_scale,
        smoothing=smoothing,
        class_weights=class_weights,
        max_block=max_block,
        block=block,
        num_warps=num_warps,
        lse_given=lse_given,
    ).launch(0, n_rows)
