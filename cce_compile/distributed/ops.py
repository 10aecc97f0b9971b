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

from ..op import versioning
from ..op.custom_ops import (
    define,
    differentiate,
    row_index_fake,
    row_index_output,
    row_shape,
    save_context,
    saved_by_name,
)
from ..op.signature import LOSS_OPTIONS
from . import vocab_parallel
from .signature import BACKWARD, FORWARD, FORWARD_RETURNS

# The single-device op's version and this package's sources: a compiled graph from another
# cce_compile misses the caches or fails loudly (see ``versioning``).
IMPLEMENTATION_VERSION = versioning.source_hash(
    sorted(pathlib.Path(__file__).parent.glob("*.py")),
    seed=str(versioning.IMPLEMENTATION_VERSION).encode(),
)


def _forward(*values) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, lse, row_index): float32 loss a scalar or (B, T - shift) for 'none', lse
    (B, T - shift); ``row_index`` as the single-device op's (``ops._forward``)."""
    args = FORWARD.bind(values)
    out = vocab_parallel.forward(args)
    rows = row_shape(args.hidden, args.shift)
    return FORWARD_RETURNS.pack(
        loss=out.loss.view(rows) if args.reduction == "none" else out.loss,
        lse=out.lse.view(rows),
        row_index=row_index_output(out.row_index, args.hidden),
    )


def _forward_fake(*values) -> tuple[Tensor, Tensor, Tensor]:
    args = FORWARD.bind(values)
    rows = row_shape(args.hidden, args.shift)
    f32 = torch.float32
    loss_shape = rows if args.reduction == "none" else ()
    return FORWARD_RETURNS.pack(
        loss=args.hidden.new_empty(loss_shape, dtype=f32),
        lse=args.hidden.new_empty(rows, dtype=f32),
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
    ctx.mark_non_differentiable(out.row_index)
    ctx.passed_on = args.pick(_PASSED_ON)
    save_context(ctx, args, lse=out.lse, row_index=out.row_index)


def _backward(ctx, grad_loss, grad_lse, _grad_row_index):
    # Every rank runs this backward (SPMD), so the hidden gradient's all-reduce inside is
    # issued by all of them or, where hidden needs no gradient, by none.
    backward_op = torch.ops.cce.vocab_parallel_cross_entropy_backward
    signatures = (FORWARD, BACKWARD)
    return differentiate(ctx, signatures, backward_op, grad_loss, grad_lse, saved_by_name(ctx))


vocab_parallel_cross_entropy.register_autograd(_backward, setup_context=_setup_context)
