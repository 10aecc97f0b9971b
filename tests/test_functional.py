"""linear_cross_entropy against the float64 oracle: values, every gradient, lse, edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from oracle import GRAD_RTOL, LOSS_RTOL, assert_close, gradient_scale, loss_scale, lse_scale, oracle
from strategies import DTYPE_IDS, DTYPES, build_case, cases

import cce_compile

lce = cce_compile.linear_cross_entropy


def refuses_float16_fast(case) -> bool:
    """Does an explicit mode='fast' refuse this case (float16 gradients: policy.FLOAT16_FAST)?"""
    return any(t.requires_grad and t.dtype == torch.float16 for t in case.leaves())


def run_and_compare(case, *, mode="auto", return_lse=False, grads="all", seed=0, loss_rtol=None):
    """Run the op and the oracle with the same upstream gradients and compare everything."""
    dtype = case.hidden.dtype
    loss_rtol = loss_rtol or LOSS_RTOL
    wanted = {
        "all": (True, True, True),
        "hidden": (True, False, False),
        "classifier": (False, True, False),
        "none": (False, False, False),
    }[grads]
    for tensor, flag in zip((case.hidden, case.classifier, case.bias), wanted):
        if tensor is not None:
            tensor.requires_grad_(flag)
    if mode == "fast" and refuses_float16_fast(case):
        with pytest.raises(ValueError, match="float16 gradients"):
            lce(case.hidden, case.classifier, case.targets, case.bias, mode=mode, **case.options())
        mode = "lean"  # what auto takes for them: compared below
    ours = lce(
        case.hidden,
        case.classifier,
        case.targets,
        case.bias,
        return_lse=return_lse,
        mode=mode,
        **case.options(),
    )
    expected = oracle(case, return_lse=return_lse)
    ours = ours if isinstance(ours, tuple) else (ours,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for name, a, e, scale in zip(
        ("loss", "lse"), ours, expected, (loss_scale(case), lse_scale(case))
    ):
        assert a.dtype == torch.float32, f"{name} dtype {a.dtype}"
        assert_close(name, a, e, loss_rtol[dtype], scale)

    leaves = [t for t in case.leaves() if t.requires_grad]
    if not leaves:
        return
    gen = torch.Generator().manual_seed(seed)
    upstream = [
        torch.randn(e.shape, generator=gen, dtype=torch.float64).to(e.device) for e in expected
    ]
    total_ours = sum((a.double() * u).sum() for a, u in zip(ours, upstream))
    total_expected = sum((e * u).sum() for e, u in zip(expected, upstream))
    got = torch.autograd.grad(total_ours, leaves, allow_unused=True)
    want = torch.autograd.grad(total_expected, leaves, allow_unused=True)
    scales = gradient_scale(case, upstream[0], upstream[1] if return_lse else None, leaves)
    for leaf, g, w, scale in zip(leaves, got, want, scales):
        name = {id(case.hidden): "grad_hidden", id(case.classifier): "grad_classifier"}.get(
            id(leaf), "grad_bias"
        )
        assert g is not None, f"{name} missing"
        assert g.dtype == leaf.dtype, f"{name} dtype {g.dtype} != {leaf.dtype}"
        assert_close(name, g, w.to(torch.float64), GRAD_RTOL[dtype], scale)


def test_matches_oracle_on_random_cases(fuzz_examples):
    @settings(
        max_examples=fuzz_examples(300),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        print_blob=True,
    )
    @given(cases())
    def check(drawn):
        case, flags = drawn
        run_and_compare(case, **flags)

    check()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_typical_shape_all_options(dtype, mode):
    case = build_case(
        leading=(2, 17),
        dim=33,
        vocab=131,
        dtype=dtype,
        bias=True,
        class_weights=True,
        label_smoothing=0.1,
        softcap=15.0,
        logit_scale=1.3,
        shift=1,
        z_loss=1e-3,
        seed=7,
    )
    run_and_compare(case, mode=mode)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_rows_ignored(reduction):
    case = build_case(
        leading=(3, 5),
        dim=8,
        vocab=13,
        ignored_fraction=1.0,
        reduction=reduction,
        label_smoothing=0.1,
        z_loss=1e-2,
    )
    case.hidden.requires_grad_()
    loss = lce(case.hidden, case.classifier, case.targets, **case.options())
    if reduction == "mean":
        assert math.isnan(loss.item())  # PyTorch: 0 / 0
        loss = loss.nan_to_num()
    else:
        assert torch.all(loss == 0)
    (grad,) = torch.autograd.grad(loss.sum(), case.hidden)
    assert torch.all(grad == 0)
    run_and_compare(case)


@pytest.mark.parametrize("leading", [(), (1,), (1, 1), (2, 1, 3)], ids=str)
def test_tiny_and_unbatched_shapes(leading):
    case = build_case(leading=leading, dim=5, vocab=3, ignored_fraction=0.0)
    run_and_compare(case, return_lse=True)
    case.reduction = "none"
    run_and_compare(case)


def test_single_class_vocabulary():
    run_and_compare(build_case(leading=(4,), dim=3, vocab=1, ignored_fraction=0.0))


def test_ignore_index_inside_vocabulary():
    case = build_case(leading=(6, 4), dim=9, vocab=5, ignore_index=2, ignored_fraction=0.3)
    assert (case.targets == 2).any()
    run_and_compare(case)


def test_int32_targets():
    run_and_compare(build_case(leading=(7,), dim=6, vocab=11, target_dtype=torch.int32))


def test_noncontiguous_inputs():
    base = build_case(leading=(3, 8), dim=12, vocab=19, bias=True, shift=2)
    hidden = torch.randn(3, 12, 8).transpose(1, 2)  # (3, 8, 12), strided
    classifier = torch.randn(12, 19).t()  # (19, 12), column-major
    bias = torch.randn(38)[::2]
    targets = torch.randint(0, 19, (8, 3)).t()
    assert not (hidden.is_contiguous() or classifier.is_contiguous() or targets.is_contiguous())
    base.hidden, base.classifier, base.bias, base.targets = hidden, classifier, bias, targets
    run_and_compare(base)


def test_shift_keeps_sliced_view_semantics():
    # shift=1 equals the Hugging Face form logits[..., :-1, :] against labels[..., 1:].
    case = build_case(leading=(2, 9), dim=10, vocab=17, reduction="none")
    shifted = lce(case.hidden, case.classifier, case.targets, shift=1, reduction="none")
    sliced = lce(case.hidden[:, :-1], case.classifier, case.targets[:, 1:], reduction="none")
    assert shifted.shape == (2, 8)
    torch.testing.assert_close(shifted, sliced, rtol=0, atol=0)


def test_gradients_only_for_inputs_that_require_them():
    case = build_case(leading=(4, 3), dim=6, vocab=7, bias=True)
    case.classifier.requires_grad_()
    loss = lce(case.hidden, case.classifier, case.targets, case.bias)
    loss.backward()
    assert case.classifier.grad is not None
    assert case.hidden.grad is None and case.bias.grad is None


def test_no_grad_returns_plain_tensor():
    case = build_case(leading=(4,), dim=6, vocab=7)
    case.hidden.requires_grad_()
    with torch.no_grad():
        loss = lce(case.hidden, case.classifier, case.targets, mode="fast")
    assert not loss.requires_grad


def test_class_weights_gradient_is_refused_like_pytorch():
    case = build_case(leading=(4,), dim=6, vocab=7, class_weights=True)
    case.hidden.requires_grad_()
    case.class_weights.requires_grad_()
    logits = torch.nn.functional.linear(case.hidden, case.classifier)
    with pytest.raises(RuntimeError, match="weight"):  # PyTorch refuses at the call
        torch.nn.functional.cross_entropy(logits, case.targets, weight=case.class_weights)
    with pytest.raises(RuntimeError, match="class_weights"):
        lce(case.hidden, case.classifier, case.targets, class_weights=case.class_weights)
    scale = torch.tensor(1.0, requires_grad=True)  # the autograd fallback's route too
    with pytest.raises(RuntimeError, match="class_weights"):
        lce(case.hidden, case.classifier, case.targets, class_weights=case.class_weights,
            logit_scale=scale)  # fmt: skip
    with torch.no_grad():  # no gradient asked: served
        lce(case.hidden, case.classifier, case.targets, class_weights=case.class_weights)


@pytest.mark.parametrize("where", ["ignored_row", "counted_row"])
def test_nan_in_hidden_propagates_like_pytorch(where):
    case = build_case(leading=(5,), dim=6, vocab=7, ignored_fraction=0.0, reduction="none")
    row = 2
    if where == "ignored_row":
        case.targets[row] = -100
    case.hidden[row, 0] = float("nan")
    ours = lce(case.hidden, case.classifier, case.targets, reduction="none")
    expected = oracle(case)
    assert torch.equal(torch.isnan(ours), torch.isnan(expected))
    mean = lce(case.hidden, case.classifier, case.targets)
    assert math.isnan(mean.item()) == (where == "counted_row")


def test_out_of_range_target_raises_on_cpu():
    case = build_case(leading=(5,), dim=6, vocab=7)
    case.targets[3] = 7
    with pytest.raises(IndexError, match="out of bounds"):
        lce(case.hidden, case.classifier, case.targets)


def test_chunking_does_not_change_the_result():
    case = build_case(leading=(4, 25), dim=16, vocab=300, bias=True, label_smoothing=0.2)
    case.hidden.requires_grad_()
    case.classifier.requires_grad_()
    results = []
    for budget_mb in (1, 1024):  # 1 MB forces many chunks of a few rows
        with cce_compile.config.override(memory_budget_mb=budget_mb):
            for mode in ("lean", "fast"):
                loss = lce(
                    case.hidden,
                    case.classifier,
                    case.targets,
                    case.bias,
                    label_smoothing=0.2,
                    mode=mode,
                )
                results.append((loss, *torch.autograd.grad(loss, [case.hidden, case.classifier])))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
