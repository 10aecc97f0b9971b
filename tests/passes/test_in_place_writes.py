"""An input of the compiled loss written in place after the loss and before its backward: as
PyTorch, a version-counter error, never the gradient of values the loss no longer had.

Through the pass in lean mode, with Inductor's generated code: the rewritten call takes a hidden
that is not 3-D as a (B, T, D) view (passes/emit.canonical_hidden). Were that view saved for the
backward's recompute, Inductor's code would return it as an alias without hidden's version
counter, the write would go unnoticed and the gradients would be those of the written values
(1e15 instead of 0.2 after ``h.mul_(3)``). The same holds for the row slice of the logits that the
pass moves onto hidden. Both views are tagged for recompute (passes/emit.recomputed), so hidden
itself is saved and checked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import GRAD_RTOL, LOSS_RTOL, assert_close

import cce_compile
from cce_compile import config

V, D, ROWS = 97, 24, 40


def _flat_loss(hidden, classifier, targets):
    logits = F.linear(hidden, classifier)
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=-100)


def _shifted_loss(hidden, classifier, targets):  # the row slice moves onto hidden
    logits = F.linear(hidden, classifier)[:, :-1]
    return F.cross_entropy(logits.flatten(0, 1), targets[:, 1:].flatten(), ignore_index=-100)


# form -> (hidden's shape, the loss): each compiled once, then called on fresh inputs
FORMS = {
    "hidden-2d": ((ROWS, D), _flat_loss),
    "hidden-4d": ((2, 4, ROWS // 8, D), _flat_loss),
    "hidden-shifted": ((2, ROWS // 2, D), _shifted_loss),
}


def _inputs(shape):
    gen = torch.Generator().manual_seed(0)
    classifier = torch.randn(V, D, generator=gen).requires_grad_()
    hidden = torch.randn(shape, generator=gen).requires_grad_()
    targets = torch.randint(0, V, shape[:-1], generator=gen)
    targets.view(-1)[:7] = -100
    return hidden, classifier, targets


@pytest.mark.parametrize("form", list(FORMS))
def test_lean_mode_through_the_pass_refuses_an_in_place_write_before_backward(form):
    shape, loss_fn = FORMS[form]
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend="cce")
    written = ["hidden", "classifier"] if form == "hidden-2d" else ["hidden"]
    with config.override(mode="lean"), cce_compile.watch() as report:
        # Unwritten: the recompute tags change what is saved, not what is computed.
        hidden, classifier, targets = _inputs(shape)
        compiled(hidden * 1.0, classifier * 1.0, targets).backward()
        hidden64 = hidden.detach().double().requires_grad_()
        classifier64 = classifier.detach().double().requires_grad_()
        want = loss_fn(hidden64, classifier64, targets)
        want.backward()
        for name, got, expected in [
            ("grad hidden", hidden.grad, hidden64.grad),
            ("grad classifier", classifier.grad, classifier64.grad),
        ]:
            assert_close(name, got, expected, GRAD_RTOL[torch.float32])
        for name in written:
            hidden, classifier, targets = _inputs(shape)
            h, c = hidden * 1.0, classifier * 1.0  # non-leaves: writable in place
            loss = compiled(h, c, targets)
            assert_close("loss", loss.detach(), want.detach().float(), LOSS_RTOL[torch.float32])
            with torch.no_grad():
                (h if name == "hidden" else c).mul_(3.0)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()
    assert len(report.rewritten) == 1, str(report)  # one compile served every call
