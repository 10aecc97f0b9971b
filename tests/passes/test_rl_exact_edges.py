"""RL forms at the edges where a fused form would differ from eager's, found by an adversarial
run: an entropy at a -inf logit (a masked class: Categorical's clamp and the op give 0 log 0 =
0 there, the other spellings NaN in eager), a log-prob whose two operands differ in having a
gradient (the op gave neither one), and ids whose sizes Dynamo makes separate symbols when it
recompiles for a new batch size (the log-probs were left unfused without a word).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from oracle import GRAD_RTOL, assert_close
from rl_forms import trl_entropy, verl_entropy
from test_rl_forms import OP, TEMPERATURE, VALUE_RTOL, V, compile_and_run, make_inputs
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
    """Categorical's terms without its clamp: 0 * -inf at a masked class."""
    d = torch.distributions.Categorical(logits=F.linear(x, w, b) / TEMPERATURE)
    return d.log_prob(ids), -(d.probs * d.logits).sum(-1)


def trl_entropy_of_head(x, w, b, ids):
    return (trl_entropy(F.linear(x, w, b) / TEMPERATURE),)


def softmax_log_softmax_entropy(x, w, b, ids):
    z = F.linear(x, w, b) / TEMPERATURE
    log_probs = F.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1)
    return log_probs, -(F.softmax(z, -1) * F.log_softmax(z, -1)).sum(-1)


def verl_entropy_of_head(x, w, b, ids):
    return (verl_entropy(F.linear(x, w, b) / TEMPERATURE),)


def _masked_inputs(seed=1):
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=seed)
    return x, w, _masking_bias(), ids % (V - MASKED)


def test_categorical_entropy_of_a_head_with_a_minus_inf_bias_fuses_finite_and_exact():
    """Categorical's clamp makes a masked class (a -inf in the bias) add 0, and so does the op
    (0 log 0 = 0, its gradient 0 there): fused into one call, whatever the logits, with eager's
    finite entropy and gradients, against float64 within the oracle's tolerances."""
    x, w, b, ids = _masked_inputs()
    (log_probs, entropy), compiled = compile_and_run(categorical_entropy, (x, w, b, ids))
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    assert _op_calls(compiled) == 1
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    want_log_probs, want_entropy = categorical_entropy(x64, w64, b.double(), ids)
    assert torch.isfinite(entropy).all() and torch.isfinite(want_entropy).all()
    rtol = VALUE_RTOL[torch.float32]
    assert_close("entropy", entropy.double(), want_entropy.detach(), rtol, 1.0)
    assert_close("log-probs", log_probs.double(), want_log_probs.detach(), rtol, 1.0)
    got = torch.autograd.grad(log_probs.sum() + 0.1 * entropy.sum(), (x, w))
    want = torch.autograd.grad(want_log_probs.sum() + 0.1 * want_entropy.sum(), (x64, w64))
    for name, g, expected in zip(("hidden", "classifier"), got, want):
        assert torch.isfinite(g).all(), name
        assert_close(f"gradient of {name}", g.double(), expected, GRAD_RTOL[torch.float32])


def _exact_entropy(z):
    """The entropy with 0 log 0 = 0, in a spelling whose gradient cannot overflow: a masked
    class's log-prob is never multiplied (float64, the oracle)."""
    log_p = F.log_softmax(z, -1)
    p = log_p.exp()
    return -(p * torch.where(p > 0, log_p, 0)).sum(-1)


def test_categorical_entropy_gradient_at_a_minus_inf_logit_is_exact_where_eager_overflows():
    """With an upstream of 2 on the entropy, eager Categorical's gradient is NaN at a masked
    class: its clamp at finfo.min times 2 overflows to -inf, and softmax's backward makes 0 *
    inf = NaN (every |dL/dH| > 1 does). The op's gradient is the exact one there (0 at that
    class): finite, and within the oracle's tolerance of float64's exact gradient."""
    x, w, b, ids = _masked_inputs()
    (log_probs, entropy), compiled = compile_and_run(categorical_entropy, (x, w, b, ids))
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    got = torch.autograd.grad(log_probs.sum() + 2 * entropy.sum(), (x, w))
    eager_log_probs, eager_entropy = categorical_entropy(x, w, b, ids)
    eager = torch.autograd.grad(eager_log_probs.sum() + 2 * eager_entropy.sum(), (x, w))
    assert all(torch.isnan(g).any() for g in eager), "eager's gradient overflows: the case's point"
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    z64 = F.linear(x64, w64, b.double()) / TEMPERATURE
    want_log_probs = F.log_softmax(z64, -1).gather(-1, ids[..., None]).squeeze(-1)
    want = torch.autograd.grad(want_log_probs.sum() + 2 * _exact_entropy(z64).sum(), (x64, w64))
    for name, g, expected in zip(("hidden", "classifier"), got, want):
        assert torch.isfinite(g).all() and torch.isfinite(expected).all(), name
        assert_close(f"gradient of {name}", g.double(), expected, GRAD_RTOL[torch.float32])


