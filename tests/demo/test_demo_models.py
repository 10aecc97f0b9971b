"""The demo's models: shapes, the loss in forward, and chunked GLA against its recurrence."""

from __future__ import annotations

import pytest
import torch

from cce_compile.demo.models import GatedLinearAttention, ModelConfig, build

CFG = ModelConfig(vocab=101, dim=32, layers=2, heads=4, context=32, chunk=8)


@pytest.mark.parametrize("arch", ["gpt", "gla"])
def test_shapes_and_loss(arch):
    torch.manual_seed(0)
    model = build(arch, CFG)
    idx = torch.randint(0, CFG.vocab, (3, 32))
    assert model.hidden(idx).shape == (3, 32, CFG.dim)
    loss = model(idx, idx)
    assert loss.shape == () and abs(loss.item() - torch.log(torch.tensor(101.0)).item()) < 0.5
    loss.backward()
    assert model.lm_head.weight is model.wte.weight and model.wte.weight.grad is not None


def _gla_recurrence(layer, x):
    """The same layer token by token: S_t = exp(g_t) S_{t-1} + k_t^T v_t ; o_t = q_t S_t,
    then the per-head RMS norm."""
    b, t, d = x.shape
    h = CFG.heads
    q, k, v = layer.qkv(x).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
    q = q * (d // h) ** -0.5
    gate = torch.nn.functional.logsigmoid(layer.gate(x)).transpose(1, 2) / 16
    state = x.new_zeros(b, h, d // h, d // h)
    outs = []
    for step in range(t):
        state = state * gate[:, :, step].exp()[..., None, None] + (
            k[:, :, step, :, None] * v[:, :, step, None, :]
        )
        outs.append((q[:, :, step, None, :] @ state)[:, :, 0])
    y = torch.nn.functional.rms_norm(torch.stack(outs, 2), (d // h,), eps=CFG.norm_eps)
    return layer.out(y.transpose(1, 2).reshape(b, t, d))


# "weak": the initial gates (decay ~0.97 per step); "strong": decay ~0.1 per step, and heads
# that differ, so chunk-to-chunk decay matters and a wrong exponent shows.
@pytest.mark.parametrize("gates", ["weak", "strong"])
def test_gla_chunked_equals_recurrence(gates):
    torch.manual_seed(0)
    layer = GatedLinearAttention(CFG).double()
    if gates == "strong":
        with torch.no_grad():
            layer.gate.bias.copy_(torch.tensor([-40.0, -20.0, -5.0, 2.0]))
    x = torch.randn(2, 32, CFG.dim, dtype=torch.float64, requires_grad=True)
    chunked = layer(x)
    grad_out = torch.randn_like(chunked)
    got = torch.autograd.grad(chunked, [x, *layer.parameters()], grad_out)
    reference = _gla_recurrence(layer, x)
    want = torch.autograd.grad(reference, [x, *layer.parameters()], grad_out)
    torch.testing.assert_close(chunked, reference, rtol=1e-10, atol=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


def test_gla_rejects_partial_chunk():
    with pytest.raises(ValueError, match="chunk"):
        GatedLinearAttention(CFG)(torch.randn(1, 30, CFG.dim))


def test_gla_is_one_model_in_float32_and_float64():
    """The output norm's eps is fixed, not the dtype's machine epsilon: with that default the
    float32 and float64 gradients differed by 31% here (two different models), and the float32
    model amplified rounding enough to make its training chaotic within ten steps."""
    grads = {}
    idx = torch.randint(0, CFG.vocab, (4, 32), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)
        model = build("gla", CFG).to(dtype)
        model(idx, idx.roll(-1, 1)).backward()
        grads[dtype] = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    want = grads[torch.float64]
    assert (grads[torch.float32] - want).norm() / want.norm() < 1e-5
