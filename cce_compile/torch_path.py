"""The PyTorch implementation: the CPU path (any device), and the fast companion of the oracle.

Rows are processed in chunks so that at most one chunk of float32 logits exists at a time
(never N x V). Everything is accumulated in float32 and matches float32 math to rounding.

Shapes follow the op's canonical form (``interface``): row ``r`` of the loss is
``hidden[b, t]`` predicting ``targets[b, t + shift]`` with ``(b, t) = divmod(r, T - shift)``,
so a shift never copies ``hidden``.

``differentiable_loss`` is the same math left to PyTorch's autograd, for what the op's own
formula does not cover (forward-mode AD, functorch transforms, a differentiable logit_scale).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

from . import filtering
from .interface import Coefficients, ForwardOut, Gradients, Needs, RowStats
from .loss_math import (
    LossSpec,
    RowTargets,
    finish_loss,
    returned_lse,
    row_coefficients,
    row_targets,
)
from .policy import cpu_chunk_rows


class _Rows:
    """Reads and writes rows of a (B, T, D) tensor by flat row index, without copying it."""

    def __init__(self, hidden: torch.Tensor, shift: int):
        self.hidden = hidden
        self.per_batch = hidden.shape[1] - shift
        self.flat = None
        if shift == 0 or hidden.shape[0] == 1:
            view = hidden[:, : self.per_batch]
            try:
                self.flat = view.view(-1, hidden.shape[-1])
            except RuntimeError:
                self.flat = None

    def index(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = torch.arange(start, stop, device=self.hidden.device)
        return r // self.per_batch, r % self.per_batch

    def read(self, start: int, stop: int) -> torch.Tensor:
        if self.flat is not None:
            return self.flat[start:stop]
        return self.hidden[self.index(start, stop)]

    def write(self, out: torch.Tensor, start: int, stop: int, value: torch.Tensor) -> None:
        if self.flat is not None and out.is_contiguous():
            out.view(-1, out.shape[-1])[start:stop] = value
        else:
            out[self.index(start, stop)] = value


def _chunks(n_rows: int, chunk: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n_rows, chunk):
        yield start, min(start + chunk, n_rows)


def _logits(h32, c32, b32, logit_scale, softcap) -> torch.Tensor:
    """z = softcap(logit_scale * (h @ c.T + b)), float32; scale and cap are numbers, or 0-d
    tensors (the differentiable path)."""
    z = h32 @ c32.T
    if b32 is not None:
        z += b32
    if isinstance(logit_scale, torch.Tensor):
        z = z * logit_scale  # out of place: its gradient needs z
    elif logit_scale != 1.0:
        z *= logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


@dataclasses.dataclass
class _ClassTargets:
    """Each row's target as a column of the given classes [col_start, col_start + V)."""

    index: torch.Tensor  # (N,) int64 column, clamped into [0, V): usable as an index
    hit: torch.Tensor  # (N,) bool: the target is one of the given classes

    @staticmethod
    def of(targets: torch.Tensor, spec: LossSpec, col_start: int, vocab: int) -> _ClassTargets:
        columns = targets[:, spec.shift :].reshape(-1).long() - col_start
        hit = (columns >= 0) & (columns < vocab)
        return _ClassTargets(torch.where(hit, columns, 0), hit)

    def slice(self, start: int, stop: int) -> _ClassTargets:
        return _ClassTargets(self.index[start:stop], self.hit[start:stop])


