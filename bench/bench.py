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
(time against memory) into ``--out``.

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
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # PYTHONPATH first

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


def count_first_selection(valid: torch.Tensor, order_of=None):
    """Fast mode's compaction as before bdc59b7: the count of kept rows waited for
    (``nonzero``) before the first GEMM, not after it (``compaction._kept_first``'s order;
    ``order_of``, the implementation's kept-first kernel, is not used)."""
    from cce_compile.op import compaction

    return compaction.Selection(valid.nonzero().squeeze(1), valid.numel())


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


def eager_loss(hidden, classifier, targets):
    logits = hidden @ classifier.T
    return F.cross_entropy(logits.float(), targets, ignore_index=-100)


def amp_reference_inputs(hidden, classifier, scenario: Scenario):
    """What the reference sees: under AMP the head's inputs rounded to bf16, as autocast
    rounds them (the float32 math after that is the ideal)."""
    if scenario.amp:
        return hidden.bfloat16(), classifier.bfloat16()
    return hidden, classifier


def _cce_methods():
    """cce_compile's modes and the default under other settings (budgets, chunk forms, skipping)."""
    import cce_compile

    methods = {}
    for mode in ("lean", "fast", "auto"):
        methods[f"cce_{mode}"] = lambda mode=mode: (
            lambda h, c, t: cce_compile.linear_cross_entropy(h, c, t, mode=mode)
        )

    def auto_every_row(h, c, t):
        """The default with CCE_SKIP_IGNORED=0: ignored rows computed, no host sync."""
        with cce_compile.config.override(skip_ignored=False):
            return cce_compile.linear_cross_entropy(h, c, t)

    methods["cce_auto_every_row"] = lambda: auto_every_row

    def auto_patched(module, **values):
        """The default with some of ``module``'s names replaced for the call (a function by a
        function, a constant by a constant)."""

        def loss(h, c, t):
            with mock.patch.multiple(module, **values):
                return cce_compile.linear_cross_entropy(h, c, t)

        return loss

    def auto_with_policy(**values):
        """The default with some of ``policy``'s names replaced for the call."""
        from cce_compile import policy

        return auto_patched(policy, **values)

    def auto_count_first():
        from cce_compile.op import compaction

        return auto_patched(compaction, _kept_first=count_first_selection)

    # skipping ignored rows whatever the size
    methods["cce_auto_skip_any_size"] = lambda: auto_with_policy(MIN_SKIP_MACS=0)
    # the count of kept rows waited for before the first GEMM: compaction before bdc59b7
    methods["cce_auto_count_first"] = auto_count_first
    # a frozen head's chunks on the whole budget: the frozen default before 4c7e74e
    methods["cce_auto_frozen_whole_budget"] = lambda: auto_with_policy(FROZEN_BUDGET_SHARE=1.0)
    # fast mode's chunks as whole float32 rows (cuBLAS logits, then chunk_softmax_grad), not
    # the GEMM's scaled exponentials: the whole-row form before the fused GEMM (05c7832)
    methods["cce_auto_whole_rows"] = lambda: auto_with_policy(fast_fuses_exp=lambda *a, **k: False)

    def auto_with_budget(h, c, t, megabytes):
        """The default under CCE_MEMORY_BUDGET_MB=megabytes (fewer, larger chunks and slabs on
        small problems, where the default's 1/5 of the logits is a few tens of MB)."""
        with cce_compile.config.override(memory_budget_mb=megabytes):
            return cce_compile.linear_cross_entropy(h, c, t)

    for megabytes in (128, 256, 512):
        methods[f"cce_auto_budget{megabytes}"] = lambda mb=megabytes: (
            lambda h, c, t: auto_with_budget(h, c, t, mb)
        )

    def auto_with_fast_rows(h, c, t, chunk_rows):
        """auto under the smallest budget that admits fast mode with ``chunk_rows``-row chunks
        of whole float32 rows (float32 logits and d hidden per row, and the rounded hidden under
        AMP): a point on fast mode's memory/speed curve (policy.py). Where the policy takes
        the fused form (bf16 scaled exponentials) the same budget holds more rows."""
        vocab, dim = c.shape
        rows = h.numel() // dim
        rounded = rows * dim * 2 if torch.is_autocast_enabled("cuda") else 0
        budget = chunk_rows * (vocab + dim) * 4 + rounded
        with cce_compile.config.override(memory_budget_mb=budget // 2**20 + 1):
            return cce_compile.linear_cross_entropy(h, c, t)

    for chunk_rows in (512, 1024, 2048, 4096):
        methods[f"cce_fast_rows{chunk_rows}"] = lambda n=chunk_rows: (
            lambda h, c, t: auto_with_fast_rows(h, c, t, n)
        )

    return methods


def _trl_chunk_size() -> int:
    """TRL's chunk size for its fused head (``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``).
    That module imports ``datasets``, which the GPU machine lacks; its kernel does not, so
    there the constant is read from the module's source instead of importing it."""
    try:
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        return _CHUNKED_LOGPROB_CHUNK_SIZE
    except ImportError:
        import re

        import trl

        source = (pathlib.Path(trl.__file__).parent / "trainer" / "utils.py").read_text()
        return int(re.search(r"^_CHUNKED_LOGPROB_CHUNK_SIZE\s*=\s*(\d+)", source, re.M)[1])


def _peer_methods():
    """Apple's CCE, Liger, TRL's fused head and quack, each imported when its method runs."""
    methods = {}

    def apple(filter_eps):
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, c, t: linear_cross_entropy(h, c, t, filter_eps=filter_eps)

    methods["apple_cce"] = lambda: apple("high")
    methods["apple_cce_exact"] = lambda: apple(None)

    def liger():
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )

        loss_fn = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        return lambda h, c, t: loss_fn(c, h, t)

    methods["liger"] = liger

    def trl_fused_head():
        # As SFTTrainer calls it (trl.trainer.utils.add_fused_lm_head, TRL 1.16): the valid
        # positions only, its chunk size, the outputs its metrics log; the loss is its mean.
        from trl.kernels import ChunkedLogProbFunction

        chunk_size = _trl_chunk_size()

        def loss_fn(h, c, t):
            mask = t != -100
            log_probs, *_ = ChunkedLogProbFunction.apply(
                h[mask],
                c,
                None,
                t[mask],
                1.0,
                chunk_size,
                None,
                1.0,
                ("log_probs", "entropy", "is_top1"),
            )
            return -log_probs.sum() / mask.sum().clamp(min=1)

        return loss_fn

    methods["trl_fused_head"] = trl_fused_head

    def quack():
        from quack.linear_cross_entropy import chunked_linear_cross_entropy

        return lambda h, c, t: chunked_linear_cross_entropy(h, c, t)

    methods["quack"] = quack
    return methods


