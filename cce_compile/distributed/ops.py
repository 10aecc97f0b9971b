"""The vocabulary-parallel custom ops: ``torch.ops.cce.vocab_parallel_cross_entropy`` and its
backward ``torch.ops.cce.vocab_parallel_cross_entropy_backward``.

Both run their collectives inside (``collectives``), so torch.compile sees one opaque node per
op and traces them with ``fullgraph=True`` (fake kernels below; no host synchronisation). The
argument lists live in ``signature``; the math in ``vocab_parallel``. Every rank of the group
must call the ops with the same hidden states, targets and options (SPMD), as for any
collective.

The autograd formula is the single-device op's (``op.custom_ops``' shared helpers): lean mode
recomputes through the backward op; fast mode's forward returns the gradients for a unit
upstream gradient, and the backward scales the classifier's and bias's in place and hands them
out, while hidden's goes through the backward op (``fast_grad_hidden``), which scales it and,
with ``reduce_hidden_grad``, all-reduces it in float32 before its one rounding: the one
collective of a fast backward, issued at run time inside the op like the lean backward's.
"""

from __future__ import annotations

import pathlib

import torch
from torch import Tensor

from ..op import versioning
from ..op.custom_ops import (
    claim_fast_buffers,
    define,
    differentiate,
    fast_filled,
    fast_outputs,
    fast_outputs_fake,
    requested_gradients,
    returned_gradients,
    row_index_fake,
    row_index_output,
    row_shape,
    save_context,
    saved_by_name,
)
from ..op.dispatch import scale_gradient_
from ..op.signature import FAST_BUFFERS, GRAD_FLAGS, LOSS_OPTIONS
from . import vocab_parallel
from .signature import BACKWARD, FORWARD, FORWARD_RETURNS

# The single-device op's version and this package's sources: a compiled graph from another
# cce_compile misses the caches or fails loudly (see ``versioning``).
IMPLEMENTATION_VERSION = versioning.source_hash(
    sorted(pathlib.Path(__file__).parent.glob("*.py")),
    seed=str(versioning.IMPLEMENTATION_VERSION).encode(),
)


def _forward(*values) -> tuple[Tensor, ...]:
    """(loss, lse, fast_grad_hidden, fast_grad_classifier, fast_grad_bias, row_index): float32
    loss a scalar or (B, T - shift) for 'none', lse (B, T - shift); the fast buffers as
    ``signature.FORWARD_RETURNS`` says; ``row_index`` as the single-device op's."""
    args = FORWARD.bind(values)
    out = vocab_parallel.forward(args)
    rows = row_shape(args.hidden, args.shift)
    return FORWARD_RETURNS.pack(
        loss=out.loss.view(rows) if args.reduction == "none" else out.loss,
        lse=out.lse.view(rows),
        **fast_outputs(out, args),
        row_index=row_index_output(out.row_index, args.hidden),
    )


def _forward_fake(*values) -> tuple[Tensor, ...]:
    args = FORWARD.bind(values)
    rows = row_shape(args.hidden, args.shift)
    f32 = torch.float32
    loss_shape = rows if args.reduction == "none" else ()
    return FORWARD_RETURNS.pack(
        loss=args.hidden.new_empty(loss_shape, dtype=f32),
        lse=args.hidden.new_empty(rows, dtype=f32),
        **fast_outputs_fake(args, vocab_parallel.hidden_buffer_dtype(args)),
        row_index=row_index_fake(args, args.hidden),
    )


vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward = define(
    "vocab_parallel_cross_entropy",
    (FORWARD, FORWARD_RETURNS, BACKWARD),
    (_forward, _forward_fake, vocab_parallel.backward),
)

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
    out = FORWARD_RETURNS.unpack(output)
    buffers = {name: getattr(out, name) for name in FAST_BUFFERS.values()}
    ctx.mark_non_differentiable(out.row_index, *buffers.values())
    ctx.passed_on = args.pick(_PASSED_ON)
    ctx.fast_held = fast_filled(args)
    save_context(ctx, args, lse=out.lse, row_index=out.row_index, **buffers)


def _backward(ctx, grad_loss, grad_lse, *_unused):
    # Every rank runs this backward (SPMD), so the hidden gradient's all-reduce inside the
    # backward op is issued by all of them or, where hidden needs no gradient, by none.
    saved = saved_by_name(ctx)
    buffers = {flag: saved.pop(name) for flag, name in FAST_BUFFERS.items()}
    backward_op = torch.ops.cce.vocab_parallel_cross_entropy_backward
    # A gradient of the returned lse: recomputed whole, so that hidden's is reduced once.
    wanted = None if grad_lse is not None else claim_fast_buffers(ctx, FORWARD, grad_loss)
    if wanted is None:  # lean, or fast's buffers already handed out: recompute
        return differentiate(ctx, (FORWARD, BACKWARD), backward_op, grad_loss, grad_lse, saved)
    grads = {
        flag: scale_gradient_(buffers[flag], grad_loss) for flag in wanted if flag != "grad_hidden"
    }
    if "grad_hidden" in wanted:  # scaled (and reduced) by the backward op
        flags = dict.fromkeys(GRAD_FLAGS, False) | {"grad_hidden": True}
        fast = dict(grad_loss=grad_loss, grad_lse=None, fast_grad_hidden=buffers["grad_hidden"])
        arguments = dict(**fast, **saved, **flags, **ctx.passed_on)
        grads["grad_hidden"], _, _ = backward_op(*BACKWARD.build(**arguments))
    taken = tuple(grads.get(flag) for flag in GRAD_FLAGS)
    return returned_gradients(FORWARD, requested_gradients(ctx, FORWARD), taken)


vocab_parallel_cross_entropy.register_autograd(_backward, setup_context=_setup_context)
