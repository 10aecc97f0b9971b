"""What the pass must never turn into a different number: in-place writes in the region, grad
mode, edge constants, and consumers of the logits that come before the loss.

Every case runs compiled (the pass + AOTAutograd) and eagerly and compares the loss and every
gradient (``harness.check``), then checks what the pass decided and why.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import check, inductor_without_codegen

from cce_compile import config

B, T, D, V = 2, 5, 8, 11
MUTATION = {"mutation_in_region": 1}


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen, requires_grad=True)
    w = (torch.randn(V, D, generator=gen) / D**0.5).requires_grad_()
    b = (torch.randn(V, generator=gen) * 0.1).requires_grad_()
    y = torch.randint(0, V, (B, T), generator=gen)
    y[0, 1] = -100
    return x, w, b, y


def ce(logits, y, **kw):
    return F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), **kw)


# --- in-place writes between the head and the loss ------------------------------------------


def _hidden_mul_(x, w, b, y):
    h = x * 1.0
    logits = F.linear(h, w)
    h.mul_(3.0)
    return ce(logits, y) + 0 * h.sum()


def _hidden_iadd(x, w, b, y):
    h = x * 1.0
    logits = F.linear(h, w)
    h += 1.0
    return ce(logits, y) + 0 * h.sum()


def _hidden_setitem_through_a_view(x, w, b, y):
    h = x * 1.0
    flat = h.view(-1)
    logits = F.linear(h, w)
    flat[3] = 100.0
    return ce(logits, y) + 0 * h.sum()


def _hidden_relu_inplace(x, w, b, y):
    h = x * 1.0
    logits = F.linear(h, w)
    F.relu(h, inplace=True)
    return ce(logits, y) + 0 * h.sum()


def _hidden_out_argument(x, w, b, y):
    h = x * 1.0
    logits = F.linear(h, w, b)  # out= takes no tensor that requires grad: the bias does
    torch.add(h, 1.0, out=h)
    return ce(logits, y) + 0 * h.sum()


def _classifier_add_(x, w, b, y):
    w2 = w * 1.0
    logits = F.linear(x, w2)
    w2.add_(1.0)
    return ce(logits, y) + 0 * w2.sum()


def _bias_zero_(x, w, b, y):
    b2 = b * 1.0
    logits = F.linear(x, w, b2)
    b2.zero_()
    return ce(logits, y) + 0 * b2.sum()


def _logits_div_(x, w, b, y):
    logits = F.linear(x, w)
    flat = logits.view(-1, V)
    logits.div_(2.0)  # the loss sees the halved logits, and so does the view read after it
    return ce(logits, y) + 0 * flat.sum()


def _logits_setitem(x, w, b, y):
    logits = F.linear(x, w)
    logits[:, :, 0] = -1e4
    return ce(logits, y)


def _hidden_relu_inplace_positional(x, w, b, y):
    h = x * 1.0
    logits = F.linear(h, w)
    F.relu(h, True)  # inplace by position
    return ce(logits, y) + 0 * h.sum()


def _hidden_foreach_mul_(x, w, b, y):
    h = x * 1.0
    logits = F.linear(h, w)
    torch._foreach_mul_([h], 0.0)  # a list operand written in place
    return ce(logits, y) + 0 * h.sum()


MUTATIONS = {
    "hidden-mul_": _hidden_mul_,
    "hidden-iadd": _hidden_iadd,
    "hidden-setitem-through-a-view": _hidden_setitem_through_a_view,
    "hidden-relu-inplace": _hidden_relu_inplace,
    "hidden-relu-inplace-positional": _hidden_relu_inplace_positional,
    "hidden-foreach-mul_": _hidden_foreach_mul_,
    "hidden-out=": _hidden_out_argument,
    "classifier-add_": _classifier_add_,
    "bias-zero_": _bias_zero_,
    "logits-div_": _logits_div_,
    "logits-setitem": _logits_setitem,
}


@pytest.mark.parametrize("fn", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_a_write_in_the_region_leaves_the_site_alone(fn):
    x, w, b, y = inputs()
    # Eager autograd refuses a backward through a tensor written after it was saved: the
    # tensor written is one that no gradient formula saves (the other operand has no grad).
    if fn in (_classifier_add_,):
        x = x.detach()
    elif fn is not _bias_zero_ and fn not in (_logits_div_, _logits_setitem):
        w = w.detach()
    if fn is _hidden_out_argument:
        x = x.detach()
    outcome = check(fn, (x, w, b, y))
    assert outcome.rewritten == 0 and outcome.skipped == MUTATION, outcome


def test_a_write_to_kept_logits_is_seen_with_the_rewrite_policy():
    def fn(x, w, b, y):
        logits = F.linear(x, w)
        logits[:, :, 0] = -1e4
        return ce(logits, y), logits

    with config.override(escaping_logits="rewrite"):
        outcome = check(fn, inputs(), backward_all=True)
    assert outcome.rewritten == 0 and outcome.skipped == MUTATION


def test_writes_outside_the_region_and_to_later_targets_are_fine():
    def fn(x, w, b, y):
        h = x * 1.0
        h.mul_(3.0)  # before the head: eager and the op both read the written value
        labels = y.clone()
        logits = F.linear(h, w)
        labels[labels == 3] = -100  # read at the loss by both
        return ce(logits, labels)

    outcome = check(fn, inputs())
    assert outcome.rewritten == 1 and outcome.has_op


def test_an_unused_random_draw_from_the_logits_still_counts_as_a_user():
    """Dead code decides no escape, but an unused dropout of the logits is no dead code: it
    draws random numbers, and erasing it with the logits would shift every later draw."""

    def fn(x, w, b, y):
        logits = F.linear(x, w)
        F.dropout(logits, 0.5)
        return ce(logits, y)

    outcome = check(fn, inputs())
    assert outcome.rewritten == 0 and outcome.skipped == {"logits_escape": 1}, outcome


# --- grad mode -------------------------------------------------------------------------------


def _head_under_no_grad(x, w, b, y):
    with torch.no_grad():
        logits = F.linear(x, w, b)
    return ce(logits, y) + (x * 0).sum()


def _head_under_inference_mode(x, w, b, y):
    with torch.inference_mode():
        logits = F.linear(x, w)
    return ce(logits.clone(), y) + (x * 0).sum()


def _all_under_inference_mode(x, w, b, y):  # an evaluation step inside the compiled code
    with torch.inference_mode():
        return ce(F.linear(x, w, b), y)


def _detached_logits(x, w, b, y):
    return ce(F.linear(x, w).detach(), y) + (x * 0).sum()


def _detached_hidden(x, w, b, y):
    return ce(F.linear(x.detach(), w), y)


def _loss_under_no_grad(x, w, b, y):
    logits = F.linear(x, w)
    with torch.no_grad():
        loss = ce(logits, y)
    return loss + (x * 0).sum()


GRAD_MODES = {
    "head-under-no_grad": _head_under_no_grad,
    "head-under-inference_mode": _head_under_inference_mode,
    "all-under-inference_mode": _all_under_inference_mode,
    "detached-logits": _detached_logits,
    "detached-hidden": _detached_hidden,
    "loss-under-no_grad": _loss_under_no_grad,
}


@pytest.mark.parametrize("fn", GRAD_MODES.values(), ids=GRAD_MODES.keys())
def test_grad_mode_of_the_region_is_kept(fn):
    """Rewritten, and the gradients that eager does not compute stay None (the harness
    compares None-ness and values)."""
    outcome = check(fn, inputs())
    assert outcome.rewritten == 1 and outcome.has_op


def test_logsumexp_under_no_grad_is_not_served():
    def fn(x, w, b, y):
        logits = F.linear(x, w)
        with torch.no_grad():
            z = torch.logsumexp(logits, -1)
        return ce(logits, y) + 1e-2 * z.square().mean()

    outcome = check(fn, inputs())
    assert outcome.rewritten == 0 and outcome.skipped == {"logits_escape": 1}


def test_logsumexp_consumed_before_the_loss_is_served_there():
    def fn(x, w, b, y):
        logits = F.linear(x, w)
        z_loss = 1e-2 * torch.logsumexp(logits, -1).square().mean()  # before the loss
        return z_loss + ce(logits, y)

    outcome = check(fn, inputs())
    assert outcome.rewritten == 1 and torch.logsumexp not in outcome.targets()


def test_logsumexp_consumed_under_another_grad_mode_is_not_served():
    def fn(x, w, b, y):
        logits = F.linear(x, w)
        z = torch.logsumexp(logits, -1)
        with torch.no_grad():
            monitor = z.mean() * 0
        return ce(logits, y) + z.square().mean() * 1e-2 + monitor

    outcome = check(fn, inputs())
    assert outcome.rewritten == 0 and outcome.skipped == {"logits_escape": 1}


# --- constants -------------------------------------------------------------------------------

CONSTANTS = {
    "softcap-0": (lambda x, w, b, y: ce(0.0 * torch.tanh(F.linear(x, w) / 0.0), y), 0),
    "softcap-inf": (
        lambda x, w, b, y: ce(float("inf") * torch.tanh(F.linear(x, w) / float("inf")), y),
        0,
    ),
    "softcap-negative": (lambda x, w, b, y: ce(-4.0 * torch.tanh(F.linear(x, w) / -4.0), y), 1),
    "divided-by-0": (lambda x, w, b, y: ce(F.linear(x, w) / 0.0, y), 0),
    "scaled-by-inf": (lambda x, w, b, y: ce(F.linear(x, w) * float("inf"), y), 0),
    "scaled-by-0": (lambda x, w, b, y: ce(F.linear(x, w) * 0.0, y), 1),
}


@pytest.mark.parametrize("fn, rewritten", CONSTANTS.values(), ids=CONSTANTS.keys())
def test_edge_constants_are_rewritten_only_when_exact(fn, rewritten):
    outcome = check(fn, inputs())
    assert outcome.rewritten == rewritten
    if not rewritten:
        assert outcome.skipped == {"unsupported_option": 1}


def test_smoothing_outside_range_keeps_pytorchs_error():
    x, w, b, y = inputs()
    fn = lambda x, w, y: ce(F.linear(x, w), y, label_smoothing=1.5)  # noqa: E731
    torch._dynamo.reset()
    with pytest.raises(Exception, match="label_smoothing"):
        torch.compile(fn, backend="cce")(x, w, y)


def test_float64_head_is_left_alone():
    x, w, b, y = inputs()
    outcome = check(lambda x, w, y: ce(F.linear(x, w), y), (x.double(), w.double(), y))
    assert outcome.rewritten == 0 and outcome.skipped == {"unsupported_option": 1}


def test_symbolic_softcap_of_zero_is_a_clear_error():
    class Capped(torch.nn.Module):
        def __init__(self, cap):
            super().__init__()
            self.cap = cap

        def forward(self, x, w, y):
            return ce(torch.tanh(F.linear(x, w) / self.cap) * self.cap, y)

    x, w, b, y = inputs()
    torch._dynamo.reset()
    compiled = torch.compile(Capped(3.0), backend="cce", dynamic=True)
    with inductor_without_codegen():  # the op's refusal is under test, not Inductor's code
        torch.testing.assert_close(compiled(x, w, y), Capped(3.0)(x, w, y))
        compiled.cap = 0.0
        try:
            result = compiled(x, w, y)
        except ValueError as error:  # the op refuses a cap it cannot compute
            assert "softcap" in str(error)
        else:  # or Dynamo specialised the cap and recompiled: then the site is left alone
            torch.testing.assert_close(result, Capped(0.0)(x, w, y), equal_nan=True)


def test_a_bias_that_broadcasts_over_the_classes_is_left_alone():
    x, w, _, y = inputs()
    b = torch.randn(1, requires_grad=True)
    outcome = check(lambda x, w, b, y: ce(F.linear(x, w, b), y), (x, w, b, y))
    assert outcome.rewritten == 0 and outcome.skipped == {"unsupported_option": 1}


def test_a_row_slice_with_a_symbolic_bound_is_replayed():
    """logits[:, -k:] with k an int argument that changes: Dynamo makes k symbolic."""

    def last_k(x, w, y, k):
        logits = F.linear(x, w)
        return ce(logits[:, -k:], y[:, -k:])

    x, w, _, y = inputs()
    outcome = check(last_k, (x, w, y, 2), fullgraph=True, extra_calls=[(x, w, y, 3)])
    assert outcome.rewritten >= 1 and outcome.has_op


# --- torch.func transforms compiled around the loss ------------------------------------------


def _plain_loss(x, w, y):
    return ce(F.linear(x, w), y)


TRANSFORMS = {
    "grad": lambda: torch.func.grad(_plain_loss),
    "vmap": lambda: torch.func.vmap(_plain_loss, in_dims=(0, None, None)),
}


@pytest.mark.parametrize("make", TRANSFORMS.values(), ids=TRANSFORMS.keys())
def test_a_compiled_torch_func_transform_is_left_alone_with_the_reason(make):
    """Traced inside grad / vmap, the example values are functorch wrappers: the site is left
    alone (it crashed the rewrite), and the results are eager's."""
    x, w, _, y = (t.detach() for t in inputs())
    if make is TRANSFORMS["vmap"]:
        x = torch.stack([x, 2 * x])
    outcome = check(make(), (x, w, y))
    assert outcome.rewritten == 0 and outcome.skipped == {"unsupported_option": 1}