def _cce_backend():
    import cce_compile

    return cce_compile.backend


def method_factories():
    """name -> (callable(hidden, classifier, targets) -> loss, or None when unavailable)."""

    methods = {}
    methods["torch_eager"] = lambda: eager_loss
    methods["torch_compile"] = lambda: torch.compile(eager_loss, dynamic=False)

    def autochunk():
        compiled = torch.compile(eager_loss, dynamic=False, options={"auto_chunker.enable": True})
        return compiled

    methods["compile_autochunk"] = autochunk
    # The pass through torch.compile, and both under CUDA graphs: the host-bound small heads' case.
    methods["torch_compile_graphs"] = lambda: torch.compile(
        eager_loss, dynamic=False, mode="reduce-overhead"
    )
    # The backend object, not its entry-point name: a source tree on PYTHONPATH registers none.
    methods["cce_pass"] = lambda: torch.compile(eager_loss, backend=_cce_backend(), dynamic=False)
    methods["cce_pass_graphs"] = lambda: torch.compile(
        eager_loss, backend=_cce_backend(), dynamic=False, mode="reduce-overhead"
    )
    methods.update(_cce_methods())
    methods.update(_peer_methods())
    if hasattr(F, "linear_cross_entropy"):
        methods["torch_linear_cross_entropy"] = lambda: (
            lambda h, c, t: F.linear_cross_entropy(h, c, t)
        )
    return methods


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


