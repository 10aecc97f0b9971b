"""The ops' dispatcher: forward and backward of both ops, on the rows that count.

The op's kernels (``custom_ops``, ``distributed.ops``) hand their bound arguments here. Each call:

1. is planned by ``call_plan`` (implementation, autocast off, compute dtype, budget, needs);
2. runs on the rows whose target counts (``compaction``: ignored rows are skipped, and the
   backward gathers the same rows as its forward);
3. computes the loss from per-row statistics (``loss_math``) — or, in fast mode, also the
   gradients for a unit upstream gradient, which the backward only scales;
4. recomputes in the backward what fast mode's buffers do not hold (the lean path).

The vocabulary-parallel op (``distributed.vocab_parallel``) brings its own per-row step (each
rank's statistics, combined over the group) to ``on_kept_rows`` and ``recompute``, so the
compaction, the coefficients and the casts are written once for both ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import decide, filtering, policy, row_metrics
from ..implementations.interface import (
    Coefficients,
    ForwardOut,
    Gradients,
    HeadInputs,
    Implementation,
    KeptRows,
    Needs,
)
from ..loss_math import (
    EntropyGradient,
    LossSpec,
    finish_loss,
    returned_lse,
    row_coefficients,
    row_targets,
)
from . import compaction
from .call_plan import budget_of, compute_dtype_of, float32_math, implementation_for, needs_of
from .signature import Bound

# forward_rows(args, budget[, kept]) -> ForwardOut, on every row of ``args`` (``kept``: the
# KeptRows of on_kept_rows' ``order_of``).
ForwardRows = Callable[..., ForwardOut]
# gradients_rows(args, needs, budget) -> gradients in the inputs' dtypes, on every row.
GradientRows = Callable[[Bound, Needs, int], Gradients]


def forward(args: Bound) -> ForwardOut:
    """Loss and per-row lse; fast mode also its unit-gradient buffers, lean mode with
    filtering the mask of blocks its backward computes; with ``skip_ignored`` the rows it
    computed on (compaction.py)."""
    decide.check_targets(args.targets, args.class_weights, args.spec(), args.classifier.shape[0])
    return on_kept_rows(args, _forward_rows, order_of=_kept_first_order(args))


def _runs_fast(args: Bound) -> bool:
    """Does this forward run fast mode (gradients in the forward)?"""
    return args.mode == "fast" and needs_of(args).any


def _kept_first_order(args: Bound) -> compaction.OrderOf | None:
    """The implementation's kept-first order where this forward can queue its first GEMM
    before it waits for the count of kept rows: a fast run whose logits GEMM is fused
    (``policy.fast_fuses_exp``; it stops at a count only the GPU holds) on an implementation
    with ``kept_first``. None: the count is waited for first (compaction.py)."""
    order_of = getattr(implementation_for(args.hidden.device), "kept_first", None)
    if order_of is None or not _runs_fast(args):
        return None
    problem = decide.problem_of(args.hidden, args.classifier, args.shift, compute_dtype_of(args))
    whole_rows = policy.fast_needs_whole_rows(
        softcap=bool(args.softcap),
        entropy=args.return_entropy,
        argmax=args.return_argmax,
    )
    return order_of if policy.fast_fuses_exp(problem, whole_rows) else None


def on_kept_rows(
    args: Bound,
    forward_rows: ForwardRows,
    budget: int | None = None,
    *,
    order_of: compaction.OrderOf | None = None,
) -> ForwardOut:
    """``forward_rows`` on the rows whose target counts (all rows without ``skip_ignored``),
    its per-row outputs given back for every row, and those rows in ``row_index``;
    ``budget``: the call's memory budget where not ``budget_of(args)``. With ``order_of``
    (``_kept_first_order``) ``forward_rows`` takes a third argument, the ``KeptRows`` of
    compaction's kept-first order, and waits for their count itself."""
    budget = budget_of(args) if budget is None else budget
    selection = compaction.select(args, order_of)
    if selection is None or not selection.compacted:
        out = forward_rows(args, budget)
    else:
        compact = compaction.compact(args, selection)
        budget -= compaction.copy_bytes(args, selection)
        if isinstance(selection, compaction.KeptFirst):
            out = forward_rows(compact, budget, selection.kept)
            selection = selection.resolved()
        else:
            out = forward_rows(compact, budget)
        out = _expanded(out, selection, args)
    out.row_index = None if selection is None else selection.index
    return out


