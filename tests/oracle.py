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
# Elementwise floor for values near zero (absolute), relative to the loss's own scale.
ABS_FLOOR = 1e-6


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


def oracle(case: Case, return_lse: bool = False):
    """Loss (and lse) in float64 from the case's tensors, differentiable w.r.t. them."""
    hidden, targets = case.hidden, case.targets
    if case.shift:
        time = hidden.shape[-2]
        hidden = hidden[..., : time - case.shift, :]
        targets = targets[..., case.shift :]
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
    """Per leaf, 0.1 x the norm of the gradient of sum_i (|a_i| + |g_i|) lse_i, no softcap.

    The size of one term of the exact gradient before cancellation: (softmax - onehot) terms
    cancel when the model is confident (or V = 1), and a saturated softcap multiplies them by
    1 - tanh^2, which float32 can only compute to an absolute (not relative) error. This is the
    natural floor for a relative error. ``a_i`` is the upstream gradient of row i's loss
    (divided by the row count for 'mean'), ``g_i`` that of its lse (or 0).
    """
    uncapped = dataclasses.replace(case, softcap=None)
    _, lse = oracle(uncapped, return_lse=True)
    factor = upstream_loss.abs().expand_as(lse)
    if case.reduction == "mean":
        targets = case.targets[..., case.shift :] if case.shift else case.targets
        factor = factor / max(int((targets != case.ignore_index).sum()), 1)
    if upstream_lse is not None:
        factor = factor + upstream_lse.abs()
    grads = torch.autograd.grad((factor * lse).sum(), leaves, allow_unused=True)
    return [0.0 if g is None else 0.1 * g.norm().item() for g in grads]


def assert_close(
    name: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, scale: float = 0.0
) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    err = rel_error(actual, expected, scale)
    assert err <= rtol, f"{name}: relative error {err:.3e} > {rtol:.1e}"
