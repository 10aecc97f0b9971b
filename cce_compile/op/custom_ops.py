"""The ``cce`` custom ops: what the graph pass inserts and the public function calls.

``torch.ops.cce.linear_cross_entropy`` computes the loss (and per-row lse) from ``hidden``
(B, T, D), ``classifier`` (V, D) and ``targets`` (B, T) without materialising the logits; its
backward is the op ``torch.ops.cce.linear_cross_entropy_backward``. Both have fake kernels, so
they trace under torch.compile with static or dynamic shapes, and neither synchronises with the
host. In "fast" mode the forward also returns the gradients for a unit upstream gradient, which
the backward only scales.

The argument lists live in ``signature``; the real kernels hand their bound arguments to
``dispatch``. This module only registers the ops and their autograd formula.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import filtering, row_metrics
from . import dispatch, versioning
from .signature import (
    BACKWARD,
    BACKWARD_RETURNS,
    FAST_BUFFERS,
    FORWARD,
    FORWARD_RETURNS,
    GRAD_FLAGS,
    LOSS_OPTIONS,
)

IMPLEMENTATION_VERSION = versioning.IMPLEMENTATION_VERSION
_EMPTY = (0,)


def empty_output(like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The placeholder for an output that is not computed (ops return no None)."""
    return like.new_empty(_EMPTY, dtype=dtype)


def row_shape(hidden: Tensor, shift: int) -> tuple:
    return (hidden.shape[0], hidden.shape[1] - shift)


# What both ops (this one and distributed.ops's vocabulary-parallel one) share: the rows the
# forward computed on, the backward op's outputs, which gradients a backward asks for, and
# the refusal of double backward.


def row_index_output(row_index: Tensor | None, hidden: Tensor) -> Tensor:
    """The forward's ``row_index`` output (compaction.py), empty without ``skip_ignored``."""
    return row_index if row_index is not None else empty_output(hidden, torch.int64)


def row_index_fake(args, hidden: Tensor) -> Tensor:
    """The fake ``row_index``: its size depends on the targets' values."""
    if not args.skip_ignored:
        return empty_output(hidden, torch.int64)
    return hidden.new_empty((_rows_kept_size(),), dtype=torch.int64)


def fast_outputs(out, args) -> dict[str, Tensor]:
    """Fast mode's buffers (``out``: the forward's ``ForwardOut``) as the op's outputs, by
    name: each gradient for a unit upstream gradient, empty where not computed."""
    hidden, classifier = args.hidden, args.classifier
    bias_like = classifier if args.bias is None else args.bias
    grads = (out.grad_hidden, out.grad_classifier, out.grad_bias)
    likes = (hidden, classifier, bias_like)
    return {name: or_empty(g, like) for name, g, like in zip(FAST_BUFFERS.values(), grads, likes)}


