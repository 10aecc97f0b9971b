"""Fast mode's slabbed passes (``slab_exp`` then ``scaled_exp_grad``) against float64 math.

The two passes over a chunk's logits, slab by slab of classes, must give each row's lse,
target logit and weighted sum, and the logits' gradient, as ``chunk_softmax_grad`` defines
them: (coef_p * softmax - coef_t * onehot - coef_w * w) * logit_scale, coef_p = p_base +
p_per_lse * lse. Small blocks (16 classes) so that slabs, blocks and a partial last block all
occur at test sizes.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 16


def _run_slabs(y, targets, coefs, *, slab, scale, bias, weights, smoothing, work_dtype):
    from cce_compile.kernels.scaled_exp_grad import scaled_exp_grad
    from cce_compile.kernels.slab_exp import slab_blocks, slab_exp

    n, vocab = y.shape
    exps = torch.empty((n, vocab), dtype=work_dtype, device=DEVICE)
    block_max = torch.empty((n, slab_blocks(vocab, BLOCK)), device=DEVICE)
    running = (torch.empty(n, device=DEVICE), torch.empty(n, device=DEVICE))
    target_logit = torch.empty(n, device=DEVICE)
    wsum = torch.empty(n, device=DEVICE) if smoothing else None
    for start in range(0, vocab, slab):
        part = y[:, start : start + slab].contiguous()  # the slab buffer the GEMM fills
        slab_exp(
            part,
            exps,
            block_max,
            targets,
            running,
            (target_logit, wsum),
            col_start=start,
            first=start == 0,
            logit_scale=scale,
            bias=bias,
            class_weights=weights,
            block=BLOCK,
        )
    lse = torch.empty(n, device=DEVICE)
    scaled_exp_grad(
        exps,
        block_max,
        targets,
        running,
        target_logit,
        coefs,
        lse,
        logit_scale=scale,
        smoothing=smoothing,
        class_weights=weights,
        block=BLOCK,
    )
    return exps, lse, target_logit, wsum


CASES = {
    "plain": dict(),
    "bias-scale": dict(bias=True, scale=1.7),
    "smoothing-weights-z_loss": dict(smoothing=True, weights=True, z_loss=True),
    "smoothing-unweighted": dict(smoothing=True),
    "one_slab": dict(slab=128),
    "neg_inf_bias_block": dict(bias=True, inf_block=True),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_slabbed_passes_match_float64(case):
    gen = torch.Generator().manual_seed(3)
    n, vocab, slab = 7, 77, case.get("slab", 32)
    scale = case.get("scale", 1.0)
    y = torch.randn(n, vocab, generator=gen) * 3
    bias = torch.randn(vocab, generator=gen) if case.get("bias") else None
    if case.get("inf_block"):  # a whole block of classes masked out by its bias
        bias[BLOCK : 2 * BLOCK] = float("-inf")
    weights = torch.rand(vocab, generator=gen) if case.get("weights") else None
    targets = torch.randint(0, vocab, (n,), generator=gen)
    if case.get("inf_block"):
        targets[targets // BLOCK == 1] = 0  # a target with probability 0 has an infinite loss
    p_base, coef_t, coef_w = (torch.rand(n, generator=gen) for _ in range(3))
    p_base[2] = coef_t[2] = coef_w[2] = 0.0  # a row without a loss: zero gradient
    p_per_lse = torch.rand(n, generator=gen) * 0.1 if case.get("z_loss") else None
    if p_per_lse is not None:
        p_per_lse[2] = 0.0
    smoothing = bool(case.get("smoothing"))

    z = (y.double() + (0 if bias is None else bias.double())) * scale
    lse = torch.logsumexp(z, 1)
    c_p = p_base.double() + (0 if p_per_lse is None else p_per_lse.double() * lse)
    onehot = torch.nn.functional.one_hot(targets, vocab).double()
    w = torch.ones(vocab, dtype=torch.float64) if weights is None else weights.double()
    g = c_p[:, None] * torch.softmax(z, 1) - coef_t.double()[:, None] * onehot
    if smoothing:
        g = g - coef_w.double()[:, None] * w
    g = g * scale
    g[2] = 0.0

    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    coefs = tuple(move(t) for t in (p_base, p_per_lse, coef_t, coef_w))
    got, got_lse, got_target, got_wsum = _run_slabs(
        y.to(DEVICE),
        targets.to(DEVICE),
        coefs,
        slab=slab,
        scale=scale,
        bias=move(bias),
        weights=move(weights),
        smoothing=smoothing,
        work_dtype=torch.float32,
    )
    torch.testing.assert_close(got_lse.cpu().double(), lse, rtol=1e-5, atol=1e-5)
    target_z = z.gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(got_target.cpu().double(), target_z, rtol=1e-5, atol=1e-5)
    if smoothing:
        wz = torch.where(w > 0, w * z, 0.0).sum(1)
        torch.testing.assert_close(got_wsum.cpu().double(), wz, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.cpu().double(), g, rtol=1e-5, atol=1e-6)


def test_slab_exp_rejects_a_slab_off_its_blocks():
    from cce_compile.kernels.slab_exp import slab_blocks, slab_exp

    n, vocab = 2, 40
    exps = torch.empty((n, vocab), device=DEVICE)
    block_max = torch.empty((n, slab_blocks(vocab, BLOCK)), device=DEVICE)
    running = (torch.empty(n, device=DEVICE), torch.empty(n, device=DEVICE))
    with pytest.raises(ValueError, match="must start a block"):
        slab_exp(
            torch.zeros((n, 8), device=DEVICE),
            exps,
            block_max,
            torch.zeros(n, dtype=torch.int64, device=DEVICE),
            running,
            (torch.empty(n, device=DEVICE), None),
            col_start=8,
            first=False,
            logit_scale=1.0,
            block=BLOCK,
        )


def _slab_args(n, vocab):
    from cce_compile.kernels.slab_exp import slab_blocks

    zeros = lambda *shape, dtype=torch.float32: torch.zeros(shape, dtype=dtype, device=DEVICE)  # noqa: E731
    return dict(
        exps=zeros(n, vocab),
        block_max=zeros(n, slab_blocks(vocab, BLOCK)),
        targets=zeros(n, dtype=torch.int64),
        running=(zeros(n), zeros(n)),
        stats=(zeros(n), None),
    )


def _every_other(t):
    """A strided (n,) view with t's values: what a program indexing by row would misread."""
    wide = torch.zeros(2 * t.shape[0], dtype=t.dtype, device=t.device)
    wide[::2] = t
    return wide[::2]


