"""Logits that leave the graph. By default (CCE_ESCAPING_LOGITS=drop) a training graph that only
returns them gets the fused loss and returns a LogitsNotComputed placeholder in their place: no
memory, and any read raises one error naming the setting; evaluation graphs keep their logits,
quietly. keep leaves the site alone (INFO); rewrite fuses and keeps them (test_forms.py)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from harness import check

import cce_compile
from cce_compile import config
from cce_compile.passes import graph_pass
from cce_compile.passes.placeholder import LogitsNotComputed, LogitsNotComputedError

B, T, D, V = 2, 5, 8, 11


def inputs(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen).to(dtype).requires_grad_()
    w = torch.randn(V, D, generator=gen).to(dtype).requires_grad_()
    y = torch.randint(0, V, (B, T), generator=gen)
    y[0, 1] = -100
    return x, w, y


def returns_logits(x, w, y):
    logits = F.linear(x, w)
    return F.cross_entropy(logits.view(-1, V), y.view(-1)), logits


def returns_softcapped_float_logits(x, w, y):
    logits = (torch.tanh(F.linear(x, w) / 5.0) * 5.0).float()
    return F.cross_entropy(logits.view(-1, V), y.view(-1)), logits


def returns_shifted_flat_logits(x, w, y):
    """Their row count, B x (T - 1), is read from the shifted targets' numel for the
    placeholder (dynamic sizes)."""
    logits = F.linear(x, w)[:, :-1].reshape(-1, V)
    return F.cross_entropy(logits, y[:, 1:].reshape(-1)), logits


def returns_upcast_logits(x, w, y):
    """What accelerate's mixed-precision wrapper makes of a bf16 model's output, traced into
    the graph: the returned logits are a float32 cast of the head's."""
    logits = F.linear(x, w)
    return F.cross_entropy(logits.float().view(-1, V), y.view(-1)), logits.float()


@pytest.mark.parametrize(
    "fn",
    [returns_logits, returns_softcapped_float_logits, returns_shifted_flat_logits],
    ids=["linear", "softcapped-float", "shifted-flat"],
)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_default_fuses_a_training_loss_and_returns_a_placeholder(fn, dynamic):
    outcome = check(fn, inputs(), dynamic=dynamic, dropped_logits=True)  # no setting
    assert outcome.rewritten == 1 and outcome.has_op
    assert torch._C._nn.linear not in outcome.targets()  # the logits are never computed


def test_returned_float_cast_of_the_logits_is_dropped_too():
    bf16 = torch.bfloat16
    outcome = check(returns_upcast_logits, inputs(dtype=bf16), dtype=bf16, dropped_logits=True)
    assert outcome.rewritten == 1 and torch._C._nn.linear not in outcome.targets()
    assert not any(n.target == "float" for g in outcome.graphs for n in g.graph.nodes)


@pytest.fixture(scope="module")
def compiled_outputs():
    """(loss, logits, labels) of one step through Inductor with the default settings."""
    torch._dynamo.reset()
    x, w, y = inputs()
    loss, logits = torch.compile(returns_logits, backend=cce_compile.backend)(x, w, y)
    return loss, logits, y, w


READS = {
    "token-accuracy": lambda z, y: (z.argmax(-1) == y).float().mean().item(),
    "arithmetic": lambda z, y: z * 2,
    "item": lambda z, y: z.mean().item(),
    "index": lambda z, y: z[0, 0],
    "print-a-value": lambda z, y: print(z[0, 0, 0]),
    "cpu": lambda z, y: z.cpu(),
    "tolist": lambda z, y: z.tolist(),
    "numpy": lambda z, y: z.detach().numpy(),
    "float-of-element": lambda z, y: float(z[0, 0, 0]),
    "compare": lambda z, y: bool((z > 0).any()),
    "iterate": lambda z, y: list(z),
    "softmax": lambda z, y: z.float().softmax(-1),
    "save": lambda z, y: torch.save(z, "/dev/null"),
    "add-to-loss": lambda z, y: (z.sum() + y.float().sum()).backward(),
}