def fast_outputs_fake(args, hidden_dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The fake ``fast_outputs``: shaped like their inputs where fast mode fills them
    (``hidden_dtype``: the hidden buffer's, where it is not hidden's own)."""
    hidden, classifier, bias = args.hidden, args.classifier, args.bias
    filled = fast_filled(args)
    hidden_filled = "grad_hidden" in filled  # (an empty placeholder is in hidden's dtype)
    return {
        FAST_BUFFERS["grad_hidden"]: like_if(
            hidden_filled, hidden, dtype=hidden_dtype if hidden_filled else None
        ),
        FAST_BUFFERS["grad_classifier"]: like_if("grad_classifier" in filled, classifier),
        FAST_BUFFERS["grad_bias"]: like_if("grad_bias" in filled, bias, classifier),
    }


def fast_filled(args) -> set[str]:
    """The gradient flags whose fast-mode buffers the forward fills: static flags, not sizes
    (no guards). The autograd formula hands each out once (``claim_fast_buffers``)."""
    if args.mode != "fast":
        return set()
    filled = (args.grad_hidden, args.grad_classifier, args.grad_bias and args.bias is not None)
    return {flag for flag, is_filled in zip(GRAD_FLAGS, filled) if is_filled}


def claim_fast_buffers(ctx, forward, grad_loss) -> list[str] | None:
    """The gradient flags this backward asks for, whose fast-mode buffers it now hands out
    (``ctx.fast_held``, from ``fast_filled``, forgets them); None where it must recompute
    instead: lean mode, a buffer not filled or already handed out, no loss gradient, or
    create_graph.

    Handed out, a buffer belongs to autograd (it may keep it as ``.grad`` and add into it), so
    a second backward through the same graph (``retain_graph=True``) recomputes it, lean
    mode's way. Under torch.compile this Python runs once, at tracing: the compiled backward
    scales the saved buffer out of place, or in place where Inductor may reuse a donated one
    (and PyTorch refuses a retained backward of a graph that donates buffers)."""
    wanted = [flag for flag, needed in requested_gradients(ctx, forward).items() if needed]
    if grad_loss is None or not wanted or not ctx.fast_held.issuperset(wanted):
        return None
    if torch.is_grad_enabled() and type(grad_loss) is Tensor:
        # create_graph=True, eagerly: the backward op's gradients carry the clear refusal of
        # a backward through them (refuse_double_backward); buffers would carry no graph.
        # (AOTAutograd traces every backward with grad enabled: it refuses double backward.)
        return None
    ctx.fast_held.difference_update(wanted)
    return wanted


def gradient_outputs(grads, args) -> tuple[Tensor, Tensor, Tensor]:
    """A backward op's outputs: the gradients, empty placeholders where none was asked for."""
    likes = (args.hidden, args.classifier, args.classifier)
    return tuple(g if g is not None else empty_output(like) for g, like in zip(grads, likes))


def gradient_outputs_fake(args) -> tuple[Tensor, Tensor, Tensor]:
    hidden, classifier, bias = args.hidden, args.classifier, args.bias
    return (
        hidden.new_empty(hidden.shape) if args.grad_hidden else empty_output(hidden),
        classifier.new_empty(classifier.shape)
        if args.grad_classifier
        else empty_output(classifier),
        bias.new_empty(bias.shape) if args.grad_bias and bias is not None else empty_output(hidden),
    )


def requested_gradients(ctx, forward) -> dict[str, bool]:
    """Which of hidden, classifier and bias the backward must differentiate (by name);
    a class-weights gradient is PyTorch's error, as in F.cross_entropy."""
    needed = dict(zip(forward.names, ctx.needs_input_grad))
    if needed["class_weights"]:
        raise RuntimeError(
            "the derivative for 'class_weights' is not implemented (as in F.cross_entropy)"
        )
    return dict(
        grad_hidden=needed["hidden"],
        grad_classifier=needed["classifier"],
        grad_bias=ctx.has_bias and needed["bias"],
    )


def save_context(ctx, args, *, lse: Tensor, row_index: Tensor, **extra: Tensor | None) -> None:
    """What both ops' setup_context record alike: the inputs, lse and row_index saved by the
    backward op's argument names (``extra``: an op's own), and the flags their backward reads."""
    # Unused outputs get None, not zeros: the backward then knows statically that lse carries
    # no gradient, and skips work for it.
    ctx.set_materialize_grads(False)
    ctx.has_bias = args.bias is not None
    ctx.skip_ignored = args.skip_ignored
    names = ("hidden", "classifier", "targets", "bias", "class_weights")
    tensors = dict(args.pick(names), lse=lse, row_index=row_index, **extra)
    ctx.saved_names = tuple(tensors)
    ctx.save_for_backward(*tensors.values())


def saved_by_name(ctx) -> dict[str, Tensor | None]:
    """The tensors ``save_context`` saved, by name; no row_index where no rows were skipped."""
    saved = dict(zip(ctx.saved_names, ctx.saved_tensors))
    if not ctx.skip_ignored:
        saved["row_index"] = None
    return saved


def differentiate(
    ctx, signatures, backward_op, grad_loss, grad_lse, saved: dict, **row_grads
) -> tuple:
    """The autograd formula shared by both ops: their backward op on the ``saved`` tensors
    (by argument name), its gradients returned where requested; signatures: the (forward,
    backward) pair; ``row_grads``: the gradients of other differentiable outputs, by the
    backward op's argument names (``grad_entropy``)."""
    forward, backward = signatures
    requested = requested_gradients(ctx, forward)
    row_grads = {name: g for name, g in row_grads.items() if g is not None}
    if grad_loss is None and grad_lse is None and not row_grads:
        return forward.gradients()
    arguments = dict(
        grad_loss=grad_loss,
        grad_lse=grad_lse,
        **row_grads,
        **saved,
        **requested,
        **ctx.passed_on,
    )
    grads = backward_op(*backward.build(**arguments))
    return returned_gradients(forward, requested, grads)


def returned_gradients(forward, requested: dict[str, bool], grads) -> tuple:
    """The autograd formula's return value: the computed gradients where requested."""
    grad_h, grad_c, grad_b = grads
    return forward.gradients(
        hidden=grad_h if requested["grad_hidden"] else None,
        classifier=grad_c if requested["grad_classifier"] else None,
        bias=grad_b if requested["grad_bias"] else None,
    )


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "cce_compile.linear_cross_entropy does not support double backward (create_graph=True "
        "followed by a backward through the gradients, e.g. a gradient penalty): compute that "
        "loss with F.cross_entropy(F.linear(hidden, classifier), targets) instead"
    )


