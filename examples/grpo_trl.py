"""TRL's GRPOTrainer with cce_compile's op under its fused LM head: policy, old and reference
log-probs and a differentiable entropy bonus, without the logits.

    python examples/grpo_trl.py                        # tiny random Llama on CPU, < 1 min
    python examples/grpo_trl.py --device cuda --bf16   # GRPOConfig's default AMP (bf16)

TRL 1.16's trainers never build the logits: their fused head calls TRL's own chunked kernel, so
the graph pass has nothing to rewrite. ``cce_compile.integrations.trl.install()`` puts the op
under every call of it (docs/trl.md): the policy's with gradients, the old log-probs' and the
reference model's without, all one kernel, so the first step's KL is exactly 0 and, with a
batch-order-independent backbone, the importance ratio exactly 1. Nothing is downloaded: the
tokenizer, the prompts and the model are built here, and the reward counts a word.
"""

from __future__ import annotations

import argparse
import random
import tempfile

from sft_trl import WORDS, build_model, build_tokenizer


def reward_the(completions, **kwargs) -> list[float]:
    """A toy reward: how often the completion says 'the'."""
    return [float(completion.split().count("the")) for completion in completions]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--bf16", action="store_true", help="GRPOConfig's default bf16 autocast")
    parser.add_argument("--entropy-coef", type=float, default=0.01, help="entropy bonus")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from cce_compile.integrations import trl as cce_trl

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # Activation checkpointing off (TRL's default is on), under transformers 5's name where it
    # has it: the old name, gradient_checkpointing, is reported as deprecated there.
    no_checkpointing = (
        {"activation_checkpointing": False}
        if hasattr(GRPOConfig, "activation_checkpointing")
        else {"gradient_checkpointing": False}
    )
    rng = random.Random(0)
    prompts = [" ".join(rng.choices(WORDS, k=rng.randint(3, 8))) for _ in range(32)]
    cce_trl.install()  # before or after building the trainer; raises if TRL is not 1.16.x
    with tempfile.TemporaryDirectory() as directory:
        # TRL builds the reference model from the policy's path: save the random model there.
        tokenizer = build_tokenizer()
        model = build_model(len(tokenizer))
        for config in (model.config, model.generation_config):
            config.pad_token_id = tokenizer.pad_token_id
            config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        config = GRPOConfig(
            output_dir=directory,
            use_cpu=device == "cpu",
            bf16=args.bf16,
            max_steps=args.steps,
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=16,
            temperature=0.9,
            num_iterations=2,  # old log-probs from a call without gradients
            entropy_coef=args.entropy_coef,  # the entropy takes a gradient
            beta=0.04,  # a reference model and a KL term
            learning_rate=1e-2,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            **no_checkpointing,
        )
        trainer = GRPOTrainer(
            model=directory,
            reward_funcs=reward_the,
            processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            args=config,
        )
        trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            shown = ("loss", "reward", "entropy", "kl", "clip_ratio/region_mean")
            print({key: entry[key] for key in shown if key in entry})
    # Every call served by the op (policy, old, reference), none handed to TRL's kernel.
    print("cce_compile.integrations.trl:", cce_trl.counts())
    cce_trl.uninstall()


if __name__ == "__main__":
    main()
