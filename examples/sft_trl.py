"""TRL's SFTTrainer with cce_compile's op under its fused LM head.

    python examples/sft_trl.py                        # tiny random Llama on CPU, ~10 s
    python examples/sft_trl.py --device cuda --bf16   # SFTConfig's default AMP (bf16)

TRL 1.16's trainers never build the logits: their fused head calls TRL's own chunked kernel, so
the graph pass has nothing to rewrite. ``cce_compile.integrations.trl.install()`` puts the op
under that call (opt-in; it refuses any TRL but 1.16.x). With ``bf16=False`` the logged numbers
equal TRL's own run; under bf16 AMP they differ slightly: the op keeps float32 logits where TRL
rounds them to bf16 (docs/trl.md). Nothing is downloaded: the tokenizer, the data and the model
are built here.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used, so that --help answers at once
    from datasets import Dataset
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = "the a of to and in is it that for on with as was be by at this are from".split()


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over WORDS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    inner = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def build_dataset(rows: int = 64) -> Dataset:
    """Prompt-completion pairs; completions use 3 words, so the loss visibly falls."""
    from datasets import Dataset

    rng = random.Random(0)

    def text(choices, shortest, longest):
        return " ".join(rng.choices(choices, k=rng.randint(shortest, longest)))

    return Dataset.from_dict(
        {
            "prompt": [text(WORDS, 3, 12) for _ in range(rows)],
            "completion": [" " + text(WORDS[:3], 2, 10) for _ in range(rows)],
        }
    )


def build_model(vocab_size: int) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights, from a config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bf16", action="store_true", help="SFTConfig's default bf16 autocast")
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--torch-compile", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import torch
    from trl import SFTConfig, SFTTrainer

    from cce_compile.integrations import trl as cce_trl

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = build_tokenizer()
    # TRL turns activation checkpointing on by default, under transformers' old name
    # (gradient_checkpointing), which transformers 5 reports as deprecated: the new name, where
    # transformers has it, keeps the same run without the FutureWarning.
    renamed = (
        {"activation_checkpointing": True} if hasattr(SFTConfig, "activation_checkpointing") else {}
    )
    cce_trl.install()  # before or after building the trainer; raises if TRL is not 1.16.x
    with tempfile.TemporaryDirectory() as output_dir:
        config = SFTConfig(
            output_dir=output_dir,
            use_cpu=device == "cpu",
            bf16=args.bf16,
            max_steps=args.steps,
            per_device_train_batch_size=8,
            learning_rate=1e-2,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            completion_only_loss=True,  # the prompt's tokens are masked (-100)
            packing=args.packing,
            max_length=64,
            torch_compile=args.torch_compile,
            **renamed,
        )
        trainer = SFTTrainer(
            model=build_model(len(tokenizer)),
            processing_class=tokenizer,
            train_dataset=build_dataset(),
            args=config,
        )
        trainer.train()
    # Calls the op served, and calls handed to TRL's own function (none for SFT), with why.
    print("cce_compile.integrations.trl:", cce_trl.counts())
    cce_trl.uninstall()


if __name__ == "__main__":
    main()
