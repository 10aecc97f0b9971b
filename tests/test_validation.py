"""Bad input: a clear TypeError/ValueError naming the argument, before any computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cce_compile

lce = cce_compile.linear_cross_entropy


def good():
    return dict(
        hidden=torch.randn(2, 5, 8),
        classifier=torch.randn(11, 8),
        targets=torch.randint(0, 11, (2, 5)),
    )


BAD = [
    ("hidden-not-tensor", dict(hidden=[[1.0]]), TypeError, "hidden"),
    ("hidden-int", dict(hidden=torch.ones(2, 5, 8, dtype=torch.int64)), TypeError, "hidden"),
    ("hidden-float64", dict(hidden=torch.randn(2, 5, 8, dtype=torch.float64)), TypeError, "hidden"),
    ("classifier-1d", dict(classifier=torch.randn(8)), ValueError, "classifier"),
    ("classifier-dtype", dict(classifier=torch.randn(11, 8).bfloat16()), TypeError, "classifier"),
    ("classifier-D", dict(classifier=torch.randn(11, 9)), ValueError, "D="),
    ("classifier-empty", dict(classifier=torch.randn(0, 8)), ValueError, "classifier"),
    ("targets-float", dict(targets=torch.zeros(2, 5)), TypeError, "targets"),
    ("targets-bool", dict(targets=torch.zeros(2, 5, dtype=torch.bool)), TypeError, "targets"),
    ("targets-int16", dict(targets=torch.zeros(2, 5, dtype=torch.int16)), TypeError, "targets"),
    ("targets-shape", dict(targets=torch.zeros(2, 6, dtype=torch.long)), ValueError, "targets"),
    ("targets-flat", dict(targets=torch.zeros(10, dtype=torch.long)), ValueError, "targets"),
    ("bias-length", dict(bias=torch.randn(10)), ValueError, "bias"),
    ("bias-dtype", dict(bias=torch.randn(11).half()), TypeError, "bias"),
    ("weights-length", dict(class_weights=torch.rand(12)), ValueError, "class_weights"),
    (
        "weights-int",
        dict(class_weights=torch.ones(11, dtype=torch.long)),
        TypeError,
        "class_weights",
    ),
    ("reduction", dict(reduction="avg"), ValueError, "reduction"),
    ("smoothing-negative", dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    ("smoothing-above-one", dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    ("softcap-zero", dict(softcap=0.0), ValueError, "softcap"),
    ("softcap-negative", dict(softcap=-3.0), ValueError, "softcap"),
    ("softcap-inf", dict(softcap=float("inf")), ValueError, "softcap"),
    ("scale-nan", dict(logit_scale=float("nan")), ValueError, "logit_scale"),
    ("scale-string", dict(logit_scale="2"), TypeError, "logit_scale"),
    ("softcap-string", dict(softcap="3"), TypeError, "softcap"),
    ("smoothing-string", dict(label_smoothing="0.1"), TypeError, "label_smoothing"),
    ("z_loss-none", dict(z_loss=None), TypeError, "z_loss"),
    ("z-loss-negative", dict(z_loss=-1.0), ValueError, "z_loss"),
    ("shift-negative", dict(shift=-1), ValueError, "shift"),
    ("shift-too-large", dict(shift=5), ValueError, "shift"),
    ("shift-float", dict(shift=1.0), TypeError, "shift"),
    ("ignore-index-float", dict(ignore_index=-100.0), TypeError, "ignore_index"),
    ("mode", dict(mode="turbo"), ValueError, "mode"),
    ("fast-with-none", dict(mode="fast", reduction="none"), ValueError, "fast"),
]


@pytest.mark.parametrize("change, error, name", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(change, error, name):
    kwargs = {**good(), **change}
    with pytest.raises(error, match=name):
        lce(**kwargs)


def test_shift_needs_time_dimension():
    with pytest.raises(ValueError, match="shift"):
        lce(torch.randn(8), torch.randn(11, 8), torch.tensor(3), shift=1)


def test_mixed_devices_rejected():
    kwargs = good()
    kwargs["targets"] = kwargs["targets"].to("meta")
    with pytest.raises(ValueError, match="device"):
        lce(**kwargs)


def test_validation_runs_before_any_kernel(monkeypatch):
    import cce_compile.implementations.torch_path as torch_path

    calls = []
    real_forward = torch_path.logit_stats
    monkeypatch.setattr(
        torch_path, "logit_stats", lambda *a, **k: calls.append(1) or real_forward(*a, **k)
    )
    lce(**good())
    assert calls, "the patch must observe the implementation"
    calls.clear()
    with pytest.raises(ValueError):
        lce(**{**good(), "label_smoothing": 2.0})
    assert not calls


# What F.cross_entropy takes as ignore_index (operator.index: numpy integers, one-element
# integer tensors) is taken, read once as a Python int; bool is refused, as there.
IGNORE_INDEX_FORMS = {
    "numpy-int64": lambda v: np.int64(v),
    "numpy-int32": lambda v: np.int32(v),
    "tensor-0d": lambda v: torch.tensor(v),
    "tensor-0d-int32": lambda v: torch.tensor(v, dtype=torch.int32),
    "tensor-one-element": lambda v: torch.tensor([v]),
}


@pytest.mark.parametrize("form", IGNORE_INDEX_FORMS.values(), ids=IGNORE_INDEX_FORMS)
def test_ignore_index_in_any_integer_form_pytorch_takes(form):
    kwargs = good()
    kwargs["targets"][0, :3] = 4
    expected = lce(**kwargs, ignore_index=4, reduction="sum")
    got = lce(**kwargs, ignore_index=form(4), reduction="sum")
    assert torch.equal(got, expected)
    logits = kwargs["hidden"] @ kwargs["classifier"].T
    reference = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), kwargs["targets"].flatten(), ignore_index=form(4), reduction="sum"
    )
    torch.testing.assert_close(got, reference)


BAD_IGNORE_INDEX = {
    "bool": (True, TypeError),
    "numpy-bool": (np.bool_(True), TypeError),
    "bool-tensor": (torch.tensor(True), TypeError),
    "float-tensor": (torch.tensor(3.0), TypeError),
    "numpy-float": (np.float64(3.0), TypeError),
    "string": ("3", TypeError),
    "above-int64": (2**63, ValueError),
    "below-int64": (-(2**63) - 1, ValueError),
}


@pytest.mark.parametrize(("value", "error"), BAD_IGNORE_INDEX.values(), ids=BAD_IGNORE_INDEX)
def test_ignore_index_refused_like_pytorch(value, error):
    with pytest.raises(error, match="ignore_index"):
        lce(**good(), ignore_index=value)