def _grad_from_logits(
    z: torch.Tensor,
    lse: torch.Tensor,
    coefs: Coefficients,
    columns: _ClassTargets,
    w32: torch.Tensor | None,
    spec: LossSpec,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """d loss / d (h @ c.T + b) for one chunk from its logits ``z``, which it overwrites;
    ``keep`` (n, blocks): gradient filtering drops the softmax term elsewhere."""
    tanh_grad = None
    if spec.softcap is not None:
        tanh_grad = 1.0 - (z / spec.softcap).square()
    coef_p, coef_t, coef_w = coefs
    grad = z.sub_(lse[:, None]).exp_().mul_(coef_p[:, None])
    if keep is not None:
        grad.mul_(filtering.keep_columns(keep, grad.shape[1]))
    grad.scatter_add_(1, columns.index[:, None], torch.where(columns.hit, -coef_t, 0.0)[:, None])
    if spec.label_smoothing:
        grad.sub_(coef_w[:, None] * (w32 if w32 is not None else 1.0))
    if tanh_grad is not None:
        grad.mul_(tanh_grad)
    if spec.logit_scale != 1.0:
        grad.mul_(spec.logit_scale)
    # A row with no upstream gradient (ignored) contributes exactly 0, even where its saved lse
    # is a placeholder and exp(z - lse) overflowed.
    active = (coef_p != 0) | (coef_t != 0) | (coef_w != 0)
    return torch.where(active[:, None], grad, 0.0)


class _Accumulators:
    """float32 accumulators of the gradients (hidden's is written row by row)."""

    def __init__(self, hidden, classifier, bias, needs: Needs):
        def zeros(like, wanted):
            return (
                torch.zeros(like.shape, dtype=torch.float32, device=like.device) if wanted else None
            )

        self.hidden = zeros(hidden, needs.hidden)
        self.classifier = zeros(classifier, needs.classifier)
        self.bias = zeros(bias, needs.bias)

    def add(self, rows_io: _Rows, start, stop, grad, h32, c32) -> None:
        if self.hidden is not None:
            rows_io.write(self.hidden, start, stop, grad @ c32)
        if self.classifier is not None:
            self.classifier.addmm_(grad.T, h32)
        if self.bias is not None:
            self.bias += grad.sum(0)


def scale_to(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(x * scale).to(dtype) with one rounding."""
    return torch.mul(x, scale.float()).to(dtype)


def _float(t: torch.Tensor, compute_dtype: torch.dtype | None) -> torch.Tensor:
    """t as float32 after rounding to the head's compute dtype (autocast's rounding)."""
    return (t if compute_dtype is None else t.to(compute_dtype)).float()


def _operands(classifier, bias, class_weights, compute_dtype):
    """The classifier, bias and class weights in float32 (the first two rounded first)."""
    c32 = _float(classifier, compute_dtype)
    b32 = _float(bias, compute_dtype) if bias is not None else None
    w32 = class_weights.float() if class_weights is not None else None
    return c32, b32, w32


def logit_stats(
    hidden: torch.Tensor,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    spec: LossSpec,
    *,
    col_start: int,
    all_rows: bool,
    budget_bytes: int,
    compute_dtype: torch.dtype | None = None,
    block_lse: bool = False,
    mean_z: bool = False,
    argmax: bool = False,
) -> RowStats:
    """Per-row lse, target logit and weighted sum over the given classes (every row), and
    with ``block_lse`` the lse of each block of classes (filtering.py), with ``mean_z`` /
    ``argmax`` each row's mean logit under its softmax / first largest logit's class."""
    vocab = classifier.shape[0]
    c32, b32, w32 = _operands(classifier, bias, class_weights, compute_dtype)
    columns = _ClassTargets.of(targets, spec, col_start, vocab)
    rows_io = _Rows(hidden, spec.shift)
    n_rows = columns.index.numel()
    lse = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    target_logit = torch.empty_like(lse)
    wsum = torch.empty_like(lse) if spec.needs_wsum else None
    blocks = None
    if block_lse:
        blocks = torch.empty((filtering.block_count(vocab), n_rows), device=hidden.device)
    extras = _Extras.empty(lse, mean_z, argmax)
    for start, stop in _chunks(n_rows, cpu_chunk_rows(vocab, budget_bytes)):
        z = _logits(
            _float(rows_io.read(start, stop), compute_dtype),
            c32,
            b32,
            spec.logit_scale,
            spec.softcap,
        )
        _write_stats(z, columns.slice(start, stop), w32, (lse, target_logit, wsum), start, stop)
        extras.write(z, lse, start, stop)
        if blocks is not None:
            blocks[:, start:stop] = filtering.block_lse_of_logits(z).t()
    stats = RowStats(lse, target_logit, wsum, blocks)
    stats.mean_z, stats.argmax = extras.mean_z, extras.argmax
    return stats


@dataclasses.dataclass
class _Extras:
    """Each row's mean logit under its softmax and first largest logit's class, when asked
    (the op's entropy and argmax outputs)."""

    mean_z: torch.Tensor | None
    argmax: torch.Tensor | None

    @staticmethod
    def empty(like: torch.Tensor, mean_z: bool, argmax: bool) -> _Extras:
        return _Extras(
            torch.empty_like(like) if mean_z else None,
            torch.empty_like(like, dtype=torch.int64) if argmax else None,
        )

    def write(self, z: torch.Tensor, lse: torch.Tensor, start: int, stop: int) -> None:
        """From one chunk's logits (before they are overwritten) and its rows' lse."""
        if self.mean_z is not None:
            p = torch.exp(z - lse[start:stop, None])
            self.mean_z[start:stop] = (p * z).sum(-1)
        if self.argmax is not None:
            self.argmax[start:stop] = z.argmax(-1)


def _write_stats(z, columns: _ClassTargets, w32, stats, start: int, stop: int) -> None:
    """One chunk's lse, target logit (0 where the target is not a given class) and wsum."""
    lse, target_logit, wsum = stats
    lse[start:stop] = torch.logsumexp(z, dim=-1)
    picked = z.gather(1, columns.index[:, None])[:, 0]
    target_logit[start:stop] = torch.where(columns.hit, picked, 0.0)
    if wsum is not None:
        wsum[start:stop] = z @ w32 if w32 is not None else z.sum(-1)


def fast_forward(
    hidden: torch.Tensor,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    spec: LossSpec,
    rows: RowTargets,
    *,
    needs: Needs,
    budget_bytes: int,
    compute_dtype: torch.dtype | None = None,
    entropy: bool = False,
    argmax: bool = False,
) -> ForwardOut:
    """Fast mode: loss, lse and the gradients for a unit upstream gradient from the same
    chunks of logits (three GEMMs), and each row's entropy and argmax where asked."""
    vocab = classifier.shape[0]
    c32, b32, w32 = _operands(classifier, bias, class_weights, compute_dtype)
    columns = _ClassTargets.of(targets, spec, 0, vocab)
    rows_io = _Rows(hidden, spec.shift)
    n_rows = rows.targets.numel()
    lse = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    stats = (lse, torch.empty_like(lse), torch.empty_like(lse) if spec.needs_wsum else None)
    acc = _Accumulators(hidden, classifier, bias, needs)
    extras = _Extras.empty(lse, entropy, argmax)
    unit = torch.ones((), device=hidden.device)
    for start, stop in _chunks(n_rows, cpu_chunk_rows(vocab, budget_bytes)):
        h32 = _float(rows_io.read(start, stop), compute_dtype)
        z = _logits(h32, c32, b32, spec.logit_scale, spec.softcap)
        _write_stats(z, columns.slice(start, stop), w32, stats, start, stop)
        extras.write(z, lse, start, stop)
        grad_loss = unit.expand(stop - start) if spec.reduction == "none" else unit
        chunk_rows_ = rows.slice(start, stop)
        coefs = row_coefficients(grad_loss, None, lse[start:stop], chunk_rows_, spec, vocab)
        grad = _grad_from_logits(z, lse[start:stop], coefs, columns.slice(start, stop), w32, spec)
        acc.add(rows_io, start, stop, grad, h32, c32)
    out = ForwardOut(finish_loss(*stats, rows, spec, vocab), lse)
    out.grad_hidden, out.grad_classifier, out.grad_bias = acc.hidden, acc.classifier, acc.bias
    out.entropy = None if extras.mean_z is None else lse - extras.mean_z
    out.argmax = extras.argmax
    return out


def gradients(
    hidden: torch.Tensor,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    lse: torch.Tensor,
    coefs: Coefficients,
    spec: LossSpec,
    *,
    col_start: int,
    needs: Needs,
    budget_bytes: int,
    compute_dtype: torch.dtype | None = None,
    keep_blocks: torch.Tensor | None = None,
) -> Gradients:
    """float32 gradients from per-row coefficients, recomputing the logits chunk by chunk
    (``keep_blocks``: gradient filtering's mask, filtering.py)."""
    vocab = classifier.shape[0]
    c32, b32, w32 = _operands(classifier, bias, class_weights, compute_dtype)
    columns = _ClassTargets.of(targets, spec, col_start, vocab)
    rows_io = _Rows(hidden, spec.shift)
    acc = _Accumulators(hidden, classifier, bias, needs)
    for start, stop in _chunks(columns.index.numel(), cpu_chunk_rows(vocab, budget_bytes)):
        h32 = _float(rows_io.read(start, stop), compute_dtype)
        z = _logits(h32, c32, b32, spec.logit_scale, spec.softcap)
        chunk_coefs = tuple(c[start:stop] for c in coefs)
        keep = None if keep_blocks is None else keep_blocks[start:stop]
        grad = _grad_from_logits(
            z, lse[start:stop], chunk_coefs, columns.slice(start, stop), w32, spec, keep
        )
        acc.add(rows_io, start, stop, grad, h32, c32)
    return acc.hidden, acc.classifier, acc.bias


def differentiable_loss(
    hidden: torch.Tensor,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    spec: LossSpec,
    *,
    lse_all_rows: bool,
    budget_bytes: int,
    compute_dtype: torch.dtype | None = None,
    logit_scale: torch.Tensor | None = None,
    softcap: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) by PyTorch's own autograd over the same chunked math, any AD mode.

    ``logit_scale`` / ``softcap`` given as 0-d tensors replace the spec's numbers and are
    differentiated. Nothing is written in place into a shared buffer (functorch transforms
    forbid it). Reverse mode keeps every chunk's float32 logits for the backward, as eager
    PyTorch keeps its logits; forward mode keeps none.
    """
    vocab = classifier.shape[0]
    rows = row_targets(targets, class_weights, spec, vocab)
    c32, b32, w32 = _operands(classifier, bias, class_weights, compute_dtype)
    scale = spec.logit_scale if logit_scale is None else logit_scale
    cap = spec.softcap if softcap is None else softcap
    rows_io = _Rows(hidden, spec.shift)
    n_rows = rows.targets.numel()
    stats: list[list[torch.Tensor]] = [[], [], []]  # lse, target logit, wsum per chunk
    for start, stop in _chunks(n_rows, cpu_chunk_rows(vocab, budget_bytes)):
        z = _logits(_float(rows_io.read(start, stop), compute_dtype), c32, b32, scale, cap)
        stats[0].append(torch.logsumexp(z, dim=-1))
        stats[1].append(z.gather(1, rows.safe[start:stop, None])[:, 0])
        if spec.needs_wsum:
            stats[2].append(z @ w32 if w32 is not None else z.sum(-1))
    empty = hidden.new_zeros(0, dtype=torch.float32)
    lse, target_logit, wsum = (torch.cat(s) if s else empty for s in stats)
    loss = finish_loss(lse, target_logit, wsum if spec.needs_wsum else None, rows, spec, vocab)
    return loss, returned_lse(lse, rows, lse_all_rows)
