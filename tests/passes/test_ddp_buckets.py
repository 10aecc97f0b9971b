"""DDP under torch.compile: Dynamo's DDPOptimizer cuts a compiled frame at gradient-bucket
boundaries and compiles each piece alone. The pass runs on the whole graph before the cut
(passes/ddp_split.py), so a boundary between the head and its loss (here: an auxiliary head's
parameters, used after the LM head, fill a bucket) leaves the loss fused, exact and counted."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from harness import check

import cce_compile
from cce_compile.passes.matching import find_sites
from cce_compile.passes.verdicts import GRAPH_BREAK

V = 96


class HeadThenAuxiliary(nn.Module):
    """An LM head, then an auxiliary head (8192 x 64 float32: 2 MiB) before the loss."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(64, 64)
        self.lm_head = nn.Linear(64, V, bias=False)
        self.aux = nn.Linear(64, 8192)

    def forward(self, x, labels):
        h = torch.relu(self.body(x))
        logits = self.lm_head(h)
        aux = self.aux(h).square().mean()
        return F.cross_entropy(logits.view(-1, V), labels.view(-1)) + 1e-2 * aux


@pytest.fixture
def process_group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 6, 64, generator=gen), torch.randint(0, V, (2, 6), generator=gen)


BUCKETS = [25, 1]  # MiB: DDP's default (its first bucket: 1 MiB), and small buckets
BUCKET_IDS = ["default-buckets", "small-buckets"]


def _ddp(bucket_cap_mb):
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(HeadThenAuxiliary(), bucket_cap_mb=bucket_cap_mb)


@pytest.mark.parametrize("bucket_cap_mb", BUCKETS, ids=BUCKET_IDS)
def test_without_the_pass_first_the_cut_separates_head_and_loss(process_group, bucket_cap_mb):
    """What the pieces look like to a backend: the loss's logits are a piece's input."""
    sites = []

    def recording(gm, example_inputs):
        sites.extend(find_sites(gm.graph))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_ddp(bucket_cap_mb), backend=recording)(*_batch())
    assert [site.reason for site in sites] == [GRAPH_BREAK]


@pytest.mark.parametrize("bucket_cap_mb", BUCKETS, ids=BUCKET_IDS)
def test_the_head_stays_fused_across_ddp_buckets(process_group, bucket_cap_mb):
    outcome = check(_ddp(bucket_cap_mb), _batch(), fullgraph=False)
    assert outcome.rewritten == 1 and outcome.has_op
    assert outcome.gradients == 5  # body and aux: weight and bias; lm_head: weight


def test_explain_reports_the_site_fused_across_the_cut(process_group):
    report = cce_compile.explain(_ddp(1), *_batch())
    assert [site.rewritten for site in report.sites] == [True]