@pytest.mark.parametrize("read", READS.values(), ids=READS.keys())
def test_every_read_of_the_placeholder_raises_one_clear_error(compiled_outputs, read):
    loss, logits, y, _ = compiled_outputs
    with pytest.raises(LogitsNotComputedError) as raised:
        read(logits, y)
    message = str(raised.value)
    assert "were not computed" in message and "fused the cross-entropy" in message
    assert "CCE_ESCAPING_LOGITS=rewrite" in message and "CCE_ESCAPING_LOGITS=keep" in message
    assert "test_escaping_logits.py" in message  # where the fused loss is


def test_the_placeholder_holds_no_memory_and_says_what_it_is(compiled_outputs):
    loss, logits, _, w = compiled_outputs
    assert isinstance(logits, LogitsNotComputed)
    assert logits.shape == (B, T, V) and logits.dtype == torch.float32 and logits.is_meta
    assert not logits.requires_grad
    text = repr(logits)
    assert text.startswith("LogitsNotComputed(shape=(2, 5, 11)") and "CCE_ESCAPING_LOGITS" in text
    assert str(logits) == text == f"{logits}"
    with pytest.raises(LogitsNotComputedError):
        logits.untyped_storage()
    loss.backward()  # the loss itself trains
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_what_frameworks_do_to_outputs_gives_placeholders_that_still_raise(compiled_outputs):
    """DDP's _DDPSink clones outputs, autograd views returned inputs, accelerate's
    mixed-precision wrapper casts them to float32: no value is read, so no error yet."""
    _, logits, y, _ = compiled_outputs
    passed = [logits.clone(), logits.detach(), logits.view_as(logits), logits.to(torch.bfloat16)]
    assert all(isinstance(t, LogitsNotComputed) for t in passed)
    assert passed[-1].dtype == torch.bfloat16 and passed[-1].float().dtype == torch.float32
    for tensor in passed:
        with pytest.raises(LogitsNotComputedError):
            tensor.argmax(-1)


def test_evaluation_graphs_keep_their_logits_without_a_warning(caplog):
    graph_pass._told.clear()
    x, w, y = inputs()
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="cce_compile"):
        outcome = check(returns_logits, (x.detach(), w.detach(), y))
    assert outcome.rewritten == 0 and outcome.skipped == {"logits_escape": 1}
    told = [r for r in caplog.records if r.name == "cce_compile"]
    assert told and all(r.levelno < logging.WARNING for r in told), told
    assert "evaluation" in told[0].getMessage()


def test_logits_used_inside_a_training_graph_are_left_alone_with_a_warning(caplog):
    def accuracy_in_graph(x, w, y):
        logits = F.linear(x, w)
        accuracy = (logits.argmax(-1) == y).float().mean()
        return F.cross_entropy(logits.view(-1, V), y.view(-1)), accuracy

    graph_pass._told.clear()
    with caplog.at_level(logging.WARNING, logger="cce_compile"):
        outcome = check(accuracy_in_graph, inputs(), backward_all=True)
        check(accuracy_in_graph, inputs(1), backward_all=True)  # compiled again: said once
    assert outcome.rewritten == 0 and outcome.skipped == {"logits_escape": 1}
    (told,) = [r.getMessage() for r in caplog.records if r.name == "cce_compile"]
    assert "logits_escape" in told and "CCE_ESCAPING_LOGITS=rewrite" in told
    assert "\n" not in told and "test_escaping_logits.py" in told


def test_keep_leaves_a_training_site_alone_as_asked(caplog):
    graph_pass._told.clear()
    with config.override(escaping_logits="keep"), caplog.at_level(logging.INFO, "cce_compile"):
        outcome = check(returns_logits, inputs(), backward_all=True)
    assert outcome.rewritten == 0 and outcome.skipped == {"logits_escape": 1}
    (told,) = [r for r in caplog.records if r.name == "cce_compile"]
    assert told.levelno == logging.INFO and "CCE_ESCAPING_LOGITS=keep" in told.getMessage()
