"""GPU-only tests at realistic shapes: accuracy, no host sync, NaN for bad targets, int64 sizes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from oracle import Case, oracle
from oracle import rel_error as rel

import cce_compile

pytestmark = pytest.mark.gpu
lce = cce_compile.linear_cross_entropy


def realistic(batch=2, time=2049, dim=2304, vocab=50257, dtype=torch.bfloat16, seed=0):
    """D not a power of 2, V not a multiple of any tile, 10% ignored targets."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(batch, time, dim, device="cuda", generator=gen).to(dtype)
    classifier = (torch.randn(vocab, dim, device="cuda", generator=gen) * 0.02).to(dtype)
    targets = torch.randint(0, vocab, (batch, time), device="cuda", generator=gen)
    ignored = torch.rand(batch, time, device="cuda", generator=gen) < 0.1
    targets[ignored] = -100
    return hidden, classifier, targets


@pytest.mark.parametrize("mode", ["lean", "fast"])
@pytest.mark.parametrize(
    "options",
    [{}, {"softcap": 30.0, "label_smoothing": 0.1, "shift": 1}],
    ids=["plain", "softcap-smoothing-shift"],
)
# 2304: the large tiles; 520 and 515 with the plain epilogue: the small-tile configuration
# (D <= 2048; the heavy epilogue keeps its tiles), with TMA (rows 16-byte aligned) and with
# pointers (odd D). tests/test_triton_path.py checks which configuration each case gets.
@pytest.mark.parametrize("dim", [2304, 520, 515], ids=["d2304", "d520-tma", "d515-pointers"])
def test_realistic_shape_matches_float64(mode, options, dim):
    hidden, classifier, targets = realistic(dim=dim)
    bias = (torch.randn(classifier.shape[0], device="cuda") * 0.1).bfloat16()
    leaves = [t.clone().requires_grad_() for t in (hidden, classifier, bias)]
    loss = lce(*leaves[:2], targets, leaves[2], mode=mode, **options)
    loss.backward()
    leaves64 = [t.double().requires_grad_() for t in (hidden, classifier, bias)]
    expected = oracle(Case(*leaves64[:2], targets, bias=leaves64[2], **options))
    expected.backward()
    # Lean mode: float32 logits. Fast mode: logits rounded once to bf16 by cuBLAS, as eager.
    tolerance = 1e-5 if mode == "lean" else 2e-3
    assert abs(loss.item() - expected.item()) <= tolerance * abs(expected.item())
    for ours, ref in zip(leaves, leaves64):
        # bf16 gradients: one rounding of a float32 result, ||err|| / ||g|| ~ 2^-9.
        assert rel(ours.grad, ref.grad) < 5e-3


@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_no_host_synchronisation(mode):
    hidden, classifier, targets = realistic(time=512, vocab=32003)
    hidden.requires_grad_()
    classifier.requires_grad_()
    lce(hidden, classifier, targets, mode=mode).backward()  # warm up: compile the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = lce(hidden, classifier, targets, mode=mode, label_smoothing=0.1, z_loss=1e-4)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_out_of_range_target_gives_nan_not_a_number():
    hidden, classifier, targets = realistic(time=256, vocab=1000)
    targets[0, 5] = 1000
    loss = lce(hidden, classifier, targets, reduction="none")
    assert math.isnan(loss[0, 5].item())
    assert not torch.isnan(loss[0, :5]).any()
    assert math.isnan(lce(hidden, classifier, targets).item())
    with cce_compile.config.override(check_targets=True):
        with pytest.raises(IndexError, match="out of bounds"):
            lce(hidden, classifier, targets)


def test_more_than_2_to_31_hidden_elements():
    # N * D = 2^20 * 2^11 = 2^31: element offsets need 64 bits.
    hidden, classifier, targets = realistic(batch=1, time=2**20 + 3, dim=2048, vocab=257)
    hidden.requires_grad_()
    loss = lce(hidden, classifier, targets, mode="lean")
    loss.backward()
    rows = torch.arange(hidden.shape[1] - 1000, hidden.shape[1], device="cuda")
    with torch.no_grad():
        logits = hidden[0, rows].float() @ classifier.float().T
        valid = targets[0, rows] != -100
        expected_tail = F.cross_entropy(logits, targets[0, rows], reduction="none")
        full = lce(hidden, classifier, targets, reduction="none")
    assert rel(full[0, rows][valid], expected_tail[valid]) < 1e-5
    p = torch.softmax(logits, -1)
    p[torch.arange(1000), targets[0, rows].clamp(min=0)] -= 1
    p[~valid] = 0
    expected_grad = (p @ classifier.float()) / (targets != -100).sum()
    assert rel(hidden.grad[0, rows], expected_grad) < 1e-2
