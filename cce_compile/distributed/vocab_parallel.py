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

The backward recomputes each rank's logits (lean mode) and turns them into gradients with the
global lse and the per-row coefficients of ``loss_math.row_coefficients``, which are the same on
every rank: the classifier's and bias's gradients are exactly this rank's rows and stay local;
hidden's is a sum over the classes, so each rank holds a partial sum that must be reduced
exactly once over the group (here, or by the caller's DTensor placement).

Why no fast mode: fast computes the gradient from the same logits as the statistics, in one
pass. Here the gradient needs the global lse, which exists only after the all-gather, so the
logits would be computed twice in the forward anyway (as lean does in the backward) and fast
would only add its V_local x D float32 accumulator.
"""

from __future__ import annotations

import torch

from .. import decide
from ..implementations.interface import ForwardOut, Gradients, HeadInputs, Needs, RowStats
from ..loss_math import LossSpec, finish_loss, returned_lse, row_targets
from ..op import call_plan, dispatch
from ..op.signature import Bound
from . import collectives


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
    ``lse_all_rows``), the same on every rank; with ``skip_ignored`` on the rows whose target
    counts, which every rank selects alike (the same targets), so the collectives agree."""
    decide.check_targets(args.targets, args.class_weights, args.spec(), args.vocab_size)
    return dispatch.on_kept_rows(args, _forward_rows)


def _forward_rows(args: Bound, budget: int) -> ForwardOut:
    spec = args.spec()
    vocab = args.vocab_size
    stats = _combine(_local_stats(args, spec, budget), args.group_name)
    rows = row_targets(args.targets, args.class_weights, spec, vocab)
    loss = finish_loss(stats.lse, stats.target_logit, stats.wsum, rows, spec, vocab)
    return ForwardOut(loss, returned_lse(stats.lse, rows, args.lse_all_rows))


def backward(args: Bound) -> Gradients:
    """Gradients for (hidden, classifier, bias) in their dtypes, None where not needed, on the
    rows the forward computed on. hidden's is all-reduced here (``reduce_hidden_grad``) or
    left this rank's partial sum."""
    return dispatch.recompute(args, call_plan.needs_of(args), _gradients_rows)


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
    # No rows kept (alike on every rank): every rank's gradient is zero, nothing to reduce.
    if grad_hidden is not None and args.reduce_hidden_grad and grad_hidden.numel():
        # In float32, before the one rounding to hidden's dtype; in place: the buffer is ours.
        grad_hidden = collectives.all_reduce_(grad_hidden.contiguous(), "sum", args.group_name)
    return dispatch.in_input_dtypes((grad_hidden, grad_classifier, grad_bias), args)
