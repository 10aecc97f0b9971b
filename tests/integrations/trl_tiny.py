"""Tiny runs of TRL 1.16's DPO (and WPO), KTO, GRPO and RLOO trainers on CPU, nothing downloaded:
``sft_tiny``'s word-level tokenizer and 1-layer Llama, saved to a directory (the trainers build
their reference model from the policy's path, so both load the same weights), in-memory
datasets, float32 (the base configs' default ``bf16=True`` is bf16 autocast on CPU), no
gradient checkpointing. ``train(name, directory)`` returns what the trainer logged at each step
and every call of TRL's fused LM head kernel (``Recorded``).

The settings make each trainer make every kind of call it can:

* DPO: the policy asks for log-probs, entropy, mean_logits and is_top1 with gradients, the
  reference model for log-probs without; WPO (``use_weighting``) adds log_sum_sq_probs;
* KTO: the policy without gradients for the KL term, with them for the loss; the reference
  model for both;
* GRPO: ``num_iterations=2``, so the old log-probs come from a no-grad call (and step 2 reuses
  the generation with moved weights: ratios off 1, clipping), ``entropy_coef`` so the entropy
  takes a gradient (an entropy bonus), ``beta`` so there is a reference model and a KL term;
* RLOO: old log-probs always without gradients, a reference model (``beta``).

Optimizer SGD (COMMON says why); RL trainers with eager attention (RL says why).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import warnings

import sft_tiny
import torch

TRAINERS = ("dpo", "wpo", "kto", "grpo", "rloo")
STEPS = 2
COMMON = dict(
    use_cpu=True,
    bf16=False,
    max_steps=STEPS,
    per_device_train_batch_size=4,
    # SGD: Adam's first step moves every weight by about the learning rate times the sign of its
    # gradient, so the sign of a near-zero gradient, which rounding decides, would set a step-2
    # difference of 1e-4 between two kernels that agree to 1e-7.
    optim="sgd",
    learning_rate=1e-1,
    logging_steps=1,
    report_to=[],
    save_strategy="no",
    seed=0,
    dataloader_num_workers=0,
    disable_tqdm=True,
    gradient_checkpointing=False,
)
RL = dict(
    temperature=0.7,
    num_generations=2,
    max_completion_length=8,
    # Eager attention: torch's CPU SDPA gives a sequence other bits (up to 5e-7) at another
    # place in the batch, and GRPO and RLOO shuffle the generation batch between the old
    # log-probs and the new; the first step's ratio is exactly 1 only for a backbone that
    # does not (the head's part is tested on direct calls either way).
    model_init_kwargs={"attn_implementation": "eager"},
)


@dataclasses.dataclass
class Recorded:
    """One call of the fused head's kernel: grad mode, outputs asked for, inputs and what came
    back (detached copies)."""

    grad: bool
    outputs: tuple[str, ...]
    temperature: float
    hidden: torch.Tensor
    targets: torch.Tensor
    returned: tuple  # the 5-tuple, tensors detached, None where not asked for
    entropy_has_grad: bool


class Recording:
    """Stands in for ``trl.trainer.utils._ChunkedLogProbFunction`` around ``inner`` (TRL's
    function, or ours once installed), keeping each call in ``calls``."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[Recorded] = []

    def apply(self, hidden, weight, bias, targets, temperature, chunk, softcap, scale, outputs):
        out = self.inner.apply(
            hidden, weight, bias, targets, temperature, chunk, softcap, scale, outputs
        )
        self.calls.append(
            Recorded(
                grad=torch.is_grad_enabled(),
                outputs=tuple(outputs),
                temperature=temperature,
                hidden=hidden.detach().clone(),
                targets=targets.clone(),
                returned=tuple(None if x is None else x.detach().clone() for x in out),
                entropy_has_grad=out[1] is not None and out[1].requires_grad,
            )
        )
        return out


def saved_model(directory: str) -> str:
    """The tiny model and its tokenizer saved in ``directory`` (returned)."""
    tok = sft_tiny.tokenizer()
    model = sft_tiny.model(len(tok))
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def _text(rng: random.Random, low: int, high: int, words=sft_tiny.WORDS) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))


def _dataset(name: str, rows: int = 8):
    from datasets import Dataset

    rng = random.Random(0)
    prompts = [_text(rng, 2, 6) for _ in range(rows)]
    if name in ("dpo", "wpo"):
        chosen = [" " + _text(rng, 2, 6, sft_tiny.WORDS[:3]) for _ in range(rows)]
        rejected = [" " + _text(rng, 2, 6, sft_tiny.WORDS[:3]) for _ in range(rows)]
        return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})
    if name == "kto":
        completions = [" " + _text(rng, 2, 6, sft_tiny.WORDS[:3]) for _ in range(rows)]
        labels = [i % 2 == 0 for i in range(rows)]
        return Dataset.from_dict({"prompt": prompts, "completion": completions, "label": labels})
    return Dataset.from_dict({"prompt": prompts})


def reward_length(completions, **kwargs) -> list[float]:
    """A toy reward: the completion's length in words."""
    return [float(len(completion.split())) for completion in completions]


def trainer(name: str, model_path: str, out: str):
    """The trainer ``name`` (one of TRAINERS) over the saved model, writing nothing to ``out``."""
    import trl

    tok = sft_tiny.tokenizer()
    data = dict(train_dataset=_dataset(name), processing_class=tok)
    if name in ("dpo", "wpo"):
        args = trl.DPOConfig(output_dir=out, max_length=32, use_weighting=name == "wpo", **COMMON)
        return trl.DPOTrainer(model=model_path, args=args, **data)
    if name == "kto":  # the KL term needs batches of more than one (the config's default)
        args = trl.KTOConfig(output_dir=out, max_length=32, **COMMON)
        return trl.KTOTrainer(model=model_path, args=args, **data)
    if name == "grpo":
        # entropy_coef: with 0.01 a bonus without gradient moved the grad norm by only 3e-5
        options = dict(num_iterations=2, entropy_coef=0.1, beta=0.04)
        args = trl.GRPOConfig(output_dir=out, **RL, **options, **COMMON)
        return trl.GRPOTrainer(model=model_path, reward_funcs=reward_length, args=args, **data)
    if name == "rloo":
        args = trl.RLOOConfig(output_dir=out, beta=0.05, **RL, **COMMON)
        return trl.RLOOTrainer(model=model_path, reward_funcs=reward_length, args=args, **data)
    raise ValueError(f"unknown trainer {name!r}; one of {TRAINERS}")


@dataclasses.dataclass
class Run:
    logs: list[dict]  # per step: every number the trainer logged
    calls: list[Recorded]


def train(name: str, model_path: str, out: str) -> Run:
    """Train ``name`` for STEPS steps, recording the fused head's calls."""
    import trl.trainer.utils as trl_utils

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("transformers").setLevel(logging.ERROR)
        built = trainer(name, model_path, out)
        recording = Recording(trl_utils._ChunkedLogProbFunction)
        trl_utils._ChunkedLogProbFunction = recording
        try:
            built.train()
        finally:
            trl_utils._ChunkedLogProbFunction = recording.inner
    logs = [
        {key: float(value) for key, value in entry.items() if isinstance(value, (int, float))}
        for entry in built.state.log_history
        if "loss" in entry
    ]
    return Run(logs, recording.calls)
