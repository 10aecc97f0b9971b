"""Gradient filtering: the bound of filtering.py holds for every option, on the PyTorch path and
the Triton path (interpreter on CPU), and beta = 0 changes nothing."""

from __future__ import annotations

import math
import os

import pytest
import torch
from oracle import Case, oracle
from strategies import build_case

import cce_compile
from cce_compile import filtering, loss_math
from cce_compile.op import dispatch

lce = cce_compile.linear_cross_entropy
BETA = 2.0**-12
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def peaked_case(
    mass_left=1e-6, vocab=1024, dim=64, leading=(3, 8), seed=0, first_block=False, **options
):
    """Each row puts all but ~``mass_left`` of its softmax on its target: blocks of classes
    without the target are negligible, as in a trained model. ``first_block``: every target
    is one of the first block's classes."""
    case = build_case(leading=leading, dim=dim, vocab=vocab, seed=seed, **options)
    if first_block:
        case.targets = torch.where(
            case.targets >= 0, case.targets % filtering.FILTER_BLOCK, case.targets
        )
    gen = torch.Generator().manual_seed(seed + 1)
    rows = case.targets.clamp(min=0)
    direction = case.classifier[rows] / case.classifier[rows].norm(dim=-1, keepdim=True)
    margin = math.log(vocab / mass_left)
    norm = case.classifier.norm(dim=-1).mean()
    case.hidden = direction * margin / norm * 1.6 + 0.01 * torch.randn(
        case.hidden.shape, generator=gen
    )
    return case


def _run(case, implementation, grad_filter):
    leaves = [t.clone().to(DEVICE).requires_grad_() for t in case.leaves()]
    targets = case.targets.to(DEVICE)
    weights = None if case.class_weights is None else case.class_weights.to(DEVICE)
    options = {**case.options(), "class_weights": weights}
    # Lean both ways: filtering is a lean-mode feature, and auto may pick fast without it.
    loss = lce(*leaves[:2], targets, *leaves[2:], grad_filter=grad_filter, mode="lean", **options)
    upstream = torch.ones_like(loss)
    grads = torch.autograd.grad(loss, leaves, upstream)
    return loss.detach().cpu(), [g.cpu() for g in grads]


def _bound(case, beta):
    """Per-leaf bound of filtering.py on the error of each gradient (float64)."""
    wide = Case(
        **{**case.__dict__, "hidden": case.hidden.double(), "classifier": case.classifier.double()}
    )
    hidden, targets = wide.hidden, wide.targets
    if wide.shift:
        hidden = hidden[..., : hidden.shape[-2] - wide.shift, :]
        targets = targets[..., wide.shift :]
    spec = loss_math.LossSpec(
        case.ignore_index,
        case.reduction,
        case.label_smoothing,
        case.softcap,
        case.logit_scale,
        case.shift,
        case.z_loss,
    )
    _, lse = oracle(wide, return_lse=True)
    vocab = case.classifier.shape[0]
    rows = loss_math.row_targets(wide.targets, wide.class_weights, spec, vocab)
    upstream = torch.ones(
        () if case.reduction != "none" else rows.targets.shape, dtype=torch.float64
    )
    coef_p = loss_math.row_coefficients(upstream, None, lse.reshape(-1), rows, spec, vocab).p
    scale = abs(case.logit_scale)
    h_rows = hidden.reshape(-1, hidden.shape[-1])
    return {
        # per row |s| |coef_p,r| S_r max_j ||C_j||; over all rows in the Frobenius norm:
        "hidden": scale * coef_p.norm() * beta * wide.classifier.norm(dim=-1).max(),
        "classifier": scale * beta * (coef_p.abs() * h_rows.norm(dim=-1)).sum(),
        "bias": scale * beta * coef_p.abs().sum(),
    }


OPTIONS = {
    "plain": {},
    "z-loss": dict(z_loss=1e-3),
    "softcap": dict(softcap=20.0),
    "smoothing": dict(label_smoothing=0.1),
    "weights-sum": dict(class_weights=True, reduction="sum"),
    "none-scale-shift": dict(reduction="none", logit_scale=0.7, shift=1),
}
PATHS = ["torch"] + (["triton"] if TRITON else [])
# Four filter blocks on the PyTorch path; two on the Triton path, whose interpreter runs a
# program per 16 x 16 tile (rows in two tiles, the second partial): a quarter of the work.
SIZES = {
    "torch": dict(leading=(3, 8), dim=64, vocab=4 * filtering.FILTER_BLOCK),
    "triton": dict(leading=(3, 6), dim=64, vocab=2 * filtering.FILTER_BLOCK),
}


@pytest.fixture
def path(request, monkeypatch):
    from cce_compile.implementations import torch_path

    if request.param == "triton":
        from cce_compile.implementations import triton_path

        monkeypatch.setattr(dispatch, "implementation_for", lambda device: triton_path)
    else:
        monkeypatch.setattr(dispatch, "implementation_for", lambda device: torch_path)
    return request.param


def _bound_cases():
    """Every option on both paths, peaked and flat; the interpreter (slow where nothing is
    skipped) runs flat inputs for one option only."""
    for path in PATHS:
        for shape in ("peaked", "flat"):
            for name, options in OPTIONS.items():
                if path == "triton" and shape == "flat" and name != "smoothing":
                    continue
                yield pytest.param(path, options, shape, id=f"{path}-{shape}-{name}")


