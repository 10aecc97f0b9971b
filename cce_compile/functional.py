"""The public function: ``cce_compile.linear_cross_entropy``.

It validates its arguments, applies an enclosing autocast region's cast to the head's inputs (as
``F.linear`` would), and calls the op. Where the op's autograd formula cannot serve the call it
takes ``torch_path.differentiable_loss`` instead — the same math under PyTorch's own autograd —
and says so once: forward-mode AD, functorch transforms (``torch.func.grad``, ``jvp``,
``jacrev``, ``vmap``...) and a ``logit_scale`` or ``softcap`` tensor that requires grad.
"""

from __future__ import annotations

import logging
import math
import numbers
import operator

import torch
from torch import Tensor

from . import autograd_fallback, call_plan, config, filtering
from . import ops as _ops  # registers torch.ops.cce
from .loss_math import REDUCTIONS, LossSpec
from .op_signature import FORWARD
from .policy import choose_mode

log = logging.getLogger("cce_compile")

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TARGET_DTYPES = (torch.int64, torch.int32)
_warned: set[str] = set()


def _finite(value: float) -> bool:
    # Not math.isfinite: Dynamo cannot trace it; NaN fails both comparisons.
    return -math.inf < value < math.inf


def _require_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _require_float(name: str, value: Tensor) -> None:
    if value.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {value.dtype}")


def _validate_tensors(hidden, classifier, targets, bias, class_weights) -> None:
    """Types and shapes; dtypes must agree only after autocast (``_validate_dtypes``)."""
    _require_tensor("hidden", hidden)
    _require_tensor("classifier", classifier)
    _require_tensor("targets", targets)
    _require_float("hidden", hidden)
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension (..., D)")
    if classifier.dim() != 2:
        raise ValueError(f"classifier must be 2-D (V, D), got shape {tuple(classifier.shape)}")
    _require_float("classifier", classifier)
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
        _require_float("bias", bias)
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


def _validate_dtypes(hidden, classifier, bias) -> None:
    if classifier.dtype != hidden.dtype:
        raise TypeError(
            f"classifier dtype {classifier.dtype} must match hidden dtype {hidden.dtype} "
            "(or run under autocast, which casts both)"
        )
    if bias is not None and bias.dtype != hidden.dtype:
        raise TypeError(f"bias dtype {bias.dtype} must match hidden dtype {hidden.dtype}")


