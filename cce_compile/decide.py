"""Every per-call decision, made once: the three front doors ask this module.

The front doors are the public function (``functional``), the vocabulary-parallel function
(``distributed.functional``) and the graph pass (``passes.plain``, ``passes.tensor_parallel``).
For each call this module decides:

* whether its arguments are valid (PyTorch's errors, naming the argument), and its
  :class:`~cce_compile.loss_math.LossSpec`;
* the compute dtype an enclosing autocast region gives the head;
* the :class:`~cce_compile.policy.Problem`, its memory budget and the mode (lean or fast);
* whether the op compacts away ignored rows (``skip_ignored``: a host synchronisation), which
  is not the kernels' skipping of ignored rows' tiles (``skip_ignored_tiles``, always safe);
* whether gradient filtering may run;
* whether the op's autograd formula can serve the call at all (``route``).

``policy`` holds the memory rules and their numbers; this module applies them to a call.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator

import torch
from torch import Tensor

from . import config, policy, row_metrics
from .loss_math import LossSpec, check_targets_in_range, row_targets

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TARGET_DTYPES = (torch.int64, torch.int32)


# --- validation ------------------------------------------------------------------------------


def _finite(value: float) -> bool:
    # Not math.isfinite: Dynamo cannot trace it; NaN fails both comparisons.
    return -math.inf < value < math.inf


def _require_tensor(name: str, value: object) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _require_float(name: str, value: Tensor) -> None:
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {value.dtype}")


def _require_real(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")


def check_tensors(hidden, classifier, targets, bias, class_weights, shard=None) -> None:
    """Types, shapes and devices of a head's tensors; dtypes must agree only after autocast
    (``compute_dtype``). ``shard`` (a ``distributed.sharding.VocabShard``): ``classifier`` and
    ``bias`` are this rank's classes of a split vocabulary, ``class_weights`` the whole's."""
    for name, value in (("hidden", hidden), ("classifier", classifier), ("targets", targets)):
        _require_tensor(name, value)
    _require_float("hidden", hidden)
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension (..., D)")
    _check_classifier(hidden, classifier, shard)
    _check_targets_tensor(hidden, targets)
    local = classifier.shape[0]
    _check_per_class("bias", bias, local, "this rank's slice " if shard else "")
    if bias is not None:
        _require_float("bias", bias)
    _check_per_class("class_weights", class_weights, shard.size if shard else local, "")
    if class_weights is not None and not class_weights.dtype.is_floating_point:
        raise TypeError(f"class_weights must be floating point, got {class_weights.dtype}")
    if class_weights is not None and class_weights.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(
            "the derivative for 'class_weights' is not implemented (as for F.cross_entropy's "
            "weight): pass class_weights.detach()"
        )
    devices = {
        t.device for t in (hidden, classifier, targets, bias, class_weights) if t is not None
    }
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_classifier(hidden: Tensor, classifier: Tensor, shard) -> None:
    """The (V, D) classifier (a rank's (V_local, D) shard that fits the vocabulary)."""
    what = "this rank's shard (V_local, D)" if shard else "2-D (V, D)"
    if classifier.dim() != 2:
        raise ValueError(f"classifier must be {what}, got shape {tuple(classifier.shape)}")
    _require_float("classifier", classifier)
    if classifier.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"classifier has D={classifier.shape[1]} but hidden has D={hidden.shape[-1]} "
            f"(classifier {tuple(classifier.shape)}, hidden {tuple(hidden.shape)})"
        )
    if shard is None and classifier.shape[0] < 1:
        raise ValueError("classifier must have at least one row (V >= 1)")
    if shard is not None and not 0 <= shard.start <= shard.start + len(classifier) <= shard.size:
        raise ValueError(
            f"vocab_start={shard.start} with a shard of {classifier.shape[0]} classes does not "
            f"fit in vocab_size={shard.size}"
        )


def _check_targets_tensor(hidden: Tensor, targets: Tensor) -> None:
    """Class indices (int64 or int32) of hidden's leading shape."""
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(
            f"targets must hold class indices (int64 or int32), got {targets.dtype}; "
            "class-probability targets are not supported"
        )
    if targets.dtype not in TARGET_DTYPES:
        raise TypeError(f"targets must be int64 or int32, got {targets.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden's leading shape "
            f"{tuple(hidden.shape[:-1])}"
        )


def _check_per_class(name: str, value, classes: int, which: str) -> None:
    """An optional tensor of one value per class."""
    if value is None:
        return
    _require_tensor(name, value)
    if tuple(value.shape) != (classes,):
        raise ValueError(f"{name} must be {which}of shape ({classes},), got {tuple(value.shape)}")


