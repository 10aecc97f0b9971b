"""The vocabulary-parallel loss: each rank's statistics, combined over the group.

Each rank holds classes [vocab_start, vocab_start + V_local) of the classifier and the same
hidden states and targets. With the notation of ``loss_math`` (z the logits, w the class
weights), the loss needs three per-row statistics over the *whole* vocabulary, and each is a
reduction over the classes, so over the ranks:

* ``lse    = logsumexp_r lse_r``
* ``target = sum_r target_r``  (z_it on the rank that holds t, exactly 0 elsewhere)
* ``wsum   = sum_r wsum_r``    (label smoothing only)

Each rank packs its rows of these into one (k, N) float32 tensor (k = 2, or 3 with smoothing)
and the forward issues ONE all-gather of it; every rank then combines the (ranks, k, N) result
itself, in the same order, so every rank gets the same bits. This is the fewest collectives
the loss allows (Megatron's fused cross-entropy issues two: a MAX all-reduce of the row max,
then a SUM all-reduce of the packed sum-exp and target logit, which waits for the first).
Per row and rank it sends (ranks - 1) * k * 4 bytes, against 2 (ranks - 1) / ranks * (k + 1)
* 4 for a ring MAX + SUM pair: fewer at 2 ranks (8 bytes against 12), equal at 3 (k = 2),
more beyond. At the row counts of a step (N ~ 10^4) either is under a megabyte, so what
counts at every tensor-parallel size of one node is one latency instead of two dependent
ones. It is exact: the log-sum-exp over the ranks is the MAX + SUM pair's formula, computed
locally, and the target logit's sum adds exact zeros.

The loss then follows from ``loss_math.finish_loss`` with the global vocabulary size and class
weights, identically on every rank. Nothing that every rank can compute travels: the targets
and class weights are replicated, so the rows kept by compaction, the row weights and the
'mean' divisors are computed locally.

Lean mode's backward recomputes each rank's logits and turns them into gradients with the
global lse and the per-row coefficients of ``loss_math.row_coefficients``, which are the same on
every rank: the classifier's and bias's gradients are exactly this rank's rows and stay local;
hidden's is a sum over the classes, so each rank holds a partial sum that must be reduced
exactly once over the group (here, or by the caller's DTensor placement).

Fast mode (three GEMMs, no recomputation) keeps each chunk's logits until its gradient is
written, and the gradient needs the global lse, so the combine moves inside the chunk loop
(``SplitVocabulary``; both implementations). Per chunk of n rows, on every rank:

1. z = the shard's logits: GEMM 1 (on a GPU with a bf16 / fp16 gradient, fused as on one
   device: each tile's exp(z - tile max) in that dtype with the tile's maximum and partial lse;
   else n x V_local float32);
2. the shard's lse, target logit and wsum of z (from the fused GEMM's partials; else one read
   of the chunk);
3. ONE all-gather of those packed rows, combined as above: the chunk's global statistics;
4. dz = coef_p * exp(z - lse) - coef_t * onehot - coef_w * w with the global lse and the unit
   upstream gradient's coefficients of the whole vocabulary, written over z;
5. hidden's partial gradient of the chunk (GEMM 2) and the shard's classifier gradient
   (GEMM 3, accumulated into the gradient itself), as on one device.

So a fast forward issues one all-gather per chunk (ceil(N / n) of them, the same count on
every rank: the chunk size comes from ``decide.shard_vocab``'s share of the vocabulary and the
budget of that share, never from the rank's own uneven shard), and the loss's statistics
travel exactly as in lean mode, split by rows. The backward only scales the saved gradients by
the upstream gradient; hidden's is all-reduced once, in float32 before its one rounding, over
the rows the forward kept (as in lean mode), unless the caller reduces it
(``reduce_hidden_grad``). The budget, forward and lean backward, is that of the share at twice
the single-device fraction (``decide.budget_bytes(..., vocab_parallel=True)``). Memory per
rank: a chunk's n x V_local exponentials or float32 logits, the shard's
classifier gradient (an output) and hidden's partial gradient, N x D, held from the forward to
the backward: float32 where the op reduces it (the all-reduce's operand), else in hidden's
dtype. Lean is taken where fast cannot serve a call alike on every rank or at all: 'none',
a gradient of the returned lse, no gradient wanted (``decide.mode``).
"""

