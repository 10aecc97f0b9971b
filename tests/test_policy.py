"""Choosing lean or fast."""

from __future__ import annotations

import pytest

from cce_compile.policy import choose_mode, fast_extra_bytes

BIG = 10**12


def choose(requested="auto", **overrides):
    args = dict(
        reduction="mean",
        needs_grad=True,
        needs_classifier=True,
        lse_has_grad=False,
        vocab=1000,
        dim=64,
        budget_bytes=BIG,
    )
    args.update(overrides)
    return choose_mode(requested, **args)


def test_auto_takes_fast_when_it_fits():
    assert choose() == "fast"


@pytest.mark.parametrize(
    "override",
    [
        dict(reduction="none"),
        dict(needs_grad=False),
        dict(lse_has_grad=True),
        dict(budget_bytes=fast_extra_bytes(1000, 64, True) - 1),
    ],
    ids=["none", "no-grad", "lse-grad", "over-budget"],
)
def test_auto_takes_lean(override):
    assert choose(**override) == "lean"


def test_budget_ignores_classifier_accumulator_without_classifier_grad():
    budget = fast_extra_bytes(1000, 64, False)
    assert choose(needs_classifier=False, budget_bytes=budget) == "fast"


def test_explicit_modes():
    assert choose("lean") == "lean"
    assert choose("fast", lse_has_grad=True) == "fast"  # still exact, only slower
    assert choose("fast", reduction="none") == "lean"  # configured: falls back
    with pytest.raises(ValueError, match="fast"):
        choose("fast", reduction="none", explicit=True)


def test_fast_chunk_rows_bounded_by_budget():
    from cce_compile.policy import FAST_CHUNK_ROWS, fast_chunk_rows

    accumulator = 1000 * 64 * 4
    assert fast_chunk_rows(1000, 64, 2, True, 10**12) == FAST_CHUNK_ROWS
    assert fast_chunk_rows(1000, 64, 2, True, accumulator + 2000 * 10) == 10
    assert fast_chunk_rows(1000, 64, 2, True, accumulator) == 1
