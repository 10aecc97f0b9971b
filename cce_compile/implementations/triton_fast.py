"""The CUDA implementation's fast mode (``forward(fast=True)``): Triton kernels plus cuBLAS.

For each token chunk of ``n`` rows:
  cuBLAS logits (n x V, float32 out of the accumulator: nothing rounded before the softmax) ->
  ``chunk_softmax_grad`` writes their gradient, rounded once to the compute dtype, over the
  logits' own memory -> d hidden[chunk] = grad @ classifier (written once) and d classifier +=
  grad.T @ hidden[chunk] into the classifier's gradient itself (its own dtype: float32 under
  AMP, bf16 for bf16 weights). The backward scales both by the upstream gradient in place
  (``triton_shared.scale_``). Three GEMMs, the minimum, and no V x D tensor but the gradient
  (below D = 1024 a bf16 gradient is summed in a float32 buffer and rounded once, as is a bf16
  one of float16 products at every D: ``policy.sums_classifier_in_float32``).
  Over a vocabulary shard (``SplitVocabulary``), in this whole-rows form: ``chunk_row_stats``,
  the combine over the ranks, then ``chunk_softmax_grad`` with the whole vocabulary's lse.
Fused (``policy.fast_fuses_exp``: a bf16 / fp16 gradient; not with softcap, entropy or
argmax): a Triton GEMM (``logits_exp``) writes each tile's exp(z - tile max) into the
gradient buffer in the compute dtype, with the tile maxima and partial lse; then
``scaled_exp_grad`` reduces the partials to the rows' lse and turns them into the gradient.
No float32 logits: two bytes a logit instead of four, so a budget holds ~1.9x the rows (fewer
chunks, fewer re-reads of the classifier's gradient), and less traffic per logit. Over a shard,
the shard's row statistics come from the GEMM's partials (no pass over the chunk), are
combined over the ranks, and ``scaled_exp_grad`` takes the whole vocabulary's lse.
Mixed precision (``compute_dtype`` rounding float32 inputs, autocast's form): hidden and the
classifier are rounded once (cuBLAS needs the classifier whole per chunk); a float32
classifier's gradient is summed in place, in float32. The chunk size comes from ``policy``
(the memory budget). ``triton_path`` (lean mode) re-exports ``fast_forward``, the op's entry
point here.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import policy
from ..kernels.chunk_softmax_grad import chunk_row_stats, chunk_softmax_grad
from ..kernels.common import RowLayout, TileConfig, row_layout
from ..kernels.logits_exp import LogitsExpLaunch, exp_blocks
from ..kernels.scaled_exp_grad import ScaledExpGradLaunch
from ..loss_math import RowTargets, finish_loss, row_coefficient_parts
from . import triton_shared as shared
from .interface import (
    ForwardOut,
    HeadInputs,
    KeptRows,
    Needs,
    RowStats,
    SplitVocabulary,
)


@dataclasses.dataclass
class _PositionCoefficients:
    """Fast mode's per-position inputs of ``chunk_softmax_grad`` for a unit upstream gradient:
    each position's target (clamped: a valid class) and coefficients (0 where no loss row)."""

    targets: torch.Tensor
    p_base: torch.Tensor
    p_per_lse: torch.Tensor | None
    coef_t: torch.Tensor
    coef_w: torch.Tensor

    @staticmethod
    def targets_of(
        head: HeadInputs, rows: RowTargets, layout: RowLayout, split: SplitVocabulary | None
    ) -> torch.Tensor:
        """Each position's target column (``split``: of the head's shard; a target on another
        shard becomes column -1, none of the shard's)."""
        targets = rows.safe
        if split is not None:
            columns = rows.targets.long() - head.col_start
            targets = torch.where((columns >= 0) & (columns < head.vocab), columns, -1)
        return layout.rows_to_positions(targets)

    @staticmethod
    def of(
        head: HeadInputs,
        rows: RowTargets,
        layout: RowLayout,
        split: SplitVocabulary | None,
        targets: torch.Tensor,
    ) -> _PositionCoefficients:
        """``rows`` over the whole vocabulary (``split``: of which the head holds a shard),
        with their positions' ``targets_of``."""
        unit = torch.ones((), device=head.hidden.device)
        vocab = head.vocab if split is None else split.size
        parts = row_coefficient_parts(unit, None, rows, head.spec, vocab)
        to_positions = layout.rows_to_positions
        return _PositionCoefficients(
            targets,
            to_positions(parts.p_base),
            None if parts.p_per_lse is None else to_positions(parts.p_per_lse),
            to_positions(parts.coef_t),
            to_positions(parts.coef_w),
        )

    def chunk(self, start: int, stop: int) -> dict:
        """The positions [start, stop) as ``chunk_softmax_grad``'s keyword arguments."""
        fields = dataclasses.fields(self)
        return {f.name: shared.part(getattr(self, f.name), start, stop) for f in fields}