from __future__ import annotations

import functools

import torch

from .. import decide
from ..implementations.interface import (
    ForwardOut,
    Gradients,
    HeadInputs,
    Needs,
    RowStats,
    SplitVocabulary,
)
from ..loss_math import LossSpec, RowTargets, finish_loss, returned_lse, row_targets
from ..op import call_plan, compaction, dispatch
from ..op.signature import Bound
from . import collectives, sharding


def _shard(args: Bound, budget: int) -> HeadInputs:
    """This rank's classes, from ``vocab_start``, with their slice of the class weights (the
    statistics and gradients compute on them)."""
    start, weights = args.vocab_start, args.class_weights
    if weights is not None:
        weights = weights[start : start + args.classifier.shape[0]]
    return dispatch.head_inputs(args, budget, class_weights=weights, col_start=start)


def _local_stats(args: Bound, spec: LossSpec, budget: int) -> RowStats:
    """This rank's statistics; an empty shard (fewer classes than ranks) has none."""
    hidden, classifier = args.hidden, args.classifier
    if classifier.shape[0] == 0:
        rows = hidden.shape[0] * (hidden.shape[1] - spec.shift)
        empty = hidden.new_zeros(rows, dtype=torch.float32)
        return RowStats(empty - float("inf"), empty, empty if spec.needs_wsum else None)
    impl = call_plan.implementation_for(hidden.device)
    with call_plan.float32_math(hidden.device):
        return impl.logit_stats(_shard(args, budget), all_rows=args.lse_all_rows)


def _combine(local: RowStats, group_name: str) -> RowStats:
    """The whole vocabulary's statistics from every rank's: one all-gather of the packed rows,
    combined locally (module docstring)."""
    if local.lse.numel() == 0:  # every rank kept no row (the same targets): nothing to send
        return local
    packed = [local.lse, local.target_logit] + ([] if local.wsum is None else [local.wsum])
    per_rank = collectives.all_gather(torch.stack(packed), group_name)  # (ranks, k, N)
    # A row without a finite logit anywhere (an ignored row the kernels skipped: -inf on
    # every rank) gets lse -inf, as on one device (logsumexp guards the all -inf max), and
    # the loss never reads it.
    lse = torch.logsumexp(per_rank[:, 0], dim=0)
    sums = per_rank[:, 1:].sum(dim=0)
    return RowStats(lse, sums[0], None if local.wsum is None else sums[1])


def forward(args: Bound) -> ForwardOut:
    """Loss (float32, a scalar or (N,) for 'none') and lse ((N,), 0 at ignored rows unless
    ``lse_all_rows``), the same on every rank; in fast mode also the gradients for a unit
    upstream gradient (hidden's this rank's partial sum, in ``hidden_buffer_dtype``); with
    ``skip_ignored`` on the rows whose target counts, which every rank selects alike (the same
    targets), so the collectives agree."""
    decide.check_targets(args.targets, args.class_weights, args.spec(), args.vocab_size)
    out = dispatch.on_kept_rows(args, _forward_rows, _budget(args))
    if out.grad_hidden is not None:
        out.grad_hidden = out.grad_hidden.to(hidden_buffer_dtype(args))
    return out


def hidden_buffer_dtype(args: Bound) -> torch.dtype:
    """Fast mode's hidden gradient between forward and backward: float32 where the op reduces
    it (rounded once, after the sum over ranks), else the partial sum the caller reduces, in
    hidden's dtype (as lean mode returns it)."""
    return torch.float32 if args.reduce_hidden_grad else args.hidden.dtype


def _budget(args: Bound) -> int:
    """The call's memory budget, the same on every rank: that of the share of the vocabulary
    ``decide.shard_vocab`` plans every rank for (fast mode's chunks follow from it)."""
    share = decide.shard_vocab(args.vocab_size, sharding.group_size(args.group_name))
    compute = call_plan.compute_dtype_of(args)
    problem = decide.problem_of(args.hidden, args.classifier, args.shift, compute, vocab=share)
    return decide.budget_bytes(problem, vocab_parallel=True)


