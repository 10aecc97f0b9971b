"""The CUDA implementation: Triton kernels plus cuBLAS GEMMs, same interface as ``torch_path``.

Lean mode (``forward`` + ``backward``):
  forward   one fused kernel (``lse_forward``) -> per-row lse and target logit; nothing N x V.
  backward  for each vocabulary slab of ``width`` classes: ``logit_grad`` recomputes the slab's
            logits and writes their gradient (N x width, inputs' dtype); then cuBLAS computes
            d classifier[slab] = slab.T @ hidden (written once, one rounding) and
            d hidden += slab @ classifier[slab] into a float32 accumulator (N x D).
Fast mode (``forward(fast=True)``), for each token chunk of ``n`` rows:
  cuBLAS logits (n x V, inputs' dtype) -> ``chunk_softmax_grad`` makes them the gradient in
  place -> d hidden[chunk] = grad @ classifier (written once) and d classifier += grad.T @
  hidden[chunk] into a float32 accumulator (V x D). The backward only scales by the upstream
  gradient. Three GEMMs, the minimum; one chunk and the accumulator are the extra memory.

Everything here also runs on CPU tensors under TRITON_INTERPRET=1 (the kernel tests): there
the GEMMs run in float32 and slabs are float32, because the interpreter truncates when it
rounds to bfloat16.
"""

from __future__ import annotations

import torch

from .interface import ForwardOut, Gradients, Needs
from .kernels.chunk_softmax_grad import chunk_softmax_grad
from .kernels.common import RowLayout, TileConfig, check_operands, row_layout
from .kernels.logit_grad import logit_grad
from .kernels.lse_forward import lse_forward
from .kernels.scale_cast import scale_cast
from .loss_math import (
    LossSpec,
    finish_loss,
    returned_lse,
    row_coefficient_parts,
    row_coefficients,
    row_targets,
)
from .policy import fast_chunk_rows

# The lean backward's slab: at most this many bytes (and at least one tile of columns). With
# the small per-row vectors it keeps lean mode's extra memory under 64 MB; wider slabs save the
# float32 d-hidden accumulator read-modify-write passes (bench/results/tune.md).
SLAB_BYTES = 60 * 2**20
# Widest hidden size that takes the small-tile configuration (see _tile_config).
SMALL_TILE_MAX_DIM = 2048


def available() -> bool:
    return torch.cuda.is_available()


def _tile_config(
    device: torch.device, heavy: bool = False, elem_bytes: int = 2, *, dim: int
) -> TileConfig:
    """Tiles for the GEMM kernels.

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
    # two programs share an SM, one's epilogue overlapping the other's main loop (forward
    # 1.41-1.54x the matmul instead of 1.55-1.80x at D = 512-2048). With the heavy epilogue
    # they would spill, so heavy keeps eight warps.
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


def _rounded(compute_dtype: torch.dtype | None, *tensors):
    """The head's operands in the compute dtype (copies where it rounds them)."""
    return tuple(t if t is None or compute_dtype is None else t.to(compute_dtype) for t in tensors)


def _heavy(spec: LossSpec, class_weights: torch.Tensor | None) -> bool:
    return bool(spec.softcap or spec.label_smoothing or class_weights is not None)


def _work_dtype(tensor: torch.Tensor) -> torch.dtype:
    """dtype of slabs and chunks: the inputs' on GPU, float32 in the CPU interpreter."""
    return torch.float32 if tensor.device.type == "cpu" else tensor.dtype