class _FastBuffers:
    """Fast mode's buffers, filled chunk by chunk of positions: the float32 logits and their
    gradient over their own memory (or, fused, the gradient, its tile maxima and the rows'
    partial lse per tile), each position's lse, target logit, wsum (and entropy, argmax
    where asked), and the gradients for a unit upstream gradient."""

    def __init__(
        self,
        head: HeadInputs,
        layout: RowLayout,
        needs: Needs,
        chunk: int,
        work: torch.Tensor,
        *,
        extras: frozenset[str],
        split: bool = False,
        fused_tiles: TileConfig | None = None,
        classifier_sum_dtype: torch.dtype | None = None,
    ):
        """Room for ``chunk`` positions' logits (``work``: hidden in the compute dtype);
        ``split``: hidden's gradient is a shard's float32 partial sum; ``fused_tiles``: the GEMM's
        tiles when it writes the scaled exponentials itself (``logits_exp``; None: whole
        float32 rows); ``classifier_sum_dtype``: what sums the classifier's gradient over the
        chunks (default: the gradient itself, in the classifier's dtype)."""
        vocab, dim = head.classifier.shape
        device, n_positions = work.device, layout.n_positions
        rows = min(chunk, max(n_positions, 1))
        self.fused_tiles = fused_tiles
        if fused_tiles is not None:
            self._fused_buffers(rows, vocab, shared.work_dtype(work), fused_tiles, head, device)
        else:
            self._logit_buffers(rows, vocab, shared.work_dtype(work), device)
        # In hidden's own dtype (the op's output); each chunk's GEMM writes float32 (``stage``)
        # that is rounded once into it: a bf16 GEMM output lets cuBLAS reduce split-K partials
        # in bf16 (allow_bf16_reduced_precision_reduction), which measurably loses accuracy
        # against lean mode on a peaked softmax. No N x D float32 buffer.
        hidden_dtype = torch.float32 if split else head.hidden.dtype
        self.grad_positions = (
            torch.empty((n_positions, dim), dtype=hidden_dtype, device=device)
            if needs.hidden
            else None
        )
        self.stage = None
        if self.grad_positions is not None and hidden_dtype != torch.float32:
            self.stage = torch.empty((rows, dim), dtype=torch.float32, device=device)
        # The classifier's gradient itself, in its dtype, accumulates the chunks (no separate
        # float32 buffer): float32 under AMP, exact; bf16 for bf16 weights, each chunk's float32
        # product added in cuBLAS's epilogue and rounded once. Below D = 1024 a bf16 gradient,
        # and at every D a bf16 one of float16 products (bf16 weights under float16 autocast),
        # is summed in float32 and rounded at the end (``policy.sums_classifier_in_float32``).
        # Written, not accumulated, by the first chunk's GEMM (beta = 0): no zero fill, unless
        # there is no chunk at all (no rows).
        alloc = torch.empty if n_positions else torch.zeros
        self.grad_classifier = (
            alloc((vocab, dim), dtype=classifier_sum_dtype or head.classifier.dtype, device=device)
            if needs.classifier
            else None
        )
        self.grad_bias = (
            torch.zeros(vocab, dtype=torch.float32, device=device) if needs.bias else None
        )
        lse = torch.empty(n_positions, dtype=torch.float32, device=device)
        wsum = torch.empty_like(lse) if head.spec.needs_wsum else None
        self.stats = (lse, torch.empty_like(lse), wsum)  # lse, target logit, wsum
        self.entropy = torch.empty_like(lse) if "entropy" in extras else None
        self.argmax = torch.empty_like(lse, dtype=torch.int64) if "argmax" in extras else None

    def _logit_buffers(self, rows: int, vocab: int, work_dtype, device):
        """Whole rows: float32 logits, the gradient in the compute dtype over their own memory."""
        self.logits = torch.empty((rows, vocab), dtype=torch.float32, device=device)
        half_width = work_dtype != torch.float32
        self.grad = self.logits.view(work_dtype)[:, :vocab] if half_width else self.logits

    def _fused_buffers(self, rows, vocab, work_dtype, config: TileConfig, head, device):
        """The gradient (first the scaled exponentials), its tile maxima, and each row's
        partial lse (and partial weighted sums) per GEMM tile."""
        # Rows padded to 16 bytes: the GEMM's epilogue stores its tiles by TMA.
        padded = -(-vocab // 8) * 8
        self.grad = torch.empty((rows, padded), dtype=work_dtype, device=device)[:, :vocab]
        tiles = exp_blocks(vocab, config)
        self.block_max = torch.empty((rows, tiles), dtype=torch.float32, device=device)
        self.partial_lse = torch.empty_like(self.block_max)
        self.partial_wsum = torch.empty_like(self.partial_lse) if head.spec.needs_wsum else None

    def truncate(self, n: int) -> None:
        """Keep the per-position outputs of the first ``n`` positions only (kept-first rows:
        the rest were not computed)."""
        lse, target_logit, wsum = self.stats
        self.stats = (lse[:n], target_logit[:n], shared.part(wsum, 0, n))
        self.entropy, self.argmax = shared.part(self.entropy, 0, n), shared.part(self.argmax, 0, n)
        self.grad_positions = shared.part(self.grad_positions, 0, n)

    def fused_buffers(self) -> tuple:
        """The fused buffers, whose first rows each chunk takes: (gradient, tile maxima,
        partial lse, partial weighted sums or None)."""
        return self.grad, self.block_max, self.partial_lse, self.partial_wsum

    def chunk_outputs(self, start: int, stop: int) -> dict:
        """``chunk_softmax_grad``'s output arguments for the positions [start, stop)."""
        return dict(
            grad=self.grad[: stop - start],
            out=tuple(shared.part(s, start, stop) for s in self.stats),
            entropy_out=shared.part(self.entropy, start, stop),
            argmax_out=shared.part(self.argmax, start, stop),
        )

    def add_gradients(self, start: int, stop: int, h: torch.Tensor, classifier) -> None:
        """The chunk's shares of the gradients from its logits' gradient (``h``: its hidden
        positions, ``classifier`` in the compute dtype)."""
        grad = self.grad[: stop - start]
        if self.stage is not None:
            self.grad_positions[start:stop] = shared.matmul(
                grad, classifier, out=self.stage[: stop - start]
            )
        elif self.grad_positions is not None:
            shared.matmul(grad, classifier, out=self.grad_positions[start:stop])
        if self.grad_classifier is not None:
            shared.addmm_(self.grad_classifier, grad.t(), h, first=start == 0)
        if self.grad_bias is not None:
            self.grad_bias += grad.sum(0, dtype=torch.float32)

    def result(
        self, head: HeadInputs, rows: RowTargets, layout: RowLayout, vocab: int
    ) -> ForwardOut:
        """The loss over ``vocab`` classes, each row's statistics and the gradients in the
        inputs' dtypes (hidden's in the buffer's: float32 for a shard's partial sum)."""
        lse, target_logit, wsum = (shared.rows_of(layout, s) for s in self.stats)
        out = ForwardOut(finish_loss(lse, target_logit, wsum, rows, head.spec, vocab), lse)
        out.stats = RowStats(
            lse,
            target_logit,
            wsum,
            entropy=shared.rows_of(layout, self.entropy),
            argmax=shared.rows_of(layout, self.argmax),
        )
        if self.grad_positions is not None:
            out.grad_hidden = shared.hidden_grad(self.grad_positions, layout, head.hidden)
        out.grad_classifier = shared.rounded(head.classifier.dtype, self.grad_classifier)
        out.grad_bias = None if self.grad_bias is None else self.grad_bias.to(head.bias.dtype)
        return out


def fast_forward(
    head: HeadInputs,
    rows: RowTargets,
    *,
    needs: Needs,
    extras: frozenset[str] = frozenset(),
    split: SplitVocabulary | None = None,
    kept: KeptRows | None = None,
) -> ForwardOut:
    """Fast mode: loss, lse and the gradients for a unit upstream gradient, computed in
    chunks of positions (three GEMMs); with ``extras`` (FAST_EXTRA_STATS) also those of each
    row, from the same pass over each chunk's logits; with ``split``, over a shard of a split
    vocabulary; with ``kept``, over the kept rows, the first chunk's GEMM queued before their
    count is waited for (``interface.Implementation``)."""
    if not extras <= policy.FAST_EXTRA_STATS or (split is not None and extras):
        raise ValueError(f"fast mode computes no {sorted(extras)} here (lean mode does)")
    if split is not None and kept is not None:
        raise ValueError("fast mode over a split vocabulary takes no kept-first rows")
    run = _FastRun.plan(head, rows, needs, extras, split, kept)
    first = min(run.chunk, run.layout.n_positions)
    chunk_logits = run.logits(0, first, None if kept is None else kept.device_count)
    # After the first chunk's GEMM is queued, so that the GPU runs it while the host builds
    # pass 2's coefficients (and waits for the kept rows' count): at a call's start, or after
    # compaction's host synchronisation, it has nothing else to do.
    run.coefs = _PositionCoefficients.of(run.head, run.rows, run.layout, split, run.targets)
    end = run.layout.n_positions if run.kept is None else run.kept.count()
    start, stop = 0, min(first, end)
    run.gradients(start, stop, chunk_logits)  # (no rows at all: the classifier's zero gradient)
    for start in range(stop, end, run.chunk):
        stop = min(start + run.chunk, end)
        run.gradients(start, stop, run.logits(start, stop))
    return run.result(end)


@dataclasses.dataclass
class _FastRun:
    """One fast-mode call's plan and buffers: its operands in the compute dtype, row layout,
    chunk size, whether the GEMM is fused, and the chunk steps (``logits``, ``gradients``)."""

    head: HeadInputs
    rows: RowTargets
    split: SplitVocabulary | None
    kept: KeptRows | None
    hidden: torch.Tensor
    classifier: torch.Tensor
    layout: RowLayout
    fused: bool
    chunk: int
    targets: torch.Tensor
    positions: torch.Tensor
    out: _FastBuffers
    static_args: dict
    gemm: LogitsExpLaunch | None  # fused: the logits GEMM's launch, built once a call
    coefs: _PositionCoefficients | None = None
    pass2: ScaledExpGradLaunch | None = None  # fused: built with the coefficients

    @staticmethod
    def plan(head, rows, needs: Needs, extras, split, kept) -> _FastRun:
        hidden, classifier, bias = (
            shared.rounded(head.compute_dtype, t) for t in (head.hidden, head.classifier, head.bias)
        )
        # Fused (the GEMM writes scaled exponentials): not where pass 2 would need more of
        # each logit than that (softcap's derivative, the entropy, the argmax).
        whole_rows = policy.fast_needs_whole_rows(
            softcap=bool(head.spec.softcap),
            entropy="entropy" in extras,
            argmax="argmax" in extras,
        )
        layout, problem, fused = _plan(head, hidden, whole_rows, split)
        if fused and whole_rows:  # pass 2 would compute a plausible wrong gradient
            raise RuntimeError("fast mode fused a chunk that needs its whole float32 logits")
        if kept is not None and not fused:
            # cuBLAS's logits GEMM cannot stop at a count only the GPU holds: wait for it now.
            head, rows = kept.restricted(head, rows)
            hidden, kept = hidden[:, : kept.count()], None
            layout, problem, fused = _plan(head, hidden, whole_rows, split)
        if fused and classifier.stride(1) != 1:
            # The fused GEMM loads classifier rows by TMA: a (D, V)-stored head (W.t(),
            # Conv1D) is copied row-major, as lean's GEMMs copy it (check_operands); under AMP
            # the transposed rounded copy is dropped after it. Not counted by the policy,
            # which sees no strides.
            classifier = classifier.contiguous()
        chunk = policy.fast_run_rows(problem, needs.classifier, head.budget_bytes, fused)
        in_float32 = policy.sums_classifier_in_float32(problem, needs.classifier, fused)
        positions = layout.positions()
        out = _FastBuffers(
            head,
            layout,
            needs,
            chunk,
            hidden,
            extras=extras,
            split=bool(split),
            fused_tiles=shared.fused_config_of(head, positions, classifier) if fused else None,
            classifier_sum_dtype=torch.float32 if in_float32 else None,
        )
        static_args = dict(
            class_weights=head.class_weights,
            logit_scale=head.spec.logit_scale,
            softcap=head.spec.softcap,
            smoothing=head.spec.needs_wsum,
            bias=bias,
        )
        targets = _PositionCoefficients.targets_of(head, rows, layout, split)
        if fused and split is not None:
            # The GEMM writes the target logit of the rows whose target is in the shard; the
            # others' is 0 in the shard's statistics (the combine sums them over the ranks).
            out.stats[1].zero_()
        return _FastRun(
            head=head,
            rows=rows,
            split=split,
            kept=kept,
            hidden=hidden,
            classifier=classifier,
            layout=layout,
            fused=fused,
            chunk=chunk,
            targets=targets,
            positions=positions,
            out=out,
            static_args=static_args,
            gemm=_fused_gemm_launch(positions, classifier, targets, out, static_args)
            if fused
            else None,
        )

    def logits(self, start: int, stop: int, row_limit: torch.Tensor | None = None):
        """The chunk's logits GEMM (fused: its scaled exponentials), queued."""
        if self.fused:
            _fused_gemm(self.gemm, (start, stop), row_limit)
            return None
        chunk_logits = self.out.logits[: stop - start]
        shared.matmul(self.positions[start:stop], self.classifier.t(), out=chunk_logits)
        return chunk_logits

    def gradients(self, start: int, stop: int, chunk_logits) -> None:
        """The chunk's pass 2 (its gradient, in place) and its shares of the gradients."""
        out = self.out
        if stop > start and self.fused:
            if self.pass2 is None:  # (the coefficients come after the first chunk's GEMM)
                lse_given = self.split is not None
                self.pass2 = _fused_pass2_launch(self.coefs, self.static_args, out, lse_given)
            if self.split is not None:
                _combine_fused_chunk(out, (start, stop), self.split)
            self.pass2.launch(start, stop)
        elif stop > start:  # (no rows: only the classifier's gradient, zero, is written)
            kernel_args = dict(self.static_args, **self.coefs.chunk(start, stop))
            if self.split is None:
                chunk_softmax_grad(chunk_logits, **kernel_args, **out.chunk_outputs(start, stop))
            else:
                _shard_chunk(chunk_logits, kernel_args, out, (start, stop), self.split)
        out.add_gradients(start, stop, self.positions[start:stop], self.classifier)

    def result(self, end: int) -> ForwardOut:
        """The outputs, of the first ``end`` positions where the rows were kept first."""
        head, rows, layout = self.head, self.rows, self.layout
        if self.kept is not None:  # the outputs of the kept rows alone
            head, rows = self.kept.restricted(head, rows)
            self.out.truncate(end)
            layout = row_layout(self.hidden[:, :end], head.spec.shift)
        vocab = head.vocab if self.split is None else self.split.size
        return self.out.result(head, rows, layout, vocab)


def _plan(head: HeadInputs, hidden: torch.Tensor, whole_rows: bool, split) -> tuple:
    """(row layout, policy problem, fused?) of a fast-mode call on ``hidden`` (its hidden in
    the compute dtype)."""
    layout = row_layout(hidden, head.spec.shift)
    problem = shared.problem(layout, head, hidden)
    if split is not None:  # every rank's chunks alike: one collective each
        problem = dataclasses.replace(problem, vocab=split.share)
    return layout, problem, policy.fast_fuses_exp(problem, whole_rows)


def _fused_gemm_launch(
    positions: torch.Tensor,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    out: _FastBuffers,
    static_args: dict,
) -> LogitsExpLaunch:
    """The fused logits GEMM (``logits_exp``) over the call's positions, its operands checked
    and its per-call arguments built once for every chunk."""
    return LogitsExpLaunch(
        positions,
        classifier,
        targets,
        out.stats[1],
        out.fused_buffers(),
        logit_scale=static_args["logit_scale"],
        bias=static_args["bias"],
        class_weights=static_args["class_weights"],
        config=out.fused_tiles,
    )


def _fused_gemm(gemm: LogitsExpLaunch, span: tuple, row_limit: torch.Tensor | None) -> None:
    """The scaled exponentials of the positions [start, stop) (``span``) from the logits
    GEMM's epilogue, with their tile maxima, partial lse (and weighted sums) and target
    logits; ``row_limit``: the chunk's rows past a count on the device are left."""
    gemm.launch(*span, row_limit)


def _fused_pass2_launch(
    coefs: _PositionCoefficients, static_args: dict, out: _FastBuffers, lse_given: bool
) -> ScaledExpGradLaunch:
    """After ``_fused_gemm``, per chunk: the gradient in place, and the rows' lse (and
    weighted sums) from the GEMM's partials, in one launch (``scaled_exp_grad``), over the
    call's positions; ``lse_given``: the rows' lse is read (a shard's: ``_combine_fused_chunk``
    wrote the whole vocabulary's)."""
    lse, target_logit, wsum = out.stats
    return ScaledExpGradLaunch(
        out.fused_buffers(),
        coefs.targets,
        target_logit,
        (coefs.p_base, coefs.p_per_lse, coefs.coef_t, coefs.coef_w),
        lse,
        wsum=None if out.partial_wsum is None else wsum,
        logit_scale=static_args["logit_scale"],
        smoothing=static_args["smoothing"],
        class_weights=static_args["class_weights"],
        max_block=out.fused_tiles.block_v,
        lse_given=lse_given,
    )


def _combine_fused_chunk(out: _FastBuffers, span: tuple, split: SplitVocabulary) -> None:
    """A fused chunk of a vocabulary shard: its rows' statistics over the shard from the GEMM's
    per-tile partials (as ``scaled_exp_grad`` reduces them: -inf for an empty shard), combined
    over the ranks into the whole vocabulary's, in the call's statistics."""
    start, stop = span
    n = stop - start
    stats = tuple(shared.part(s, start, stop) for s in out.stats)
    lse, target_logit, wsum = stats
    torch.logsumexp(out.partial_lse[:n], dim=1, out=lse)
    if wsum is not None:
        torch.sum(out.partial_wsum[:n], dim=1, out=wsum)
    _store_combined(stats, split.combine(RowStats(lse, target_logit, wsum)))


def _store_combined(stats: tuple, whole: RowStats) -> None:
    """The whole vocabulary's (lse, target logit, wsum) over a chunk's shard statistics."""
    for mine, combined in zip(stats, (whole.lse, whole.target_logit, whole.wsum)):
        if mine is not None:
            mine.copy_(combined)


def _shard_chunk(
    logits: torch.Tensor, kernel_args: dict, out: _FastBuffers, span: tuple, split
) -> None:
    """A chunk of a vocabulary shard's logits: its statistics over the shard (one read),
    combined over the ranks, then its gradient with the whole vocabulary's lse."""
    start, stop = span
    stats = tuple(shared.part(s, start, stop) for s in out.stats)
    coefs = ("p_base", "p_per_lse", "coef_t", "coef_w")
    stat_args = {k: v for k, v in kernel_args.items() if k not in coefs}
    chunk_row_stats(logits, **stat_args, out=stats)
    _store_combined(stats, split.combine(RowStats(*stats)))
    chunk_softmax_grad(logits, **kernel_args, grad=out.grad[: stop - start], lse=stats[0])
