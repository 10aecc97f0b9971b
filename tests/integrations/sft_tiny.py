"""A tiny SFTTrainer run on CPU with nothing downloaded: a word-level tokenizer built in memory,
an in-memory prompt-completion dataset (completion-only loss), a 1-layer Llama from a config.
``train(...)`` returns what the trainer logged at each step."""

from __future__ import annotations

import logging
import random
import tempfile
import warnings

import torch

WORDS = (
    "the a of to and in is it that for on with as was be by at this are from or an have not "
    "they which one you were all we when there can more if out so up said what its about into"
).split()
SPECIAL = ["<pad>", "<eos>", "<unk>"]
LOGGED = ("loss", "entropy", "mean_token_accuracy", "grad_norm")


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(SPECIAL + WORDS)}
    inner = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def dataset(count: int = 24, seed: int = 0):
    from datasets import Dataset

    rng = random.Random(seed)
    rows = {"prompt": [], "completion": []}
    for _ in range(count):
        rows["prompt"].append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))))
        # Completions from 3 words, so that a few steps move the top-1 metric off 0.
        rows["completion"].append(
            " " + " ".join(rng.choice(WORDS[:3]) for _ in range(rng.randint(2, 10)))
        )
    return Dataset.from_dict(rows)


def model(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        # One layer: the head needs hidden states, not depth, and Dynamo's and AOTAutograd's
        # time in the compiled test grows with layers (CPU: 21-24 s for one, 31 s for two).
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def train(
    *,
    packing: bool,
    torch_compile: bool = False,
    compile_backend: str = "inductor",
    steps: int = 3,
    model_backend=None,
) -> list[dict]:
    """SFTTrainer, float32 (``bf16=False``: SFTConfig's default is bf16 autocast), completion
    loss only; per logged step the values in LOGGED. ``model_backend``: the model is compiled
    with it (``model.compile(backend=...)``) before SFTTrainer gets it."""
    from trl import SFTConfig, SFTTrainer

    tok = tokenizer()
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("transformers").setLevel(logging.ERROR)
        args = SFTConfig(
            output_dir=out,
            use_cpu=True,
            bf16=False,
            max_steps=steps,
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            seed=0,
            dataloader_num_workers=0,
            disable_tqdm=True,
            completion_only_loss=True,
            packing=packing,
            max_length=64,
            torch_compile=torch_compile,
            torch_compile_backend=compile_backend if torch_compile else None,
        )
        built = model(len(tok))
        if model_backend is not None:
            built.compile(backend=model_backend)
        trainer = SFTTrainer(model=built, args=args, train_dataset=dataset(), processing_class=tok)
        trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return [{key: float(entry[key]) for key in LOGGED} for entry in logged]
