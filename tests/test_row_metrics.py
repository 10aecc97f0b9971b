"""The op's row metrics (row_metrics.py): each row's entropy (with its gradient), argmax,
log sum p^2 and mean logit, from the same pass as the loss, against the float64 oracle, on the
PyTorch path and (under the interpreter on CPU) the Triton path, in both modes, with and without
skipping ignored rows."""

from __future__ import annotations

import math
import os

import pytest
import torch
from oracle import GRAD_RTOL, LOSS_RTOL, assert_close, oracle, oracle_logits, rel_error
from strategies import build_case

import cce_compile
from cce_compile import config
from cce_compile.implementations import torch_path
from cce_compile.op import dispatch

# Compaction at these small sizes on a GPU too (conftest.skip_at_any_size).
pytestmark = pytest.mark.usefixtures("skip_at_any_size")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = os.environ.get("TRITON_INTERPRET") == "1" or DEVICE == "cuda"


@pytest.fixture(
    params=[
        pytest.param("torch", id="torch-path"),
        pytest.param(
            "triton",
            id="triton-path",
            marks=pytest.mark.skipif(not TRITON, reason="needs a GPU or TRITON_INTERPRET=1"),
        ),
    ]
)
def implementation(request, monkeypatch):
    if request.param == "triton":
        from cce_compile.implementations import triton_path as impl
    else:
        impl = torch_path
    monkeypatch.setattr(dispatch, "implementation_for", lambda device: impl)


OPTIONS = {
    "plain": {},
    "softcap-scale-bias": dict(softcap=4.0, logit_scale=1.5, bias=True),
    "shift-smoothing": dict(shift=1, label_smoothing=0.1),
}


def _case(options, seed=0, ignored=0.3):
    case = build_case(
        leading=(3, 13), dim=21, vocab=53, seed=seed, ignored_fraction=ignored, **options
    )
    for name in ("hidden", "classifier", "targets", "bias"):
        value = getattr(case, name)
        if value is not None:
            setattr(case, name, value.to(DEVICE))
    return case


def _rows(case):
    """hidden and targets of the loss rows."""
    if case.shift:
        return case.hidden[:, : -case.shift], case.targets[:, case.shift :]
    return case.hidden, case.targets


def _expected(case):
    """float64 entropy, argmax, log sum p^2 and mean logit of every loss row (0, -1, 0, 0 at
    ignored rows), differentiable with respect to the case's tensors."""
    hidden, targets = _rows(case)
    logits = oracle_logits(hidden, case.classifier, case.bias, case.softcap, case.logit_scale)
    log_p = logits.log_softmax(-1)
    valid = targets != case.ignore_index
    return dict(
        entropy=torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0),
        argmax=torch.where(valid, logits.argmax(-1), -1),
        log_sum_sq_probs=torch.where(valid, torch.logsumexp(2 * log_p, -1), 0.0),
        mean_logits=torch.where(valid, logits.mean(-1), 0.0),
    )


METRICS = ("entropy", "argmax", "log_sum_sq_probs", "mean_logits")
FLAGS = {f"return_{name}": True for name in METRICS}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("skip", [True, False], ids=["skip-ignored", "every-row"])
def test_every_metric_matches_the_oracle(implementation, options, skip):
    case = _case(options)
    with config.override(skip_ignored=skip):
        loss, *metrics = cce_compile.linear_cross_entropy(
            case.hidden, case.classifier, case.targets, case.bias, **FLAGS, **case.options()
        )
    want = _expected(case)
    for name, got in zip(METRICS, metrics):
        assert got.dtype == (torch.int64 if name == "argmax" else torch.float32), name
        if name == "argmax":
            assert torch.equal(got, want[name])
        else:
            assert_close(name, got, want[name], 1e-5, want[name].abs().max().item())
    assert_close("loss", loss, oracle(case).float(), LOSS_RTOL[torch.float32])


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("skip", [True, False], ids=["skip-ignored", "every-row"])
def test_fast_mode_gives_the_entropy_and_argmax(implementation, options, skip):
    case = _case(options)
    case.hidden.requires_grad_()
    with config.override(skip_ignored=skip):
        loss, entropy, argmax = cce_compile.linear_cross_entropy(
            *case_args(case), case.bias, mode="fast", return_entropy=True,
            return_argmax=True, **case.options(),
        )  # fmt: skip
    want = _expected(case)
    assert not argmax.requires_grad
    scale = want["entropy"].abs().max().item()
    assert_close("entropy", entropy, want["entropy"].detach(), 1e-5, scale)
    assert torch.equal(argmax, want["argmax"])
    assert_close("loss", loss, oracle(case).float(), LOSS_RTOL[torch.float32])


