"""The ``cce`` custom ops: what the graph pass inserts and the public function calls.

``torch.ops.cce.linear_cross_entropy`` computes the loss (and per-row lse) from ``hidden``
(B, T, D), ``classifier`` (V, D) and ``targets`` (B, T) without materialising the logits; its
backward is the op ``torch.ops.cce.linear_cross_entropy_backward``. Both have fake kernels, so
they trace under torch.compile with static or dynamic shapes, and neither synchronises with the
host. In "fast" mode the forward also returns the gradients for a unit upstream gradient, which
the backward only scales.

Device dispatch: CUDA with Triton runs the kernels (``triton_path``); everything else runs the
chunked reference (``reference``). Both return the same things.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib

import torch
from torch import Tensor

from . import config, reference
from .loss_math import LossSpec, check_targets_in_range, row_targets

_EMPTY = (0,)


def _source_hash() -> int:
    """A 31-bit hash of the sources that define what the op and its backward compute."""
    package = pathlib.Path(__file__).parent
    files = [
        package / name for name in ("ops.py", "loss_math.py", "reference.py", "triton_path.py")
    ]
    files += sorted((package / "kernels").glob("*.py"))
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.read_bytes())
    return int.from_bytes(digest.digest()[:4], "little") & 0x7FFFFFFF


# Passed as the op's last argument by every caller. PyTorch's AOTAutograd and FX graph caches
# key a custom op by its name and arguments only, not by its autograd formula: with this
# number in the graph, an upgrade of cce_compile misses the cache instead of replaying a
# backward graph traced from old code.
IMPLEMENTATION_VERSION = _source_hash()


def _spec(ignore_index, reduction, label_smoothing, softcap, logit_scale, shift, z_loss):
    return LossSpec(ignore_index, reduction, label_smoothing, softcap, logit_scale, shift, z_loss)


@functools.cache
def _triton_path():
    """The Triton implementation, or None where Triton cannot run."""
    try:
        from . import triton_path
    except ImportError:
        return None
    return triton_path if triton_path.available() else None


def _implementation(device: torch.device):
    if device.type == "cuda":
        impl = _triton_path()
        if impl is not None:
            return impl
    return reference


def _check_targets(targets, class_weights, spec, vocab) -> None:
    """PyTorch's error for out-of-range targets, where checking costs no device sync."""
    if targets.device.type == "cpu" or config.get().check_targets:
        check_targets_in_range(row_targets(targets, class_weights, spec, vocab), vocab)


def _budget_bytes() -> int:
    return config.get().memory_budget_mb * 2**20


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(_EMPTY)


def _empty_f32(like: Tensor) -> Tensor:
    return like.new_empty(_EMPTY, dtype=torch.float32)


def _row_shape(hidden: Tensor, shift: int) -> tuple:
    return (hidden.shape[0], hidden.shape[1] - shift)


