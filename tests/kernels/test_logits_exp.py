"""Fast mode's fused passes (``logits_exp`` in the GEMM, then ``scaled_exp_grad``) against float64.

The GEMM's epilogue writes exp(z - tile max), the tile maxima, partial lse per tile, the
target logit and partial weighted sums; with the rows' lse (the partials' logsumexp) pass 2
must give the logits' gradient as ``chunk_softmax_grad`` defines it: (coef_p * softmax -
coef_t * onehot - coef_w * w) * logit_scale, coef_p = p_base + p_per_lse * lse. On CPU the
interpreter's tiles are 16 wide, so several tiles, programs and a partial last tile occur.
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


def _config(dtype):
    from cce_compile.implementations.triton_shared import tile_config

    return tile_config(
        torch.device(DEVICE), elem_bytes=torch.tensor([], dtype=dtype).element_size(), dim=64
    )


def _run_fused(
    h, classifier, targets, coefs, *, scale, bias, weights, smoothing, exp_dtype, padded=False
):
    from cce_compile.kernels.logits_exp import exp_blocks, logits_exp
    from cce_compile.kernels.scaled_exp_grad import scaled_exp_grad

    config = _config(h.dtype)
    n, vocab = h.shape[0], classifier.shape[0]
    f32 = lambda *shape: torch.full(shape, float("nan"), device=DEVICE)  # noqa: E731
    width = -(-vocab // 8) * 8 if padded else vocab  # 16-byte rows: the TMA tile store
    exps = torch.full((n, width), float("nan"), dtype=exp_dtype, device=DEVICE)[:, :vocab]
    block_max = f32(n, exp_blocks(vocab, config))
    partial_lse = f32(n, exp_blocks(vocab, config))
    partial_wsum = f32(n, exp_blocks(vocab, config)) if smoothing else None
    target_logit = f32(n)
    logits_exp(
        h,
        classifier,
        targets,
        exps,
        block_max,
        partial_lse,
        target_logit,
        partial_wsum,
        logit_scale=scale,
        bias=bias,
        class_weights=weights,
        config=config,
    )
    first_pass = exps.clone()
    lse = f32(n)  # written by pass 2, from the partials
    wsum = f32(n) if smoothing else None
    scaled_exp_grad(
        exps,
        block_max,
        partial_lse,
        targets,
        target_logit,
        coefs,
        lse,
        partial_wsum=partial_wsum,
        wsum=wsum,
        logit_scale=scale,
        smoothing=smoothing,
        class_weights=weights,
        block=4 * config.block_v,
        max_block=config.block_v,
    )
    return first_pass, block_max, exps, lse, target_logit, wsum


CASES = {
    "plain": dict(),
    "bias-scale": dict(bias=True, scale=1.7),
    "smoothing-weights-z_loss": dict(smoothing=True, weights=True, z_loss=True),
    "smoothing-unweighted": dict(smoothing=True),
    "neg_inf_bias_tile": dict(bias=True, inf_tile=True),
    "strided_h": dict(strided=True),
    "one_tile": dict(vocab=13),
    "padded_rows": dict(padded=True),
    "bf16": dict(dtype=torch.bfloat16, padded=True, bias=True),
}
# Rounding of the buffers: float32 math where they are float32; where they are bf16, e and then
# the gradient are rounded once each, each by up to one ulp (2^-7 relative at a binade's foot:
# the interpreter truncates; a GPU rounds to nearest, half that).
ROUNDING = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2**-6, atol=1e-5)}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fused_passes_match_float64(case):
    gen = torch.Generator().manual_seed(5)
    n, dim, vocab = 37, 40, case.get("vocab", 77)
    scale = case.get("scale", 1.0)
    wide = torch.randn(n, dim + 8, generator=gen)
    h = wide[:, :dim] if case.get("strided") else wide[:, :dim].contiguous()
    classifier = torch.randn(vocab, dim, generator=gen) / 2
    bias = torch.randn(vocab, generator=gen) if case.get("bias") else None
    dtype = case.get("dtype", torch.float32)
    h, classifier, bias = (None if t is None else t.to(dtype) for t in (h, classifier, bias))
    if case.get("inf_tile"):  # a whole tile (and program) of classes masked out by its bias
        bias[32:64] = float("-inf")
    weights = torch.rand(vocab, generator=gen) if case.get("weights") else None
    targets = torch.randint(0, vocab, (n,), generator=gen)
    if case.get("inf_tile"):
        targets[(targets >= 32) & (targets < 64)] = 0  # probability 0: an infinite loss
    p_base, coef_t, coef_w = (torch.rand(n, generator=gen) for _ in range(3))
    p_base[2] = coef_t[2] = coef_w[2] = 0.0  # a row without a loss: zero gradient
    p_per_lse = torch.rand(n, generator=gen) * 0.1 if case.get("z_loss") else None
    if p_per_lse is not None:
        p_per_lse[2] = 0.0
    smoothing = bool(case.get("smoothing"))

    y = h.double() @ classifier.double().T
    z = (y + (0 if bias is None else bias.double())) * scale
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
    first, block_max, got, got_lse, got_target, got_wsum = _run_fused(
        move(h),
        move(classifier),
        move(targets),
        coefs,
        scale=scale,
        bias=move(bias),
        weights=move(weights),
        smoothing=smoothing,
        exp_dtype=dtype,
        padded=bool(case.get("padded")),
    )
    tol = ROUNDING[dtype]
    # Pass 1's exponentials are exp(z - m_t) with m_t their tile's row max (0 if all -inf).
    tile = block_max.shape[1] and -(-vocab // block_max.shape[1])
    m_t = block_max.cpu().double().repeat_interleave(tile, 1)[:, :vocab]
    torch.testing.assert_close(first.cpu().double(), torch.exp(z - m_t), **tol)
    torch.testing.assert_close(got_lse.cpu().double(), lse, rtol=1e-5, atol=1e-5)
    target_z = z.gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(got_target.cpu().double(), target_z, rtol=1e-5, atol=1e-5)
    if smoothing:
        wz = torch.where(w > 0, w * z, 0.0).sum(1)
        torch.testing.assert_close(got_wsum.cpu().double(), wz, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.cpu().double(), g, **tol)


def test_fused_pass_propagates_nan_logits():
    """A NaN logit makes its row's lse NaN (PyTorch's loss is NaN), even in a tile whose other
    logits a -inf bias masks out; the other rows stay finite."""
    n, dim, vocab = 4, 16, 48
    h = torch.randn(n, dim)
    h[1, 0] = float("nan")
    bias = torch.zeros(vocab)
    bias[:16] = float("-inf")
    targets = torch.full((n,), 20)
    zeros = torch.zeros(n)
    coefs = (zeros.to(DEVICE), None, zeros.to(DEVICE), zeros.to(DEVICE))
    *_, lse, _, _ = _run_fused(
        h.to(DEVICE),
        torch.randn(vocab, dim).to(DEVICE),
        targets.to(DEVICE),
        coefs,
        scale=1.0,
        bias=bias.to(DEVICE),
        weights=None,
        smoothing=False,
        exp_dtype=torch.float32,
    )
    assert torch.isnan(lse[1]) and torch.isfinite(lse[[0, 2, 3]]).all()


def _logits_exp_outputs(h, classifier, targets, row_limit):
    """Every output of one ``logits_exp`` call, NaN where it wrote nothing."""
    from cce_compile.kernels.logits_exp import exp_blocks, logits_exp

    config = _config(h.dtype)
    n, vocab = h.shape[0], classifier.shape[0]
    tiles = exp_blocks(vocab, config)
    outs = dict(
        exps=torch.full((n, vocab), float("nan"), device=DEVICE),
        block_max=torch.full((n, tiles), float("nan"), device=DEVICE),
        partial_lse=torch.full((n, tiles), float("nan"), device=DEVICE),
        target_logit=torch.full((n,), float("nan"), device=DEVICE),
    )
    logits_exp(h, classifier, targets, **outs, logit_scale=1.0, config=config, row_limit=row_limit)
    return outs


# Rows counted on the device: none, inside the first row tile, on a tile's edge, all, past all.
ROW_LIMITS = {"none": 0, "partial-tile": 5, "tile-edge": 16, "all": 37, "past-all": 50}


@pytest.mark.parametrize("limit", ROW_LIMITS.values(), ids=ROW_LIMITS)
def test_row_limit_computes_the_rows_before_it_and_leaves_the_rest(limit):
    """A count that only the device holds (compaction's kept-first rows): the rows before it
    are exactly those of a call without it; the per-row outputs after it are not written, nor
    are the exponentials past the row tile the count ends in (the tile is stored whole)."""
    n, dim, vocab = 37, 16, 40
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(n, dim, generator=gen).to(DEVICE)
    classifier = torch.randn(vocab, dim, generator=gen).to(DEVICE)
    targets = torch.randint(0, vocab, (n,), generator=gen).to(DEVICE)
    whole = _logits_exp_outputs(h, classifier, targets, None)
    limited = _logits_exp_outputs(h, classifier, targets, torch.tensor(limit, device=DEVICE))
    computed = min(limit, n)
    block_n = _config(h.dtype).block_n
    for name, got in limited.items():
        assert torch.equal(got[:computed], whole[name][:computed]), name
        untouched = -(-computed // block_n) * block_n if name == "exps" else computed
        assert torch.isnan(got[untouched:]).all(), name


@pytest.mark.parametrize(
    "bad",
    [
        "classifier_dtype",
        "exps_shape",
        "block_max_shape",
        "targets_dtype",
        "partial_shape",
        "row_limit_dtype",
    ],
)
def test_logits_exp_rejects_mismatched_buffers(bad):
    from cce_compile.kernels.logits_exp import exp_blocks, logits_exp

    config = _config(torch.float32)
    n, dim, vocab = 5, 16, 40
    args = dict(
        h=torch.zeros(n, dim, device=DEVICE),
        classifier=torch.zeros(vocab, dim, device=DEVICE),
        targets=torch.zeros(n, dtype=torch.int64, device=DEVICE),
        exps=torch.zeros(n, vocab, device=DEVICE),
        block_max=torch.zeros(n, exp_blocks(vocab, config), device=DEVICE),
        partial_lse=torch.zeros(n, exp_blocks(vocab, config), device=DEVICE),
        target_logit=torch.zeros(n, device=DEVICE),
    )
    if bad == "classifier_dtype":
        args["classifier"] = args["classifier"].double()
    elif bad == "exps_shape":
        args["exps"] = args["exps"][:, 1:]
    elif bad == "block_max_shape":
        args["block_max"] = args["block_max"][:, 1:]
    elif bad == "targets_dtype":
        args["targets"] = args["targets"].int()
    elif bad == "row_limit_dtype":
        args["row_limit"] = torch.tensor(3, dtype=torch.int32, device=DEVICE)
    else:
        args["partial_lse"] = args["partial_lse"][1:]
    with pytest.raises(ValueError):
        logits_exp(**args, logit_scale=1.0, config=config)


def _every_other(t):
    """A strided (n,) view with t's values: what a program indexing by row would misread."""
    wide = torch.zeros(2 * t.shape[0], dtype=t.dtype, device=t.device)
    wide[::2] = t
    return wide[::2]


SCALED_EXP_GRAD_MISMATCHES = {
    "strided_targets": "contiguous",
    "strided_target_logit": "contiguous",
    "strided_lse": "contiguous",
    "block_max_shape": "block_max",
    "partial_lse_shape": "partial_lse",
    "wsum_alone": "come together",
    "partial_wsum_stride": "its strides",
    "max_block": "must divide",
}


@pytest.mark.parametrize(
    "bad, match", SCALED_EXP_GRAD_MISMATCHES.items(), ids=SCALED_EXP_GRAD_MISMATCHES.keys()
)
def test_scaled_exp_grad_rejects_mismatched_buffers(bad, match):
    """The program reads row i's target, target logit and lse at offset i: a strided view
    (targets[::2]) would be read as its storage's first n elements, silently wrong. The block
    maxima must match their granularity, which must divide the loop's block."""
    from cce_compile.kernels.scaled_exp_grad import scaled_exp_grad

    n, vocab, block, max_block = 4, 32, 16, 8
    row = lambda: torch.zeros(n, device=DEVICE)  # noqa: E731
    args = dict(
        exps=torch.zeros(n, vocab, device=DEVICE),
        block_max=torch.zeros(n, vocab // max_block, device=DEVICE),
        partial_lse=torch.zeros(n, vocab // max_block, device=DEVICE),
        targets=torch.tensor([3, 7, 20, 31], device=DEVICE),
        target_logit=row(),
        coefs=(row(), None, row(), row()),
        lse=row(),
    )
    if bad.startswith("strided"):
        name = bad.removeprefix("strided_")
        args[name] = _every_other(args[name])
    elif bad.endswith("_shape"):
        name = bad.removesuffix("_shape")
        args[name] = torch.zeros(n, vocab // block, device=DEVICE)
    elif bad == "wsum_alone":
        args["wsum"] = row()
    elif bad == "partial_wsum_stride":  # the two partials share the kernel's row stride
        args["wsum"] = row()
        args["partial_wsum"] = torch.zeros(n, 2 * (vocab // max_block), device=DEVICE)[:, ::2]
    else:
        max_block = 3 * block
    with pytest.raises(ValueError, match=match):
        scaled_exp_grad(**args, logit_scale=1.0, smoothing=False, block=block, max_block=max_block)


def test_pass2_reduces_the_partials_as_torch_logsumexp():
    """Each row's lse comes from its blocks' partial lse inside pass 2: -inf where every block
    is -inf (a row masked out by its bias), inf where one is, NaN where one is NaN, as
    ``torch.logsumexp`` gives; the weighted sums are the partials' sums."""
    from cce_compile.kernels.scaled_exp_grad import scaled_exp_grad

    n, vocab, max_block = 5, 40, 8
    blocks = vocab // max_block
    gen = torch.Generator().manual_seed(3)
    partial_lse = torch.randn(n, blocks, generator=gen) * 30
    partial_lse[1] = float("-inf")
    partial_lse[2, 3] = float("inf")
    partial_lse[3, 0] = float("nan")
    partial_lse[4, 1:] = float("-inf")
    partial_wsum = torch.randn(n, blocks, generator=gen)
    row = lambda: torch.zeros(n, device=DEVICE)  # noqa: E731
    lse, wsum = row(), row()
    scaled_exp_grad(
        torch.zeros(n, vocab, device=DEVICE),
        torch.zeros(n, blocks, device=DEVICE),
        partial_lse.to(DEVICE),
        torch.zeros(n, dtype=torch.int64, device=DEVICE),
        row(),
        (row(), None, row(), row()),
        lse,
        partial_wsum=partial_wsum.to(DEVICE),
        wsum=wsum,
        logit_scale=1.0,
        smoothing=True,
        block=16,
        max_block=max_block,
    )
    expected = torch.logsumexp(partial_lse.double(), 1)
    torch.testing.assert_close(lse.cpu().double(), expected, rtol=1e-6, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(wsum.cpu(), partial_wsum.sum(1), rtol=1e-6, atol=1e-6)


def test_pass2_without_classes_gives_each_row_log_zero():
    """No classes (a (0, D) classifier): torch.logsumexp over no terms is -inf, and the
    weighted sum over no classes 0; the rows' buffers must not keep what was in memory."""
    from cce_compile.kernels.scaled_exp_grad import scaled_exp_grad

    n = 3
    lse, wsum = torch.full((n,), 123.0, device=DEVICE), torch.full((n,), 123.0, device=DEVICE)
    empty = torch.zeros(n, 0, device=DEVICE)
    row = torch.zeros(n, device=DEVICE)
    scaled_exp_grad(
        empty,
        empty,
        empty,
        torch.zeros(n, dtype=torch.int64, device=DEVICE),
        row,
        (row, None, row, row),
        lse,
        partial_wsum=empty,
        wsum=wsum,
        logit_scale=1.0,
        smoothing=True,
        block=16,
        max_block=8,
    )
    assert torch.equal(lse.cpu(), torch.full((n,), float("-inf")))
    assert torch.equal(wsum.cpu(), torch.zeros(n))