def _forward_rows(args: Bound, budget: int) -> ForwardOut:
    spec = args.spec()
    vocab = args.vocab_size
    rows = row_targets(args.targets, args.class_weights, spec, vocab)
    needs = call_plan.needs_of(args)
    if args.mode == "fast" and needs.any:
        out = _fast_forward_rows(args, budget, rows, needs)
        lse = out.lse
    else:
        stats = _combine(_local_stats(args, spec, budget), args.group_name)
        lse = stats.lse
        out = ForwardOut(finish_loss(lse, stats.target_logit, stats.wsum, rows, spec, vocab), lse)
    out.lse = returned_lse(lse, rows, args.lse_all_rows)
    return out


def _fast_forward_rows(args: Bound, budget: int, rows: RowTargets, needs: Needs) -> ForwardOut:
    """Fast mode on this rank's shard (module docstring): one all-gather per chunk."""
    ranks = sharding.group_size(args.group_name)
    split = SplitVocabulary(
        args.vocab_size,
        decide.shard_vocab(args.vocab_size, ranks),
        functools.partial(_combine, group_name=args.group_name),
    )
    impl = call_plan.implementation_for(args.hidden.device)
    with call_plan.float32_math(args.hidden.device):
        return impl.fast_forward(_shard(args, budget), rows, needs=needs, split=split)


def backward(args: Bound) -> Gradients:
    """Gradients for (hidden, classifier, bias) in their dtypes, None where not needed, on the
    rows the forward computed on. hidden's is all-reduced here (``reduce_hidden_grad``) or
    left this rank's partial sum. With fast mode's ``fast_grad_hidden``, hidden's gradient
    alone, from that buffer (``_fast_hidden_gradient``)."""
    if args.fast_grad_hidden is not None:
        return _fast_hidden_gradient(args), None, None
    needs = call_plan.needs_of(args)
    return dispatch.recompute(args, needs, _gradients_rows, budget=_budget(args))


def _fast_hidden_gradient(args: Bound) -> torch.Tensor:
    """Fast mode's hidden buffer times the upstream gradient (float32 math; the buffer is a
    saved tensor and stays as it is), all-reduced over the rows the forward kept as lean mode
    reduces them (``reduce_hidden_grad``), rounded once to hidden's dtype."""
    grad = args.fast_grad_hidden.float() * args.grad_loss.float()
    if args.reduce_hidden_grad:
        selection = compaction.of_backward(args)
        if selection is None or not selection.compacted:
            grad = _all_reduce_rows(grad, args.group_name)
        else:
            kept = compaction.gather_hidden(grad, args.shift, selection)
            kept = _all_reduce_rows(kept, args.group_name)
            grad = compaction.expand_hidden(kept, selection, args.hidden, args.shift)
    return grad.to(args.hidden.dtype)


def _all_reduce_rows(grad: torch.Tensor, group_name: str) -> torch.Tensor:
    """Hidden's partial gradients summed over the group, in place; no rows (alike on every
    rank): every rank's gradient is zero, nothing to reduce."""
    if not grad.numel():
        return grad
    return collectives.all_reduce_(grad.contiguous(), "sum", group_name)


def _gradients_rows(args: Bound, needs: Needs, budget: int) -> Gradients:
    lse, coefs = dispatch.coefficients(args, args.vocab_size)
    hidden, classifier, bias = args.hidden, args.classifier, args.bias
    if classifier.shape[0] == 0:  # an empty shard contributes nothing but takes part below
        grads = (
            torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            if needs.hidden
            else None,
            torch.zeros_like(classifier) if needs.classifier else None,
            torch.zeros_like(bias) if needs.bias else None,
        )
    else:
        impl = call_plan.implementation_for(hidden.device)
        grads = dispatch.lean_gradients(args, impl, _shard(args, budget), needs, lse, coefs)
    grad_hidden, grad_classifier, grad_bias = grads
    if grad_hidden is not None and args.reduce_hidden_grad:
        # In float32, before the one rounding to hidden's dtype; in place: the buffer is ours.
        grad_hidden = _all_reduce_rows(grad_hidden, args.group_name)
    return dispatch.in_input_dtypes((grad_hidden, grad_classifier, grad_bias), args)
