"""The pass's message for an unsupported op between the head and the loss gives LoRA advice only
where that op is an addition to the logits (what an adapter on lm_head makes), not for code with
no PEFT in it (found by a review, 11713e6: every such message carried it)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from harness import inductor_without_codegen

import cce_compile  # noqa: F401  (registers backend="cce")


def test_unsupported_op_message_does_not_mention_lora_without_peft(caplog):
    torch._dynamo.reset()
    vocab, dim = 23, 8
    weight = torch.randn(vocab, dim, requires_grad=True)

    def step(hidden, targets):
        logp = F.log_softmax(F.linear(hidden, weight), dim=-1)
        return F.nll_loss(logp.transpose(1, 2), targets)

    hidden = torch.randn(2, 5, dim, requires_grad=True)
    targets = torch.randint(0, vocab, (2, 5))
    # The pass's message is under test, not Inductor's code for the unfused loss: the backend's
    # Inductor compile stops before its code generation (one g++ build, ~2.5 s of CPU cold).
    with inductor_without_codegen(), caplog.at_level(logging.WARNING, logger="cce_compile"):
        loss = torch.compile(step, backend="cce")(hidden, targets)
    torch.testing.assert_close(loss, step(hidden, targets))
    lines = [r.getMessage() for r in caplog.records if "left the cross-entropy" in r.getMessage()]
    assert lines, "the pass should say once that it left this site alone"
    assert not any("LoRA" in line for line in lines), lines
