"""The TRL integration tells the user, once, at the default log level (WARNING), when it hands a
call to TRL's own kernel: a trainer whose requests the op does not serve (DPO/KTO ask for
``log_sum_sq_probs`` / ``mean_logits``; GRPO/RLOO for ``("log_probs", "entropy")``) would
otherwise get TRL's kernel on every call with nothing said (found by a review, 11713e6: it
was logged at INFO)."""

from __future__ import annotations

import logging

import pytest
import torch

trl = pytest.importorskip("trl")
if not trl.__version__.startswith("1.16."):
    pytest.skip(f"written for TRL 1.16.x, found {trl.__version__}", allow_module_level=True)

import trl.trainer.utils as trl_utils  # noqa: E402

from cce_compile.integrations import trl as cce_trl  # noqa: E402


@pytest.fixture
def installed():
    cce_trl.install()
    cce_trl.reset_counts()
    cce_trl._logged.clear()
    yield
    cce_trl.uninstall()


@pytest.mark.parametrize(
    "outputs",
    [("log_sum_sq_probs",), ("entropy",)],
    ids=["dpo-kto-outputs", "rl-policy-entropy"],
)
def test_hand_over_is_visible_at_default_log_level(installed, caplog, outputs):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 8, generator=gen, requires_grad=True)
    weight = torch.randn(37, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, 37, (6,), generator=gen)
    with caplog.at_level(logging.WARNING, logger="cce_compile"):
        trl_utils._ChunkedLogProbFunction.apply(
            hidden, weight, None, targets, 1.0, 16, None, 1.0, outputs
        )
    assert cce_trl.counts()["handed_to_trl"] == 1  # it was handed over ...
    # ... and the user should be told so at the default (WARNING) level, once.
    assert any("handed to TRL" in r.getMessage() for r in caplog.records), caplog.records
