"""The vocabulary-parallel custom ops: ``torch.ops.cce.vocab_parallel_cross_entropy`` and its
backward ``torch.ops.cce.vocab_parallel_cross_entropy_backward``.

Both run their collectives inside (``collectives``), so torch.compile sees one opaque node per
op and traces them with ``fullgraph=True`` (fake kernels below; no host synchronisation). The
argument lists live in ``signature``; the math in ``vocab_parallel``. Every rank of the group
must call the ops with the same hidden states, targets and options (SPMD), as for any
collective.
"""

from __future__ import annotations

import pathlib

import torch
from torch import Tensor

from .. import versioning
from ..op_signature import LOSS_OPTIONS
from ..ops import empty_output, row_shape
from . import vocab_parallel
from .signature import BACKWARD, BACKWARD_RETURNS, FORWARD, FORWARD_RETURNS

# The single-device op's version and this package's sources: a compiled graph from another
# cce_compile misses the caches or fails loudly (see ``versioning``).
IMPLEMENTATION_VERSION = versioning.source_hash(
    sorted(pathlib.Path(__file__).parent.glob("*.py")),
    seed=str(versioning.IMPLEMENTATION_VERSION).encode(),
)


def _forward(*values) -> tuple[Tensor, Tensor]:
    """(loss, lse): float32; loss a scalar or (B, T - shift) for 'none', lse (B, T - shift)."""
    args = FORWARD.bind(values)
    loss, lse = vocab_parallel.forward(args)
    rows = row_shape(args.hidden, args.shift)
    return (loss.view(rows) if args.reduction == "none" else loss), lse.view(rows)


def _forward_fake(*values) -> tuple[Tensor, Tensor]:
    args = FORWARD.bind(values)
    rows = row_shape(args.hidden, args.shift)
    f32 = torch.float32
    loss_shape = rows if args.reduction == "none" else ()
    return args.hidden.new_empty(loss_shape, dtype=f32), args.hidden.new_empty(rows, dtype=f32)


def _backward_op(*values) -> tuple[Tensor, Tensor, Tensor]:
    args = BACKWARD.bind(values)
    grads = vocab_parallel.backward(args)
    likes = (args.hidden, args.classifier, args.classifier)
    return tuple(g if g is not None else empty_output(like) for g, like in zip(grads, likes))


def _backward_fake(*values) -> tuple[Tensor, Tensor, Tensor]:
    args = BACKWARD.bind(values)
    hidden, classifier, bias = args.hidden, args.classifier, args.bias
    return (
        hidden.new_empty(hidden.shape) if args.grad_hidden else empty_output(hidden),
        classifier.new_empty(classifier.shape)
        if args.grad_classifier
        else empty_output(classifier),
        bias.new_empty(bias.shape)
        if args.grad_bias and bias is not None
        else empty_output(classifier),
    )


vocab_parallel_cross_entropy = torch.library.custom_op(
    "cce::vocab_parallel_cross_entropy",
    _forward,
    mutates_args=(),
    schema=FORWARD.schema(FORWARD_RETURNS),
)
vocab_parallel_cross_entropy.register_fake(_forward_fake)

vocab_parallel_cross_entropy_backward = torch.library.custom_op(
    "cce::vocab_parallel_cross_entropy_backward",
    _backward_op,
    mutates_args=(),
    schema=BACKWARD.schema(BACKWARD_RETURNS),
)
vocab_parallel_cross_entropy_backward.register_fake(_backward_fake)

# Forward -> backward, unchanged.
_PASSED_ON = (
    "compute_dtype",
    *LOSS_OPTIONS,
    "vocab_start",
    "vocab_size",
    "group_name",
    "reduce_hidden_grad",
    "lse_all_rows",
)


def check_version(version: int) -> None:
    versioning.check(
        version, expected=IMPLEMENTATION_VERSION, op="cce::vocab_parallel_cross_entropy"
    )


def _setup_context(ctx, inputs, output) -> None:
    args = FORWARD.bind(inputs)
    check_version(args.implementation_version)
    _, lse = output
    # Unused outputs get None, not zeros: the backward skips the lse's part.
    ctx.set_materialize_grads(False)
    ctx.passed_on = args.pick(_PASSED_ON)
    ctx.has_bias = args.bias is not None
    ctx.save_for_backward(
        args.hidden, args.classifier, args.targets, args.bias, args.class_weights, lse
    )


def _backward(ctx, grad_loss, grad_lse):
    hidden, classifier, targets, bias, class_weights, lse = ctx.saved_tensors
    needed = dict(zip(FORWARD.names, ctx.needs_input_grad))
    if needed["class_weights"]:
        raise RuntimeError(
            "the derivative for 'class_weights' is not implemented (as in F.cross_entropy)"
        )
    needs_h, needs_c = needed["hidden"], needed["classifier"]
    needs_b = ctx.has_bias and needed["bias"]
    if grad_loss is None and grad_lse is None:
        return FORWARD.gradients()
    # Every rank runs this backward (SPMD), so the hidden gradient's all-reduce inside is
    # issued by all of them or, where hidden needs no gradient, by none.
    grad_h, grad_c, grad_b = torch.ops.cce.vocab_parallel_cross_entropy_backward(
        *BACKWARD.build(
            grad_loss=grad_loss,
            grad_lse=grad_lse,
            hidden=hidden,
            classifier=classifier,
            targets=targets,
            bias=bias,
            class_weights=class_weights,
            lse=lse,
            grad_hidden=needs_h,
            grad_classifier=needs_c,
            grad_bias=needs_b,
            **ctx.passed_on,
        )
    )
    return FORWARD.gradients(
        hidden=grad_h if needs_h else None,
        classifier=grad_c if needs_c else None,
        bias=grad_b if needs_b else None,
    )


vocab_parallel_cross_entropy.register_autograd(_backward, setup_context=_setup_context)