def compute_dtype(
    hidden: Tensor, classifier: Tensor, bias: Tensor | None, requested: torch.dtype | None = None
) -> torch.dtype | None:
    """The dtype the op rounds its inputs to, as autocast would: ``requested`` (a caller's
    ``compute_dtype``), else the one an enclosing autocast region gives ``F.linear`` on
    hidden's device, else None, and then the head's dtypes must agree."""
    if requested is not None:
        if requested not in FLOAT_DTYPES:
            raise TypeError(
                f"compute_dtype must be torch.float32, bfloat16 or float16, got {requested!r}"
            )
        return requested
    device = hidden.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    for name, value in (("classifier", classifier), ("bias", bias)):
        if value is not None and value.dtype != hidden.dtype:
            raise TypeError(
                f"{name} dtype {value.dtype} must match hidden dtype {hidden.dtype} "
                "(or run under autocast, which casts both)"
            )
    return None


def ignore_index_of(value) -> int:
    """``ignore_index`` as a Python int, from what F.cross_entropy takes: what
    ``operator.index`` reads (an int, a numpy integer, a one-element integer tensor) in int64's
    range, but no bool. The op's masks then compare it exactly (``loss_math.valid_rows``)."""
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


def int_argument(name: str, value) -> int:
    """An integer argument (a size, an offset) as a Python int: what ``operator.index``
    reads, no bool."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _check_scalar(name: str, value) -> None:
    """``softcap`` (a finite number > 0, or None) or ``logit_scale`` (finite): a Python
    number, or a 0-d tensor holding one real number."""
    if value is None and name == "softcap":
        return
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex():
            raise ValueError(f"{name} as a tensor must hold one real number")
        return
    _require_real(name, value)
    if name == "softcap" and not (_finite(value) and value > 0):
        raise ValueError(f"softcap must be a finite number > 0 or None, got {value}")
    if not _finite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def with_scalars(spec: LossSpec, logit_scale, softcap) -> LossSpec:
    """``spec`` with the op's float ``logit_scale`` and ``softcap`` (checked by ``loss_spec``):
    a tensor is read (a host sync on a GPU; one that requires grad loses it: ``route`` sends
    those calls elsewhere) and checked as a number is."""
    values = {}
    for name, value in (("logit_scale", logit_scale), ("softcap", softcap)):
        if isinstance(value, Tensor):
            value = float(value.detach())
            _check_scalar(name, value)
        values[name] = None if value is None else float(value)
    return dataclasses.replace(spec, **values)


def checked_scalars(logit_scale, softcap) -> tuple:
    """(logit_scale, softcap) for PyTorch's autograd (``route``): their values checked as a
    number's are, where they can be read (a host read: eagerly, outside functorch transforms;
    a compiled graph cannot branch on them, and reads them as they are)."""
    for name, value in (("logit_scale", logit_scale), ("softcap", softcap)):
        readable = isinstance(value, Tensor) and not torch.compiler.is_compiling()
        if readable and not transform_route(value):
            _check_scalar(name, float(value.detach()))
    return logit_scale, softcap


def loss_spec(
    hidden: Tensor,
    ignore_index,
    reduction: str,
    label_smoothing: float,
    softcap,
    logit_scale,
    shift: int,
    z_loss: float,
) -> LossSpec:
    """The checked loss options of a call on ``hidden``, in LossSpec's field order (LossSpec
    checks the values' ranges).
    ``softcap`` and ``logit_scale`` may be 0-d tensors (checked here; the spec then holds
    none and 1.0: ``scalar_value`` reads them where the op serves the call)."""
    for name, value in (("label_smoothing", label_smoothing), ("z_loss", z_loss)):
        _require_real(name, value)
    _check_scalar("softcap", softcap)
    _check_scalar("logit_scale", logit_scale)
    if isinstance(shift, bool) or not isinstance(shift, int):
        raise TypeError(f"shift must be an int, got {type(shift).__name__}")
    if shift and hidden.dim() < 2:
        raise ValueError("shift needs hidden with a time dimension (..., T, D)")
    if shift and not 0 <= shift < hidden.shape[-2]:
        raise ValueError(f"shift must be in [0, T={hidden.shape[-2]}), got {shift}")
    return LossSpec(
        ignore_index=ignore_index_of(ignore_index),
        reduction=reduction,
        label_smoothing=float(label_smoothing),
        softcap=None if softcap is None or isinstance(softcap, Tensor) else float(softcap),
        logit_scale=1.0 if isinstance(logit_scale, Tensor) else float(logit_scale),
        shift=shift,
        z_loss=float(z_loss),
    )


def check_targets(targets: Tensor, class_weights, spec: LossSpec, vocab: int) -> None:
    """PyTorch's error for out-of-range targets, where checking costs no device sync (on a
    CPU, or asked for: CCE_CHECK_TARGETS)."""
    if targets.device.type == "cpu" or config.get().check_targets:
        check_targets_in_range(row_targets(targets, class_weights, spec, vocab), vocab)


def canonical_form(hidden: Tensor, targets: Tensor, shift: int) -> tuple[Tensor, Tensor, tuple]:
    """(hidden (B, T, D), targets (B, T), the shape of a per-row output): the ops' form of a
    call on hidden (..., D) (views where the strides allow), and the caller's for its result
    (the time dimension shortened by ``shift``)."""
    leading = tuple(hidden.shape[:-1])
    time = leading[-1] if leading else 1
    batch = math.prod(leading[:-1])
    rows_shape = leading[:-1] + (time - shift,) if leading else ()
    return hidden.reshape(batch, time, hidden.shape[-1]), targets.reshape(batch, time), rows_shape


def check_mode(mode: str | None) -> None:
    if mode is not None and mode not in config.MODES:
        raise ValueError(f"mode must be one of {config.MODES} or None, got {mode!r}")


# --- gradient filtering ----------------------------------------------------------------------


def grad_filter_conflict(label_smoothing, softcap) -> str | None:
    """Why filtering cannot keep these options' gradient exact, or None: label smoothing
    under a softcap (the smoothing term's gradient then needs every logit). ``label_smoothing``
    may be a graph node (symbolic): then it may be non-zero."""
    smoothing = label_smoothing if isinstance(label_smoothing, (int, float)) else 1.0
    if smoothing and softcap is not None:
        return (
            "grad_filter cannot be combined with label_smoothing under a softcap: the "
            "smoothing term's gradient then needs every logit (set one of them off)"
        )
    return None


def grad_filter(beta, mode: str | None, spec: LossSpec) -> float | None:
    """A call's gradient-filter threshold, checked (type, range, mode, options), or None.
    ``mode``: the one asked for (None, 'auto' and 'lean' take lean) or the op's own."""
    if beta is None:
        return None
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"grad_filter must be a float or None, got {type(beta)}")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"grad_filter must be in [0, 1) (a probability mass), got {beta}")
    if mode == "fast":
        raise ValueError("grad_filter filters the lean backward: mode='fast' cannot use it")
    conflict = grad_filter_conflict(spec.label_smoothing, spec.softcap)
    if conflict:
        raise ValueError(conflict)
    return float(beta)


