"""An input of the compiled loss written in place after the loss and before its backward: as
PyTorch, a version-counter error, never the gradient of values the loss no longer had.

Through the pass in lean mode, with Inductor's generated code: the rewritten call reads views of
its inputs (a hidden that is not 3-D as (B, T, D), the logits' row slice moved onto hidden, the
targets reshaped to the rows, the user's own views). Were such a view saved for the backward's
recompute, Inductor's code would return it as an alias without the input's version counter: the
write would go unnoticed, and the gradients would be wrong (1e15 instead of 0.2 after
``h.mul_(3)``). The pass tags every view between a graph input and the op for
recompute (passes/emit.save_inputs_not_views), so the input itself is saved and checked."""

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


def _sliced_hidden_loss(hidden, classifier, targets):  # the user's own view of the input
    logits = F.linear(hidden[:, :-1], classifier)
    return F.cross_entropy(logits.flatten(0, 1), targets[:, 1:].flatten(), ignore_index=-100)


# form -> (hidden's shape, the loss, the inputs written in place, one per call, each to be
# refused with PyTorch's version-counter error); each form is compiled once, then called on
# fresh inputs, unwritten first. Eager raises for each of these writes but two, where it had
# copied what it saves: the targets of targets[:, 1:].flatten(), and hidden[:, :-1] through its
# linear. The op reads the inputs themselves there (the shift is its argument, the view its
# hidden), so the write is refused: an error, never the gradients of the written values.
FORMS = {
    "hidden-2d": (
        (ROWS, D),
        _flat_loss,
        ("hidden", "classifier", "targets"),
    ),
    "hidden-4d": ((2, 4, ROWS // 8, D), _flat_loss, ("hidden", "targets")),
    "logits-shifted": (
        (2, ROWS // 2, D),
        _shifted_loss,
        ("hidden", "targets"),
    ),
    "hidden-sliced": ((2, ROWS // 2, D), _sliced_hidden_loss, ("hidden",)),
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
    shape, loss_fn, writes = FORMS[form]
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, backend="cce")
    hidden, classifier, targets = _inputs(shape)
    hidden64 = hidden.detach().double().requires_grad_()
    classifier64 = classifier.detach().double().requires_grad_()
    want = loss_fn(hidden64, classifier64, targets)
    want.backward()
    with config.override(mode="lean"), cce_compile.watch() as report:
        for written in [None, *writes]:
            hidden, classifier, targets = _inputs(shape)
            h, c = hidden * 1.0, classifier * 1.0  # non-leaves: writable in place
            loss = compiled(h, c, targets)
            assert_close("loss", loss.detach(), want.detach().float(), LOSS_RTOL[torch.float32])
            if written is not None:
                with torch.no_grad():
                    {"hidden": h, "classifier": c, "targets": targets}[written].mul_(3)
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    loss.backward()
                continue
            loss.backward()
            for name, got, expected in [
                ("grad hidden", hidden.grad, hidden64.grad),
                ("grad classifier", classifier.grad, classifier64.grad),
            ]:
                assert_close(name, got, expected, GRAD_RTOL[torch.float32])
    assert len(report.rewritten) == 1, str(report)  # one compile served every call


def _written_by_the_graph(hidden, classifier, targets):
    hidden += 1  # the compiled code itself writes its input, before the head reads a view of it
    return _sliced_hidden_loss(hidden, classifier, targets)


def test_an_input_the_compiled_code_writes_itself_is_not_saved_for_the_backward():
    """The views after an in-place write are not tagged: the saved input would fail its own
    version check (the graph's write is applied to it after the forward)."""
    shape = (2, ROWS // 2, D)
    hidden, classifier, targets = _inputs(shape)
    hidden64 = hidden.detach().double().requires_grad_()
    classifier64 = classifier.detach().double().requires_grad_()
    want = _written_by_the_graph(hidden64 * 1.0, classifier64, targets)
    want.backward()
    torch._dynamo.reset()
    with config.override(mode="lean"), cce_compile.watch() as report:
        loss = torch.compile(_written_by_the_graph, backend="cce")(
            hidden * 1.0, classifier * 1.0, targets
        )
        loss.backward()
    assert len(report.rewritten) == 1, str(report)
    assert_close("loss", loss.detach(), want.detach().float(), LOSS_RTOL[torch.float32])
    assert_close("grad hidden", hidden.grad, hidden64.grad, GRAD_RTOL[torch.float32])
    assert_close("grad classifier", classifier.grad, classifier64.grad, GRAD_RTOL[torch.float32])
