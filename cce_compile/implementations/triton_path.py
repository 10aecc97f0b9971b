"""The CUDA implementation: Triton kernels plus cuBLAS GEMMs, same interface as ``torch_path``.

This module is the implementation (``interface.Implementation``) and holds lean mode; fast
mode is in ``triton_fast`` (``fast_forward``, re-exported here), and what both modes share
(tiles, cuBLAS GEMMs, rounding, ``scale_``, re-exported here) in ``triton_shared``.

Lean mode (``forward`` + ``backward``):
  forward   one fused kernel (``lse_forward``) -> per-row lse and target logit; nothing N x V.
  backward  for each vocabulary slab of ``width`` classes: ``logit_grad`` recomputes the slab's
            logits and writes their gradient (N x width, the compute dtype); then cuBLAS
            computes d classifier[slab] = slab.T @ hidden (written once, in the classifier's
            dtype) and d hidden += slab @ classifier[slab] into a float32 accumulator (N x D).
Mixed precision (``compute_dtype`` rounding float32 inputs, autocast's form): hidden is rounded
once; the classifier one slab of classes at a time in lean mode (no V x D copy), once in fast
mode (cuBLAS needs it whole per chunk); a float32 classifier's gradient is written in float32
directly (a bf16 one of float16 products through a float32 product: ``triton_shared.matmul``).
The sizes of slabs and chunks come from ``policy`` (the memory budget).

Everything here also runs on CPU tensors under TRITON_INTERPRET=1 (the kernel tests): there
the GEMMs run in float32 and slabs are float32, because the interpreter truncates when it
rounds to bfloat16.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import filtering, policy, row_metrics
from ..kernels.common import RowLayout, TileConfig, check_operands, row_layout
from ..kernels.kept_first import kept_first as kept_first  # the op calls it on this module
from ..kernels.logit_grad import LogitGradLaunch
from ..kernels.lse_forward import lse_forward, partial_blocks
from . import triton_shared as shared
from .interface import Coefficients, Gradients, HeadInputs, Needs, RowStats
from .triton_fast import fast_forward as fast_forward  # the op calls it on this module
from .triton_shared import scale_ as scale_  # the op calls it on this module


def available() -> bool:
    """Whether this implementation can run here: a CUDA device."""
    return torch.cuda.is_available()


def _slab_operands(
    head: HeadInputs, start: int, stop: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The classes [start, stop) of the head as the kernels take them: classifier and bias
    rounded to the compute dtype (one slab at a time: no V x D copy), class weights."""
    return (
        shared.rounded(head.compute_dtype, head.classifier[start:stop]),
        shared.rounded(head.compute_dtype, shared.part(head.bias, start, stop)),
        shared.part(head.class_weights, start, stop),
    )


def _slabs(vocab: int, width: int):
    """The slabs [start, stop) of ``width`` classes that cover ``vocab`` classes."""
    for start in range(0, vocab, width):
        yield start, min(start + width, vocab)


