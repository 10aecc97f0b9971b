"""DistributedDataParallel: its forward always breaks the graph (a C++ logger call, and a
frame Dynamo is told to skip), so the head and the loss meet only inside the wrapped module.

A loss computed in the wrapped module's forward (Hugging Face's ``model(x, labels=y)``) is
rewritten, with CCE_ESCAPING_LOGITS=drop (the default) when the module also returns its
logits; a loss computed outside DDP is left alone, and explain() says what cut the graph and
what to do.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from harness import check

import cce_compile

V = 64


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 16)
        self.lm_head = nn.Linear(16, V, bias=False)

    def forward(self, x, labels=None):
        logits = self.lm_head(torch.relu(self.body(x)))
        if labels is None:
            return logits
        return F.cross_entropy(logits.view(-1, V), labels.view(-1)), logits


@pytest.fixture
def ddp_model(request):
    """DDP over TinyLM; ``find_unused_parameters`` from the test's indirect parameter."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch.manual_seed(0)
        model = TinyLM()
        unused = getattr(request, "param", False)
        yield nn.parallel.DistributedDataParallel(model, find_unused_parameters=unused)
    finally:
        dist.destroy_process_group()


def batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 6, 16, generator=gen), torch.randint(0, V, (2, 6), generator=gen)


@pytest.mark.parametrize(
    "ddp_model", [False, True], ids=["used-parameters", "find-unused-parameters"], indirect=True
)
def test_loss_inside_the_wrapped_module_is_rewritten(ddp_model):
    """find_unused_parameters=True (the Trainer's default for Hugging Face models) passes every
    output through DDP's _DDPSink, which clones it: the logits' placeholder too."""
    outcome = check(  # the module also returns its logits: a placeholder (the default)
        lambda x, y: ddp_model(x, labels=y),
        batch(),
        fullgraph=False,
        parameters=ddp_model.parameters(),
        dropped_logits=True,
    )
    assert outcome.rewritten == 1 and outcome.gradients == 3


def test_loss_outside_ddp_is_left_alone_and_explained(ddp_model):
    def step(x, y):
        return F.cross_entropy(ddp_model(x).view(-1, V), y.view(-1))

    report = cce_compile.explain(step, *batch())
    (site,) = report.sites
    assert site.reason == "logits_from_graph_input" and not site.rewritten
    assert "DistributedDataParallel's forward always breaks the graph" in site.advice
    assert "test_ddp.py" in site.detail  # the break is named at the user's line
