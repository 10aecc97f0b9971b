"""What the pass says of RL forms it leaves alone, where an adversarial run found the message
unclear or missing: a graph node's name where a description was meant ("neg: ...", "used by
logsumexp, sub"), a fix that did not apply (Categorical's log_prob of broadcast ids; old
log-probs under no_grad beside an entropy with a gradient), and entropies written with an
epsilon or through ``Categorical(probs=...)``, which were not reported at all. Each message is
checked with the fix it names: that spelling fuses.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from test_rl_forms import OP, TEMPERATURE, V, compile_and_run, make_inputs

from cce_compile.passes import categorical, entropy_rules, escapes


def _op_calls(compiled) -> int:
    return [n.target for g in compiled.graphs for n in g.graph.nodes].count(OP)


def _as_written(fn, args, outputs, compiled):
    """No node the rules made is left, and eager's numbers come out."""
    for graph in compiled.graphs:
        for node in graph.graph.nodes:
            made = str(node.target).startswith("cce.") or node.meta.get("cce_form")
            assert not made, node.format_node()
    want = fn(*args)
    for got, expected in zip(outputs, want if isinstance(want, tuple) else (want,), strict=True):
        torch.testing.assert_close(got, expected, equal_nan=True)


def _assert_fused_as_eager(fn, args):
    outputs, compiled = compile_and_run(fn, args)
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    assert _op_calls(compiled) == 1
    for got, expected in zip(outputs, fn(*args), strict=True):
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


# --- an entropy left alone: its reason, without a node's name --------------------------------


def biased_trl_entropy(x, w, ids):
    b = torch.zeros(V)
    lp = F.log_softmax(F.linear(x, w, b) / TEMPERATURE, -1)
    return (-(lp.exp() * lp).sum(-1),)


def biased_loss_and_entropy(x, w, ids):
    z = F.linear(x, w, torch.zeros(V))
    lp = F.log_softmax(z, -1)
    return F.cross_entropy(z.reshape(-1, V), ids.reshape(-1)), -(lp.exp() * lp).sum(-1)


def test_a_left_alone_entropy_says_why_in_words_not_by_a_node_name():
    """Its own site's detail is the reason alone (it read 'neg: ...'); a loss beside it names
    it as an entropy of its logits."""
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=1)
    _, compiled = compile_and_run(biased_trl_entropy, (x, w, ids))
    (report,) = compiled.reports
    assert report.detail == entropy_rules.NAN_AT_MINUS_INF, report.detail
    _, compiled = compile_and_run(biased_loss_and_entropy, (x, w, ids))
    (report,) = compiled.reports
    assert report.form == "cross-entropy" and report.reason == "inexact_form", report
    want = f"an entropy of these logits: {entropy_rules.NAN_AT_MINUS_INF}"
    assert report.detail == want, report.detail


# --- Categorical's log_prob of ids that broadcast ---------------------------------------------


def categorical_of_broadcast_ids(x, w, ids):
    d = torch.distributions.Categorical(logits=F.linear(x, w) / TEMPERATURE)
    return d.log_prob(ids[0]), d.entropy()  # ids (T,) against logits (B, T, V)


def categorical_of_expanded_ids(x, w, ids):
    """The fix: ids of the logits' leading shape."""
    z = F.linear(x, w) / TEMPERATURE
    d = torch.distributions.Categorical(logits=z)
    return d.log_prob(ids[0].expand(z.shape[:-1])), d.entropy()


def test_categorical_log_prob_of_broadcast_ids_says_it_is_not_recognised():
    """The entropy's site named 'logsumexp, sub' and the fix 'compile the step that computes
    the loss from the model's outputs', which does not apply."""
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=2)
    args = (x, w, ids)
    outputs, compiled = compile_and_run(categorical_of_broadcast_ids, args)
    assert compiled.counts == {"skipped:logits_escape": 1}, compiled.counts
    _as_written(categorical_of_broadcast_ids, args, outputs, compiled)
    (report,) = compiled.reports
    assert categorical.BROADCAST_IDS in report.detail, report.detail
    assert "logsumexp" not in report.detail and " sub" not in report.detail, report.detail
    assert report.advice == categorical.BROADCAST_IDS_FIX, report.advice
    assert "ids.expand(z.shape[:-1])" in report.advice
    _assert_fused_as_eager(categorical_of_expanded_ids, args)


def categorical_of_logits_written_in_place(x, w, ids):
    d = torch.distributions.Categorical(logits=F.linear(x, w) / TEMPERATURE)
    d.logits.clamp_(min=-3.0)
    return d.log_prob(ids), d.entropy()


def categorical_without_the_write(x, w, ids):
    """The fix: no in-place write after the head."""
    d = torch.distributions.Categorical(logits=F.linear(x, w) / TEMPERATURE)
    return d.log_prob(ids), d.entropy()


def test_categorical_logits_written_in_place_name_the_write_not_broadcast_ids():
    """Ids of the logits' own shape: the site blamed "ids that broadcast" and gave the
    ids.expand fix, which did not apply; it names the in-place write, whose fix fuses."""
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=2)
    args = (x, w, ids)
    outputs, compiled = compile_and_run(categorical_of_logits_written_in_place, args)
    assert compiled.counts == {"skipped:logits_escape": 1}, compiled.counts
    _as_written(categorical_of_logits_written_in_place, args, outputs, compiled)
    (report,) = compiled.reports
    assert categorical.BROADCAST_IDS not in report.detail, report.detail
    assert f"{categorical.LOG_PROB_WRITTEN_IN_PLACE} (clamp_)" in report.detail, report.detail
    assert report.advice == categorical.LOG_PROB_WRITTEN_IN_PLACE_FIX, report.advice
    _assert_fused_as_eager(categorical_without_the_write, args)


