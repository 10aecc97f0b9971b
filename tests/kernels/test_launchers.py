"""Kernel launchers: shape checks, and each kernel's output against float64 torch math."""

from __future__ import annotations

import os

import pytest
import torch
from strategies import random_targets

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def small_config():
    """The tiles the op would use for these (float32) inputs on this device."""
    from cce_compile.implementations import triton_shared

    return triton_shared.tile_config(torch.device(DEVICE), elem_bytes=4, dim=37)


def logits64(hidden, classifier, bias, shift, scale, softcap):
    rows = hidden[:, : hidden.shape[1] - shift].reshape(-1, hidden.shape[-1]).double()
    y = rows @ classifier.double().T
    if bias is not None:
        y = y + bias.double()
    z = y * scale
    return softcap * torch.tanh(z / softcap) if softcap else z


@pytest.mark.parametrize("softcap", [0.0, 4.0], ids=["plain", "softcap"])
def test_lse_forward_partials(softcap):
    from cce_compile.kernels.lse_forward import lse_forward

    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 11, 37, generator=gen).to(DEVICE)
    classifier = (torch.randn(53, 37, generator=gen) / 6).to(DEVICE)
    bias = torch.randn(53, generator=gen).to(DEVICE)
    weights = torch.rand(53, generator=gen).to(DEVICE)
    targets = random_targets((2, 11), 53, 0.2, -100, gen).to(DEVICE)
    partial, target_logit, partial_wsum = lse_forward(
        hidden,
        classifier,
        targets,
        bias,
        weights,
        shift=2,
        ignore_index=-100,
        logit_scale=0.7,
        softcap=softcap,
        skip_ignored_tiles=False,
        needs_wsum=True,
        config=small_config(),
    )
    z = logits64(hidden, classifier, bias, 2, 0.7, softcap)
    rows = targets[:, 2:].reshape(-1)
    valid = rows != -100
    torch.testing.assert_close(
        torch.logsumexp(partial, 0).double(), torch.logsumexp(z, -1), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(
        target_logit.double()[valid], z[valid, rows[valid]], rtol=1e-6, atol=1e-6
    )
    assert torch.all(target_logit[~valid] == 0)
    torch.testing.assert_close(
        partial_wsum.sum(0).double(), z @ weights.double(), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    ("ignore_index", "skipped"),
    [(2**32 + 5, False), (2**40 + 5, False), (-(2**40), False), (5, True)],
    ids=["2^32+5", "2^40+5", "-2^40", "in-range-5"],
)
def test_lse_forward_skips_only_tiles_of_ignored_rows_of_int32_targets(ignore_index, skipped):
    # Every target is 5 (int32): only ignore_index 5 ignores them, as PyTorch compares in
    # int64; the others wrap to 5 or 0 in int32 and must not skip a tile of counted rows.
    from cce_compile.kernels.lse_forward import lse_forward

    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 9, 37, generator=gen).to(DEVICE)
    classifier = (torch.randn(20, 37, generator=gen) / 6).to(DEVICE)
    targets = torch.full((2, 9), 5, dtype=torch.int32, device=DEVICE)
    targets[1] = ignore_index % 2**32  # its int32 wrap-around: 5, 5, 0 (and 5 itself)
    partial, _, _ = lse_forward(
        hidden,
        classifier,
        targets,
        None,
        None,
        shift=0,
        ignore_index=ignore_index,
        logit_scale=1.0,
        softcap=0.0,
        skip_ignored_tiles=True,
        needs_wsum=False,
        config=small_config(),
    )
    lse = torch.logsumexp(partial, 0)
    if skipped:
        assert torch.all(lse == float("-inf"))  # never read: the tiles cost nothing
    else:
        z = logits64(hidden, classifier, None, 0, 1.0, 0.0)
        torch.testing.assert_close(lse.double(), torch.logsumexp(z, -1), rtol=1e-6, atol=1e-6)


