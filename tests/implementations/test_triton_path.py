"""The Triton implementation behind the op, end to end against the float64 oracle.

On CPU the kernels run in Triton's interpreter (small shapes); on a GPU the same tests run on
CUDA tensors. The op's dispatch is pointed at ``triton_path`` for the test's device.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from oracle import GRAD_RTOL, LOSS_RTOL, LOSS_RTOL_ROUNDED_LOGITS, Case, assert_close, oracle
from strategies import DTYPE_IDS, DTYPES, build_case, cases
from test_functional import run_and_compare as _run_and_compare

import cce_compile
from cce_compile.op import dispatch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERPRETING, reason="needs a GPU or TRITON_INTERPRET=1"
)


@pytest.fixture(autouse=True)
def triton_dispatch(monkeypatch):
    from cce_compile.implementations import triton_path

    monkeypatch.setattr(dispatch, "implementation_for", lambda device: triton_path)


def run_and_compare(case, mode="auto", **flags):
    """The functional comparison, with fast mode's documented precision on the GPU: its
    logits come from cuBLAS in the inputs' dtype (auto may choose fast)."""
    rounded = DEVICE == "cuda" and mode in ("fast", "auto")
    table = LOSS_RTOL_ROUNDED_LOGITS if rounded else LOSS_RTOL
    _run_and_compare(case, mode=mode, loss_rtol=table, **flags)


def to_device(case):
    for name in ("hidden", "classifier", "targets", "bias", "class_weights"):
        value = getattr(case, name)
        if value is not None:
            setattr(case, name, value.to(DEVICE))
    return case