def _matmul(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """out = a @ b (+ bias) with one rounding to out's dtype; float32 math on CPU."""
    if a.device.type == "cpu":
        result = a.float() @ b.float()
        if bias is not None:
            result += bias.float()
        return out.copy_(result)
    if bias is not None:
        return torch.addmm(bias, a, b, out=out)
    return torch.mm(a, b, out=out)


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """acc += a @ b (acc = a @ b when ``first``) with float32 accumulation, in place."""
    if a.device.type == "cpu":
        if first:
            torch.mm(a.float(), b.float(), out=acc)
        else:
            acc.addmm_(a.float(), b.float())
    elif a.dtype == torch.float32:
        torch.mm(a, b, out=acc) if first else acc.addmm_(a, b)
    elif first:  # beta = 0: the accumulator is written, not read
        torch.mm(a, b, out_dtype=torch.float32, out=acc)
    else:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def _hidden_grad(grad_positions: torch.Tensor, layout: RowLayout, hidden: torch.Tensor):
    """(n_positions, D) gradient -> hidden's (B, T, D) gradient in hidden's dtype, zeros where
    no loss row; one cast, no intermediate copy."""
    batch, time, dim = hidden.shape
    if layout.n_positions == batch * time:  # positions are exactly hidden's (b, t)
        return grad_positions.view(batch, time, dim).to(hidden.dtype)
    out = hidden.new_zeros((batch, time, dim))
    out[:, : layout.rows_per_seq] = layout.row_grid(grad_positions)
    return out


def forward(
    hidden: torch.Tensor,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    spec: LossSpec,
    *,
    lse_all_rows: bool,
    fast: bool,
    needs: Needs,
    budget_bytes: int,
    compute_dtype: torch.dtype | None = None,
) -> ForwardOut:
    hidden, classifier, bias = _rounded(compute_dtype, hidden, classifier, bias)
    vocab = classifier.shape[0]
    rows = row_targets(targets, class_weights, spec, vocab)
    if fast and needs.any:
        out = _forward_fast(
            hidden, classifier, bias, class_weights, spec, rows, needs, budget_bytes
        )
        out.lse = returned_lse(out.lse, rows, lse_all_rows)
        return out
    partial_lse, target_logit, partial_wsum = lse_forward(
        hidden,
        classifier,
        targets,
        bias,
        class_weights,
        shift=spec.shift,
        ignore_index=spec.ignore_index,
        logit_scale=spec.logit_scale,
        softcap=spec.softcap,
        skip_ignored=not lse_all_rows,
        needs_wsum=spec.needs_wsum,
        config=_tile_config(
            hidden.device, _heavy(spec, class_weights), hidden.element_size(), dim=hidden.shape[-1]
        ),
    )
    lse = torch.logsumexp(partial_lse, dim=0)
    wsum = partial_wsum.sum(0) if partial_wsum is not None else None
    loss = finish_loss(lse, target_logit, wsum, rows, spec, vocab)
    return ForwardOut(loss, returned_lse(lse, rows, lse_all_rows))


def _forward_fast(hidden, classifier, bias, class_weights, spec, rows, needs, budget_bytes):
    """Gradients for a unit upstream gradient, computed in chunks of positions."""
    vocab, dim = classifier.shape
    device = hidden.device
    layout = row_layout(hidden, spec.shift)
    positions = layout.positions()
    n_positions = layout.n_positions
    to_positions = layout.rows_to_positions
    work_dtype = _work_dtype(hidden)
    elem = torch.finfo(work_dtype).bits // 8
    chunk = max(
        1, min(n_positions, fast_chunk_rows(vocab, dim, elem, needs.classifier, budget_bytes))
    )
    parts = row_coefficient_parts(torch.ones((), device=device), None, rows, spec, vocab)
    p_base, coef_t, coef_w = (to_positions(v) for v in (parts.p_base, parts.coef_t, parts.coef_w))
    p_per_lse = None if parts.p_per_lse is None else to_positions(parts.p_per_lse)
    targets = to_positions(rows.safe)
    logits_buf = torch.empty((chunk, vocab), dtype=work_dtype, device=device)
    grad_positions = (
        torch.empty((n_positions, dim), dtype=hidden.dtype, device=device) if needs.hidden else None
    )
    # Written, not accumulated, by the first chunk's GEMM (beta = 0): no zero fill, unless
    # there is no chunk at all (no rows).
    alloc = torch.empty if n_positions else torch.zeros
    grad_classifier = (
        alloc((vocab, dim), dtype=torch.float32, device=device) if needs.classifier else None
    )
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if needs.bias else None
    lse_positions = torch.empty(n_positions, dtype=torch.float32, device=device)
    stats = (
        lse_positions,
        torch.empty_like(lse_positions),
        torch.empty_like(lse_positions) if spec.needs_wsum else None,
    )
    classifier_t = classifier.t()
    for start in range(0, n_positions, chunk):
        stop = min(start + chunk, n_positions)
        h = positions[start:stop]
        logits = logits_buf[: stop - start]
        _matmul(h, classifier_t, out=logits, bias=bias)
        chunk_softmax_grad(
            logits,
            targets[start:stop],
            class_weights,
            p_base[start:stop],
            None if p_per_lse is None else p_per_lse[start:stop],
            coef_t[start:stop],
            coef_w[start:stop],
            logit_scale=spec.logit_scale,
            softcap=spec.softcap,
            smoothing=spec.needs_wsum,
            out=tuple(None if s is None else s[start:stop] for s in stats),
        )
        if grad_positions is not None:
            _matmul(logits, classifier, out=grad_positions[start:stop])
        if grad_classifier is not None:
            _addmm_f32_(grad_classifier, logits.t(), h, first=start == 0)
        if grad_bias is not None:
            grad_bias += logits.sum(0, dtype=torch.float32)
    lse, target_logit, wsum = (None if s is None else layout.positions_to_rows(s) for s in stats)
    loss = finish_loss(lse, target_logit, wsum, rows, spec, vocab)
    out = ForwardOut(loss, lse)
    if grad_positions is not None:
        out.grad_hidden = _hidden_grad(grad_positions, layout, hidden)
    out.grad_classifier, out.grad_bias = grad_classifier, grad_bias
    return out


def scale_to(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(x * scale).to(dtype) with one rounding, in one pass on the GPU."""
    if x.device.type == "cpu":
        return torch.mul(x, scale.float()).to(dtype)
    return scale_cast(x.contiguous(), scale, dtype)


def slab_width(n_rows: int, vocab: int, elem_bytes: int, block_v: int, budget: int) -> int:
    """Columns per backward slab: within ``budget`` bytes, a multiple of the tile width."""
    width = budget // max(1, n_rows * elem_bytes)
    width = max(block_v, width // block_v * block_v)
    return min(width, vocab)


def backward(
    grad_loss: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    hidden: torch.Tensor,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    lse: torch.Tensor,
    spec: LossSpec,
    *,
    lse_all_rows: bool,
    needs: Needs,
    budget_bytes: int,
    compute_dtype: torch.dtype | None = None,
) -> Gradients:
    hidden, classifier, bias = _rounded(compute_dtype, hidden, classifier, bias)
    vocab, dim = classifier.shape
    device = hidden.device
    # Once here rather than in every slab's launch: the contiguous copies it may make.
    bias, class_weights, classifier = check_operands(
        hidden, classifier, targets, bias, class_weights, spec.shift
    )
    rows = row_targets(targets, class_weights, spec, vocab)
    layout = row_layout(hidden, spec.shift)
    coefs = tuple(
        layout.rows_to_positions(c)
        for c in row_coefficients(grad_loss, grad_lse, lse, rows, spec, vocab, lse_all_rows)
    )
    lse_positions = layout.rows_to_positions(lse)
    config = _tile_config(device, _heavy(spec, class_weights), hidden.element_size(), dim=dim)
    work_dtype = _work_dtype(hidden)
    n_positions = layout.n_positions
    width = slab_width(
        n_positions,
        vocab,
        torch.finfo(work_dtype).bits // 8,
        config.block_v,
        min(SLAB_BYTES, budget_bytes),
    )
    slab_buf = torch.empty((n_positions, width), dtype=work_dtype, device=device)
    grad_positions = (
        torch.empty((n_positions, dim), dtype=torch.float32, device=device)
        if needs.hidden
        else None
    )
    positions = layout.positions() if needs.classifier else None
    grad_classifier = (
        torch.empty((vocab, dim), dtype=classifier.dtype, device=device)
        if needs.classifier
        else None
    )
    grad_bias = torch.empty(vocab, dtype=torch.float32, device=device) if needs.bias else None
    for start in range(0, vocab, width):
        stop = min(start + width, vocab)
        slab = slab_buf[:, : stop - start]
        logit_grad(
            hidden,
            classifier,
            targets,
            bias,
            class_weights,
            lse_positions,
            coefs,
            slab,
            col_start=start,
            shift=spec.shift,
            logit_scale=spec.logit_scale,
            softcap=spec.softcap,
            smoothing=spec.needs_wsum,
            config=config,
        )
        if grad_positions is not None:
            _addmm_f32_(grad_positions, slab, classifier[start:stop], first=start == 0)
        if grad_classifier is not None:
            # Positions that are no loss row have zero gradient rows in the slab.
            _matmul(slab.t(), positions, out=grad_classifier[start:stop])
        if grad_bias is not None:
            grad_bias[start:stop] = slab.sum(0, dtype=torch.float32)
    grad_hidden = None
    if grad_positions is not None:
        grad_hidden = _hidden_grad(grad_positions, layout, hidden)
    return grad_hidden, grad_classifier, grad_bias
