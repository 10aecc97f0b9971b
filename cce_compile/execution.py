"""Running the ops' implementations: which one, under which numerics, and how fast mode's
precomputed gradients combine with recomputed ones.

The op's kernels (``ops``) hand their bound arguments here. CUDA with Triton runs
``triton_path``; every other device runs ``torch_path``. Both always compute in float32 from
the inputs they are given: autocast is switched off around them, so an enclosing autocast
region neither changes their dtypes nor mixes precisions between forward and backward (the
public function and the graph pass apply autocast's casts to the inputs instead).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch

from . import compaction, config, filtering, policy, torch_path
from .interface import ForwardOut, Gradients, Implementation, Needs
from .loss_math import (
    LossSpec,
    check_targets_in_range,
    finish_loss,
    returned_lse,
    row_coefficients,
    row_targets,
)
from .op_signature import Bound


@functools.cache
def _triton_path() -> Implementation | None:
    """The Triton implementation, or None where Triton cannot run."""
    try:
        from . import triton_path
    except ImportError:
        return None
    return triton_path if triton_path.available() else None


def implementation_for(device: torch.device) -> Implementation:
    if device.type == "cuda":
        impl = _triton_path()
        if impl is not None:
            return impl
    return torch_path


def problem_of(hidden, classifier, shift: int, compute_dtype) -> policy.Problem:
    """What the memory policy needs to know about a call: hidden (..., T, D)."""
    leading = hidden.shape[:-1]
    rows = (math.prod(leading) // max(leading[-1], 1)) * (leading[-1] - shift) if leading else 1
    dtype = compute_dtype or hidden.dtype
    return policy.Problem(
        rows=rows,
        vocab=classifier.shape[0],
        dim=classifier.shape[1],
        logit_bytes=dtype.itemsize,
        rounds_inputs=compute_dtype is not None
        and any(d != compute_dtype for d in (hidden.dtype, classifier.dtype)),
    )


def budget_bytes(problem: policy.Problem) -> int:
    """The extra memory the settings give this problem (policy.py)."""
    settings = config.get()
    return policy.budget_bytes(problem, settings.memory_budget_mb, settings.memory_fraction)


def check_targets(targets, class_weights, spec: LossSpec, vocab: int) -> None:
    """PyTorch's error for out-of-range targets, where checking costs no device sync."""
    if targets.device.type == "cpu" or config.get().check_targets:
        check_targets_in_range(row_targets(targets, class_weights, spec, vocab), vocab)


@contextlib.contextmanager
def float32_math(device: torch.device) -> Iterator[None]:
    """Autocast off for ``device`` inside the block (the implementations pick dtypes)."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        with torch.autocast(device.type, enabled=False):
            yield
    else:
        yield


def needs_of(args: Bound) -> Needs:
    return Needs(args.grad_hidden, args.grad_classifier, args.grad_bias and args.bias is not None)


def forward(args: Bound) -> ForwardOut:
    """Loss and per-row lse; fast mode also its unit-gradient buffers, lean mode with
    filtering the mask of blocks its backward computes; with ``skip_ignored`` the rows it
    computed on (compaction.py)."""
    spec = args.spec()
    vocab = args.classifier.shape[0]
    check_targets(args.targets, args.class_weights, spec, vocab)
    budget = _budget_of(args)
    selection = compaction.select(args)
    if selection is None or not selection.compacted:
        out = _forward_rows(args, budget)
    else:
        compact = compaction.compact(args, selection)
        out = _forward_rows(compact, budget - compaction.copy_bytes(args, selection))
        out = _expanded(out, selection, args)
    out.row_index = None if selection is None else selection.index
    return out


def _forward_rows(args: Bound, budget: int) -> ForwardOut:
    """``forward`` on every row of ``args``."""
    spec = args.spec()
    vocab = args.classifier.shape[0]
    impl = implementation_for(args.hidden.device)
    rows = row_targets(args.targets, args.class_weights, spec, vocab)
    tensors = (args.hidden, args.classifier, args.targets, args.bias, args.class_weights)
    sizing = dict(budget_bytes=budget, compute_dtype=_compute_dtype(args))
    with float32_math(args.hidden.device):
        if args.mode == "fast" and needs_of(args).any:
            out = impl.fast_forward(*tensors, spec, rows, needs=needs_of(args), **sizing)
            lse = out.lse
        else:
            beta = args.grad_filter if _filtered(args, spec) else None
            stats = impl.logit_stats(
                *tensors,
                spec,
                col_start=0,
                all_rows=args.lse_all_rows,
                block_lse=beta is not None,
                **sizing,
            )
            lse = stats.lse
            out = ForwardOut(
                finish_loss(lse, stats.target_logit, stats.wsum, rows, spec, vocab), lse
            )
            if beta is not None:
                out.keep_blocks = filtering.keep_blocks(stats.block_lse, lse, rows.targets, beta)
    out.lse = returned_lse(lse, rows, args.lse_all_rows)
    if out.grad_hidden is not None:  # the op returns it in hidden's own dtype
        out.grad_hidden = out.grad_hidden.to(args.hidden.dtype)
    return out


def _expanded(out: ForwardOut, selection: compaction.Selection, args: Bound) -> ForwardOut:
    """The outputs of a forward on the kept rows, for every row (zeros at skipped ones)."""
    if args.reduction == "none":
        out.loss = compaction.expand_rows(out.loss, selection)
    out.lse = compaction.expand_rows(out.lse, selection)
    if out.keep_blocks is not None:
        out.keep_blocks = compaction.expand_rows(out.keep_blocks, selection)
    if out.grad_hidden is not None:
        out.grad_hidden = compaction.expand_hidden(
            out.grad_hidden, selection, args.hidden, args.shift
        )
    return out


def filters(args: Bound) -> bool:
    """Does this call filter its gradients (and return the mask)? Asked for, lean mode,
    gradients wanted. The op's fake kernel and its implementation both ask this."""
    return args.grad_filter is not None and args.mode == "lean" and needs_of(args).any


