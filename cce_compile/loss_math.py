"""The loss in closed form, from three per-row statistics of the logits.

Both implementations (the chunked PyTorch path and the Triton path) reduce the N x V logits to
per-row statistics and share everything after that here, so PyTorch's conventions are written
once. With ``z = softcap(logit_scale * (hidden @ classifier.T + bias))`` and ``w`` the class
weights (all ones when absent), each row ``i`` with target ``t`` needs:

* ``lse_i    = logsumexp_j z_ij``
* ``target_i = z_it``                       (the target logit)
* ``wsum_i   = sum_j w_j z_ij``             (only with label smoothing)

PyTorch's cross_entropy is then, per non-ignored row (eps = label_smoothing, V classes)::

    ce_i = (1 - eps) * w_t * (lse_i - target_i) + eps / V * (W * lse_i - wsum_i),  W = sum_j w_j

reduced by 'sum', by 'none' (0 at ignored rows) or by 'mean' = sum_i ce_i / sum_i w_t (nan when
every row is ignored, as in PyTorch). The z-loss adds ``z_loss * lse_i**2`` per non-ignored row,
reduced the same way except that 'mean' divides it by the number of non-ignored rows (an
unweighted mean, as PaLM and OLMo define it).

The gradient with respect to z is, with p = softmax(z) and upstream factors ``a`` (for ce),
``b`` (for the z-loss), ``g`` (the gradient of the returned lse, if any) and ``h`` (that of
the returned entropy H_i = -sum_j p_ij log p_ij, if any)::

    dz_ij = (coef_p_i + coef_e_i * log p_ij) * p_ij - coef_t_i * [j == t] - coef_w_i * w_j
    coef_p_i = a_i * ((1 - eps) * w_t + eps / V * W) + 2 * z_loss * b_i * lse_i + g_i - h_i * H_i
    coef_t_i = a_i * (1 - eps) * w_t,     coef_w_i = a_i * eps / V,     coef_e_i = -h_i

(dH_i / dz_ij = -p_ij (log p_ij + H_i); log p_ij = z_ij - lse_i is what the kernels already
subtract before the exponential, so the entropy's term costs one multiply-add per logit.)

A class of logit -inf (a masked class: a -inf bias) has p = 0 and adds 0 log 0 = 0 to H and 0
to dz, on every path, as ``torch.distributions.Categorical``'s entropy (its clamp of log p at
the least float), not eager's NaN of ``-(p * log_softmax(z)).sum(-1)``: log p is clamped at
``LOG_P_FLOOR`` wherever it multiplies p.
"""

from __future__ import annotations

import dataclasses
import math

import torch

REDUCTIONS = ("none", "mean", "sum")

# log p below which p = exp(log p) is 0 in every float dtype (float64's last is exp(-745)):
# clamping there changes no p, and keeps coef_e * log p finite where log p = -inf.
LOG_P_FLOOR = -1.0e4


def _finite(value: float) -> bool:
    # Not math.isfinite: Dynamo cannot trace it; NaN fails both comparisons.
    return -math.inf < value < math.inf


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """The static options of one loss: everything but the tensors.

    The field list is also the options part of the op's argument list (``op.signature``), so
    a new option is declared here once. Values are checked on construction: the op receives
    them at run time (a compiled graph may pass symbolic ones), so an impossible value is a
    clear error there, never a different loss.
    """

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    softcap: float | None = None  # None: no softcap; c * tanh(z / c) for any finite c != 0
    logit_scale: float = 1.0
    shift: int = 0
    z_loss: float = 0.0

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        if self.softcap is not None and not (_finite(self.softcap) and self.softcap != 0.0):
            raise ValueError(
                f"softcap must be a finite non-zero number or None, got {self.softcap}"
            )
        if not _finite(self.logit_scale):
            raise ValueError(f"logit_scale must be finite, got {self.logit_scale}")
        if not (_finite(self.z_loss) and self.z_loss >= 0.0):
            raise ValueError(f"z_loss must be a finite number >= 0, got {self.z_loss}")
        if self.shift < 0:
            raise ValueError(f"shift must be >= 0, got {self.shift}")

    @property
    def needs_wsum(self) -> bool:
        return self.label_smoothing > 0.0


@dataclasses.dataclass
class RowTargets:
    """Targets of the loss's rows (flattened to N = B * (T - shift)) and what follows from them.

    The row tensors are 1-D; the totals are 0-d tensors over all rows, so a slice of rows keeps
    the normalisers of the whole batch.
    """

    targets: torch.Tensor  # (N,) int, as given
    valid: torch.Tensor  # bool: not ignore_index
    safe: torch.Tensor  # int64 targets clamped into [0, V): usable as an index
    out_of_range: torch.Tensor  # bool: valid but outside [0, V)
    weight: torch.Tensor  # float32 w_t, 0 at ignored rows
    weight_total: torch.Tensor  # float32 W = sum_j w_j (V without class weights)
    weight_sum: torch.Tensor  # float32 sum of w_t over rows: the 'mean' divisor
    count: torch.Tensor  # float32 number of non-ignored rows: the z-loss 'mean' divisor

    def slice(self, start: int, stop: int) -> RowTargets:
        return dataclasses.replace(
            self,
            targets=self.targets[start:stop],
            valid=self.valid[start:stop],
            safe=self.safe[start:stop],
            out_of_range=self.out_of_range[start:stop],
            weight=self.weight[start:stop],
        )


