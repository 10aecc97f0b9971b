"""PEFT LoRA models: the frozen head's loss is fused, with no gradient work for the head, and
the adapters train exactly as they do unfused.

A LoRA model freezes every base weight, lm_head included, and trains small adapters inside
the attention projections. So hidden states need a gradient and the classifier does not: the
rewritten graph must call the op with ``grad_classifier=False`` (no V x D gradient GEMM).
``merge_and_unload()`` folds the adapters back into a plain model, whose evaluation loss is
fused too. Nothing PEFT-specific needs setting: the step that returns the loss is compiled as
for any model. Two things in these stacks keep the loss from being fused as is, pinned here
with what to do (docs/stacks.md): activation checkpointing on a model with frozen embeddings
(transformers' requires_grad_() hook cuts the graph) and LoRA on lm_head itself.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from harness import check, hook_enabled, inductor_without_codegen
from oracle import COMPILED_VS_EAGER_RTOL, rel_error
from torch._dynamo.utils import counters

import cce_compile
from cce_compile import config
from cce_compile.op.signature import FORWARD

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
import hf_zoo  # noqa: E402  (needs transformers)

STEPS = 3
# The rest of the model is compiled by Inductor, whose float32 kernels round differently.
RTOL = COMPILED_VS_EAGER_RTOL[torch.float32]
OP = torch.ops.cce.linear_cross_entropy.default


def _lora(seed: int = 0):
    """A tiny Llama with LoRA adapters on q_proj and v_proj (base weights frozen)."""
    base = hf_zoo.tiny("llama", seed)
    torch.manual_seed(seed)
    adapters = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        init_lora_weights=False,  # B != 0, so that both adapter matrices get gradients
    )
    return peft.get_peft_model(base, adapters)


def _recording(graphs: list, via: str):
    """A backend that compiles as ``via`` does and keeps each Dynamo graph after the pass:
    "cce" (``backend="cce"``) or "enable" (Inductor with ``enable()``'s pre-grad hook)."""

    def backend(gm, example_inputs, **kwargs):
        if via == "cce":
            compiled = cce_compile.backend(gm, example_inputs, **kwargs)
        else:
            from torch._inductor.compile_fx import compile_fx

            compiled = compile_fx(gm, example_inputs)
        graphs.append(gm)
        return compiled

    return backend


def _op_calls(graphs) -> list:
    return [FORWARD.bind(n.args) for g in graphs for n in g.graph.nodes if n.target is OP]


def _train(model, step) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """STEPS optimizer steps on the adapters; each step's loss and adapter gradients."""
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(adapters.values(), lr=1e-2)
    losses, grads = [], []
    for i in range(STEPS):
        loss = step(*hf_zoo.batch(seed=i))
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in adapters.items()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


@pytest.fixture(scope="module")
def eager_run():
    return _train(model := _lora(), hf_zoo.step(model))


@pytest.mark.slow
@pytest.mark.parametrize("via", ["cce", "enable"])
def test_lora_training_is_fused_without_head_gradient(via, eager_run):
    model = _lora()
    assert not model.get_output_embeddings().weight.requires_grad  # LoRA froze the head
    graphs = []
    counters.clear()
    torch._dynamo.reset()
    # Inductor's routes, without its code generation: the rewrite and the gradients are
    # under test (tests/test_backend.py compiles the op with Inductor's code).
    with (
        hook_enabled() if via == "enable" else contextlib.nullcontext(),
        inductor_without_codegen(),
    ):
        compiled = torch.compile(hf_zoo.step(model), backend=_recording(graphs, via))
        losses, grads = _train(model, compiled)

    assert counters["cce_compile"]["rewritten"] == 1, dict(counters["cce_compile"])
    (call,) = _op_calls(graphs)
    assert (call.grad_hidden, call.grad_classifier, call.grad_bias) == (True, False, False)
    eager_losses, eager_grads = eager_run
    for step, (got, want) in enumerate(zip(losses, eager_losses)):
        assert rel_error(got, want) <= RTOL, (step, losses, eager_losses)
    for step, (got, want) in enumerate(zip(grads, eager_grads)):
        assert got.keys() == want.keys() and len(got) == 4  # A and B of q_proj and v_proj
        for name in got:
            assert rel_error(got[name], want[name]) <= RTOL, (step, name)


def test_merged_model_evaluates_fused():
    model = _lora()
    merged = model.merge_and_unload()  # adapters folded into q_proj / v_proj: a plain model
    assert not any("lora" in name for name, _ in merged.named_parameters())
    merged.eval()

    def evaluate(ids, labels):
        with torch.no_grad():
            return merged(input_ids=ids, labels=labels).loss

    outcome = check(evaluate, hf_zoo.batch())  # the loss equals eager's
    assert outcome.rewritten == 1
    (call,) = _op_calls(outcome.graphs)
    assert not (call.grad_hidden or call.grad_classifier or call.grad_bias)


def _checkpointed_lora():
    model = _lora()
    # transformers' own call (TrainingArguments(activation_checkpointing=True) makes it too);
    # on a model with frozen embeddings it adds a hook that calls requires_grad_() on the
    # embeddings' output, which Dynamo cannot trace.
    model.activation_checkpointing_enable()  # PeftModel hands it to the base model
    return model


@pytest.mark.slow
def test_lora_with_activation_checkpointing_and_the_input_grads_hook():
    """What docs/stacks.md says: the hook cuts the graph, so the frame holding head and loss
    returns its logits; the default CCE_ESCAPING_LOGITS=drop fuses that training loss (a
    placeholder leaves the frame in the logits' place) and the adapter gradients are eager's;
    explain() shows the break. Under =keep the site is left alone.

    Two traces of this model, not three (each costs ~15 s of CPU: the hook's break splits
    the checkpointed layer into ~25 frames): watch() reports the compile that check() makes,
    and the break is the same under either setting, so the =keep explain() shows it."""
    model = _checkpointed_lora()
    with cce_compile.watch() as compiled:
        outcome = check(
            hf_zoo.step(model), hf_zoo.batch(), parameters=model.parameters(), fullgraph=False
        )
    assert outcome.rewritten == 1 and outcome.gradients == 4
    (site,) = compiled.sites
    assert site.rewritten and site.logits == "dropped", str(compiled)
    with config.override(escaping_logits="keep"):
        report = cce_compile.explain(hf_zoo.step(model), *hf_zoo.batch())
    (kept,) = report.sites
    assert not kept.rewritten and kept.reason == "logits_escape", str(report)
    assert any("make_inputs_require_grads" in b.location for b in report.breaks), str(report)


def test_lora_with_activation_checkpointing_fuses_without_the_input_grads_hook():
    """Non-reentrant checkpointing (transformers' default) does not need the hook; without it
    the loss is fused and the adapter gradients are eager's."""
    model = _checkpointed_lora()
    model.disable_input_require_grads()
    outcome = check(
        hf_zoo.step(model), hf_zoo.batch(), parameters=model.parameters(), fullgraph=False
    )
    assert outcome.rewritten == 1 and outcome.gradients == 4


def test_lora_on_the_head_is_left_alone_with_the_reason():
    """lm_head in target_modules: the logits are the frozen head's plus the adapter's low-rank
    term (a sum of two linears), which the op does not compute; explain() says so."""
    base = hf_zoo.tiny("llama")
    adapters = peft.LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_dropout=0.0, target_modules=["q_proj", "lm_head"]
    )
    model = peft.get_peft_model(base, adapters)
    report = cce_compile.explain(hf_zoo.step(model), *hf_zoo.batch())
    (site,) = report.sites
    assert not site.rewritten and site.reason == "unsupported_op_in_chain", str(report)
    assert "target_modules" in site.advice and "modules_to_save" in site.advice


def test_lora_with_a_fully_trained_head_is_fused():
    """modules_to_save=["lm_head"]: PEFT trains a copy of the head in full, a plain linear."""
    base = hf_zoo.tiny("llama")
    adapters = peft.LoraConfig(
        task_type="CAUSAL_LM", r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]
    )
    model = peft.get_peft_model(base, adapters)
    assert model.get_output_embeddings().weight.requires_grad
    outcome = check(hf_zoo.step(model), hf_zoo.batch(), parameters=model.parameters())
    assert outcome.rewritten == 1
    (call,) = _op_calls(outcome.graphs)
    assert call.grad_classifier
