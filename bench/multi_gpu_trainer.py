"""A transformers Trainer script with nothing of cce_compile in it, timed, for ``accelerate
launch`` on several GPUs (``bench/multi_gpu.py`` launches it: FSDP2 or DDP, each with
``torch_compile=True``, with ``CCE_COMPILE=1`` and without)::

    CCE_COMPILE=1 accelerate launch --multi_gpu --num_processes 2 --mixed_precision bf16 \\
        bench/multi_gpu_trainer.py OUT/fused-ddp

A Llama (``--hidden`` 1024, ``--layers`` 2, Llama 3's vocabulary V 128256) trained from seed 0
on windows of tokens drawn from a Zipf law, the same batches in every run, losses logged every
step. Each rank writes ``OUT/rank<r>.json``: the losses Trainer logged, each step's seconds
(CUDA-synchronised at the step's start and end) and peak memory allocated (reset at each step's
start), the tokens of a step on this rank, what the graph pass counted in
``torch._dynamo.utils.counters["cce_compile"]`` (empty when it never ran: how a run shows it
was fused) and how the model was wrapped.

``--cpu-smoke``: ``use_cpu`` and toy sizes, for 2 gloo ranks without GPUs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import numpy as np
import torch
import transformers
from torch._dynamo.utils import counters

WARMUP_STEPS = 5  # steps left out of the medians (the first compiles)


class ZipfWindows(torch.utils.data.Dataset):
    """``count`` windows of ``length`` token ids drawn from a Zipf law (s = 1.1) over the
    vocabulary, seed 0; labels are the ids (the model shifts them)."""

    def __init__(self, count: int, length: int, vocab: int):
        weights = 1.0 / np.arange(1, vocab + 1) ** 1.1
        rng = np.random.default_rng(0)
        drawn = rng.choice(vocab, size=(count, length), p=weights / weights.sum())
        self.ids = torch.from_numpy(drawn).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class StepRecorder(transformers.TrainerCallback):
    """Each step's seconds and peak memory allocated on this rank."""

    def __init__(self):
        self.seconds: list[float] = []
        self.peaks: list[int] = []
        self._began = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._began)
        self.peaks.append(torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0)


def parse_args() -> argparse.Namespace:
    """The command line; ``--cpu-smoke`` replaces the sizes with toy ones."""
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--no-compile", action="store_true", help="torch_compile=False")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--cpu-smoke", action="store_true")
    cli = parser.parse_args()
    if cli.cpu_smoke:
        cli.steps, cli.batch, cli.seq_len, cli.vocab, cli.hidden = 6, 2, 32, 1001, 64
    return cli


def build_model(cli) -> transformers.LlamaForCausalLM:
    """The Llama of the command line's sizes (heads of 128, at least 4), seed 0."""
    heads = max(cli.hidden // 128, 4)
    config = transformers.LlamaConfig(
        vocab_size=cli.vocab,
        hidden_size=cli.hidden,
        intermediate_size=cli.hidden * 11 // 4,
        num_hidden_layers=cli.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=cli.hidden // heads,
        max_position_embeddings=cli.seq_len,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def training_arguments(cli) -> transformers.TrainingArguments:
    """Constant learning rate, a log every step, no checkpoints; bf16 on GPUs, float32 on the
    CPU; ``torch_compile`` unless ``--no-compile``."""
    return transformers.TrainingArguments(
        output_dir=str(cli.out / "trainer"),
        use_cpu=cli.cpu_smoke,
        bf16=not cli.cpu_smoke,
        max_steps=cli.steps,
        per_device_train_batch_size=cli.batch,
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        torch_compile=not cli.no_compile,
    )


def rank_report(cli, args, trainer, recorder: StepRecorder) -> dict:
    """What this rank writes: the logged losses, the pass's counters, the steps' seconds and
    peak memory (medians and peaks past the warm-up) and how the model was wrapped."""
    timed = recorder.seconds[WARMUP_STEPS:] or recorder.seconds
    step_s = statistics.median(timed)
    tokens = cli.batch * cli.seq_len
    return {
        "rank": args.process_index,
        "world": args.world_size,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "cce_compile": dict(counters["cce_compile"]),
        "step_seconds": recorder.seconds,
        "step_s": step_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "peak_gib": max(recorder.peaks[WARMUP_STEPS:] or recorder.peaks) / 2**30,
        # (DDP or the FSDP2 class under torch.compile's OptimizedModule)
        "wrapped": type(
            getattr(trainer.model_wrapped, "_orig_mod", trainer.model_wrapped)
        ).__name__,
        # FSDP2: accelerate's [norm, lm_head] unit, or lm_head in the root (cce_compile's layout)
        "lm_head_own_fsdp_unit": _own_fsdp_unit(trainer.model.get_output_embeddings()),
        "model": dict(
            vocab=cli.vocab,
            hidden=cli.hidden,
            layers=cli.layers,
            batch=cli.batch,
            seq_len=cli.seq_len,
        ),
    }


def main() -> None:
    cli = parse_args()
    model = build_model(cli)
    args = training_arguments(cli)
    recorder = StepRecorder()
    windows = ZipfWindows(cli.steps * cli.batch * args.world_size, cli.seq_len, cli.vocab)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=windows, callbacks=[recorder]
    )
    trainer.train()

    report = rank_report(cli, args, trainer, recorder)
    print(f"rank {report['rank']}: cce_compile counters {report['cce_compile']}", flush=True)
    cli.out.mkdir(parents=True, exist_ok=True)
    (cli.out / f"rank{args.process_index}.json").write_text(json.dumps(report))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _own_fsdp_unit(module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


if __name__ == "__main__":
    main()
