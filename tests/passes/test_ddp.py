"""DistributedDataParallel: its forward always breaks the graph (a C++ logger call, and a
frame Dynamo is told to skip), so the head and the loss meet only inside the wrapped module.

A loss computed in the wrapped module's forward (Hugging Face's ``model(x, labels=y)``) is
rewritten, with CCE_ESCAPING_LOGITS=drop when the module also returns its logits; a loss
computed outside DDP is left alone, and explain() says what cut the graph and what to do.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from harness import check

import cce_compile
from cce_compile import config

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
def ddp_model():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch.manual_seed(0)
        yield nn.parallel.DistributedDataParallel(TinyLM())
    finally:
        dist.destroy_process_group()


def batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 6, 16, generator=gen), torch.randint(0, V, (2, 6), generator=gen)


def test_loss_inside_the_wrapped_module_is_rewritten(ddp_model):
    with config.override(escaping_logits="drop"):
        outcome = check(
            lambda x, y: ddp_model(x, labels=y)[0],
            batch(),
            fullgraph=False,
            parameters=ddp_model.parameters(),
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
