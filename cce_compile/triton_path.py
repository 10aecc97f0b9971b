"""The CUDA implementation: Triton kernels plus cuBLAS GEMMs, same interface as ``torch_path``.

Lean mode (``forward`` + ``backward``):
  forward   one fused kernel (``lse_forward``) -> per-row lse and target logit; nothing N x V.
  backward  for each vocabulary slab of ``width`` classes: ``logit_grad`` recomputes the slab's
            logits and writes their gradient (N x width, the compute dtype); then cuBLAS
            computes d classifier[slab] = slab.T @ hidden (written once, in the classifier's
            dtype) and d hidden += slab @ classifier[slab] into a float32 accumulator (N x D).
Fast mode (``forward(fast=True)``), for each token chunk of ``n`` rows:
  cuBLAS logits (n x V, float32 out of the accumulator: nothing rounded before the softmax) ->
  ``chunk_softmax_grad`` writes their gradient, rounded once to the compute dtype, over the
  logits' own memory -> d hidden[chunk] = grad @ classifier (written once) and d classifier +=
  grad.T @ hidden[chunk] into the classifier's gradient itself (its own dtype: float32 under
  AMP, bf16 for bf16 weights). The backward scales both by the upstream gradient in place.
  Three GEMMs, the minimum, and no V x D tensor but the gradient.
Mixed precision (``compute_dtype`` rounding float32 inputs, autocast's form): hidden is rounded
once; the classifier one slab of classes at a time in lean mode (no V x D copy), once in fast
mode (cuBLAS needs it whole per chunk); classifier gradients are written in float32 directly.
The sizes of slabs and chunks come from ``policy`` (the memory budget).

Everything here also runs on CPU tensors under TRITON_INTERPRET=1 (the kernel tests): there
the GEMMs run in float32 and slabs are float32, because the interpreter truncates when it
rounds to bfloat16.
"""

from __future__ import annotations

import math

import torch

from . import filtering, policy
from .interface import Coefficients, ForwardOut, Gradients, HeadInputs, Needs, RowStats
from .kernels.chunk_softmax_grad import chunk_softmax_grad
from .kernels.common import RowLayout, TileConfig, check_operands, row_layout
from .kernels.logit_grad import logit_grad
from .kernels.lse_forward import lse_forward, partial_blocks
from .kernels.scale_cast import scale_cast
from .loss_math import LossSpec, RowTargets, finish_loss, row_coefficient_parts

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


