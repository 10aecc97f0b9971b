"""Side-by-side benchmark of linear + cross-entropy implementations on one GPU.

For each scenario (``Scenario``: bf16 or AMP, the share of ignored targets, a frozen classifier)
and each shape (N tokens x D hidden x V classes) and method it records, in one run on one GPU:

* forward+backward and forward-only (under no_grad) time: median of CUDA-event timings over
  ``--reps`` repetitions after warm-up;
* peak memory above the inputs and the gradients (``max_memory_allocated`` during fwd+bwd,
  minus what was allocated before, minus the bytes of the gradients themselves);
* relative gradient error ||g - g_ref|| / ||g_ref|| of d hidden and d classifier against a
  float32 reference (float32 inputs, materialised float32 logits, IEEE float32 matmuls).

The floor is the bare ``hidden @ classifier.T`` matmul: 3 x its time for forward+backward (2 x
with a frozen classifier).
Writes ``results.json`` (with GPU, torch, triton versions), ``results.md`` and one PNG per shape
(time against memory) into ``--out``. The methods are in bench/methods.py, the table and the
PNGs in bench/bench_report.py.

    python bench/bench.py --out bench/results            # every shape and method
    python bench/bench.py --shapes C --methods cce_lean,torch_compile --reps 5
    python bench/bench.py --shapes E --scenarios bf16-ign50,amp-ign50,bf16-frozen,prompt50
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import pathlib
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

# PYTHONPATH first; then this folder, for the modules beside this file when it is imported as
# bench.bench rather than run.
sys.path += [str(pathlib.Path(__file__).resolve().parents[i]) for i in (1, 0)]
from bench_report import markdown, plot  # noqa: E402
from methods import (  # noqa: E402, F401  (the profiling scripts import them from here)
    _trl_chunk_size,
    count_first_selection,
    method_factories,
)

SHAPES = {  # name: (N, D, V)
    "A": (8192, 2304, 256000),
    "B": (16384, 4096, 128256),
    "C": (4096, 2048, 32000),
    "E": (8192, 4096, 128256),
    "G": (16384, 512, 131072),  # the GPU demo's head: batch 16 x context 1024, dim 512
    "H": (16384, 768, 131072),  # GPT-2 small's width
    "I": (16384, 1024, 131072),  # where the small-tile rule (D <= 2048) was checked
    "L": (8192, 2048, 128256),  # e2e_llama.py's head: 4 x 2048 tokens, hidden 2048
}
GiB = 2**30
SEQUENCE = 2048  # tokens per sequence for prompt-style masking


@dataclasses.dataclass(frozen=True)
class Scenario:
    """What the inputs look like; named like ``amp-frozen-ign50`` (tokens joined by '-'):

    ``bf16`` / ``amp``  bf16 hidden and classifier, or float32 ones under bf16 autocast
    ``frozen``          the classifier needs no gradient (LoRA, PEFT)
    ``ignNN``           NN% of the targets are ignore_index, at random rows (default 10)
    ``promptNN``        the first NN% of every 2048-token sequence is ignored (SFT prompts)
    ``peaked``          each hidden state aligned with its target's classifier row, so that
                        the target holds ~97% of the softmax mass, as in a trained model
    """

    name: str
    amp: bool = False
    frozen: bool = False
    ignored: float = 0.1
    prompt: bool = False
    peaked: bool = False

    @staticmethod
    def parse(name: str) -> Scenario:
        fields: dict = {}
        for token in name.split("-"):
            if token in ("bf16", "amp"):
                fields["amp"] = token == "amp"
            elif token in ("frozen", "peaked"):
                fields[token] = True
            elif token.startswith(("ign", "prompt")):
                prefix = "ign" if token.startswith("ign") else "prompt"
                fields["ignored"] = int(token[len(prefix) :]) / 100
                fields["prompt"] = prefix == "prompt"
            else:
                raise ValueError(f"unknown scenario token {token!r} in {name!r}")
        return Scenario(name, **fields)


PEAKED_TARGET_MASS = 0.97


def make_inputs(n, d, v, scenario: Scenario, seed=0):
    """hidden ~ N(0, 1), classifier ~ N(0, 1) / sqrt(D), targets uniform, some ignored."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, d, device="cuda", generator=gen)
    classifier = torch.randn(v, d, device="cuda", generator=gen) / d**0.5
    targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
    if scenario.peaked:
        # target logit ~ s |C_t|^2 = s; others ~ N(0, 1): mass q needs a margin of
        # log(q / (1 - q) * V) above the lse of the rest.
        margin = math.log(PEAKED_TARGET_MASS / (1 - PEAKED_TARGET_MASS) * v)
        hidden = margin * classifier[targets] + 0.1 * hidden
    if scenario.prompt:
        position = torch.arange(n, device="cuda") % SEQUENCE
        ignored = position < int(scenario.ignored * SEQUENCE)
    else:
        ignored = torch.rand(n, device="cuda", generator=gen) < scenario.ignored
    targets = torch.where(ignored, torch.full_like(targets, -100), targets)
    dtype = torch.float32 if scenario.amp else torch.bfloat16
    return hidden.to(dtype), classifier.to(dtype), targets