def _filtered(args: Bound, spec: LossSpec) -> bool:
    """``filters``, after the checks that make a bad request an error."""
    if args.grad_filter is None:
        return False
    filtering.check_beta(args.grad_filter)
    if args.mode != "lean":
        raise ValueError("grad_filter filters the lean backward: it needs mode 'lean'")
    filtering.check_spec(spec)
    return filters(args)


def _budget_of(args: Bound) -> int:
    problem = problem_of(args.hidden, args.classifier, args.shift, _compute_dtype(args))
    return budget_bytes(problem)


def _compute_dtype(args: Bound) -> torch.dtype | None:
    """The compute dtype where it rounds an input (None where every input has it)."""
    dtype = args.compute_dtype
    inputs = (args.hidden, args.classifier, args.bias)
    if dtype is None or all(t is None or t.dtype == dtype for t in inputs):
        return None
    return dtype


def backward(args: Bound) -> Gradients:
    """Gradients in the backward op's needs, in the inputs' dtypes (None where not needed).

    Fast mode's buffers hold the loss's gradients for a unit upstream gradient: they are
    scaled, and only the lse's part (if any) is recomputed. Needs they do not cover (a
    gradient the forward was not asked for) are recomputed in full, on the rows the forward
    computed on.
    """
    needs = needs_of(args)
    impl = implementation_for(args.hidden.device)
    buffers = (args.fast_grad_hidden, args.fast_grad_classifier, args.fast_grad_bias)
    served = Needs(*(b is not None for b in buffers))
    grads: list[torch.Tensor | None] = [None, None, None]
    grad_loss = args.grad_loss
    inputs = (args.hidden, args.classifier, args.bias)
    with float32_math(args.hidden.device):
        if grad_loss is not None and served.any and not needs.without(served).any:
            wanted = (needs.hidden, needs.classifier, needs.bias)
            for i, (buffer, like) in enumerate(zip(buffers, inputs)):
                if buffer is not None and wanted[i]:
                    grads[i] = impl.scale_to(buffer, grad_loss, like.dtype)
            grad_loss = None  # consumed
        if grad_loss is not None or args.grad_lse is not None:
            recomputed = _recomputed(args.replace(grad_loss=grad_loss), impl, needs)
            for i, extra in enumerate(recomputed):
                if extra is not None:
                    grads[i] = extra if grads[i] is None else grads[i] + extra
    return grads[0], grads[1], grads[2]


def _recomputed(args: Bound, impl: Implementation, needs: Needs) -> Gradients:
    """The gradients from recomputed logits (lean), in the inputs' dtypes."""
    budget = _budget_of(args)
    selection = compaction.of_backward(args)
    if selection is None or not selection.compacted:
        return _recomputed_rows(args, impl, needs, budget)
    per_row = dict(lse=args.lse.reshape(-1), keep_blocks=args.keep_blocks)
    per_row["grad_lse"] = None if args.grad_lse is None else args.grad_lse.reshape(-1)
    if args.grad_loss is not None and args.reduction == "none":
        per_row["grad_loss"] = args.grad_loss.reshape(-1)
    compact = compaction.compact(args, selection, **per_row)
    budget -= compaction.copy_bytes(args, selection)
    grad_hidden, grad_classifier, grad_bias = _recomputed_rows(compact, impl, needs, budget)
    if grad_hidden is not None:
        grad_hidden = compaction.expand_hidden(grad_hidden, selection, args.hidden, args.shift)
    return grad_hidden, grad_classifier, grad_bias


def _recomputed_rows(args: Bound, impl: Implementation, needs: Needs, budget: int) -> Gradients:
    """``_recomputed`` on every row of ``args``."""
    spec = args.spec()
    grad_loss = args.grad_loss
    if grad_loss is not None and spec.reduction == "none":
        grad_loss = grad_loss.reshape(-1)
    grad_lse = None if args.grad_lse is None else args.grad_lse.reshape(-1)
    vocab = args.classifier.shape[0]
    lse = args.lse.reshape(-1)
    rows = row_targets(args.targets, args.class_weights, spec, vocab)
    coefs = row_coefficients(grad_loss, grad_lse, lse, rows, spec, vocab, args.lse_all_rows)
    computed = impl.gradients(
        args.hidden,
        args.classifier,
        args.targets,
        args.bias,
        args.class_weights,
        lse,
        coefs,
        spec,
        col_start=0,
        needs=needs,
        budget_bytes=budget,
        compute_dtype=_compute_dtype(args),
        keep_blocks=args.keep_blocks,
    )
    likes = (args.hidden, args.classifier, args.bias)
    return tuple(None if g is None else g.to(like.dtype) for g, like in zip(computed, likes))
