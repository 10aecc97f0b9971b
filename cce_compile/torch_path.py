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

from collections.abc import Iterator

import torch

from .interface import ForwardOut, Gradients, Needs
from .loss_math import (
    LossSpec,
    RowTargets,
    finish_loss,
    returned_lse,
    row_coefficients,
    row_targets,
)

# Temporaries of one chunk, in float32 values per logit: y, z, and the gradient.
_LOGIT_TEMPORARIES = 3


def chunk_rows(vocab: int, budget_bytes: int) -> int:
    """Rows per chunk so that one chunk's float32 temporaries fit in ``budget_bytes``."""
    return max(1, budget_bytes // (vocab * 4 * _LOGIT_TEMPORARIES))


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


def _grad_from_logits(
    z: torch.Tensor,
    lse: torch.Tensor,
    coefs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    rows: RowTargets,
    w32: torch.Tensor | None,
    spec: LossSpec,
) -> torch.Tensor:
    """d loss / d (h @ c.T + b) for one chunk from its logits ``z``, which it overwrites."""
    tanh_grad = None
    if spec.softcap is not None:
        tanh_grad = 1.0 - (z / spec.softcap).square()
    coef_p, coef_t, coef_w = coefs
    grad = z.sub_(lse[:, None]).exp_().mul_(coef_p[:, None])
    grad.scatter_add_(1, rows.safe[:, None], -coef_t[:, None])
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
    """float32 gradient accumulators for the parameters, and the hidden gradient."""

    def __init__(self, hidden, classifier, bias, needs: Needs):
        self.hidden = (
            torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
            if needs.hidden
            else None
        )
        self.classifier = (
            torch.zeros(classifier.shape, dtype=torch.float32, device=classifier.device)
            if needs.classifier
            else None
        )
        self.bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs.bias else None
        )

    def add(self, rows_io: _Rows, start, stop, grad, h32, c32) -> None:
        if self.hidden is not None:
            rows_io.write(self.hidden, start, stop, (grad @ c32).to(self.hidden.dtype))
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


def _prepare(hidden, classifier, targets, bias, class_weights, spec, compute_dtype):
    vocab = classifier.shape[0]
    rows = row_targets(targets, class_weights, spec, vocab)
    c32 = _float(classifier, compute_dtype)
    b32 = _float(bias, compute_dtype) if bias is not None else None
    w32 = class_weights.float() if class_weights is not None else None
    return vocab, rows, c32, b32, w32


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
    """Loss and per-row lse; with ``fast``, also the gradients for a unit upstream gradient."""
    vocab, rows, c32, b32, w32 = _prepare(
        hidden, classifier, targets, bias, class_weights, spec, compute_dtype
    )
    rows_io = _Rows(hidden, spec.shift)
    n_rows = rows.targets.numel()
    lse = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    target_logit = torch.empty_like(lse)
    wsum = torch.empty_like(lse) if spec.needs_wsum else None
    acc = _Accumulators(hidden, classifier, bias, needs) if fast and needs.any else None
    unit = torch.ones((), device=hidden.device)
    for start, stop in _chunks(n_rows, chunk_rows(vocab, budget_bytes)):
        h32 = _float(rows_io.read(start, stop), compute_dtype)
        z = _logits(h32, c32, b32, spec.logit_scale, spec.softcap)
        chunk_rows_ = rows.slice(start, stop)
        lse[start:stop] = torch.logsumexp(z, dim=-1)
        target_logit[start:stop] = z.gather(1, chunk_rows_.safe[:, None])[:, 0]
        if wsum is not None:
            wsum[start:stop] = z @ w32 if w32 is not None else z.sum(-1)
        if acc is not None:  # fast mode: the gradient from the same logits, three GEMMs
            grad_loss = unit.expand(stop - start) if spec.reduction == "none" else unit
            coefs = row_coefficients(grad_loss, None, lse[start:stop], chunk_rows_, spec, vocab)
            grad = _grad_from_logits(z, lse[start:stop], coefs, chunk_rows_, w32, spec)
            acc.add(rows_io, start, stop, grad, h32, c32)
        del z
    loss = finish_loss(lse, target_logit, wsum, rows, spec, vocab)
    out = ForwardOut(loss, returned_lse(lse, rows, lse_all_rows))
    if acc is not None:
        out.grad_hidden, out.grad_classifier, out.grad_bias = acc.hidden, acc.classifier, acc.bias
    return out


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
    """Gradients for hidden (its dtype) and float32 accumulators for classifier and bias."""
    vocab, rows, c32, b32, w32 = _prepare(
        hidden, classifier, targets, bias, class_weights, spec, compute_dtype
    )
    rows_io = _Rows(hidden, spec.shift)
    n_rows = rows.targets.numel()
    acc = _Accumulators(hidden, classifier, bias, needs)
    for start, stop in _chunks(n_rows, chunk_rows(vocab, budget_bytes)):
        chunk_rows_ = rows.slice(start, stop)
        chunk_grad_loss = grad_loss
        if grad_loss is not None and spec.reduction == "none":
            chunk_grad_loss = grad_loss[start:stop]
        chunk_grad_lse = grad_lse[start:stop] if grad_lse is not None else None
        coefs = row_coefficients(
            chunk_grad_loss,
            chunk_grad_lse,
            lse[start:stop],
            chunk_rows_,
            spec,
            vocab,
            lse_all_rows,
        )
        h32 = _float(rows_io.read(start, stop), compute_dtype)
        z = _logits(h32, c32, b32, spec.logit_scale, spec.softcap)
        grad = _grad_from_logits(z, lse[start:stop], coefs, chunk_rows_, w32, spec)
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
    vocab, rows, c32, b32, w32 = _prepare(
        hidden, classifier, targets, bias, class_weights, spec, compute_dtype
    )
    scale = spec.logit_scale if logit_scale is None else logit_scale
    cap = spec.softcap if softcap is None else softcap
    rows_io = _Rows(hidden, spec.shift)
    n_rows = rows.targets.numel()
    stats: list[list[torch.Tensor]] = [[], [], []]  # lse, target logit, wsum per chunk
    for start, stop in _chunks(n_rows, chunk_rows(vocab, budget_bytes)):
        z = _logits(_float(rows_io.read(start, stop), compute_dtype), c32, b32, scale, cap)
        stats[0].append(torch.logsumexp(z, dim=-1))
        stats[1].append(z.gather(1, rows.safe[start:stop, None])[:, 0])
        if spec.needs_wsum:
            stats[2].append(z @ w32 if w32 is not None else z.sum(-1))
    empty = hidden.new_zeros(0, dtype=torch.float32)
    lse, target_logit, wsum = (torch.cat(s) if s else empty for s in stats)
    loss = finish_loss(lse, target_logit, wsum if spec.needs_wsum else None, rows, spec, vocab)
    return loss, returned_lse(lse, rows, lse_all_rows)
