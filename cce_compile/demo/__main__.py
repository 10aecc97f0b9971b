"""``python -m cce_compile.demo``: train a small LM twice, with and without cce_compile.

python -m cce_compile.demo                      # CPU: about a minute on 2 cores, vocabulary 32K
python -m cce_compile.demo --arch gla --control # GLA, and torch.compile against itself as control
python -m cce_compile.demo --max-batch          # GPU: largest batch per run, throughput

The two runs train side by side, one step of each in turn (the order swapped every step), from
the same initial weights on the same batches; only the backend differs. Speed is the median of
per-block tokens/s ratios with its spread, compilation and warm-up excluded. Step 0 compares
losses and gradients; later steps show how far the runs drift apart, and --control shows how
far torch.compile drifts from itself after a last-bit change to the initial weights.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

import torch

from .. import config as cce_config
from . import corpus, report
from .models import ModelConfig
from .train import WARM_STEPS, RunConfig, compare, max_batch

# The first steps' compiles, as the banner says them: on a CPU, most of a first run's time.
COMPILE_TIME = {
    "cpu": "tens of seconds on 2 cores with a cold Inductor cache, a few seconds warm",
    "cuda": "up to ~60 s each",
}
# The CPU defaults keep `make demo` within two minutes from nothing on 2 cores. The first
# compile is most of it, and one block compiles about a third faster than two; the head is 95%
# of a one-block step's multiply-adds at V 32K, D 128 (90% with two), so the comparison holds.
# 16 steps give 7 timed blocks (a step of both runs: ~1 s; 20 steps, 9 blocks, kept the first
# run ~4 s over two minutes). The CPU's corpus is the first 8 MB of the stdlib: 2.9M tokens, a
# full 32K vocabulary, tokenised in a quarter of the time of all 30 MB.
DEFAULTS = {  # (vocab, dim, layers, heads, context, batch, steps)
    "cpu": (32768, 128, 1, 4, 128, 8, 16),
    "cuda": (131072, 512, 4, 8, 1024, 16, 300),
}
CORPUS_BYTES = {"cpu": 8_000_000, "cuda": None}  # None: all of it


def _progress(steps: int, tokens_per_step: int):
    start = time.perf_counter()

    def show(step: int, runs) -> None:
        if step % max(1, steps // 20) and step != steps - 1:
            return
        parts = []
        for run in runs[:2]:  # the control, when there is one, is neither timed nor shown
            rate, _ = run.tokens_per_s(tokens_per_step)
            speed = "    warm-up" if math.isnan(rate) else f"{rate:7,.0f} tok/s"
            parts.append(f"{run.name} {run.losses[-1]:7.4f} {speed}")
        bar = "#" * int(20 * (step + 1) / steps)
        print(
            f"\r  [{bar:20s}] {step + 1:4d}/{steps}  "
            + "  ".join(parts)
            + f"  {time.perf_counter() - start:6.1f}s",
            end="",
            flush=True,
        )
        if step == steps - 1:
            print()

    return show


def parse(argv) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The demo's options, every one described (``--help``)."""
    cpu, gpu = DEFAULTS["cpu"], DEFAULTS["cuda"]

    def default(index: int) -> str:
        return f"default: {cpu[index]:,} on the CPU, {gpu[index]:,} on a GPU"

    parser = argparse.ArgumentParser(
        prog="python -m cce_compile.demo",
        description=__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # one example per line
    )
    _model_options(parser.add_argument_group("model and training"), default)
    _measure_options(parser.add_argument_group("measurements"))
    _file_options(parser.add_argument_group("files"))
    return parser


