"""The float64 oracle: materialise the logits and let PyTorch's own cross_entropy define the loss.

Everything the op promises is spelled out here in plain PyTorch, so a test compares the op with
PyTorch's conventions rather than with a second copy of our formulas.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

# Relative error ||actual - expected|| / ||expected|| allowed per dtype of the inputs. The loss
# and lse are accumulated in float32 whatever the input dtype (float32 rounding of a sum of
# exact products); gradients are rounded once to the input dtype at the end, so their tolerance
# is that dtype's rounding (2^-8 bf16, 2^-11 fp16) with headroom for the norm.
LOSS_RTOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}
GRAD_RTOL = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1.5e-3}
# Fast mode on the GPU takes the logits from cuBLAS in the inputs' dtype, as eager PyTorch
# does, so its loss and lse are those of logits rounded once to that dtype: relative to the
# size of the loss's terms (``loss_scale``), half a unit in the last place of the dtype.
LOSS_RTOL_ROUNDED_LOGITS = {torch.float32: 2e-5, torch.bfloat16: 4e-3, torch.float16: 5e-4}
# Elementwise floor for values near zero (absolute), relative to the loss's own scale.
ABS_FLOOR = 1e-6
# A compiled graph with the op against the same function run eagerly (``harness.check``): each
# is within its tolerance of the float64 truth (eager's loss is that of logits rounded to the
# head's dtype), so they are within the sum of the two of each other.
COMPILED_VS_EAGER_RTOL = {
    dtype: LOSS_RTOL_ROUNDED_LOGITS[dtype] + max(LOSS_RTOL[dtype], GRAD_RTOL[dtype]) * 2
    for dtype in GRAD_RTOL
}


@dataclasses.dataclass
class Case:
    """One call of linear_cross_entropy: tensors and options."""

    hidden: torch.Tensor
    classifier: torch.Tensor
    targets: torch.Tensor
    bias: torch.Tensor | None = None
    class_weights: torch.Tensor | None = None
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    softcap: float | None = None
    logit_scale: float = 1.0
    shift: int = 0
    z_loss: float = 0.0

    def options(self) -> dict:
        return dict(
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            class_weights=self.class_weights,
            softcap=self.softcap,
            logit_scale=self.logit_scale,
            shift=self.shift,
            z_loss=self.z_loss,
        )

    def leaves(self) -> list[torch.Tensor]:
        return [t for t in (self.hidden, self.classifier, self.bias) if t is not None]


def oracle_logits(hidden, classifier, bias, softcap, logit_scale):
    logits = F.linear(hidden.double(), classifier.double(), None if bias is None else bias.double())
    logits = logits * logit_scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def _loss_rows(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden and targets of the loss rows: position t predicts target t + shift."""
    if not case.shift:
        return case.hidden, case.targets
    time = case.hidden.shape[-2]
    return case.hidden[..., : time - case.shift, :], case.targets[..., case.shift :]


def oracle(case: Case, return_lse: bool = False):
    """Loss (and lse) in float64 from the case's tensors, differentiable w.r.t. them."""
    hidden, targets = _loss_rows(case)
    logits = oracle_logits(hidden, case.classifier, case.bias, case.softcap, case.logit_scale)
    vocab = case.classifier.shape[0]
    flat = logits.reshape(-1, vocab)
    flat_targets = targets.reshape(-1).long()
    weight = None if case.class_weights is None else case.class_weights.double()
    loss = F.cross_entropy(
        flat,
        flat_targets,
        weight=weight,
        ignore_index=case.ignore_index,
        reduction=case.reduction,
        label_smoothing=case.label_smoothing,
    )
    lse = torch.logsumexp(flat, dim=-1)
    if case.z_loss:
        valid = flat_targets != case.ignore_index
        z_term = torch.where(valid, case.z_loss * lse.square(), 0.0)
        if case.reduction == "none":
            loss = loss + z_term
        elif case.reduction == "sum":
            loss = loss + z_term.sum()
        else:
            loss = loss + z_term.sum() / valid.sum()
    if case.reduction == "none":
        loss = loss.reshape(targets.shape)
    if return_lse:
        return loss, lse.reshape(targets.shape)
    return loss


