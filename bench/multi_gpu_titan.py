"""torchtitan's own trainer with and without cce_compile's fused loss, on several GPUs (NCCL).

Run under torchrun, one process per GPU (``bench/multi_gpu.py`` does)::

    torchrun --standalone --nproc-per-node 2 bench/multi_gpu_titan.py --out OUT --workdir W

torchtitan 0.2.x only (the release for torch 2.11: 0.3.x needs torch >= 2.12). A debug Llama
(torchtitan's ``debugmodel``: dim 256, 6 layers, 16 heads) with Llama 3's vocabulary, V 128256,
on a synthetic corpus: a word-level tokenizer of ``--vocab-words`` tokens and documents drawn
from a Zipf law over them (written under ``--workdir``; nothing is downloaded). For each layout
(``fsdp2``: FSDP2 over every GPU; ``tp2``: tensor parallel 2, loss_parallel, no FSDP, so
torchtitan trains in float32; ``fsdp2xtp2``: 2 x 2 on 4 GPUs) three runs from the same seed:

* ``unfused``: torchtitan's ``llama3`` and its own loss;
* ``fused``: the recipe, ``--experimental.custom_import cce_compile.integrations.torchtitan
  --model.name llama3_cce``;
* ``unfused_ulp``: ``llama3`` with every initial weight moved one unit in the last place
  (``nextafter`` towards +inf): how far torchtitan drifts from itself, the yardstick for the
  fused curve's distance.

The runs share one process per rank (torchtitan's Trainer, built, trained and closed in turn;
torchtitan keeps the process group of the first): the start-up is paid once. Each step's loss
and grad norm come from torchtitan's metrics (logged every step), its time from the host
(the step ends in ``.item()`` of the loss and grad norm), and the peak memory allocated per
rank and step from the CUDA allocator before torchtitan's log resets it. The fused runs must
log ``cce_compile: torchtitan loss fused`` (``fused_logged``).

``--cpu-smoke``: the same on gloo and CPU at toy sizes (tests/integrations/titan_cpu_train.py's
patches), to check the script without GPUs.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# layout -> torchtitan 0.2 flags (data_parallel_shard_degree -1: every GPU left over).
LAYOUTS = {
    "fsdp2": ("--parallelism.data_parallel_shard_degree", "-1"),
    "tp2": (
        "--parallelism.tensor_parallel_degree", "2",
        "--parallelism.data_parallel_shard_degree", "1",
    ),
    "fsdp2xtp2": (
        "--parallelism.tensor_parallel_degree", "2",
        "--parallelism.data_parallel_shard_degree", "2",
    ),
}  # fmt: skip
LAYOUT_GPUS = {"fsdp2": 2, "tp2": 2, "fsdp2xtp2": 4}
VARIANTS = ("unfused", "fused", "unfused_ulp")
FUSED_FLAGS = (
    "--experimental.custom_import", "cce_compile.integrations.torchtitan",
    "--model.name", "llama3_cce",
)  # fmt: skip
FLAVOR = "debugmodel_v128k"
FUSED_LOG_LINE = "cce_compile: torchtitan loss fused"
SPECIALS = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>"]
WARMUP_STEPS = 5  # steps left out of the medians (the first allocates, later ones settle)


def write_assets(workdir: pathlib.Path, words: int, tokens: int, seed: int = 0) -> None:
    """A word-level tokenizer of ``words`` tokens (Llama 3's special-token names) and a
    c4_test-style JSON-lines corpus of about ``tokens`` tokens (documents of 1024) drawn from a
    Zipf law (s = 1.1) over them, where torchtitan's ``c4_test`` and tokenizer loaders look
    (torchtitan's training data loops over it)."""
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers

    names = np.array([f"w{i}" for i in range(words)])
    weights = 1.0 / np.arange(1, words + 1) ** 1.1
    drawn = np.random.default_rng(seed).choice(words, size=tokens, p=weights / weights.sum())
    data = workdir / "tests/assets/c4_test"
    tokenizer_dir = workdir / "tests/assets/tokenizer"
    data.mkdir(parents=True, exist_ok=True)
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    with (data / "data.json").open("w") as f:
        for start in range(0, tokens, 1024):
            f.write(json.dumps({"text": " ".join(names[drawn[start : start + 1024]])}) + "\n")
    vocab = {token: i for i, token in enumerate(SPECIALS + names.tolist())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tokenizer_dir / "tokenizer.json"))
    special = {"bos_token": SPECIALS[1], "eos_token": SPECIALS[2], "unk_token": SPECIALS[0]}
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(special))


