"""decide.py: each per-call decision, asked by every front door alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cce_compile
from cce_compile import config, decide, policy
from cce_compile.distributed.sharding import VocabShard
from cce_compile.loss_math import LossSpec

SHARD = VocabShard(start=4, rows=4, size=12, group_name="g")


def _tensors(rows=3, dim=5, vocab=8, dtype=torch.float32):
    hidden = torch.randn(2, rows, dim, dtype=dtype)
    classifier = torch.randn(vocab, dim, dtype=dtype)
    targets = torch.randint(0, vocab, (2, rows))
    return hidden, classifier, targets


@pytest.mark.parametrize(
    "change, shard, error, words",
    [
        ("classifier-1d", None, ValueError, "classifier must be 2-D"),
        ("classifier-1d", SHARD, ValueError, "classifier must be this rank's shard"),
        ("bias-shape", None, ValueError, "bias must be of shape (8,)"),
        ("bias-shape", SHARD, ValueError, "bias must be this rank's slice of shape (4,)"),
        ("weights-local", SHARD, ValueError, "class_weights must be of shape (12,)"),
        ("shard-overflow", SHARD, ValueError, "does not fit in vocab_size=12"),
        ("float-targets", None, TypeError, "class-probability targets"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_check_tensors_names_the_argument(change, shard, error, words):
    hidden, classifier, targets = _tensors(vocab=4 if shard else 8)
    bias = class_weights = None
    if change == "classifier-1d":
        classifier = classifier[:, 0]
    if change == "bias-shape":
        bias = torch.zeros(3)
    if change == "weights-local":
        class_weights = torch.ones(4)
    if change == "shard-overflow":
        classifier = torch.randn(9, hidden.shape[-1])
    if change == "float-targets":
        targets = targets.float()
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        decide.check_tensors(hidden, classifier, targets, bias, class_weights, shard)


def test_both_public_functions_take_their_validation_from_decide():
    """The single-device and the vocabulary-parallel door give one error for one mistake."""
    from cce_compile.distributed import vocab_parallel_cross_entropy

    hidden, classifier, targets = _tensors()
    for call in (
        lambda: cce_compile.linear_cross_entropy(hidden, classifier, targets.float()),
        lambda: vocab_parallel_cross_entropy(
            hidden, classifier, targets.float(), vocab_start=0, vocab_size=8, group="g"
        ),
    ):
        with pytest.raises(TypeError, match="class-probability targets are not supported"):
            call()


@pytest.mark.parametrize(
    "value, expected",
    [(-100, -100), (np.int64(7), 7), (torch.tensor(3), 3), (2**40, 2**40)],
    ids=["int", "numpy", "tensor", "beyond-int32"],
)
def test_ignore_index_accepts_what_pytorch_accepts(value, expected):
    assert decide.ignore_index_of(value) == expected


@pytest.mark.parametrize(
    "value, error", [(True, TypeError), (1.5, TypeError), (2**63, ValueError)], ids=str
)
def test_ignore_index_refuses_what_pytorch_refuses(value, error):
    with pytest.raises(error, match="ignore_index"):
        decide.ignore_index_of(value)


def _spec(**changes):
    hidden = torch.randn(2, 3, 4)
    options = dict(
        ignore_index=-100,
        reduction="mean",
        label_smoothing=0.0,
        softcap=None,
        logit_scale=1.0,
        shift=0,
        z_loss=0.0,
    )
    return decide.loss_spec(hidden, **{**options, **changes})


def test_loss_spec_is_typed_and_read_scalars_join_it():
    spec = _spec(softcap=torch.tensor(30.0), logit_scale=torch.tensor(0.5), shift=1)
    assert spec == LossSpec(shift=1)  # tensors are read only where the op serves the call
    read = decide.with_scalars(spec, torch.tensor(0.5), torch.tensor(30.0))
    assert (read.logit_scale, read.softcap) == (0.5, 30.0)
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        decide.with_scalars(spec, 1.0, torch.tensor(-1.0))


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(softcap=-3.0), "softcap must be a finite number > 0"),
        (dict(shift=3), r"shift must be in \[0, T=3\)"),
        (dict(reduction="avg"), "reduction must be one of"),
        (dict(label_smoothing=1.5), r"label_smoothing must be in \[0, 1\]"),
        (dict(z_loss=float("nan")), "z_loss must be a finite number"),
        (dict(logit_scale=torch.ones(2)), "logit_scale as a tensor must hold one real number"),
    ],
    ids=["softcap", "shift", "reduction", "smoothing", "z-loss", "scale-tensor"],
)
def test_loss_spec_refuses_bad_options(changes, words):
    with pytest.raises((ValueError, TypeError), match=words):
        _spec(**changes)


def test_grad_filter_rules():
    plain, capped = LossSpec(), LossSpec(label_smoothing=0.1, softcap=30.0)
    assert decide.grad_filter(None, "fast", plain) is None
    assert decide.grad_filter(2**-12, "auto", plain) == 2**-12
    with pytest.raises(ValueError, match="mode='fast' cannot use it"):
        decide.grad_filter(0.01, "fast", plain)
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        decide.grad_filter(1.0, None, plain)
    with pytest.raises(ValueError, match="label_smoothing under a softcap"):
        decide.grad_filter(0.01, None, capped)
    assert decide.filters(0.01, "lean", True) and not decide.filters(0.01, "fast", True)
    assert not decide.filters(0.01, "lean", False)


def test_site_grad_filter_is_the_setting_unless_the_options_conflict():
    with config.override(grad_filter=0.01):
        assert decide.site_grad_filter(0.0, 30.0) == 0.01
        assert decide.site_grad_filter(0.1, None) == 0.01
        assert decide.site_grad_filter(0.1, 30.0) is None
        assert decide.site_grad_filter(object(), 30.0) is None  # a symbolic smoothing


def test_problem_of_tensors_is_the_problem_of_their_sizes():
    hidden, classifier, _ = _tensors(rows=7, dim=5, vocab=8)
    plain = decide.problem_of(hidden, classifier, 2, None)
    f32 = (torch.float32, torch.float32)
    assert plain == policy.problem(10, (8, 5), torch.float32, "cpu", compute_dtype=None, dtypes=f32)
    amp = decide.problem_of(hidden, classifier, 0, torch.bfloat16)
    assert amp == policy.Problem(14, 8, 5, 2, True, True, device_type="cpu")


def _bf16_gpu_problem(rows: int, classifier_shape) -> policy.Problem:
    """The policy's problem of a bf16 call on a GPU, no autocast."""
    bf16 = (torch.bfloat16, torch.bfloat16)
    return policy.problem(rows, classifier_shape, bf16[0], "cuda", compute_dtype=None, dtypes=bf16)


