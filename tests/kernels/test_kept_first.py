"""Compaction's kept-first order in one launch (``kernels/kept_first.py``) against torch's
``nonzero``, over row counts around its block size (16 here: one, several and partial blocks)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

ROWS = [0, 1, 15, 16, 17, 50]
KEPT = {"none": 0.0, "some": 0.4, "all": 1.0}


@pytest.mark.parametrize("kept", KEPT.values(), ids=KEPT)
@pytest.mark.parametrize("rows", ROWS)
def test_the_kept_rows_then_the_ignored_ones_and_their_count(rows, kept):
    from cce_compile.kernels.kept_first import kept_first

    valid = torch.rand(rows, generator=torch.Generator().manual_seed(rows)) < kept
    order, count = kept_first(valid.to(DEVICE), block=16)
    expected = torch.cat([valid.nonzero().squeeze(1), (~valid).nonzero().squeeze(1)])
    assert order.dtype == torch.int64 and count.dtype == torch.int64 and count.dim() == 0
    assert torch.equal(order.cpu(), expected)
    assert int(count) == int(valid.sum())


# Built on the device: a copy there (``.to``) would be contiguous.
BAD = {
    "not-bool": lambda: torch.zeros(4, dtype=torch.uint8, device=DEVICE),
    "two-dims": lambda: torch.zeros(2, 2, dtype=torch.bool, device=DEVICE),
    "strided": lambda: torch.zeros(8, dtype=torch.bool, device=DEVICE)[::2],
}


@pytest.mark.parametrize("valid", BAD.values(), ids=BAD)
def test_the_launcher_names_what_it_needs(valid):
    from cce_compile.kernels.kept_first import kept_first

    with pytest.raises(ValueError, match="contiguous 1-D bool"):
        kept_first(valid())
