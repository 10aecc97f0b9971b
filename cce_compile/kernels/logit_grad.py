"""Lean backward: recompute a vocabulary slab of logits and write their gradient.

For classes [v0, v0 + width) each program recomputes one (BLOCK_N x BLOCK_V) tile of logits
exactly as the forward did, and writes

    d loss / d y = (coef_p * softmax - coef_t * onehot - coef_w * w) * dz/dy

into ``slab`` (N x width, the inputs' dtype) — the slab is the only N x V-sized memory, and the
caller bounds its width. The per-row coefficients come from ``loss_math.row_coefficients``.
Two GEMMs on cuBLAS then turn the slab into d hidden (accumulated) and d classifier (written
once per slab). Tiles whose rows all have zero coefficients (ignored rows) skip the GEMM and
write zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cap_logits, grouped_tile, logit_grad_factor, logits_tile, row_offsets
from .lse_forward import TileConfig, dot_precision


@triton.jit
def _logit_grad_kernel(
    hidden,
    classifier,
    bias,
    class_weights,
    targets,
    lse,
    coef_p,
    coef_t,
    coef_w,
    slab,
    n_rows,
    rows_per_batch,
    vocab,
    dim,
    shift,
    col_start,
    width,
    logit_scale,
    softcap,
    stride_hb,
    stride_ht,
    stride_hd,
    stride_cv,
    stride_cd,
    stride_tb,
    stride_tt,
    stride_sn,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    pid_n, pid_v = grouped_tile(tl.program_id(0), n_rows, width, BLOCK_N, BLOCK_V, GROUP_N)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    local_cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = col_start + local_cols
    col_ok = (local_cols < width) & (cols < vocab)
    out_ptrs = slab + rows.to(tl.int64)[:, None] * stride_sn + local_cols[None, :]
    out_mask = row_ok[:, None] & col_ok[None, :]

    c_p = tl.load(coef_p + rows, mask=row_ok, other=0.0)
    c_t = tl.load(coef_t + rows, mask=row_ok, other=0.0)
    c_w = tl.load(coef_w + rows, mask=row_ok, other=0.0)
    # NaN coefficients (out-of-range targets) count as active and poison their row.
    active = (c_p != 0.0) | (c_t != 0.0) | (c_w != 0.0)
    if tl.max(active.to(tl.int32), axis=0) == 0:
        tl.store(
            out_ptrs,
            tl.zeros((BLOCK_N, BLOCK_V), tl.float32).to(slab.dtype.element_ty),
            mask=out_mask,
        )
        return

    rows_c = tl.minimum(rows, n_rows - 1)
    h_off, t_off = row_offsets(
        rows_c, rows_per_batch, shift, stride_hb, stride_ht, stride_tb, stride_tt
    )
    cols_c = tl.minimum(cols, vocab - 1)
    acc = logits_tile(
        hidden,
        classifier,
        h_off,
        cols_c.to(tl.int64) * stride_cv,
        dim,
        stride_hd,
        stride_cd,
        BLOCK_N,
        BLOCK_V,
        BLOCK_D,
        EVEN_D,
        UPCAST_DOT,
        DOT_PRECISION,
    )
    if HAS_BIAS:
        acc += tl.load(bias + cols_c).to(tl.float32)[None, :]
    z = cap_logits(acc, logit_scale, softcap, HAS_SOFTCAP)
    row_lse = tl.load(lse + rows_c)
    grad = c_p[:, None] * tl.exp(z - row_lse[:, None])
    tgt = tl.load(targets + t_off)
    grad -= tl.where(cols[None, :] == tgt[:, None], c_t[:, None], 0.0)
    if HAS_SMOOTHING:
        if HAS_WEIGHTS:
            w = tl.load(class_weights + cols_c).to(tl.float32)
            grad -= c_w[:, None] * w[None, :]
        else:
            grad -= c_w[:, None]
    grad *= logit_grad_factor(z, logit_scale, softcap, HAS_SOFTCAP)
    # where(), not a product: an ignored row's placeholder lse may overflow exp().
    grad = tl.where(active[:, None], grad, 0.0)
    tl.store(out_ptrs, grad.to(slab.dtype.element_ty), mask=out_mask)


def logit_grad(
    hidden: torch.Tensor,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    lse: torch.Tensor,
    coefs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slab: torch.Tensor,
    *,
    col_start: int,
    shift: int,
    logit_scale: float,
    softcap: float,
    smoothing: bool,
    config: TileConfig = TileConfig(),
) -> torch.Tensor:
    """Fill ``slab`` (N x width, row stride free, unit column stride) with the gradient of
    the loss w.r.t. the pre-activation logits of classes [col_start, col_start + width)."""
    batch, time, dim = hidden.shape
    vocab = classifier.shape[0]
    n_rows = batch * (time - shift)
    width = slab.shape[1]
    if classifier.shape != (vocab, dim) or targets.shape != (batch, time):
        raise ValueError("classifier must be (V, D) and targets (B, T) for hidden (B, T, D)")
    if slab.shape[0] != n_rows or slab.stride(1) != 1:
        raise ValueError(f"slab must be ({n_rows}, width) with unit column stride")
    if col_start < 0 or col_start + width > vocab:
        raise ValueError(f"slab columns [{col_start}, {col_start + width}) outside [0, {vocab})")
    for name, t in zip(("lse", "coef_p", "coef_t", "coef_w"), (lse, *coefs)):
        if t.shape != (n_rows,) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 ({n_rows},)")
    if n_rows == 0 or width == 0:
        return slab
    grid = (triton.cdiv(n_rows, config.block_n) * triton.cdiv(width, config.block_v),)
    _logit_grad_kernel[grid](
        hidden,
        classifier,
        bias if bias is not None else classifier,
        class_weights if class_weights is not None else classifier,
        targets,
        lse,
        *coefs,
        slab,
        n_rows,
        time - shift,
        vocab,
        dim,
        shift,
        col_start,
        width,
        float(logit_scale),
        float(softcap) if softcap else 1.0,
        *hidden.stride(),
        *classifier.stride(),
        *targets.stride(),
        slab.stride(0),
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=bool(softcap),
        HAS_WEIGHTS=class_weights is not None,
        HAS_SMOOTHING=smoothing,
        EVEN_D=dim % config.block_d == 0,
        UPCAST_DOT=hidden.device.type == "cpu",
        DOT_PRECISION=dot_precision(hidden.dtype),
        BLOCK_N=config.block_n,
        BLOCK_V=config.block_v,
        BLOCK_D=config.block_d,
        GROUP_N=config.group_n,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return slab
