"""``scale_cast``: fast mode's backward scaling its gradients by the upstream gradient."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _values():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    x[:4] = torch.tensor([float("inf"), float("-inf"), -0.0, 1e-42])
    return x.to(DEVICE)


@pytest.mark.parametrize("factor", [1.0, 0.37, -2.0], ids=["unit", "fraction", "negative"])
def test_in_place_scaling_is_float32_math(factor):
    from cce_compile.kernels.scale_cast import scale_cast

    x = _values()
    expected = x.double() * torch.tensor(factor, dtype=torch.float32).item()  # the scale's value
    out = scale_cast(x, torch.tensor(factor, device=DEVICE), x.dtype, out=x)
    assert out.data_ptr() == x.data_ptr()
    # float32 math: one rounding (rtol 2^-24), on the subnormal grid below 2^-126 (atol 2^-149)
    tiny = torch.finfo(torch.float32).smallest_normal * 2.0**-23
    torch.testing.assert_close(x.double(), expected, rtol=2.0**-24, atol=tiny, equal_nan=True)
    assert torch.signbit(x[2]) == (factor > 0)  # -0.0 keeps its sign under a positive factor


def test_a_unit_scale_into_another_tensor_still_writes_it():
    from cce_compile.kernels.scale_cast import scale_cast

    x = _values()
    out = torch.full_like(x, 7.0)
    scale_cast(x, torch.tensor(1.0, device=DEVICE), x.dtype, out=out)
    torch.testing.assert_close(out, x, rtol=0, atol=0)
    converted = scale_cast(x, torch.tensor(1.0, device=DEVICE), torch.float64)
    torch.testing.assert_close(converted, x.double(), rtol=0, atol=0)
