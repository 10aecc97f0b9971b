"""Lean forward: per-tile log-sum-exp of the logits, never storing them.

Each program computes one (BLOCK_N rows x BLOCK_V classes) tile of ``hidden @ classifier.T``
in registers (float32 accumulation on the tensor cores), applies bias / scale / softcap, and
writes the tile's log-sum-exp per row into ``partial_lse[vocab_block, row]``. A tiny reduction
over vocab blocks (in the caller) gives the row's lse: no locks and no atomics, so the result
is deterministic. The program whose tile holds a row's target writes that target logit (one
writer per row). With label smoothing it also writes the tile's sum_j w_j z_ij.

Bytes: hidden and classifier are read once per tile from L2 (grouped ordering keeps GROUP_N row
blocks' hidden and one classifier tile resident); output is 4 bytes per row per vocab block.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .common import cap_logits, grouped_tile, logits_tile, row_offsets


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_n: int = 128
    block_v: int = 256
    block_d: int = 64
    group_n: int = 8
    num_warps: int = 8
    num_stages: int = 3


@triton.jit
def _lse_forward_kernel(
    hidden,
    classifier,
    bias,
    class_weights,
    targets,
    partial_lse,
    partial_wsum,
    target_logit,
    n_rows,
    rows_per_batch,
    vocab,
    dim,
    shift,
    ignore_index,
    logit_scale,
    softcap,
    stride_hb,
    stride_ht,
    stride_hd,
    stride_cv,
    stride_cd,
    stride_tb,
    stride_tt,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    NEEDS_WSUM: tl.constexpr,
    SKIP_IGNORED: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    pid_n, pid_v = grouped_tile(tl.program_id(0), n_rows, vocab, BLOCK_N, BLOCK_V, GROUP_N)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    rows_c = tl.minimum(rows, n_rows - 1)
    h_off, t_off = row_offsets(
        rows_c, rows_per_batch, shift, stride_hb, stride_ht, stride_tb, stride_tt
    )
    tgt = tl.load(targets + t_off, mask=row_ok, other=ignore_index)
    out_off = pid_v.to(tl.int64) * n_rows + rows
    if SKIP_IGNORED:
        if tl.max((tgt != ignore_index).to(tl.int32), axis=0) == 0:
            # Only ignored rows: their lse is never read, the tile costs nothing.
            tl.store(
                partial_lse + out_off, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=row_ok
            )
            if NEEDS_WSUM:
                tl.store(partial_wsum + out_off, tl.zeros((BLOCK_N,), tl.float32), mask=row_ok)
            return

    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < vocab
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
    z = tl.where(col_ok[None, :], z, float("-inf"))

    row_max = tl.max(z, axis=1)
    # NaN logits make the sum NaN, so NaN propagates to the lse as in PyTorch.
    lse = row_max + tl.log(tl.sum(tl.exp(z - row_max[:, None]), axis=1))
    tl.store(partial_lse + out_off, lse, mask=row_ok)

    is_target = cols[None, :] == tgt[:, None]
    has_target = tl.max(is_target.to(tl.int32), axis=1) > 0
    target_z = tl.sum(tl.where(is_target, z, 0.0), axis=1)
    tl.store(target_logit + rows, target_z, mask=row_ok & has_target)

    if NEEDS_WSUM:
        if HAS_WEIGHTS:
            w = tl.load(class_weights + cols_c).to(tl.float32)
        else:
            w = tl.full((BLOCK_V,), 1.0, tl.float32)
        wz = tl.where(col_ok[None, :], w[None, :] * z, 0.0)
        tl.store(partial_wsum + out_off, tl.sum(wz, axis=1), mask=row_ok)


def dot_precision(dtype: torch.dtype) -> str:
    """Triton's precision for float32 dots, following torch's matmul setting."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def lse_forward(
    hidden: torch.Tensor,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    *,
    shift: int,
    ignore_index: int,
    logit_scale: float,
    softcap: float,
    skip_ignored: bool,
    needs_wsum: bool,
    config: TileConfig = TileConfig(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Partial lse (vocab_blocks, N), target logit (N,) and partial sum_j w_j z_ij or None.

    ``hidden`` (B, T, D) and ``targets`` (B, T) may be strided; rows are (b, t < T - shift).
    Target logits of rows whose target is not a class (ignored, out of range) stay 0.
    """
    batch, time, dim = hidden.shape
    vocab = classifier.shape[0]
    if classifier.shape != (vocab, dim):
        raise ValueError(f"classifier shape {tuple(classifier.shape)} != ({vocab}, {dim})")
    if targets.shape != (batch, time):
        raise ValueError(f"targets shape {tuple(targets.shape)} != ({batch}, {time})")
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"bias shape {tuple(bias.shape)} != ({vocab},)")
    if class_weights is not None and class_weights.shape != (vocab,):
        raise ValueError(f"class_weights shape {tuple(class_weights.shape)} != ({vocab},)")
    if not 0 <= shift < time:
        raise ValueError(f"shift {shift} outside [0, {time})")
    rows_per_batch = time - shift
    n_rows = batch * rows_per_batch
    blocks_v = triton.cdiv(vocab, config.block_v)
    device = hidden.device
    partial_lse = torch.empty((blocks_v, n_rows), dtype=torch.float32, device=device)
    partial_wsum = (
        torch.empty((blocks_v, n_rows), dtype=torch.float32, device=device) if needs_wsum else None
    )
    target_logit = torch.zeros(n_rows, dtype=torch.float32, device=device)
    if n_rows == 0:
        return partial_lse, target_logit, partial_wsum
    grid = (triton.cdiv(n_rows, config.block_n) * blocks_v,)
    _lse_forward_kernel[grid](
        hidden,
        classifier,
        bias if bias is not None else classifier,
        class_weights if class_weights is not None else classifier,
        targets,
        partial_lse,
        partial_wsum if partial_wsum is not None else partial_lse,
        target_logit,
        n_rows,
        rows_per_batch,
        vocab,
        dim,
        shift,
        ignore_index,
        float(logit_scale),
        float(softcap) if softcap else 1.0,
        *hidden.stride(),
        *classifier.stride(),
        *targets.stride(),
        HAS_BIAS=bias is not None,
        HAS_SOFTCAP=bool(softcap),
        HAS_WEIGHTS=class_weights is not None,
        NEEDS_WSUM=needs_wsum,
        SKIP_IGNORED=skip_ignored,
        EVEN_D=dim % config.block_d == 0,
        UPCAST_DOT=device.type == "cpu",
        DOT_PRECISION=dot_precision(hidden.dtype),
        BLOCK_N=config.block_n,
        BLOCK_V=config.block_v,
        BLOCK_D=config.block_d,
        GROUP_N=config.group_n,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return partial_lse, target_logit, partial_wsum
