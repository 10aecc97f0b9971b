"""Hugging Face's Trainer, as people run it: the loss is fused, the losses are eager's.

Trainer compiles the whole model (``torch_compile=True``), whose output carries the logits, so
these runs set CCE_ESCAPING_LOGITS=drop. ``torch_compile_backend="cce"`` cannot work:
accelerate checks the name against its fixed ``DynamoBackend`` enum before torch sees it
(``ValueError: 'CCE' is not a valid DynamoBackend``). The two paths that work:

* ``cce_compile.enable()`` (or ``CCE_COMPILE=1``) with ``torch_compile=True``: Trainer's
  Inductor compile gets the pass through Inductor's hook;
* ``model.compile(backend="cce")`` before ``Trainer(...)`` (``torch_compile`` left off):
  accelerate leaves a compiled module alone.
"""

from __future__ import annotations

import pytest
import torch
from harness import hook_enabled
from oracle import COMPILED_VS_EAGER_RTOL

import cce_compile
from cce_compile import config

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


def _train(model, tmp_path, **arguments) -> list[float]:
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
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Windows())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _check(losses, eager):
    assert len(losses) == len(eager) == STEPS
    # The rest of the model is compiled by Inductor, whose float32 kernels round differently.
    rtol = COMPILED_VS_EAGER_RTOL[torch.float32]
    for got, want in zip(losses, eager):
        assert abs(got - want) <= rtol * abs(want) + 1e-6, (losses, eager)


@pytest.fixture
def eager_losses(tmp_path):
    return _train(hf_zoo.tiny("llama"), tmp_path / "eager")


@pytest.mark.slow
def test_trainer_torch_compile_with_enable(tmp_path, eager_losses):
    torch._dynamo.reset()
    with (
        hook_enabled(),
        config.override(escaping_logits="drop"),
        cce_compile.watch() as report,
    ):
        losses = _train(hf_zoo.tiny("llama"), tmp_path / "compiled", torch_compile=True)
    assert len(report.rewritten) >= 1 and all(s.logits == "dropped" for s in report.rewritten)
    _check(losses, eager_losses)


@pytest.mark.slow
def test_trainer_with_a_model_compiled_by_the_cce_backend(tmp_path, eager_losses):
    torch._dynamo.reset()
    model = hf_zoo.tiny("llama")
    model.compile(backend="cce")
    with config.override(escaping_logits="drop"), cce_compile.watch() as report:
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
    with (
        hook_enabled(),
        config.override(escaping_logits="drop"),
        cce_compile.watch() as report,
    ):
        losses = _train(_lora(), tmp_path / "compiled", torch_compile=True)
    assert len(report.rewritten) >= 1 and all(s.logits == "dropped" for s in report.rewritten)
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
