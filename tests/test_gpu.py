"""GPU-only tests at realistic shapes: accuracy, no host sync, NaN for bad targets, int64 sizes."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from oracle import GRAD_RTOL, LOSS_RTOL, Case, gradient_scale, loss_scale, oracle
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


def _leaves(*tensors):
    return [t.clone().requires_grad_() for t in tensors]


def _errors(case: Case, loss, leaves, reference_leaves):
    """(loss error, [gradient errors]) against the float64 oracle, on the oracle's scales."""
    expected = oracle(case)
    grads = torch.autograd.grad(expected, reference_leaves)
    upstream = torch.ones((), dtype=torch.float64, device="cuda")
    scales = gradient_scale(case, upstream, None, reference_leaves)
    loss_err = rel(loss, expected, loss_scale(case))
    return loss_err, [rel(t.grad, g, sc) for t, g, sc in zip(leaves, grads, scales)]


@pytest.mark.parametrize("mode", ["lean", "fast"])
@pytest.mark.parametrize(
    "options",
    [{}, {"softcap": 30.0, "label_smoothing": 0.1, "shift": 1}],
    ids=["plain", "softcap-smoothing-shift"],
)
# 2304: the large tiles; 520 and 515 with the plain epilogue: the small-tile configuration
# (D <= 2048; the heavy epilogue keeps its tiles), with TMA (rows 16-byte aligned) and with
# pointers (odd D). tests/implementations/test_triton_path.py checks which configuration each
# case gets.
@pytest.mark.parametrize("dim", [2304, 520, 515], ids=["d2304", "d520-tma", "d515-pointers"])
def test_realistic_shape_matches_float64(mode, options, dim):
    """Both modes keep float32 logits: the loss to float32 rounding, the gradients to one
    rounding of the bf16 GEMMs' operand (the oracle's tolerances)."""
    hidden, classifier, targets = realistic(dim=dim)
    bias = (torch.randn(classifier.shape[0], device="cuda") * 0.1).bfloat16()
    leaves = _leaves(hidden, classifier, bias)
    loss = lce(*leaves[:2], targets, leaves[2], mode=mode, **options)
    loss.backward()
    wide = [t.double().requires_grad_() for t in (hidden, classifier, bias)]
    case = Case(*wide[:2], targets, bias=wide[2], **options)
    loss_err, grad_errs = _errors(case, loss, leaves, wide)
    assert loss_err <= LOSS_RTOL[torch.bfloat16], loss_err
    assert max(grad_errs) <= GRAD_RTOL[torch.bfloat16], grad_errs


