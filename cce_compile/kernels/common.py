"""Small Triton helpers shared by the kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_offsets(rows, rows_per_batch, shift, stride_b, stride_t, stride_tb, stride_tt):
    """Element offsets of loss row ``r`` in hidden (b, t) and in targets (b, t + shift).

    Rows are (b, t) with t < T - shift, so a shift needs no copy of hidden (int64 offsets:
    N * D may exceed 2**31).
    """
    b = rows // rows_per_batch
    t = rows - b * rows_per_batch
    b = b.to(tl.int64)
    t = t.to(tl.int64)
    return b * stride_b + t * stride_t, b * stride_tb + (t + shift) * stride_tt


@triton.jit
def tanh(x):
    # exp-based: portable to the interpreter; absolute error ~1e-7, which is what the softmax
    # sees after multiplying by the cap.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def cap_logits(y, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """z = softcap * tanh(logit_scale * y / softcap), or logit_scale * y."""
    z = y * logit_scale
    if HAS_SOFTCAP:
        z = softcap * tanh(z / softcap)
    return z


@triton.jit
def logit_grad_factor(z, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """dz / dy for z = cap_logits(y)."""
    if HAS_SOFTCAP:
        u = z / softcap
        return logit_scale * (1.0 - u * u)
    return logit_scale


@triton.jit
def logits_tile(
    hidden,
    classifier,
    h_off,
    c_off,
    dim,
    stride_hd,
    stride_cd,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """hidden[rows] @ classifier[cols].T for one (BLOCK_N, BLOCK_V) tile, float32.

    ``h_off`` / ``c_off`` are the int64 element offsets of the tile's rows in hidden and in
    classifier; callers clamp out-of-range rows and columns to valid ones, so only the last,
    partial D block needs a mask.
    """
    offs_d = tl.arange(0, BLOCK_D)
    h_ptrs = hidden + h_off[:, None] + offs_d[None, :] * stride_hd
    c_ptrs = classifier + c_off[None, :] + offs_d[:, None] * stride_cd
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k in range(0, tl.cdiv(dim, BLOCK_D)):
        if EVEN_D:
            h = tl.load(h_ptrs)
            c = tl.load(c_ptrs)
        else:
            remaining = dim - k * BLOCK_D
            h = tl.load(h_ptrs, mask=offs_d[None, :] < remaining, other=0.0)
            c = tl.load(c_ptrs, mask=offs_d[:, None] < remaining, other=0.0)
        if UPCAST_DOT:
            # The CPU interpreter mis-evaluates bf16 dots; bf16 products are exact in float32,
            # so upcasting computes the same tile.
            h = h.to(tl.float32)
            c = c.to(tl.float32)
        acc = tl.dot(h, c, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_D * stride_hd
        c_ptrs += BLOCK_D * stride_cd
    return acc


@triton.jit
def grouped_tile(
    pid, n_rows, vocab_cols, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, GROUP_N: tl.constexpr
):
    """(row block, vocab block) of program ``pid``, GROUP_N row blocks at a time so that
    programs running together share classifier tiles in L2."""
    num_pid_n = tl.cdiv(n_rows, BLOCK_N)
    num_pid_v = tl.cdiv(vocab_cols, BLOCK_V)
    per_group = GROUP_N * num_pid_v
    group = pid // per_group
    first_n = group * GROUP_N
    group_size = tl.minimum(num_pid_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_size
    pid_v = (pid % per_group) // group_size
    return pid_n, pid_v
