"""Fast mode on the Triton implementation, end to end against the float64 oracle: its chunks of
rows (``policy.fast_run_rows``), in whole float32 rows or as scaled exponentials from the logits
GEMM's epilogue (the fused form, ``policy.fast_fuses_exp``), in the operands' dtype or under
autocast, where the host waits for what, and what it refuses to compute.

As ``test_triton_path.py`` (whose dispatch, device and comparison it shares): on CPU the kernels
run in Triton's interpreter (small shapes), on a GPU on CUDA tensors.
"""

from __future__ import annotations

import pytest
import test_triton_path
import torch
from oracle import GRAD_RTOL, LOSS_RTOL_ROUNDED_LOGITS, assert_close, oracle
from strategies import build_case
from test_triton_path import DEVICE, run_and_compare, to_device

import cce_compile

# test_triton_path's skip (no GPU and no interpreter) and its autouse dispatch to triton_path
pytestmark = test_triton_path.pytestmark
triton_dispatch = test_triton_path.triton_dispatch


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
