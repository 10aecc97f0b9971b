"""The entropy spellings users write to avoid eager's ``0 * log 0`` = NaN: each is fused where
its value and gradient are the op's (``0 log 0 = 0``, a finite gradient), and left alone as
``inexact_form`` with a fix that fuses where eager's gradient is NaN and the op's a number.
They were not recognised: alone, no site and no word; beside log-probs, the log-probs' site
named "softmax" as the use that kept the logits, with a fix that did not apply.

Checked against eager in float64 at a -inf logit and without (value and gradient):
``where(p > 0, log_p, 0)`` and ``log_p.clamp_min(finfo.min)`` equal the op's everywhere; a
negated factor and the ``dtype=`` spellings are the plain spelling (NaN at -inf); ``nansum`` and
``nan_to_num`` have the op's value but a NaN gradient at -inf (exact where the logits cannot
hold -inf); ``entr``, ``xlogy`` and a ``p.log()`` made safe have a NaN gradient wherever p is 0,
an underflow included, so they are never fused.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from oracle import GRAD_RTOL, assert_close
from test_rl_forms import OP, TEMPERATURE, VALUE_RTOL, V, compile_and_run, make_inputs

from cce_compile.passes import entropy_rules

MASKED = 3  # the vocabulary's last classes, masked by a -inf bias


def _softmax(z):
    return F.softmax(z, -1)


def _log_softmax(z):
    return F.log_softmax(z, -1)


def zeroed_where_p_is_0(z):
    p = _softmax(z)
    return -(p * torch.where(p > 0, _log_softmax(z), 0)).sum(-1)


def clamp_min_at_least_float(z):
    return -(_softmax(z) * _log_softmax(z).clamp_min(torch.finfo(z.dtype).min)).sum(-1)


def negated_factor(z):
    return (_softmax(z) * -_log_softmax(z)).sum(-1)


def softmaxes_with_dtype(z):
    p = F.softmax(z, -1, dtype=torch.float32)
    return -(p * F.log_softmax(z, -1, dtype=torch.float32)).sum(-1)


def sum_with_dtype(z):
    return -(_softmax(z) * _log_softmax(z)).sum(-1, dtype=z.dtype)


def nansum(z):
    return -(_softmax(z) * _log_softmax(z)).nansum(-1)


def nan_to_num(z):
    return -(_softmax(z) * _log_softmax(z)).nan_to_num().sum(-1)


def entr(z):
    return torch.special.entr(_softmax(z)).sum(-1)


def xlogy(z):
    p = _softmax(z)
    return -torch.special.xlogy(p, p).sum(-1)


def log_of_softmax_zeroed(z):
    p = _softmax(z)
    return -(p * torch.where(p > 0, p.log(), 0)).sum(-1)


def log_of_softmax_clamped(z):
    p = _softmax(z)
    return -(p * p.log().clamp(min=torch.finfo(z.dtype).min)).sum(-1)


EXACT_WHATEVER_THE_LOGITS = [zeroed_where_p_is_0, clamp_min_at_least_float]
EXACT_OF_FINITE_LOGITS = [negated_factor, softmaxes_with_dtype, sum_with_dtype, nansum, nan_to_num]
NEVER_EXACT = [entr, xlogy, log_of_softmax_zeroed, log_of_softmax_clamped]
# Why each is left alone at a -inf logit.
WHY_AT_MINUS_INF = {
    negated_factor: entropy_rules.NAN_AT_MINUS_INF,
    softmaxes_with_dtype: entropy_rules.NAN_AT_MINUS_INF,
    sum_with_dtype: entropy_rules.NAN_AT_MINUS_INF,
    nansum: entropy_rules.NAN_GRADIENT_AT_MINUS_INF,
    nan_to_num: entropy_rules.NAN_GRADIENT_AT_MINUS_INF,
    **dict.fromkeys(NEVER_EXACT, entropy_rules.NAN_GRADIENT_WHERE_P_IS_0),
}


def _with_log_probs(entropy):
    def step(x, w, b, ids):
        z = F.linear(x, w, b) / TEMPERATURE
        log_probs = F.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1)
        return log_probs, entropy(z)

    return step


def _inputs(masked: bool, dtype=torch.float32):
    x, (w,), ids, _ = make_inputs(dtype, ["one"], seed=4)
    bias = None
    if masked:
        bias = torch.zeros(V, dtype=dtype)
        bias[-MASKED:] = float("-inf")
    return x, w, bias, ids % (V - MASKED)


def _float64(fn, x, w, b, ids):
    """fn's outputs and its (x, w) gradients (upstream 1 on the log-probs, 0.5 on the entropy)
    in float64, the entropy replaced by one that never multiplies a masked log-prob."""
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    z = F.linear(x64, w64, None if b is None else b.double()) / TEMPERATURE
    log_probs = F.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1)
    entropy = zeroed_where_p_is_0(z)
    grads = torch.autograd.grad(log_probs.sum() + 0.5 * entropy.sum(), (x64, w64))
    return (log_probs.detach(), entropy.detach()), grads


def _assert_fused_exact(fn, args):
    (log_probs, entropy), compiled = compile_and_run(fn, args)
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    assert [n.target for g in compiled.graphs for n in g.graph.nodes].count(OP) == 1
    got = torch.autograd.grad(log_probs.sum() + 0.5 * entropy.sum(), args[:2])
    want, want_grads = _float64(fn, *args)
    for name, value, expected in zip(("log-probs", "entropy"), (log_probs, entropy), want):
        assert torch.isfinite(value).all(), name
        assert_close(name, value.double(), expected, VALUE_RTOL[torch.float32], 1.0)
    for name, g, expected in zip(("hidden", "classifier"), got, want_grads):
        assert torch.isfinite(g).all(), name
        assert_close(f"gradient of {name}", g.double(), expected, GRAD_RTOL[torch.float32])
    return compiled


@pytest.mark.parametrize("entropy", EXACT_WHATEVER_THE_LOGITS, ids=lambda f: f.__name__)
def test_a_spelling_equal_to_the_op_fuses_with_a_minus_inf_bias(entropy):
    """Eager's value and gradient are the op's at a masked class: fused into the log-probs'
    call, finite and within float64's tolerances."""
    _assert_fused_exact(_with_log_probs(entropy), _inputs(masked=True))


