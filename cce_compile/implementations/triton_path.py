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
  Three GEMMs, the minimum, and no V x D tensor but the gradient. Over a vocabulary shard
  (``SplitVocabulary``): ``chunk_row_stats``, the combine over the ranks, then
  ``chunk_softmax_grad`` with the whole vocabulary's lse.
Mixed precision (``compute_dtype`` rounding float32 inputs, autocast's form): hidden is rounded
once; the classifier one slab of classes at a time in lean mode (no V x D copy), once in fast
mode (cuBLAS needs it whole per chunk); classifier gradients are written in float32 directly.
The sizes of slabs and chunks come from ``policy`` (the memory budget).

Everything here also runs on CPU tensors under TRITON_INTERPRET=1 (the kernel tests): there
the GEMMs run in float32 and slabs are float32, because the interpreter truncates when it
rounds to bfloat16.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import filtering, policy
from ..kernels.chunk_softmax_grad import chunk_row_stats, chunk_softmax_grad
from ..kernels.common import RowLayout, TileConfig, check_operands, row_layout
from ..kernels.logit_grad import logit_grad
from ..kernels.lse_forward import lse_forward, partial_blocks
from ..kernels.scale_cast import scale_cast
from ..loss_math import RowTargets, finish_loss, row_coefficient_parts
from .interface import (
    Coefficients,
    ForwardOut,
    Gradients,
    HeadInputs,
    Needs,
    RowStats,
    SplitVocabulary,
)

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


def _part(t: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if t is None else t[start:stop]


def _config_of(head: HeadInputs, hidden: torch.Tensor) -> TileConfig:
    """The GEMM kernels' tiles for ``head`` (``hidden``: its hidden in the compute dtype)."""
    spec = head.spec
    heavy = bool(spec.softcap or spec.label_smoothing or head.class_weights is not None)
    return _tile_config(hidden.device, heavy, hidden.element_size(), dim=head.classifier.shape[1])


def _work_dtype(tensor: torch.Tensor) -> torch.dtype:
    """dtype of slabs and gradients: the compute dtype on GPU, float32 in the interpreter."""
    return torch.float32 if tensor.device.type == "cpu" else tensor.dtype


def _problem(layout: RowLayout, head: HeadInputs, work: torch.Tensor) -> policy.Problem:
    """The head's sizes as ``policy`` takes them (``work``: a tensor in the GEMMs' dtype)."""
    rounds = head.compute_dtype is not None
    shape = tuple(head.classifier.shape)
    return policy.problem(layout.n_positions, shape, _work_dtype(work), rounds, "cuda")


def _slab_operands(
    head: HeadInputs, start: int, stop: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The classes [start, stop) of the head as the kernels take them: classifier and bias
    rounded to the compute dtype (one slab at a time: no V x D copy), class weights."""
    return (
        _rounded(head.compute_dtype, head.classifier[start:stop]),
        _rounded(head.compute_dtype, _part(head.bias, start, stop)),
        _part(head.class_weights, start, stop),
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


@dataclasses.dataclass
class _Partials:
    """``lse_forward``'s per-program partials of each row, (programs, N): the lse, and where
    asked the weighted sum, the mean logit under the program's softmax, and the largest logit
    with its first class (int32)."""

    lse: torch.Tensor
    wsum: torch.Tensor | None
    mean_z: torch.Tensor | None
    top: tuple[torch.Tensor, torch.Tensor] | None

    @staticmethod
    def empty(
        programs: int, n_rows: int, device: torch.device, *, wsum: bool, mean_z: bool, argmax: bool
    ) -> _Partials:
        """Room for ``programs`` programs' partials of ``n_rows`` rows."""
        lse = torch.empty((programs, n_rows), dtype=torch.float32, device=device)
        top = (torch.empty_like(lse), torch.empty_like(lse, dtype=torch.int32)) if argmax else None
        return _Partials(
            lse,
            torch.empty_like(lse) if wsum else None,
            torch.empty_like(lse) if mean_z else None,
            top,
        )

    def outputs(self, first: int, last: int, target_logit: torch.Tensor) -> dict:
        """``lse_forward``'s output arguments for the programs [first, last)."""
        return dict(
            out=(self.lse[first:last], target_logit, _part(self.wsum, first, last)),
            mean_z_out=_part(self.mean_z, first, last),
            argmax_out=None if self.top is None else tuple(t[first:last] for t in self.top),
        )

    def row_stats(self, target_logit: torch.Tensor, tile: int, block_lse: bool) -> RowStats:
        """Each row's statistics over every program's classes (``block_lse``: also per block
        of classes, programs of ``tile`` classes)."""
        wsum = self.wsum.sum(0) if self.wsum is not None else None
        blocks = filtering.block_lse_from_partials(self.lse, tile) if block_lse else None
        lse = torch.logsumexp(self.lse, dim=0)
        stats = RowStats(lse, target_logit, wsum, blocks)
        if self.mean_z is not None:  # each program's mean weighted by its share of the mass
            stats.mean_z = (torch.exp(self.lse - lse) * self.mean_z).sum(0)
        if self.top is not None:  # the first program holding the row's largest logit
            top, arg = self.top
            program = top.argmax(0, keepdim=True)
            stats.argmax = arg.gather(0, program)[0].long()
        return stats


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
    spec, vocab = head.spec, head.vocab
    hidden = _rounded(head.compute_dtype, head.hidden)
    config = _config_of(head, hidden)
    layout = row_layout(hidden, spec.shift)
    tile = config.block_v * config.tiles_per_program
    problem = _problem(layout, head, hidden)
    width = _tile_width(policy.forward_slab_columns(problem, head.budget_bytes), tile, vocab)
    partials = _Partials.empty(
        partial_blocks(vocab, config),
        layout.n_rows,
        hidden.device,
        wsum=spec.needs_wsum,
        mean_z=mean_z,
        argmax=argmax,
    )
    target_logit = torch.zeros(layout.n_rows, dtype=torch.float32, device=hidden.device)
    for start, stop in _slabs(vocab, width):
        classifier, bias, class_weights = _slab_operands(head, start, stop)
        lse_forward(
            hidden,
            classifier,
            head.targets,
            bias,
            class_weights,
            shift=spec.shift,
            ignore_index=spec.ignore_index,
            logit_scale=spec.logit_scale,
            softcap=spec.softcap,
            skip_ignored_tiles=not all_rows,
            needs_wsum=spec.needs_wsum,
            config=config,
            col_start=head.col_start + start,
            **partials.outputs(start // tile, partial_blocks(stop, config), target_logit),
        )
    return partials.row_stats(target_logit, tile, block_lse)


@dataclasses.dataclass
class _PositionCoefficients:
    """Fast mode's per-position inputs of ``chunk_softmax_grad`` for a unit upstream gradient:
    each position's target (clamped: a valid class) and coefficients (0 where no loss row)."""

    targets: torch.Tensor
    p_base: torch.Tensor
    p_per_lse: torch.Tensor | None
    coef_t: torch.Tensor
    coef_w: torch.Tensor

    @staticmethod
    def of(
        head: HeadInputs, rows: RowTargets, layout: RowLayout, split: SplitVocabulary | None
    ) -> _PositionCoefficients:
        """``rows`` over the whole vocabulary (``split``: of which the head holds a shard; a
        target on another shard becomes column -1, none of the shard's)."""
        unit = torch.ones((), device=head.hidden.device)
        vocab = head.vocab if split is None else split.size
        parts = row_coefficient_parts(unit, None, rows, head.spec, vocab)
        targets = rows.safe
        if split is not None:
            columns = rows.targets.long() - head.col_start
            targets = torch.where((columns >= 0) & (columns < head.vocab), columns, -1)
        to_positions = layout.rows_to_positions
        return _PositionCoefficients(
            to_positions(targets),
            to_positions(parts.p_base),
            None if parts.p_per_lse is None else to_positions(parts.p_per_lse),
            to_positions(parts.coef_t),
            to_positions(parts.coef_w),
        )

    def chunk(self, start: int, stop: int) -> dict:
        """The positions [start, stop) as ``chunk_softmax_grad``'s keyword arguments."""
        fields = dataclasses.fields(self)
        return {f.name: _part(getattr(self, f.name), start, stop) for f in fields}


class _FastBuffers:
    """Fast mode's buffers, filled chunk by chunk of positions: the float32 logits and their
    gradient over their own memory, each position's lse, target logit, wsum (and mean logit,
    argmax where asked), and the gradients for a unit upstream gradient."""

    def __init__(
        self,
        head: HeadInputs,
        layout: RowLayout,
        needs: Needs,
        chunk: int,
        work: torch.Tensor,
        *,
        entropy: bool,
        argmax: bool,
        split: bool = False,
    ):
        """Room for ``chunk`` positions' logits (``work``: hidden in the compute dtype);
        ``split``: hidden's gradient is a shard's float32 partial sum."""
        vocab, dim = head.classifier.shape
        device, n_positions = work.device, layout.n_positions
        # float32 logits; the gradient, rounded to the compute dtype, over their own memory.
        self.logits = torch.empty(
            (min(chunk, max(n_positions, 1)), vocab), dtype=torch.float32, device=device
        )
        work_dtype = _work_dtype(work)
        self.grad = (
            self.logits if work_dtype == torch.float32 else self.logits.view(work_dtype)[:, :vocab]
        )
        # In hidden's own dtype (the op's output); each chunk's GEMM writes float32 (``stage``)
        # that is rounded once into it: a bf16 GEMM output lets cuBLAS reduce split-K partials
        # in bf16 (allow_bf16_reduced_precision_reduction), which measurably loses accuracy
        # against lean mode on a peaked softmax. No N x D float32 buffer.
        hidden_dtype = torch.float32 if split else head.hidden.dtype
        self.grad_positions = (
            torch.empty((n_positions, dim), dtype=hidden_dtype, device=device)
            if needs.hidden
            else None
        )
        self.stage = None
        if self.grad_positions is not None and hidden_dtype != torch.float32:
            self.stage = torch.empty(
                (self.logits.shape[0], dim), dtype=torch.float32, device=device
            )
        # The classifier's gradient itself, in its dtype, accumulates the chunks (no separate
        # float32 buffer): float32 under AMP, exact; bf16 for bf16 weights, each chunk's float32
        # product added in cuBLAS's epilogue and rounded once. Written, not accumulated, by the
        # first chunk's GEMM (beta = 0): no zero fill, unless there is no chunk at all (no rows).
        alloc = torch.empty if n_positions else torch.zeros
        self.grad_classifier = (
            alloc((vocab, dim), dtype=head.classifier.dtype, device=device)
            if needs.classifier
            else None
        )
        self.grad_bias = (
            torch.zeros(vocab, dtype=torch.float32, device=device) if needs.bias else None
        )
        lse = torch.empty(n_positions, dtype=torch.float32, device=device)
        wsum = torch.empty_like(lse) if head.spec.needs_wsum else None
        self.stats = (lse, torch.empty_like(lse), wsum)  # lse, target logit, wsum
        self.mean_z = torch.empty_like(lse) if entropy else None
        self.argmax = torch.empty_like(lse, dtype=torch.int64) if argmax else None

    def chunk_outputs(self, start: int, stop: int) -> dict:
        """``chunk_softmax_grad``'s output arguments for the positions [start, stop)."""
        return dict(
            grad=self.grad[: stop - start],
            out=tuple(_part(s, start, stop) for s in self.stats),
            mean_z_out=_part(self.mean_z, start, stop),
            argmax_out=_part(self.argmax, start, stop),
        )

    def add_gradients(self, start: int, stop: int, h: torch.Tensor, classifier) -> None:
        """The chunk's shares of the gradients from its logits' gradient (``h``: its hidden
        positions, ``classifier`` in the compute dtype)."""
        grad = self.grad[: stop - start]
        if self.stage is not None:
            self.grad_positions[start:stop] = _matmul(
                grad, classifier, out=self.stage[: stop - start]
            )
        elif self.grad_positions is not None:
            _matmul(grad, classifier, out=self.grad_positions[start:stop])
        if self.grad_classifier is not None:
            _addmm_(self.grad_classifier, grad.t(), h, first=start == 0)
        if self.grad_bias is not None:
            self.grad_bias += grad.sum(0, dtype=torch.float32)

    def result(
        self, head: HeadInputs, rows: RowTargets, layout: RowLayout, vocab: int
    ) -> ForwardOut:
        """The loss over ``vocab`` classes, each row's statistics and the gradients in the
        inputs' dtypes (hidden's in the buffer's: float32 for a shard's partial sum)."""
        lse, target_logit, wsum = (_rows_of(layout, s) for s in self.stats)
        out = ForwardOut(finish_loss(lse, target_logit, wsum, rows, head.spec, vocab), lse)
        if self.mean_z is not None:
            out.entropy = lse - layout.positions_to_rows(self.mean_z)
        out.argmax = _rows_of(layout, self.argmax)
        if self.grad_positions is not None:
            out.grad_hidden = _hidden_grad(self.grad_positions, layout, head.hidden)
        out.grad_classifier = self.grad_classifier
        out.grad_bias = None if self.grad_bias is None else self.grad_bias.to(head.bias.dtype)
        return out


def _rows_of(layout: RowLayout, positions: torch.Tensor | None) -> torch.Tensor | None:
    return None if positions is None else layout.positions_to_rows(positions)


def fast_forward(
    head: HeadInputs,
    rows: RowTargets,
    *,
    needs: Needs,
    entropy: bool = False,
    argmax: bool = False,
    split: SplitVocabulary | None = None,
) -> ForwardOut:
    """Fast mode: loss, lse and the gradients for a unit upstream gradient, computed in
    chunks of positions (three GEMMs); with ``entropy`` / ``argmax`` also those of each row,
    from the same pass over each chunk's logits; with ``split``, over a shard of a split
    vocabulary (``interface.Implementation``)."""
    if split is not None and (entropy or argmax):
        raise ValueError("fast mode over a split vocabulary computes no entropy or argmax")
    hidden, classifier, bias = (
        _rounded(head.compute_dtype, t) for t in (head.hidden, head.classifier, head.bias)
    )
    layout = row_layout(hidden, head.spec.shift)
    positions, n_positions = layout.positions(), layout.n_positions
    problem = _problem(layout, head, hidden)
    if split is not None:  # every rank's chunks alike: one collective each
        problem = dataclasses.replace(problem, vocab=split.share)
    chunk = policy.fast_run_rows(problem, needs.classifier, head.budget_bytes)
    coefs = _PositionCoefficients.of(head, rows, layout, split)
    out = _FastBuffers(
        head, layout, needs, chunk, hidden, entropy=entropy, argmax=argmax, split=bool(split)
    )
    classifier_t = classifier.t()
    for start in range(0, n_positions, chunk):
        stop = min(start + chunk, n_positions)
        h, logits = positions[start:stop], out.logits[: stop - start]
        _matmul(h, classifier_t, out=logits)
        kernel_args = dict(
            class_weights=head.class_weights,
            logit_scale=head.spec.logit_scale,
            softcap=head.spec.softcap,
            smoothing=head.spec.needs_wsum,
            bias=bias,
            **coefs.chunk(start, stop),
        )
        if split is None:
            chunk_softmax_grad(logits, **kernel_args, **out.chunk_outputs(start, stop))
        else:
            _shard_chunk(logits, kernel_args, out, (start, stop), split)
        out.add_gradients(start, stop, h, classifier)
    return out.result(head, rows, layout, head.vocab if split is None else split.size)


def _shard_chunk(
    logits: torch.Tensor, kernel_args: dict, out: _FastBuffers, span: tuple, split
) -> None:
    """A chunk of a vocabulary shard's logits: its statistics over the shard (one read),
    combined over the ranks, then its gradient with the whole vocabulary's lse."""
    start, stop = span
    stats = tuple(_part(s, start, stop) for s in out.stats)
    coefs = ("p_base", "p_per_lse", "coef_t", "coef_w")
    stat_args = {k: v for k, v in kernel_args.items() if k not in coefs}
    chunk_row_stats(logits, **stat_args, out=stats)
    whole = split.combine(RowStats(*stats))
    for mine, combined in zip(stats, (whole.lse, whole.target_logit, whole.wsum)):
        if mine is not None:
            mine.copy_(combined)
    chunk_softmax_grad(logits, **kernel_args, grad=out.grad[: stop - start], lse=stats[0])


def scale_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x *= scale in place, float32 math, one rounding (one pass on the GPU)."""
    if x.device.type == "cpu" or not x.is_contiguous():  # (the interpreter's small tests)
        return x.copy_(x.float() * scale.float())
    return scale_cast(x, scale, x.dtype, out=x)


class _SlabGradients:
    """The lean backward's gradients, filled slab by slab of classes: hidden's by position
    (float32, accumulated), the classifier's rows of each slab (written once, in its dtype),
    the bias's (float32)."""

    def __init__(self, head: HeadInputs, layout: RowLayout, needs: Needs):
        vocab, dim = head.classifier.shape
        device, n_positions = head.classifier.device, layout.n_positions
        self.hidden = (
            torch.empty((n_positions, dim), dtype=torch.float32, device=device)
            if needs.hidden
            else None
        )
        self.positions = layout.positions() if needs.classifier else None
        self.classifier = (
            torch.empty((vocab, dim), dtype=head.classifier.dtype, device=device)
            if needs.classifier
            else None
        )
        self.bias = torch.empty(vocab, dtype=torch.float32, device=device) if needs.bias else None

    def add(self, slab: torch.Tensor, classifier_slab: torch.Tensor, start: int, stop: int) -> None:
        """The gradients' shares of the slab of classes [start, stop) from its logits'
        gradient (``classifier_slab``: its rows in the compute dtype)."""
        if self.hidden is not None:
            _addmm_(self.hidden, slab, classifier_slab, first=start == 0)
        if self.classifier is not None:
            # Positions that are no loss row have zero gradient rows in the slab.
            _matmul(slab.t(), self.positions, out=self.classifier[start:stop])
        if self.bias is not None:
            self.bias[start:stop] = slab.sum(0, dtype=torch.float32)

    def result(self, layout: RowLayout, hidden: torch.Tensor) -> Gradients:
        grad_hidden = None if self.hidden is None else _hidden_grad(self.hidden, layout, hidden)
        return grad_hidden, self.classifier, self.bias


def _lean_slab_width(
    head: HeadInputs, layout: RowLayout, hidden: torch.Tensor, config: TileConfig, needs: Needs
) -> int:
    """The lean backward's classes per slab (``hidden`` in the compute dtype).

    Slabs start on filtering blocks, so that no tile straddles two; the same widths with and
    without filtering keep d hidden's slab-by-slab sum in one order (grad_filter=0 is then
    bit for bit the exact result)."""
    problem = _problem(layout, head, hidden)
    columns = policy.lean_slab_columns(problem, needs.hidden, head.budget_bytes)
    return _tile_width(columns, math.lcm(filtering.FILTER_BLOCK, config.block_v), head.vocab)


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
    spec = head.spec
    hidden = _rounded(head.compute_dtype, head.hidden)
    # Once here rather than in every slab's launch: the contiguous copies it may make.
    bias, class_weights, classifier = check_operands(
        hidden, head.classifier, head.targets, head.bias, head.class_weights, spec.shift
    )
    head = dataclasses.replace(head, classifier=classifier, bias=bias, class_weights=class_weights)
    layout = row_layout(hidden, spec.shift)
    to_positions = layout.rows_to_positions
    coefs, lse_positions = tuple(to_positions(c) for c in coefs), to_positions(lse)
    keep = None if keep_blocks is None else to_positions(keep_blocks)
    config = _config_of(head, hidden)
    width = _lean_slab_width(head, layout, hidden, config, needs)
    slab_buf = torch.empty(
        (layout.n_positions, width), dtype=_work_dtype(hidden), device=hidden.device
    )
    grads = _SlabGradients(head, layout, needs)
    for start, stop in _slabs(head.vocab, width):
        slab = slab_buf[:, : stop - start]
        classifier_slab, bias_slab, weights_slab = _slab_operands(head, start, stop)
        logit_grad(
            hidden,
            classifier_slab,
            head.targets,
            bias_slab,
            weights_slab,
            lse_positions,
            coefs,
            slab,
            target_offset=head.col_start + start,
            shift=spec.shift,
            logit_scale=spec.logit_scale,
            softcap=spec.softcap,
            smoothing=spec.needs_wsum,
            config=config,
            keep=keep,
            filter_block=filtering.FILTER_BLOCK,
        )
        grads.add(slab, classifier_slab, start, stop)
    return grads.result(layout, hidden)
