"""Bad arguments to vocab_parallel_cross_entropy: a clear error naming the argument, raised
before any collective (so these run in one process, without a process group)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cce_compile.distributed import vocab_parallel_cross_entropy

D, ROWS = 8, 5  # this rank's shard: 5 of 12 classes


def _call(**changes):
    args = dict(
        hidden=torch.randn(2, 3, D),
        classifier=torch.randn(ROWS, D),
        targets=torch.zeros(2, 3, dtype=torch.long),
        bias=None,
        vocab_start=0,
        vocab_size=12,
        group="unused",  # a name: nothing is resolved before the op runs
    )
    args.update(changes)
    return vocab_parallel_cross_entropy(**args)


@pytest.mark.parametrize(
    "changes, error, names",
    [
        pytest.param(dict(vocab_start=None), ValueError, "vocab_start", id="no-vocab_start"),
        pytest.param(dict(vocab_start=10), ValueError, "vocab_start", id="shard-past-vocab"),
        pytest.param(
            dict(class_weights=torch.ones(ROWS)), ValueError, "class_weights", id="shard-weights"
        ),
        pytest.param(dict(bias=torch.zeros(12)), ValueError, "bias", id="full-bias"),
        pytest.param(
            dict(classifier=torch.randn(ROWS, D + 1)), ValueError, "classifier", id="bad-dim"
        ),
        pytest.param(dict(targets=torch.zeros(2, 3)), TypeError, "targets", id="float-targets"),
        pytest.param(
            dict(targets=torch.zeros(2, 4, dtype=torch.long)), ValueError, "targets", id="shape"
        ),
        pytest.param(dict(reduction="avg"), ValueError, "reduction", id="reduction"),
        pytest.param(dict(label_smoothing=1.5), ValueError, "label_smoothing", id="smoothing"),
        pytest.param(dict(shift=3), ValueError, "shift", id="shift-too-large"),
        pytest.param(
            dict(classifier=torch.randn(ROWS, D, dtype=torch.bfloat16)),
            TypeError,
            "classifier",
            id="mixed-dtypes",
        ),
        pytest.param(dict(group=3), TypeError, "group", id="group-type"),
        pytest.param(dict(vocab_start=0.5), TypeError, "vocab_start", id="float-start"),
        pytest.param(dict(vocab_size="12"), TypeError, "vocab_size", id="str-size"),
        pytest.param(
            dict(logit_scale=torch.tensor(2.0, requires_grad=True)),
            NotImplementedError,
            "logit_scale or softcap tensor that requires grad",
            id="scale-needing-grad",
        ),
    ],
)
def test_bad_argument_is_named(changes, error, names):
    with pytest.raises(error, match=names):
        _call(**changes)


@pytest.mark.parametrize(
    ("value", "error"),
    [
        pytest.param(True, TypeError, id="bool"),
        pytest.param(np.bool_(True), TypeError, id="numpy-bool"),
        pytest.param(torch.tensor(True), TypeError, id="bool-tensor"),
        pytest.param(torch.tensor(3.0), TypeError, id="float-tensor"),
        pytest.param(-100.0, TypeError, id="float"),
        pytest.param(2**63, ValueError, id="above-int64"),
    ],
)
def test_ignore_index_refused_like_pytorch(value, error):
    with pytest.raises(error, match="ignore_index"):
        _call(ignore_index=value)


def test_a_one_rank_group_must_hold_the_whole_vocabulary():
    """One rank: its shard is the vocabulary, or the loss would be over fewer classes."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with pytest.raises(ValueError, match="whole vocabulary"):
            _call(group=None)  # classes [0, 5) of 12
        assert torch.isfinite(_call(group=None, vocab_size=ROWS))
    finally:
        if created:
            dist.destroy_process_group()


def test_the_vocabulary_parallel_function_tells_mode_its_softcap(mode_calls):
    """``decide.mode`` hears whether the call has a softcap: a shard's fast chunks are then
    whole float32 rows, else the fused GEMM's scaled exponentials (its statistics combined
    from the GEMM's partials), and auto sizes them so (``policy.fast_needs_whole_rows``),
    within a vocabulary-parallel call's budget (``policy.VOCAB_PARALLEL_BUDGET_SCALE``)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        _call(group=None, vocab_size=ROWS)
        _call(group=None, vocab_size=ROWS, softcap=5.0)
    finally:
        if created:
            dist.destroy_process_group()
    assert [call.get("softcap") for call in mode_calls] == [False, True]
    assert [call.get("vocab_parallel") for call in mode_calls] == [True, True]


def test_the_lean_backward_plans_with_the_forwards_budget(monkeypatch):
    """The lean backward recomputes with the budget its forward planned with (twice the
    fraction of the share's logits), not the single-device one of the rank's own shard."""
    import torch.distributed as dist

    from cce_compile import decide
    from cce_compile.op import dispatch

    budgets = []
    head_inputs = dispatch.head_inputs

    def recording(args, budget, **kw):
        budgets.append(("backward" if args.has("grad_loss") else "forward", budget))
        return head_inputs(args, budget, **kw)

    monkeypatch.setattr(dispatch, "head_inputs", recording)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        rows, vocab = 4096, 512  # a budget over policy.MIN_BUDGET
        hidden = torch.randn(1, rows, D, requires_grad=True)
        classifier = torch.randn(vocab, D, requires_grad=True)
        targets = torch.randint(0, vocab, (1, rows))
        vocab_parallel_cross_entropy(
            hidden, classifier, targets, vocab_start=0, vocab_size=vocab, mode="lean"
        ).backward()
    finally:
        if created:
            dist.destroy_process_group()
    problem = decide.problem_of(hidden, classifier, 0, None, vocab=vocab)
    planned = decide.budget_bytes(problem, vocab_parallel=True)
    assert planned > decide.budget_bytes(problem)
    assert {phase for phase, _ in budgets} == {"forward", "backward"}
    assert {budget for _, budget in budgets} == {planned}, budgets
