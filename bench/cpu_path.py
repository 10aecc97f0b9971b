"""The CPU path against torch.compile's CPU code: the loss alone and the demo's training step.

Everything runs in one process and interleaved (A, B, C, A, B, C, ...), so that a busy machine
slows every method alike; the tables give the median and the spread (min-max) over the rounds.

* ``loss``: forward+backward of ``hidden @ W.T`` -> cross-entropy at the CPU demo's head (N
  1024 rows, D 128, V 32768, float32, 10% of targets ignored unless ``--ignored``): plain
  torch.compile (Inductor), the op in lean and in fast mode, and with ``--baseline REF`` the
  op with the torch_path.py of git revision REF (to measure a change in the same process; REF's
  functions must take ``interface.HeadInputs``, as this checkout's ``op.dispatch`` calls them).
* ``demo``: one training step of ``python -m cce_compile.demo``'s GPT (its CPU defaults):
  tokens/s and the peak memory of one step measured as the demo does (the profiler's memory
  timeline), torch.compile against cce_compile (and the baseline).

    python bench/cpu_path.py --out bench/results/cpu_path.md
    python bench/cpu_path.py --baseline main --rounds 15
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cce_compile  # noqa: E402
from cce_compile.demo.__main__ import DEFAULTS  # noqa: E402
from cce_compile.demo.models import ModelConfig, build  # noqa: E402
from cce_compile.demo.train import RunConfig, _make_step, batches, step_peak_bytes  # noqa: E402
from cce_compile.op import dispatch  # noqa: E402


def load_baseline(ref: str):
    """torch_path.py of git revision ``ref`` as a module of the package (relative imports)."""
    source = subprocess.run(
        ["git", "show", f"{ref}:cce_compile/implementations/torch_path.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    name = "cce_compile.implementations._torch_path_at_" + "".join(
        c if c.isalnum() else "_" for c in ref
    )
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__ = "cce_compile.implementations"
    sys.modules[name] = module  # dataclasses look their module up
    where = f"{ref}:cce_compile/implementations/torch_path.py"
    exec(compile(source, where, "exec"), module.__dict__)
    return module


@contextlib.contextmanager
def implementation(module):
    """Run the op with ``module`` as the CPU path (None: the checked-out torch_path)."""
    saved = dispatch.implementation_for
    if module is not None:
        dispatch.implementation_for = lambda device: module
    try:
        yield
    finally:
        dispatch.implementation_for = saved


def interleaved(
    methods: dict, rounds: int, warmup: int, clock=time.perf_counter
) -> dict[str, list[float]]:
    """Seconds per call of each method, the methods taking turns."""
    for fn in methods.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(rounds):
        for name, fn in methods.items():
            start = clock()
            fn()
            times[name].append(clock() - start)
    return times


def summary(seconds: list[float]) -> tuple[float, float, float]:
    ms = [1000 * s for s in seconds]
    return statistics.median(ms), min(ms), max(ms)


def loss_methods(args, baseline) -> tuple[dict, dict]:
    vocab, dim = args.vocab, args.dim
    rows = args.batch * args.context
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, dim, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[torch.rand(rows, generator=gen) < args.ignored] = -100

    def compiled_loss(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)

    compiled = torch.compile(compiled_loss, backend="inductor")

    def run(fn):
        def step():
            loss = fn()
            loss.backward()
            hidden.grad = weight.grad = None

        return step

    def cce(mode, module=None):
        def fn():
            with implementation(module):
                return cce_compile.linear_cross_entropy(hidden, weight, targets, mode=mode)

        return fn

    methods = {"torch.compile": run(lambda: compiled(hidden, weight, targets))}
    methods["cce lean"] = run(cce("lean"))
    methods["cce fast"] = run(cce("fast"))
    if baseline is not None:
        methods[f"cce lean @{args.baseline}"] = run(cce("lean", baseline))
        methods[f"cce fast @{args.baseline}"] = run(cce("fast", baseline))
    memory = {name: step_peak_bytes(fn) for name, fn in methods.items()}
    return methods, memory


def demo_methods(args, baseline) -> tuple[dict, dict, int]:
    from cce_compile.demo import corpus

    vocab, dim, layers, heads, context, batch, _ = DEFAULTS["cpu"]
    cfg = RunConfig(
        arch="gpt",
        model=ModelConfig(vocab=vocab, dim=dim, layers=layers, heads=heads, context=context),
        batch=batch,
        steps=1,
        device="cpu",
    )
    _, ids = corpus.load(vocab, pathlib.Path.home() / ".cache" / "cce_compile", None)
    x, y = next(batches(ids, batch, context, 0, "cpu"))

    def make(use_cce: bool, module=None):
        torch.manual_seed(0)
        model = build("gpt", cfg.model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        compiled = _make_step(model, cfg, use_cce)

        def forward_backward():
            with implementation(module):
                compiled(x, y).backward()

        def step():  # as the demo's training loop times it
            with implementation(module):
                loss = compiled(x, y)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()

        return step, forward_backward, model

    methods, memory = {}, {}
    variants = {"torch.compile": (False, None), "cce_compile": (True, None)}
    if baseline is not None:
        variants[f"cce_compile @{args.baseline}"] = (True, baseline)
    for name, (use_cce, module) in variants.items():
        step, forward_backward, model = make(use_cce, module)
        step()  # compile
        memory[name] = step_peak_bytes(forward_backward)
        model.zero_grad(set_to_none=True)
        methods[name] = step
    return methods, memory, batch * context


def table(title: str, times: dict, memory: dict, reference: str, tokens: int | None) -> str:
    ref = statistics.median(times[reference])
    lines = [
        f"### {title}",
        "",
        "| method | median ms | min-max ms | vs "
        + reference
        + " | "
        + ("tokens/s | " if tokens else "")
        + "peak MiB |",
        "|---|---|---|---|" + ("---|" if tokens else "") + "---|",
    ]
    for name, seconds in times.items():
        med, low, high = summary(seconds)
        cells = [
            name,
            f"{med:.1f}",
            f"{low:.1f}-{high:.1f}",
            f"{ref / statistics.median(seconds):.3f}x",
        ]
        if tokens:
            cells.append(f"{tokens / (med / 1000):,.0f}")
        cells.append(f"{memory[name] / 2**20:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--what", choices=["loss", "demo", "both"], default="both")
    parser.add_argument("--baseline", help="git revision whose torch_path.py to compare with")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time (with --threads 1, immune to other work on the machine)",
    )
    parser.add_argument("--ignored", type=float, default=0.1)
    parser.add_argument("--vocab", type=int, default=DEFAULTS["cpu"][0])
    parser.add_argument("--dim", type=int, default=DEFAULTS["cpu"][1])
    parser.add_argument("--context", type=int, default=DEFAULTS["cpu"][4])
    parser.add_argument("--batch", type=int, default=DEFAULTS["cpu"][5])
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    baseline = load_baseline(args.baseline) if args.baseline else None
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    load = os.getloadavg()
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    sections = []
    if args.what in ("loss", "both"):
        methods, memory = loss_methods(args, baseline)
        times = interleaved(methods, args.rounds, args.warmup, clock)
        rows = args.batch * args.context
        sections.append(
            table(
                f"Loss forward+backward: N {rows} x D {args.dim} x V {args.vocab}, float32, "
                f"{args.ignored:.0%} ignored",
                times,
                memory,
                "torch.compile",
                None,
            )
        )
    if args.what in ("demo", "both"):
        methods, memory, tokens = demo_methods(args, baseline)
        times = interleaved(methods, args.rounds, args.warmup, clock)
        sections.append(
            table("Demo training step (GPT, CPU defaults)", times, memory, "torch.compile", tokens)
        )
    header = (
        f"torch {torch.__version__}, {cpu}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, {args.clock} clock; "
        f"{args.rounds} interleaved rounds after {args.warmup} warm-up; "
        f"load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    text = header + "\n\n" + "\n\n".join(sections) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