def peaked(batch=2, time=2049, dim=2304, vocab=50257, mass=0.97, seed=0):
    """Each hidden state aligned with its target's classifier row: the target holds ~``mass``
    of the softmax, as in a trained model (bench.py's 'peaked' scenario)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    classifier = torch.randn(vocab, dim, device="cuda", generator=gen) * 0.02
    targets = torch.randint(0, vocab, (batch, time), device="cuda", generator=gen)
    scale = math.log(mass / (1 - mass) * vocab) / (0.0004 * dim)
    noise = torch.randn(batch, time, dim, device="cuda", generator=gen)
    hidden = scale * classifier[targets] + 0.1 * noise
    targets[torch.rand(batch, time, device="cuda", generator=gen) < 0.1] = -100
    return hidden.bfloat16(), classifier.bfloat16(), targets


def test_every_mode_is_as_accurate_as_float32_logits_on_a_peaked_softmax():
    """Issue 15's contract: fast mode's errors are within 1.2x lean's (float32 logits in
    both), where bf16 logits (eager, torch.compile) cost several times more."""
    hidden, classifier, targets = peaked()
    wide = [t.double().requires_grad_() for t in (hidden, classifier)]
    case = Case(*wide, targets)
    errors = {}
    for mode in ("lean", "fast"):
        leaves = _leaves(hidden, classifier)
        loss = lce(*leaves, targets, mode=mode)
        loss.backward()
        errors[mode] = _errors(case, loss, leaves, wide)
    leaves = _leaves(hidden, classifier)
    eager = F.cross_entropy((leaves[0] @ leaves[1].T).float().flatten(0, 1), targets.flatten())
    eager.backward()
    errors["eager"] = _errors(case, eager, leaves, wide)
    (lean_loss, lean_grads), (fast_loss, fast_grads) = errors["lean"], errors["fast"]
    assert fast_loss <= 1.2 * lean_loss + 1e-7, errors
    assert all(f <= 1.2 * g for f, g in zip(fast_grads, lean_grads)), errors
    assert max(lean_grads) <= GRAD_RTOL[torch.bfloat16], errors


def test_float32_weights_under_autocast_are_no_less_accurate_than_eager_autocast():
    """Mixed precision: float32 leaves, bf16 GEMMs inside the op, float32 gradients."""
    hidden, classifier, targets = realistic(time=1025, vocab=32003, dtype=torch.float32)
    errors = {}
    for name in ("cce", "eager"):
        leaves = _leaves(hidden, classifier)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if name == "cce":
                loss = lce(*leaves, targets)
            else:
                logits = leaves[0] @ leaves[1].T
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        assert all(t.grad.dtype == torch.float32 for t in leaves)
        rounded = [t.bfloat16().double().requires_grad_() for t in (hidden, classifier)]
        errors[name] = _errors(Case(*rounded, targets), loss, leaves, rounded)
    assert errors["cce"][0] <= max(errors["eager"][0], LOSS_RTOL[torch.bfloat16]), errors
    for ours, theirs in zip(errors["cce"][1], errors["eager"][1]):
        assert ours <= max(theirs, GRAD_RTOL[torch.float32]), errors


@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_a_second_backward_under_autocast_gives_the_oracles_gradients_again(mode):
    """A second backward through one graph (retain_graph, another upstream gradient) under
    AMP is as accurate as the first. Fast mode hands its forward's gradients to the first
    backward (scaled in place: they are its result), so its second recomputes them as lean
    does, with the upstream folded into bf16 slabs: each within bf16's rounding of the oracle,
    and the first's values unchanged by the second."""
    hidden, classifier, targets = realistic(time=513, vocab=32003, dtype=torch.float32)
    leaves = _leaves(hidden, classifier)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = lce(*leaves, targets, mode=mode)
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    kept = [g.clone() for g in first]
    second = torch.autograd.grad(loss * 3.0, leaves)
    rounded = [t.bfloat16().double().requires_grad_() for t in (hidden, classifier)]
    expected = torch.autograd.grad(oracle(Case(*rounded, targets)), rounded)
    for one, three, want in zip(first, second, expected):
        assert one.dtype == three.dtype == torch.float32
        assert rel(one, want) <= GRAD_RTOL[torch.bfloat16]
        assert rel(three, want * 3.0) <= GRAD_RTOL[torch.bfloat16]
    for one, copy in zip(first, kept):
        assert torch.equal(one, copy), "the second backward changed the first's gradients"


def _synchronisations(fn) -> int:
    """How many synchronising CUDA operations ``fn`` runs: those PyTorch's sync debug mode
    warns of, and waits on an event (fast mode's wait for the kept rows' count, which the
    debug mode does not see)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    event_waits = []
    real_wait = torch.cuda.Event.synchronize
    torch.cuda.Event.synchronize = lambda event: event_waits.append(1) or real_wait(event)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.Event.synchronize = real_wait
    return sum("synchronizing" in str(w.message) for w in caught) + len(event_waits)


@pytest.mark.parametrize("mode", ["lean", "fast"])
@pytest.mark.usefixtures("skip_at_any_size")  # (this size is under policy.MIN_SKIP_MACS)
def test_no_host_synchronisation(mode):
    """Without skipping ignored rows the op never synchronises; with it (the default) the
    forward synchronises once to count the rows, and the backward never."""
    hidden, classifier, targets = realistic(time=512, vocab=32003)
    hidden.requires_grad_()
    classifier.requires_grad_()
    lce(hidden, classifier, targets, mode=mode).backward()  # warm up: compile the kernels
    options = dict(mode=mode, label_smoothing=0.1, z_loss=1e-4)
    with cce_compile.config.override(skip_ignored=False):
        loss = None

        def forward():
            nonlocal loss
            loss = lce(hidden, classifier, targets, **options)

        assert _synchronisations(forward) == 0
        assert _synchronisations(loss.backward) == 0
    assert _synchronisations(forward) == 1
    assert _synchronisations(loss.backward) == 0


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
    assert rel(full[0, rows][valid], expected_tail[valid]) < LOSS_RTOL[torch.float32]
    p = torch.softmax(logits, -1)
    p[torch.arange(1000), targets[0, rows].clamp(min=0)] -= 1
    p[~valid] = 0
    expected_grad = (p @ classifier.float()) / (targets != -100).sum()
    assert rel(hidden.grad[0, rows], expected_grad) < GRAD_RTOL[torch.bfloat16]
