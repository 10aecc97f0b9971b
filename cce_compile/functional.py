"""The public function: ``cce_compile.linear_cross_entropy``."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import config
from . import ops as _ops  # noqa: F401  (registers torch.ops.cce)
from .loss_math import REDUCTIONS
from .policy import choose_mode

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TARGET_DTYPES = (torch.int64, torch.int32)


def _finite(value: float) -> bool:
    # Not math.isfinite: Dynamo cannot trace it; NaN fails both comparisons.
    return -math.inf < value < math.inf


def _require_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _validate(
    hidden,
    classifier,
    targets,
    bias,
    ignore_index,
    reduction,
    label_smoothing,
    class_weights,
    softcap,
    logit_scale,
    shift,
    z_loss,
    mode,
) -> None:
    """Raise a TypeError/ValueError that names the offending argument."""
    _require_tensor("hidden", hidden)
    _require_tensor("classifier", classifier)
    _require_tensor("targets", targets)
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension (..., D)")
    if classifier.dim() != 2:
        raise ValueError(f"classifier must be 2-D (V, D), got shape {tuple(classifier.shape)}")
    if classifier.dtype != hidden.dtype:
        raise TypeError(
            f"classifier dtype {classifier.dtype} must match hidden dtype {hidden.dtype}"
        )
    if classifier.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"classifier has D={classifier.shape[1]} but hidden has D={hidden.shape[-1]} "
            f"(classifier {tuple(classifier.shape)}, hidden {tuple(hidden.shape)})"
        )
    if classifier.shape[0] < 1:
        raise ValueError("classifier must have at least one row (V >= 1)")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(
            f"targets must hold class indices (int64 or int32), got {targets.dtype}; "
            "class-probability targets are not supported"
        )
    if targets.dtype not in _TARGET_DTYPES:
        raise TypeError(f"targets must be int64 or int32, got {targets.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden's leading shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    vocab = classifier.shape[0]
    if bias is not None:
        _require_tensor("bias", bias)
        if tuple(bias.shape) != (vocab,):
            raise ValueError(f"bias must have shape ({vocab},), got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias dtype {bias.dtype} must match hidden dtype {hidden.dtype}")
    if class_weights is not None:
        _require_tensor("class_weights", class_weights)
        if tuple(class_weights.shape) != (vocab,):
            raise ValueError(
                f"class_weights must have shape ({vocab},), got {tuple(class_weights.shape)}"
            )
        if not class_weights.dtype.is_floating_point:
            raise TypeError(f"class_weights must be floating point, got {class_weights.dtype}")
    devices = {
        t.device for t in (hidden, classifier, targets, bias, class_weights) if t is not None
    }
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not (_finite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite number > 0 or None, got {softcap}")
    if not _finite(logit_scale):
        raise ValueError(f"logit_scale must be finite, got {logit_scale}")
    if not (_finite(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss}")
    if isinstance(shift, bool) or not isinstance(shift, int):
        raise TypeError(f"shift must be an int, got {type(shift).__name__}")
    if shift:
        if hidden.dim() < 2:
            raise ValueError("shift needs hidden with a time dimension (..., T, D)")
        if not 0 <= shift < hidden.shape[-2]:
            raise ValueError(f"shift must be in [0, T={hidden.shape[-2]}), got {shift}")
    if mode is not None and mode not in config.MODES:
        raise ValueError(f"mode must be one of {config.MODES} or None, got {mode!r}")


def linear_cross_entropy(
    hidden: Tensor,
    classifier: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weights: Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    shift: int = 0,
    z_loss: float = 0.0,
    return_lse: bool = False,
    mode: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of ``hidden @ classifier.T (+ bias)`` against ``targets``, no logits stored.

    Equals, value and gradients, the float32 math of::

        logits = logit_scale * F.linear(hidden, classifier, bias)
        logits = softcap * tanh(logits / softcap)            # if softcap
        F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), weight=class_weights,
                        ignore_index=ignore_index, reduction=reduction,
                        label_smoothing=label_smoothing) + z_loss term

    Args:
        hidden: (..., D) float32, bfloat16 or float16; the last hidden states.
        classifier: (V, D), hidden's dtype; the lm_head weight (tied embeddings allowed).
        targets: (...) int64 or int32 class indices, hidden's leading shape.
        bias: optional (V,) bias of the head.
        ignore_index: targets equal to it contribute nothing.
        reduction: 'mean' (over non-ignored rows; class-weighted with class_weights; nan when
            all rows are ignored), 'sum' or 'none'.
        label_smoothing: in [0, 1], as F.cross_entropy defines it.
        class_weights: optional (V,) rescaling weight per class, as F.cross_entropy's weight.
        softcap: if given, logits -> softcap * tanh(logits / softcap) (Gemma 2/3).
        logit_scale: logits are multiplied by it before the softcap (muP, Cohere, Granite).
        shift: predict ``targets[..., t + shift]`` from ``hidden[..., t, :]`` (needs a time
            dimension); the last ``shift`` positions have no target. ``hidden`` is not copied.
        z_loss: adds ``z_loss * lse**2`` per non-ignored row, reduced like the loss (an
            unweighted mean over non-ignored rows for 'mean').
        return_lse: also return the per-row log-sum-exp of the (capped) logits, differentiable.
        mode: 'lean', 'fast' or 'auto'; None takes the configured mode (CCE_MODE).

    Returns:
        The loss (float32): a scalar, or for 'none' shaped like ``targets`` with the time
        dimension shortened by ``shift`` (0 at ignored rows). With ``return_lse``, also the
        per-row lse (float32, same shape as a 'none' loss, valid at ignored rows too).
    """
    _validate(
        hidden,
        classifier,
        targets,
        bias,
        ignore_index,
        reduction,
        label_smoothing,
        class_weights,
        softcap,
        logit_scale,
        shift,
        z_loss,
        mode,
    )
    dim = hidden.shape[-1]
    leading = tuple(hidden.shape[:-1])
    time = leading[-1] if leading else 1
    batch = math.prod(leading[:-1])
    hidden3 = hidden.reshape(batch, time, dim)
    targets2 = targets.reshape(batch, time)
    rows_shape = leading[:-1] + (time - shift,) if leading else ()

    grad_on = torch.is_grad_enabled()
    needs_h = grad_on and hidden.requires_grad
    needs_c = grad_on and classifier.requires_grad
    needs_b = grad_on and bias is not None and bias.requires_grad
    settings = config.get()
    chosen = choose_mode(
        mode or settings.mode,
        reduction=reduction,
        needs_grad=needs_h or needs_c or needs_b,
        needs_classifier=needs_c,
        lse_has_grad=return_lse and grad_on,
        vocab=classifier.shape[0],
        dim=dim,
        budget_bytes=settings.memory_budget_mb * 2**20,
        explicit=mode is not None,
    )
    loss, lse, *_ = torch.ops.cce.linear_cross_entropy(
        hidden3,
        classifier,
        targets2,
        bias,
        class_weights,
        ignore_index,
        reduction,
        float(label_smoothing),
        float(softcap or 0.0),
        float(logit_scale),
        shift,
        float(z_loss),
        return_lse,
        chosen,
        needs_h,
        needs_c,
        needs_b,
        _ops.IMPLEMENTATION_VERSION,
    )
    if reduction == "none":
        loss = loss.reshape(rows_shape)
    if return_lse:
        return loss, lse.reshape(rows_shape)
    return loss
