"""An entropy written with probabilities, ``-(p * p.log()).sum(-1)`` of ``p = softmax(z)``:
where a probability underflows to 0, eager's ``0 * log 0`` is NaN and the op's entropy would
be a number, so the pass must not fuse it. It is left as written (eager's NaN kept) and says
so once, with what to change: alone, and beside a cross-entropy of the same logits. The
``log_softmax`` spelling, which has no NaN, still fuses (the control).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from test_rl_forms import OP, TEMPERATURE, VALUE_RTOL, V, compile_and_run, make_inputs

import cce_compile
from cce_compile import config

# Logits some 100s apart: float32's exp underflows to 0 for most classes of every row.
SPREAD = 60.0


def softmax_then_log(x, w, ids):
    z = F.linear(x, w) / TEMPERATURE
    p = F.softmax(z, -1)
    return -(p * p.log()).sum(-1)


def torch_log_first(x, w, ids):
    p = F.linear(x, w).softmax(-1)
    return -(torch.log(p) * p).sum(dim=-1)


def two_softmaxes_keepdim_no_minus(x, w, ids):
    z = F.linear(x, w)
    return (F.softmax(z, -1) * z.softmax(-1).log()).sum(-1, keepdim=True)


def log_softmax_spelling(x, w, ids):
    z = F.linear(x, w) / TEMPERATURE
    return -(F.softmax(z, -1) * F.log_softmax(z, -1)).sum(-1)


def loss_and_entropy(entropy):
    def fn(x, w, ids):
        z = F.linear(x, w)
        loss = F.cross_entropy(z.reshape(-1, V), ids.reshape(-1))
        return loss, entropy(z)

    return fn


def _probs_entropy(z):
    p = z.softmax(-1)
    return -(p * p.log()).sum(-1)


def _log_softmax_entropy(z):
    return -(z.softmax(-1) * F.log_softmax(z, -1)).sum(-1)


ALONE = {
    "-(p * p.log()).sum(-1), p = F.softmax(z / T)": softmax_then_log,
    "-(torch.log(p) * p).sum(dim=-1), p = z.softmax(-1)": torch_log_first,
    "(softmax(z) * softmax(z).log()).sum(-1, keepdim=True)": two_softmaxes_keepdim_no_minus,
}


def _underflowing_inputs():
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=3)
    w = (w.detach() * SPREAD).requires_grad_()
    return x, w, ids


def _tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _assert_as_written(fn, args, outputs, compiled):
    """No node the rules made is left, and eager's numbers (its NaNs included) come out."""
    for graph in compiled.graphs:
        for node in graph.graph.nodes:
            made = str(node.target).startswith("cce.") or node.meta.get("cce_form")
            assert not made, node.format_node()
    want = _tuple(fn(*args))
    assert any(torch.isnan(t).any() for t in want), "eager gives no NaN: the case tests nothing"
    for got, expected in zip(_tuple(outputs), want, strict=True):
        torch.testing.assert_close(got, expected, equal_nan=True)


@pytest.mark.parametrize("fn", ALONE.values(), ids=ALONE.keys())
def test_an_entropy_of_softmax_log_alone_is_left_as_written_and_says_why(fn, caplog):
    args = _underflowing_inputs()
    with caplog.at_level(logging.INFO, logger="cce_compile"):
        outputs, compiled = compile_and_run(fn, args)
    assert compiled.counts == {"skipped:inexact_form": 1}, compiled.counts
    _assert_as_written(fn, args, outputs, compiled)
    (report,) = compiled.reports
    assert report.form == "entropy" and not report.quiet, report
    assert "log of softmax(z)" in report.detail and "NaN" in report.detail, report.detail
    assert "F.log_softmax(z, -1)" in report.advice, report.advice
    told = [r.getMessage() for r in caplog.records]  # (TORCH_LOGS=cce: INFO and up)
    assert any("(inexact_form)" in m and "left the entropy" in m for m in told), told


def test_explain_shows_the_left_alone_entropy_with_its_reason_and_fix():
    report = cce_compile.explain(softmax_then_log, *_underflowing_inputs())
    (site,) = report.sites
    assert not site.rewritten and site.reason == "inexact_form", site
    text = str(report)
    assert "reason: inexact_form: " in text and "p * p.log()" in text, text
    assert "fix: take the entropy's log-probabilities with F.log_softmax(z, -1)" in text, text


def test_beside_a_cross_entropy_of_the_same_logits_neither_fuses_and_the_reason_names_it():
    """(Before, the entropy's softmax was an escaping use of the logits: logits_escape, which
    named a node but not why nor what to write.)"""
    fn, args = loss_and_entropy(_probs_entropy), _underflowing_inputs()
    outputs, compiled = compile_and_run(fn, args)
    assert compiled.counts == {"skipped:inexact_form": 1}, compiled.counts
    _assert_as_written(fn, args, outputs, compiled)
    (report,) = compiled.reports
    assert report.form == "cross-entropy" and "p * p.log()" in report.detail, report.detail
    assert "F.log_softmax(z, -1)" in report.advice, report.advice


def test_under_rewrite_the_kept_logits_serve_it_as_written():
    """CCE_ESCAPING_LOGITS=rewrite keeps the logits for their other uses: the loss fuses and
    the entropy is eager's, from the kept logits (its rewrite is put back, not decomposed)."""
    fn, args = loss_and_entropy(_probs_entropy), _underflowing_inputs()
    with config.override(escaping_logits="rewrite"):
        (loss, entropy), compiled = compile_and_run(fn, args)
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    (report,) = compiled.reports
    assert report.logits == "kept" and report.form == "cross-entropy", report
    want_loss, want_entropy = fn(*args)
    assert torch.isnan(want_entropy).any()
    torch.testing.assert_close(entropy, want_entropy, equal_nan=True)
    torch.testing.assert_close(loss, want_loss)


CONTROL = {
    "alone": log_softmax_spelling,
    "beside a cross-entropy": loss_and_entropy(_log_softmax_entropy),
}


@pytest.mark.parametrize("fn", CONTROL.values(), ids=CONTROL.keys())
def test_the_log_softmax_spelling_still_fuses_without_nan(fn):
    """The control: the spelling the fix names fuses into one op call, and where eager's
    probabilities underflow its entropy is a number (0 * a finite log-prob), float64's."""
    x, w, ids = args = _underflowing_inputs()
    outputs, compiled = compile_and_run(fn, args)
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    assert [n.target for g in compiled.graphs for n in g.graph.nodes].count(OP) == 1
    want = _tuple(fn(x.detach().double(), w.detach().double(), ids))
    # A float32 log-prob is off by about eps * |z| (z some 100s here): so is a sum of p * log p.
    atol = 4 * torch.finfo(torch.float32).eps * F.linear(x, w).abs().max().item() / TEMPERATURE
    for got, expected in zip(_tuple(outputs), want, strict=True):
        assert not torch.isnan(got).any()
        rtol = VALUE_RTOL[torch.float32]
        torch.testing.assert_close(got.double(), expected.detach(), rtol=rtol, atol=atol)