@pytest.mark.parametrize("path, options, shape", list(_bound_cases()), indirect=["path"])
def test_the_bound_holds(path, options, shape):
    make = peaked_case if shape == "peaked" else build_case
    kwargs = dict(**SIZES[path], seed=3, bias=True, **options)
    case = make(**kwargs)
    exact_loss, exact = _run(case, path, None)
    filtered_loss, filtered = _run(case, path, BETA)
    stats = filtering.report()
    assert torch.equal(exact_loss, filtered_loss), "filtering changes no loss"
    bounds = _bound(case, stats["max_skipped_mass"])
    assert stats["max_skipped_mass"] <= BETA
    for (name, bound), got, want in zip(bounds.items(), filtered, exact):
        err = (got.double() - want.double()).norm().item()
        # bound of the skipped terms, plus float32 rounding of the rest (both runs round)
        assert err <= bound.item() * 1.01 + 1e-6 * want.double().norm().item(), name
    if shape == "peaked":
        assert stats["kept_blocks"] < 1.0, stats  # the peaked rows did skip blocks
    else:
        assert stats["kept_blocks"] == 1.0, stats  # a flat softmax has no negligible block


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_beta_zero_is_bit_for_bit_the_exact_result(path):
    case = peaked_case(mass_left=1e-3, bias=True, label_smoothing=0.1, **SIZES[path])
    exact_loss, exact = _run(case, path, None)
    loss, grads = _run(case, path, 0.0)
    assert torch.equal(loss, exact_loss)
    assert all(torch.equal(g, e) for g, e in zip(grads, exact))


@pytest.mark.skipif(not TRITON, reason="needs a GPU or TRITON_INTERPRET=1")
def test_whole_tiles_are_skipped_on_the_triton_path(monkeypatch):
    from cce_compile.implementations import triton_path

    monkeypatch.setattr(dispatch, "implementation_for", lambda device: triton_path)
    blocks = 2
    case = peaked_case(leading=(2, 20), vocab=blocks * filtering.FILTER_BLOCK, first_block=True)
    _run(case, "triton", BETA)
    assert filtering.report()["kept_tiles"] <= 1 / blocks + 1e-6  # the other block: no tile


def test_bad_requests_are_refused():
    case = build_case(leading=(4,), dim=6, vocab=9)
    args = (case.hidden, case.classifier, case.targets)
    with pytest.raises(ValueError, match="grad_filter"):
        lce(*args, grad_filter=1.5)
    with pytest.raises(ValueError, match="lean"):
        lce(*args, grad_filter=BETA, mode="fast")
    with pytest.raises(ValueError, match="label_smoothing"):
        lce(*args, grad_filter=BETA, label_smoothing=0.1, softcap=5.0)
    with pytest.raises(TypeError, match="grad_filter"):
        lce(*args, grad_filter="small")


def test_keep_blocks_never_skips_the_target_and_respects_beta():
    gen = torch.Generator().manual_seed(0)
    block_lse = torch.randn(6, 40, generator=gen) * 8 - 20
    lse = torch.logsumexp(block_lse, 0)
    targets = torch.randint(0, 6 * filtering.FILTER_BLOCK, (40,), generator=gen)
    targets[3] = -100
    keep = filtering.keep_blocks(block_lse, lse, targets, 0.05)
    mass = torch.exp(block_lse.t() - lse[:, None])
    rows = torch.arange(40)
    valid = targets >= 0
    assert torch.all(keep[rows[valid], targets[valid] // filtering.FILTER_BLOCK] == 1)
    assert torch.all((mass * (1 - keep.double().float())).sum(1) <= 0.05 + 1e-6)
    assert keep.float().mean() < 1  # something was skipped


def test_the_pass_carries_the_setting_into_the_op():
    """CCE_GRAD_FILTER reaches every rewritten site (lean mode, the op's grad_filter) and is
    in the pass's cache key; a site with label smoothing under a softcap stays exact."""
    import torch.nn.functional as F

    from cce_compile import config
    from cce_compile.op.signature import FORWARD
    from cce_compile.passes.graph_pass import pass_uuid, run_on_module

    def grab(graphs):
        def backend(gm, example_inputs):
            run_on_module(gm)
            graphs.append(gm)
            return gm.forward

        return backend

    def filters_of(fn, case):
        graphs = []
        torch._dynamo.reset()
        torch.compile(fn, backend=grab(graphs))(case.hidden, case.classifier, case.targets)
        op = torch.ops.cce.linear_cross_entropy.default
        calls = [n for g in graphs for n in g.graph.nodes if n.target is op]
        return [(FORWARD.bind(n.args).grad_filter, FORWARD.bind(n.args).mode) for n in calls]

    def plain(h, c, y):
        return F.cross_entropy(F.linear(h, c).view(-1, c.shape[0]), y.view(-1))

    def capped_smoothed(h, c, y):
        z = 5.0 * torch.tanh(F.linear(h, c) / 5.0)
        return F.cross_entropy(z.view(-1, c.shape[0]), y.view(-1), label_smoothing=0.1)

    case = peaked_case()
    case.hidden.requires_grad_()
    exact_uuid = pass_uuid()
    with config.override(grad_filter=BETA, mode="fast"):
        assert pass_uuid() != exact_uuid
        assert filters_of(plain, case) == [(BETA, "lean")]
        assert filters_of(capped_smoothed, case) == [(None, "fast")]
    ((beta, _),) = filters_of(plain, case)
    assert beta is None  # exact without the setting