def test_fast_mode_refuses_the_metrics_only_lean_computes():
    case = _case({})
    case.hidden.requires_grad_()
    for flag in ("return_log_sum_sq_probs", "return_mean_logits"):
        with pytest.raises(ValueError, match="mode='fast' computes no"):
            cce_compile.linear_cross_entropy(*case_args(case), mode="fast", **{flag: True})


GRADIENT_FORMS = {
    # (reduction, mode): the per-token log-probs (RL's form, 'none', lean), and a scalar loss
    # beside an entropy bonus (fast's buffers for the loss, the entropy's part recomputed).
    "log-probs": ("none", "lean"),
    "scalar-loss-lean": ("mean", "lean"),
    "scalar-loss-fast": ("mean", "fast"),
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("form", GRADIENT_FORMS.values(), ids=GRADIENT_FORMS.keys())
@pytest.mark.parametrize("skip", [True, False], ids=["skip-ignored", "every-row"])
def test_entropy_gradient_matches_the_oracle(implementation, options, form, skip):
    """d/d(hidden, classifier, bias) of sum(a * loss) + sum(g * entropy) with random upstream
    a and g, against float64 autograd through the materialised logits."""
    reduction, mode = form
    case = _case(dict(options, reduction=reduction), seed=1)
    leaves = [t.requires_grad_() for t in case.leaves()]
    gen = torch.Generator().manual_seed(2)
    rows = _rows(case)[1].shape
    upstream_loss = torch.randn(rows if reduction == "none" else (), generator=gen).to(DEVICE)
    upstream_entropy = torch.randn(rows, generator=gen).to(DEVICE)
    with config.override(skip_ignored=skip):
        loss, entropy = cce_compile.linear_cross_entropy(
            *case_args(case), case.bias, mode=mode, return_entropy=True, **case.options()
        )
    got = torch.autograd.grad(
        (loss * upstream_loss).sum() + (entropy * upstream_entropy).sum(), leaves
    )
    want_total = (oracle(case) * upstream_loss.double()).sum() + (
        _expected(case)["entropy"] * upstream_entropy.double()
    ).sum()
    want = torch.autograd.grad(want_total, leaves)
    for name, g, w in zip(("hidden", "classifier", "bias"), got, want):
        error = rel_error(g, w)
        assert error < GRAD_RTOL[torch.float32], f"{name}: {error:.2e}"


def test_entropy_alone_carries_a_gradient(implementation):
    """The loss unused: the gradient is the entropy's alone (the loss's upstream is None)."""
    case = _case(dict(reduction="none", softcap=3.0))
    leaves = [t.requires_grad_() for t in case.leaves()]
    _, entropy = cce_compile.linear_cross_entropy(
        *case_args(case), return_entropy=True, **case.options()
    )
    got = torch.autograd.grad(entropy.sum(), leaves)
    want = torch.autograd.grad(_expected(case)["entropy"].sum(), leaves)
    for g, w in zip(got, want):
        assert rel_error(g, w) < GRAD_RTOL[torch.float32]


def test_lse_and_entropy_gradients_add_up():
    case = _case(dict(reduction="sum"))
    leaves = [t.requires_grad_() for t in case.leaves()]
    loss, lse, entropy = cce_compile.linear_cross_entropy(
        *case_args(case), mode="fast", return_lse=True, return_entropy=True, **case.options()
    )
    got = torch.autograd.grad(loss + lse.sum() * 0.5 - entropy.sum() * 0.1, leaves)
    want_loss, want_lse = oracle(case, return_lse=True)
    want_total = want_loss + want_lse.sum() * 0.5 - _expected(case)["entropy"].sum() * 0.1
    want = torch.autograd.grad(want_total, leaves)
    for g, w in zip(got, want):
        assert rel_error(g, w) < GRAD_RTOL[torch.float32]


def test_without_grad_nothing_is_saved_and_metrics_carry_no_graph():
    """Old and reference log-probs: under no_grad the op records no autograd node."""
    case = _case(dict(reduction="none"))
    case.hidden.requires_grad_()
    with torch.no_grad():
        loss, entropy = cce_compile.linear_cross_entropy(
            *case_args(case), return_entropy=True, **case.options()
        )
    assert loss.grad_fn is None and entropy.grad_fn is None


def test_argmax_takes_the_first_of_tied_logits(implementation):
    """Two classes share the largest logit: the first wins, as in torch.argmax; the tie spans
    the Triton path's tiles and programs (classes 3 and 40 of 53)."""
    case = _case({}, ignored=0.0)
    case.classifier[40] = case.classifier[3]
    _, argmax = cce_compile.linear_cross_entropy(
        case.hidden, case.classifier, case.targets, reduction="none", return_argmax=True
    )
    assert torch.equal(argmax, _expected(case)["argmax"])
    assert (argmax != 40).all()


def test_with_the_lse_the_outputs_come_in_order():
    case = _case({})
    loss, lse, *metrics = cce_compile.linear_cross_entropy(
        *case_args(case), reduction="none", return_lse=True, **FLAGS
    )
    shape = case.targets.shape
    assert loss.shape == lse.shape == shape
    assert all(m.shape == shape for m in metrics)
    assert [m.dtype for m in metrics] == [torch.float32, torch.int64, torch.float32, torch.float32]


def test_compiled_fullgraph_gives_the_same_metrics_and_entropy_gradient():
    case = _case({})

    def metrics(h, c, t):
        return cce_compile.linear_cross_entropy(h, c, t, reduction="none", **FLAGS)

    torch._dynamo.reset()
    compiled = torch.compile(metrics, backend="aot_eager", fullgraph=True)
    hidden = case.hidden.clone().requires_grad_()
    got = compiled(hidden, case.classifier, case.targets)
    want = metrics(case.hidden.requires_grad_(), case.classifier, case.targets)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    (grad,) = torch.autograd.grad(got[1].sum(), hidden)
    (want_grad,) = torch.autograd.grad(want[1].sum(), case.hidden)
    assert torch.equal(grad, want_grad)


def case_args(case):
    return case.hidden, case.classifier, case.targets


def test_not_served_under_a_functorch_transform():
    case = _case({})

    def loss_of(h):
        return cce_compile.linear_cross_entropy(
            h, case.classifier, case.targets, return_entropy=True
        )[0]

    with pytest.raises(NotImplementedError, match="return_entropy"):
        torch.func.grad(loss_of)(case.hidden)


def _op_entropy_every_row(case, mode):
    """The op's per-row loss and entropy with ``metrics_all_rows`` (what the graph pass asks
    for an entropy beside the user's own cross_entropy), through its argument list."""
    from cce_compile.op import custom_ops
    from cce_compile.op.signature import FORWARD, FORWARD_RETURNS

    needs = dict(grad_hidden=True, grad_classifier=True, grad_bias=case.bias is not None)
    output = torch.ops.cce.linear_cross_entropy(
        *FORWARD.build(
            hidden=case.hidden,
            classifier=case.classifier,
            targets=case.targets,
            bias=case.bias,
            class_weights=None,
            ignore_index=case.ignore_index,
            reduction=case.reduction,
            label_smoothing=0.0,
            softcap=case.softcap,
            logit_scale=case.logit_scale,
            shift=case.shift,
            z_loss=0.0,
            lse_all_rows=False,
            mode=mode,
            **needs,
            implementation_version=custom_ops.IMPLEMENTATION_VERSION,
            skip_ignored=True,
            return_entropy=True,
            metrics_all_rows=True,
        )
    )
    out = FORWARD_RETURNS.unpack(output)
    return out.loss, out.entropy


@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_entropy_of_every_row_beside_a_loss_that_ignores_some(implementation, mode):
    """``metrics_all_rows``: the entropy (and its gradient) at ignored rows too, while the loss
    still ignores them: eager's entropy of the logits beside its cross_entropy."""
    case = _case(dict(softcap=4.0, bias=True, reduction="sum"), seed=3, ignored=0.4)
    leaves = [t.requires_grad_() for t in case.leaves()]
    loss, entropy = _op_entropy_every_row(case, mode)
    hidden, _ = _rows(case)
    logits = oracle_logits(hidden, case.classifier, case.bias, case.softcap, case.logit_scale)
    log_p = logits.log_softmax(-1)
    want_entropy = -(log_p.exp() * log_p).sum(-1)  # every row, the ignored ones included
    assert_close("entropy", entropy, want_entropy.detach(), 1e-5, 5.0)
    assert_close("loss", loss, oracle(case).float(), LOSS_RTOL[torch.float32])
    upstream = torch.linspace(-1, 1, entropy.numel()).reshape(entropy.shape).to(DEVICE)
    got = torch.autograd.grad(loss + (entropy * upstream).sum(), leaves)
    want = torch.autograd.grad(oracle(case) + (want_entropy * upstream.double()).sum(), leaves)
    for g, w in zip(got, want):
        assert rel_error(g, w) < GRAD_RTOL[torch.float32]


def _offset_case(offset: float, gen: torch.Generator):
    """Rows whose logits carry a constant offset each, from -offset to offset (hidden's first
    feature times a classifier column of ones), on top of a random head's: the entropy does
    not depend on the offset."""
    rows, dim, vocab = 6, 16, 1000
    hidden = torch.randn(rows, dim, generator=gen)
    hidden[:, 0] = torch.linspace(-offset, offset, rows)
    classifier = torch.randn(vocab, dim, generator=gen) * 3 / dim**0.5
    classifier[:, 0] = 1.0
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    return hidden.to(DEVICE), classifier.to(DEVICE), targets.to(DEVICE)


@pytest.mark.parametrize("offset", [160.0, 1400.0])
@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_entropy_keeps_its_digits_under_large_logits(implementation, offset, mode):
    """Each row's entropy and its gradient against float64, under logits of size ``offset``.
    An entropy from lse - E_p[z] cancels two terms of that size (1.2e-3 off at 160, 8e-2 at
    1400); one relative to the row's max errs only by what float32's rounding of the logits
    themselves moves it: |dH| <= max_j |dz_j| sum_j p_j |log p_j + H|, dz_j one rounding of
    z_j (eps |z_j|) plus the GEMM's (eps sum_d |h_d c_jd|), here times 4 for headroom. The
    gradient -g p_j (log p_j + H) takes log p_j = z_j - lse and H from the forward, each off by
    up to one rounding of the lse's size and that bound: row i's share of d/dh errs by at most
    |g_i| 2 (eps |lse_i| + bound_i) max_j |c_j| beyond GRAD_RTOL."""
    gen = torch.Generator().manual_seed(4)
    hidden, classifier, targets = _offset_case(offset, gen)
    hidden.requires_grad_()
    loss, entropy = cce_compile.linear_cross_entropy(
        hidden, classifier, targets, mode=mode, reduction="sum", return_entropy=True
    )
    h64 = hidden.detach().double().requires_grad_()
    log_p = (h64 @ classifier.double().T).log_softmax(-1)
    want = -(log_p.exp() * log_p).sum(-1)
    with torch.no_grad():
        eps = torch.finfo(torch.float32).eps
        terms = h64.abs() @ classifier.double().abs().T  # >= |z|
        spread = (log_p.exp() * (log_p + want[:, None]).abs()).sum(-1)
        bound = 4 * eps * terms.amax(-1) * spread
    error = (entropy.double() - want).abs()
    assert torch.all(error <= bound), f"entropy: {error.max():.2e} (bound {bound.min():.2e})"
    upstream = torch.linspace(-1, 1, entropy.numel(), device=DEVICE)
    (got,) = torch.autograd.grad(loss * 0 + (entropy * upstream).sum(), hidden)
    (grad64,) = torch.autograd.grad((want * upstream.double()).sum(), h64)
    with torch.no_grad():
        lse = (h64 @ classifier.double().T).logsumexp(-1)
        widest = classifier.double().norm(dim=-1).max()
        row_bounds = upstream.double().abs() * 2 * (eps * lse.abs() + bound) * widest
        grad_bound = GRAD_RTOL[torch.float32] * grad64.norm() + row_bounds.norm()
    error = (got.double() - grad64).norm()
    assert error <= grad_bound, f"hidden's gradient: {error:.2e} > {grad_bound:.2e}"


@pytest.mark.parametrize("form", GRADIENT_FORMS.values(), ids=GRADIENT_FORMS.keys())
def test_a_masked_class_adds_nothing_to_the_entropy(implementation, form):
    """A class of logit -inf (a -inf in the head's bias) adds 0 log 0 = 0 to the entropy and
    nothing to any gradient, on every path: Categorical(logits=z).entropy()'s values and
    gradients in float64 (its clamp of log p), where -(p * log_softmax(z)).sum(-1) is NaN."""
    reduction, mode = form
    gen = torch.Generator().manual_seed(5)
    rows, dim, vocab = 14, 12, 40
    masked = [0, 3, 17, vocab - 1]  # tile edges included
    hidden = torch.randn(rows, dim, generator=gen)
    classifier = torch.randn(vocab, dim, generator=gen) / dim**0.5
    bias = torch.randn(vocab, generator=gen)
    bias[masked] = -math.inf
    allowed = torch.tensor([j for j in range(vocab) if j not in masked])
    targets = allowed[torch.randint(0, len(allowed), (rows,), generator=gen)]
    targets[::4] = -100
    leaves = [t.to(DEVICE).requires_grad_() for t in (hidden, classifier, bias)]
    targets = targets.to(DEVICE)
    hidden, classifier, bias = leaves
    loss, entropy = cce_compile.linear_cross_entropy(
        hidden, classifier, targets, bias, mode=mode, reduction=reduction, return_entropy=True
    )
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    logits = torch.nn.functional.linear(*leaves64)
    want_entropy = torch.distributions.Categorical(logits=logits).entropy()
    valid = targets != -100
    want_entropy = torch.where(valid, want_entropy, 0.0)
    want_loss = torch.nn.functional.cross_entropy(logits, targets, reduction=reduction)
    assert torch.isfinite(entropy).all(), entropy
    assert_close("entropy", entropy, want_entropy.detach(), 1e-5, want_entropy.abs().max().item())
    assert_close("loss", loss, want_loss.detach().float(), LOSS_RTOL[torch.float32])
    upstream = torch.linspace(-1, 1, rows, device=DEVICE)
    loss_up = upstream.flip(0) if reduction == "none" else torch.tensor(0.5, device=DEVICE)
    got = torch.autograd.grad((loss * loss_up).sum() + (entropy * upstream).sum(), leaves)
    want_total = (want_loss * loss_up.double()).sum() + (want_entropy * upstream.double()).sum()
    want = torch.autograd.grad(want_total, leaves64)
    for name, g, w in zip(("hidden", "classifier", "bias"), got, want):
        assert torch.isfinite(g).all(), f"{name}: {g}"
        error = rel_error(g, w)
        assert error < GRAD_RTOL[torch.float32], f"{name}: {error:.2e}"