def register(vocab: int, dim: int, layers: int, heads: int) -> None:
    """The flavor ``FLAVOR`` of llama3 (shared by llama3_cce, whose spec holds the same model
    arguments) and the spec ``llama3_ulp``: llama3 with its initial weights moved one ulp."""
    import torch
    from torch.distributed.tensor import DTensor
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args
    from torchtitan.protocols import train_spec as specs

    llama3_args[FLAVOR] = TransformerModelArgs(
        dim=dim, n_layers=layers, n_heads=heads, vocab_size=vocab, rope_theta=500000
    )
    if "llama3_ulp" in specs._extra_train_specs:
        return
    spec = specs.get_train_spec("llama3")

    def init_weights(self, *args, **kwargs):
        spec.model_cls.init_weights(self, *args, **kwargs)
        with torch.no_grad():
            for parameter in self.parameters():
                local = parameter._local_tensor if isinstance(parameter, DTensor) else parameter
                local.copy_(torch.nextafter(local, torch.full_like(local, math.inf)))

    nudged = type("UlpTransformer", (spec.model_cls,), {"init_weights": init_weights})
    import dataclasses

    specs.register_train_spec("llama3_ulp", dataclasses.replace(spec, model_cls=nudged))


def trainer_flags(args, layout: str, variant: str) -> list[str]:
    flags = [
        "--job.dump_folder", str(args.workdir / "outputs"),
        "--model.name", "llama3_ulp" if variant == "unfused_ulp" else "llama3",
        "--model.flavor", FLAVOR,
        "--model.hf_assets_path", str(args.workdir / "tests/assets/tokenizer"),
        "--training.dataset", "c4_test",
        "--training.dataset_path", str(args.workdir / "tests/assets/c4_test"),
        "--training.local_batch_size", str(args.local_batch),
        "--training.seq_len", str(args.seq_len),
        "--training.steps", str(args.steps),
        "--training.max_norm", "1.0",
        "--optimizer.lr", "8e-4",
        "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_freq", "1",
        "--metrics.disable_color_printing",
        "--checkpoint.no-enable",
        "--validation.no-enable",
        "--compile.no-enable",
        "--debug.seed", "0",
        *LAYOUTS[layout],
    ]  # fmt: skip
    if args.cpu_smoke:
        flags += ["--training.mixed_precision_param", "float32"]
    if variant == "fused":
        flags += FUSED_FLAGS  # (the later --model.name wins)
    return flags