# --- old log-probs without a gradient beside an entropy with one -----------------------------


def old_log_probs_under_no_grad(x, w, ids):
    z = F.linear(x, w) / TEMPERATURE
    with torch.no_grad():
        old = F.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0]
    lp = F.log_softmax(z, -1)
    return old, -(lp.exp() * lp).sum(-1)


def old_log_probs_detached(x, w, ids):
    """The fix: the log-probs with a gradient, detached."""
    z = F.linear(x, w) / TEMPERATURE
    lp = F.log_softmax(z, -1)
    return lp.gather(-1, ids[..., None])[..., 0].detach(), -(lp.exp() * lp).sum(-1)


def test_log_probs_under_no_grad_beside_an_entropy_with_a_gradient_name_the_grad_modes():
    """The same rows at the same scaling: the reason said 'other rows or another scaling'."""
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=3)
    outputs, compiled = compile_and_run(old_log_probs_under_no_grad, (x, w, ids))
    assert compiled.counts == {"skipped:logits_escape": 1}, compiled.counts
    _as_written(old_log_probs_under_no_grad, (x, w, ids), outputs, compiled)
    (report,) = compiled.reports
    assert escapes.GRAD_MODES_DIFFER in report.detail, report.detail
    assert "other rows or another scaling" not in report.detail, report.detail
    assert report.advice == escapes.GRAD_MODES_DIFFER_FIX and ".detach()" in report.advice
    _assert_fused_as_eager(old_log_probs_detached, (x, w, ids))


# --- entropies of probabilities with an epsilon, or through Categorical(probs=...) -----------


def eps_in_the_log(x, w, ids):
    p = F.softmax(F.linear(x, w) / TEMPERATURE, -1)
    return (-(p * torch.log(p + 1e-10)).sum(-1),)


def probs_clamped_at_eps(x, w, ids):
    p = F.linear(x, w).softmax(-1)
    return (-(torch.log(p.clamp(min=1e-12)) * p).sum(-1, keepdim=True),)


def loss_beside_eps_in_the_log(x, w, ids):
    z = F.linear(x, w)
    p = F.softmax(z, -1)
    return F.cross_entropy(z.reshape(-1, V), ids.reshape(-1)), -(p * (p + 1e-8).log()).sum(-1)


def categorical_of_probs(x, w, ids):
    d = torch.distributions.Categorical(probs=torch.softmax(F.linear(x, w) / TEMPERATURE, -1))
    return (d.entropy(),)


def categorical_of_probs_with_log_prob(x, w, ids):
    d = torch.distributions.Categorical(probs=torch.softmax(F.linear(x, w) / TEMPERATURE, -1))
    return d.log_prob(ids), d.entropy()


def categorical_of_logits(x, w, ids):
    """The fix both name."""
    d = torch.distributions.Categorical(logits=F.linear(x, w) / TEMPERATURE)
    return d.log_prob(ids), d.entropy()


SILENT = {
    "-(p * log(p + eps))": (eps_in_the_log, entropy_rules.EPS_IN_LOG, "entropy"),
    "-(log(p.clamp(min=eps)) * p), keepdim": (
        probs_clamped_at_eps,
        entropy_rules.EPS_IN_LOG,
        "entropy",
    ),
    "a loss beside -(p * (p + eps).log())": (
        loss_beside_eps_in_the_log,
        entropy_rules.EPS_IN_LOG,
        "cross-entropy",
    ),
    "Categorical(probs=softmax(z)).entropy()": (
        categorical_of_probs,
        entropy_rules.PROBS_RENORMALISED,
        "entropy",
    ),
    "Categorical(probs=...): log_prob and entropy": (
        categorical_of_probs_with_log_prob,
        entropy_rules.PROBS_RENORMALISED,
        "entropy",
    ),
}


@pytest.mark.parametrize("case", SILENT.values(), ids=SILENT.keys())
def test_an_entropy_the_op_would_compute_otherwise_is_reported_left_alone(case, caplog):
    """Neither fused nor reported before (no site, no log line, the N x V logits kept): now
    its site is left alone as inexact_form, once, as written, with what to write instead."""
    fn, why, form = case
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=4)
    with caplog.at_level(logging.INFO, logger="cce_compile"):
        outputs, compiled = compile_and_run(fn, (x, w, ids))
    assert compiled.counts == {"skipped:inexact_form": 1}, compiled.counts
    _as_written(fn, (x, w, ids), outputs, compiled)
    (report,) = compiled.reports
    assert report.form == form and why in report.detail, report
    assert report.advice == entropy_rules.FIXES[why], report.advice
    assert "Categorical(logits=z).entropy()" in report.advice
    told = [r.getMessage() for r in caplog.records if why in r.getMessage()]
    assert len(told) == 1 and "(inexact_form)" in told[0], told


def test_the_spelling_those_fixes_name_fuses():
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=4)
    _assert_fused_as_eager(categorical_of_logits, (x, w, ids))