def _rounded(compute_dtype: torch.dtype | None, t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` in the compute dtype (a copy only where that rounds it)."""
    return t if t is None or compute_dtype is None else t.to(compute_dtype)


def _heavy(spec: LossSpec, class_weights: torch.Tensor | None) -> bool:
    return bool(spec.softcap or spec.label_smoothing or class_weights is not None)


def _work_dtype(tensor: torch.Tensor) -> torch.dtype:
    """dtype of slabs and gradients: the compute dtype on GPU, float32 in the interpreter."""
    return torch.float32 if tensor.device.type == "cpu" else tensor.dtype


def _problem(layout: RowLayout, classifier, work: torch.Tensor, compute_dtype) -> policy.Problem:
    vocab, dim = classifier.shape
    return policy.Problem(
        rows=layout.n_positions,
        vocab=vocab,
        dim=dim,
        logit_bytes=torch.finfo(_work_dtype(work)).bits // 8,
        rounds_inputs=compute_dtype is not None,
    )


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
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
    return torch.mm(a, b, out_dtype=out.dtype, out=out)


def _addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """acc += a @ b (acc = a @ b when ``first``) in place, float32 accumulation, one rounding
    to acc's dtype per call (a bf16 ``acc`` is the bf16 gradient itself: cuBLAS reads it into
    its float32 epilogue and writes it back)."""
    if first:  # beta = 0: the accumulator is written, not read
        _matmul(a, b, out=acc)
    elif a.device.type == "cpu":
        if acc.dtype == torch.float32:
            acc.addmm_(a.float(), b.float())
        else:
            acc.copy_(torch.addmm(acc.float(), a.float(), b.float()))
    elif a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.dtype == torch.float32:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # e.g. a float16 classifier with a bf16 compute dtype: no cuBLAS form
        acc.add_(torch.mm(a, b, out_dtype=torch.float32))


def _hidden_grad(grad_positions: torch.Tensor, layout: RowLayout, hidden: torch.Tensor):
    """(n_positions, D) gradient -> hidden's (B, T, D) gradient in ``grad_positions``' dtype,
    zeros where no loss row."""
    batch, time, dim = hidden.shape
    if layout.n_positions == batch * time:  # positions are exactly hidden's (b, t)
        return grad_positions.view(batch, time, dim)
    out = grad_positions.new_zeros((batch, time, dim))
    out[:, : layout.rows_per_seq] = layout.row_grid(grad_positions)
    return out


def _slabs(vocab: int, width: int):
    for start in range(0, vocab, width):
        yield start, min(start + width, vocab)


def _tile_width(columns: int, tile: int, vocab: int) -> int:
    """``columns`` rounded down to whole tiles, at least one tile, at most the vocabulary."""
    return min(vocab, max(tile, columns // tile * tile))


def logit_stats(
    head: HeadInputs,
    *,
    all_rows: bool,
    block_lse: bool = False,
    mean_z: bool = False,
    argmax: bool = False,
) -> RowStats:
    """Per-row lse, target logit and weighted sum from per-tile partials (``lse_forward``);
    a classifier to be rounded is rounded one slab of classes at a time. ``block_lse``: also
    the lse per block of classes (filtering.py), from the same partials; ``mean_z`` and
    ``argmax``: also each row's mean logit under the softmax and first largest logit's class,
    from per-program partials combined the same way."""
    hidden, classifier, targets = head.hidden, head.classifier, head.targets
    bias, class_weights, spec = head.bias, head.class_weights, head.spec
    budget_bytes, compute_dtype = head.budget_bytes, head.compute_dtype
    col_start = head.col_start
    hidden = _rounded(compute_dtype, hidden)
    vocab, dim = classifier.shape
    config = _tile_config(
        hidden.device, _heavy(spec, class_weights), hidden.element_size(), dim=dim
    )
    layout = row_layout(hidden, spec.shift)
    tile = config.block_v * config.tiles_per_program
    problem = _problem(layout, classifier, hidden, compute_dtype)
    width = _tile_width(policy.forward_slab_columns(problem, budget_bytes), tile, vocab)
    device = hidden.device
    n_rows = layout.n_rows
    partial_lse = torch.empty(
        (partial_blocks(vocab, config), n_rows), dtype=torch.float32, device=device
    )
    partial_wsum = torch.empty_like(partial_lse) if spec.needs_wsum else None
    partial_mean_z = torch.empty_like(partial_lse) if mean_z else None
    partial_max = torch.empty_like(partial_lse) if argmax else None
    partial_arg = torch.empty_like(partial_lse, dtype=torch.int32) if argmax else None
    target_logit = torch.zeros(n_rows, dtype=torch.float32, device=device)
    for start, stop in _slabs(vocab, width):
        first, last = start // tile, partial_blocks(stop, config)
        lse_forward(
            hidden,
            _rounded(compute_dtype, classifier[start:stop]),
            targets,
            None if bias is None else _rounded(compute_dtype, bias[start:stop]),
            None if class_weights is None else class_weights[start:stop],
            shift=spec.shift,
            ignore_index=spec.ignore_index,
            logit_scale=spec.logit_scale,
            softcap=spec.softcap,
            skip_ignored_tiles=not all_rows,
            needs_wsum=spec.needs_wsum,
            config=config,
            col_start=col_start + start,
            out=(
                partial_lse[first:last],
                target_logit,
                None if partial_wsum is None else partial_wsum[first:last],
            ),
            mean_z_out=None if partial_mean_z is None else partial_mean_z[first:last],
            argmax_out=None
            if partial_max is None
            else (
                partial_max[first:last],
                partial_arg[first:last],
            ),
        )
    wsum = partial_wsum.sum(0) if partial_wsum is not None else None
    blocks = filtering.block_lse_from_partials(partial_lse, tile) if block_lse else None
    lse = torch.logsumexp(partial_lse, dim=0)
    stats = RowStats(lse, target_logit, wsum, blocks)
    if partial_mean_z is not None:  # each program's mean weighted by its share of the mass
        stats.mean_z = (torch.exp(partial_lse - lse) * partial_mean_z).sum(0)
    if partial_max is not None:  # the first program holding the row's largest logit
        program = partial_max.argmax(0, keepdim=True)
        stats.argmax = partial_arg.gather(0, program)[0].long()
    return stats


def fast_forward(
    head: HeadInputs,
    rows: RowTargets,
    *,
    needs: Needs,
    entropy: bool = False,
    argmax: bool = False,
) -> ForwardOut:
    """Fast mode: loss, lse and the gradients for a unit upstream gradient, computed in
    chunks of positions (three GEMMs); with ``entropy`` / ``argmax`` also those of each row,
    from the same pass over each chunk's logits."""
    hidden, classifier, targets = head.hidden, head.classifier, head.targets
    bias, class_weights, spec = head.bias, head.class_weights, head.spec
    budget_bytes, compute_dtype = head.budget_bytes, head.compute_dtype
    hidden_c, classifier_c = _rounded(compute_dtype, hidden), _rounded(compute_dtype, classifier)
    bias_c = _rounded(compute_dtype, bias)
    vocab, dim = classifier.shape
    device = hidden.device
    layout = row_layout(hidden_c, spec.shift)
    positions = layout.positions()
    n_positions = layout.n_positions
    to_positions = layout.rows_to_positions
    problem = _problem(layout, classifier, hidden_c, compute_dtype)
    chunk = policy.fast_run_rows(problem, needs.classifier, budget_bytes)
    parts = row_coefficient_parts(torch.ones((), device=device), None, rows, spec, vocab)
    p_base, coef_t, coef_w = (to_positions(v) for v in (parts.p_base, parts.coef_t, parts.coef_w))
    p_per_lse = None if parts.p_per_lse is None else to_positions(parts.p_per_lse)
    targets = to_positions(rows.safe)
    # float32 logits; the gradient, rounded to the compute dtype, over their own memory.
    logits_buf = torch.empty(
        (min(chunk, max(n_positions, 1)), vocab), dtype=torch.float32, device=device
    )
    work_dtype = _work_dtype(hidden_c)
    grad_buf = logits_buf if work_dtype == torch.float32 else logits_buf.view(work_dtype)[:, :vocab]
    # In hidden's own dtype (the op's output); each chunk's GEMM writes float32 (``stage``)
    # that is rounded once into it: a bf16 GEMM output lets cuBLAS reduce split-K partials in
    # bf16 (allow_bf16_reduced_precision_reduction), which measurably loses accuracy against
    # lean mode on a peaked softmax. No N x D float32 buffer.
    grad_positions = (
        torch.empty((n_positions, dim), dtype=hidden.dtype, device=device) if needs.hidden else None
    )
    stage = None
    if grad_positions is not None and hidden.dtype != torch.float32:
        stage = torch.empty((logits_buf.shape[0], dim), dtype=torch.float32, device=device)
    # The classifier's gradient itself, in its dtype, accumulates the chunks (no separate
    # float32 buffer): float32 under AMP, exact; bf16 for bf16 weights, each chunk's float32
    # product added in cuBLAS's epilogue and rounded once. Written, not accumulated, by the
    # first chunk's GEMM (beta = 0): no zero fill, unless there is no chunk at all (no rows).
    alloc = torch.empty if n_positions else torch.zeros
    grad_classifier = (
        alloc((vocab, dim), dtype=classifier.dtype, device=device) if needs.classifier else None
    )
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if needs.bias else None
    lse_positions = torch.empty(n_positions, dtype=torch.float32, device=device)
    stats = (
        lse_positions,
        torch.empty_like(lse_positions),
        torch.empty_like(lse_positions) if spec.needs_wsum else None,
    )
    mean_z_positions = torch.empty_like(lse_positions) if entropy else None
    argmax_positions = torch.empty_like(lse_positions, dtype=torch.int64) if argmax else None
    classifier_t = classifier_c.t()
    for start in range(0, n_positions, chunk):
        stop = min(start + chunk, n_positions)
        h = positions[start:stop]
        logits, grad = logits_buf[: stop - start], grad_buf[: stop - start]
        _matmul(h, classifier_t, out=logits)
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
            bias=bias_c,
            grad=grad,
            out=tuple(None if s is None else s[start:stop] for s in stats),
            mean_z_out=None if mean_z_positions is None else mean_z_positions[start:stop],
            argmax_out=None if argmax_positions is None else argmax_positions[start:stop],
        )
        if stage is not None:
            grad_positions[start:stop] = _matmul(grad, classifier_c, out=stage[: stop - start])
        elif grad_positions is not None:
            _matmul(grad, classifier_c, out=grad_positions[start:stop])
        if grad_classifier is not None:
            _addmm_(grad_classifier, grad.t(), h, first=start == 0)
        if grad_bias is not None:
            grad_bias += grad.sum(0, dtype=torch.float32)
    lse, target_logit, wsum = (None if s is None else layout.positions_to_rows(s) for s in stats)
    loss = finish_loss(lse, target_logit, wsum, rows, spec, vocab)
    out = ForwardOut(loss, lse)
    if mean_z_positions is not None:
        out.entropy = lse - layout.positions_to_rows(mean_z_positions)
    if argmax_positions is not None:
        out.argmax = layout.positions_to_rows(argmax_positions)
    if grad_positions is not None:
        out.grad_hidden = _hidden_grad(grad_positions, layout, hidden)
    out.grad_classifier = grad_classifier
    out.grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
    return out


def scale_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x *= scale in place, float32 math, one rounding (one pass on the GPU)."""
    if x.device.type == "cpu" or not x.is_contiguous():  # (the interpreter's small tests)
        return x.copy_(x.float() * scale.float())
    return scale_cast(x, scale, x.dtype, out=x)


def gradients(
    head: HeadInputs,
    lse: torch.Tensor,
    coefs: Coefficients,
    *,
    needs: Needs,
    keep_blocks: torch.Tensor | None = None,
) -> Gradients:
    """Slab by slab of classes: ``logit_grad`` recomputes the slab's logits and writes their
    gradient, cuBLAS turns it into d hidden (float32, accumulated) and d classifier[slab]
    (written once, in the classifier's dtype) and the bias gradient (float32)."""
    hidden, classifier, targets = head.hidden, head.classifier, head.targets
    bias, class_weights, spec = head.bias, head.class_weights, head.spec
    budget_bytes, compute_dtype = head.budget_bytes, head.compute_dtype
    col_start = head.col_start
    hidden = _rounded(compute_dtype, hidden)
    vocab, dim = classifier.shape
    device = hidden.device
    # Once here rather than in every slab's launch: the contiguous copies it may make.
    bias, class_weights, classifier = check_operands(
        hidden, classifier, targets, bias, class_weights, spec.shift
    )
    layout = row_layout(hidden, spec.shift)
    coefs = tuple(layout.rows_to_positions(c) for c in coefs)
    lse_positions = layout.rows_to_positions(lse)
    config = _tile_config(device, _heavy(spec, class_weights), hidden.element_size(), dim=dim)
    problem = _problem(layout, classifier, hidden, compute_dtype)
    # Slabs start on filtering blocks, so that no tile straddles two; the same widths with
    # and without filtering keep d hidden's slab-by-slab sum in one order (grad_filter=0
    # is then bit for bit the exact result).
    unit = math.lcm(filtering.FILTER_BLOCK, config.block_v)
    width = _tile_width(policy.lean_slab_columns(problem, needs.hidden, budget_bytes), unit, vocab)
    keep = None if keep_blocks is None else layout.rows_to_positions(keep_blocks)
    n_positions = layout.n_positions
    slab_buf = torch.empty((n_positions, width), dtype=_work_dtype(hidden), device=device)
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
    for start, stop in _slabs(vocab, width):
        slab = slab_buf[:, : stop - start]
        classifier_slab = _rounded(compute_dtype, classifier[start:stop])
        logit_grad(
            hidden,
            classifier_slab,
            targets,
            None if bias is None else _rounded(compute_dtype, bias[start:stop]),
            None if class_weights is None else class_weights[start:stop],
            lse_positions,
            coefs,
            slab,
            target_offset=col_start + start,
            shift=spec.shift,
            logit_scale=spec.logit_scale,
            softcap=spec.softcap,
            smoothing=spec.needs_wsum,
            config=config,
            keep=keep,
            filter_block=filtering.FILTER_BLOCK,
        )
        if grad_positions is not None:
            _addmm_(grad_positions, slab, classifier_slab, first=start == 0)
        if grad_classifier is not None:
            # Positions that are no loss row have zero gradient rows in the slab.
            _matmul(slab.t(), positions, out=grad_classifier[start:stop])
        if grad_bias is not None:
            grad_bias[start:stop] = slab.sum(0, dtype=torch.float32)
    grad_hidden = None
    if grad_positions is not None:
        grad_hidden = _hidden_grad(grad_positions, layout, hidden)
    return grad_hidden, grad_classifier, grad_bias