def test_mode_explicit_fast_without_a_scalar_loss_is_an_error_and_filtering_takes_lean():
    problem = _bf16_gpu_problem(4096, (32000, 2048))
    call = dict(
        needs=dict(grad_hidden=True, grad_classifier=True, grad_bias=False),
        dtypes=(torch.bfloat16, torch.bfloat16, None),
    )
    with pytest.raises(ValueError, match="mode='fast' needs reduction"):
        decide.mode("fast", problem, grad_filter=None, reduction="none", **call)
    assert decide.mode("fast", problem, grad_filter=0.01, reduction="mean", **call) == "lean"
    with config.override(mode="fast"):  # the setting is not explicit: no error
        assert decide.mode(None, problem, grad_filter=None, reduction="none", **call) == "lean"


@pytest.mark.parametrize("hint", [8, 4096, policy.SYMBOLIC_PLAN_ROWS * 3], ids=str)
def test_planned_rows_plans_a_symbolic_count_for_larger_calls_under_a_fractional_budget(hint):
    grown = max(hint, min(policy.SYMBOLIC_PLAN_ROWS, hint * policy.SYMBOLIC_PLAN_GROWTH))
    assert decide.planned_rows(hint, symbolic=False) == hint
    assert decide.planned_rows(hint, symbolic=True) == grown
    assert decide.planned_rows(hint, symbolic=True, upper_bound=hint + 1) == min(grown, hint + 1)
    with config.override(memory_budget_mb=64):  # an absolute budget does not grow: the hint
        assert decide.planned_rows(hint, symbolic=True) == hint