def refuse_double_backward(backward_op) -> None:
    """A clear error for a backward through the gradients. Without it, PyTorch's generic "no
    autograd formula was registered" error would name our backward op rather than what the
    user did."""
    backward_op.register_autograd(
        _no_double_backward, setup_context=lambda ctx, inputs, output: None
    )


def _forward(*values) -> tuple[Tensor, ...]:
    """Returns (loss, lse, fast_grad_hidden, fast_grad_classifier, fast_grad_bias,
    keep_blocks, row_index, *the row metrics) (row_metrics.METRICS: entropy, argmax,
    log_sum_sq_probs, mean_logits).

    ``loss`` is float32, a scalar or (B, T - shift) for reduction 'none'; ``lse`` is float32
    (B, T - shift) (0 at ignored rows unless ``lse_all_rows``). In mode 'fast' the three
    ``fast_*`` are d loss / d input for a unit upstream gradient, each in its input's own dtype,
    where requested, else empty; in mode 'lean' they are always empty. The backward scales
    them in place and returns them as the gradients (``_backward``): the classifier's gradient
    is the only V x D tensor fast mode makes. ``keep_blocks`` is gradient filtering's
    (N, blocks) uint8 mask, else empty.
    ``row_index`` (int64) is, with ``skip_ignored``, the loss rows the forward computed on
    (all N of them when it skipped none: compaction.py), else empty; its size depends on the
    targets' values. Each row metric, shaped like ``lse`` in its own dtype, with its
    ``return_<name>`` flag: its value per row (its ``ignored_value`` at ignored rows), else
    empty; only the entropy carries a gradient.
    """
    args = FORWARD.bind(values)
    out = dispatch.forward(args)
    hidden, classifier = args.hidden, args.classifier
    rows = row_shape(hidden, args.shift)
    return FORWARD_RETURNS.pack(
        loss=out.loss.view(rows) if args.reduction == "none" else out.loss,
        lse=out.lse.view(rows),
        **fast_outputs(out, args),
        keep_blocks=or_empty(out.keep_blocks, classifier, torch.uint8),
        row_index=row_index_output(out.row_index, hidden),
        **{
            m.name: or_empty(out.metrics.get(m.name), hidden, m.dtype, rows)
            for m in row_metrics.METRICS
        },
    )


def or_empty(value: Tensor | None, like: Tensor, dtype=None, shape=None) -> Tensor:
    """An output: ``value`` (viewed as ``shape``), or an empty placeholder like ``like``."""
    if value is None:
        return empty_output(like, dtype)
    return value if shape is None else value.view(shape)


def _rows_kept_size() -> torch.SymInt:
    """The size of ``row_index`` in a fake kernel: a new unbacked (data-dependent) size.

    ``ctx.new_dynamic_size()`` refuses unless Dynamo captures data-dependent output shapes
    (fullgraph=True or capture_dynamic_output_shape_ops), because for an op in user code the
    alternative is a graph break. Nothing but our own backward reads this size, so the op
    stays in the graph either way: the symbol is made directly, as PyTorch's device-mesh op
    does for its data-dependent coordinate.
    """
    from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

    shape_env = getattr(torch.library.get_ctx(), "_shape_env", None)
    if shape_env is None:  # not under torch.compile's fake mode: PyTorch's own error
        return torch.library.get_ctx().new_dynamic_size()
    size = shape_env.create_unbacked_symint()
    _constrain_range_for_size(size, min=0)
    return size


def _forward_fake(*values):
    args = FORWARD.bind(values)
    hidden, classifier = args.hidden, args.classifier
    rows = row_shape(hidden, args.shift)
    f32 = torch.float32
    filtered_rows = (rows[0] * rows[1], filtering.block_count(classifier.shape[0]))
    return FORWARD_RETURNS.pack(
        loss=hidden.new_empty(rows if args.reduction == "none" else (), dtype=f32),
        lse=hidden.new_empty(rows, dtype=f32),
        **fast_outputs_fake(args),
        keep_blocks=like_if(
            dispatch.filters(args), classifier, shape=filtered_rows, dtype=torch.uint8
        ),
        row_index=row_index_fake(args, hidden),
        **{
            m.name: like_if(getattr(args, m.flag), hidden, shape=rows, dtype=m.dtype)
            for m in row_metrics.METRICS
        },
    )


def like_if(computed: bool, like: Tensor | None, fallback=None, *, shape=None, dtype=None):
    """A fake output: shaped like ``like`` (or ``shape``) where it is computed, else empty."""
    if not computed:
        return empty_output(like if like is not None else fallback, dtype)
    return like.new_empty(like.shape if shape is None else shape, dtype=dtype)


