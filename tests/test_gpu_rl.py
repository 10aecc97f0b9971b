"""GPU-only: RL's per-token log-probs and entropy at a Qwen-like vocabulary, bf16 and under
AMP, against float64: values and gradients of a policy-gradient loss with an entropy bonus;
the no-grad (old / reference) log-probs bit for bit the grad ones; the DPO/KTO metrics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import GRAD_RTOL
from oracle import rel_error as rel

import cce_compile

pytestmark = pytest.mark.gpu

TEMPERATURE = 0.9


def _policy(dtype, rows=2 * 1031, dim=1536, vocab=151936, seed=0):
    """hidden (1, rows, D), classifier (V, D), sampled ids with 20% padding (-100)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(1, rows, dim, device="cuda", generator=gen).to(dtype)
    classifier = (torch.randn(vocab, dim, device="cuda", generator=gen) * 0.03).to(dtype)
    ids = torch.randint(0, vocab, (1, rows), device="cuda", generator=gen)
    ids[torch.rand(1, rows, device="cuda", generator=gen) < 0.2] = -100
    return hidden, classifier, ids


def _float64(hidden, classifier, ids, compute_dtype):
    """Log-probs and entropy of the operands rounded to the compute dtype, in float64."""
    h, w = (t.to(compute_dtype).double() for t in (hidden, classifier))
    log_p = (F.linear(h, w) / TEMPERATURE).log_softmax(-1)
    valid = ids != -100
    picked = log_p.gather(-1, ids.clamp(min=0)[..., None])[..., 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    return torch.where(valid, picked, 0.0), torch.where(valid, entropy, 0.0)


@pytest.mark.parametrize("precision", ["bf16", "amp"])
def test_policy_gradient_with_an_entropy_bonus_matches_float64(precision):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    hidden, classifier, ids = _policy(dtype)
    leaves = [hidden.requires_grad_(), classifier.requires_grad_()]
    gen = torch.Generator(device="cuda").manual_seed(1)
    advantages = torch.randn(ids.shape, device="cuda", generator=gen)
    with torch.autocast("cuda", torch.bfloat16, enabled=precision == "amp"):
        log_probs, entropy = cce_compile.linear_log_probs(
            hidden, classifier, ids, temperature=TEMPERATURE, return_entropy=True
        )
    mask = ids != -100
    loss = -(advantages * log_probs).sum() / mask.sum() - 0.01 * entropy.sum() / mask.sum()
    got = torch.autograd.grad(loss, leaves)
    references = [t.detach().clone().requires_grad_() for t in leaves]
    want_lp, want_h = _float64(*references, ids, torch.bfloat16)
    want_loss = -(advantages * want_lp).sum() / mask.sum() - 0.01 * want_h.sum() / mask.sum()
    want = torch.autograd.grad(want_loss, references)
    # The values: float32 sums of bf16 products' exact logits (the operands rounded as autocast
    # rounds them): float32 rounding. The gradients: rounded once to the compute dtype before
    # the GEMMs (bf16), as eager PyTorch's are.
    assert rel(log_probs, want_lp) < 1e-5 and rel(entropy, want_h) < 1e-5
    for name, g, w in zip(("hidden", "classifier"), got, want):
        assert g.dtype == dtype, name
        assert rel(g, w) < GRAD_RTOL[torch.bfloat16], name


def test_old_log_probs_are_the_policy_log_probs_bit_for_bit():
    hidden, classifier, ids = _policy(torch.bfloat16, seed=2)
    with torch.no_grad():
        old = cce_compile.linear_log_probs(hidden, classifier, ids, temperature=TEMPERATURE)
    hidden.requires_grad_()
    new, _ = cce_compile.linear_log_probs(
        hidden, classifier, ids, temperature=TEMPERATURE, return_entropy=True
    )
    assert torch.equal(old, new.detach())


def test_dpo_and_kto_metrics_match_float64():
    hidden, classifier, ids = _policy(torch.bfloat16, rows=517, seed=3)
    _, argmax, lsq, mean_logits = cce_compile.linear_cross_entropy(
        hidden, classifier, ids, reduction="none", return_argmax=True,
        return_log_sum_sq_probs=True, return_mean_logits=True,
    )  # fmt: skip
    z = F.linear(hidden.double(), classifier.double())
    valid = ids != -100
    want_lsq = torch.where(valid, torch.logsumexp(2 * z.log_softmax(-1), -1), 0.0)
    assert rel(lsq, want_lsq) < 1e-5
    assert rel(mean_logits, torch.where(valid, z.mean(-1), 0.0), 1e-3) < 1e-4
    # Rows whose two largest logits differ by more than float32's error of a logit.
    top2 = z.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1] > 1e-4) | ~valid
    want_argmax = torch.where(valid, z.argmax(-1), -1)
    assert torch.equal(argmax[clear], want_argmax[clear])