def site_grad_filter(label_smoothing, softcap) -> float | None:
    """CCE_GRAD_FILTER for a graph site with these options, unless they conflict with it."""
    beta = config.get().grad_filter
    return None if beta is None or grad_filter_conflict(label_smoothing, softcap) else beta


def filters(grad_filter: float | None, mode: str, needs_any: bool) -> bool:
    """Does a call filter its gradients (and return the mask)? Asked for, lean mode,
    gradients wanted. The op's fake kernel and its implementation both ask this."""
    return grad_filter is not None and mode == "lean" and needs_any


# --- problem, budget and mode ----------------------------------------------------------------


def problem_of(
    hidden: Tensor, classifier: Tensor, shift: int, compute, *, vocab: int | None = None
) -> policy.Problem:
    """``policy.problem`` of a call's tensors: hidden (..., T, D), its rows shortened by
    ``shift``, rounded to ``compute`` (None: hidden's dtype, which every input has); ``vocab``:
    the classes to plan for where not the classifier's (a rank's shard: ``shard_vocab``)."""
    leading = hidden.shape[:-1]
    rows = (math.prod(leading) // max(leading[-1], 1)) * (leading[-1] - shift) if leading else 1
    shape = (classifier.shape[0] if vocab is None else vocab, classifier.shape[1])
    dtypes = (hidden.dtype, classifier.dtype)
    logit_dtype = compute or hidden.dtype
    return policy.problem(
        rows, shape, logit_dtype, hidden.device.type, compute_dtype=compute, dtypes=dtypes
    )


def shard_vocab(vocab_size: int, ranks: int) -> int:
    """The classes the policy plans each rank's shard of a split vocabulary for: ceil(V /
    ranks), the largest shard of an even split (DTensor's ``Shard(0)``, torch.chunk), on every
    rank. Not the rank's own shard: uneven shards differ by a class, and every rank must make
    the same choices (the mode; fast mode's chunks, one collective each, from the budget)."""
    return -(-vocab_size // max(ranks, 1))


def planned_rows(rows_hint: int, symbolic: bool, upper_bound: int | None = None) -> int:
    """The rows a compiled call's mode is chosen for: its example's, or, where the graph's row
    count is symbolic (one graph for every size), up to ``policy.SYMBOLIC_PLAN_ROWS``, at most
    ``policy.SYMBOLIC_PLAN_GROWTH`` times the example and at most ``upper_bound`` (the
    largest size the graph admits: ``mark_dynamic``'s max). The fractional budget grows with
    the rows, so a graph first traced on a small batch would keep that batch's mode (lean,
    where fast's chunks do not fit yet) at every larger size; planned far above its example, a
    small call would run fast's fixed buffers and floor chunk at many times its own budget.
    An absolute budget (CCE_MEMORY_BUDGET_MB) does not grow: there the example stands."""
    if not symbolic or config.get().memory_budget_mb is not None:
        return rows_hint
    plan = min(policy.SYMBOLIC_PLAN_ROWS, rows_hint * policy.SYMBOLIC_PLAN_GROWTH)
    if upper_bound is not None:
        plan = min(plan, upper_bound)
    return max(rows_hint, plan)


def budget_bytes(problem: policy.Problem, vocab_parallel: bool = False) -> int:
    """The extra memory the settings give this problem (policy.py; ``vocab_parallel``: each
    rank's share of a split vocabulary)."""
    settings = config.get()
    fraction = settings.memory_fraction
    return policy.budget_bytes(problem, settings.memory_budget_mb, fraction, vocab_parallel)


def mode(
    requested: str | None,
    problem: policy.Problem,
    needs: dict[str, bool],
    *,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype | None],
    reduction: str,
    grad_filter: float | None = None,
    lse_has_grad: bool = False,
    softcap: bool = False,
    entropy: bool = False,
    argmax: bool = False,
    vocab_parallel: bool = False,
    entropy_has_grad: bool = False,
    lean_metrics: tuple[str, ...] = (),
) -> str:
    """The concrete mode ('lean' or 'fast') of a call: ``requested`` (None: the configured
    mode; a requested mode is explicit: 'fast' where it cannot apply is an error), lean under
    gradient filtering, else the policy's choice for the gradients ``needs`` asks for (the op's
    grad flags, ``gradients_asked``); ``softcap`` ... ``argmax``: what a fast run would compute
    (a softcap, the entropy, the argmax), which sets its chunks' form
    (``policy.fast_needs_whole_rows``); ``vocab_parallel``: ``problem`` is each rank's share of
    a split vocabulary, with its budget (``budget_bytes``). ``dtypes``: hidden's, the
    classifier's and the bias's (None without one), the dtypes of their gradients.
    ``lse_has_grad`` / ``entropy_has_grad``: the returned lse / entropy takes a gradient (fast
    mode's buffers hold only the loss's); ``lean_metrics``: row metrics asked that only lean
    mode computes (``lean_only_metrics``)."""
    explicit = requested is not None
    if lean_metrics:
        if requested == "fast":
            raise ValueError(
                f"mode='fast' computes no {', '.join(lean_metrics)}: use mode='lean' or 'auto'"
            )
        requested = "lean"
    requested = "lean" if grad_filter is not None else requested or config.get().mode
    return policy.choose_mode(
        requested,
        reduction=reduction,
        needs_grad=any(needs.values()),
        needs_classifier=needs["grad_classifier"],
        outputs_have_grad=lse_has_grad or entropy_has_grad,
        problem=problem,
        budget=budget_bytes(problem, vocab_parallel),
        explicit=explicit,
        whole_rows=policy.fast_needs_whole_rows(softcap=softcap, entropy=entropy, argmax=argmax),
        float16_gradients=_float16_gradients(needs, dtypes),
    )


def lean_only_metrics(names) -> tuple[str, ...]:
    """Of the row metrics ``names`` (row_metrics.py), those fast mode does not compute."""
    return tuple(
        name for name in names if not row_metrics.BY_NAME[name].stats <= policy.FAST_EXTRA_STATS
    )


def _float16_gradients(needs: dict[str, bool], dtypes: tuple) -> bool:
    """Is a gradient the call returns float16 (``policy.FLOAT16_FAST``)? Each comes in its
    input's dtype, whatever the compute dtype."""
    flags = ("grad_hidden", "grad_classifier", "grad_bias")
    return any(needs[flag] and dtype == torch.float16 for flag, dtype in zip(flags, dtypes))


def operand_dtypes(hidden, classifier, bias) -> tuple:
    """``mode``'s ``dtypes`` of a call's hidden, classifier and bias (tensors or example
    values; bias may be None)."""
    return hidden.dtype, classifier.dtype, None if bias is None else bias.dtype


def gradients_asked(hidden: Tensor, classifier: Tensor, bias: Tensor | None) -> dict[str, bool]:
    """The op's grad flags for a call: the head's inputs that require grad, in grad mode."""
    grad_on = torch.is_grad_enabled()
    return dict(
        grad_hidden=grad_on and hidden.requires_grad,
        grad_classifier=grad_on and classifier.requires_grad,
        grad_bias=grad_on and bias is not None and bias.requires_grad,
    )


def op_inputs(tensors, compute: torch.dtype | None) -> dict:
    """The op's tensor arguments, by name, from (hidden, classifier, targets, bias,
    class_weights) in the ops' canonical form, and the compute dtype."""
    names = ("hidden", "classifier", "targets", "bias", "class_weights")
    return dict(zip(names, tensors), compute_dtype=compute)


# --- skipping ignored rows -------------------------------------------------------------------


def compacts_ignored_rows() -> bool:
    """Does the op compact away a call's ignored rows (CCE_SKIP_IGNORED)? Not where the
    torch.compile tracing the call records CUDA graphs: compaction sizes the work by the
    targets' values (a host sync), which a recorded graph cannot do."""
    if not config.get().skip_ignored:
        return False
    return not (torch.compiler.is_compiling() and _compiled_into_cuda_graphs())


def site_compacts_ignored_rows() -> bool:
    """``compacts_ignored_rows`` for a graph the pass rewrites: not where Inductor runs it as
    CUDA graphs."""
    return config.get().skip_ignored and not _inductor_records_cuda_graphs()


def _inductor_records_cuda_graphs() -> bool:
    import torch._inductor.config as inductor_config

    return bool(inductor_config.triton.cudagraphs)


@torch.compiler.assume_constant_result
def _compiled_into_cuda_graphs() -> bool:
    """Does the torch.compile tracing this call record CUDA graphs (mode "reduce-overhead" or
    "max-autotune", or Inductor's ``triton.cudagraphs``)? Dynamo calls this at trace time (its
    backend is known then); outside Dynamo, False."""
    if _inductor_records_cuda_graphs():
        return True
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        backend = InstructionTranslator.current_tx().output.compiler_fn
    except Exception:  # not tracing, or a torch without these internals
        return False
    while backend is not None:  # through Dynamo's debug and torch.compile's wrappers
        if _backend_records_cuda_graphs(backend):
            return True
        backend = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(
            backend, "compiler_fn", None
        )
    return False


def _backend_records_cuda_graphs(backend) -> bool:
    """Does this layer of a torch.compile backend ask Inductor for CUDA graphs?"""
    if hasattr(backend, "get_compiler_config"):  # the default backend, with its mode
        if (backend.get_compiler_config() or {}).get("triton.cudagraphs"):
            return True
    kwargs = getattr(backend, "kwargs", None) or {}  # a named backend given mode/options
    options = dict(kwargs.get("options") or {})
    if kwargs.get("mode"):
        options.update(torch._inductor.list_mode_options(kwargs["mode"]))
    return bool(options.get("triton.cudagraphs"))


# --- the op's autograd formula, or PyTorch's -------------------------------------------------


@torch.compiler.assume_constant_result
def transform_route(*present: Tensor) -> str:
    """A functorch transform or forward-mode AD around these tensors ('' if none). Dynamo
    cannot trace these queries; it calls this at trace time instead (its guards on the
    functorch stack keep the answer valid), so torch.compile(torch.func.grad(f)) takes the
    same route as eager and a plain compile has no graph break."""
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in present):
        return "a functorch transform (torch.func.grad / jvp / vjp / jacrev / vmap)"
    if any(torch.autograd.forward_ad.unpack_dual(t).tangent is not None for t in present):
        return "forward-mode AD (dual tensors)"
    return ""


def route(tensors, logit_scale, softcap) -> str | None:
    """Why the op's own autograd formula cannot serve this call (PyTorch's autograd over
    chunked logits then does: ``autograd_fallback``), or None if it can."""
    grad_on = torch.is_grad_enabled()
    if any(isinstance(v, Tensor) and v.requires_grad and grad_on for v in (logit_scale, softcap)):
        return "a logit_scale or softcap tensor that requires grad"
    if torch.compiler.is_compiling() and any(isinstance(v, Tensor) for v in (logit_scale, softcap)):
        # Reading it as the op's float would be a data-dependent host read in the graph.
        return "a logit_scale or softcap tensor under torch.compile"
    present = [t for t in (*tensors, logit_scale, softcap) if isinstance(t, Tensor)]
    return transform_route(*present) or None
