"""RL forms at the edges where a fused form would differ from eager's, found by an adversarial
run: Categorical's entropy of logits that may hold -inf (its clamp gives a number, the op NaN),
a log-prob whose two operands differ in having a gradient (the op gave neither one), and ids
whose sizes Dynamo makes separate symbols when it recompiles for a new batch size (the
log-probs were left unfused without a word).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_rl_forms import OP, TEMPERATURE, V, compile_and_run, make_inputs
from torch._dynamo.backends.debugging import aot_eager

from cce_compile.passes.graph_pass import run_on_module

MASKED = 5  # the vocabulary's last classes, masked by a -inf bias (padding entries)


def _masking_bias():
    bias = torch.zeros(V)
    bias[-MASKED:] = float("-inf")
    return bias


def _op_calls(compiled) -> int:
    return [n.target for g in compiled.graphs for n in g.graph.nodes].count(OP)


def categorical_entropy(x, w, b, ids):
    d = torch.distributions.Categorical(logits=F.linear(x, w, b) / TEMPERATURE)
    return d.log_prob(ids), d.entropy()


def categorical_log_prob(x, w, b, ids):
    return torch.distributions.Categorical(logits=F.linear(x, w, b) / TEMPERATURE).log_prob(ids)


def categorical_unclamped_entropy(x, w, b, ids):
    """The fix the left-alone entropy names: its terms without Categorical's clamp."""
    d = torch.distributions.Categorical(logits=F.linear(x, w, b) / TEMPERATURE)
    return d.log_prob(ids), -(d.probs * d.logits).sum(-1)


def test_categorical_entropy_of_a_biased_head_is_left_alone_and_keeps_eagers_numbers():
    """A -inf in the bias (masked classes): Categorical's clamp makes 0 * log 0 count 0, the
    op's entropy is NaN there (every row was NaN). A bias may hold -inf: the site is left alone
    as inexact_form, its detail saying what to change."""
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=1)
    ids = ids % (V - MASKED)
    args = (x, w, _masking_bias(), ids)
    (log_probs, entropy), compiled = compile_and_run(categorical_entropy, args)
    assert compiled.counts == {"skipped:inexact_form": 1}, compiled.counts
    assert _op_calls(compiled) == 0
    want_log_probs, want_entropy = categorical_entropy(*args)
    assert torch.isfinite(want_entropy).all(), "eager's entropy is finite: the case's point"
    torch.testing.assert_close(entropy, want_entropy)
    torch.testing.assert_close(log_probs, want_log_probs)
    (report,) = compiled.reports
    assert "Categorical's entropy clamps" in report.detail, report.detail
    assert "-(d.probs * d.logits).sum(-1)" in report.detail, report.detail
    assert "softmax(z).log()" not in report.advice, report.advice  # not this site's fix


def test_categorical_log_prob_of_a_biased_head_still_fuses():
    """The clamp is only the entropy's: the log-probs are equal, -inf bias or not."""
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=1)
    args = (x, w, _masking_bias(), ids % (V - MASKED))
    log_probs, compiled = compile_and_run(categorical_log_prob, args)
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    torch.testing.assert_close(log_probs, categorical_log_prob(*args))


@pytest.mark.parametrize("bias", [None, "zeros"])
def test_categorical_entropy_fuses_where_the_logits_hold_no_minus_inf(bias):
    """No bias: Categorical's entropy fuses (the clamp changes nothing); with a bias, the
    spelling the detail names fuses."""
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=1)
    fn = categorical_entropy if bias is None else categorical_unclamped_entropy
    args = (x, w, None if bias is None else torch.zeros(V), ids)
    (log_probs, entropy), compiled = compile_and_run(fn, args)
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    assert _op_calls(compiled) == 1
    want_log_probs, want_entropy = fn(*args)
    torch.testing.assert_close(entropy, want_entropy, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(log_probs, want_log_probs, rtol=2e-5, atol=2e-5)


def gather_of_detached(x, w, ids):
    z = F.linear(x, w) / TEMPERATURE
    return z.detach().gather(-1, ids[..., None])[..., 0] - torch.logsumexp(z, -1)


def gather_of_detached_keepdim(x, w, ids):
    z = F.linear(x, w) / TEMPERATURE
    return (z.detach().gather(-1, ids[..., None]) - z.logsumexp(-1, keepdim=True)).squeeze(-1)


def negative_with_gather_of_detached(x, w, ids):
    z = F.linear(x, w) / TEMPERATURE
    return torch.logsumexp(z, -1) - z.detach().gather(-1, ids[..., None])[..., 0]


def logsumexp_without_grad(x, w, ids):
    z = F.linear(x, w) / TEMPERATURE
    with torch.no_grad():
        lse = torch.logsumexp(z, -1)
    return z.gather(-1, ids[..., None])[..., 0] - lse


DETACHED = [
    gather_of_detached,
    gather_of_detached_keepdim,
    negative_with_gather_of_detached,
    logsumexp_without_grad,
]


@pytest.mark.parametrize("fn", DETACHED, ids=[f.__name__ for f in DETACHED])
def test_a_log_prob_with_one_operand_detached_is_left_as_written(fn):
    """Eager's gradient flows through the other operand alone; the fused log-prob read the
    detached logits, so it had no gradient at all (silently dropped beside another term)."""
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=2)
    got, compiled = compile_and_run(fn, (x, w, ids))
    assert _op_calls(compiled) == 0 and compiled.counts == {}, compiled.counts
    want = fn(x, w, ids)
    assert got.requires_grad and want.requires_grad
    torch.testing.assert_close(got, want)
    for g, expected in zip(
        torch.autograd.grad(got.sum(), (x, w)), torch.autograd.grad(want.sum(), (x, w))
    ):
        torch.testing.assert_close(g, expected)


def log_probs(x, w, ids):
    return F.log_softmax(F.linear(x, w) / TEMPERATURE, -1).gather(-1, ids[..., None]).squeeze(-1)


def _cce_eager(gm, example_inputs, graphs):
    run_on_module(gm)
    graphs.append(gm)
    return aot_eager(gm, example_inputs)


def test_a_new_batch_size_fuses_the_log_probs_and_other_ids_sizes_recompile():
    """Recompiling for a new batch size makes the hidden states' and the ids' sizes separate
    symbols (gather allows ids smaller than the logits): the rule guards them equal, so the
    recompiled graph fuses (it was left unfused without a site or a log line), and ids of
    other sizes recompile, unfused, with eager's values."""
    graphs = []
    compiled = torch.compile(log_probs, backend=lambda gm, ex: _cce_eager(gm, ex, graphs))
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(V, 12, generator=gen) / 12**0.5).requires_grad_()
    for rows, id_rows in (((2, 5), (2, 5)), ((3, 7), (3, 7)), ((4, 6), (4, 6)), ((4, 6), (3, 5))):
        x = torch.randn(*rows, 12, generator=gen, requires_grad=True)
        ids = torch.randint(0, V, id_rows, generator=gen)
        torch.testing.assert_close(compiled(x, w, ids), log_probs(x, w, ids))
    fused = [OP in [n.target for n in g.graph.nodes] for g in graphs]
    assert fused == [True, True, False], fused  # static, dynamic, ids smaller than the logits
