"""Edge cases of skipping ignored targets and of the metrics outputs that held up
(regression tests; each against float64 F.cross_entropy on F.linear logits)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import GRAD_RTOL, LOSS_RTOL, assert_close

from cce_compile import config, linear_cross_entropy

# Compaction at these small sizes on a GPU too (conftest.skip_at_any_size).
pytestmark = pytest.mark.usefixtures("skip_at_any_size")

V, D = 23, 8


def _reference(hidden, classifier, targets, **options):
    logits = F.linear(hidden.double(), classifier.double())
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten().long(), **options)


@pytest.mark.parametrize("ignore_index", [V, 50000, -1, 0])
@pytest.mark.parametrize("mode", ["lean", "fast"])
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "every-row"])
def test_ignore_index_outside_or_inside_the_vocabulary(ignore_index, mode, skip):
    gen = torch.Generator().manual_seed(0)
    classifier = torch.randn(V, D, generator=gen)
    hidden = torch.randn(2, 6, D, generator=gen, requires_grad=True)
    targets = torch.randint(1, V, (2, 6), generator=gen).to(torch.int32)
    targets[0, :3] = ignore_index
    with config.override(skip_ignored=skip):
        loss = linear_cross_entropy(
            hidden, classifier, targets, ignore_index=ignore_index, mode=mode, label_smoothing=0.1
        )
    (grad,) = torch.autograd.grad(loss, hidden)
    ref_hidden = hidden.detach().double().requires_grad_()
    expected = _reference(
        ref_hidden, classifier, targets, ignore_index=ignore_index, label_smoothing=0.1
    )
    (ref_grad,) = torch.autograd.grad(expected, ref_hidden)
    assert_close("loss", loss, expected, LOSS_RTOL[torch.float32])
    assert_close("grad", grad, ref_grad, GRAD_RTOL[torch.float32])


def test_argmax_ties_across_cpu_slabs_pick_the_first_class():
    """1500 rows x 1300 classes: the CPU path's lean tiles split the classes into slabs."""
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 1500, 1300
    classifier = torch.randn(vocab, 4, generator=gen)
    classifier[700] = classifier[5]
    classifier[1100] = classifier[5]
    hidden = torch.randn(1, rows, 4, generator=gen)
    hidden[0, :200] = classifier[5] * 3
    targets = torch.randint(0, vocab, (1, rows), generator=gen)
    targets[0, torch.rand(rows, generator=gen) < 0.3] = -100
    _, argmax = linear_cross_entropy(
        hidden, classifier, targets, mode="lean", reduction="none", return_argmax=True
    )
    logits = F.linear(hidden.double(), classifier.double())
    expected = torch.where(targets != -100, logits.argmax(-1), -1)
    assert torch.equal(argmax, expected)