def define(name: str, signatures: tuple, implementations: tuple) -> tuple:
    """Register an op ``cce::<name>`` and its backward op ``cce::<name>_backward``; returns
    both. ``signatures``: (forward signature, forward returns, backward signature);
    ``implementations``: (forward, forward fake, gradients), the backward op's kernel computing
    ``gradients(bound arguments)``, empty where not asked for. The caller registers the
    forward's autograd formula; a backward through the backward op is refused
    (``refuse_double_backward``)."""
    forward_signature, forward_returns, backward_signature = signatures
    forward, forward_fake, gradients = implementations
    op = torch.library.custom_op(
        f"cce::{name}", forward, mutates_args=(), schema=forward_signature.schema(forward_returns)
    )
    op.register_fake(forward_fake)

    def backward_op(*values) -> tuple[Tensor, Tensor, Tensor]:
        args = backward_signature.bind(values)
        return gradient_outputs(gradients(args), args)

    backward = torch.library.custom_op(
        f"cce::{name}_backward",
        backward_op,
        mutates_args=(),
        schema=backward_signature.schema(BACKWARD_RETURNS),
    )
    backward.register_fake(lambda *values: gradient_outputs_fake(backward_signature.bind(values)))
    refuse_double_backward(backward)
    return op, backward


linear_cross_entropy, linear_cross_entropy_backward = define(
    "linear_cross_entropy",
    (FORWARD, FORWARD_RETURNS, BACKWARD),
    (_forward, _forward_fake, dispatch.backward),
)

_PASSED_ON = ("compute_dtype", *LOSS_OPTIONS, "lse_all_rows", "metrics_all_rows")  # to backward


def _setup_context(ctx, inputs, output) -> None:
    args = FORWARD.bind(inputs)
    versioning.check(args.implementation_version)
    out = FORWARD_RETURNS.unpack(output)
    buffers = {name: getattr(out, name) for name in FAST_BUFFERS.values()}
    # The entropy carries a gradient where it was asked for; the other metrics are metrics.
    no_gradient = [
        getattr(out, m.name)
        for m in row_metrics.METRICS
        if not (m.differentiable and getattr(args, m.flag))
    ]
    ctx.mark_non_differentiable(*buffers.values(), out.keep_blocks, out.row_index, *no_gradient)
    ctx.filtered = dispatch.filters(args)
    ctx.passed_on = args.pick(_PASSED_ON)
    ctx.fast_held = fast_filled(args)
    entropy = out.entropy if args.return_entropy else None
    save_context(
        ctx,
        args,
        lse=out.lse,
        row_index=out.row_index,
        keep_blocks=out.keep_blocks,
        entropy=entropy,
        **buffers,
    )


def _backward(ctx, grad_loss, grad_lse, *other_grads):
    saved = saved_by_name(ctx)
    buffers = {flag: saved.pop(name) for flag, name in FAST_BUFFERS.items()}
    if not ctx.filtered:
        saved["keep_blocks"] = None
    grad_entropy = FORWARD_RETURNS.unpack((grad_loss, grad_lse, *other_grads)).entropy
    backward_op = torch.ops.cce.linear_cross_entropy_backward
    signatures = (FORWARD, BACKWARD)
    taken = _take_fast_gradients(ctx, grad_loss, buffers)
    if taken is None:  # lean, or fast's gradients already handed out: recompute
        return differentiate(
            ctx, signatures, backward_op, grad_loss, grad_lse, saved, grad_entropy=grad_entropy
        )
    grads = returned_gradients(FORWARD, requested_gradients(ctx, FORWARD), taken)
    if grad_lse is None and grad_entropy is None:
        return grads
    # The lse's and entropy's parts, recomputed (the buffers hold the loss's alone).
    rest = differentiate(
        ctx, signatures, backward_op, None, grad_lse, saved, grad_entropy=grad_entropy
    )
    return tuple(_sum(g, extra) for g, extra in zip(grads, rest))


def _take_fast_gradients(ctx, grad_loss, buffers: dict) -> tuple | None:
    """Fast mode's buffers of the gradients this backward asks for, scaled in place by the
    upstream gradient (``dispatch.scale_gradient_``) and handed to autograd as the gradients
    (no copy: the classifier's gradient is the only V x D tensor); None where the backward
    recomputes instead (``claim_fast_buffers``)."""
    wanted = claim_fast_buffers(ctx, FORWARD, grad_loss)
    if wanted is None:
        return None
    scaled = {flag: dispatch.scale_gradient_(buffers[flag], grad_loss) for flag in wanted}
    return tuple(scaled.get(flag) for flag in GRAD_FLAGS)


def _sum(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    return b if a is None else a if b is None else a + b


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)
