"""A whole Hugging Face model compiled with the default settings, as loops other than the
Trainer use it: a custom loop that reads the training logits gets the placeholder's error (and
its evaluation the real logits); accelerate's mixed-precision wrapper, which casts the logits
to float32 inside the compiled forward, is fused too."""

from __future__ import annotations

from types import MethodType

import pytest
import torch
from harness import check
from torch._dynamo.backends.debugging import aot_eager

from cce_compile.passes.graph_pass import run_on_module
from cce_compile.passes.placeholder import LogitsNotComputed, LogitsNotComputedError

pytest.importorskip("transformers")
import hf_zoo  # noqa: E402  (needs transformers)


def cce_eager(gm, example_inputs):
    run_on_module(gm)
    return aot_eager(gm, example_inputs)


def test_a_custom_loop_reading_the_training_logits_gets_the_error():
    torch._dynamo.reset()
    model = hf_zoo.tiny("llama")
    compiled = torch.compile(model, backend=cce_eager)
    ids, labels = hf_zoo.batch()
    out = compiled(input_ids=ids, labels=labels)
    out.loss.backward()  # training works
    assert isinstance(out.logits, LogitsNotComputed)
    with pytest.raises(LogitsNotComputedError, match="CCE_ESCAPING_LOGITS=rewrite"):
        (out.logits[:, :-1].argmax(-1) == labels[:, 1:]).float().mean()  # token accuracy
    with torch.no_grad():  # an evaluation step: its logits are real
        evaluated = compiled(input_ids=ids, labels=labels)
    assert not isinstance(evaluated.logits, LogitsNotComputed)
    want = model.forward(input_ids=ids).logits.detach()
    assert torch.allclose(evaluated.logits, want, rtol=1e-4, atol=1e-5)


def test_accelerates_mixed_precision_output_cast_is_fused():
    """What accelerate's prepare_model does under bf16 / fp16 (the Trainer's ``bf16=True``):
    autocast around the forward, and every half-precision output cast to float32."""
    from accelerate.utils import convert_outputs_to_fp32

    model = hf_zoo.tiny("llama")
    forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward.__func__)
    model.forward = MethodType(convert_outputs_to_fp32(forward), model)
    outcome = check(
        hf_zoo.whole(model),
        hf_zoo.batch(),
        parameters=model.parameters(),
        dtype=torch.bfloat16,
        dropped_logits=True,
    )
    assert outcome.rewritten == 1 and outcome.has_op
