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


# Every shard in the fused form, each chunk combined over ALL shards' fused statistics of that
# chunk (what the all-gather gives each rank), in chunks of 4 positions that do not divide the
# 13: the cases above run the Triton path in one chunk (fast mode's floor is 512-1024 rows)
# and combine it with lean's statistics of the other shards. (options, shards, seed)
FUSED_CHUNK_CASES = {
    # shards of 9, 10 and 8 classes planned for a share of 7, one empty; 2 x 7 positions
    "four-shards-one-empty-every-option-shift": (
        dict(
            bias=True,
            label_smoothing=0.1,
            class_weights=True,
            z_loss=1e-3,
            logit_scale=1.3,
            shift=1,
            leading=(2, 7),
        ),
        (9, 0, 10, 8),
        6,
    ),
    # the middle shard's logits all -inf (its statistics -inf, 0); targets on the first and
    # last class of the other shards
    "minus-inf-shard-targets-at-boundaries": (
        dict(bias=True, ignored_fraction=0.0, leading=(1, 13)),
        (10, 7, 10),
        9,
    ),
    # int32 targets: ignore_index 2**32 + 5 wraps to class 5, which counts (PyTorch's int64)
    "int32-ignore_index-outside-sum": (
        dict(
            target_dtype=torch.int32,
            ignore_index=2**32 + 5,
            ignored_fraction=0.4,
            reduction="sum",
            leading=(1, 13),
        ),
        (17, 10),
        14,
    ),
}


def _combined(parts: list[RowStats]) -> RowStats:
    """The shards' statistics of the same rows combined in shard order (the all-gather's)."""
    lse = torch.logsumexp(torch.stack([p.lse for p in parts]), 0)
    target = torch.stack([p.target_logit for p in parts]).sum(0)
    wsum = None if parts[0].wsum is None else torch.stack([p.wsum for p in parts]).sum(0)
    return RowStats(lse, target, wsum)


def _fused_shard_outputs(impl, heads: list[HeadInputs], rows, vocab: int, needs: Needs) -> list:
    """Each shard's fast_forward with every chunk combined over all shards' own statistics:
    a first run records each shard's per-chunk statistics (they do not depend on what the
    combine returns), the second combines the running shard's with the others' records."""
    share = -(-vocab // len(heads))
    recorded = [[] for _ in heads]
    for head, store in zip(heads, recorded):

        def record(local: RowStats, store=store) -> RowStats:
            kept = (local.lse, local.target_logit, local.wsum)
            store.append(RowStats(*(None if t is None else t.clone() for t in kept)))
            return local

        impl.fast_forward(head, rows, needs=needs, split=SplitVocabulary(vocab, share, record))
    outs = []
    for me, head in enumerate(heads):
        chunks = iter(range(len(recorded[me])))

        def combine(local: RowStats, me=me, chunks=chunks) -> RowStats:
            k = next(chunks)
            return _combined([local if j == me else r[k] for j, r in enumerate(recorded)])

        split = SplitVocabulary(vocab, share, combine)
        outs.append(impl.fast_forward(head, rows, needs=needs, split=split))
    assert [len(r) for r in recorded] == [4] * len(heads), "one combine per chunk of 4 positions"
    return outs


@pytest.mark.skipif(not (DEVICE == "cuda" or INTERPRETING), reason="needs the Triton path")
@pytest.mark.parametrize("name", list(FUSED_CHUNK_CASES))
def test_fused_shards_combine_chunk_by_chunk(name, monkeypatch):
    from cce_compile.implementations import triton_path

    options, shards, seed = FUSED_CHUNK_CASES[name]
    options = dict(options)
    leading = options.pop("leading")
    monkeypatch.setattr(policy, "fast_fuses_exp", lambda problem, whole_rows: not whole_rows)
    monkeypatch.setattr(policy, "fast_run_rows", lambda problem, *args, **kwargs: 4)
    vocab = sum(shards)
    case = build_case(leading=leading, dim=8, vocab=vocab, seed=seed, **options)
    if name.startswith("minus-inf"):
        case.bias[10:17] = float("-inf")
        case.targets = torch.tensor([[0, 9, 17, 26, 0, 9, 17, 26, 26, 17, 9, 0, 5]])
    spec = LossSpec(**{k: v for k, v in case.options().items() if k != "class_weights"})
    weights = None if case.class_weights is None else case.class_weights.to(DEVICE)
    rows = row_targets(case.targets.to(DEVICE), weights, spec, vocab)
    starts = [sum(shards[:i]) for i in range(len(shards))]

    def part(t, start, size):
        return None if t is None else t[start : start + size].to(DEVICE)

    heads = [
        HeadInputs(
            case.hidden.to(DEVICE),
            case.classifier[start : start + size].to(DEVICE),
            case.targets.to(DEVICE),
            part(case.bias, start, size),
            part(case.class_weights, start, size),
            spec,
            1 << 20,
            col_start=start,
        )
        for start, size in zip(starts, shards)
    ]
    needs = Needs(hidden=True, classifier=True, bias=case.bias is not None)
    outs = _fused_shard_outputs(triton_path, heads, rows, vocab, needs)

    for leaf in case.leaves():
        leaf.requires_grad_()
    expected = oracle(case)
    want = torch.autograd.grad(expected, case.leaves())
    scales = gradient_scale(case, torch.ones(()), None, case.leaves())
    for out in outs:
        assert rel_error(out.loss.cpu(), expected, loss_scale(case)) <= LOSS_RTOL[torch.float32]
    got = [sum(o.grad_hidden for o in outs), torch.cat([o.grad_classifier for o in outs])]
    if case.bias is not None:
        got.append(torch.cat([o.grad_bias for o in outs]))
    for label, g, w, scale in zip(("hidden", "classifier", "bias"), got, want, scales):
        err = rel_error(g.cpu(), w, scale)
        assert err <= GRAD_RTOL[torch.float32], f"grad_{label}: {err:.2e}"
