"""Logits that leave the graph: left alone and said so (keep), fused and kept (rewrite), or
fused and returned as a data-less 'meta' tensor that no use can read (drop, training only)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from harness import check

import cce_compile
from cce_compile import config
from cce_compile.passes import graph_pass

B, T, D, V = 2, 5, 8, 11


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen, requires_grad=True)
    w = torch.randn(V, D, generator=gen, requires_grad=True)
    y = torch.randint(0, V, (B, T), generator=gen)
    y[0, 1] = -100
    return x, w, y


def returns_logits(x, w, y):
    logits = F.linear(x, w)
    return F.cross_entropy(logits.view(-1, V), y.view(-1)), logits


def returns_softcapped_float_logits(x, w, y):
    logits = (torch.tanh(F.linear(x, w) / 5.0) * 5.0).float()
    return F.cross_entropy(logits.view(-1, V), y.view(-1)), logits


@pytest.mark.parametrize(
    "fn", [returns_logits, returns_softcapped_float_logits], ids=["linear", "softcapped-float"]
)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_drop_fuses_the_loss_and_returns_meta_logits(fn, dynamic):
    with config.override(escaping_logits="drop"):
        outcome = check(fn, inputs(), dynamic=dynamic, dropped_logits=True)
    assert outcome.rewritten == 1 and outcome.has_op
    assert torch._C._nn.linear not in outcome.targets()  # the logits are never computed


USES = {
    "token-accuracy": lambda z, y: (z.argmax(-1) == y).float().mean().item(),
    "item": lambda z, y: z.mean().item(),
    "cpu": lambda z, y: z.cpu(),
    "tolist": lambda z, y: z[0, 0].tolist(),
    "numpy": lambda z, y: z.detach().numpy(),
    "float-of-element": lambda z, y: float(z[0, 0, 0]),
    "compare": lambda z, y: bool((z > 0).any()),
    "add-to-loss": lambda z, y: (z.sum() + y.float().sum()).backward(),
}


@pytest.mark.parametrize("use", USES.values(), ids=USES.keys())
def test_every_use_of_dropped_logits_raises(use):
    torch._dynamo.reset()
    x, w, y = inputs()
    with config.override(escaping_logits="drop"):
        loss, logits = torch.compile(returns_logits, backend=cce_compile.backend)(x, w, y)
    assert logits.device.type == "meta" and logits.shape == (B, T, V)
    assert "device='meta'" in repr(logits)  # printing shows no numbers
    with pytest.raises((RuntimeError, NotImplementedError, TypeError)):
        use(logits, y)
    loss.backward()  # the loss itself trains
    assert w.grad is not None and torch.isfinite(w.grad).all()


def test_drop_leaves_evaluation_graphs_alone():
    x, w, y = inputs()
    with config.override(escaping_logits="drop"), torch.no_grad():
        outcome = check(returns_logits, (x.detach(), w.detach(), y))
    assert outcome.rewritten == 0 and outcome.skipped == {"logits_escape": 1}


def test_drop_leaves_logits_used_inside_the_graph_alone():
    def accuracy_in_graph(x, w, y):
        logits = F.linear(x, w)
        accuracy = (logits.argmax(-1) == y).float().mean()
        return F.cross_entropy(logits.view(-1, V), y.view(-1)), accuracy

    with config.override(escaping_logits="drop"):
        outcome = check(accuracy_in_graph, inputs())
    assert outcome.rewritten == 0 and outcome.skipped == {"logits_escape": 1}


def test_left_alone_sites_are_logged_once_with_the_setting(caplog):
    graph_pass._told.clear()
    with caplog.at_level(logging.WARNING, logger="cce_compile"):
        check(returns_logits, inputs(), backward_all=True)
        check(returns_logits, inputs(1), backward_all=True)  # compiled again: not told again
    told = [r.getMessage() for r in caplog.records if r.name == "cce_compile"]
    assert len(told) == 1, told
    assert "logits_escape" in told[0] and "CCE_ESCAPING_LOGITS=drop" in told[0]
    assert "\n" not in told[0] and "test_escaping_logits.py" in told[0]


def test_evaluation_graph_under_drop_says_drop_is_for_training(caplog):
    graph_pass._told.clear()
    x, w, y = inputs()
    with config.override(escaping_logits="drop"), torch.no_grad():
        with caplog.at_level(logging.WARNING, logger="cce_compile"):
            check(returns_logits, (x.detach(), w.detach(), y))
    (told,) = [r.getMessage() for r in caplog.records if r.name == "cce_compile"]
    assert "training graphs only" in told