class _FusedLogSeen(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.seen = False

    def emit(self, record):
        self.seen = self.seen or FUSED_LOG_LINE in record.getMessage()


def run_one(args, layout: str, variant: str) -> dict:
    """One torchtitan run: per step loss, grad norm, seconds and this rank's peak memory."""
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.train import Trainer

    handler = _FusedLogSeen()
    logging.getLogger("cce_compile").addHandler(handler)
    logging.getLogger("cce_compile").setLevel(logging.INFO)
    steps: list[dict] = []
    config = ConfigManager().parse_args(trainer_flags(args, layout, variant))
    trainer = Trainer(config)
    metrics = trainer.metrics_processor
    log_metrics, train_step = metrics.log, trainer.train_step

    def log(step, loss, max_loss, grad_norm, *rest, **kw):
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        steps.append(dict(step=step, loss=float(loss), grad_norm=float(grad_norm), peak=peak))
        return log_metrics(step, loss, max_loss, grad_norm, *rest, **kw)

    seconds: list[float] = []

    def timed_step(data_iterator):
        began = time.perf_counter()
        train_step(data_iterator)
        seconds.append(time.perf_counter() - began)

    metrics.log, trainer.train_step = log, timed_step
    began = time.perf_counter()
    try:
        trainer.train()
    finally:
        trainer.close()
        logging.getLogger("cce_compile").removeHandler(handler)
    wall = time.perf_counter() - began
    for record, took in zip(steps, seconds):
        record["seconds"] = took
    timed = steps[WARMUP_STEPS:] or steps
    step_s = statistics.median(r["seconds"] for r in timed)
    return dict(
        layout=layout,
        variant=variant,
        steps=steps,
        wall_s=wall,
        step_s=step_s,
        tokens_per_s=args.local_batch * args.seq_len / step_s,
        peak_gib=max(r["peak"] for r in timed) / 2**30,
        fused_logged=handler.seen,
    )


def compare(runs: dict) -> dict:
    """Per layout: the largest and mean |loss difference| of fused and of unfused_ulp against
    unfused over the steps (the ulp run's is the yardstick)."""

    def distance(a, b):
        diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(a["steps"], b["steps"])]
        if not diffs:
            return None
        return dict(max=max(diffs), mean=sum(diffs) / len(diffs), steps=len(diffs))

    out = {}
    for layout in {layout for layout, _ in runs}:
        base = runs.get((layout, "unfused"))
        if base is None:
            continue
        out[layout] = {
            variant: distance(runs[(layout, variant)], base)
            for variant in ("fused", "unfused_ulp")
            if (layout, variant) in runs
        }
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; ``--cpu-smoke`` replaces the sizes with toy ones."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--workdir", type=pathlib.Path, required=True)
    parser.add_argument("--layouts", default="auto", help="comma-separated, or auto (by GPUs)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--local-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--vocab-words", type=int, default=128000)
    parser.add_argument("--corpus-tokens", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU, toy sizes")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.steps, args.local_batch, args.seq_len = min(args.steps, 6), 2, 64
        args.vocab, args.vocab_words, args.dim, args.layers, args.heads = 1000, 900, 64, 2, 4
        args.corpus_tokens = 20_000
    return args


def run_all(args, layouts: list[str]) -> tuple[dict, dict]:
    """Every variant of every layout in turn, all ranks together: ({(layout, variant): run},
    {"layout/variant": the error of a run that failed})."""
    import torch
    import torch.distributed as dist

    runs: dict = {}
    failures: dict = {}
    for layout in layouts:
        for variant in args.variants.split(","):
            if dist.is_initialized():
                dist.barrier()
            try:
                runs[(layout, variant)] = run_one(args, layout, variant)
            except Exception as exc:  # noqa: BLE001  (recorded; the other runs go on)
                failures[f"{layout}/{variant}"] = f"{type(exc).__name__}: {exc}"[-3000:]
            # The run's model, optimiser and (fused) FusedHead go before the next run is built:
            # the fused loss finds its head as the one live FusedHead.
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return runs, failures


def gather_ranks(runs: dict, failures: dict) -> list:
    """Every rank's runs and failures, in rank order (this rank's alone without a group)."""
    import torch.distributed as dist

    ranks = [None] * dist.get_world_size() if dist.is_initialized() else [None]
    mine = dict(runs=list(runs.values()), failures=failures)
    if dist.is_initialized():
        dist.all_gather_object(ranks, mine)
    else:
        ranks = [mine]
    return ranks


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.cpu_smoke:
        sys.path.insert(0, str(ROOT / "tests" / "integrations"))
        import titan_cpu_train  # noqa: F401  (makes torchtitan pick the CPU, before it loads)

        titan_cpu_train._patch()

    import torch
    import torch.distributed as dist
    import torchtitan
    from torchtitan.tools.logging import init_logger

    if not torchtitan.__version__.startswith("0.2."):
        raise SystemExit(f"multi_gpu_titan.py runs torchtitan 0.2.x, not {torchtitan.__version__}")
    import cce_compile.integrations.torchtitan  # noqa: F401  (registers llama3_cce)

    init_logger()
    register(args.vocab, args.dim, args.layers, args.heads)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    layouts = args.layouts.split(",")
    if args.layouts == "auto":  # (tp2 alone needs exactly 2 ranks: dp_shard 1 x tp 2)
        layouts = ["fsdp2", "tp2"] if world == 2 else ["fsdp2", "fsdp2xtp2"]
    # Each rank writes its own copy of the same files: no rank waits for another before the
    # first Trainer starts the process group.
    args.workdir = args.workdir / f"rank{rank}"
    write_assets(args.workdir, args.vocab_words, tokens=args.corpus_tokens)
    runs, failures = run_all(args, layouts)
    ranks = gather_ranks(runs, failures)
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        result = dict(
            torchtitan=torchtitan.__version__,
            torch=torch.__version__,
            world=world,
            flavor=dict(dim=args.dim, layers=args.layers, heads=args.heads, vocab=args.vocab),
            local_batch=args.local_batch,
            seq_len=args.seq_len,
            steps=args.steps,
            ranks=ranks,
            agreement=compare(runs),
        )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "titan.json").write_text(json.dumps(result, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