def _forward_rows(args: Bound, budget: int, kept: KeptRows | None = None) -> ForwardOut:
    """The single-device forward on every row of ``args`` (``kept``: on its kept-first rows,
    interface.KeptRows)."""
    head = head_inputs(args, budget, class_weights=args.class_weights)
    spec, vocab = head.spec, head.vocab
    impl = implementation_for(args.hidden.device)
    needs = needs_of(args)
    rows = row_targets(args.targets, args.class_weights, spec, vocab)
    metrics = row_metrics.asked(args)
    extras = row_metrics.stats_needed(metrics)
    with float32_math(args.hidden.device):
        if _runs_fast(args):
            options = dict(extras=extras)
            if kept is not None:  # (an implementation with ``kept_first`` only)
                options["kept"] = kept
            out = impl.fast_forward(head, rows, needs=needs, **options)
            lse, stats = out.lse, out.stats
            if kept is not None:  # the outputs are the kept rows'
                rows = rows.slice(0, lse.numel())
        else:
            beta = args.grad_filter if _filtered(args, spec) else None
            stats = impl.logit_stats(
                head, all_rows=_all_rows(args), block_lse=beta is not None, extras=extras
            )
            lse = stats.lse
            out = ForwardOut(
                finish_loss(lse, stats.target_logit, stats.wsum, rows, spec, vocab), lse
            )
            if beta is not None:
                out.keep_blocks = filtering.keep_blocks(stats.block_lse, lse, rows.targets, beta)
        # Metrics of the rows that count (the kernels may skip ignored rows' tiles), or of
        # every row (``metrics_all_rows``).
        counted = None if args.metrics_all_rows else rows.valid
        out.metrics = row_metrics.values(metrics, stats, lse, vocab, counted)
    out.lse = returned_lse(lse, rows, _all_rows(args))
    if out.grad_hidden is not None:  # the op returns it in hidden's own dtype
        out.grad_hidden = out.grad_hidden.to(args.hidden.dtype)
    return out


def _all_rows(args: Bound) -> bool:
    """Must the forward compute ignored rows' statistics too (the lse or the row metrics
    returned valid there)?"""
    return args.lse_all_rows or args.metrics_all_rows


def _expanded(out: ForwardOut, selection: compaction.Selection, args: Bound) -> ForwardOut:
    """The outputs of a forward on the kept rows, for every row (zeros at skipped ones)."""
    if args.reduction == "none":
        out.loss = compaction.expand_rows(out.loss, selection)
    out.lse = compaction.expand_rows(out.lse, selection)
    for name, value in out.metrics.items():
        fill = row_metrics.BY_NAME[name].ignored_value
        out.metrics[name] = compaction.expand_rows(value, selection, fill=fill)
    if out.keep_blocks is not None:
        out.keep_blocks = compaction.expand_rows(out.keep_blocks, selection)
    if out.grad_hidden is not None:
        out.grad_hidden = compaction.expand_hidden(
            out.grad_hidden, selection, args.hidden, args.shift
        )
    return out


def filters(args: Bound) -> bool:
    """Does this call filter its gradients (``decide.filters``)? The op's fake kernel and its
    implementation both ask this."""
    return decide.filters(args.grad_filter, args.mode, needs_of(args).any)


def _filtered(args: Bound, spec: LossSpec) -> bool:
    """``filters``, after ``decide.grad_filter``'s checks (a bad request is an error)."""
    decide.grad_filter(args.grad_filter, args.mode, spec)
    return filters(args)


def backward(args: Bound) -> Gradients:
    """Gradients in the backward op's needs, in the inputs' dtypes (None where not needed),
    recomputed on the rows the forward computed on. (Fast mode's forward already holds the
    loss's gradients: the autograd formula scales those itself, ``scale_gradient_``, and asks
    this op only for what they do not cover, such as the returned lse's part.)"""
    return recompute(args, needs_of(args), _lean_gradients)


