"""What the CUDA implementation's two modes share (``triton_path`` lean, ``triton_fast`` fast).

The Triton kernels' tile choice, the sizes ``policy`` takes, the rounding of inputs to the
compute dtype, the cuBLAS GEMMs with float32 accumulation, the reshaping of per-position
results to hidden's and the loss's rows, and the in-place scaling by the upstream gradient.

On CPU tensors (the interpreter, TRITON_INTERPRET=1) the GEMMs run in float32 and the work
dtype is float32, because the interpreter truncates when it rounds to bfloat16.
"""

from __future__ import annotations

import torch

from .. import policy
from ..kernels.common import RowLayout, TileConfig, operands_tma_ok
from ..kernels.scale_cast import scale_cast
from .interface import HeadInputs

# Widest hidden size that takes the small-tile configuration (see tile_config).
SMALL_TILE_MAX_DIM = 2048


def tile_config(
    device: torch.device, heavy: bool = False, elem_bytes: int = 2, *, dim: int
) -> TileConfig:
    """Tiles for lean's GEMM kernels (a program per tile), and for the fused logits GEMM where
    its own (``fused_tile_config``) do not fit.

    ``heavy``: softcap / label smoothing / class weights add epilogue registers, and 128 x 256
    tiles would spill (bench/sass_report.py). float32 operands take twice the shared memory
    per stage: 128 x 128 x 32 tiles keep three stages within the 227 KB of a Hopper SM.
    """
    if device.type == "cpu":  # interpreter: small tiles, several per test shape
        return TileConfig(
            block_n=16,
            block_v=16,
            block_d=16,
            group_n=2,
            num_warps=4,
            num_stages=1,
            tiles_per_program=2,
        )
    if elem_bytes > 2:
        return TileConfig(
            block_n=128, block_v=128, block_d=32, num_warps=8, num_stages=3, tiles_per_program=1
        )
    # Measured on an H200 (bench/results/tune.md): 128 x 256 tiles, one per program, were the
    # fastest for the plain epilogue on shapes A, B and E (D >= 2304). Up to D = 2048 a tile
    # has few K steps and its epilogue is a larger share: 128 x 128 tiles on four warps let
    # two programs share an SM, one's epilogue overlapping the other's main loop. With the
    # heavy epilogue they would spill, so heavy keeps eight warps.
    if heavy:
        return TileConfig(
            block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=4, tiles_per_program=1
        )
    if dim <= SMALL_TILE_MAX_DIM:
        return TileConfig(
            block_n=128, block_v=128, block_d=64, num_warps=4, num_stages=3, tiles_per_program=1
        )
    return TileConfig(
        block_n=128, block_v=256, block_d=64, num_warps=8, num_stages=3, tiles_per_program=1
    )


def fused_tile_config(
    device: torch.device, heavy: bool = False, elem_bytes: int = 2, *, dim: int, tma: bool
) -> TileConfig:
    """Tiles for fast mode's fused logits GEMM (``kernels/logits_exp.py``); ``tma``: its
    operands load by TMA (``kernels.common.operands_tma_ok``).

    That kernel is persistent, one program per SM, so the small tiles that let two of lean's
    programs share an SM (``tile_config`` up to D = 2048) leave the SM half used: 128 x 256
    tiles on eight warps, grouped 16 row tiles deep, were the fastest at every D measured, D =
    512-4096 (bench/results/tune_fused.md). They are for 2-byte operands loaded by TMA, the form
    measured: in float32 they overflow shared memory (bench/results/gpu_tests.md), and loaded
    by pointers they were not measured. Those, the heavy epilogue (label smoothing, class
    weights: it would spill) and the interpreter keep ``tile_config``'s."""
    if device.type == "cpu" or heavy or elem_bytes != 2 or not tma:
        return tile_config(device, heavy, elem_bytes, dim=dim)
    return TileConfig(
        block_n=128,
        block_v=256,
        block_d=64,
        group_n=16,
        num_warps=8,
        num_stages=3,
        tiles_per_program=1,
    )


