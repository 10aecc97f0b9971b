"""Hugging Face's Trainer, as people run it, with no setting: the loss is fused, the losses are
eager's.

Trainer compiles the whole model (``torch_compile=True``), whose output carries the logits: the
default CCE_ESCAPING_LOGITS=drop fuses the training loss and returns a placeholder for the
logits, which Trainer's training loop never reads; its evaluation keeps the real logits. Label
smoothing and ``compute_loss_func`` take the labels away from the model, whose graph then holds
no loss: nothing is fused and the Trainer's own loss is exact. ``torch_compile_backend="cce"``
cannot work:
accelerate checks the name against its fixed ``DynamoBackend`` enum before torch sees it
(``ValueError: 'CCE' is not a valid DynamoBackend``). The two paths that work:

* ``cce_compile.enable()`` (or ``CCE_COMPILE=1``) with ``torch_compile=True``: Trainer's
  Inductor compile gets the pass through Inductor's hook;
* ``model.compile(backend="cce")`` before ``Trainer(...)`` (``torch_compile`` left off):
  accelerate leaves a compiled module alone.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from harness import hook_enabled, inductor_without_codegen
from oracle import COMPILED_VS_EAGER_RTOL, rel_error
from torch._dynamo.backends.debugging import aot_eager

import cce_compile
from cce_compile.passes.graph_pass import run_on_module
from cce_compile.passes.placeholder import LogitsNotComputed

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import hf_zoo  # noqa: E402  (needs transformers)

STEPS = 3


class _Windows(torch.utils.data.Dataset):
    def __init__(self, count=12, length=16):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, hf_zoo.VOCAB, (count, length), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def _trainer(model, tmp_path, trainer_kwargs=(), **arguments):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        **arguments,
    )
    return transformers.Trainer(
        model=model, args=args, train_dataset=_Windows(), **dict(trainer_kwargs)
    )


def _train(model, tmp_path, trainer_kwargs=(), **arguments) -> list[float]:
    trainer = _trainer(model, tmp_path, trainer_kwargs, **arguments)
    trainer.train()
    return _losses(trainer)


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def cce_eager(gm, example_inputs):
    """The pass, then AOTAutograd without Inductor: what the cce backend rewrites, compiled
    in a fraction of Inductor's time (for tests about the rewrite, not about Inductor)."""
    run_on_module(gm)
    return aot_eager(gm, example_inputs)


def _check(losses, eager):
    assert len(losses) == len(eager) == STEPS
    # The rest of the model is compiled by Inductor, whose float32 kernels round differently.
    rtol = COMPILED_VS_EAGER_RTOL[torch.float32]
    for got, want in zip(losses, eager):
        assert abs(got - want) <= rtol * abs(want) + 1e-6, (losses, eager)


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory):
    return _train(hf_zoo.tiny("llama"), tmp_path_factory.mktemp("eager"))


# Trainer's Inductor compiles run without Inductor's code generation (the routes and the losses
# are under test; tests/test_backend.py and test_models.py compile the op with Inductor's code).
@pytest.mark.slow
def test_trainer_torch_compile_with_enable(tmp_path, eager_losses):
    torch._dynamo.reset()
    with hook_enabled(), inductor_without_codegen(), cce_compile.watch() as report:
        # CCE_COMPILE=1, nothing else
        losses = _train(hf_zoo.tiny("llama"), tmp_path / "compiled", torch_compile=True)
    assert len(report.rewritten) >= 1 and all(s.logits == "dropped" for s in report.rewritten)
    _check(losses, eager_losses)


@pytest.mark.slow
def test_trainer_with_a_model_compiled_by_the_cce_backend(tmp_path, eager_losses):
    torch._dynamo.reset()
    model = hf_zoo.tiny("llama")
    model.compile(backend="cce")
    with inductor_without_codegen(), cce_compile.watch() as report:
        losses = _train(model, tmp_path / "compiled")
    assert len(report.rewritten) >= 1 and all(s.logits == "dropped" for s in report.rewritten)
    _check(losses, eager_losses)


def _lora():
    peft = pytest.importorskip("peft")
    adapters = peft.LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]
    )
    return peft.get_peft_model(hf_zoo.tiny("llama"), adapters)


@pytest.mark.slow
def test_trainer_with_a_lora_model(tmp_path):
    """PEFT's usual route: a LoRA model handed to Trainer, as the other tests' model is."""
    eager = _train(_lora(), tmp_path / "eager")
    torch._dynamo.reset()
    with hook_enabled(), inductor_without_codegen(), cce_compile.watch() as report:
        losses = _train(_lora(), tmp_path / "compiled", torch_compile=True)
    assert len(report.rewritten) >= 1 and all(s.logits == "dropped" for s in report.rewritten)
    _check(losses, eager)


def test_trainer_evaluation_keeps_its_logits_without_a_warning(tmp_path, caplog):
    """The same compiled model trains (its logits: a placeholder) and predicts (no gradient:
    the real logits, what ``compute_metrics`` reads), and nothing is said at WARNING."""
    torch._dynamo.reset()
    model = hf_zoo.tiny("llama")
    model.compile(backend=cce_eager)
    trainer = _trainer(model, tmp_path)
    with cce_compile.watch() as report, caplog.at_level(logging.INFO, logger="cce_compile"):
        trainer.train()
        predicted = trainer.predict(_Windows(count=4))
    training, evaluation = report.rewritten, [s for s in report.sites if not s.rewritten]
    assert training and all(s.logits == "dropped" for s in training)
    assert evaluation and all(s.reason == "logits_escape" and s.quiet for s in evaluation)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "cce" in r.name]
    ids = _Windows(count=4).ids
    with torch.no_grad():
        want = model.forward(input_ids=ids).logits  # the module's own, uncompiled forward
    got = torch.as_tensor(predicted.predictions)
    assert not isinstance(got, LogitsNotComputed) and got.shape == want.shape
    assert rel_error(got, want) <= COMPILED_VS_EAGER_RTOL[torch.float32]


def _causal_loss(outputs, labels, num_items_in_batch=None):
    logits = outputs.logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(logits, labels[:, 1:].flatten(), ignore_index=-100)


# Losses the Trainer computes from the logits the model returns: it pops the labels first.
FROM_LOGITS = {
    "label-smoothing": ({}, {"label_smoothing_factor": 0.1}),
    "compute-loss-func": ({"compute_loss_func": _causal_loss}, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("trainer_kwargs, arguments", FROM_LOGITS.values(), ids=FROM_LOGITS)
def test_losses_the_trainer_computes_from_the_logits_are_left_to_it(
    tmp_path, trainer_kwargs, arguments
):
    """The model gets no labels, so its graph has no loss: nothing for the pass to fuse or
    drop (its logits are returned whole) and the Trainer's loss is eager's."""
    eager = _train(hf_zoo.tiny("llama"), tmp_path / "eager", trainer_kwargs, **arguments)
    torch._dynamo.reset()
    model = hf_zoo.tiny("llama")
    model.compile(backend=cce_eager)
    with cce_compile.watch() as report:
        losses = _train(model, tmp_path / "compiled", trainer_kwargs, **arguments)
    assert report.graphs >= 1 and report.sites == []
    _check(losses, eager)


def test_trainer_rejects_the_backend_name(tmp_path):
    """accelerate's fixed enum: documented in the README, checked here so that the day it
    accepts the name, the README's advice is revisited."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        torch_compile=True,
        torch_compile_backend="cce",
    )
    with pytest.raises(ValueError, match="DynamoBackend"):
        transformers.Trainer(model=hf_zoo.tiny("llama"), args=args, train_dataset=_Windows())
