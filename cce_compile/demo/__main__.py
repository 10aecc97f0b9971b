"""``python -m cce_compile.demo``: train a small LM twice, with and without cce_compile.

python -m cce_compile.demo                      # CPU: ~1 minute on 2 idle cores, vocabulary 32K
python -m cce_compile.demo --arch gla           # gated linear attention instead of GPT
python -m cce_compile.demo --max-batch          # GPU: largest batch per run, throughput
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

from .. import config as cce_config
from . import corpus, report
from .models import ModelConfig
from .train import RunConfig, max_batch, train

COMPILE_SECONDS = {"cpu": 15, "cuda": 60}  # the first step's compile at most, measured (README)
DEFAULTS = {  # (vocab, dim, layers, heads, context, batch, steps)
    "cpu": (32768, 128, 2, 4, 128, 8, 40),
    "cuda": (131072, 512, 4, 8, 1024, 16, 300),
}


def _progress(name: str, steps: int):
    start = time.perf_counter()

    def show(step: int, loss: float, rate: float, memory: float | None) -> None:
        if step % max(1, steps // 20) and step != steps - 1:
            return
        mem = f"  mem {memory:.2f} GiB" if memory is not None else ""
        bar = "#" * int(30 * (step + 1) / steps)
        print(
            f"\r  {name:14s} [{bar:30s}] {step + 1:4d}/{steps}  loss {loss:7.4f}  "
            f"{rate:9,.0f} tok/s{mem}  {time.perf_counter() - start:6.1f}s",
            end="",
            flush=True,
        )
        if step == steps - 1:
            print()

    return show


def parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m cce_compile.demo",
        description=__doc__.replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,  # one example per line
    )
    parser.add_argument("--arch", choices=["gpt", "gla"], default="gpt")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--dim", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--context", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mode",
        choices=cce_config.MODES,
        default=None,
        help="the op's mode for the cce_compile run (default: CCE_MODE, else 'auto')",
    )
    parser.add_argument(
        "--max-batch",
        action="store_true",
        help="GPU: find the largest batch that fits for each run",
    )
    parser.add_argument(
        "--max-batch-limit", type=int, default=512, help="stop the --max-batch search here"
    )
    parser.add_argument(
        "--corpus-bytes",
        type=int,
        default=None,
        help="use only the first N bytes of the stdlib (faster first run)",
    )
    parser.add_argument(
        "--cache-dir", type=pathlib.Path, default=pathlib.Path.home() / ".cache" / "cce_compile"
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("demo_out"))
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    changes = {"mode": args.mode} if args.mode else {}
    with cce_config.override(**changes):  # restored afterwards: tests call main() in-process
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA GPU is visible to torch", file=sys.stderr)
        return 2
    if device == "cpu":
        print(
            "No GPU: running on the CPU with the chunked PyTorch path (small defaults; peak "
            "memory is what torch allocates during one training step). On a GPU the Triton "
            "kernels run."
        )
    else:
        try:
            import triton  # noqa: F401
        except ImportError:
            print(
                "Triton is not installed: the op falls back to the PyTorch path on the GPU "
                "(correct but slow). pip install triton for the kernels."
            )
    vocab, dim, layers, heads, context, batch, steps = DEFAULTS[device]
    model_cfg = ModelConfig(
        vocab=args.vocab or vocab,
        dim=args.dim or dim,
        layers=args.layers or layers,
        heads=args.heads or heads,
        context=args.context or context,
    )
    cfg = RunConfig(
        arch=args.arch,
        model=model_cfg,
        batch=args.batch or batch,
        steps=args.steps or steps,
        lr=args.lr,
        seed=args.seed,
        device=device,
    )

    print(
        f"Corpus: the standard library of Python {sys.version.split()[0]} "
        f"({len(corpus.stdlib_files())} files), vocabulary {model_cfg.vocab:,}"
    )
    _, ids = corpus.load(model_cfg.vocab, args.cache_dir, args.corpus_bytes)
    print(f"  {ids.numel():,} tokens (cached in {args.cache_dir})")
    print(
        f"Model: {args.arch.upper()} dim {model_cfg.dim}, {model_cfg.layers} layers, context "
        f"{model_cfg.context}; batch {cfg.batch}, {cfg.steps} steps, device {device}; "
        f"cce_compile mode {cce_config.get().mode!r}"
    )

    runs = []
    for name, use_cce in (("torch.compile", False), ("cce_compile", True)):
        wait = COMPILE_SECONDS[device]
        print(f"  {name:14s} compiling (the first step takes up to ~{wait} s) ...")
        runs.append(train(cfg, ids, use_cce=use_cce, progress=_progress(name, cfg.steps)))
    baseline, fused = runs
    if args.max_batch:
        if device != "cuda":
            print("--max-batch needs a GPU; skipped")
        else:
            for run, use_cce in ((baseline, False), (fused, True)):
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
    tokens_per_step = cfg.batch * model_cfg.context
    logits_dtype = cfg.autocast_dtype or torch.float32
    logits_mib = tokens_per_step * model_cfg.vocab * logits_dtype.itemsize / 2**20
    print()
    print(report.table(baseline, fused, logits_mib if fused.rewritten_sites else None))
    if device == "cpu":
        print(report.CPU_NOTE)
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
    report.save(args.out, meta, baseline, fused)
    print(f"\nWrote {args.out / f'demo_{args.arch}.json'} and the PNG beside it.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
