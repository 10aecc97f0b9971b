"""The PyTorch implementation: the CPU path (any device), and the fast companion of the oracle.

Never N x V: the logits exist one tile at a time, in float32, and everything is accumulated in
float32 (it matches float32 math to rounding).

* Lean mode (``logit_stats``, ``gradients``) takes tiles of up to ``ROW_TILE`` rows by a slab
  of classes. The forward combines each row's log-sum-exp over the slabs; the backward
  recomputes each tile, turns it into its gradient in place, adds its share of hidden's
  gradient to the row block's float32 accumulator, and writes (past the first row block:
  adds) its slab of the classifier's gradient.
* Fast mode (``fast_forward``) needs a row's lse before any of its gradient, so it takes
  chunks of whole rows (over a vocabulary shard: the shard's statistics, combined over the
  ranks, give that lse).

The tile's size: the memory budget (``policy.cpu_chunk_rows``) is a maximum, not a target. A
CPU's GEMMs run at full speed only while their output stays in cache, so a lean tile holds at
most ``TILE_ELEMENTS`` logits (``bench/cpu_path.py`` measures it).

Shapes follow the op's canonical form (``interface``): row ``r`` of the loss is
``hidden[b, t]`` predicting ``targets[b, t + shift]`` with ``(b, t) = divmod(r, T - shift)``,
so a shift never copies ``hidden`` where its rows form one strided matrix.

``autograd_fallback`` leaves the same math to PyTorch's autograd, for what the op's own formula
does not cover.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import torch

from .. import filtering
from ..loss_math import LOG_P_FLOOR, LossSpec, RowTargets, finish_loss, row_coefficients
from ..policy import FAST_EXTRA_STATS, cpu_chunk_rows
from .interface import (
    Coefficients,
    ForwardOut,
    Gradients,
    HeadInputs,
    Needs,
    RowStats,
    SplitVocabulary,
)
from .torch_row_stats import RowExtras, exp_, row_max, tile_lse_

# The most rows per lean tile. Tiles of fewer rows re-read each slab of the classifier more
# often: at the CPU demo's shape 256-row tiles took 1.3x as long as 1024-row ones.
ROW_TILE = 1024
# The most float32 logits per lean tile (2 MiB): larger tiles were no faster on 2 cores with
# 1 MiB of L2 cache each, and they take memory.
TILE_ELEMENTS = 1 << 19
# Slabs are whole blocks of gradient filtering's classes, so that a slab's per-block lse is
# complete (filtering.py).
SLAB_ALIGN = filtering.FILTER_BLOCK


class _Rows:
    """The loss's rows of a (B, T, D) tensor as one (N, D) matrix, a view where possible."""

    def __init__(self, hidden: torch.Tensor, shift: int):
        self.hidden = hidden
        self.per_batch = hidden.shape[1] - shift
        self.count = hidden.shape[0] * self.per_batch
        self.shift = shift

    def view_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """``tensor``'s rows as an (N, D) view, or None where they are not one matrix."""
        if self.shift and tensor.shape[0] != 1:
            return None
        try:
            return tensor[:, : self.per_batch].view(-1, tensor.shape[-1])
        except RuntimeError:
            return None

    def index(self) -> tuple[torch.Tensor, torch.Tensor]:
        r = torch.arange(self.count, device=self.hidden.device)
        return r // self.per_batch, r % self.per_batch

    def read(self) -> torch.Tensor:
        view = self.view_of(self.hidden)
        return view if view is not None else self.hidden[self.index()]

    def write(self, out: torch.Tensor, value: torch.Tensor) -> None:
        out[self.index()] = value