def rounded(compute_dtype: torch.dtype | None, t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` in the compute dtype (a copy only where that rounds it)."""
    return t if t is None or compute_dtype is None else t.to(compute_dtype)


def part(t: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    """``t[start:stop]``, or None for None."""
    return None if t is None else t[start:stop]


def _heavy(head: HeadInputs) -> bool:
    """Does ``head``'s epilogue hold more registers (softcap, label smoothing, class weights)?"""
    spec = head.spec
    return bool(spec.softcap or spec.label_smoothing or head.class_weights is not None)


def config_of(head: HeadInputs, hidden: torch.Tensor) -> TileConfig:
    """The GEMM kernels' tiles for ``head`` (``hidden``: its hidden in the compute dtype)."""
    dim = head.classifier.shape[1]
    return tile_config(hidden.device, _heavy(head), hidden.element_size(), dim=dim)


def fused_config_of(
    head: HeadInputs, positions: torch.Tensor, classifier: torch.Tensor
) -> TileConfig:
    """The fused logits GEMM's tiles for ``head``, reading ``positions`` (its hidden rows in
    the compute dtype) and ``classifier`` (in the compute dtype)."""
    tma = operands_tma_ok(positions, positions.stride(0), classifier)
    dim = classifier.shape[1]
    return fused_tile_config(
        positions.device, _heavy(head), positions.element_size(), dim=dim, tma=tma
    )


def work_dtype(tensor: torch.Tensor) -> torch.dtype:
    """dtype of slabs and gradients: the compute dtype on GPU, float32 in the interpreter."""
    return torch.float32 if tensor.device.type == "cpu" else tensor.dtype


def problem(layout: RowLayout, head: HeadInputs, work: torch.Tensor) -> policy.Problem:
    """The head's sizes as ``policy`` takes them (``work``: a tensor in the GEMMs' dtype)."""
    return policy.problem(
        layout.n_positions,
        tuple(head.classifier.shape),
        work_dtype(work),
        "cuda",
        compute_dtype=head.compute_dtype,
        dtypes=(head.hidden.dtype, head.classifier.dtype),
    )


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = a @ b with one rounding to out's dtype (float32 accumulation); float32 math on
    CPU."""
    if a.device.type == "cpu":
        return (
            torch.mm(a.float(), b.float(), out=out)
            if out.dtype == torch.float32
            else out.copy_(a.float() @ b.float())
        )
    if out.dtype == a.dtype:
        return torch.mm(a, b, out=out)
    if out.dtype == torch.float32:
        return torch.mm(a, b, out_dtype=out.dtype, out=out)
    # Another 2-byte dtype (bf16 weights' gradient from float16 operands under float16
    # autocast): cuBLAS has no such form; a float32 product, rounded once (out's size: lean's
    # slab counts it, policy.cross_half_gradient; fast mode sums such a gradient in float32)
    return out.copy_(torch.mm(a, b, out_dtype=torch.float32))


def addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """acc += a @ b (acc = a @ b when ``first``) in place, float32 accumulation, one rounding
    to acc's dtype per call (a bf16 ``acc`` is the bf16 gradient itself: cuBLAS reads it into
    its float32 epilogue and writes it back)."""
    if first:  # beta = 0: the accumulator is written, not read
        matmul(a, b, out=acc)
    elif a.device.type == "cpu":
        if acc.dtype == torch.float32:
            acc.addmm_(a.float(), b.float())
        else:
            acc.copy_(torch.addmm(acc.float(), a.float(), b.float()))
    elif a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:  # a float32 acc: cuBLAS has no other mixed form, and needs none here (a 2-byte
        # gradient of other 2-byte products is summed in float32: policy.cross_half_gradient)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def hidden_grad(grad_positions: torch.Tensor, layout: RowLayout, hidden: torch.Tensor):
    """(n_positions, D) gradient -> hidden's (B, T, D) gradient in ``grad_positions``' dtype,
    zeros where no loss row."""
    batch, time, dim = hidden.shape
    if layout.n_positions == batch * time:  # positions are exactly hidden's (b, t)
        return grad_positions.view(batch, time, dim)
    out = grad_positions.new_zeros((batch, time, dim))
    out[:, : layout.rows_per_seq] = layout.row_grid(grad_positions)
    return out


def rows_of(layout: RowLayout, positions: torch.Tensor | None) -> torch.Tensor | None:
    """A per-position tensor as one per loss row, or None for None."""
    return None if positions is None else layout.positions_to_rows(positions)


def scale_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x *= scale in place, float32 math, one rounding (one pass on the GPU)."""
    if x.device.type == "cpu" or not x.is_contiguous():  # (the interpreter's small tests)
        return x.copy_(x.float() * scale.float())
    return scale_cast(x, scale, x.dtype, out=x)
