"""``cce_compile.linear_log_probs``: per-token log-probs and entropy of temperature-scaled
logits (the temperature after the softcap, as TRL and verl apply it), against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import GRAD_RTOL, assert_close, rel_error
from strategies import build_case

import cce_compile


def _reference(case, temperature):
    """float64 log-probs and entropy of softcap(scale * (h @ W.T + b)) / T, 0 at ignored."""
    h, w = case.hidden.double(), case.classifier.double()
    z = F.linear(h, w, None if case.bias is None else case.bias.double()) * case.logit_scale
    if case.softcap:
        z = case.softcap * torch.tanh(z / case.softcap)
    log_p = (z / temperature).log_softmax(-1)
    valid = case.targets != case.ignore_index
    picked = log_p.gather(-1, case.targets.clamp(min=0)[..., None])[..., 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    return torch.where(valid, picked, 0.0), torch.where(valid, entropy, 0.0)


CASES = {
    "plain": dict(),
    "softcap-scale-bias": dict(softcap=3.0, logit_scale=0.5, bias=True),
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_log_probs_and_entropy_match_float64(options, temperature):
    case = build_case(leading=(2, 9), dim=16, vocab=37, seed=3, ignored_fraction=0.3, **options)
    leaves = [t.requires_grad_() for t in case.leaves()]
    kwargs = dict(logit_scale=case.logit_scale, softcap=case.softcap, temperature=temperature)
    log_probs, entropy = cce_compile.linear_log_probs(
        case.hidden, case.classifier, case.targets, case.bias, return_entropy=True, **kwargs
    )
    want_lp, want_h = _reference(case, temperature)
    assert_close("log_probs", log_probs, want_lp.detach(), 2e-5, want_lp.abs().max().item())
    assert_close("entropy", entropy, want_h.detach(), 2e-5, want_h.abs().max().item())
    assert (log_probs <= 0).all()
    gen = torch.Generator().manual_seed(4)
    a, g = torch.randn(log_probs.shape, generator=gen), torch.randn(entropy.shape, generator=gen)
    got = torch.autograd.grad((log_probs * a).sum() + (entropy * g).sum(), leaves)
    want = torch.autograd.grad((want_lp * a).sum() + (want_h * g).sum(), leaves)
    for got_grad, want_grad in zip(got, want):
        assert rel_error(got_grad, want_grad) < GRAD_RTOL[torch.float32]


def test_no_grad_log_probs_are_the_grad_log_probs_bit_for_bit():
    """An old or reference policy's log-probs (no grad) against the policy's (grad), with and
    without the entropy: the importance ratio exp(new - old) is exactly 1 at the first step."""
    case = build_case(leading=(3, 11), dim=24, vocab=61, seed=5, ignored_fraction=0.2)
    args = (case.hidden, case.classifier, case.targets)
    with torch.no_grad():
        old = cce_compile.linear_log_probs(*args, temperature=0.9)
    case.hidden.requires_grad_()
    new, _ = cce_compile.linear_log_probs(*args, temperature=0.9, return_entropy=True)
    assert torch.equal(old, new.detach())
    assert torch.equal(torch.exp(new - old), torch.ones_like(old))


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf"), float("nan")])
def test_a_temperature_that_is_not_a_positive_number_is_refused(temperature):
    case = build_case(leading=(2, 3), dim=4, vocab=5)
    with pytest.raises(ValueError, match="temperature"):
        cce_compile.linear_log_probs(
            case.hidden, case.classifier, case.targets, temperature=temperature
        )
    with pytest.raises(TypeError, match="temperature"):
        cce_compile.linear_log_probs(case.hidden, case.classifier, case.targets, temperature="1")


def test_a_row_gets_the_same_bits_whatever_the_batch_it_comes_in():
    """TRL passes only labelled rows, so an old policy's and the policy's calls can hold a row
    in batches of different sizes: its log-prob must not depend on them (CPU path: the slabs
    of classes are sized from the vocabulary alone)."""
    case = build_case(leading=(1, 1100), dim=32, vocab=5000, seed=7, ignored_fraction=0.0)
    whole = cce_compile.linear_log_probs(case.hidden, case.classifier, case.targets)
    few = cce_compile.linear_log_probs(case.hidden[:, :17], case.classifier, case.targets[:, :17])
    assert torch.equal(few, whole[:, :17])


def test_compute_dtype_gives_float32_math_for_a_bf16_head():
    """TRL's ``cast_lm_head_to_fp32``: a float32 hidden beside a bf16 head, computed in
    float32 with no float32 copy of the head for the caller to make; the head's gradient comes
    back in bf16. Without ``compute_dtype`` (and outside autocast) the dtypes must agree."""
    case = build_case(leading=(2, 9), dim=16, vocab=37, seed=8, ignored_fraction=0.2)
    head = case.classifier.bfloat16().requires_grad_()
    hidden = case.hidden.requires_grad_()
    with pytest.raises(TypeError, match="must match hidden dtype"):
        cce_compile.linear_log_probs(hidden, head, case.targets)
    got = cce_compile.linear_log_probs(
        hidden, head, case.targets, temperature=0.8, compute_dtype=torch.float32
    )
    case.classifier = head.detach().float()  # the head's values, in float32
    want, _ = _reference(case, 0.8)
    assert got.dtype == torch.float32
    assert_close("log_probs", got, want, 2e-5, want.abs().max().item())
    (grad,) = torch.autograd.grad(got.sum(), head)
    assert grad.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="compute_dtype must be"):
        cce_compile.linear_log_probs(hidden, head, case.targets, compute_dtype=torch.int32)


def test_fast_mode_is_refused_in_the_log_probs_terms():
    case = build_case(leading=(2, 3), dim=4, vocab=5)
    with pytest.raises(ValueError, match="per-token log-probs get theirs only in the backward"):
        cce_compile.linear_log_probs(case.hidden, case.classifier, case.targets, mode="fast")
