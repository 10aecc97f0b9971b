"""The host's time before fast mode's first GEMM: what the GPU waits through at a call's start.

Times one warm forward+backward of ``cce_compile.linear_cross_entropy(mode="fast")`` on the host
(no profiler): from the call to compaction's selection (``compaction.select``), the selection
itself, from it to the first ``logits_exp`` launch, and the wait for the count of kept rows.
Until that launch the GPU has nothing large to run: in a benchmark of the loss alone, or after
a host synchronisation in a model, that host time is GPU idle. Before bdc59b7 the selection
was the synchronisation (``nonzero``); since, fast mode's selection queues a kept-first order
and the wait comes after the first GEMM's launch (``KeptRows.count``: "count wait").

    python bench/host_prework.py --shapes E,G
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path += [str(pathlib.Path(__file__).resolve().parents[i]) for i in (0, 1)]
from bench import Scenario, loss_step  # noqa: E402
from cce_compile.implementations import interface, triton_fast  # noqa: E402
from cce_compile.op import compaction  # noqa: E402

MARKS: dict = {}


def _timed(module, name: str, key: str) -> None:
    """Record when ``module.name`` is first entered and left in a step under ``key``."""
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        entered = time.perf_counter()
        result = real(*args, **kwargs)
        MARKS.setdefault(key, (entered, time.perf_counter()))
        return result

    setattr(module, name, wrapper)


def measure(name: str, skip_ignored: bool, reps: int) -> dict:
    step, _ = loss_step(name, Scenario.parse("bf16"), "fast", skip_ignored=skip_ignored)
    for _ in range(3):
        step()
    parts = {"to_select": [], "select": [], "select_to_gemm": [], "count_wait": []}
    parts.update(host=[], wall=[])
    for _ in range(reps):
        MARKS.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        host = time.perf_counter()
        torch.cuda.synchronize()
        wall = time.perf_counter()
        sel_in, sel_out = MARKS.get("select", (start, start))
        parts["to_select"].append(sel_in - start)
        parts["select"].append(sel_out - sel_in)
        parts["select_to_gemm"].append(MARKS["gemm"][0] - sel_out)
        wait_in, wait_out = MARKS.get("count", (start, start))
        parts["count_wait"].append(wait_out - wait_in)
        parts["host"].append(host - start)
        parts["wall"].append(wall - start)
    return {k: 1e3 * statistics.median(v) for k, v in parts.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="E,G")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    _timed(triton_fast, "logits_exp", "gemm")
    _timed(compaction, "select", "select")
    _timed(interface.KeptRows, "count", "count")
    print(f"GPU: {torch.cuda.get_device_name()} · torch {torch.__version__}")
    columns = "to select | select | select to 1st GEMM | count wait | host | wall"
    print(f"| shape | skip_ignored | {columns} |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        for skip in (True, False):
            r = measure(name, skip, args.reps)
            cells = " | ".join(f"{r[k]:.2f}" for k in r)
            print(f"| {name} | {skip} | {cells} |")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("host_prework.py needs a CUDA GPU")
    main()
