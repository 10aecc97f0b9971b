"""Where an end-to-end training step's time goes, kernel by kernel: torch.compile against cce.

Builds each variant exactly as ``e2e_llama.py`` does (same model, seed, autocast, fused AdamW,
compiled loss step), warms it up, then profiles ``--steps`` steps with ``torch.profiler`` (CUDA
and host operators, no Python stacks). For every variant it reports the GPU's time per step by
kernel family, the GPU's idle time inside the step (gaps between kernels, with the kernel after
each of the largest) and the heaviest kernels; then the per-family difference to ``compile``,
which is what a step's gap to compile is made of.

    python bench/e2e_profile.py --layers 16 --batch 4 --variants compile,cce --out out/e2e_profile
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
import e2e_llama  # noqa: E402

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# family -> substrings of kernel names, first match wins
FAMILIES = (
    (
        "cce (ours)",
        (
            "_logits_exp",
            "_scaled_exp_grad",
            "_lse_forward",
            "_logit_grad",
            "_chunk_softmax_grad",
            "_scale_cast",
            "_kept_first",
        ),
    ),
    ("attention", ("flash", "fmha", "attention", "sdpa")),  # before GEMM: cutlass / sm90_ names
    ("GEMM (cuBLAS)", ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "ampere_bf16", "cublas")),
    ("optimizer", ("multi_tensor", "adam", "fused_adam")),
    ("inductor (triton)", ("triton_",)),
    ("copies", ("memcpy", "memset", "copy_kernel", "cat_")),
)


def family(name: str) -> str:
    """The kernel family a kernel's name belongs to."""
    lowered = name.lower()
    for label, keys in FAMILIES:
        if any(k in lowered for k in keys):
            return label
    return "other (aten)"


def trace(train_step, first: int, steps: int) -> list[dict]:
    """The chrome-trace events of ``steps`` warm steps from step ``first``."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(steps):
            train_step(first + i).item()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def summarise(events: list[dict], steps: int, min_gap_us: float = 20.0) -> dict:
    """Per-step GPU time by family, idle gaps, and the heaviest kernels."""
    gpu = sorted(
        (e for e in events if e.get("cat") in GPU_CATEGORIES and e.get("ph") == "X"),
        key=lambda e: e["ts"],
    )
    by_family, by_kernel = collections.defaultdict(float), collections.defaultdict(lambda: [0, 0.0])
    for e in gpu:
        by_family[family(e["name"])] += e["dur"] / 1e3 / steps
        by_kernel[e["name"]][0] += 1
        by_kernel[e["name"]][1] += e["dur"] / 1e3 / steps
    gaps = []
    for before, after in zip(gpu, gpu[1:]):
        idle = after["ts"] - (before["ts"] + before["dur"])
        if idle >= min_gap_us:
            gaps.append((idle, after["name"][:70]))
    # The host's synchronisation between steps (``.item()``) is a gap too: leave the largest
    # ``steps - 1`` out, they are between the steps, not inside one.
    gaps.sort(reverse=True)
    inside = gaps[steps - 1 :]
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:25]
    return {
        "kernel_ms": sum(by_family.values()),
        "by_family": dict(by_family),
        "idle_ms": sum(g for g, _ in inside) / 1e3 / steps,
        "gaps": len(inside) / steps,
        "largest_gaps": [{"us": g, "next": name} for g, name in inside[:12]],
        "kernels": [
            {"name": k[:110], "calls": c // steps, "ms": ms, "family": family(k)}
            for k, (c, ms) in top
        ],
    }


def profile_variant(name: str, args) -> dict:
    """Warm the variant's step, time it as e2e_llama does, then profile it."""
    import cce_compile

    train_step, settings = e2e_llama._training(name, args)
    with cce_compile.config.override(**settings), e2e_llama.count_first(name):
        for i in range(args.warmup):
            train_step(i).item()
        times, _ = e2e_llama._timed(train_step, args.warmup, args.timed)
        events = trace(train_step, args.warmup + args.timed, args.steps)
    result = summarise(events, args.steps)
    result["step_ms"] = sorted(times)[len(times) // 2]
    return result


def markdown(results: dict, args) -> str:
    env = e2e_llama.environment()
    lines = [" · ".join(f"{k} {v}" for k, v in env.items()), ""]
    lines.append(
        f"HF Llama: {args.layers} layers, hidden {args.hidden}, V {args.vocab};"
        f" {args.batch} x {args.seq} tokens, labels {args.labels}, lora {args.lora};"
        f" bf16 autocast, fused AdamW; {args.steps}"
        f" profiled steps (median step ms from {args.timed} unprofiled steps)."
    )
    names = list(results)
    families = sorted({f for r in results.values() for f in r["by_family"]})
    lines += ["", "| ms per step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    rows = [
        ("step (CUDA events, unprofiled)", "step_ms"),
        ("kernels", "kernel_ms"),
        ("GPU idle inside the step", "idle_ms"),
    ]
    for label, key in rows:
        lines.append(f"| {label} | " + " | ".join(f"{results[n][key]:.2f}" for n in names) + " |")
    for f in families:
        cells = [f"{results[n]['by_family'].get(f, 0.0):.2f}" for n in names]
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    for n in names:
        lines += ["", f"### {n}: largest idle gaps and heaviest kernels", ""]
        lines.append(
            "gaps (us, next kernel): "
            + "; ".join(f"{g['us']:.0f} {g['next'][:40]}" for g in results[n]["largest_gaps"])
        )
        lines += ["", "| kernel | calls | ms | family |", "|---|---|---|---|"]
        lines += [
            f"| `{k['name']}` | {k['calls']} | {k['ms']:.3f} | {k['family']} |"
            for k in results[n]["kernels"]
        ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    e2e_llama.add_step_arguments(parser, variants="compile,cce", layers=16, batch=4)
    parser.add_argument("--timed", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2, help="steps under the profiler")
    parser.add_argument("--out", default="bench/results/e2e_profile")
    args = parser.parse_args(argv)
    args.cap_gib = None  # e2e_llama._training reads it: no allocator cap here
    results = {name: profile_variant(name, args) for name in args.variants.split(",")}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e_profile.json").write_text(json.dumps(results, indent=1))
    text = markdown(results, args)
    (out / "e2e_profile.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
