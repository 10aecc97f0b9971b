"""A plain transformers Trainer script, with nothing of cce_compile in it (for
test_accelerate_launch.py). On a CPU-only machine, two gloo ranks:

    CCE_COMPILE=1 CCE_ESCAPING_LOGITS=drop \\
        accelerate launch --multi_gpu --num_processes 2 trainer_script.py OUT --torch-compile

trains a model eagerly, then (``--torch-compile``) the same model from the same seed with
``torch_compile=True``, each with its own Trainer on the same batches. Each rank writes
OUT/rank<r>.json: the world size and, per run, the losses Trainer logged and what the graph
pass counted in ``torch._dynamo.utils.counters`` during that run (empty when the pass never
ran). That report is the test's observation; the training above it is what a user's script
does. ``--inductor-without-codegen`` stops Inductor before its code generation (the test's
choice: tests/fresh_process.py, which must be importable).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
import transformers
from torch._dynamo.utils import counters

VOCAB = 97


class Windows(torch.utils.data.Dataset):
    def __init__(self, count: int = 16, length: int = 16):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, VOCAB, (count, length), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def train(out: pathlib.Path, steps: int, torch_compile: bool) -> tuple[dict, dict]:
    """One Trainer run from seed 0: (its report, the arguments' rank and world)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    args = transformers.TrainingArguments(
        output_dir=str(out / "trainer"),
        use_cpu=True,
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        torch_compile=torch_compile,
    )
    counters.clear()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Windows())
    trainer.train()
    report = {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "cce_compile": dict(counters["cce_compile"]),
    }
    return report, {"rank": args.process_index, "world": args.world_size}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--torch-compile", action="store_true")
    parser.add_argument("--inductor-without-codegen", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    cli = parser.parse_args()
    if cli.inductor_without_codegen:
        import fresh_process

        fresh_process.install_inductor_without_codegen()

    eager, where = train(cli.out, cli.steps, torch_compile=False)
    report = {**where, "eager": eager}
    if cli.torch_compile:
        report["compiled"], _ = train(cli.out, cli.steps, torch_compile=True)
    cli.out.mkdir(parents=True, exist_ok=True)
    (cli.out / f"rank{where['rank']}.json").write_text(json.dumps(report))
    # Leave the process group before exiting: a rank that exits with gloo's threads still
    # running can abort in teardown ("terminate called without an active exception"), which
    # a CI run under load hit once.
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