def test_logit_grad_slab_matches_formula():
    from cce_compile.kernels.logit_grad import logit_grad

    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 7, 21, generator=gen).to(DEVICE)
    classifier = (torch.randn(40, 21, generator=gen) / 5).to(DEVICE)
    targets = random_targets((3, 7), 40, 0.3, -100, gen).to(DEVICE)
    z = logits64(hidden, classifier, None, 0, 1.0, 0.0)
    lse = torch.logsumexp(z, -1).float()
    coefs = tuple(torch.rand(21, generator=gen).to(DEVICE) for _ in range(3))
    coefs[0][:4] = 0  # inactive rows write zeros
    coefs[1][:4] = 0
    coefs[2][:4] = 0
    slab = torch.full((21, 20), float("nan"), device=DEVICE)
    logit_grad(
        hidden,
        classifier[17:37],  # classes 17..36 of the vocabulary that the targets index
        targets,
        None,
        None,
        lse,
        coefs,
        slab,
        target_offset=17,
        shift=0,
        logit_scale=1.0,
        softcap=0.0,
        smoothing=True,
        config=small_config(),
    )
    cols = torch.arange(17, 37, device=DEVICE)
    p = torch.exp(z[:, 17:37] - lse.double()[:, None])
    onehot = (targets.reshape(-1)[:, None] == cols[None, :]).double()
    c_p, c_t, c_w = (c.double()[:, None] for c in coefs)
    expected = c_p * p - c_t * onehot - c_w
    torch.testing.assert_close(slab.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.all(slab[:4] == 0)


def test_chunk_softmax_grad_in_place():
    from cce_compile.kernels.chunk_softmax_grad import chunk_softmax_grad

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(9, 77, generator=gen) * 3).to(DEVICE)
    original = logits.double().clone()
    targets = torch.randint(0, 77, (9,), generator=gen).to(DEVICE)
    p_base, p_lse, c_t, c_w = (torch.rand(9, generator=gen).to(DEVICE) for _ in range(4))
    lse, target_logit, wsum = chunk_softmax_grad(
        logits,
        targets,
        None,
        p_base,
        p_lse,
        c_t,
        c_w,
        logit_scale=1.0,
        softcap=0.0,
        smoothing=True,
        block=32,
    )
    lse64 = torch.logsumexp(original, -1)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(target_logit.double(), original.gather(1, targets[:, None])[:, 0])
    torch.testing.assert_close(wsum.double(), original.sum(-1), rtol=1e-5, atol=1e-5)
    coef_p = (p_base + p_lse * lse).double()[:, None]
    onehot = torch.nn.functional.one_hot(targets, 77).double()
    expected = coef_p * torch.exp(original - lse64[:, None]) - c_t.double()[:, None] * onehot
    expected -= c_w.double()[:, None]
    torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-6)