def test_categorical_log_prob_of_a_biased_head_fuses():
    x, w, b, ids = _masked_inputs()
    log_probs, compiled = compile_and_run(categorical_log_prob, (x, w, b, ids))
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    torch.testing.assert_close(log_probs, categorical_log_prob(x, w, b, ids))


NAN_AT_MINUS_INF = {
    "TRL -(exp(logp) * logp)": trl_entropy_of_head,
    "-(softmax * log_softmax), beside log-probs": softmax_log_softmax_entropy,
    "verl logsumexp - (softmax * z)": verl_entropy_of_head,
    "-(d.probs * d.logits)": categorical_unclamped_entropy,
}


@pytest.mark.parametrize("fn", NAN_AT_MINUS_INF.values(), ids=NAN_AT_MINUS_INF.keys())
def test_an_entropy_spelling_nan_at_minus_inf_of_a_biased_head_is_left_alone(fn, caplog):
    """Eager's 0 * -inf is NaN at a masked class where the op's entropy would be 0: with a
    bias the logits may hold -inf, so the site is left as written (eager's NaN kept) and says
    so once, with what to write instead. (Fused before: the op was NaN there too.)"""
    args = _masked_inputs()
    with caplog.at_level(logging.INFO, logger="cce_compile"):
        outputs, compiled = compile_and_run(fn, args)
    assert compiled.counts == {"skipped:inexact_form": 1}, compiled.counts
    assert _op_calls(compiled) == 0
    want = fn(*args)
    assert torch.isnan(want[-1]).all(), "eager's entropy is NaN in every row: the case's point"
    for got, expected in zip(outputs, want, strict=True):
        torch.testing.assert_close(got, expected, equal_nan=True)
    (report,) = compiled.reports
    assert "NaN at a -inf logit" in report.detail and "0 log 0 = 0" in report.detail, report
    assert "Categorical(logits=z).entropy()" in report.advice, report.advice
    assert "without its bias" in report.advice, report.advice
    told = [r.getMessage() for r in caplog.records if "NaN at a -inf logit" in r.getMessage()]
    assert len(told) == 1 and "(inexact_form)" in told[0], told


@pytest.mark.parametrize("fn", NAN_AT_MINUS_INF.values(), ids=NAN_AT_MINUS_INF.keys())
def test_the_same_spellings_of_a_head_without_a_bias_fuse(fn):
    """The control: a linear head without a bias has no -inf logit, so they fuse."""
    x, w, _, ids = _masked_inputs()
    outputs, compiled = compile_and_run(fn, (x, w, None, ids))
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    assert _op_calls(compiled) == 1
    for got, expected in zip(outputs, fn(x, w, None, ids), strict=True):
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


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


def test_a_widening_cast_keeps_a_head_without_a_bias_free_of_minus_inf():
    """bf16 logits cast to float32 (TRL's upcast) cannot overflow: the spelling fuses. (The
    cast's check read the tensor where it meant its dtype, and raised in the backend.)"""
    x, (w,), ids, _ = make_inputs(torch.bfloat16, ["one"], seed=2)

    def step(x, w, ids):
        return trl_entropy(F.linear(x, w).float() / TEMPERATURE)

    entropy, compiled = compile_and_run(step, (x, w, ids))
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    # (the op's logits are not rounded to bf16: float64's of the bf16 operands)
    want = trl_entropy(F.linear(x.detach().double(), w.detach().double()) / TEMPERATURE)
    assert_close("entropy", entropy.double(), want, VALUE_RTOL[torch.float32], 1.0)