def test_random_cases(fuzz_examples):
    @settings(
        max_examples=fuzz_examples(25),
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(cases(max_vocab=40, max_dim=36, max_rows=12))
    def check(drawn):
        case, flags = drawn
        run_and_compare(to_device(case), **flags)

    check()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_odd_shape_every_option(dtype, mode):
    # V and D not multiples of the 16-wide tiles, rows spanning several tiles, a shift.
    case = build_case(
        leading=(3, 13),
        dim=37,
        vocab=53,
        dtype=dtype,
        bias=True,
        class_weights=True,
        label_smoothing=0.1,
        softcap=12.0,
        logit_scale=1.3,
        shift=1,
        z_loss=1e-3,
        seed=3,
    )
    run_and_compare(to_device(case), mode=mode)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_return_lse_and_ignored_tiles(reduction):
    # The first rows are all ignored: whole tiles are skipped in forward and backward.
    case = build_case(leading=(2, 20), dim=20, vocab=33, reduction=reduction, seed=5)
    case.targets[0, :] = -100
    run_and_compare(to_device(case), return_lse=True, mode="lean")
    run_and_compare(to_device(case), return_lse=False, mode="lean")


def test_several_backward_slabs(monkeypatch):
    from cce_compile import policy

    monkeypatch.setattr(policy, "lean_slab_columns", lambda *args: 16)  # one tile per slab
    case = build_case(leading=(24,), dim=18, vocab=70, bias=True, label_smoothing=0.2, seed=9)
    run_and_compare(to_device(case), mode="lean")


def test_several_fast_chunks(monkeypatch):
    from cce_compile import policy

    calls = []

    def five_rows(*args):
        calls.append(args)
        return 5

    monkeypatch.setattr(policy, "fast_run_rows", five_rows)
    case = build_case(
        leading=(4, 7),
        dim=18,
        vocab=45,
        bias=True,
        class_weights=True,
        label_smoothing=0.2,
        z_loss=1e-2,
        seed=11,
    )
    run_and_compare(to_device(case), mode="fast")
    assert calls, "fast mode must size its chunks through policy.fast_run_rows"


@pytest.mark.parametrize("mode", ["lean", "fast"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["plain", "smoothing"])
def test_a_whole_program_of_classes_masked_by_a_minus_inf_bias(mode, smoothing):
    """Classes [256, 512) masked out with a -inf bias: every program (16 or 256 classes on
    the interpreter's or a GPU's tiles) that holds only them must add nothing to the lse, not
    exp(-inf - -inf) = NaN; the loss and gradients are finite, as PyTorch's."""
    case = build_case(leading=(2, 5), dim=16, vocab=600, bias=True, label_smoothing=smoothing)
    case.bias[256:512] = float("-inf")
    masked = (case.targets >= 256) & (case.targets < 512)
    case.targets[masked] = case.targets[masked] - 256  # targets on classes that count
    if smoothing:  # smoothing spreads mass over the masked classes: an infinite loss
        loss = cce_compile.linear_cross_entropy(
            to_device(case).hidden, case.classifier, case.targets, case.bias,
            label_smoothing=smoothing, mode=mode,
        )  # fmt: skip
        assert loss.item() == float("inf"), loss
    else:
        run_and_compare(to_device(case), mode=mode)


FUSED_FAST = {
    "every_option": dict(
        bias=True, class_weights=True, label_smoothing=0.2, z_loss=1e-2, logit_scale=1.3
    ),
    "plain-shift": dict(shift=1),
    "sum-ignored": dict(reduction="sum", ignored_fraction=0.5),
}


@pytest.mark.parametrize("options", FUSED_FAST.values(), ids=FUSED_FAST.keys())
def test_fast_mode_with_exponentials_from_the_gemm(monkeypatch, options):
    """Fast mode's chunks as scaled exponentials written by the logits GEMM's epilogue
    (logits_exp, scaled_exp_grad): chunks of 5 rows over 45 classes (the interpreter's
    16-class tiles: a partial last tile), against the oracle; and the fused path ran."""
    from cce_compile import policy
    from cce_compile.implementations import triton_fast

    chunks = []
    monkeypatch.setattr(policy, "fast_fuses_exp", lambda *args: True)
    monkeypatch.setattr(policy, "fast_run_rows", lambda *args: 5)
    real_fused_gemm = triton_fast._fused_gemm
    monkeypatch.setattr(
        triton_fast, "_fused_gemm", lambda *a: chunks.append(a[-1]) or real_fused_gemm(*a)
    )
    case = build_case(leading=(4, 7), dim=18, vocab=45, seed=13, **options)
    run_and_compare(to_device(case), mode="fast")
    assert chunks, "fast mode must take the fused path where policy.fast_fuses_exp says so"


def test_fast_mode_queues_the_first_gemm_before_building_the_coefficients(monkeypatch):
    """The GPU has nothing large to run until a call's first logits GEMM is queued, so the host
    builds pass 2's per-row coefficients after it (bc5956c, H200: 0.8 ms off E's and C's
    step): once per call, after chunk 0's GEMM and before chunk 1's."""
    from cce_compile import policy
    from cce_compile.implementations import triton_fast

    events = []
    monkeypatch.setattr(policy, "fast_fuses_exp", lambda *args: True)
    monkeypatch.setattr(policy, "fast_run_rows", lambda *args: 5)
    real_gemm, real_of = triton_fast._fused_gemm, triton_fast._PositionCoefficients.of
    monkeypatch.setattr(
        triton_fast, "_fused_gemm", lambda *a: events.append("gemm") or real_gemm(*a)
    )
    monkeypatch.setattr(
        triton_fast._PositionCoefficients,
        "of",
        staticmethod(lambda *a: events.append("coefficients") or real_of(*a)),
    )
    case = build_case(leading=(2, 6), dim=18, vocab=45, seed=5)
    run_and_compare(to_device(case), mode="fast")
    assert events[:3] == ["gemm", "coefficients", "gemm"], events
    assert events.count("coefficients") == 1


# Kept rows against fast mode's chunk of 16 rows (28 rows in all).
KEPT_COUNTS = {"none-kept": 0, "fewer-than-a-chunk": 3, "a-chunk-and-more": 19}


@pytest.mark.usefixtures("skip_at_any_size")  # compaction at this size on a GPU too
@pytest.mark.parametrize("kept", KEPT_COUNTS.values(), ids=KEPT_COUNTS)
def test_fast_mode_waits_for_the_kept_rows_count_after_its_first_gemm(monkeypatch, kept):
    """Skipping ignored rows, fast mode queues its first chunk's GEMM, stopped at the kept
    rows' count on the device, before it waits for that count (compaction.KeptFirst): the
    GPU computes while the host waits. The rows computed are the kept ones, however many:
    none, fewer than a chunk, more than one; an ignored row's non-finite hidden changes
    nothing, and the results match the oracle. (Rows past the count inside its row tile are
    computed and never read: on a GPU they hold the ignored rows' NaN, in the interpreter the
    kernel clamps them to the last kept row.)"""
    from cce_compile import policy
    from cce_compile.implementations import triton_fast
    from cce_compile.op import compaction

    events = []
    monkeypatch.setattr(policy, "fast_fuses_exp", lambda *args: True)
    monkeypatch.setattr(policy, "fast_run_rows", lambda *args: 16)
    real_gemm, real_reader = triton_fast._fused_gemm, compaction._host_reader
    monkeypatch.setattr(
        triton_fast,
        "_fused_gemm",
        lambda *a: events.append(("gemm", a[-1] is not None)) or real_gemm(*a),
    )

    def recording_reader(count):
        read = real_reader(count)
        return lambda: events.append("count") or read()

    monkeypatch.setattr(compaction, "_host_reader", recording_reader)
    case = build_case(leading=(4, 7), dim=18, vocab=45, seed=17, reduction="sum")
    gen = torch.Generator().manual_seed(kept)
    ignored = torch.ones(28, dtype=torch.bool)
    ignored[torch.randperm(28, generator=gen)[:kept]] = False
    case.targets.view(-1)[ignored] = case.ignore_index
    case = to_device(case)
    run_and_compare(case, mode="fast")
    assert events[:2] == [("gemm", True), "count"], events
    assert all(e[1] is False for e in events[2:]), events  # later chunks: the count known

    def results(hidden):
        hidden = hidden.detach().requires_grad_()
        classifier = case.classifier.detach().requires_grad_()
        loss = cce_compile.linear_cross_entropy(
            hidden, classifier, case.targets, reduction="sum", mode="fast"
        )
        loss.backward()
        return loss, hidden.grad, classifier.grad

    poisoned = case.hidden.detach().clone()
    poisoned.view(-1, 18)[ignored.to(DEVICE)] = float("nan")
    for clean, dirty in zip(results(case.hidden), results(poisoned)):
        assert torch.equal(clean, dirty)


def test_fast_mode_with_exponentials_from_the_gemm_of_a_transposed_classifier(monkeypatch):
    """A head stored (D, V) and used transposed (Conv1D, ``h @ W``): the classifier's column
    stride is V. The fused GEMM needs unit column strides; it raised "h and classifier need
    unit column strides" instead of computing (until 12ac2d6). Under autocast the rounded copy
    keeps those strides, so the same line serves both."""
    from cce_compile import policy
    from cce_compile.implementations import triton_fast, triton_shared

    chunks = []
    monkeypatch.setattr(triton_shared, "work_dtype", lambda tensor: tensor.dtype)
    monkeypatch.setattr(policy, "fast_fuses_exp", lambda problem, whole_rows: not whole_rows)
    monkeypatch.setattr(policy, "fast_run_rows", lambda *args: 5)
    real_fused_gemm = triton_fast._fused_gemm
    monkeypatch.setattr(
        triton_fast, "_fused_gemm", lambda *a: chunks.append(a[-1]) or real_fused_gemm(*a)
    )
    case = build_case(leading=(3, 5), dim=16, vocab=40, dtype=torch.bfloat16, scale=4.0, seed=21)
    case.classifier = case.classifier.t().contiguous().t()  # strides (1, V)
    assert case.classifier.stride(1) != 1
    run_and_compare(to_device(case), mode="fast")
    assert chunks, "the fused path must have run"


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_fast_mode_with_exponentials_from_the_gemm_in_half_width(monkeypatch, dtype):
    """The GPU's form: bf16 operands and scaled exponentials (the interpreter's buffers are
    otherwise float32), every option, against the oracle of the rounded inputs. (float16
    operands have float16 gradients, which fast mode refuses: policy.FLOAT16_FAST; the next
    test runs float16 exponentials under autocast.)"""
    from cce_compile import policy
    from cce_compile.implementations import triton_shared

    monkeypatch.setattr(triton_shared, "work_dtype", lambda tensor: tensor.dtype)
    monkeypatch.setattr(policy, "fast_fuses_exp", lambda *args: True)
    monkeypatch.setattr(policy, "fast_run_rows", lambda *args: 5)
    options = FUSED_FAST["every_option"]
    case = build_case(leading=(4, 7), dim=18, vocab=45, dtype=dtype, scale=4.0, seed=13, **options)
    run_and_compare(to_device(case), mode="fast")


def test_fast_mode_with_float16_exponentials_under_autocast(monkeypatch):
    """float32 weights and hidden under a float16 compute dtype (autocast's form): their
    gradients are float32, so fast mode applies, with float16 scaled exponentials from the
    GEMM; against the float64 oracle of the rounded inputs at float16's tolerances."""
    from oracle import gradient_scale, loss_scale

    from cce_compile import policy
    from cce_compile.implementations import triton_shared

    monkeypatch.setattr(triton_shared, "work_dtype", lambda tensor: tensor.dtype)
    monkeypatch.setattr(policy, "fast_fuses_exp", lambda *args: True)
    monkeypatch.setattr(policy, "fast_run_rows", lambda *args: 5)
    case = to_device(build_case(leading=(4, 7), dim=18, vocab=45, dtype=torch.float16, seed=13))
    leaves = [case.hidden.requires_grad_(), case.classifier.requires_grad_()]
    ours_leaves = [t.detach().float().requires_grad_() for t in leaves]
    with torch.autocast(DEVICE, dtype=torch.float16):
        ours = cce_compile.linear_cross_entropy(
            *ours_leaves, case.targets, mode="fast", **case.options()
        )
    expected = oracle(case)
    assert_close("loss", ours, expected, LOSS_RTOL_ROUNDED_LOGITS[torch.float16], loss_scale(case))
    got = torch.autograd.grad(ours, ours_leaves)
    want = torch.autograd.grad(expected, leaves)
    scales = gradient_scale(case, torch.ones((), dtype=torch.float64, device=DEVICE), None, leaves)
    for name, g, w, scale in zip(("hidden", "classifier"), got, want, scales):
        assert g.dtype == torch.float32
        assert_close(name, g, w, GRAD_RTOL[torch.float16], scale)


def _fused_chunks_recording_sums(monkeypatch, min_fast_dim: int) -> list:
    """Fast runs in fused chunks of 5 rows in the operands' dtype, ``min_fast_dim`` as
    policy.MIN_FAST_DIM; returns the list of the dtypes the classifier's gradient is summed in,
    one entry per chunk."""
    from cce_compile import policy
    from cce_compile.implementations import triton_shared

    summed = []
    real_addmm = triton_shared.addmm_
    monkeypatch.setattr(
        triton_shared,
        "addmm_",
        lambda acc, *a, **k: summed.append(acc.dtype) or real_addmm(acc, *a, **k),
    )
    monkeypatch.setattr(triton_shared, "work_dtype", lambda tensor: tensor.dtype)
    monkeypatch.setattr(policy, "fast_fuses_exp", lambda *args: True)
    monkeypatch.setattr(policy, "fast_run_rows", lambda *args: 5)
    monkeypatch.setattr(policy, "MIN_FAST_DIM", min_fast_dim)
    return summed


@pytest.mark.parametrize(
    "min_fast_dim, summed_in",
    [(1024, torch.float32), (16, torch.bfloat16)],
    ids=["narrow-float32-buffer", "wide-the-gradient-itself"],
)
def test_fused_chunks_sum_a_bf16_classifier_gradient_in_float32_below_min_fast_dim(
    monkeypatch, min_fast_dim, summed_in
):
    """Below policy.MIN_FAST_DIM the chunks' bf16 classifier gradient is summed in a float32
    buffer and rounded once at the end (summed in bf16 it had 1.35x compile's error at G);
    from it on the gradient sums itself. Both against the oracle, in bf16 as returned."""
    summed = _fused_chunks_recording_sums(monkeypatch, min_fast_dim)
    case = build_case(leading=(4, 7), dim=18, vocab=45, dtype=torch.bfloat16, seed=13)
    run_and_compare(to_device(case), mode="fast")
    assert len(summed) > 2 and set(summed) == {summed_in}


@pytest.mark.parametrize("min_fast_dim", [1024, 16], ids=["narrow", "wide"])
def test_a_bf16_classifier_under_float16_autocast_in_fast_mode(monkeypatch, min_fast_dim):
    """bf16 weights beside a float32 hidden under float16 autocast: the classifier is rounded,
    but its gradient is bf16 (summed in bf16 below MIN_FAST_DIM it had 2x float32
    accumulation's error), and cuBLAS writes no float16 product into bf16 (a GPU error in lean
    and fast before e8133ce; then an uncounted V x D float32 temporary per chunk until 5bd9acd):
    at every D its chunks are summed in a float32 buffer, counted, and rounded once. The
    classifier's gradient against the oracle in its dtype; hidden's against lean mode's (the
    same float16 products of the gradient: 1.4-1.8e-3 from the oracle in both modes,
    float16's rounding of bf16-valued inputs)."""
    from oracle import gradient_scale, loss_scale

    summed = _fused_chunks_recording_sums(monkeypatch, min_fast_dim)
    # bf16 values, which float16 holds exactly: the oracle's inputs are the rounded ones
    case = to_device(build_case(leading=(4, 7), dim=18, vocab=45, dtype=torch.bfloat16, seed=13))
    leaves = [case.hidden.requires_grad_(), case.classifier.requires_grad_()]

    def gradients(mode):
        ours_leaves = [case.hidden.detach().float(), case.classifier.detach()]
        ours_leaves = [t.requires_grad_() for t in ours_leaves]
        with torch.autocast(DEVICE, dtype=torch.float16):
            loss = cce_compile.linear_cross_entropy(
                *ours_leaves, case.targets, mode=mode, **case.options()
            )
        return loss, torch.autograd.grad(loss, ours_leaves)

    _, (lean_hidden, _) = gradients("lean")
    summed.clear()
    ours, (grad_hidden, grad_classifier) = gradients("fast")
    assert len(summed) > 2 and set(summed) == {torch.float32}
    expected = oracle(case)
    assert_close("loss", ours, expected, LOSS_RTOL_ROUNDED_LOGITS[torch.float16], loss_scale(case))
    want = torch.autograd.grad(expected, leaves)[1]
    scale = gradient_scale(case, torch.ones((), dtype=torch.float64, device=DEVICE), None, leaves)[
        1
    ]
    assert grad_hidden.dtype == torch.float32 and grad_classifier.dtype == torch.bfloat16
    assert_close("classifier", grad_classifier, want, GRAD_RTOL[torch.bfloat16], scale)
    assert_close("hidden", grad_hidden, lean_hidden, GRAD_RTOL[torch.float16])


@pytest.mark.parametrize("form", ["lean", "fast", "fused"])
@pytest.mark.parametrize("shift", [0, 1])
def test_sequences_apart_in_memory_leave_the_gaps_unread(monkeypatch, form, shift):
    """hidden = base[:, :T] of a (B, T + 1, D) buffer, as a user's slice or Inductor's padded
    allocation of a slice (never written past T): the flat view of its positions took the gap
    rows as positions, and the classifier's gradient GEMM multiplied their zero gradients by
    NaN in the gap: a NaN gradient where PyTorch's is finite (an adversarial test; cde5a52)."""
    from cce_compile import policy
    from cce_compile.implementations import triton_shared

    if form == "fused":
        monkeypatch.setattr(triton_shared, "work_dtype", lambda tensor: tensor.dtype)
        monkeypatch.setattr(policy, "fast_fuses_exp", lambda problem, whole_rows: not whole_rows)
        monkeypatch.setattr(policy, "fast_run_rows", lambda *args: 5)
    case = build_case(leading=(3, 8), dim=16, vocab=40, ignored_fraction=0.0, shift=shift, seed=4)
    base = torch.full((3, 9, 16), float("nan"), dtype=case.hidden.dtype)
    base[:, :8] = case.hidden
    case.hidden = base[:, :8]
    run_and_compare(to_device(case), mode="lean" if form == "lean" else "fast")


def test_fast_mode_whole_rows_with_a_minus_inf_bias_before_finite_logits(monkeypatch):
    """V > 4096 (the softmax kernel's block): lane j sees column j, then j + 4096. A -inf bias
    at column j once made that lane's sum exp(-inf - -inf) = NaN, which the finite column
    after it kept (NaN * 0): NaN loss and gradients where PyTorch's are finite."""
    from cce_compile import policy

    monkeypatch.setattr(policy, "fast_fuses_exp", lambda *args: False)
    case = build_case(leading=(1, 3), dim=8, vocab=4106, bias=True, ignored_fraction=0.0, seed=5)
    case.bias[:5] = float("-inf")  # masked classes at the front: lanes 0-4 see them first
    case.targets[case.targets < 5] = 100
    run_and_compare(to_device(case), mode="fast")


NAN_LOGITS = {
    "nan-classifier-row": dict(),
    "nan-in-a-minus-inf-block": dict(minus_inf_block=True),
}


@pytest.mark.parametrize("form", ["whole-rows", "fused"])
@pytest.mark.parametrize("where", NAN_LOGITS.values(), ids=NAN_LOGITS.keys())
def test_fast_mode_propagates_a_nan_logit(monkeypatch, form, where):
    """A NaN logit makes every row's loss NaN in PyTorch (it is in every row's lse). The
    softmax's running max skips NaN (tl.maximum), so a lane or block whose max stayed -inf
    (only NaN seen: a NaN classifier row with V <= the block; or NaN among -inf biases) had
    its NaN sum replaced by 0: a finite loss. 'sum', no row targets the NaN class."""
    from cce_compile import policy

    monkeypatch.setattr(policy, "fast_fuses_exp", lambda *args: form == "fused")
    monkeypatch.setattr(policy, "fast_run_rows", lambda *args: 5)
    case = build_case(
        leading=(2, 7), dim=12, vocab=45, bias=True, ignored_fraction=0.0, reduction="sum", seed=5
    )
    if where.get("minus_inf_block"):
        case.bias[16:32] = float("-inf")
        case.targets[(case.targets >= 16) & (case.targets < 32)] = 0
    case.classifier[20, 3] = float("nan")
    case.targets[case.targets == 20] = 0
    case = to_device(case)
    for leaf in case.leaves():  # fast mode's forward is the gradients' pass
        leaf.requires_grad_()
    loss = cce_compile.linear_cross_entropy(
        case.hidden, case.classifier, case.targets, case.bias, mode="fast", **case.options()
    )
    assert torch.isnan(oracle(case))
    assert torch.isnan(loss), f"loss {loss.item()} where PyTorch's is NaN"


def test_fast_mode_keeps_whole_rows_where_the_fused_form_cannot_serve(monkeypatch):
    """softcap's derivative needs each logit, not its scaled exponential: whole float32 rows."""
    from cce_compile import policy
    from cce_compile.implementations import triton_fast

    monkeypatch.setattr(policy, "fast_fuses_exp", lambda problem, whole_rows: not whole_rows)
    monkeypatch.setattr(triton_fast, "_fused_gemm", lambda *a: pytest.fail("fused with softcap"))
    case = build_case(leading=(2, 7), dim=18, vocab=45, softcap=5.0, seed=14)
    run_and_compare(to_device(case), mode="fast")


def test_a_policy_that_fuses_a_softcap_chunk_is_refused_not_computed(monkeypatch):
    """A fused chunk has no float32 logits for softcap's derivative: should the policy ever
    fuse one (a test forced it: a loss 0.98 off, wrong gradients; ede328c), the call raises."""
    from cce_compile import policy

    monkeypatch.setattr(policy, "fast_fuses_exp", lambda *args: True)
    case = to_device(build_case(leading=(2, 7), dim=18, vocab=45, softcap=5.0, seed=14))
    case.hidden.requires_grad_()  # (fast mode: gradients in the forward)
    with pytest.raises(RuntimeError, match="whole float32 logits"):
        cce_compile.linear_cross_entropy(
            case.hidden, case.classifier, case.targets, softcap=5.0, mode="fast"
        )


@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_float32_inputs_with_a_bf16_compute_dtype_in_slabs(monkeypatch, mode):
    """Autocast's form: float32 hidden and classifier rounded to bf16 inside the op, the
    classifier one slab of classes at a time; float32 gradients against the oracle of the
    rounded inputs."""
    from cce_compile import policy

    monkeypatch.setattr(policy, "forward_slab_columns", lambda *args: 16)
    monkeypatch.setattr(policy, "lean_slab_columns", lambda *args: 16)
    case = build_case(
        leading=(2, 9),
        dim=24,
        vocab=61,
        bias=True,
        class_weights=True,
        label_smoothing=0.1,
        softcap=9.0,
        shift=1,
        z_loss=1e-3,
        seed=21,
    )
    case = to_device(case)
    leaves = [t.clone().requires_grad_() for t in (case.hidden, case.classifier, case.bias)]
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = cce_compile.linear_cross_entropy(
            *leaves[:2], case.targets, leaves[2], mode=mode, **case.options()
        )
    grads = torch.autograd.grad(loss, leaves)
    assert all(g.dtype == torch.float32 for g in grads)
    rounded = [t.bfloat16().double().requires_grad_() for t in leaves]
    expected = oracle(Case(*rounded[:2], case.targets, bias=rounded[2], **case.options()))
    assert_close("loss", loss, expected, LOSS_RTOL_ROUNDED_LOGITS[torch.bfloat16])
    for name, got, want in zip(
        ("hidden", "classifier", "bias"), grads, torch.autograd.grad(expected, rounded)
    ):
        assert_close(name, got, want, GRAD_RTOL[torch.bfloat16])


@pytest.mark.parametrize("dim, tma", [(32, True), (37, False)], ids=["tma", "pointers"])
@pytest.mark.parametrize("layout", ["contiguous", "shift", "sliced-view", "expanded-batch"])
def test_hidden_layouts_and_load_paths(monkeypatch, dim, tma, layout):
    from cce_compile.kernels import common

    used = []
    real = common.operand_args

    def spy(*args):
        result = real(*args)
        used.append(result[2])
        return result

    monkeypatch.setattr(common, "operand_args", spy)
    for module in ("lse_forward", "logit_grad"):
        monkeypatch.setattr(f"cce_compile.kernels.{module}.operand_args", spy)
    case = build_case(leading=(3, 12), dim=dim, vocab=41, bias=True, seed=13)
    if layout == "shift":
        case.shift = 2
    elif layout == "sliced-view":  # what the graph pass feeds for logits[:, :-1] (copied)
        case.hidden = case.hidden[:, :-1]
        case.targets = case.targets[:, 1:]
    elif layout == "expanded-batch":  # stride 0: no flat matrix, the launcher copies
        case.hidden = case.hidden[:1].expand(3, -1, -1)
    run_and_compare(to_device(case), mode="lean")
    assert used and all(u == tma for u in used)


@pytest.mark.parametrize(
    "dim, heavy, elem_bytes, expected",
    [
        (512, False, 2, (128, 128, 4)),
        (2048, False, 2, (128, 128, 4)),
        (2049, False, 2, (128, 256, 8)),
        (512, True, 2, (128, 128, 8)),
        (512, False, 4, (128, 128, 8)),
    ],
    ids=["d512", "d2048-last-small", "d2049-large", "heavy-keeps-8-warps", "float32"],
)
def test_gpu_tile_choice(dim, heavy, elem_bytes, expected):
    """Which tiles a GPU launch gets (a CUDA device object needs no GPU to exist)."""
    from cce_compile.implementations import triton_shared

    config = triton_shared.tile_config(torch.device("cuda"), heavy, elem_bytes, dim=dim)
    assert (config.block_n, config.block_v, config.num_warps) == expected


@pytest.mark.parametrize(
    "dim, heavy, elem_bytes, tma, expected",
    [
        (512, False, 2, True, (128, 256, 8, 16, 3)),
        (2048, False, 2, True, (128, 256, 8, 16, 3)),
        (4096, False, 2, True, (128, 256, 8, 16, 3)),
        (2048, True, 2, True, (128, 128, 8, 8, 4)),
        (512, False, 2, False, (128, 128, 4, 8, 3)),
        (512, False, 4, True, (128, 128, 8, 8, 3)),
    ],
    ids=["d512", "d2048", "d4096", "heavy-keeps-lean-tiles", "pointer-loads", "float32"],
)
def test_gpu_fused_tile_choice(dim, heavy, elem_bytes, tma, expected):
    """The fused logits GEMM is persistent (one program per SM): wide tiles at every D where
    they fit shared memory (2-byte operands by TMA), where lean's kernels take small ones up to
    D = 2048 (two programs per SM). The wide tiles by pointers, or in float32, took 256-448 KB
    of an H200's 227 (bench/results/gpu_tests.md, cf15073)."""
    from cce_compile.implementations import triton_shared

    config = triton_shared.fused_tile_config(
        torch.device("cuda"), heavy, elem_bytes, dim=dim, tma=tma
    )
    chosen = (config.block_n, config.block_v, config.num_warps, config.group_n, config.num_stages)
    assert chosen == expected


@pytest.mark.parametrize(
    "dtype, dim, row_stride, tma",
    [
        (torch.bfloat16, 64, 64, True),
        (torch.bfloat16, 18, 18, False),
        (torch.bfloat16, 64, 68, False),
        (torch.float32, 16, 16, True),
    ],
    ids=["bf16-aligned", "bf16-rows-of-36-bytes", "bf16-strided-rows", "float32-aligned"],
)
def test_fused_tiles_follow_what_the_launcher_loads_by_tma(
    monkeypatch, dtype, dim, row_stride, tma
):
    """``fused_config_of`` asks for tiles with the TMA verdict of the operands the fused GEMM
    will read (the launcher's rule, ``operands_tma_ok``), their element size and the epilogue."""
    from cce_compile.implementations import triton_shared

    asked = []
    monkeypatch.setattr(
        triton_shared, "fused_tile_config", lambda *a, **k: asked.append((a, k)) or "tiles"
    )
    from cce_compile.implementations.interface import HeadInputs
    from cce_compile.loss_math import LossSpec

    storage = torch.zeros(10 * row_stride, dtype=dtype)
    positions = storage.as_strided((10, dim), (row_stride, 1))
    classifier = torch.zeros(40, dim, dtype=dtype)
    targets = torch.zeros(1, 10, dtype=torch.int64)
    spec = LossSpec(label_smoothing=0.1)
    head = HeadInputs(
        positions[None],
        classifier,
        targets,
        None,
        None,
        spec,
        1 << 20,
    )
    assert triton_shared.fused_config_of(head, positions, classifier) == "tiles"
    (device, heavy, elem_bytes), options = asked[0]
    assert (heavy, elem_bytes, options["tma"], options["dim"]) == (
        True,
        positions.element_size(),
        tma,
        dim,
    )


@pytest.mark.parametrize("mode", ["lean", "fast"])
@pytest.mark.parametrize(
    "leading, shift", [((0, 5), 0), ((0, 5), 1), ((3, 0), 0)], ids=["B0", "B0-shift", "T0"]
)
def test_empty_batch(leading, shift, mode):
    """No rows: a NaN mean (PyTorch's 0 / 0) and all-zero gradients, every one written."""
    case = to_device(build_case(leading=leading, dim=20, vocab=33, bias=True, shift=shift))
    for t in (case.hidden, case.classifier, case.bias):
        t.requires_grad_()
    loss = cce_compile.linear_cross_entropy(
        case.hidden, case.classifier, case.targets, case.bias, shift=shift, mode=mode
    )
    assert torch.isnan(loss)
    grads = torch.autograd.grad(loss.nan_to_num(), [case.hidden, case.classifier, case.bias])
    assert all(
        g.shape == t.shape and torch.count_nonzero(g) == 0
        for g, t in zip(grads, (case.hidden, case.classifier, case.bias))
    )