def scale_gradient_(gradient: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """``gradient *= grad_loss`` in place (fast mode's unit-upstream gradient becoming the
    gradient), with float32 math and one rounding (a bf16 buffer is not multiplied by a
    bf16-rounded scale). ``gradient`` is a saved tensor of the op's autograd formula.

    Eager, it is scaled and handed out as ``.data``: the same storage under a version counter
    of its own, so neither this scaling nor what autograd, hooks or the user later do to it in
    place (``.grad`` accumulation, ``zero_()``) moves the saved tensor's version, which every
    later backward of a retained graph checks when it unpacks. The formula hands each buffer
    out once and recomputes after that (``ops._take_fast_gradients``): no later backward reads
    its values. Traced (torch.compile's fake and
    functional tensors), that Python runs once, so the product is out of place: Inductor
    computes it in float32 and writes it over the saved buffer only where AOTAutograd donates
    that buffer to the backward (``donated_buffer``, which PyTorch refuses with a retained
    graph). An in-place ``mul_`` there would be a mutation of the saved tensor that every
    later backward of a retained graph reads."""
    if type(gradient) is not torch.Tensor:
        return gradient * grad_loss
    handed_out = gradient.data  # its own version counter: the saved tensor's never moves
    implementation_for(gradient.device).scale_(handed_out, grad_loss)
    return handed_out


def recompute(
    args: Bound, needs: Needs, gradients_rows: GradientRows, budget: int | None = None
) -> Gradients:
    """``gradients_rows`` on the rows the forward computed on (``row_index``), hidden's
    gradient given back for every position (exact zeros at skipped ones); ``budget``: the
    call's memory budget where its forward had another than ``budget_of``'s (a vocabulary
    shard's)."""
    budget = budget_of(args) if budget is None else budget
    selection = compaction.of_backward(args)
    if selection is None or not selection.compacted:
        return gradients_rows(args, needs, budget)
    per_row = dict(lse=args.lse.reshape(-1))
    per_row["grad_lse"] = None if args.grad_lse is None else args.grad_lse.reshape(-1)
    if args.has("grad_entropy") and args.grad_entropy is not None:
        per_row.update(grad_entropy=args.grad_entropy.reshape(-1), entropy=args.entropy.reshape(-1))
    if args.grad_loss is not None and args.reduction == "none":
        per_row["grad_loss"] = args.grad_loss.reshape(-1)
    if args.has("keep_blocks"):  # (the vocabulary-parallel op filters nothing)
        per_row["keep_blocks"] = args.keep_blocks
    compact = compaction.compact(args, selection, **per_row)
    budget -= compaction.copy_bytes(args, selection)
    grad_hidden, grad_classifier, grad_bias = gradients_rows(compact, needs, budget)
    if grad_hidden is not None:
        grad_hidden = compaction.expand_hidden(grad_hidden, selection, args.hidden, args.shift)
    return grad_hidden, grad_classifier, grad_bias


def coefficients(args: Bound, vocab: int) -> tuple[torch.Tensor, Coefficients]:
    """(lse, per-row coefficients of dz) of a backward call over a vocabulary of ``vocab``
    classes, flattened to the loss rows (loss_math's module docstring)."""
    spec = args.spec()
    grad_loss = args.grad_loss
    if grad_loss is not None and spec.reduction == "none":
        grad_loss = grad_loss.reshape(-1)
    grad_lse = None if args.grad_lse is None else args.grad_lse.reshape(-1)
    lse = args.lse.reshape(-1)
    rows = row_targets(args.targets, args.class_weights, spec, vocab)
    entropy = None
    if args.has("grad_entropy") and args.grad_entropy is not None:
        entropy = EntropyGradient(
            args.grad_entropy.reshape(-1), args.entropy.reshape(-1), args.metrics_all_rows
        )
    coefs = row_coefficients(
        grad_loss, grad_lse, lse, rows, spec, vocab, args.lse_all_rows, entropy=entropy
    )
    return lse, coefs


def head_inputs(
    args: Bound, budget: int, *, class_weights: torch.Tensor | None, col_start: int = 0
) -> HeadInputs:
    """What an implementation computes on for a call of either op: its classifier's classes,
    the vocabulary's [col_start, col_start + V), and their ``class_weights``."""
    return HeadInputs(
        args.hidden,
        args.classifier,
        args.targets,
        args.bias,
        class_weights,
        args.spec(),
        budget,
        compute_dtype_of(args),
        col_start,
    )


def lean_gradients(
    args: Bound,
    impl: Implementation,
    head: HeadInputs,
    needs: Needs,
    lse: torch.Tensor,
    coefs: Coefficients,
) -> Gradients:
    """The implementation's gradients from recomputed logits of the head's classes, before
    any cast: hidden's in float32 (with ``args``' filtering mask, where it has one)."""
    keep_blocks = args.keep_blocks if args.has("keep_blocks") else None
    with float32_math(head.hidden.device):
        return impl.gradients(head, lse, coefs, needs=needs, keep_blocks=keep_blocks)


def in_input_dtypes(grads: Gradients, args: Bound) -> Gradients:
    """Gradients cast once to the dtypes of hidden, classifier and bias."""
    likes = (args.hidden, args.classifier, args.bias)
    return tuple(None if g is None else g.to(like.dtype) for g, like in zip(grads, likes))


def _lean_gradients(args: Bound, needs: Needs, budget: int) -> Gradients:
    """The single-device op's recomputed gradients on every row of ``args``."""
    lse, coefs = coefficients(args, args.classifier.shape[0])
    impl = implementation_for(args.hidden.device)
    head = head_inputs(args, budget, class_weights=args.class_weights)
    grads = lean_gradients(args, impl, head, needs, lse, coefs)
    return in_input_dtypes(grads, args)