def test_a_large_plan_takes_fast_where_the_example_size_takes_lean():
    """What ``planned_rows`` is for: at AMP, 4096 rows of a Llama-3 head leave no room for
    fast's chunks in 1/5 of their logits; the rows a symbolic graph plans for do."""
    amp = (torch.float32, torch.float32)
    call = dict(
        needs=dict(grad_hidden=True, grad_classifier=True, grad_bias=False),
        dtypes=(torch.float32, torch.float32, None),
        reduction="mean",
    )

    def mode(rows):
        problem = policy.problem(
            rows, (128256, 2048), torch.bfloat16, "cuda", compute_dtype=torch.bfloat16, dtypes=amp
        )
        return decide.mode(None, problem, **call)

    with config.override(mode="auto"):
        assert mode(4096) == "lean"
        assert mode(decide.planned_rows(4096, symbolic=True)) == "fast"


WHOLE_ROW_FLAGS = ["softcap", "entropy", "argmax"]  # not a vocabulary shard: see triton_fast


@pytest.mark.parametrize("flag", WHOLE_ROW_FLAGS)
def test_mode_sizes_fast_chunks_by_the_form_the_call_takes(flag):
    """A budget that holds auto's floor of fused rows (bf16 exponentials) but not of whole
    float32 rows: fast for a plain call, lean for one that needs whole rows."""
    problem = _bf16_gpu_problem(8192, (128256, 4096))
    floor = policy.fast_floor_rows(problem, True)
    megabytes = floor * policy.fast_row_bytes(problem, fused=True) // 2**20 + 1
    assert megabytes * 2**20 < floor * policy.fast_row_bytes(problem)
    call = dict(
        needs=dict(grad_hidden=True, grad_classifier=True, grad_bias=False),
        dtypes=(torch.bfloat16, torch.bfloat16, None),
    )
    with config.override(memory_budget_mb=megabytes, mode="auto"):
        assert decide.mode(None, problem, reduction="mean", **call) == "fast"
        assert decide.mode(None, problem, reduction="mean", **call, **{flag: True}) == "lean"


@pytest.mark.parametrize(
    ("options", "flags"),
    [
        (dict(), dict(softcap=False, entropy=False, argmax=False)),
        (dict(softcap=5.0), dict(softcap=True)),
        (dict(return_entropy=True), dict(entropy=True)),
        (dict(return_argmax=True), dict(argmax=True)),
    ],
    ids=["plain", "softcap", "entropy", "argmax"],
)
def test_the_function_tells_mode_what_forces_whole_rows(mode_calls, options, flags):
    """``linear_cross_entropy`` passes what a fast run would compute to ``decide.mode``."""
    hidden, classifier, targets = _tensors(rows=6, dim=4, vocab=9)
    cce_compile.linear_cross_entropy(hidden, classifier, targets, **options)
    (seen,) = mode_calls
    assert {k: seen.get(k, False) for k in flags} == flags


def test_the_pass_tells_mode_about_a_softcap(mode_calls):
    """The graph pass passes a site's softcap to ``decide.mode`` (whole rows in fast mode)."""
    import torch.nn.functional as F

    def loss(x, w, y):
        return F.cross_entropy(torch.tanh((x @ w.t()) / 5.0) * 5.0, y)

    hidden, classifier, targets = _tensors(rows=6, dim=4, vocab=9)
    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="cce")
    compiled(hidden.flatten(0, 1).requires_grad_(), classifier, targets.flatten())
    assert [call.get("softcap", False) for call in mode_calls] == [True]


def test_compaction_follows_the_setting_in_both_doors():
    with config.override(skip_ignored=False):
        assert not decide.compacts_ignored_rows() and not decide.site_compacts_ignored_rows()
    with config.override(skip_ignored=True):
        assert decide.compacts_ignored_rows() and decide.site_compacts_ignored_rows()
        import torch._inductor.config as inductor_config

        with inductor_config.patch({"triton.cudagraphs": True}):
            assert not decide.site_compacts_ignored_rows()


def test_canonical_form_views_rows_and_shortens_time():
    hidden, _, targets = _tensors(rows=5)
    hidden = hidden.reshape(1, 2, 5, -1)
    rows, flat_targets, shape = decide.canonical_form(hidden, targets.reshape(1, 2, 5), 2)
    assert rows.shape == (2, 5, hidden.shape[-1]) and flat_targets.shape == (2, 5)
    assert shape == (1, 2, 3) and rows.data_ptr() == hidden.data_ptr()
    _, _, scalar_shape = decide.canonical_form(torch.randn(4), torch.tensor(1), 0)
    assert scalar_shape == ()
