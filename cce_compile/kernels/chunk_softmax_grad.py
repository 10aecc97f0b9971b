"""Fast mode: turn a chunk of materialised logits into their gradient.

One program per row of ``logits`` (y = hidden @ classifier.T of a token chunk, float32 from
the GEMM's accumulator: nothing is rounded before the softmax). Pass 1 streams the row (adding
the bias) for the online max / sum of exp(z) (z = softcap(logit_scale * (y + b))), the target
logit and, with label smoothing, sum_j w_j z_j. Pass 2 re-reads the row and writes

    d loss / d y = (coef_p * softmax - coef_t * onehot - coef_w * w) * dz/dy,

coef_p = p_base + p_per_lse * lse, rounded once to ``grad``'s dtype. ``grad`` may share the
logits' memory: a bf16 gradient row is written over the first half of its own float32 row.
Column block k then overwrites float32 columns [k B / 2, (k + 1) B / 2), which block k // 2
read; a barrier between each block's loads and its stores keeps every read before the write
that covers it. Bytes per row: 2 reads of 4 V, 1 write of 2 V.

A vocabulary split over ranks (the vocabulary-parallel op's fast mode) needs the whole
vocabulary's lse before any gradient, and that exists only after a collective between the two
passes. So each pass runs alone there: ``chunk_row_stats`` is pass 1 (STATS_ONLY: the shard's
statistics, one read of the chunk), and ``chunk_softmax_grad(lse=...)`` is pass 2 with the
given lse (GIVEN_LSE). A target on another rank's shard is a column outside [0, V): it adds
nothing to the target logit and no one-hot term.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..loss_math import LOG_P_FLOOR
from .common import cap_logits, next_power_of_2, row_coefficients


@triton.jit
def _chunk_softmax_grad_kernel(
    logits,
    grad,
    bias,
    targets,
    class_weights,
    p_base,
    p_per_lse,
    coef_t,
    coef_w,
    lse_row,  # (n,) float32: written by pass 1, or read (GIVEN_LSE)
    target_out,
    wsum_out,
    entropy_out,
    argmax_out,
    vocab,
    stride_row,
    stride_grad,
    logit_scale,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    NEEDS_ENTROPY: tl.constexpr,
    LOG_P_FLOOR: tl.constexpr,
    NEEDS_ARGMAX: tl.constexpr,
    GIVEN_LSE: tl.constexpr,  # no pass 1: the row's lse is read from lse_row
    STATS_ONLY: tl.constexpr,  # no pass 2: the statistics only, no gradient
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits + row * stride_row
    grad_ptr = grad + row * stride_grad
    tgt = tl.load(targets + row)
    offs = tl.arange(0, BLOCK)

    if GIVEN_LSE:
        lse = tl.load(lse_row + row)
    else:
        running_max = tl.full((BLOCK,), float("-inf"), tl.float32)
        running_sum = tl.zeros((BLOCK,), tl.float32)
        target_acc = tl.zeros((BLOCK,), tl.float32)
        wsum_acc = tl.zeros((BLOCK,), tl.float32)
        lane_arg = tl.zeros((BLOCK,), tl.int32)  # each lane's first column of its running max
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            ok = cols < vocab
            y = tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y += tl.load(bias + cols, mask=ok, other=0.0).to(tl.float32)
            z = cap_logits(y, logit_scale, softcap, HAS_SOFTCAP)
            z = tl.where(ok, z, float("-inf"))
            new_max = tl.maximum(running_max, z)
            if NEEDS_ARGMAX:  # strictly greater: a lane keeps its first column of a tie
                lane_arg = tl.where(z > running_max, cols, lane_arg)
            # Lane-wise online softmax; a lane that has only seen -inf keeps a zero sum, one
            # that saw a NaN (which tl.maximum skips: its max can stay -inf) a NaN sum.
            scale_old = tl.where(running_max == float("-inf"), 0.0, tl.exp(running_max - new_max))
            e = tl.where(z == float("-inf"), 0.0, tl.exp(z - new_max))
            running_sum = running_sum * scale_old + e
            running_max = new_max
            target_acc += tl.where(cols == tgt, z, 0.0)
            if HAS_SMOOTHING:
                if HAS_WEIGHTS:
                    w = tl.load(class_weights + cols, mask=ok, other=0.0).to(tl.float32)
                else:
                    w = tl.where(ok, 1.0, 0.0)
                wsum_acc += tl.where(ok, w * z, 0.0)
        row_max = tl.max(running_max, axis=0)
        lane_sum = tl.where(
            running_max == float("-inf"), running_sum, running_sum * tl.exp(running_max - row_max)
        )
        lse = row_max + tl.log(tl.sum(lane_sum, axis=0))
        tl.store(lse_row + row, lse)
        tl.store(target_out + row, tl.sum(target_acc, axis=0))
        if HAS_SMOOTHING:
            tl.store(wsum_out + row, tl.sum(wsum_acc, axis=0))
        if NEEDS_ARGMAX:  # the first column of the row's largest logit, as torch.argmax
            first = tl.where(running_max == row_max, lane_arg, vocab)
            tl.store(argmax_out + row, tl.min(first, axis=0).to(tl.int64))

    if not STATS_ONLY:
        c_p, c_t, c_w, active = row_coefficients(
            row, lse, p_base, p_per_lse, coef_t, coef_w, HAS_Z_LOSS
        )
        entropy_acc = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            ok = cols < vocab
            y = tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y += tl.load(bias + cols, mask=ok, other=0.0).to(tl.float32)
            z = cap_logits(y, logit_scale, softcap, HAS_SOFTCAP)
            p = tl.exp(z - lse)
            if NEEDS_ENTROPY:  # -p log p with log p = z - lse: no term of the logits' size;
                # clamped (loss_math.LOG_P_FLOOR): a -inf logit adds 0, not 0 * inf
                entropy_acc += tl.where(ok, p * tl.minimum(lse - z, -LOG_P_FLOOR), 0.0)
            g = c_p * p - tl.where(cols == tgt, c_t, 0.0)
            if HAS_SMOOTHING:
                if HAS_WEIGHTS:
                    g -= c_w * tl.load(class_weights + cols, mask=ok, other=0.0).to(tl.float32)
                else:
                    g -= c_w
            if HAS_SOFTCAP:
                u = z / softcap
                g = g * (1.0 - u * u)
            g = g * logit_scale
            g = tl.where(active, g, 0.0)
            tl.debug_barrier()  # every read of this block before any write over it
            tl.store(grad_ptr + cols, g.to(grad.dtype.element_ty), mask=ok)
        if NEEDS_ENTROPY:
            tl.store(entropy_out + row, tl.sum(entropy_acc, axis=0))


def chunk_softmax_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    class_weights: torch.Tensor | None,
    p_base: torch.Tensor,
    p_per_lse: torch.Tensor | None,
    coef_t: torch.Tensor,
    coef_w: torch.Tensor,
    *,
    logit_scale: float,
    softcap: float | None,
    smoothing: bool,
    bias: torch.Tensor | None = None,
    grad: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    entropy_out: torch.Tensor | None = None,
    argmax_out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    block: int = 4096,
    num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Write d loss / d logits of ``logits`` (n, V) into ``grad`` (n, V; default: ``logits``
    itself); return lse, target logit, wsum (n,).

    ``grad`` may be a view of ``logits``' own memory in a dtype of half the width, each row
    starting where the float32 row starts (``logits.view(bf16)[:, :V]``). ``bias`` (V,) is
    added to the logits as they are read. ``targets`` (n,) int64: each row's target column
    (clamp ignored rows: their coefficients are 0), or any value outside [0, V) for a target
    that is not among these classes (no one-hot term); the coefficient vectors are float32 (n,).
    ``out``: contiguous float32 (n,) buffers to write lse, target logit and wsum into (wsum
    None without smoothing), so that a caller filling a longer vector chunk by chunk needs no
    copies. ``entropy_out`` (n,) float32: also each row's entropy, sum_j p_j (lse - z_j);
    ``argmax_out`` (n,) int64: also each row's first largest logit's class.
    ``lse`` (n,) float32: each row's log-sum-exp, given (a vocabulary split over ranks: the
    whole vocabulary's; module docstring): pass 1 is skipped, nothing but the gradient is
    written (``out``, ``entropy_out``, ``argmax_out`` must be None), and the return value is
    (lse, None, None).
    """
    n_rows, vocab = logits.shape
    grad = logits if grad is None else grad
    _check_grad(logits, grad)
    _check_vectors(n_rows, vocab, targets, class_weights, bias)
    vectors = {"p_base": p_base, "coef_t": coef_t, "coef_w": coef_w}
    if p_per_lse is not None:
        vectors["p_per_lse"] = p_per_lse
    if lse is not None:
        if out is not None or entropy_out is not None or argmax_out is not None:
            raise ValueError("with a given lse, out, entropy_out and argmax_out must be None")
        vectors["lse"] = lse
    for name, t in vectors.items():
        _check_row_vector(name, t, n_rows, torch.float32)
    stats = (lse, None, None) if lse is not None else _row_stats_out(out, logits, smoothing)
    for name, t, dtype in (
        ("entropy_out", entropy_out, torch.float32),
        ("argmax_out", argmax_out, torch.int64),
    ):
        if t is not None:
            _check_row_vector(name, t, n_rows, dtype)
    if n_rows == 0 or vocab == 0:
        return stats
    _launch(
        logits,
        grad,
        targets,
        class_weights,
        bias,
        (p_base, p_per_lse, coef_t, coef_w),
        stats,
        (entropy_out, argmax_out),
        scalars=(logit_scale, softcap),
        smoothing=smoothing,
        given_lse=lse is not None,
        stats_only=False,
        launch=(block, num_warps),
    )
    return stats