def _model_options(model, default) -> None:
    """The model's and the training run's options; ``default(i)``: DEFAULTS' i-th, as help."""
    model.add_argument(
        "--arch",
        choices=["gpt", "gla"],
        default="gpt",
        help="gpt: nanoGPT-style attention; gla: gated linear attention, where the loss layer "
        "is a larger share of the step (default: gpt)",
    )
    model.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: the GPU when torch sees one, else the CPU (default: auto)",
    )
    model.add_argument("--vocab", type=int, help=f"vocabulary size, the loss's V ({default(0)})")
    model.add_argument("--dim", type=int, help=f"model width, the loss's D ({default(1)})")
    model.add_argument("--layers", type=int, help=f"transformer blocks ({default(2)})")
    model.add_argument("--heads", type=int, help=f"attention heads per block ({default(3)})")
    model.add_argument("--context", type=int, help=f"tokens per sequence ({default(4)})")
    model.add_argument("--batch", type=int, help=f"sequences per step ({default(5)})")
    model.add_argument(
        "--steps",
        type=int,
        help=f"training steps of each run, the first {WARM_STEPS} untimed ({default(6)})",
    )
    model.add_argument(
        "--lr", type=float, default=6e-4, help="peak learning rate of AdamW (default: 6e-4)"
    )
    model.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the initial weights and the batches' order, the same for every run "
        "(default: 0)",
    )
    model.add_argument(
        "--mode",
        choices=cce_config.MODES,
        default=None,
        help="the op's mode for the cce_compile run: lean recomputes in the backward, fast "
        "computes gradients in the forward, auto picks (default: CCE_MODE, else auto)",
    )
    model.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch's intra-op CPU threads for every run (default: torch's own choice, one "
        "per core; 1 can help where other work shares the cores)",
    )


def _measure_options(measure) -> None:
    measure.add_argument(
        "--control",
        action="store_true",
        help="also train torch.compile from initial weights moved by one float32 ulp, to show "
        "how far rounding alone makes training drift (costs a third run's steps, not timed)",
    )
    measure.add_argument(
        "--max-batch",
        action="store_true",
        help="GPU: also find the largest batch that fits for each run, and its tokens/s",
    )
    measure.add_argument(
        "--max-batch-limit",
        type=int,
        default=512,
        help="the largest batch --max-batch tries (default: 512)",
    )


def _file_options(files) -> None:
    files.add_argument(
        "--corpus-bytes",
        type=int,
        default=None,
        help="tokenize only the first N bytes of the stdlib (default: "
        f"{CORPUS_BYTES['cpu']:,} on the CPU, a full 32K vocabulary; all of it on a GPU)",
    )
    files.add_argument(
        "--cache-dir",
        type=pathlib.Path,
        default=pathlib.Path.home() / ".cache" / "cce_compile",
        help="where the tokenized corpus is cached (default: ~/.cache/cce_compile)",
    )
    files.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("demo_out"),
        help="where the results JSON and the SVG picture are written (default: ./demo_out)",
    )


def main(argv=None) -> int:
    args = parse(argv)
    changes = {"mode": args.mode} if args.mode else {}
    threads = torch.get_num_threads()
    try:
        if args.threads:
            torch.set_num_threads(args.threads)
        with cce_config.override(**changes):  # restored afterwards: tests call main() in-process
            return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    device = _device(args.device)
    if device is None:
        return 2
    cfg = _run_config(args, device)
    model_cfg = cfg.model
    corpus_bytes = args.corpus_bytes if args.corpus_bytes is not None else CORPUS_BYTES[device]
    part = "" if corpus_bytes is None else f"the first {corpus_bytes:,} bytes of "
    print(
        f"Corpus: {part}the standard library of Python {sys.version.split()[0]} "
        f"({len(corpus.stdlib_files())} files), vocabulary {model_cfg.vocab:,}"
    )
    _, ids = corpus.load(model_cfg.vocab, args.cache_dir, corpus_bytes)
    print(f"  {ids.numel():,} tokens (cached in {args.cache_dir})")
    print(
        f"Model: {args.arch.upper()} dim {model_cfg.dim}, {model_cfg.layers} "
        f"layer{'s' if model_cfg.layers != 1 else ''}, context "
        f"{model_cfg.context}; batch {cfg.batch}, {cfg.steps} steps, device {device}; "
        f"cce_compile mode {cce_config.get().mode!r}"
    )
    runs = "torch.compile and cce_compile" + (" (and the control)" if cfg.control else "")
    print(
        f"Training {runs} side by side, a step of each in turn; each compiles on its first "
        f"step ({COMPILE_TIME[device]}) ..."
    )
    tokens_per_step = cfg.batch * model_cfg.context
    comparison = compare(cfg, ids, progress=_progress(cfg.steps, tokens_per_step))
    if args.max_batch:
        _max_batches(args, cfg, comparison)
    _print_results(cfg, comparison)
    return _save(args, cfg, comparison)


