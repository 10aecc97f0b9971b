"""Review s11: a call the TRL integration hands to TRL's own kernel is invisible by default.

A user who calls ``cce_trl.install()`` and then trains with a trainer whose requests the op does
not serve (DPO/KTO ask for ``log_sum_sq_probs`` / ``mean_logits``; GRPO/RLOO for
``("log_probs", "entropy")``) gets TRL's kernel on every call, and nothing is printed: the reason
is logged with ``log.info`` on the ``cce_compile`` logger, which has no handler, so Python shows
only WARNING and above. docs/trl.md says the reason is "logged once"; the graph pass says the
same kind of thing ("left the cross-entropy ... alone") at WARNING. Only ``counts()`` reveals it.
"""

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


@pytest.mark.xfail(
    strict=True,
    reason="hand-over to TRL's kernel is logged at INFO only: silent under default logging",
)
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
