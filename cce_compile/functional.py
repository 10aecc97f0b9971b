"""The public functions: ``cce_compile.linear_cross_entropy`` and ``linear_log_probs``.

It asks ``decide`` whether its arguments are valid, what autocast gives the head, the mode and
the rest of the call's choices, and calls the op (``op.custom_ops``). Where the op's autograd
formula cannot serve the call (``decide.route``: forward-mode AD, functorch transforms, a
``logit_scale`` or ``softcap`` tensor that requires grad) it takes ``autograd_fallback``
instead — the same math under PyTorch's own autograd — and says so once.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from torch import Tensor

from . import decide, row_metrics
from .implementations import autograd_fallback
from .implementations.interface import HeadInputs
from .loss_math import LossSpec
from .op import custom_ops as _ops
from .op.signature import FORWARD, FORWARD_RETURNS

log = logging.getLogger("cce_compile")
_warned: set[str] = set()


@dataclasses.dataclass(frozen=True)
class _Wanted:
    """The outputs a caller asks for besides the loss: the lse, and row metrics by name
    (row_metrics.py), returned in that table's order."""

    lse: bool = False
    metrics: tuple[str, ...] = ()

    @staticmethod
    def of(return_lse: bool, **flags: bool) -> _Wanted:
        """From the public ``return_<metric>`` flags."""
        names = tuple(m.name for m in row_metrics.METRICS if flags.get(m.flag))
        return _Wanted(bool(return_lse), names)


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
    softcap: float | Tensor | None = None,
    logit_scale: float | Tensor = 1.0,
    shift: int = 0,
    z_loss: float = 0.0,
    return_lse: bool = False,
    mode: str | None = None,
    grad_filter: float | None = None,
    return_entropy: bool = False,
    return_argmax: bool = False,
    return_log_sum_sq_probs: bool = False,
    return_mean_logits: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, ...]:
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
            Under autocast (CPU or CUDA) any float dtypes mix: hidden, classifier and bias are
            rounded to the autocast dtype inside the op, as ``F.linear`` rounds them there, and
            their gradients come back in their own dtypes; the loss is float32 either way.
        targets: (...) int64 or int32 class indices, hidden's leading shape.
        bias: optional (V,) bias of the head.
        ignore_index: targets equal to it (compared as int64, as PyTorch does) contribute
            nothing: an int, a numpy integer or a one-element integer tensor.
        reduction: 'mean' (over non-ignored rows; class-weighted with class_weights; nan when
            all rows are ignored), 'sum' or 'none'.
        label_smoothing: in [0, 1], as F.cross_entropy defines it.
        class_weights: optional (V,) rescaling weight per class, as F.cross_entropy's weight.
        softcap: if given, logits -> softcap * tanh(logits / softcap) (Gemma 2/3).
        logit_scale: logits are multiplied by it before the softcap (muP, Cohere, Granite).
            Either may be a 0-d tensor: read as a number, or differentiated if it requires
            grad (then by PyTorch's autograd, keeping the logits as eager does).
        shift: predict ``targets[..., t + shift]`` from ``hidden[..., t, :]`` (needs a time
            dimension); the last ``shift`` positions have no target. ``hidden`` is not copied.
        z_loss: adds ``z_loss * lse**2`` per non-ignored row, reduced like the loss (an
            unweighted mean over non-ignored rows for 'mean').
        return_lse: also return the per-row log-sum-exp of the (capped) logits, differentiable.
        return_entropy: also return each row's entropy of the softmax, -sum_j p_j log p_j
            (float32), computed in the same pass; 0 at ignored rows; a class of logit -inf
            adds 0 (0 log 0 = 0, as Categorical's). Differentiable (an RL entropy bonus): its
            gradient is computed in the backward's recompute.
        return_argmax: also return each row's first class of the largest logit (int64, as
            torch.argmax; token accuracy is ``argmax == targets``); -1 at ignored rows.
        return_log_sum_sq_probs: also return each row's log sum_j p_j^2 (float32, no
            gradient; WPO's weight); 0 at ignored rows. Lean mode only.
        return_mean_logits: also return each row's mean logit sum_j z_j / V (float32, no
            gradient; DPO's and KTO's logged metric); 0 at ignored rows. Lean mode only.
        compute_dtype: the GEMMs' dtype, instead of autocast's (float32, bfloat16 or
            float16): hidden, classifier and bias are rounded to it as autocast rounds them, a
            slab of classes at a time on the GPU (no V x D copy), and their gradients come back
            in their own dtypes; e.g. float32 math for a bf16 head (TRL's
            ``cast_lm_head_to_fp32``). None: autocast's, else the operands' own, which must
            then agree.
        mode: 'lean', 'fast' or 'auto'; None takes the configured mode (CCE_MODE).
        grad_filter: gradient filtering (filtering.py; lean mode): each row may drop the
            softmax term of its lightest blocks of 256 classes up to this much probability
            mass (e.g. 2**-12), with the error bound stated there; the loss is unchanged.
            None (default): exact gradients. For fine-tuning; not for pretraining.

    Returns:
        The loss (float32): a scalar, or for 'none' ``targets``' shape with ``shift`` fewer
        steps (0 at ignored rows); then where asked, in this order, the lse (valid at ignored
        rows too), the entropy, the argmax, the log sum p^2 and the mean logit, shaped like a
        'none' loss. Forward-mode AD and
        functorch transforms are served by PyTorch's autograd (docs/semantics.md).
    """
    decide.check_tensors(hidden, classifier, targets, bias, class_weights)
    options = (ignore_index, reduction, label_smoothing, softcap, logit_scale, shift, z_loss)
    spec = decide.loss_spec(hidden, *options)
    wanted = _Wanted.of(
        return_lse,
        return_entropy=return_entropy,
        return_argmax=return_argmax,
        return_log_sum_sq_probs=return_log_sum_sq_probs,
        return_mean_logits=return_mean_logits,
    )
    tensors = (hidden, classifier, targets, bias, class_weights)
    return _loss(tensors, spec, (logit_scale, softcap), wanted, mode, grad_filter, compute_dtype)


def linear_log_probs(
    hidden: Tensor,
    classifier: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    shift: int = 0,
    return_entropy: bool = False,
    mode: str | None = None,
    compute_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probabilities of ``targets`` (and the entropy), no logits stored: what RL
    and preference training take from a policy, an old policy or a reference model.

    Equals, value and gradients, the float32 math of::

        z = softcap * tanh(logit_scale * F.linear(hidden, classifier, bias) / softcap) / T
        log_probs = z.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
        entropy = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)

    with the temperature T after the softcap, as TRL and verl apply it (it folds exactly into
    the op's scale and cap: softcap_c(s y) / T = softcap_{c/T}(s y / T)). A class of logit
    -inf (a -inf bias) adds 0 log 0 = 0 to the entropy and nothing to its gradient, as
    ``Categorical(logits=z).entropy()``, where the entropy line above is NaN.

    Args:
        hidden, classifier, targets, bias, ignore_index, shift, mode, compute_dtype: as in
            ``linear_cross_entropy``.
        temperature: a finite number > 0.
        return_entropy: also return each token's entropy, differentiable (an entropy bonus).

    Returns:
        log_probs (float32, ``targets``' shape with ``shift`` fewer steps; 0 at ignored
        targets), and the entropy shaped alike (0 there too). Without a gradient (old and
        reference log-probs) the op runs its forward only: one GEMM's pass, nothing saved.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not 0.0 < temperature < math.inf:
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if mode == "fast":
        raise ValueError(
            "mode='fast' computes gradients in the forward for a scalar loss; per-token "
            "log-probs get theirs only in the backward: use mode='lean' or 'auto' (None)"
        )
    outputs = linear_cross_entropy(
        hidden,
        classifier,
        targets,
        bias,
        ignore_index=ignore_index,
        reduction="none",
        softcap=None if softcap is None else softcap / temperature,
        logit_scale=logit_scale / temperature,
        shift=shift,
        return_entropy=return_entropy,
        mode=mode,
        compute_dtype=compute_dtype,
    )
    if not return_entropy:
        return -outputs
    loss, entropy = outputs
    return -loss, entropy


def _loss(tensors, spec: LossSpec, scalars, wanted: _Wanted, mode, grad_filter, dtype=None):
    """The loss and the outputs ``wanted``, from the op, or from the autograd fallback where
    the op's formula cannot serve the call; ``scalars``: (logit_scale, softcap) as given;
    ``dtype``: the compute dtype asked for (None: autocast's or the operands')."""
    hidden, classifier, targets, bias, class_weights = tensors
    decide.check_mode(mode)
    grad_filter = decide.grad_filter(grad_filter, mode, spec)
    compute_dtype = decide.compute_dtype(hidden, classifier, bias, requested=dtype)
    hidden3, targets2, rows_shape = decide.canonical_form(hidden, targets, spec.shift)
    canonical = (hidden3, classifier, targets2, bias, class_weights)
    route = decide.route(tensors, *scalars)  # targets too: vmap over the targets alone
    if route is None:
        spec = decide.with_scalars(spec, *scalars)
        outputs = _call_op(canonical, compute_dtype, spec, wanted, mode, grad_filter)
    else:
        outputs = _fallback(canonical, compute_dtype, spec, scalars, wanted, route)
    loss, *extras = outputs
    if spec.reduction == "none":
        loss = loss.reshape(rows_shape)
    extras = [value.reshape(rows_shape) for value in extras]
    return (loss, *extras) if extras else loss


def _call_op(tensors, compute_dtype, spec: LossSpec, wanted: _Wanted, mode, grad_filter):
    """The loss and the outputs ``wanted`` (in the documented order) from
    ``torch.ops.cce.linear_cross_entropy`` in the mode ``decide`` chooses."""
    hidden, classifier, _, bias, _ = tensors
    needs = decide.gradients_asked(hidden, classifier, bias)
    chosen = decide.mode(
        mode,
        decide.problem_of(hidden, classifier, spec.shift, compute_dtype),
        needs,
        dtypes=decide.operand_dtypes(hidden, classifier, bias),
        reduction=spec.reduction,
        grad_filter=grad_filter,
        lse_has_grad=wanted.lse and torch.is_grad_enabled(),
        softcap=bool(spec.softcap),
        entropy="entropy" in wanted.metrics,
        argmax="argmax" in wanted.metrics,
        entropy_has_grad="entropy" in wanted.metrics and torch.is_grad_enabled(),
        lean_metrics=decide.lean_only_metrics(wanted.metrics),
    )
    output = torch.ops.cce.linear_cross_entropy(
        *FORWARD.build(
            **decide.op_inputs(tensors, compute_dtype),
            spec=spec,
            lse_all_rows=wanted.lse,
            mode=chosen,
            **needs,
            implementation_version=_ops.IMPLEMENTATION_VERSION,
            grad_filter=grad_filter,
            skip_ignored=decide.compacts_ignored_rows(),
            **{row_metrics.BY_NAME[name].flag: True for name in wanted.metrics},
        )
    )
    out = FORWARD_RETURNS.unpack(output)
    names = (("lse",) if wanted.lse else ()) + wanted.metrics
    return (out.loss, *(getattr(out, name) for name in names))


def _fallback(tensors, compute_dtype, spec: LossSpec, scalars, wanted: _Wanted, route: str):
    """(loss, lse if wanted) by PyTorch's autograd over chunked float32 logits
    (``autograd_fallback``), said once."""
    if wanted.metrics:
        flags = ", ".join(row_metrics.BY_NAME[name].flag for name in wanted.metrics)
        raise NotImplementedError(
            f"{flags} not served under {route}: leave them out there, or compute the metrics "
            "outside the transform"
        )
    _say_once(route)
    hidden, classifier, targets, bias, class_weights = tensors
    logit_scale, softcap = decide.checked_scalars(*scalars)
    # The scalars go to the fallback as they are (tensors are differentiated there).
    spec = dataclasses.replace(spec, logit_scale=1.0, softcap=None)
    if not (decide.transform_route(targets) or torch.compiler.is_compiling()):
        # (batched targets under vmap, and targets in a compiled graph, cannot branch on
        # their values: out-of-range targets then fail in the gather or give NaN rows)
        decide.check_targets(targets, class_weights, spec, classifier.shape[0])
    problem = decide.problem_of(hidden, classifier, spec.shift, compute_dtype)
    budget = decide.budget_bytes(problem)
    head = HeadInputs(*tensors, spec, budget, compute_dtype)
    loss, lse = autograd_fallback.differentiable_loss(
        head,
        lse_all_rows=wanted.lse,
        logit_scale=torch.as_tensor(logit_scale, device=hidden.device),
        softcap=None if softcap is None else torch.as_tensor(softcap, device=hidden.device),
    )
    return (loss, lse) if wanted.lse else (loss,)


def _say_once(route: str) -> None:
    if torch.compiler.is_compiling():  # Dynamo cannot trace logging calls (fullgraph=True)
        return
    if route not in _warned:
        _warned.add(route)
        log.warning(
            "cce_compile: linear_cross_entropy under %s: computed by PyTorch's autograd over "
            "chunked float32 logits (exact, but reverse mode keeps the logits as eager does)",
            route,
        )