@pytest.mark.parametrize(
    "entropy", EXACT_OF_FINITE_LOGITS + EXACT_WHATEVER_THE_LOGITS, ids=lambda f: f.__name__
)
def test_a_spelling_fuses_where_no_logit_can_be_minus_inf(entropy):
    """A linear head without a bias: no 0 * -inf, so these are the op's entropy."""
    _assert_fused_exact(_with_log_probs(entropy), _inputs(masked=False))


def _assert_left_alone(fn, args, why, caplog):
    with caplog.at_level(logging.INFO, logger="cce_compile"):
        outputs, compiled = compile_and_run(fn, args)
    assert compiled.counts == {"skipped:inexact_form": 1}, compiled.counts
    assert OP not in [n.target for g in compiled.graphs for n in g.graph.nodes]
    for got, expected in zip(outputs, fn(*args), strict=True):
        torch.testing.assert_close(got, expected, equal_nan=True)
    (report,) = compiled.reports
    assert why in report.detail, report.detail
    assert "Categorical(logits=z).entropy()" in report.advice, report.advice
    told = [r.getMessage() for r in caplog.records if why in r.getMessage()]
    assert len(told) == 1 and "(inexact_form)" in told[0], told


@pytest.mark.parametrize("entropy", WHY_AT_MINUS_INF, ids=lambda f: f.__name__)
def test_a_spelling_whose_eager_gradient_is_nan_at_minus_inf_is_left_alone(entropy, caplog):
    """Beside log-probs of a head with a -inf bias: the log-probs' site is left alone, once,
    naming the entropy and why (it named "softmax", a graph node, with a fix that did not
    apply), and the graph runs as written."""
    _assert_left_alone(
        _with_log_probs(entropy), _inputs(masked=True), WHY_AT_MINUS_INF[entropy], caplog
    )


@pytest.mark.parametrize("entropy", NEVER_EXACT, ids=lambda f: f.__name__)
def test_a_spelling_nan_where_p_underflows_is_left_alone_alone(entropy, caplog):
    """Alone, on a head without a bias (an entropy site of its own: it was silent)."""
    x, w, _, ids = _inputs(masked=False)

    def step(x, w, b, ids):
        return (entropy(F.linear(x, w) / TEMPERATURE),)

    _assert_left_alone(step, (x, w, None, ids), WHY_AT_MINUS_INF[entropy], caplog)


def test_the_fix_given_for_a_left_alone_spelling_fuses():
    """The fix the report gives (Categorical's entropy, or the where spelling) fuses the
    masked head the spelling was left alone on."""
    fix = entropy_rules.FIXES[entropy_rules.NAN_GRADIENT_AT_MINUS_INF]
    assert "torch.where(p > 0, F.log_softmax(z, -1), 0)" in fix, fix
    _assert_fused_exact(_with_log_probs(zeroed_where_p_is_0), _inputs(masked=True))


def test_float32_softmaxes_of_bf16_logits_are_the_entropy_of_their_float32_cast():
    """``softmax(z, -1, dtype=torch.float32)`` of bf16 logits computes in float32: fused as the
    entropy of ``z.float()``, returned in float32, within float32's tolerance of float64 of the
    bf16 operands."""
    x, w, _, ids = _inputs(masked=False, dtype=torch.bfloat16)
    step = _with_log_probs(softmaxes_with_dtype)
    (log_probs, entropy), compiled = compile_and_run(step, (x, w, None, ids))
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    assert entropy.dtype == torch.float32 and log_probs.dtype == torch.bfloat16
    (_, want), _ = _float64(step, x, w, None, ids)
    assert_close("entropy", entropy.double(), want, VALUE_RTOL[torch.float32], 1.0)