def markdown(results):
    env = results["environment"]
    lines = [
        f"GPU: {env['gpu']} · torch {env['torch']} · triton {env['triton']} · "
        f"CUDA {env['cuda']} · cut-cross-entropy {env.get('cut_cross_entropy', '-')} · "
        f"liger-kernel {env.get('liger_kernel', '-')} · trl {env.get('trl', '-')} · "
        f"quack-kernels {env.get('quack_kernels', '-')}",
        "",
        "Times are medians (ms) of CUDA-event timings; extra memory is the peak above inputs "
        "and gradients (GiB); errors are ||g - g_fp32|| / ||g_fp32||. Floor = 3 x matmul "
        "(2 with a frozen classifier). Inputs: hidden ~ N(0, 1), classifier ~ N(0, 1)/sqrt(D), "
        "uniform targets; the scenario names the dtype, the ignored share and the frozen head.",
        "",
    ]
    for shape in results["shapes"]:
        floor = shape["floor_fwd_bwd_ms"]
        compile_ms = shape["methods"].get("torch_compile", {}).get("fwd_bwd_ms")
        compile_mem = shape["methods"].get("torch_compile", {}).get("extra_memory_gb")
        lines += [
            f"### {shape['shape']} ({shape.get('scenario', 'bf16')}): "
            f"N={shape['N']} D={shape['D']} V={shape['V']}, "
            f"{shape.get('ignored_rows', '?')} rows ignored "
            f"(matmul {shape['matmul_ms']:.2f} ms = {shape['matmul_tflops']:.0f} TFLOP/s, "
            f"floor {floor:.1f} ms)",
            "",
            "| method | fwd+bwd ms | x floor | x compile | fwd ms | x matmul | extra GiB | "
            "x compile mem | loss err | dE err | dC err |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for method, r in shape["methods"].items():
            if "error" in r:
                lines.append(f"| {method} | {r['error'][:80]} |||||||||")
                continue
            xc = f"{r['fwd_bwd_ms'] / compile_ms:.2f}" if compile_ms else "-"
            xm = f"{r['extra_memory_gb'] / compile_mem:.3f}" if compile_mem else "-"
            dc = r["grad_classifier_err"]
            lines.append(
                f"| {method} | {r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_ms'] / floor:.2f} | {xc} | "
                f"{r['fwd_ms']:.2f} | {r['fwd_ms'] / shape['matmul_ms']:.2f} | "
                f"{r['extra_memory_gb']:.3f} | {xm} | {r['loss_err']:.1e} | "
                f"{r['grad_hidden_err']:.2e} | {'-' if dc is None else f'{dc:.2e}'} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(shape, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, r in shape["methods"].items():
        if "error" in r:
            continue
        ax.scatter(r["fwd_bwd_ms"], max(r["extra_memory_gb"], 1e-3), s=40)
        ax.annotate(
            method,
            (r["fwd_bwd_ms"], max(r["extra_memory_gb"], 1e-3)),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.axvline(shape["floor_fwd_bwd_ms"], color="gray", ls="--", lw=1, label="3 x matmul")
    ax.set_yscale("log")
    ax.set_xlabel("forward+backward time (ms)")
    ax.set_ylabel("extra memory (GiB, log)")
    ax.set_title(
        f"shape {shape['shape']} ({shape.get('scenario', 'bf16')}): "
        f"N={shape['N']} D={shape['D']} V={shape['V']}"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