# Each integer dtype's range, looked up rather than asked of torch.iinfo on each call (the
# op takes int64 and int32 targets; the graph pass may hand it others).
_INT_NAMES = ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
_INT_RANGES = {
    dtype: (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    for dtype in (getattr(torch, name, None) for name in _INT_NAMES)
    if dtype is not None
}


def can_be_ignored(ignore_index: int, dtype: torch.dtype) -> bool:
    """Can a target of ``dtype`` equal ``ignore_index``? PyTorch compares them as int64; a
    tensor compared with a Python int casts the int to the tensor's dtype instead, wrapping
    (int32 5 == 2**32 + 5), so an ignore_index outside the dtype's range must ignore no row.
    The kernels' launchers ask this too, to skip no tile then."""
    low, high = _INT_RANGES[dtype]
    return low <= ignore_index <= high


def valid_rows(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """bool, per target: not ``ignore_index``, as PyTorch decides it for any target dtype. The
    one place the op tells ignored rows (loss, gradients, compaction); no int64 copy."""
    if not can_be_ignored(ignore_index, targets.dtype):
        return torch.ones_like(targets, dtype=torch.bool)
    return targets != ignore_index


def row_targets(
    targets: torch.Tensor, class_weights: torch.Tensor | None, spec: LossSpec, vocab: int
) -> RowTargets:
    """Align ``targets`` (B, T) with the rows (B, T - shift), flatten, and look up weights."""
    rows = targets[:, spec.shift :].reshape(-1)
    valid = valid_rows(rows, spec.ignore_index)
    in_range = (rows >= 0) & (rows < vocab)
    safe = torch.where(in_range, rows, 0).long()
    if class_weights is None:
        weight = valid.float()
        weight_total = torch.full((), float(vocab), device=targets.device)
    else:
        cw = class_weights.float()
        weight = torch.where(valid, cw[safe], 0.0)
        weight_total = cw.sum()
    return RowTargets(
        targets=rows,
        valid=valid,
        safe=safe,
        out_of_range=valid & ~in_range,
        weight=weight,
        weight_total=weight_total,
        weight_sum=weight.sum(),
        count=valid.sum().float(),
    )


def returned_lse(lse: torch.Tensor, rows: RowTargets, lse_all_rows: bool) -> torch.Tensor:
    """The lse the op returns: every row's with ``lse_all_rows``, else 0 at ignored rows."""
    return lse if lse_all_rows else torch.where(rows.valid, lse, 0.0)


def finish_loss(
    lse: torch.Tensor,
    target_logit: torch.Tensor,
    wsum: torch.Tensor | None,
    rows: RowTargets,
    spec: LossSpec,
    vocab: int,
) -> torch.Tensor:
    """The loss from per-row statistics (float32, (N,)): a scalar, or (N,) for 'none'."""
    eps = spec.label_smoothing
    nll = lse - target_logit
    per_row = (1.0 - eps) * rows.weight * nll
    smooth = None
    if eps > 0.0:
        assert wsum is not None
        smooth = (eps / vocab) * (rows.weight_total * lse - wsum)
    # where(), not a product: a non-finite logit on an ignored row must not leak into the loss.
    per_row = torch.where(rows.valid, per_row, 0.0)
    if smooth is not None:
        smooth = torch.where(rows.valid, smooth, 0.0)
    z_term = torch.where(rows.valid, spec.z_loss * lse * lse, 0.0) if spec.z_loss else None
    # Out-of-range targets (GPU, unchecked) must never give a plausible number.
    per_row = torch.where(rows.out_of_range, float("nan"), per_row)
    if spec.reduction == "none":
        out = per_row if smooth is None else per_row + smooth
        return out if z_term is None else out + z_term
    if spec.reduction == "sum":
        total = per_row.sum()
        for term in (smooth, z_term):
            total = total if term is None else total + term.sum()
        return total
    # Each term over the weight sum, as PyTorch divides them: with weights 0 at every target,
    # 0/0 + x/0 = NaN, where the summed terms' x/0 would be a plausible inf.
    loss = per_row.sum() / rows.weight_sum
    if smooth is not None:
        loss = loss + smooth.sum() / rows.weight_sum
    if z_term is not None:
        loss = loss + z_term.sum() / rows.count
    return loss


@dataclasses.dataclass
class CoefficientParts:
    """The per-row coefficients before the lse is known: coef_p = p_base + p_per_lse * lse."""

    p_base: torch.Tensor
    p_per_lse: torch.Tensor | None
    coef_t: torch.Tensor
    coef_w: torch.Tensor


def row_coefficient_parts(
    grad_loss: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    rows: RowTargets,
    spec: LossSpec,
    vocab: int,
) -> CoefficientParts:
    """The coefficients of dz for the rows of ``rows`` (see the module docstring).

    ``grad_loss`` is the upstream gradient of the loss (a scalar for 'mean'/'sum', one per row
    for 'none'), ``grad_lse`` that of the returned lse; either may be None (no gradient).
    """
    eps = spec.label_smoothing
    zeros = torch.zeros_like(rows.weight)
    if grad_loss is None:
        ce_factor = z_factor = zeros
    else:
        g = grad_loss.float()
        if spec.reduction == "mean":
            ce_factor = (g / rows.weight_sum).expand_as(zeros)
            z_factor = (g / rows.count).expand_as(zeros)
        else:
            ce_factor = z_factor = g.expand_as(zeros)
        ce_factor = torch.where(rows.valid, ce_factor, 0.0)
        z_factor = torch.where(rows.valid, z_factor, 0.0)
    coef_t = ce_factor * (1.0 - eps) * rows.weight
    coef_w = ce_factor * (eps / vocab)
    p_base = coef_t + coef_w * rows.weight_total
    if grad_lse is not None:
        p_base = p_base + grad_lse.float()
    # Out-of-range targets (GPU, unchecked) poison their row's gradient, as their loss.
    p_base = torch.where(rows.out_of_range, float("nan"), p_base)
    p_per_lse = 2.0 * spec.z_loss * z_factor if spec.z_loss else None
    return CoefficientParts(p_base, p_per_lse, coef_t, coef_w)


@dataclasses.dataclass
class RowCoefficients:
    """Per-row coefficients of dz = (p + e * log p) * softmax - t * onehot - w * class weight
    (the module docstring), each (N,) float32; ``e`` is None without an entropy gradient."""

    p: torch.Tensor
    t: torch.Tensor
    w: torch.Tensor
    e: torch.Tensor | None = None

    def rows(self, start: int, stop: int) -> RowCoefficients:
        return self.mapped(lambda c: c[start:stop])

    def mapped(self, fn) -> RowCoefficients:
        """Each coefficient vector through ``fn`` (a slice, or rows to positions)."""
        vectors = (self.p, self.t, self.w, self.e)
        return RowCoefficients(*(None if c is None else fn(c) for c in vectors))

    def active(self) -> torch.Tensor:
        """bool (N,): rows whose gradient is not zero (NaN coefficients count as active)."""
        active = (self.p != 0) | (self.t != 0) | (self.w != 0)
        return active if self.e is None else active | (self.e != 0)


@dataclasses.dataclass
class EntropyGradient:
    """The returned entropy's upstream gradient and the entropy itself, (N,) each;
    ``all_rows``: it was returned at ignored rows too (else as 0 there, carrying nothing)."""

    grad: torch.Tensor
    entropy: torch.Tensor
    all_rows: bool = False


def row_coefficients(
    grad_loss: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    lse: torch.Tensor,
    rows: RowTargets,
    spec: LossSpec,
    vocab: int,
    lse_all_rows: bool = True,
    entropy: EntropyGradient | None = None,
) -> RowCoefficients:
    """Per-row coefficients of dz (the module docstring).

    Without ``lse_all_rows`` an ignored row's lse was returned as the constant 0, so its
    gradient carries nothing back; so was its entropy, unless ``entropy.all_rows``.
    """
    if grad_lse is not None and not lse_all_rows:
        grad_lse = torch.where(rows.valid, grad_lse, 0.0)
    parts = row_coefficient_parts(grad_loss, grad_lse, rows, spec, vocab)
    coef_p = parts.p_base if parts.p_per_lse is None else parts.p_base + parts.p_per_lse * lse
    coef_e = None
    if entropy is not None:
        coef_e = -entropy.grad.float()
        entropy_term = coef_e * entropy.entropy.float()
        if not entropy.all_rows:
            # where(): an ignored row's entropy is a placeholder 0 with no gradient to carry.
            coef_e = torch.where(rows.valid, coef_e, 0.0)
            entropy_term = torch.where(rows.valid, entropy_term, 0.0)
        coef_p = coef_p + entropy_term
    return RowCoefficients(coef_p, parts.coef_t, parts.coef_w, coef_e)


def check_targets_in_range(rows: RowTargets, vocab: int) -> None:
    """Raise like PyTorch on a target outside [0, V) (host sync: CPU or debug mode only)."""
    if bool(rows.out_of_range.any()):
        bad = rows.targets[rows.out_of_range][0].item()
        raise IndexError(f"Target {bad} is out of bounds for {vocab} classes (targets).")
