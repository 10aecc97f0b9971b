"""Fast mode over shards of a split vocabulary (``SplitVocabulary``), in one process.

Each shard runs ``fast_forward`` in turn; its ``combine`` stands in for the all-gather with the
other shards' statistics of the same rows (the lean path's ``logit_stats``), so both
implementations (the Triton one in the interpreter on CPU) are checked against the float64
oracle without a process group: the loss, the sum of the shards' hidden partials, and each
shard's rows of the classifier's and bias's gradients. The Triton path runs both chunk forms:
whole float32 rows (``chunk_row_stats``) and the fused GEMM's partials (``logits_exp``, the
shard's statistics reduced from them, ``scaled_exp_grad`` given the combined lse), the latter
where ``policy.fast_fuses_exp`` would allow it on a GPU (not with a softcap).
``tests/distributed`` runs the op.
"""

from __future__ import annotations

import os

import pytest
import torch
from oracle import GRAD_RTOL, LOSS_RTOL, gradient_scale, loss_scale, oracle, rel_error
from strategies import build_case

from cce_compile import policy
from cce_compile.implementations import torch_path
from cce_compile.implementations.interface import HeadInputs, Needs, RowStats, SplitVocabulary
from cce_compile.loss_math import LossSpec, row_targets

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = {
    # 13 rows in chunks of 4 on the PyTorch path (``budget``: 4 rows of the share's logits)
    "bias-chunks": dict(bias=True),
    "smoothing-weights-softcap-z_loss-shift": dict(
        label_smoothing=0.1, class_weights=True, softcap=3.0, logit_scale=1.3, z_loss=1e-3, shift=1
    ),
    "ignored-sum": dict(ignored_fraction=0.5, reduction="sum"),
}


def _implementations() -> list:
    """(implementation, the fused chunk form where a GPU would take it)."""
    found = [pytest.param((torch_path, False), id="torch_path")]
    if DEVICE == "cuda" or INTERPRETING:
        from cce_compile.implementations import triton_path

        found.append(pytest.param((triton_path, False), id="triton_path-whole_rows"))
        found.append(pytest.param((triton_path, True), id="triton_path-fused"))
    return found


def _combine_with(every: list[RowStats | None]):
    """A ``combine`` for the shard at the None of ``every`` (each shard's statistics of every
    row): the next rows' statistics of all shards, chunk by chunk, combined in shard order as
    the all-gather's ranks are (every shard then gets the same bits)."""
    done = [0]

    def combine(local: RowStats) -> RowStats:
        rows = slice(done[0], done[0] + local.lse.numel())
        done[0] = rows.stop
        parts = [
            local
            if s is None
            else RowStats(
                s.lse[rows], s.target_logit[rows], None if s.wsum is None else s.wsum[rows]
            )
            for s in every
        ]
        lse = torch.logsumexp(torch.stack([p.lse for p in parts]), 0)
        target = torch.stack([p.target_logit for p in parts]).sum(0)
        wsum = None if local.wsum is None else torch.stack([p.wsum for p in parts]).sum(0)
        return RowStats(lse, target, wsum)

    return combine


def _stats(head: HeadInputs) -> RowStats:
    """A shard's statistics of every row (lean's forward; an empty shard's by definition)."""
    if head.vocab:
        return torch_path.logit_stats(head, all_rows=True)
    rows = head.hidden.shape[1] - head.spec.shift
    zeros = torch.zeros(rows, device=head.hidden.device)
    return RowStats(zeros - float("inf"), zeros, zeros)


@pytest.mark.parametrize("impl", _implementations())
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("shards", [(17, 10), (27, 0)], ids=["uneven", "empty_shard"])
def test_shards_add_up_to_the_whole_vocabulary(impl, name, shards, monkeypatch):
    impl, fused = impl
    chunk_forms = []
    policy_fuses = policy.fast_fuses_exp

    def fuses(problem, whole_rows):
        chosen = (not whole_rows) if fused else policy_fuses(problem, whole_rows)
        chunk_forms.append(chosen)
        return chosen

    monkeypatch.setattr(policy, "fast_fuses_exp", fuses)
    vocab = sum(shards)
    case = build_case(leading=(1, 13), dim=8, vocab=vocab, seed=4, **CASES[name])
    spec = LossSpec(**{k: v for k, v in case.options().items() if k != "class_weights"})
    weights = None if case.class_weights is None else case.class_weights.to(DEVICE)
    rows = row_targets(case.targets.to(DEVICE), weights, spec, vocab)
    starts = [0, shards[0]]
    share = -(-vocab // len(shards))
    budget = 4 * share * 12  # 4 rows per chunk on the PyTorch path (cpu_chunk_rows)

    def head(start: int, size: int) -> HeadInputs:
        def part(t):
            return None if t is None else t[start : start + size].to(DEVICE)

        return HeadInputs(
            case.hidden.to(DEVICE),
            case.classifier[start : start + size].to(DEVICE),
            case.targets.to(DEVICE),
            part(case.bias),
            part(case.class_weights),
            spec,
            budget,
            col_start=start,
        )

    heads = [head(start, size) for start, size in zip(starts, shards)]
    stats = [_stats(h) for h in heads]
    needs = Needs(hidden=True, classifier=True, bias=case.bias is not None)
    outs = []
    for i, shard_head in enumerate(heads):
        every = [None if j == i else s for j, s in enumerate(stats)]
        split = SplitVocabulary(vocab, share, _combine_with(every))
        outs.append(impl.fast_forward(shard_head, rows, needs=needs, split=split))
    if impl is not torch_path:
        assert set(chunk_forms) == {fused and not case.softcap}, chunk_forms

    for leaf in case.leaves():
        leaf.requires_grad_()
    expected = oracle(case)
    leaves = case.leaves()
    want = torch.autograd.grad(expected, leaves)
    scales = gradient_scale(case, torch.ones(()), None, leaves)
    for out in outs:
        assert rel_error(out.loss.cpu(), expected, loss_scale(case)) <= LOSS_RTOL[torch.float32]
    grad_hidden = sum(o.grad_hidden for o in outs)
    assert all(o.grad_hidden.dtype == torch.float32 for o in outs)
    got = [grad_hidden, torch.cat([o.grad_classifier for o in outs])]
    if case.bias is not None:
        got.append(torch.cat([o.grad_bias for o in outs]))
    for label, g, w, scale in zip(("hidden", "classifier", "bias"), got, want, scales):
        err = rel_error(g.cpu(), w, scale)
        assert err <= GRAD_RTOL[torch.float32], f"grad_{label}: {err:.2e}"
