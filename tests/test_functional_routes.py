"""The autograd fallback's route (decide.route): found by a user's-eye review (c94056a),
each once a defect: float32 logits under autocast, a tensor softcap checked as a number is,
and vmap over the targets alone.

References are float64 PyTorch (``F.cross_entropy(F.linear(h.double(), W.double()), t)``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cce_compile import linear_cross_entropy

N, D, V = 8, 4, 7


@pytest.fixture
def inputs():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    return h, w, t


def _bf16_reference(h, w, t, scale=1.0):
    z = F.linear(h.bfloat16().double(), w.bfloat16().double()) * scale
    return F.cross_entropy(z, t)


@pytest.mark.parametrize("route", ["op", "logit_scale_requires_grad", "func_grad"])
def test_fallback_route_under_autocast_keeps_float32_logits(route):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(64, 32, generator=g)
    w = torch.randn(100, 32, generator=g)
    t = torch.randint(0, 100, (64,), generator=g)
    ref = _bf16_reference(h, w, t)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if route == "op":
            loss = linear_cross_entropy(h, w, t)
        elif route == "logit_scale_requires_grad":
            loss = linear_cross_entropy(h, w, t, logit_scale=torch.tensor(1.0, requires_grad=True))
        else:
            _, loss = torch.func.grad_and_value(lambda x: linear_cross_entropy(x, w, t))(h)
    err = abs(loss.item() - ref.item())
    assert err < 1e-5, (
        f"route {route}: under autocast(bf16) the loss is {loss.item():.6f}, float64 of the "
        f"bf16-rounded inputs gives {ref.item():.6f} (error {err:.1e}); docs/semantics.md: "
        "these routes are 'served exactly by PyTorch's autograd over chunked float32 logits', "
        "the op route is within 1e-7 - the fallback runs its matmul under the caller's "
        "autocast and rounds the logits to bf16"
    )


@pytest.mark.parametrize("value", [0.0, -1.5])
def test_softcap_tensor_requiring_grad_is_validated_like_a_float(inputs, value):
    h, w, t = inputs
    with pytest.raises(ValueError, match="softcap"):
        linear_cross_entropy(h, w, t, softcap=value)  # the float: refused
    with pytest.raises(ValueError, match="softcap"):
        linear_cross_entropy(h, w, t, softcap=torch.tensor(value))  # a plain tensor: refused
    try:
        loss = linear_cross_entropy(h, w, t, softcap=torch.tensor(value, requires_grad=True))
    except ValueError:
        return
    pytest.fail(
        f"softcap=torch.tensor({value}, requires_grad=True) gave loss {loss.item():.6f} (for 0: "
        f"log V = {torch.log(torch.tensor(float(V))).item():.6f}, every logit zeroed) where the "
        "same value as a float or a plain tensor raises ValueError ('A softcap of 0 is an "
        "error', docs/semantics.md); expected the same ValueError naming softcap"
    )


def test_vmap_over_targets_with_ignored_rows(inputs):
    h, w, _ = inputs
    targets = torch.randint(0, V, (3, N), generator=torch.Generator().manual_seed(1))
    targets[0, :2] = -100
    expected = torch.stack(
        [F.cross_entropy(F.linear(h.double(), w.double()), tt) for tt in targets]
    )
    try:
        got = torch.func.vmap(lambda tt: linear_cross_entropy(h, w, tt))(targets)
    except RuntimeError as error:
        pytest.fail(
            f"vmap over the targets alone (hidden shared) raised {error!s:.90}... when a row "
            f"is ignored (without ignored rows it works); expected {expected.tolist()} as "
            "PyTorch gives (route batched targets like other functorch transforms), or a clear "
            "error"
        )
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