@pytest.mark.parametrize("vector", ["targets", "running_max", "target_logit"])
def test_slab_exp_rejects_strided_row_vectors(vector):
    """The program reads row i's target, running pair and stats at offset i: a strided view
    (targets[::2]) was read as its storage's first n elements, silently wrong."""
    from cce_compile.kernels.slab_exp import slab_exp

    n, vocab = 4, 32
    args = _slab_args(n, vocab)
    if vector == "targets":
        args["targets"] = _every_other(torch.tensor([3, 7, 20, 31], device=DEVICE))
    elif vector == "running_max":
        args["running"] = (_every_other(args["running"][0]), args["running"][1])
    else:
        args["stats"] = (_every_other(args["stats"][0]), None)
    with pytest.raises(ValueError, match="contiguous"):
        slab_exp(
            torch.zeros((n, vocab), device=DEVICE),
            args["exps"],
            args["block_max"],
            args["targets"],
            args["running"],
            args["stats"],
            col_start=0,
            first=True,
            logit_scale=1.0,
            block=BLOCK,
        )


def test_scaled_exp_grad_rejects_strided_targets():
    from cce_compile.kernels.scaled_exp_grad import scaled_exp_grad

    n, vocab = 4, 32
    args = _slab_args(n, vocab)
    row = lambda: torch.zeros(n, device=DEVICE)  # noqa: E731
    with pytest.raises(ValueError, match="contiguous"):
        scaled_exp_grad(
            args["exps"],
            args["block_max"],
            _every_other(torch.tensor([3, 7, 20, 31], device=DEVICE)),
            args["running"],
            row(),
            (row(), None, row(), row()),
            row(),
            logit_scale=1.0,
            smoothing=False,
            block=BLOCK,
        )