def _tile_width(columns: int, tile: int, vocab: int) -> int:
    """``columns`` rounded down to whole tiles, at least one tile, at most the vocabulary."""
    return min(vocab, max(tile, columns // tile * tile))


@dataclasses.dataclass
class _Partials:
    """``lse_forward``'s per-program partials of each row, (programs, N): the lse, and where
    asked the (weighted) sum of logits, the entropy of the program's softmax, the largest
    logit with its first class (int32), and the logsumexp of 2 z."""

    lse: torch.Tensor
    wsum: torch.Tensor | None
    entropy: torch.Tensor | None
    top: tuple[torch.Tensor, torch.Tensor] | None
    lse_2z: torch.Tensor | None

    @staticmethod
    def empty(
        programs: int, n_rows: int, device: torch.device, *, wsum: bool, extras: frozenset[str]
    ) -> _Partials:
        """Room for ``programs`` programs' partials of ``n_rows`` rows."""
        lse = torch.empty((programs, n_rows), dtype=torch.float32, device=device)

        def like(name: str) -> torch.Tensor | None:
            return torch.empty_like(lse) if name in extras else None

        top = None
        if "argmax" in extras:
            top = (torch.empty_like(lse), torch.empty_like(lse, dtype=torch.int32))
        return _Partials(
            lse, torch.empty_like(lse) if wsum else None, like("entropy"), top, like("lse_2z")
        )

    def outputs(self, first: int, last: int, target_logit: torch.Tensor) -> dict:
        """``lse_forward``'s output arguments for the programs [first, last)."""
        return dict(
            out=(self.lse[first:last], target_logit, shared.part(self.wsum, first, last)),
            entropy_out=shared.part(self.entropy, first, last),
            argmax_out=None if self.top is None else tuple(t[first:last] for t in self.top),
            lse_2z_out=shared.part(self.lse_2z, first, last),
        )

    def row_stats(
        self, target_logit: torch.Tensor, tile: int, block_lse: bool, sums: tuple[bool, bool]
    ) -> RowStats:
        """Each row's statistics over every program's classes (``block_lse``: also per block
        of classes, programs of ``tile`` classes); ``sums``: the summed logits are (wsum,
        zsum), each or both."""
        total = self.wsum.sum(0) if self.wsum is not None else None
        blocks = filtering.block_lse_from_partials(self.lse, tile) if block_lse else None
        lse = torch.logsumexp(self.lse, dim=0)
        stats = RowStats(lse, target_logit, total if sums[0] else None, blocks)
        stats.zsum = total if sums[1] else None
        if self.entropy is not None:
            stats.entropy = row_metrics.mixture_entropy(self.lse, self.entropy, lse)
        if self.top is not None:  # the first program holding the row's largest logit
            top, arg = self.top
            program = top.argmax(0, keepdim=True)
            stats.argmax = arg.gather(0, program)[0].long()
        if self.lse_2z is not None:
            stats.lse_2z = torch.logsumexp(self.lse_2z, dim=0)
        return stats


def logit_stats(
    head: HeadInputs,
    *,
    all_rows: bool,
    block_lse: bool = False,
    extras: frozenset[str] = frozenset(),
) -> RowStats:
    """Per-row lse, target logit and weighted sum from per-tile partials (``lse_forward``);
    a classifier to be rounded is rounded one slab of classes at a time. ``block_lse``: also
    the lse per block of classes (filtering.py), from the same partials; ``extras``: also the
    ``RowStats`` fields named (interface.EXTRA_STATS), from per-program partials combined the
    same way."""
    spec, vocab = head.spec, head.vocab
    # The kernel's one sum of logits serves the plain sum (zsum) and the smoothing's weighted
    # one alike unless class weights make them differ.
    zsum = "zsum" in extras
    if zsum and spec.needs_wsum and head.class_weights is not None:
        raise NotImplementedError(
            "the mean logit with label smoothing and class_weights in one call is not served"
        )
    hidden = shared.rounded(head.compute_dtype, head.hidden)
    config = shared.config_of(head, hidden)
    layout = row_layout(hidden, spec.shift)
    hidden = layout.matrix  # the layout's copy, where it makes one: once, not per slab
    tile = config.block_v * config.tiles_per_program
    problem = shared.problem(layout, head, hidden)
    width = _tile_width(policy.forward_slab_columns(problem, head.budget_bytes), tile, vocab)
    needs_sum = spec.needs_wsum or zsum
    partials = _Partials.empty(
        partial_blocks(vocab, config), layout.n_rows, hidden.device, wsum=needs_sum, extras=extras
    )
    target_logit = torch.zeros(layout.n_rows, dtype=torch.float32, device=hidden.device)
    for start, stop in _slabs(vocab, width):
        classifier, bias, class_weights = _slab_operands(head, start, stop)
        lse_forward(
            hidden,
            classifier,
            head.targets,
            bias,
            class_weights if spec.needs_wsum else None,
            shift=spec.shift,
            ignore_index=spec.ignore_index,
            logit_scale=spec.logit_scale,
            softcap=spec.softcap,
            skip_ignored_tiles=not all_rows,
            needs_wsum=needs_sum,
            config=config,
            col_start=head.col_start + start,
            **partials.outputs(start // tile, partial_blocks(stop, config), target_logit),
        )
    return partials.row_stats(target_logit, tile, block_lse, (spec.needs_wsum, zsum))


class _SlabGradients:
    """The lean backward's gradients, filled slab by slab of classes: hidden's by position
    (float32, accumulated), the classifier's rows of each slab (written once, in its dtype),
    the bias's (float32)."""

    def __init__(self, head: HeadInputs, layout: RowLayout, needs: Needs):
        vocab, dim = head.classifier.shape
        device, n_positions = head.classifier.device, layout.n_positions
        self.hidden = (
            torch.empty((n_positions, dim), dtype=torch.float32, device=device)
            if needs.hidden
            else None
        )
        self.positions = layout.positions() if needs.classifier else None
        self.classifier = (
            torch.empty((vocab, dim), dtype=head.classifier.dtype, device=device)
            if needs.classifier
            else None
        )
        self.bias = torch.empty(vocab, dtype=torch.float32, device=device) if needs.bias else None

    def add(self, slab: torch.Tensor, classifier_slab: torch.Tensor, start: int, stop: int) -> None:
        """The gradients' shares of the slab of classes [start, stop) from its logits'
        gradient (``classifier_slab``: its rows in the compute dtype)."""
        if self.hidden is not None:
            shared.addmm_(self.hidden, slab, classifier_slab, first=start == 0)
        if self.classifier is not None:
            # Positions that are no loss row have zero gradient rows in the slab.
            shared.matmul(slab.t(), self.positions, out=self.classifier[start:stop])
        if self.bias is not None:
            self.bias[start:stop] = slab.sum(0, dtype=torch.float32)

    def result(self, layout: RowLayout, hidden: torch.Tensor) -> Gradients:
        grad_hidden = (
            None if self.hidden is None else shared.hidden_grad(self.hidden, layout, hidden)
        )
        return grad_hidden, self.classifier, self.bias


def _lean_slab_width(
    head: HeadInputs, layout: RowLayout, hidden: torch.Tensor, config: TileConfig, needs: Needs
) -> int:
    """The lean backward's classes per slab (``hidden`` in the compute dtype).

    Slabs start on filtering blocks, so that no tile straddles two; the same widths with and
    without filtering keep d hidden's slab-by-slab sum in one order (grad_filter=0 is then
    bit for bit the exact result)."""
    problem = shared.problem(layout, head, hidden)
    columns = policy.lean_slab_columns(problem, needs.hidden, head.budget_bytes)
    return _tile_width(columns, math.lcm(filtering.FILTER_BLOCK, config.block_v), head.vocab)


def gradients(
    head: HeadInputs,
    lse: torch.Tensor,
    coefs: Coefficients,
    *,
    needs: Needs,
    keep_blocks: torch.Tensor | None = None,
) -> Gradients:
    """Slab by slab of classes: ``logit_grad`` recomputes the slab's logits and writes their
    gradient, cuBLAS turns it into d hidden (float32, accumulated) and d classifier[slab]
    (written once, in the classifier's dtype) and the bias gradient (float32)."""
    spec = head.spec
    hidden = shared.rounded(head.compute_dtype, head.hidden)
    # Once here rather than in every slab's launch: the contiguous copies it may make.
    bias, class_weights, classifier = check_operands(
        hidden, head.classifier, head.targets, head.bias, head.class_weights, spec.shift
    )
    head = dataclasses.replace(head, classifier=classifier, bias=bias, class_weights=class_weights)
    layout = row_layout(hidden, spec.shift)
    hidden = layout.matrix  # the layout's copy, where it makes one: once, not per slab
    to_positions = layout.rows_to_positions
    coefs, lse_positions = coefs.mapped(to_positions), to_positions(lse)
    keep = None if keep_blocks is None else to_positions(keep_blocks)
    config = shared.config_of(head, hidden)
    width = _lean_slab_width(head, layout, hidden, config, needs)
    slab_buf = torch.empty(
        (layout.n_positions, width), dtype=shared.work_dtype(hidden), device=hidden.device
    )
    grads = _SlabGradients(head, layout, needs)
    # What every slab's launch shares (layout, checked vectors, descriptors), built once.
    slab_grad = LogitGradLaunch(
        hidden,
        head.targets,
        lse_positions,
        (coefs.p, coefs.t, coefs.w),
        slab_buf,
        shift=spec.shift,
        logit_scale=spec.logit_scale,
        softcap=spec.softcap,
        smoothing=spec.needs_wsum,
        config=config,
        keep=keep,
        entropy_coef=coefs.e,
        filter_block=filtering.FILTER_BLOCK,
    )
    for start, stop in _slabs(head.vocab, width):
        classifier_slab, bias_slab, weights_slab = _slab_operands(head, start, stop)
        slab = slab_grad.launch(
            classifier_slab, bias_slab, weights_slab, target_offset=head.col_start + start
        )
        grads.add(slab, classifier_slab, start, stop)
    return grads.result(layout, hidden)