def test_chunk_row_stats_then_the_gradient_with_a_given_lse():
    """A vocabulary shard's two passes (the vocabulary-parallel fast mode): the shard's
    statistics with targets on other shards (-1: target logit exactly 0), then the gradient
    with a given lse (here the shard's own plus a constant, as another rank's classes add)."""
    from cce_compile.kernels.chunk_softmax_grad import chunk_row_stats, chunk_softmax_grad

    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(7, 45, generator=gen) * 3).to(DEVICE)
    bias = torch.randn(45, generator=gen).to(DEVICE)
    weights = (torch.rand(45, generator=gen) + 0.5).to(DEVICE)
    z = 4.0 * torch.tanh((logits.double() + bias.double()) * 0.7 / 4.0)
    targets = torch.randint(0, 45, (7,), generator=gen).to(DEVICE)
    targets[::2] = -1  # on another rank's shard
    options = dict(logit_scale=0.7, softcap=4.0, smoothing=True, bias=bias, block=16)
    lse, target_logit, wsum = chunk_row_stats(logits, targets, weights, **options)
    torch.testing.assert_close(lse.double(), torch.logsumexp(z, -1), rtol=1e-6, atol=1e-6)
    here = targets >= 0
    expected_target = torch.where(here, z.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(target_logit.double(), expected_target, rtol=1e-6, atol=1e-6)
    assert torch.all(target_logit[~here] == 0)
    torch.testing.assert_close(wsum.double(), z @ weights.double(), rtol=1e-5, atol=1e-5)

    whole_lse = lse + 1.5
    p_base, c_t, c_w = (torch.rand(7, generator=gen).to(DEVICE) for _ in range(3))
    returned = chunk_softmax_grad(
        logits, targets, weights, p_base, None, c_t, c_w, lse=whole_lse, **options
    )
    assert returned[0] is whole_lse and returned[1:] == (None, None)
    onehot = (targets[:, None] == torch.arange(45, device=DEVICE)).double()
    dz = p_base.double()[:, None] * torch.exp(z - whole_lse.double()[:, None])
    dz = dz - c_t.double()[:, None] * onehot - c_w.double()[:, None] * weights.double()
    expected = dz * (1 - (z / 4.0) ** 2) * 0.7
    torch.testing.assert_close(logits.double(), expected, rtol=1e-5, atol=1e-6)

    empty = torch.empty(3, 0, device=DEVICE)  # an empty shard
    lse, target_logit, wsum = chunk_row_stats(
        empty, targets[:3], None, logit_scale=1.0, softcap=None, smoothing=True
    )
    assert torch.all(lse == float("-inf")) and not target_logit.any() and not wsum.any()


def test_chunk_softmax_grad_writes_a_half_width_gradient_over_its_float32_logits():
    """The bf16 gradient of each row lands over the first half of its own float32 row."""
    from cce_compile.kernels.chunk_softmax_grad import chunk_softmax_grad

    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(5, 75, generator=gen) * 2).to(DEVICE)
    bias = torch.randn(75, generator=gen).to(DEVICE)
    original = logits.double().clone() + bias.double()
    targets = torch.randint(0, 75, (5,), generator=gen).to(DEVICE)
    ones, zeros = torch.ones(5, device=DEVICE), torch.zeros(5, device=DEVICE)
    grad = logits.view(torch.bfloat16)[:, :75]
    lse, _, _ = chunk_softmax_grad(
        logits,
        targets,
        None,
        ones,
        None,
        ones,
        zeros,
        logit_scale=1.0,
        softcap=None,
        smoothing=False,
        bias=bias,
        grad=grad,
        block=16,
    )
    lse64 = torch.logsumexp(original, -1)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-6, atol=1e-6)
    expected = torch.softmax(original, -1) - torch.nn.functional.one_hot(targets, 75).double()
    # bf16: one rounding (the interpreter truncates: 2^-7 relative)
    torch.testing.assert_close(grad.double(), expected, rtol=2**-7, atol=1e-3)


def test_launchers_check_shapes():
    from cce_compile.kernels.chunk_softmax_grad import chunk_softmax_grad
    from cce_compile.kernels.logit_grad import logit_grad
    from cce_compile.kernels.lse_forward import lse_forward

    hidden = torch.randn(2, 5, 8, device=DEVICE)
    classifier = torch.randn(11, 8, device=DEVICE)
    targets = torch.zeros(2, 5, dtype=torch.long, device=DEVICE)
    common = dict(
        shift=0,
        ignore_index=-100,
        logit_scale=1.0,
        softcap=0.0,
        skip_ignored_tiles=False,
        needs_wsum=False,
    )
    with pytest.raises(ValueError, match="classifier"):
        lse_forward(hidden, classifier[:, :7], targets, None, None, **common)
    with pytest.raises(ValueError, match="targets"):
        lse_forward(hidden, classifier, targets[:, :4], None, None, **common)
    with pytest.raises(ValueError, match="shift"):
        lse_forward(hidden, classifier, targets, None, None, **{**common, "shift": 5})
    lse = torch.zeros(10, device=DEVICE)
    coefs = (lse, lse, lse)

    def slab_grad(slab, classes):
        return logit_grad(
            *(hidden, classifier[classes], targets, None, None, lse, coefs, slab),
            target_offset=classes.start,
            shift=0,
            logit_scale=1.0,
            softcap=0.0,
            smoothing=False,
        )

    with pytest.raises(ValueError, match="slab"):
        slab_grad(torch.empty(9, 4, device=DEVICE), slice(0, 4))
    with pytest.raises(ValueError, match="slab"):  # 5 classes, 4 slab columns
        slab_grad(torch.empty(10, 4, device=DEVICE), slice(6, 11))
    with pytest.raises(ValueError, match="targets"):
        chunk_softmax_grad(
            torch.zeros(3, 7, device=DEVICE),
            torch.zeros(3, dtype=torch.int32, device=DEVICE),
            None,
            *(torch.zeros(3, device=DEVICE),) * 4,
            logit_scale=1.0,
            softcap=0.0,
            smoothing=False,
        )
