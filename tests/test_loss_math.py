"""loss_math's ignored rows: ``valid_rows`` decides them as PyTorch does (targets compared with
ignore_index as int64), whatever the targets' dtype.

A tensor compared with a Python int casts the int to the tensor's dtype, wrapping:
``torch.tensor([5], dtype=torch.int32) == 2**32 + 5`` is True. PyTorch's cross_entropy takes
int64 targets, where 2**32 + 5 is no class, so no row is ignored.
"""

from __future__ import annotations

import pytest
import torch

from cce_compile.loss_math import LossSpec, can_be_ignored, row_targets, valid_rows

# (ignore_index, its int32 wrap-around): what a plain ``int32 tensor != ignore_index`` confuses.
OUT_OF_RANGE = {
    "2^32+5": (2**32 + 5, 5),
    "2^40": (2**40, 0),
    "-2^40": (-(2**40), 0),
    "2^31": (2**31, -(2**31)),
}
DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


@pytest.mark.parametrize(("ignore_index", "wrapped"), OUT_OF_RANGE.values(), ids=OUT_OF_RANGE)
def test_int32_targets_never_equal_an_ignore_index_outside_int32(ignore_index, wrapped):
    targets = torch.tensor([wrapped, 7, wrapped, 1], dtype=torch.int32)
    assert bool((targets == ignore_index).any())  # the trap
    assert valid_rows(targets, ignore_index).all()
    # PyTorch's (int64) answer
    assert torch.equal(valid_rows(targets, ignore_index), targets.long() != ignore_index)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ignore_index", [-(2**40), -129, -100, -1, 0, 5, 127, 255, 2**31, 2**40])
def test_valid_rows_is_the_int64_comparison_for_every_integer_dtype(dtype, ignore_index):
    info = torch.iinfo(dtype)
    values = [info.min, -100, -1, 0, 5, 127, info.max]
    targets = torch.tensor([v for v in values if info.min <= v <= info.max], dtype=dtype)
    expected = targets.long() != ignore_index
    assert torch.equal(valid_rows(targets, ignore_index), expected)
    assert can_be_ignored(ignore_index, dtype) == (info.min <= ignore_index <= info.max)


@pytest.mark.parametrize(("ignore_index", "wrapped"), OUT_OF_RANGE.values(), ids=OUT_OF_RANGE)
def test_row_targets_counts_every_row_with_an_out_of_range_ignore_index(ignore_index, wrapped):
    targets = torch.tensor([[1, wrapped, 4, wrapped]], dtype=torch.int32)
    rows = row_targets(targets, None, LossSpec(ignore_index=ignore_index, shift=1), vocab=11)
    assert rows.valid.tolist() == [True, True, True]
    assert rows.count.item() == 3 and rows.weight_sum.item() == 3


@pytest.mark.parametrize("mode", ["lean", "fast"])
@pytest.mark.parametrize("weights", ["zero-at-targets", "positive"])
def test_smoothed_weighted_mean_divides_each_term_as_pytorch_does(mode, weights):
    """Label smoothing with class weights, 'mean': PyTorch divides the nll and the smoothing
    term each by the targets' weight sum. With weights 0 at every target that is 0/0 + x/0 =
    NaN; summing the terms first gave x/0 = +inf, a plausible wrong number (until 05c7832)."""
    import torch.nn.functional as F

    import cce_compile

    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(9, 12, generator=gen, dtype=torch.float64)
    classifier = torch.randn(20, 12, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 20, (9,), generator=gen)
    class_weights = torch.rand(20, generator=gen, dtype=torch.float64) + 0.1
    if weights == "zero-at-targets":
        class_weights[targets] = 0.0
    expected = F.cross_entropy(
        hidden @ classifier.T, targets, weight=class_weights, label_smoothing=0.1
    )
    got = cce_compile.linear_cross_entropy(
        hidden.float(),
        classifier.float(),
        targets,
        class_weights=class_weights.float(),
        label_smoothing=0.1,
        mode=mode,
    )
    assert torch.isnan(expected) == torch.isnan(got)
    if not torch.isnan(expected):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
