"""The op's metrics outputs: each row's softmax entropy and first largest logit's class, from the
same pass as the loss, against the float64 oracle, on the PyTorch path and (under the
interpreter on CPU) the Triton path, in both modes, with and without skipping ignored rows."""

from __future__ import annotations

import os

import pytest
import torch
from oracle import LOSS_RTOL, assert_close, oracle, oracle_logits
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


def _expected(case):
    """float64 entropy and argmax of every loss row, 0 / -1 at ignored rows."""
    hidden, targets = case.hidden, case.targets
    if case.shift:
        hidden, targets = hidden[:, : -case.shift], targets[:, case.shift :]
    logits = oracle_logits(hidden, case.classifier, case.bias, case.softcap, case.logit_scale)
    p = logits.softmax(-1)
    entropy = -(p * logits.log_softmax(-1)).sum(-1)
    valid = targets != case.ignore_index
    return torch.where(valid, entropy, 0.0), torch.where(valid, logits.argmax(-1), -1)


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("mode", ["lean", "fast"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip-ignored", "every-row"])
def test_entropy_and_argmax_match_the_oracle(implementation, options, mode, skip):
    case = _case(options)
    case.hidden.requires_grad_()
    with config.override(skip_ignored=skip):
        loss, entropy, argmax = cce_compile.linear_cross_entropy(
            case.hidden,
            case.classifier,
            case.targets,
            case.bias,
            mode=mode,
            return_entropy=True,
            return_argmax=True,
            **case.options(),
        )
    want_entropy, want_argmax = _expected(case)
    assert entropy.dtype == torch.float32 and argmax.dtype == torch.int64
    assert not entropy.requires_grad and not argmax.requires_grad
    assert_close("entropy", entropy, want_entropy, 1e-5, want_entropy.abs().max().item())
    assert torch.equal(argmax, want_argmax)
    assert_close("loss", loss, oracle(case).float(), LOSS_RTOL[torch.float32])
    loss.backward()  # the metrics add nothing to the backward


def test_argmax_takes_the_first_of_tied_logits(implementation):
    """Two classes share the largest logit: the first wins, as in torch.argmax; the tie spans
    the Triton path's tiles and programs (classes 3 and 40 of 53)."""
    case = _case({}, ignored=0.0)
    case.classifier[40] = case.classifier[3]
    _, argmax = cce_compile.linear_cross_entropy(
        case.hidden, case.classifier, case.targets, reduction="none", return_argmax=True
    )
    _, want = _expected(case)
    assert torch.equal(argmax, want)
    assert (argmax != 40).all()


def test_with_the_lse_the_outputs_come_in_order():
    case = _case({})
    loss, lse, entropy, argmax = cce_compile.linear_cross_entropy(
        case.hidden,
        case.classifier,
        case.targets,
        reduction="none",
        return_lse=True,
        return_entropy=True,
        return_argmax=True,
    )
    shape = case.targets.shape
    assert loss.shape == lse.shape == entropy.shape == argmax.shape == shape


def test_compiled_fullgraph_gives_the_same_metrics():
    case = _case({})

    def metrics(h, c, t):
        return cce_compile.linear_cross_entropy(
            h, c, t, reduction="none", return_entropy=True, return_argmax=True
        )

    torch._dynamo.reset()
    compiled = torch.compile(metrics, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(*case_args(case)), metrics(*case_args(case))):
        assert torch.equal(got, want)


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