def _ranges(total: int, step: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, step):
        yield start, min(start + step, total)


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """Lean mode's tiles: up to ``rows`` x ``cols`` logits."""

    rows: int
    cols: int

    @staticmethod
    def of(n_rows: int, vocab: int, budget: int) -> _Tiles:
        # The slab's width from the vocabulary alone: a row's lse is then summed over the same
        # slabs whatever the call's row count, so an RL trainer's no-grad and grad calls of
        # different batch sizes give a row the same bits (an importance ratio of exactly 1).
        cols = vocab
        if ROW_TILE * vocab > TILE_ELEMENTS:
            cols = min(vocab, max(SLAB_ALIGN, TILE_ELEMENTS // ROW_TILE // SLAB_ALIGN * SLAB_ALIGN))
        rows = max(1, min(n_rows, ROW_TILE, TILE_ELEMENTS // cols))
        return _Tiles(max(1, min(rows, cpu_chunk_rows(cols, budget))), cols)

    def buffer(self, n_rows: int, device: torch.device) -> torch.Tensor:
        return torch.empty(min(n_rows, self.rows) * self.cols, device=device)


def _view(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return buffer[: rows * cols].view(rows, cols)


def _tile_logits(out: torch.Tensor, h32, c32, b32, spec: LossSpec) -> torch.Tensor:
    """z = softcap(logit_scale * (h @ c.T + b)) of one tile, float32, computed in ``out``."""
    z = torch.mm(h32, c32.T, out=out)
    if b32 is not None:
        z += b32
    if spec.logit_scale != 1.0:
        z *= spec.logit_scale
    if spec.softcap is not None:
        z.div_(spec.softcap).tanh_().mul_(spec.softcap)
    return z


@dataclasses.dataclass
class _ClassTargets:
    """Each row's target as a column of the given classes [col_start, col_start + V)."""

    index: torch.Tensor  # (N,) int64 column, clamped into [0, V): usable as an index
    hit: torch.Tensor  # (N,) bool: the target is one of the given classes

    @staticmethod
    def of(head: HeadInputs) -> _ClassTargets:
        columns = head.targets[:, head.spec.shift :].reshape(-1).long() - head.col_start
        hit = (columns >= 0) & (columns < head.vocab)
        return _ClassTargets(torch.where(hit, columns, 0), hit)

    def slice(self, start: int, stop: int) -> _ClassTargets:
        return _ClassTargets(self.index[start:stop], self.hit[start:stop])

    def in_slab(self, start: int, stop: int, vocab: int) -> _ClassTargets:
        """The targets as columns of the slab [start, stop) of these ``vocab`` classes."""
        if start == 0 and stop == vocab:
            return self
        local = self.index - start
        hit = self.hit & (local >= 0) & (local < stop - start)
        return _ClassTargets(local * hit, hit)


def _tanh_grad(z: torch.Tensor, spec: LossSpec, out: torch.Tensor | None) -> torch.Tensor | None:
    """The softcap's derivative 1 - (z / softcap)^2 at the capped logits ``z`` (in ``out``)."""
    if spec.softcap is None:
        return None
    return torch.div(z, spec.softcap, out=out).square_().neg_().add_(1.0)


def _tanh_out(tanh_buffer: torch.Tensor | None, z: torch.Tensor) -> torch.Tensor | None:
    """Room for the softcap's derivative at the tile ``z``, in ``tanh_buffer`` (None: none)."""
    return None if tanh_buffer is None else _view(tanh_buffer, *z.shape)


def _finish_grad_(
    grad: torch.Tensor,
    tanh_grad: torch.Tensor | None,
    coefs: Coefficients,
    columns: _ClassTargets,
    w32: torch.Tensor | None,
    spec: LossSpec,
    keep: torch.Tensor | None,
) -> torch.Tensor:
    """From the tile's softmax term coef_p * p to d loss / d (h @ c.T + b), in place."""
    coef_t, coef_w = coefs.t, coefs.w
    if keep is not None:
        grad.mul_(keep)
    grad.scatter_add_(1, columns.index[:, None], torch.where(columns.hit, -coef_t, 0.0)[:, None])
    if spec.label_smoothing:
        grad.sub_(coef_w[:, None] * w32 if w32 is not None else coef_w[:, None])
    if tanh_grad is not None:
        grad.mul_(tanh_grad)
    if spec.logit_scale != 1.0:
        grad.mul_(spec.logit_scale)
    return grad


def _grad_from_logits(
    z: torch.Tensor,
    shift: torch.Tensor,
    coefs: Coefficients,
    columns: _ClassTargets,
    w32: torch.Tensor | None,
    spec: LossSpec,
    keep: torch.Tensor | None = None,
    tanh_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """d loss / d (h @ c.T + b) of one tile from its logits ``z``, written over them.

    ``shift`` (n,): each row's lse, +inf on rows without a gradient (``_lse_shift``);
    ``columns``: the targets as the tile's columns; ``w32``: the tile's class weights;
    ``keep`` (n, cols) bool: gradient filtering drops the softmax term elsewhere;
    ``tanh_out``: room for the softcap's derivative."""
    tanh_grad = _tanh_grad(z, spec, tanh_out)
    log_p = z.sub_(shift[:, None])
    if coefs.e is None:
        grad = exp_(log_p).mul_(coefs.p[:, None])
    else:  # the entropy's term: (coef_p + coef_e * log p) * p
        # Clamped (loss_math.LOG_P_FLOOR): a -inf logit, or a row without gradient, has
        # log p = -inf, and 0 * -inf would be NaN.
        factor = log_p.clamp(min=LOG_P_FLOOR).mul_(coefs.e[:, None]).add_(coefs.p[:, None])
        grad = exp_(log_p).mul_(factor)
    return _finish_grad_(grad, tanh_grad, coefs, columns, w32, spec, keep)


def _lse_shift(lse: torch.Tensor, coefs: Coefficients) -> torch.Tensor:
    """Each row's lse, +inf on rows with no upstream gradient (ignored rows): their gradient
    is then exp(-inf) * 0 = 0 with no extra pass, even where their saved lse is a placeholder
    and exp(z - lse) would overflow (non-finite logits give NaN, as in PyTorch)."""
    return torch.where(coefs.active(), lse, math.inf)


class _Accumulators:
    """float32 gradients, filled tile by tile: hidden's per row block over the slabs,
    the classifier's and bias's per slab over the row blocks."""

    def __init__(self, head: HeadInputs, needs: Needs, rows_io: _Rows):
        hidden, classifier, bias = head.hidden, head.classifier, head.bias
        device = classifier.device
        empty = torch.zeros if rows_io.count == 0 else torch.empty  # no tile writes them
        self.rows_io = rows_io
        self.hidden = self.hidden_rows = None
        if needs.hidden:
            self.hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=device)
            self.hidden_rows = rows_io.view_of(self.hidden)
            if self.hidden_rows is None:
                self.hidden_rows = torch.empty(
                    (rows_io.count, hidden.shape[-1]), dtype=torch.float32, device=device
                )
        self.classifier = (
            empty(classifier.shape, dtype=torch.float32, device=device)
            if needs.classifier
            else None
        )
        self.bias = empty(bias.shape, dtype=torch.float32, device=device) if needs.bias else None

    def add(self, grad, rows: tuple[int, int], cols: tuple[int, int], h32, c32) -> None:
        """One tile's gradient (rows x cols): its shares of the three gradients."""
        (r0, r1), (c0, c1) = rows, cols
        if self.hidden_rows is not None:
            if c0 == 0:
                torch.mm(grad, c32, out=self.hidden_rows[r0:r1])
            else:
                self.hidden_rows[r0:r1].addmm_(grad, c32)
        if self.classifier is not None:
            if r0 == 0:
                torch.mm(grad.T, h32, out=self.classifier[c0:c1])
            else:
                self.classifier[c0:c1].addmm_(grad.T, h32)
        if self.bias is not None:
            if r0 == 0:
                torch.sum(grad, 0, out=self.bias[c0:c1])
            else:
                self.bias[c0:c1] += grad.sum(0)

    def result(self) -> Gradients:
        if self.hidden is not None and self.rows_io.view_of(self.hidden) is None:
            self.rows_io.write(self.hidden, self.hidden_rows)
        return self.hidden, self.classifier, self.bias


# Elements per step of ``scale_``'s float32 temporaries (4 MiB).
_SCALE_STEP = 1 << 20


def scale_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x *= scale in place with float32 math and one rounding (in steps: no float32 copy of
    a low-precision x)."""
    if x.dtype == torch.float32:
        return x.mul_(scale)
    if not x.is_contiguous():
        return x.copy_(x.float() * scale.float())
    for part in x.view(-1).split(_SCALE_STEP):
        part.copy_(part.float().mul_(scale.float()))
    return x


def _float(t: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.Tensor:
    """t as float32 after rounding to the head's compute dtype (autocast's rounding)."""
    return (t if compute_dtype is None else t.to(compute_dtype)).float()


def _part(t: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    return None if t is None else t[start:stop]


@dataclasses.dataclass
class Float32Operands:
    """The head's operands in float32 (hidden, classifier and bias first rounded to the compute
    dtype): hidden's loss rows as one (N, D) matrix, the classifier, bias and class weights."""

    rows: _Rows
    hidden: torch.Tensor  # (N, D)
    classifier: torch.Tensor  # (V, D)
    bias: torch.Tensor | None  # (V,)
    class_weights: torch.Tensor | None  # (V,)

    @staticmethod
    def of(head: HeadInputs) -> Float32Operands:
        rows = _Rows(head.hidden, head.spec.shift)
        dtype = head.compute_dtype
        return Float32Operands(
            rows,
            _float(rows.read(), dtype),
            _float(head.classifier, dtype),
            None if head.bias is None else _float(head.bias, dtype),
            None if head.class_weights is None else head.class_weights.float(),
        )

    def tile_logits(
        self, buffer: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int], spec: LossSpec
    ) -> torch.Tensor:
        """The tile's logits (rows x cols), computed in ``buffer``."""
        (r0, r1), (c0, c1) = rows, cols
        out = _view(buffer, r1 - r0, c1 - c0)
        c32, b32 = self.classifier[c0:c1], _part(self.bias, c0, c1)
        return _tile_logits(out, self.hidden[r0:r1], c32, b32, spec)


def logit_stats(
    head: HeadInputs,
    *,
    all_rows: bool,
    block_lse: bool = False,
    extras: frozenset[str] = frozenset(),
) -> RowStats:
    """Per-row lse, target logit and weighted sum over the given classes (every row), and
    with ``block_lse`` the lse of each block of classes (filtering.py), with ``extras`` the
    ``RowStats`` fields named there (``interface.EXTRA_STATS``)."""
    operands, columns = Float32Operands.of(head), _ClassTargets.of(head)
    w32, vocab, device = operands.class_weights, head.vocab, head.hidden.device
    n_rows = operands.rows.count
    lse = torch.empty(n_rows, dtype=torch.float32, device=device)
    target_logit = torch.zeros_like(lse)
    wsum = torch.zeros_like(lse) if head.spec.needs_wsum else None
    blocks = None
    if block_lse:
        blocks = torch.empty((filtering.block_count(vocab), n_rows), device=device)
    extras = RowExtras(n_rows, device, extras)
    tiles = _Tiles.of(n_rows, vocab, head.budget_bytes)
    buffer = tiles.buffer(n_rows, device)
    for r0, r1 in _ranges(n_rows, tiles.rows):
        row_columns = columns.slice(r0, r1)
        for c0, c1 in _ranges(vocab, tiles.cols):
            z = operands.tile_logits(buffer, (r0, r1), (c0, c1), head.spec)
            in_slab = row_columns.in_slab(c0, c1, vocab)
            picked = z.gather(1, in_slab.index[:, None])[:, 0]
            torch.where(in_slab.hit, picked, target_logit[r0:r1], out=target_logit[r0:r1])
            if wsum is not None:
                wsum[r0:r1] += z @ w32[c0:c1] if w32 is not None else z.sum(-1)
            if blocks is not None:
                b0 = c0 // filtering.FILTER_BLOCK
                part = filtering.block_lse_of_logits(z).t()
                blocks[b0 : b0 + part.shape[0], r0:r1] = part
            extras.add(z, (r0, r1), c0)
            if c0 == 0:
                lse[r0:r1] = tile_lse_(z)
            else:
                torch.logaddexp(lse[r0:r1], tile_lse_(z), out=lse[r0:r1])
    return extras.stats_into(RowStats(lse, target_logit, wsum, blocks))


class _FastChunks:
    """Fast mode's run over chunks of whole rows: the float32 operands, each row's statistics,
    the gradients' accumulators and one chunk's buffers. A chunk's gradient comes from its
    logits in one of two ways: over the whole vocabulary (``whole``), or over a shard of a
    split one (``shard``)."""

    def __init__(self, head: HeadInputs, needs: Needs, metrics: tuple, chunk_classes: int):
        """``metrics``: the ``RowStats`` extras wanted; ``chunk_classes``: the classes a chunk is
        sized for."""
        self.head = head
        self.operands, self.columns = Float32Operands.of(head), _ClassTargets.of(head)
        device, self.n_rows = head.hidden.device, self.operands.rows.count
        self.lse = torch.empty(self.n_rows, dtype=torch.float32, device=device)
        self.target_logit = torch.empty_like(self.lse)
        self.wsum = torch.empty_like(self.lse) if head.spec.needs_wsum else None
        self.acc = _Accumulators(head, needs, self.operands.rows)
        self.extras = RowExtras(self.n_rows, device, metrics)
        self.unit = torch.ones((), device=device)
        self.chunk = cpu_chunk_rows(chunk_classes, head.budget_bytes)
        self.buffer = torch.empty(min(self.n_rows, self.chunk) * head.vocab, device=device)
        softcap = head.spec.softcap is not None
        self.tanh_buffer = torch.empty_like(self.buffer) if softcap else None

    def logits(self, r0: int, r1: int) -> torch.Tensor:
        return self.operands.tile_logits(
            self.buffer, (r0, r1), (0, self.head.vocab), self.head.spec
        )

    def whole(self, z: torch.Tensor, r0: int, r1: int, rows: RowTargets) -> torch.Tensor:
        """The chunk's statistics and gradient over the whole vocabulary, the gradient written
        over its logits ``z``."""
        spec, vocab, w32 = self.head.spec, self.head.vocab, self.operands.class_weights
        chunk_columns = self.columns.slice(r0, r1)
        self.target_logit[r0:r1] = torch.where(
            chunk_columns.hit, z.gather(1, chunk_columns.index[:, None])[:, 0], 0.0
        )
        if self.wsum is not None:
            self.wsum[r0:r1] = z @ w32 if w32 is not None else z.sum(-1)
        self.extras.add(z, (r0, r1), 0)
        tanh_grad = _tanh_grad(z, spec, _tanh_out(self.tanh_buffer, z))
        # One exponential per logit for both the lse and the gradient: exp(z - top) / total.
        top = row_max(z)
        unnormalised = exp_(z.sub_(top[:, None]))
        total = unnormalised.sum(dim=-1)
        self.lse[r0:r1] = total.log().add_(top)
        grad_loss = self.unit.expand(r1 - r0) if spec.reduction == "none" else self.unit
        coefs = row_coefficients(grad_loss, None, self.lse[r0:r1], rows.slice(r0, r1), spec, vocab)
        grad = unnormalised.mul_((coefs.p / total)[:, None])
        return _finish_grad_(grad, tanh_grad, coefs, chunk_columns, w32, spec, None)

    def shard(
        self, z: torch.Tensor, r0: int, r1: int, rows: RowTargets, split: SplitVocabulary
    ) -> torch.Tensor:
        """The chunk's statistics over the shard, combined over the ranks (``split``), and its
        gradient with the whole vocabulary's lse, written over its logits ``z``."""
        spec, w32 = self.head.spec, self.operands.class_weights
        chunk_columns = self.columns.slice(r0, r1)
        whole = split.combine(_shard_stats(z, chunk_columns, w32, spec.needs_wsum))
        self.lse[r0:r1], self.target_logit[r0:r1] = whole.lse, whole.target_logit
        if self.wsum is not None:
            self.wsum[r0:r1] = whole.wsum
        if z.shape[1] == 0:  # an empty shard: no gradient, but the collective above
            return z
        grad_loss = self.unit.expand(r1 - r0) if spec.reduction == "none" else self.unit
        coefs = row_coefficients(grad_loss, None, whole.lse, rows.slice(r0, r1), spec, split.size)
        shift = _lse_shift(whole.lse, coefs)
        tanh_out = _tanh_out(self.tanh_buffer, z)
        return _grad_from_logits(z, shift, coefs, chunk_columns, w32, spec, None, tanh_out)

    def add(self, grad: torch.Tensor, r0: int, r1: int) -> None:
        operands = self.operands
        rows, cols = (r0, r1), (0, self.head.vocab)
        self.acc.add(grad, rows, cols, operands.hidden[r0:r1], operands.classifier)


def _shard_stats(
    z: torch.Tensor, columns: _ClassTargets, w32: torch.Tensor | None, smoothing: bool
) -> RowStats:
    """lse, target logit (exactly 0 where the target is another shard's) and, with smoothing,
    wsum of a chunk's logits ``z`` over a shard's classes, leaving ``z`` intact."""
    if z.shape[1] == 0:  # fewer classes than ranks
        zeros = z.new_zeros(z.shape[0])
        return RowStats(zeros - math.inf, zeros, zeros if smoothing else None)
    target_logit = torch.where(columns.hit, z.gather(1, columns.index[:, None])[:, 0], 0.0)
    wsum = None
    if smoothing:
        wsum = z @ w32 if w32 is not None else z.sum(-1)
    return RowStats(torch.logsumexp(z, dim=-1), target_logit, wsum)


def fast_forward(
    head: HeadInputs,
    rows: RowTargets,
    *,
    needs: Needs,
    extras: frozenset[str] = frozenset(),
    split: SplitVocabulary | None = None,
) -> ForwardOut:
    """Fast mode: loss, lse and the gradients for a unit upstream gradient from the same
    chunks of logits (three GEMMs), and each row's entropy and argmax where asked; with
    ``split``, over a shard of a split vocabulary (``interface.Implementation``)."""
    if not extras <= FAST_EXTRA_STATS or (split is not None and extras):
        raise ValueError(f"fast mode computes no {sorted(extras)} here (lean mode does)")
    run = _FastChunks(head, needs, extras, head.vocab if split is None else split.share)
    for r0, r1 in _ranges(run.n_rows, run.chunk):
        z = run.logits(r0, r1)
        if split is None:
            grad = run.whole(z, r0, r1, rows)
        else:
            grad = run.shard(z, r0, r1, rows, split)
        run.add(grad, r0, r1)
    vocab = head.vocab if split is None else split.size
    lse = run.lse
    out = ForwardOut(finish_loss(lse, run.target_logit, run.wsum, rows, head.spec, vocab), lse)
    # In the inputs' dtypes: the op hands them to autograd as they are (float32 accumulation
    # here; a bf16 classifier's gradient is rounded once). A shard's hidden gradient stays a
    # float32 partial sum.
    likes = (head.hidden if split is None else None, head.classifier, head.bias)
    out.grad_hidden, out.grad_classifier, out.grad_bias = (
        None if g is None else g if like is None else g.to(like.dtype)
        for g, like in zip(run.acc.result(), likes)
    )
    out.stats = run.extras.stats_into(RowStats(lse, run.target_logit, run.wsum))
    return out


def gradients(
    head: HeadInputs,
    lse: torch.Tensor,
    coefs: Coefficients,
    *,
    needs: Needs,
    keep_blocks: torch.Tensor | None = None,
) -> Gradients:
    """float32 gradients from per-row coefficients, recomputing the logits tile by tile
    (``keep_blocks``: gradient filtering's mask, filtering.py)."""
    operands, columns = Float32Operands.of(head), _ClassTargets.of(head)
    vocab, n_rows = head.vocab, operands.rows.count
    acc = _Accumulators(head, needs, operands.rows)
    shift = _lse_shift(lse, coefs)
    tiles = _Tiles.of(n_rows, vocab, head.budget_bytes)
    buffer = tiles.buffer(n_rows, head.hidden.device)
    tanh_buffer = torch.empty_like(buffer) if head.spec.softcap is not None else None
    for r0, r1 in _ranges(n_rows, tiles.rows):
        row_coefs = coefs.rows(r0, r1)
        row_columns = columns.slice(r0, r1)
        for c0, c1 in _ranges(vocab, tiles.cols):
            z = operands.tile_logits(buffer, (r0, r1), (c0, c1), head.spec)
            keep = None
            if keep_blocks is not None:
                b0, b1 = c0 // filtering.FILTER_BLOCK, -(-c1 // filtering.FILTER_BLOCK)
                keep = filtering.keep_columns(keep_blocks[r0:r1, b0:b1], c1 - c0)
            grad = _grad_from_logits(
                z,
                shift[r0:r1],
                row_coefs,
                row_columns.in_slab(c0, c1, vocab),
                _part(operands.class_weights, c0, c1),
                head.spec,
                keep,
                _tanh_out(tanh_buffer, z),
            )
            acc.add(grad, (r0, r1), (c0, c1), operands.hidden[r0:r1], operands.classifier[c0:c1])
    return acc.result()