def rel_error(actual: torch.Tensor, expected: torch.Tensor, scale: float = 0.0) -> float:
    """||a - e|| / max(||e||, scale, tiny), NaN-aware: matching NaNs count as equal.

    ``scale`` is the size of the terms that cancel in ``e`` (see ``gradient_scale``): where the
    exact value is far smaller than its parts, float32 rounding of the parts sets the error.
    """
    a, e = actual.double(), expected.double()
    a_nan, e_nan = torch.isnan(a), torch.isnan(e)
    if not torch.equal(a_nan, e_nan):
        return float("inf")
    a, e = a[~a_nan], e[~e_nan]
    if not torch.equal(torch.isinf(a), torch.isinf(e)) or not torch.equal(
        a[a.isinf()], e[e.isinf()]
    ):
        return float("inf")
    a, e = a[~a.isinf()], e[~e.isinf()]
    if e.numel() == 0:
        return 0.0
    denom = max(e.norm().item(), scale, ABS_FLOOR * e.numel() ** 0.5)
    return (a - e).norm().item() / denom


def gradient_scale(case: Case, upstream_loss: torch.Tensor, upstream_lse, leaves) -> list[float]:
    """Per leaf, the norm of the gradient of sum_i (|a_i| + |g_i|) (lse_i + z_it), no softcap.

    The exact gradient is (softmax - onehot) * upstream: its terms cancel when the model is
    confident (or V = 1), a saturated softcap multiplies them by 1 - tanh^2 (which float32
    only gets to an absolute error), and the GPU path rounds d loss / d logits to the inputs'
    dtype before the GEMMs, as eager PyTorch does. Each of these errors is relative to the
    *sum* of the terms' sizes, softmax plus onehot, which is this. ``a_i`` is the upstream
    gradient of row i's loss (divided by the row count for 'mean'), ``g_i`` that of its lse.
    """
    hidden, targets = _loss_rows(case)
    logits = oracle_logits(hidden, case.classifier, case.bias, None, case.logit_scale)
    lse = torch.logsumexp(logits, dim=-1)
    factor = upstream_loss.abs().expand_as(lse)
    if case.reduction == "mean":  # (int64: an int32 tensor compared with a huge int wraps)
        factor = factor / max(int((targets.long() != case.ignore_index).sum()), 1)
    if upstream_lse is not None:
        factor = factor + upstream_lse.abs()
    vocab = case.classifier.shape[0]
    in_range = (targets >= 0) & (targets < vocab)
    target_logit = torch.where(
        in_range, logits.gather(-1, targets.clamp(0, vocab - 1).long()[..., None])[..., 0], 0.0
    )
    total = (factor * (lse + target_logit.reshape(lse.shape))).sum()
    grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return [0.0 if g is None else g.norm().item() for g in grads]


def loss_scale(case: Case) -> float:
    """Size of the terms of the loss, sum over rows of |lse_i| + |z_it| (reduced like the loss).

    A confident row's loss lse - z_t is far smaller than either term, and float32 can only
    get it to an absolute error relative to the terms: the natural floor for its error.
    """
    with torch.no_grad():
        hidden, targets = _loss_rows(case)
        logits = oracle_logits(hidden, case.classifier, case.bias, case.softcap, case.logit_scale)
        lse = torch.logsumexp(logits, dim=-1)
        vocab = case.classifier.shape[0]
        valid = (targets.long() != case.ignore_index) & (targets >= 0) & (targets < vocab)
        picked = logits.gather(-1, targets.clamp(0, vocab - 1).long()[..., None])[..., 0]
        terms = torch.where(valid, lse.abs() + picked.abs(), 0.0) * (1 + case.label_smoothing)
        if case.reduction == "none":
            return terms.norm().item()
        total = terms.sum().item()
        return total / max(int(valid.sum()), 1) if case.reduction == "mean" else total


def lse_scale(case: Case) -> float:
    """Size of the terms that cancel in the rows' lse: each row's largest sum_d |h_d c_jd|
    (+ |b_j|) times |logit_scale| (the norm over rows, as ``rel_error`` takes it). A row whose
    lse is near 0 (one class whose logit cancels) is computed to float32's error relative to
    those terms, not to itself (a vocabulary of 1: 5.8e-5 relative to an lse of ~1e-3)."""
    with torch.no_grad():
        hidden, _ = _loss_rows(case)
        bias = None if case.bias is None else case.bias.double().abs()
        terms = F.linear(hidden.double().abs(), case.classifier.double().abs(), bias)
        if terms.shape[-1] == 0:
            return 0.0
        return (terms.amax(-1) * abs(case.logit_scale)).norm().item()


def assert_close(
    name: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, scale: float = 0.0
) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    err = rel_error(actual, expected, scale)
    assert err <= rtol, f"{name}: relative error {err:.3e} > {rtol:.1e}"