def _device(asked: str) -> str | None:
    """The device the demo runs on (None: asked for a GPU that is not there), said."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if asked == "auto" else asked
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA GPU is visible to torch", file=sys.stderr)
        return None
    if device == "cpu":
        print(
            "No GPU: running on the CPU with the chunked PyTorch path (small defaults; peak "
            "memory is what torch allocates during one training step). On a GPU the Triton "
            "kernels run."
        )
        return device
    try:
        import triton  # noqa: F401
    except ImportError:
        print(
            "Triton is not installed: the op falls back to the PyTorch path on the GPU "
            "(correct but slow). pip install triton for the kernels."
        )
    return device


def _run_config(args: argparse.Namespace, device: str) -> RunConfig:
    """The runs' configuration: the options given, the device's defaults for the rest."""
    vocab, dim, layers, heads, context, batch, steps = DEFAULTS[device]
    model_cfg = ModelConfig(
        vocab=args.vocab or vocab,
        dim=args.dim or dim,
        layers=args.layers or layers,
        heads=args.heads or heads,
        context=args.context or context,
    )
    return RunConfig(
        arch=args.arch,
        model=model_cfg,
        batch=args.batch or batch,
        steps=args.steps or steps,
        lr=args.lr,
        seed=args.seed,
        device=device,
        control=args.control,
    )


def _max_batches(args: argparse.Namespace, cfg: RunConfig, comparison) -> None:
    """--max-batch: each run's largest batch that fits, and its tokens/s (GPU only)."""
    if cfg.device != "cuda":
        print("--max-batch needs a GPU; skipped")
        return
    for run, use_cce in ((comparison.baseline, False), (comparison.fused, True)):
        run.max_batch, run.max_batch_tokens_per_s = max_batch(
            cfg,
            use_cce,
            cfg.batch,
            limit=args.max_batch_limit,
            report=lambda batch, rate, name=run.name: print(
                f"  {name:14s} batch {batch:5d}: "
                + (f"{rate:11,.0f} tok/s" if rate else "out of memory"),
                flush=True,
            ),
        )


def _print_results(cfg: RunConfig, comparison) -> None:
    """The table, the speed and the exactness, as the reader sees them."""
    baseline, fused = comparison.baseline, comparison.fused
    logits_dtype = cfg.autocast_dtype or torch.float32
    tokens_per_step = cfg.batch * cfg.model.context
    logits_mib = tokens_per_step * cfg.model.vocab * logits_dtype.itemsize / 2**20
    print()
    print(report.table(baseline, fused, logits_mib if fused.rewritten_sites else None))
    print()
    print(report.speed_text(comparison))
    print(report.exactness_text(comparison))
    if cfg.device == "cpu":
        print(report.CPU_NOTE)


def _save(args: argparse.Namespace, cfg: RunConfig, comparison) -> int:
    """The results JSON and the picture, under --out."""
    model_cfg, device = cfg.model, cfg.device
    meta = {
        "arch": args.arch,
        "vocab": model_cfg.vocab,
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "torch": torch.__version__,
        "settings": vars(cce_config.get()),
        "max_batch_limit": args.max_batch_limit if args.max_batch else None,
        "config": vars(model_cfg) | {"batch": cfg.batch, "steps": cfg.steps},
    }
    picture = report.save(args.out, meta, comparison)
    print(f"\nWrote {args.out / f'demo_{args.arch}.json'}")
    print(f"Picture: {picture}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
