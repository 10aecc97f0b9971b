"""Where the GPU waits on the host in one step: idle gaps between kernels, and what the host ran.

Runs forward+backward of ``cce_compile.linear_cross_entropy`` (``--mode``) under
``torch.profiler`` with Python stacks, then walks the GPU's timeline: every gap between two
kernels (or copies) longer than ``--min-gap-us`` is listed with the kernel after it, the
innermost ``cce_compile`` function that launched it, and the host's operators inside the gap.
A gap that ends when its kernel's launch call returns is the GPU waiting on the host.

    python bench/gpu_idle.py --shapes E,G --modes auto --out bench/results/gpu_idle
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import tempfile

import torch

sys.path += [str(pathlib.Path(__file__).resolve().parents[i]) for i in (0, 1)]
from bench import Scenario, environment, loss_step, save_results  # noqa: E402

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_step(name: str, scenario: Scenario, mode: str, skip_ignored: bool) -> list[dict]:
    """The chrome-trace events of one warm forward+backward step."""
    step, _ = loss_step(name, scenario, mode, skip_ignored=skip_ignored)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def _innermost(frames: list[dict], at: float) -> str:
    """The shortest cce_compile Python frame spanning host time ``at``."""
    spanning = [f for f in frames if f["ts"] <= at <= f["ts"] + f["dur"]]
    if not spanning:
        return "-"
    return min(spanning, key=lambda f: f["dur"])["name"][-70:]


def gaps(events: list[dict], min_gap_us: float) -> dict:
    """The GPU timeline's idle gaps and the host's work in each."""
    gpu = sorted(
        (e for e in events if e.get("cat") in GPU_CATEGORIES and e.get("ph") == "X"),
        key=lambda e: e["ts"],
    )
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    frames = [e for e in events if e.get("cat") == "python_function" and "cce_compile" in e["name"]]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    found, busy = [], 0.0
    for before, after in zip(gpu, gpu[1:]):
        busy += before["dur"]
        start, stop = before["ts"] + before["dur"], after["ts"]
        if stop - start < min_gap_us:
            continue
        launch = launches.get(after.get("args", {}).get("correlation"))
        launch_at = launch["ts"] if launch else stop
        inside = collections.Counter()
        for op in ops:
            overlap = min(op["ts"] + op["dur"], stop) - max(op["ts"], start)
            if overlap > 0:
                inside[op["name"]] += overlap
        found.append(
            {
                "gap_us": stop - start,
                "next": after["name"][:60],
                "launched_by": _innermost(frames, launch_at),
                "host_ops_us": dict(inside.most_common(4)),
            }
        )
    busy += gpu[-1]["dur"] if gpu else 0.0
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"] if gpu else 0.0
    return {"span_us": span, "busy_us": busy, "gaps": found}


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [f"GPU: {env['gpu']} · torch {env['torch']} · triton {env['triton']}", ""]
    for r in results["steps"]:
        idle = sum(g["gap_us"] for g in r["gaps"])
        lines += [
            f"### {r['shape']} ({r['scenario']}, mode {r['mode']}, skip_ignored "
            f"{r['skip_ignored']})",
            "",
            f"GPU span {r['span_us'] / 1e3:.2f} ms, kernels {r['busy_us'] / 1e3:.2f} ms, "
            f"{len(r['gaps'])} gaps over {r['min_gap_us']:.0f} us: {idle / 1e3:.2f} ms",
            "",
            "| gap us | next kernel | launched from | host ops in the gap (us) |",
            "|---|---|---|---|",
        ]
        for g in sorted(r["gaps"], key=lambda g: -g["gap_us"])[:15]:
            host = ", ".join(f"{k} {v:.0f}" for k, v in g["host_ops_us"].items())
            lines.append(f"| {g['gap_us']:.0f} | `{g['next']}` | `{g['launched_by']}` | {host} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="E")
    parser.add_argument("--scenarios", default="bf16")
    parser.add_argument("--modes", default="auto")
    parser.add_argument("--every-row", action="store_true", help="also skip_ignored=False")
    parser.add_argument("--min-gap-us", type=float, default=10.0)
    parser.add_argument("--out", default="bench/results/gpu_idle")
    args = parser.parse_args(argv)
    results = {"environment": environment(), "steps": []}
    skips = (True, False) if args.every_row else (True,)
    for scenario in map(Scenario.parse, args.scenarios.split(",")):
        for name in args.shapes.split(","):
            for mode in args.modes.split(","):
                for skip in skips:
                    events = trace_step(name, scenario, mode, skip)
                    found = gaps(events, args.min_gap_us)
                    results["steps"].append(
                        dict(
                            shape=name,
                            scenario=scenario.name,
                            mode=mode,
                            skip_ignored=skip,
                            min_gap_us=args.min_gap_us,
                            **found,
                        )
                    )
                    torch.cuda.empty_cache()
    save_results(pathlib.Path(args.out), "gpu_idle", results, markdown(results))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("gpu_idle.py needs a CUDA GPU")
    main()