def under_scenario(fn, scenario: Scenario):
    """``fn`` as the scenario runs it: under bf16 autocast for AMP."""
    if not scenario.amp:
        return fn

    def autocast_fn(h, c, t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fn(h, c, t)

    return autocast_fn


def loss_step(name: str, scenario: Scenario, mode: str | None = None, **settings):
    """(step, (hidden, classifier)): one forward+backward of cce_compile's loss on shape
    ``name``'s inputs as ``scenario`` runs them, in ``mode`` and under the ``cce_compile.config``
    ``settings`` (e.g. skip_ignored=False), each step clearing the gradients first; and the
    inputs (for a matmul to compare with). The profiling scripts' step."""
    import cce_compile

    n, d, v = SHAPES[name]
    hidden, classifier, targets = make_inputs(n, d, v, scenario)
    h = hidden.clone().requires_grad_()
    c = classifier.clone().requires_grad_(not scenario.frozen)
    loss_fn = under_scenario(
        lambda h, c, t: cce_compile.linear_cross_entropy(h, c, t, mode=mode), scenario
    )

    def step():
        h.grad = c.grad = None
        with cce_compile.config.override(**settings):
            loss_fn(h, c, targets).backward()

    return step, (hidden, classifier)


def save_results(out: pathlib.Path, stem: str, results: dict, table: str) -> None:
    """``results`` as ``stem``.json and its markdown ``table`` as ``stem``.md in ``out``, and
    the table printed: how the profiling scripts end."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)


def amp_reference_inputs(hidden, classifier, scenario: Scenario):
    """What the reference sees: under AMP the head's inputs rounded to bf16, as autocast
    rounds them (the float32 math after that is the ideal)."""
    if scenario.amp:
        return hidden.bfloat16(), classifier.bfloat16()
    return hidden, classifier


def cuda_time_ms(fn, reps, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), times


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def reference_grads(hidden, classifier, targets):
    """float32 inputs and logits, IEEE matmuls; chunked over tokens to bound memory."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        h = hidden.float().requires_grad_()
        c = classifier.float().requires_grad_()
        count = (targets != -100).sum()
        total = 0.0
        chunk = max(1, (4 * GiB) // (classifier.shape[0] * 4))
        for s in range(0, h.shape[0], chunk):
            part = (
                F.cross_entropy(
                    h[s : s + chunk] @ c.T,
                    targets[s : s + chunk],
                    ignore_index=-100,
                    reduction="sum",
                )
                / count
            )
            part.backward()
            total += part.item()
        return total, h.grad, c.grad
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def bench_method(fn, hidden, classifier, targets, reps, warmup, ref, frozen=False):
    h = hidden.detach().clone().requires_grad_()
    c = classifier.detach().clone().requires_grad_(not frozen)
    trained = [t for t in (h, c) if t.requires_grad]
    grad_bytes = sum(t.numel() * t.element_size() for t in trained)

    def step():
        for t in trained:
            t.grad = None
        fn(h, c, targets).backward()

    def forward_only():
        with torch.no_grad():
            fn(h, c, targets)

    step()  # compile / autotune outside the measurements
    for t in trained:
        t.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = fn(h, c, targets)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - grad_bytes
    result = {
        "loss": loss.item(),
        "loss_err": abs(loss.item() - ref[0]) / abs(ref[0]),
        "grad_hidden_err": rel_err(h.grad, ref[1]),
        "grad_classifier_err": None if frozen else rel_err(c.grad, ref[2]),
        "extra_memory_gb": extra / GiB,
    }
    result["fwd_bwd_ms"], result["fwd_bwd_all_ms"] = cuda_time_ms(step, reps, warmup)
    result["fwd_ms"], _ = cuda_time_ms(forward_only, reps, warmup)
    return result


def bf16_matmul_ms(hidden, classifier, reps, warmup) -> float:
    """The bare bf16 head matmul: the floor's unit (its operands are freed on return)."""
    h, c = hidden.bfloat16(), classifier.bfloat16()
    return cuda_time_ms(lambda: h @ c.T, reps, warmup)[0]


def bench_shape(name, methods, reps, warmup, scenario: Scenario):
    n, d, v = SHAPES[name]
    hidden, classifier, targets = make_inputs(n, d, v, scenario)
    out = {"shape": name, "scenario": scenario.name, "N": n, "D": d, "V": v, "methods": {}}
    out["ignored_rows"] = int((targets == -100).sum())
    matmul_ms = bf16_matmul_ms(hidden, classifier, reps, warmup)
    out["matmul_ms"] = matmul_ms
    out["floor_fwd_bwd_ms"] = (2 if scenario.frozen else 3) * matmul_ms
    out["matmul_tflops"] = 2 * n * d * v / matmul_ms / 1e9
    ref = reference_grads(*amp_reference_inputs(hidden, classifier, scenario), targets)
    gc.collect()
    torch.cuda.empty_cache()
    for method in methods:
        factory = method_factories().get(method)
        if factory is None:
            out["methods"][method] = {"error": "not available"}
            continue
        torch._dynamo.reset()
        try:
            fn = under_scenario(factory(), scenario)
            out["methods"][method] = bench_method(
                fn, hidden, classifier, targets, reps, warmup, ref, frozen=scenario.frozen
            )
        except Exception as exc:  # a peer failing must not stop the run
            out["methods"][method] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            traceback.print_exc()  # where it failed, in the run's log
        gc.collect()
        torch.cuda.empty_cache()
        print(f"[{name}/{scenario.name}] {method}: {out['methods'][method]}", flush=True)
    return out


def environment():
    import triton

    props = torch.cuda.get_device_properties(0)
    versions = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": props.name,
        "gpu_memory_gb": props.total_memory / GiB,
        "cuda": torch.version.cuda,
    }
    for peer in ("cut_cross_entropy", "liger_kernel", "trl", "quack_kernels"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions[peer] = version(peer.replace("_", "-"))
    return versions


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--methods", default=None, help="comma list (default: all)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument(
        "--scenarios", default="bf16", help="comma list of scenario names (see Scenario)"
    )
    args = parser.parse_args(argv)
    methods = args.methods.split(",") if args.methods else list(method_factories())
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {
        "environment": environment(),
        "reps": args.reps,
        "warmup": args.warmup,
        "date": time.strftime("%Y-%m-%d"),
        "shapes": [],
    }
    for scenario in map(Scenario.parse, args.scenarios.split(",")):
        for name in args.shapes.split(","):
            shape = bench_shape(name, methods, args.reps, args.warmup, scenario)
            results["shapes"].append(shape)
            (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
            plot(shape, out_dir / f"shape_{name}_{scenario.name}.png")
    table = markdown(results)
    (out_dir / "results.md").write_text(table + "\n")
    print(table)
    return results


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("bench.py needs a CUDA GPU")
    main()