def _require_real(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")


def as_ignore_index(value) -> int:
    """``ignore_index`` as a Python int, from what F.cross_entropy takes: what
    ``operator.index`` reads (an int, a numpy integer, a one-element integer tensor) in int64's
    range, but no bool. The op and its masks then see one exact value (loss_math.valid_rows)."""
    if isinstance(value, bool) or (isinstance(value, Tensor) and value.dtype == torch.bool):
        kind = "a bool tensor" if isinstance(value, Tensor) else "bool"
        raise TypeError(f"ignore_index must be an int, got {kind}")
    try:
        index = operator.index(value)
    except TypeError:
        raise TypeError(f"ignore_index must be an int, got {type(value).__name__}") from None
    if not -(2**63) <= index < 2**63:
        raise ValueError(f"ignore_index must fit in int64 (as F.cross_entropy's), got {index}")
    return index


def _validate_options(
    hidden, reduction, label_smoothing, softcap, logit_scale, shift, z_loss, mode
) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    _require_real("label_smoothing", label_smoothing)
    _require_real("z_loss", z_loss)
    if softcap is not None and not isinstance(softcap, Tensor):
        _require_real("softcap", softcap)
    if not isinstance(logit_scale, Tensor):
        _require_real("logit_scale", logit_scale)
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if isinstance(softcap, Tensor) or isinstance(logit_scale, Tensor):
        for name, value in (("softcap", softcap), ("logit_scale", logit_scale)):
            if isinstance(value, Tensor) and (value.numel() != 1 or value.is_complex()):
                raise ValueError(f"{name} as a tensor must hold one real number")
    if not isinstance(softcap, Tensor) and softcap is not None:
        if not (_finite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be a finite number > 0 or None, got {softcap}")
    if not isinstance(logit_scale, Tensor) and not _finite(logit_scale):
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


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype an enclosing autocast region gives ``F.linear`` on ``device``, or None."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def _as_number(name: str, value):
    """A tensor that needs no gradient is read as a number (a host sync on a GPU)."""
    if isinstance(value, Tensor):
        value = float(value.detach())
        if name == "softcap" and not (_finite(value) and value > 0):
            raise ValueError(f"softcap must be a finite number > 0 or None, got {value}")
        if name == "logit_scale" and not _finite(value):
            raise ValueError(f"logit_scale must be finite, got {value}")
    return value


@torch.compiler.assume_constant_result
def _transform_route(*present: Tensor) -> str:
    """A functorch transform or forward-mode AD around these tensors ('' if none). Dynamo
    cannot trace these queries; it calls this at trace time instead (its guards on the
    functorch stack keep the answer valid), so torch.compile(torch.func.grad(f)) takes the
    same route as eager and a plain compile has no graph break."""
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in present):
        return "a functorch transform (torch.func.grad / jvp / vjp / jacrev / vmap)"
    if any(torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in present):
        return "forward-mode AD (dual tensors)"
    return ""


@torch.compiler.assume_constant_result
def _compiled_into_cuda_graphs() -> bool:
    """Does the torch.compile tracing this call record CUDA graphs (mode "reduce-overhead" or
    "max-autotune", or Inductor's ``triton.cudagraphs``)? The op then keeps every row: skipping
    ignored ones sizes the work by the targets' values, which a recorded graph cannot do.
    Dynamo calls this at trace time (its backend is known then); outside Dynamo, False."""
    import torch._inductor.config as inductor_config

    if inductor_config.triton.cudagraphs:
        return True
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        backend = InstructionTranslator.current_tx().output.compiler_fn
    except Exception:  # not tracing, or a torch without these internals
        return False
    while backend is not None:  # through Dynamo's debug and torch.compile's wrappers
        if hasattr(backend, "get_compiler_config"):  # the default backend, with its mode
            if (backend.get_compiler_config() or {}).get("triton.cudagraphs"):
                return True
        kwargs = getattr(backend, "kwargs", None) or {}  # a named backend given mode/options
        options = dict(kwargs.get("options") or {})
        if kwargs.get("mode"):
            options.update(torch._inductor.list_mode_options(kwargs["mode"]))
        if options.get("triton.cudagraphs"):
            return True
        backend = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(
            backend, "compiler_fn", None
        )
    return False


def skips_ignored() -> bool:
    """CCE_SKIP_IGNORED, unless this call is being compiled into CUDA graphs."""
    if not config.get().skip_ignored:
        return False
    return not (torch.compiler.is_compiling() and _compiled_into_cuda_graphs())


def _autograd_route(tensors, logit_scale, softcap) -> str | None:
    """Why the op's own autograd formula cannot serve this call, or None if it can."""
    grad_on = torch.is_grad_enabled()
    if any(isinstance(v, Tensor) and v.requires_grad and grad_on for v in (logit_scale, softcap)):
        return "a logit_scale or softcap tensor that requires grad"
    if torch.compiler.is_compiling() and any(isinstance(v, Tensor) for v in (logit_scale, softcap)):
        # Reading it as the op's float would be a data-dependent host read in the graph.
        return "a logit_scale or softcap tensor under torch.compile"
    present = [t for t in (*tensors, logit_scale, softcap) if isinstance(t, Tensor)]
    return _transform_route(*present) or None


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
        ignore_index: targets equal to it (compared as int64, as PyTorch does, whatever the
            targets' dtype) contribute nothing. An int, a numpy integer or a one-element
            integer tensor (a host sync on a GPU), as F.cross_entropy takes.
        reduction: 'mean' (over non-ignored rows; class-weighted with class_weights; nan when
            all rows are ignored), 'sum' or 'none'.
        label_smoothing: in [0, 1], as F.cross_entropy defines it.
        class_weights: optional (V,) rescaling weight per class, as F.cross_entropy's weight.
        softcap: if given, logits -> softcap * tanh(logits / softcap) (Gemma 2/3).
        logit_scale: logits are multiplied by it before the softcap (muP, Cohere, Granite).
            ``softcap`` and ``logit_scale`` may be 0-d tensors: one that requires grad is
            differentiated (by PyTorch's autograd, keeping the logits as eager does); one that
            does not is read as a number (a host sync on a GPU).
        shift: predict ``targets[..., t + shift]`` from ``hidden[..., t, :]`` (needs a time
            dimension); the last ``shift`` positions have no target. ``hidden`` is not copied.
        z_loss: adds ``z_loss * lse**2`` per non-ignored row, reduced like the loss (an
            unweighted mean over non-ignored rows for 'mean').
        return_lse: also return the per-row log-sum-exp of the (capped) logits, differentiable.
        return_entropy: also return each row's entropy of the softmax, lse - sum_j p_j z_j
            (float32, no gradient: a metric), computed in the same pass; 0 at ignored rows.
        return_argmax: also return each row's first class of the largest logit (int64, as
            torch.argmax; token accuracy is ``argmax == targets``); -1 at ignored rows.
        mode: 'lean', 'fast' or 'auto'; None takes the configured mode (CCE_MODE).
        grad_filter: gradient filtering (filtering.py; lean mode): each row may drop the
            softmax term of its lightest blocks of 256 classes up to this much probability
            mass (e.g. 2**-12), with the error bound stated there; the loss is unchanged.
            None (default): exact gradients. For fine-tuning; not for pretraining.

    Forward-mode AD and functorch transforms (``torch.func.grad``, ``jvp``, ``vjp``,
    ``jacrev``, ``vmap``) are served exactly by PyTorch's autograd over chunked float32 logits
    (said once in the ``cce_compile`` log): reverse mode then keeps the logits as eager does.

    Returns:
        The loss (float32): a scalar, or for 'none' shaped like ``targets`` with the time
        dimension shortened by ``shift`` (0 at ignored rows). With ``return_lse``, also the
        per-row lse (float32, same shape as a 'none' loss, valid at ignored rows too); then,
        in this order, the entropy and the argmax where asked (same shape).
    """
    _validate_tensors(hidden, classifier, targets, bias, class_weights)
    ignore_index = as_ignore_index(ignore_index)
    _validate_options(hidden, reduction, label_smoothing, softcap, logit_scale, shift, z_loss, mode)
    _validate_grad_filter(grad_filter, mode, label_smoothing, softcap)
    # Under autocast F.linear rounds its inputs to the autocast dtype: the op does the same
    # inside, and returns gradients in the inputs' own dtypes (float32 weights keep float32
    # gradients, with no rounded copy of the classifier).
    compute_dtype = autocast_dtype(hidden.device)
    if compute_dtype is None:
        _validate_dtypes(hidden, classifier, bias)
    dim = hidden.shape[-1]
    leading = tuple(hidden.shape[:-1])
    time = leading[-1] if leading else 1
    batch = math.prod(leading[:-1])
    hidden3 = hidden.reshape(batch, time, dim)
    targets2 = targets.reshape(batch, time)
    rows_shape = leading[:-1] + (time - shift,) if leading else ()

    route = _autograd_route((hidden, classifier, bias), logit_scale, softcap)
    if route is not None and (return_entropy or return_argmax):
        raise NotImplementedError(
            f"return_entropy / return_argmax are not served under {route}: call "
            "linear_cross_entropy without them there, or compute the metrics outside it"
        )
    if route is None:
        logit_scale, softcap = (
            _as_number("logit_scale", logit_scale),
            _as_number("softcap", softcap),
        )
    options = dict(
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=float(label_smoothing),
        softcap=None if softcap is None or route else float(softcap),
        logit_scale=1.0 if route else float(logit_scale),
        shift=shift,
        z_loss=float(z_loss),
    )
    if route is not None:
        _say_once(route)
        entropy = argmax = None  # (refused above on this route)
        loss, lse = _autograd_route_loss(
            (hidden3, classifier, targets2, bias, class_weights),
            compute_dtype,
            options,
            return_lse=return_lse,
            scalars=(logit_scale, softcap),
        )
    else:
        loss, lse, entropy, argmax = _call_op(
            (hidden3, classifier, targets2, bias, class_weights),
            compute_dtype,
            options,
            mode=mode,
            return_lse=return_lse,
            grad_filter=None if grad_filter is None else float(grad_filter),
            metrics=(bool(return_entropy), bool(return_argmax)),
        )
    if reduction == "none":
        loss = loss.reshape(rows_shape)
    extras = [
        value.reshape(rows_shape)
        for value, wanted in ((lse, return_lse), (entropy, return_entropy), (argmax, return_argmax))
        if wanted
    ]
    return (loss, *extras) if extras else loss


def _validate_grad_filter(grad_filter, mode, label_smoothing, softcap) -> None:
    """grad_filter's type, range, and the mode and options it can filter."""
    if grad_filter is None:
        return
    if isinstance(grad_filter, bool) or not isinstance(grad_filter, (int, float)):
        raise TypeError(f"grad_filter must be a float or None, got {type(grad_filter)}")
    filtering.check_beta(float(grad_filter))
    if mode == "fast":
        raise ValueError("grad_filter filters the lean backward: mode='fast' cannot use it")
    filtering.check_options(label_smoothing, softcap)


def _autograd_route_loss(tensors, compute_dtype, options, *, return_lse, scalars):
    """(loss, lse) by PyTorch's autograd over chunked float32 logits: forward-mode AD,
    functorch transforms, a differentiable logit_scale or softcap (``scalars``)."""
    hidden, classifier, targets, bias, class_weights = tensors
    logit_scale, softcap = scalars
    spec = LossSpec(**options)
    if not (_transform_route(targets) or torch.compiler.is_compiling()):
        # (batched targets under vmap, and targets in a compiled graph, cannot branch on
        # their values: out-of-range targets then fail in the gather or give NaN rows)
        call_plan.check_targets(targets, class_weights, spec, classifier.shape[0])
    problem = call_plan.problem_of(hidden, classifier, spec.shift, compute_dtype)
    return autograd_fallback.differentiable_loss(
        hidden,
        classifier,
        targets,
        bias,
        class_weights,
        spec,
        lse_all_rows=return_lse,
        budget_bytes=call_plan.budget_bytes(problem),
        compute_dtype=compute_dtype,
        logit_scale=torch.as_tensor(logit_scale, device=hidden.device),
        softcap=None if softcap is None else torch.as_tensor(softcap, device=hidden.device),
    )


def _call_op(tensors, compute_dtype, options, *, mode, return_lse, grad_filter, metrics):
    """(loss, lse, entropy, argmax) from ``torch.ops.cce.linear_cross_entropy`` in the chosen
    mode (the last two empty unless ``metrics`` asks for them)."""
    hidden, classifier, targets, bias, class_weights = tensors
    grad_on = torch.is_grad_enabled()
    needs_h = grad_on and hidden.requires_grad
    needs_c = grad_on and classifier.requires_grad
    needs_b = grad_on and bias is not None and bias.requires_grad
    settings = config.get()
    problem = call_plan.problem_of(hidden, classifier, options["shift"], compute_dtype)
    chosen = choose_mode(
        "lean" if grad_filter is not None else mode or settings.mode,
        reduction=options["reduction"],
        needs_grad=needs_h or needs_c or needs_b,
        needs_classifier=needs_c,
        lse_has_grad=return_lse and grad_on,
        problem=problem,
        budget=call_plan.budget_bytes(problem),
        explicit=mode is not None,
    )
    loss, lse, *_, entropy, argmax = torch.ops.cce.linear_cross_entropy(
        *FORWARD.build(
            hidden=hidden,
            classifier=classifier,
            targets=targets,
            bias=bias,
            class_weights=class_weights,
            compute_dtype=compute_dtype,
            **options,
            lse_all_rows=return_lse,
            mode=chosen,
            grad_hidden=needs_h,
            grad_classifier=needs_c,
            grad_bias=needs_b,
            implementation_version=_ops.IMPLEMENTATION_VERSION,
            grad_filter=grad_filter,
            skip_ignored=skips_ignored(),
            return_entropy=metrics[0],
            return_argmax=metrics[1],
        )
    )
    return loss, lse, entropy, argmax
