"""Where a mode spends its time beyond its GEMMs: a kernel-level profile of one step on one GPU.

Runs forward+backward of ``cce_compile.linear_cross_entropy`` (``--mode``, default lean) under
``torch.profiler`` and sorts every CUDA kernel into our Triton kernels, cuBLAS GEMMs and the
rest (elementwise, reductions, copies), with their share of the step. The floor of lean mode is
four GEMMs (the forward's, the recompute, d hidden, d classifier), of fast mode three; the bare
``hidden @ classifier.T`` matmul, timed alone, is the unit.

    python bench/profile_lean.py --shapes B,C --out bench/results/profile
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import sys
import time

import torch

sys.path += [str(pathlib.Path(__file__).resolve().parents[i]) for i in (0, 1)]
from bench import (  # noqa: E402
    SHAPES,
    Scenario,
    cuda_time_ms,
    environment,
    loss_step,
    save_results,
)

# Our Triton kernels: one per module of cce_compile/kernels, named _<module>_kernel (a fixed
# list had missed the fused GEMM's _logits_exp_kernel and _scaled_exp_grad_kernel).
KERNELS = pathlib.Path(__file__).resolve().parents[1] / "cce_compile" / "kernels"
NOT_KERNELS = ("__init__", "common")
OURS = tuple(f"_{p.stem}_kernel" for p in KERNELS.glob("*.py") if p.stem not in NOT_KERNELS)
GEMM = ("gemm", "xmma", "cutlass", "nvjet", "sm90", "ampere_bf16", "cublas")


def category(name: str) -> str:
    lowered = name.lower()
    if any(k in lowered for k in OURS):
        return "triton (ours)"
    if any(k in lowered for k in GEMM):
        return "GEMM (cuBLAS)"
    return "other"


def profile_shape(name: str, scenario: Scenario, mode: str, steps: int) -> dict:
    n, d, v = SHAPES[name]
    step, (hidden, classifier) = loss_step(name, scenario, mode)
    matmul_ms = cuda_time_ms(lambda: hidden.bfloat16() @ classifier.bfloat16().T, 10, 3)[0]
    step_ms = cuda_time_ms(step, 10, 3)[0]
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        total_ms = event.device_time_total / 1e3 / steps
        if total_ms <= 0:
            continue
        kernels[event.key][0] += event.count // steps
        kernels[event.key][1] += total_ms
    by_category = collections.defaultdict(float)
    for key, (_, ms) in kernels.items():
        by_category[category(key)] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:20]
    wall_ms = _wall_ms(step)
    return {
        "wall_ms": wall_ms,
        "host_ops": _host_ops(step, steps),
        "shape": name,
        "scenario": scenario.name,
        "mode": mode,
        "N": n,
        "D": d,
        "V": v,
        "matmul_ms": matmul_ms,
        "step_ms": step_ms,
        "kernel_ms": sum(ms for _, ms in kernels.values()),
        "by_category": dict(by_category),
        "kernels": [
            {"name": k[:120], "calls": c, "ms": ms, "category": category(k)} for k, (c, ms) in top
        ],
    }


def _wall_ms(step, reps: int = 10) -> float:
    """Median wall-clock time of a synchronised step: launch overhead included."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _host_ops(step, steps: int, top: int = 15) -> list[dict]:
    """Where the host spends a step (Python and kernel launches), by cProfile's own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = [
        {
            "name": f"{pathlib.Path(file).name}:{line}:{func}"[-80:],
            "calls": calls // steps,
            "self_ms": own / steps * 1e3,
            "total_ms": total / steps * 1e3,
        }
        for (file, line, func), (_, calls, own, total, _) in stats.items()
    ]
    return sorted(rows, key=lambda r: -r["self_ms"])[:top]


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [f"GPU: {env['gpu']} · torch {env['torch']} · triton {env['triton']}", ""]
    for r in results["profiles"]:
        unit = r["matmul_ms"]
        lines += [
            f"### {r['shape']} ({r['scenario']}, {r['mode']}): N={r['N']} D={r['D']} V={r['V']}",
            "",
            f"step {r['step_ms']:.2f} ms = {r['step_ms'] / unit:.2f} matmuls "
            f"(matmul {unit:.2f} ms); kernels {r['kernel_ms']:.2f} ms "
            f"(the rest of the step is launch gaps); wall {r['wall_ms']:.2f} ms synchronised",
            "",
            "| category | ms | x matmul | share of kernels |",
            "|---|---|---|---|",
        ]
        for cat, ms in sorted(r["by_category"].items(), key=lambda kv: -kv[1]):
            share = ms / r["kernel_ms"]
            lines.append(f"| {cat} | {ms:.2f} | {ms / unit:.2f} | {share:.1%} |")
        lines += ["", "| kernel | calls/step | ms/step | category |", "|---|---|---|---|"]
        for k in r["kernels"]:
            lines.append(f"| `{k['name']}` | {k['calls']} | {k['ms']:.3f} | {k['category']} |")
        lines += ["", "| host function | calls/step | own ms | total ms |", "|---|---|---|---|"]
        for op in r["host_ops"]:
            lines.append(
                f"| `{op['name']}` | {op['calls']} | {op['self_ms']:.3f} | {op['total_ms']:.3f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="B,C")
    parser.add_argument("--scenarios", default="bf16")
    parser.add_argument("--mode", default="lean")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="bench/results/profile")
    args = parser.parse_args(argv)
    results = {"environment": environment(), "profiles": []}
    for scenario in map(Scenario.parse, args.scenarios.split(",")):
        for name in args.shapes.split(","):
            for mode in args.mode.split(","):
                results["profiles"].append(profile_shape(name, scenario, mode, args.steps))
                torch.cuda.empty_cache()
    save_results(pathlib.Path(args.out), "profile", results, markdown(results))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("profile_lean.py needs a CUDA GPU")
    main()
