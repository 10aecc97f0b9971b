"""The per-row outputs the op returns besides the loss and lse: one declaration each.

Trainers ask the loss head for more than the loss: the entropy of each token's distribution (an
RL entropy bonus, or a logged metric), whether the target is the most likely class (token
accuracy), and DPO's and KTO's ``log sum_j p_j^2`` and mean logit. Each is a function of per-row
statistics that the implementations gather in the same pass as the lse (``interface.RowStats``),
so it costs no extra GEMM. A metric is declared here once; the op's argument and output lists
(``op.signature``), its fake kernel and autograd formula (``op.custom_ops``), the dispatcher that
computes the values (``op.dispatch``) and the public function read this table.

Only the entropy is differentiable (``loss_math``'s coef_e term); the others are metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class RowMetric:
    """One per-row output: its name (the op's output; ``return_<name>`` is its flag), dtype,
    value at ignored rows, the per-row statistics it is computed from (``RowStats`` fields)
    and how (``value(stats, lse, vocab)``, over the rows computed on)."""

    name: str
    dtype: torch.dtype
    ignored_value: float | int
    stats: frozenset[str]
    value: Callable[..., torch.Tensor]
    differentiable: bool = False
    doc: str = ""

    @property
    def flag(self) -> str:
        return f"return_{self.name}"


METRICS = (
    RowMetric(
        "entropy",
        torch.float32,
        0.0,
        frozenset({"entropy"}),
        lambda stats, lse, vocab: stats.entropy,
        differentiable=True,
        doc="-sum_j p_j log p_j, with its gradient",
    ),
    RowMetric(
        "argmax",
        torch.int64,
        -1,
        frozenset({"argmax"}),
        lambda stats, lse, vocab: stats.argmax,
        doc="the first class of the largest logit, as torch.argmax",
    ),
    RowMetric(
        "log_sum_sq_probs",
        torch.float32,
        0.0,
        frozenset({"lse_2z"}),
        lambda stats, lse, vocab: stats.lse_2z - 2.0 * lse,
        doc="log sum_j p_j^2 = logsumexp_j 2 z_j - 2 lse (WPO's weight), no gradient",
    ),
    RowMetric(
        "mean_logits",
        torch.float32,
        0.0,
        frozenset({"zsum"}),
        lambda stats, lse, vocab: stats.zsum / vocab,
        doc="sum_j z_j / V, the mean logit over the vocabulary, no gradient",
    ),
)
BY_NAME = {metric.name: metric for metric in METRICS}
NAMES = tuple(BY_NAME)
FLAGS = tuple(metric.flag for metric in METRICS)


def asked(args) -> tuple[RowMetric, ...]:
    """The metrics a bound call of the op asks for (its ``return_*`` flags)."""
    return tuple(metric for metric in METRICS if getattr(args, metric.flag))


def stats_needed(metrics: tuple[RowMetric, ...]) -> frozenset[str]:
    """The ``RowStats`` fields the metrics are computed from."""
    return frozenset().union(*(metric.stats for metric in metrics))


def mixture_entropy(
    part_lse: torch.Tensor, part_entropy: torch.Tensor, lse: torch.Tensor
) -> torch.Tensor:
    """Each row's entropy over classes split into parts (dim 0), from each part's lse and the
    entropy of its own softmax: H = sum_k q_k (H_k + lse - lse_k), q_k = exp(lse_k - lse).

    Every term is >= 0, so nothing cancels: lse - sum_j p_j z_j would subtract two terms of
    the logits' size. A part of no mass (q_k = 0, lse_k = -inf) adds 0; a NaN stays NaN."""
    gap = lse - part_lse
    share = torch.exp(-gap)
    return torch.where(share == 0, 0.0, share * (part_entropy + gap)).sum(0)


def values(
    metrics: tuple[RowMetric, ...],
    stats,
    lse: torch.Tensor,
    vocab: int,
    valid: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """Each metric's value per row, its ``ignored_value`` where ``valid`` is False (the
    kernels may skip ignored rows' tiles: their statistics are placeholders); every row's
    where ``valid`` is None (they were computed)."""
    found = {metric.name: metric.value(stats, lse, vocab) for metric in metrics}
    if valid is None:
        return found
    return {
        metric.name: torch.where(valid, found[metric.name], metric.ignored_value)
        for metric in metrics
    }
