"""The neutral interface between the op and its implementations.

An implementation (``torch_path`` for any device, ``triton_path`` for CUDA) is a module that
provides the functions of :class:`Implementation`. Shapes follow the op's canonical form:
``hidden`` (B, T, D), ``classifier`` (V, D), ``targets`` (B, T); the loss's rows are
(b, t < T - shift), flattened to N = B * (T - shift).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch

from ..loss_math import LossSpec, RowCoefficients, RowTargets


@dataclasses.dataclass(frozen=True)
class Needs:
    """Which gradients the caller wants."""

    hidden: bool = False
    classifier: bool = False
    bias: bool = False

    @property
    def any(self) -> bool:
        return self.hidden or self.classifier or self.bias

    def without(self, served: Needs) -> Needs:
        """The needs that ``served`` does not cover."""
        return Needs(
            self.hidden and not served.hidden,
            self.classifier and not served.classifier,
            self.bias and not served.bias,
        )


@dataclasses.dataclass
class ForwardOut:
    loss: torch.Tensor  # float32: a scalar, or (N,) for reduction 'none'
    lse: torch.Tensor  # (N,) float32
    # Fast mode, for a unit upstream gradient, each in its input's dtype: (B, T, D), (V, D), (V,)
    grad_hidden: torch.Tensor | None = None
    grad_classifier: torch.Tensor | None = None
    grad_bias: torch.Tensor | None = None
    keep_blocks: torch.Tensor | None = None  # gradient filtering: (N, blocks) uint8
    row_index: torch.Tensor | None = None  # the rows computed on (compaction.py), int64
    # Fast mode: the rows' statistics with the extras asked for (the row metrics' sources).
    stats: RowStats | None = None
    # The op's row metrics by name (row_metrics.py), (N,) each: filled by the dispatcher.
    metrics: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


Gradients = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
Coefficients = RowCoefficients  # dz's per-row coefficients (loss_math owns their math)


@dataclasses.dataclass
class RowStats:
    """Per-row statistics of the logits over the classes an implementation was given."""

    lse: torch.Tensor  # (N,) float32 logsumexp_j z_ij
    target_logit: torch.Tensor  # (N,) float32 z_it, 0 where t is not among the classes
    wsum: torch.Tensor | None  # (N,) float32 sum_j w_j z_ij, with label smoothing only
    block_lse: torch.Tensor | None = None  # (blocks, N) per block of classes (filtering.py)
    # The extras (EXTRA_STATS), each only where asked for:
    entropy: torch.Tensor | None = None  # (N,) float32 -sum_j p_ij log p_ij
    argmax: torch.Tensor | None = None  # (N,) int64 first class of the largest logit
    lse_2z: torch.Tensor | None = None  # (N,) float32 logsumexp_j 2 z_ij
    zsum: torch.Tensor | None = None  # (N,) float32 sum_j z_ij (unweighted)


# The RowStats fields an implementation computes only when a call names them ("extras"; fast
# mode computes policy.FAST_EXTRA_STATS of them).
EXTRA_STATS = frozenset({"entropy", "argmax", "lse_2z", "zsum"})


@dataclasses.dataclass(frozen=True, eq=False)
class HeadInputs:
    """What every call of an implementation shares: the head's tensors in the canonical form,
    the loss's options, and how to compute (the rounding before the GEMMs, the memory budget).

    ``classifier`` (and ``bias``, ``class_weights``) hold classes [col_start, col_start + V)
    of the vocabulary that ``targets`` index (a vocabulary split over ranks); targets outside
    that range contribute no target term."""

    hidden: torch.Tensor  # (B, T, D)
    classifier: torch.Tensor  # (V, D)
    targets: torch.Tensor  # (B, T), classes of the whole vocabulary
    bias: torch.Tensor | None  # (V,)
    class_weights: torch.Tensor | None  # (V,), these classes' weights
    spec: LossSpec
    budget_bytes: int  # the extra memory the call may take (policy.py)
    # The dtype the head's operands are rounded to before the GEMMs (autocast's rounding;
    # None: their own, which then agree).
    compute_dtype: torch.dtype | None = None
    col_start: int = 0

    @property
    def vocab(self) -> int:
        """V, the classes given (not the whole vocabulary's size when it is split)."""
        return self.classifier.shape[0]


class KeptRows:
    """The rows of a fast-mode call in compaction's kept-first order, before their count has
    reached the host: the first ``count()`` rows of the head's (1, N, D) hidden and (1, N)
    targets are those whose target counts, the rest are ignored rows. An implementation may
    queue its first chunk's logits GEMM before it asks ``count()`` (``device_count`` lets a
    kernel stop at the kept rows), so that the GPU has work while the host waits for the count
    and plans the rest; ``count()`` waits for the count alone, not for work queued after it."""

    def __init__(self, device_count: torch.Tensor, read: Callable[[], int]):
        self.device_count = device_count  # 0-d int64 on the head's device
        self._read = read
        self._count: int | None = None

    def count(self) -> int:
        """The number of kept rows (the first call waits for it: a host synchronisation)."""
        if self._count is None:
            self._count = self._read()
        return self._count

    def restricted(self, head: HeadInputs, rows: RowTargets) -> tuple[HeadInputs, RowTargets]:
        """``head`` and ``rows`` restricted to the kept rows."""
        n = self.count()
        kept = dataclasses.replace(head, hidden=head.hidden[:, :n], targets=head.targets[:, :n])
        return kept, rows.slice(0, n)


@dataclasses.dataclass(frozen=True)
class SplitVocabulary:
    """Fast mode over one rank's shard of a vocabulary split over a process group (the
    vocabulary-parallel op): the head's classes are [col_start, col_start + V_local) of
    ``size``. Each chunk's statistics over the shard become the whole vocabulary's through
    ``combine``, a collective every rank issues once per chunk, so every rank must run the
    same chunks: they are sized for ``share`` classes, the same number on every rank, never
    for the shard's own (uneven shards differ by a class)."""

    size: int  # V, the whole vocabulary: the loss's and the coefficients' class count
    share: int  # the classes each rank's chunks are sized for (decide.shard_vocab)
    # A chunk's (lse, target logit, wsum) over the shard -> over the whole vocabulary.
    combine: Callable[[RowStats], RowStats]


class Implementation(Protocol):
    """What an implementation provides: the lean path's two halves (``op.dispatch`` builds the
    loss and the backward from them with ``loss_math``), fast mode's fused forward, and one
    in-place scaling pass. Each of the first three computes over the classes of its
    :class:`HeadInputs`.

    One whose fast mode can start before the count of kept rows reaches the host also provides
    ``kept_first(valid) -> (order, count)``: the indices of the True entries of the 1-D bool
    ``valid`` ascending, then of the False ones (int64), and their count (0-d int64), on the
    device with no synchronisation (``KeptRows``)."""

    def logit_stats(
        self,
        head: HeadInputs,
        *,
        all_rows: bool,
        block_lse: bool = False,
        extras: frozenset[str] = frozenset(),
    ) -> RowStats:
        """lse, target logit and (with smoothing) weighted sum of each row's logits over the
        head's classes (and with ``block_lse`` per block of classes, for filtering; and the
        ``RowStats`` fields named in ``extras``, a subset of EXTRA_STATS, for the op's row
        metrics). Without ``all_rows``, ignored rows' statistics may be skipped."""

    def gradients(
        self,
        head: HeadInputs,
        lse: torch.Tensor,
        coefs: Coefficients,
        *,
        needs: Needs,
        keep_blocks: torch.Tensor | None = None,
    ) -> Gradients:
        """Gradients from dz = (coef_p + coef_e * (z - lse)) * exp(z - lse) - coef_t * onehot
        - coef_w * w (``coefs``; no coef_e term without an entropy gradient) over the head's
        classes: hidden's in float32 (a partial sum when the vocabulary is split), the
        classifier's and bias's for those classes (float32 or the inputs' dtype).
        ``keep_blocks``: gradient filtering's mask (filtering.py)."""

    def fast_forward(
        self,
        head: HeadInputs,
        rows: RowTargets,
        *,
        needs: Needs,
        extras: frozenset[str] = frozenset(),
        split: SplitVocabulary | None = None,
        kept: KeptRows | None = None,
    ) -> ForwardOut:
        """Fast mode, over the whole vocabulary (``col_start`` 0): loss, lse and the gradients
        in ``needs`` for a unit upstream gradient of the loss, each in its input's dtype (the
        op hands them to autograd as they are), from the same chunks of logits (and in
        ``stats`` each row's ``extras``, a subset of policy.FAST_EXTRA_STATS, every row's:
        the caller masks ignored ones).

        ``kept`` (only for an implementation that provides ``kept_first``; never with
        ``split``): the head's rows are in compaction's kept-first order, shift 0, and the
        outputs cover the first ``kept.count()`` rows only.

        With ``split``, over one shard of a split vocabulary (``rows`` are the whole
        vocabulary's): per chunk, the shard's statistics, ``split.combine`` (one collective),
        then the gradient with the whole vocabulary's lse. Loss and lse are the whole
        vocabulary's; hidden's gradient is this shard's partial sum, in float32 (it is reduced
        over the ranks before its one rounding); no extras."""

    def scale_(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x *= scale in place with float32 math and one rounding; ``scale`` is a 0-d
        tensor."""
