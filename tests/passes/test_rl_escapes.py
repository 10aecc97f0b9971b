"""RL forms whose logits have other users: returned beside the log-probs and the entropy (the
CCE_ESCAPING_LOGITS policy decides, as for the log-probs alone), or read at other rows (left
alone, and the reason says which use and why).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import GRAD_RTOL, assert_close
from rl_forms import verl_entropy
from test_rl_forms import OP, TEMPERATURE, VALUE_RTOL, V, compile_and_run, make_inputs, survivors

from cce_compile import config
from cce_compile.passes.placeholder import LogitsNotComputed


def log_probs_entropy_and_logits(x, w, ids):
    """What an HF-style policy returns: its logits beside the RL outputs computed from them."""
    z = F.linear(x, w) / TEMPERATURE
    log_probs = F.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0]
    return log_probs, verl_entropy(z), z


def _float64(x, w, ids):
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    log_probs, entropy, _ = log_probs_entropy_and_logits(x64, w64, ids)
    return (x64, w64), log_probs, entropy


@pytest.mark.parametrize("policy", ["drop", "rewrite"])
def test_returned_logits_beside_an_entropy_follow_the_escaping_logits_policy(policy):
    """drop (the default): one op call, the logits returned as a placeholder; rewrite: one op
    call, the logits kept. (The entropy counted as a use of the logits besides the return, so
    the head was left unfused, the logits kept, whatever the setting.) Values and gradients
    against float64."""
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=5)
    with config.override(escaping_logits=policy):
        (log_probs, entropy, logits), compiled = compile_and_run(
            log_probs_entropy_and_logits, (x, w, ids)
        )
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    assert [n.target for g in compiled.graphs for n in g.graph.nodes].count(OP) == 1
    (report,) = compiled.reports
    assert report.form == "log-probs and entropy"
    if policy == "drop":
        assert isinstance(logits, LogitsNotComputed) and report.logits == "dropped"
        # (the placeholder: a 'meta' tensor of the logits' shape, holding no data)
        assert survivors(compiled.graphs, V) == ["logits_not_computed_default"]
    else:
        assert report.logits == "kept"
        torch.testing.assert_close(logits, F.linear(x, w) / TEMPERATURE)
    leaves, want_log_probs, want_entropy = _float64(x, w, ids)
    rtol = VALUE_RTOL[torch.float32]
    assert_close("log-probs", log_probs.double(), want_log_probs.detach(), rtol, 1.0)
    assert_close("entropy", entropy.double(), want_entropy.detach(), rtol, 1.0)
    got = torch.autograd.grad(log_probs.sum() + 0.1 * entropy.sum(), (x, w))
    want = torch.autograd.grad(want_log_probs.sum() + 0.1 * want_entropy.sum(), leaves)
    for name, g, expected in zip(("hidden", "classifier"), got, want):
        assert_close(f"gradient of {name}", g.double(), expected, GRAD_RTOL[torch.float32])


def test_keep_leaves_the_head_alone_beside_an_entropy_as_beside_the_log_probs():
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=5)
    with config.override(escaping_logits="keep"):
        outputs, compiled = compile_and_run(log_probs_entropy_and_logits, (x, w, ids))
    assert compiled.counts == {"skipped:logits_escape": 1}, compiled.counts
    (report,) = compiled.reports
    assert report.quiet and "returned by the graph" in report.detail, report.detail
    for got, want in zip(outputs, log_probs_entropy_and_logits(x, w, ids)):
        torch.testing.assert_close(got, want)


def shifted_loss_and_entropy_of_every_row(x, w, labels):
    """A model's loss over its shifted logits z[:, :-1], and an entropy of every row of z
    logged without a gradient: two sets of rows of one head."""
    z = F.linear(x, w)
    loss = F.cross_entropy(z[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
    with torch.no_grad():
        log_p = F.log_softmax(z, -1)
        entropy = -(log_p.exp() * log_p).sum(-1)
    return loss, entropy


def test_a_shifted_loss_beside_an_entropy_of_every_row_says_which_use_keeps_the_logits():
    """Each site names the other's use of the logits for what it is. (The entropy's site said
    'the loss needs no gradient (an evaluation or generation graph)' of a training graph, and
    the loss's named the entropy without saying why the op could not serve it.)"""
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=6)
    labels = ids.masked_fill(torch.arange(ids.shape[1]) < 2, -100)
    outputs, compiled = compile_and_run(shifted_loss_and_entropy_of_every_row, (x, w, labels))
    assert compiled.counts == {"skipped:logits_escape": 2}, compiled.counts
    loss_site, entropy_site = compiled.reports
    assert entropy_site.form == "entropy"
    assert "an entropy of other rows or another scaling" in loss_site.detail, loss_site.detail
    assert "z[:, :-1]" in loss_site.detail
    assert "(the rows the cross-entropy loss reads)" in entropy_site.detail, entropy_site.detail
    assert not any("evaluation" in r.detail for r in compiled.reports), compiled.reports
    for got, want in zip(outputs, shifted_loss_and_entropy_of_every_row(x, w, labels)):
        torch.testing.assert_close(got, want)