def chunk_row_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    class_weights: torch.Tensor | None,
    *,
    logit_scale: float,
    softcap: float | None,
    smoothing: bool,
    bias: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    block: int = 4096,
    num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pass 1 alone (one read of ``logits`` (n, V), nothing written over them): each row's
    lse, target logit and, with ``smoothing``, wsum over these V classes, (n,) float32 each,
    into ``out`` as in ``chunk_softmax_grad``. ``targets`` (n,) int64: each row's target
    column, or any value outside [0, V) where the target is not among these classes (its
    target logit is then exactly 0). No classes (an empty shard): lse -inf, the others 0."""
    n_rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must be (n, V) with unit column stride")
    _check_vectors(n_rows, vocab, targets, class_weights, bias)
    stats = _row_stats_out(out, logits, smoothing)
    if n_rows and not vocab:
        stats[0].fill_(float("-inf"))
        for t in stats[1:]:
            if t is not None:
                t.zero_()
    if n_rows == 0 or vocab == 0:
        return stats
    zeros = stats[0]  # no coefficient is read in pass 1: any float32 pointer
    _launch(
        logits,
        logits,
        targets,
        class_weights,
        bias,
        (zeros, None, zeros, zeros),
        stats,
        (None, None),
        scalars=(logit_scale, softcap),
        smoothing=smoothing,
        given_lse=False,
        stats_only=True,
        launch=(block, num_warps),
    )
    return stats


def _check_grad(logits: torch.Tensor, grad: torch.Tensor) -> None:
    n_rows, vocab = logits.shape
    if logits.stride(1) != 1 or grad.stride(1) != 1 or tuple(grad.shape) != (n_rows, vocab):
        raise ValueError("logits and grad must be (n, V) with unit column stride")
    if grad.data_ptr() == logits.data_ptr() and grad.dtype != logits.dtype:
        if (
            grad.element_size() * 2 != logits.element_size()
            or grad.stride(0) * grad.element_size() != logits.stride(0) * logits.element_size()
        ):
            raise ValueError("an in-place grad must be half-width rows over the logits' rows")


def _check_vectors(n_rows: int, vocab: int, targets, class_weights, bias) -> None:
    if targets.shape != (n_rows,) or targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 ({n_rows},)")
    for name, vector in (("class_weights", class_weights), ("bias", bias)):
        if vector is not None and vector.shape != (vocab,):
            raise ValueError(f"{name} must be ({vocab},)")


def _check_row_vector(name: str, t: torch.Tensor, n_rows: int, dtype: torch.dtype) -> None:
    if t.shape != (n_rows,) or t.dtype != dtype or not t.is_contiguous():
        what = "float32" if dtype == torch.float32 else str(dtype)
        raise ValueError(f"{name} must be contiguous {what} ({n_rows},)")


def _row_stats_out(out, logits: torch.Tensor, smoothing: bool) -> tuple:
    """``out`` (lse, target logit, wsum), checked, or new buffers."""
    n_rows = logits.shape[0]
    if out is None:
        lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        return lse, torch.empty_like(lse), torch.empty_like(lse) if smoothing else None
    for name, t in zip(("lse", "target_logit", "wsum"), out):
        if t is not None:
            _check_row_vector(f"out {name}", t, n_rows, torch.float32)
    if smoothing and out[2] is None:
        raise ValueError("out needs a wsum buffer with smoothing")
    return tuple(out)


def _launch(
    logits,
    grad,
    targets,
    class_weights,
    bias,
    coefs,
    stats,
    extras,
    *,
    scalars,
    smoothing,
    given_lse,
    stats_only,
    launch,
) -> None:
    """One program per row; absent pointers are stood in for by a tensor of the right kind
    that the flags keep the kernel from reading."""
    p_base, p_per_lse, coef_t, coef_w = coefs
    lse, target_logit, wsum = stats
    entropy_out, argmax_out = extras
    logit_scale, softcap = scalars
    block, num_warps = launch
    n_rows, vocab = logits.shape
    _chunk_softmax_grad_kernel[(n_rows,)](
        logits,
        grad,
        bias.contiguous() if bias is not None else lse,
        targets,
        class_weights if class_weights is not None else lse,
        p_base,
        p_per_lse if p_per_lse is not None else p_base,
        coef_t,
        coef_w,
        lse,
        target_logit if target_logit is not None else lse,
        wsum if wsum is not None else lse,
        entropy_out if entropy_out is not None else lse,
        argmax_out if argmax_out is not None else targets,
        vocab,
        logits.stride(0),
        grad.stride(0),
        float(logit_scale),
        float(softcap) if softcap else 1.0,
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=bool(softcap),
        HAS_WEIGHTS=class_weights is not None,
        HAS_SMOOTHING=smoothing,
        HAS_Z_LOSS=p_per_lse is not None,
        NEEDS_ENTROPY=entropy_out is not None,
        LOG_P_FLOOR=LOG_P_FLOOR,
        NEEDS_ARGMAX=argmax_out is not None,
        GIVEN_LSE=given_lse,
        STATS_ONLY=stats_only,
        BLOCK=min(block, next_power_of_2(vocab)),
        num_warps=num_warps,
    )
