"""Fast mode: turn a chunk of materialised logits into their gradient, in place.

One program per row of ``logits`` (the pre-activation y = hidden @ classifier.T + bias of a
token chunk, in the inputs' dtype). Pass 1 streams the row for the online max / sum of
exp(z) (z = softcap(logit_scale * y)), the target logit and, with label smoothing, sum_j w_j z_j.
Pass 2 re-reads the row (mostly from L2) and overwrites it with

    d loss / d y = (coef_p * softmax - coef_t * onehot - coef_w * w) * dz/dy,

coef_p = p_base + p_per_lse * lse. Bytes per row: 2 reads + 1 write of V elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cap_logits


@triton.jit
def _chunk_softmax_grad_kernel(
    logits,
    targets,
    class_weights,
    p_base,
    p_per_lse,
    coef_t,
    coef_w,
    lse_out,
    target_out,
    wsum_out,
    vocab,
    stride_row,
    logit_scale,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits + row * stride_row
    tgt = tl.load(targets + row)
    offs = tl.arange(0, BLOCK)

    running_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK,), tl.float32)
    target_acc = tl.zeros((BLOCK,), tl.float32)
    wsum_acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        ok = cols < vocab
        y = tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        z = cap_logits(y, logit_scale, softcap, HAS_SOFTCAP)
        z = tl.where(ok, z, float("-inf"))
        new_max = tl.maximum(running_max, z)
        # Lane-wise online softmax; a lane that has only seen -inf keeps a zero sum.
        scale_old = tl.where(running_max == float("-inf"), 0.0, tl.exp(running_max - new_max))
        running_sum = running_sum * scale_old + tl.where(ok, tl.exp(z - new_max), 0.0)
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
        running_max == float("-inf"), 0.0, running_sum * tl.exp(running_max - row_max)
    )
    lse = row_max + tl.log(tl.sum(lane_sum, axis=0))
    tl.store(lse_out + row, lse)
    tl.store(target_out + row, tl.sum(target_acc, axis=0))
    if HAS_SMOOTHING:
        tl.store(wsum_out + row, tl.sum(wsum_acc, axis=0))

    c_p = tl.load(p_base + row)
    if HAS_Z_LOSS:
        c_p += tl.load(p_per_lse + row) * lse
    c_t = tl.load(coef_t + row)
    c_w = tl.load(coef_w + row)
    active = (c_p != 0.0) | (c_t != 0.0) | (c_w != 0.0)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        ok = cols < vocab
        y = tl.load(row_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        z = cap_logits(y, logit_scale, softcap, HAS_SOFTCAP)
        grad = c_p * tl.exp(z - lse) - tl.where(cols == tgt, c_t, 0.0)
        if HAS_SMOOTHING:
            if HAS_WEIGHTS:
                grad -= c_w * tl.load(class_weights + cols, mask=ok, other=0.0).to(tl.float32)
            else:
                grad -= c_w
        if HAS_SOFTCAP:
            u = z / softcap
            grad = grad * (1.0 - u * u)
        grad = grad * logit_scale
        grad = tl.where(active, grad, 0.0)
        tl.store(row_ptr + cols, grad.to(logits.dtype.element_ty), mask=ok)


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
    softcap: float,
    smoothing: bool,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    block: int = 4096,
    num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Overwrite ``logits`` (n, V) with their gradient; return lse, target logit, wsum (n,).

    ``targets`` (n,) int64 must be valid class indices (clamp ignored rows: their coefficients
    are 0); the coefficient vectors are float32 (n,). ``out``: contiguous float32 (n,)
    buffers to write lse, target logit and wsum into (wsum None without smoothing), so that
    a caller filling a longer vector chunk by chunk needs no copies.
    """
    n_rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits must have unit column stride")
    if targets.shape != (n_rows,) or targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64 ({n_rows},)")
    if class_weights is not None and class_weights.shape != (vocab,):
        raise ValueError(f"class_weights must be ({vocab},)")
    vectors = {"p_base": p_base, "coef_t": coef_t, "coef_w": coef_w}
    if p_per_lse is not None:
        vectors["p_per_lse"] = p_per_lse
    for name, t in vectors.items():
        if t.shape != (n_rows,) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 ({n_rows},)")
    if out is None:
        lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        out = (lse, torch.empty_like(lse), torch.empty_like(lse) if smoothing else None)
    lse, target_logit, wsum = out
    for name, t in zip(("lse", "target_logit", "wsum"), out):
        if t is not None and (
            t.shape != (n_rows,) or t.dtype != torch.float32 or not t.is_contiguous()
        ):
            raise ValueError(f"out {name} must be contiguous float32 ({n_rows},)")
    if smoothing and wsum is None:
        raise ValueError("out needs a wsum buffer with smoothing")
    if n_rows == 0:
        return lse, target_logit, wsum
    block = min(block, triton.next_power_of_2(vocab))
    _chunk_softmax_grad_kernel[(n_rows,)](
        logits,
        targets,
        class_weights if class_weights is not None else lse,
        p_base,
        p_per_lse if p_per_lse is not None else p_base,
        coef_t,
        coef_w,
        lse,
        target_logit,
        wsum if wsum is not None else lse,
        vocab,
        logits.stride(0),
        float(logit_scale),
        float(softcap) if softcap else 1.0,
        HAS_SOFTCAP=bool(softcap),
        HAS_WEIGHTS=class_weights is not None,
        HAS_SMOOTHING=smoothing,
        HAS_Z_LOSS=p_per_lse is not None,
        BLOCK=block,
        num_warps=num_warps,
    )
    return lse, target_logit, wsum