@torch.library.custom_op("cce::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: Tensor,
    classifier: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    class_weights: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: float,
    logit_scale: float,
    shift: int,
    z_loss: float,
    lse_all_rows: bool,
    mode: str,
    grad_hidden: bool,
    grad_classifier: bool,
    grad_bias: bool,
    implementation_version: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (loss, lse, fast_grad_hidden, fast_grad_classifier, fast_grad_bias).

    ``loss`` is float32, a scalar or (B, T - shift) for reduction 'none'; ``lse`` is float32
    (B, T - shift) (0 at ignored rows unless ``lse_all_rows``). In mode 'fast' the last three
    are d loss / d input for a unit upstream gradient (hidden's dtype for hidden, float32 for
    classifier and bias) where requested, else empty; in mode 'lean' they are always empty.
    """
    spec = _spec(ignore_index, reduction, label_smoothing, softcap, logit_scale, shift, z_loss)
    _check_targets(targets, class_weights, spec, classifier.shape[0])
    fast = mode == "fast"
    needs = reference.Needs(grad_hidden, grad_classifier, grad_bias and bias is not None)
    out = _implementation(hidden.device).forward(
        hidden,
        classifier,
        targets,
        bias,
        class_weights,
        spec,
        lse_all_rows=lse_all_rows,
        fast=fast,
        needs=needs,
        budget_bytes=_budget_bytes(),
    )
    rows = _row_shape(hidden, shift)
    loss = out.loss.view(rows) if reduction == "none" else out.loss
    grads = (
        out.grad_hidden if out.grad_hidden is not None else _empty(hidden),
        out.grad_classifier if out.grad_classifier is not None else _empty_f32(classifier),
        out.grad_bias if out.grad_bias is not None else _empty_f32(classifier),
    )
    return loss, out.lse.view(rows), *grads


@linear_cross_entropy.register_fake
def _(
    hidden,
    classifier,
    targets,
    bias,
    class_weights,
    ignore_index,
    reduction,
    label_smoothing,
    softcap,
    logit_scale,
    shift,
    z_loss,
    lse_all_rows,
    mode,
    grad_hidden,
    grad_classifier,
    grad_bias,
    implementation_version,
):
    rows = _row_shape(hidden, shift)
    f32 = torch.float32
    loss = hidden.new_empty(rows if reduction == "none" else (), dtype=f32)
    lse = hidden.new_empty(rows, dtype=f32)
    fast = mode == "fast"
    grad_h = hidden.new_empty(hidden.shape) if fast and grad_hidden else _empty(hidden)
    grad_c = (
        classifier.new_empty(classifier.shape, dtype=f32)
        if fast and grad_classifier
        else _empty_f32(classifier)
    )
    has_bias_grad = fast and grad_bias and bias is not None
    grad_b = classifier.new_empty(bias.shape if has_bias_grad else _EMPTY, dtype=f32)
    return loss, lse, grad_h, grad_c, grad_b


@torch.library.custom_op("cce::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad_loss: Tensor | None,
    grad_lse: Tensor | None,
    hidden: Tensor,
    classifier: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    class_weights: Tensor | None,
    lse: Tensor,
    fast_grad_hidden: Tensor | None,
    fast_grad_classifier: Tensor | None,
    fast_grad_bias: Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: float,
    logit_scale: float,
    shift: int,
    z_loss: float,
    lse_all_rows: bool,
    grad_hidden: bool,
    grad_classifier: bool,
    grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients for (hidden, classifier, bias) in their dtypes; empty where not requested.

    With the ``fast_grad_*`` buffers (fast mode's forward), the loss's part is those buffers
    scaled by ``grad_loss``; only the lse's part, if any, is recomputed.
    """
    spec = _spec(ignore_index, reduction, label_smoothing, softcap, logit_scale, shift, z_loss)
    needs = reference.Needs(grad_hidden, grad_classifier, grad_bias and bias is not None)
    impl = _implementation(hidden.device)
    grads: list[Tensor | None] = [None, None, None]
    fast = (fast_grad_hidden, fast_grad_classifier, fast_grad_bias)
    if grad_loss is not None and any(f is not None for f in fast):
        for i, (buffer, like) in enumerate(zip(fast, (hidden, classifier, bias))):
            if buffer is not None and (needs.hidden, needs.classifier, needs.bias)[i]:
                grads[i] = impl.scale_to(buffer, grad_loss, like.dtype)
        grad_loss = None  # consumed
    if grad_loss is not None or grad_lse is not None:
        computed = impl.backward(
            grad_loss.reshape(-1) if grad_loss is not None and reduction == "none" else grad_loss,
            grad_lse.reshape(-1) if grad_lse is not None else None,
            hidden,
            classifier,
            targets,
            bias,
            class_weights,
            lse.reshape(-1),
            spec,
            lse_all_rows=lse_all_rows,
            needs=needs,
            budget_bytes=_budget_bytes(),
        )
        for i, (extra, like) in enumerate(zip(computed, (hidden, classifier, bias))):
            if extra is not None:
                extra = extra.to(like.dtype)
                grads[i] = extra if grads[i] is None else grads[i] + extra
    return (
        grads[0] if grads[0] is not None else _empty(hidden),
        grads[1] if grads[1] is not None else _empty(classifier),
        grads[2] if grads[2] is not None else _empty(classifier),
    )


@linear_cross_entropy_backward.register_fake
def _(
    grad_loss,
    grad_lse,
    hidden,
    classifier,
    targets,
    bias,
    class_weights,
    lse,
    fast_grad_hidden,
    fast_grad_classifier,
    fast_grad_bias,
    ignore_index,
    reduction,
    label_smoothing,
    softcap,
    logit_scale,
    shift,
    z_loss,
    lse_all_rows,
    grad_hidden,
    grad_classifier,
    grad_bias,
):
    grad_h = hidden.new_empty(hidden.shape) if grad_hidden else _empty(hidden)
    grad_c = classifier.new_empty(classifier.shape) if grad_classifier else _empty(classifier)
    has_bias_grad = grad_bias and bias is not None
    grad_b = (
        classifier.new_empty(bias.shape, dtype=bias.dtype) if has_bias_grad else _empty(classifier)
    )
    return grad_h, grad_c, grad_b


# Positions of the forward op's arguments, for the autograd formulas below.
_HIDDEN, _CLASSIFIER, _TARGETS, _BIAS, _WEIGHTS = range(5)
_STATIC = slice(5, 13)  # ignore_index .. lse_all_rows: passed on to the backward op as they are
_MODE = 13


def _setup_context(ctx, inputs, output) -> None:
    hidden, classifier, targets, bias, class_weights = inputs[:5]
    loss, lse, fast_h, fast_c, fast_b = output
    ctx.mark_non_differentiable(fast_h, fast_c, fast_b)
    # Unused outputs get None, not zeros: fast mode then knows statically that lse carries no
    # gradient, and the backward skips work for it.
    ctx.set_materialize_grads(False)
    ctx.static = tuple(inputs[_STATIC])
    ctx.fast = inputs[_MODE] == "fast"
    if inputs[-1] != IMPLEMENTATION_VERSION:
        raise RuntimeError(
            "cce::linear_cross_entropy was called with implementation_version "
            f"{inputs[-1]}, this cce_compile is {IMPLEMENTATION_VERSION}: a stale compiled "
            "graph; clear the torch.compile caches (TORCHINDUCTOR_CACHE_DIR)"
        )
    # Which fast-mode buffers the forward filled: static flags, not sizes (no guards).
    ctx.fast_filled = (inputs[14], inputs[15], inputs[16] and bias is not None)
    ctx.has_bias = bias is not None
    ctx.save_for_backward(
        hidden, classifier, targets, bias, class_weights, lse, fast_h, fast_c, fast_b
    )


def _backward(ctx, grad_loss, grad_lse, *_unused):
    hidden, classifier, targets, bias, class_weights, lse, fast_h, fast_c, fast_b = (
        ctx.saved_tensors
    )
    needs_h, needs_c = ctx.needs_input_grad[_HIDDEN], ctx.needs_input_grad[_CLASSIFIER]
    needs_b = ctx.has_bias and ctx.needs_input_grad[_BIAS]
    if ctx.needs_input_grad[_WEIGHTS]:
        raise RuntimeError(
            "the derivative for 'class_weights' is not implemented (as in F.cross_entropy)"
        )
    no_grads = (None,) * 18
    if grad_loss is None and grad_lse is None:
        return no_grads
    fast = tuple(
        buffer if ctx.fast and filled else None
        for buffer, filled in zip((fast_h, fast_c, fast_b), ctx.fast_filled)
    )
    grad_h, grad_c, grad_b = torch.ops.cce.linear_cross_entropy_backward(
        grad_loss,
        grad_lse,
        hidden,
        classifier,
        targets,
        bias,
        class_weights,
        lse,
        *fast,
        *ctx.static,
        needs_h,
        needs_c,
        needs_b,
    )
    return (
        grad_h if needs_h else None,
        grad_c if needs_c else None,
        None,
        grad_b if needs_b else None,
        *([None] * 14),
    )


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)
