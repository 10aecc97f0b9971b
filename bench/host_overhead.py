"""The host's work per call of the loss on the Triton path, by layer, with the kernels stubbed.

Shape C (4096 x 2048 x 32000, bf16) is host-bound on an H200 (issue 41): the GPU waits for the
Python from ``linear_cross_entropy`` through ``decide``, the op's autograd, the implementation
and the launchers. This script measures that Python on any machine:

* CPU (default): the Triton path (``implementations.triton_path`` / ``triton_fast``) runs on CPU
  tensors of shape C's sizes with every Triton launch (``JITFunction.run``) and every cuBLAS GEMM
  of ``triton_shared`` replaced by a stub that returns at once, and the few device-type choices
  (tiles, the policy's device, the work dtype, ``scale_``) taken as on a GPU. What is left is the
  host's work: our Python, PyTorch's dispatch of the small per-row ops (on N = 4096 CPU vectors,
  a few us each, as a CUDA launch), and the allocations (CPU malloc, not CUDA's caching allocator).
  The tensors are D = 64 wide, and the policy is told D = 2048 (``Stubs.POLICY_DIM``): every
  decision (mode, chunks, slabs, tiles) is shape C's, while the few ops on N x D tensors (a
  gradient's cast, compaction's gathers), which are GPU work, cost the CPU little. The
  kept-first stub computes its order and count for real (the count is read on the host); the
  stubs' own time is measured and left out of the layers.
* ``--gpu``: the same calls on CUDA tensors with nothing stubbed: the host time per call (no
  synchronisation inside it), its wall time (synchronised), and the same layer split.

For each case (lean and fast, mean reduction, 10% ignored targets; skip_ignored off, on, and
forced to compact: ``policy.MIN_SKIP_MACS = 0``, the host synchronisation larger problems take)
it reports the launches per call (Triton kernels by name, GEMMs, PyTorch's compute ops from the
profiler), the host us per forward and per backward (median of ``--reps`` calls, no
instrumentation), and the exclusive us per call of each layer (a timing wrapper around every
function of the package, a second pass; each wrapper adds ~1-2 us, counted in its layer).

    python bench/host_overhead.py                       # CPU, stubbed kernels
    python bench/host_overhead.py --gpu --reps 200      # on a GPU, for real
    python bench/host_overhead.py --profile fast-skip   # also cProfile's top functions
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import datetime
import inspect
import pathlib
import platform
import pstats
import statistics
import subprocess
import sys
import time
from unittest import mock

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import cce_compile  # noqa: E402
from cce_compile import decide, policy  # noqa: E402
from cce_compile.implementations import triton_path  # noqa: E402
from cce_compile.implementations import triton_shared as shared  # noqa: E402
from cce_compile.kernels import scale_cast as scale_cast_module  # noqa: E402
from cce_compile.op import dispatch  # noqa: E402

SHAPE_C = (4096, 2048, 32000)  # N, D, V
IGNORED = 0.1
CASES = {  # name: (mode, skip_ignored, forced compaction)
    "lean": ("lean", False, False),
    "lean-skip": ("lean", True, False),
    "lean-compact": ("lean", True, True),
    "fast": ("fast", False, False),
    "fast-skip": ("fast", True, False),
    "fast-compact": ("fast", True, True),
}
# Each function's layer, by the module that defines it (first prefix that matches).
LAYERS = (
    ("cce_compile.functional", "public function"),
    ("cce_compile.decide", "decide"),
    ("cce_compile.policy", "policy"),
    ("cce_compile.config", "decide"),
    ("cce_compile.op.custom_ops", "op: custom op + autograd"),
    ("cce_compile.op.signature", "op: custom op + autograd"),
    ("cce_compile.op.versioning", "op: custom op + autograd"),
    ("cce_compile.op", "op: dispatch, compaction"),
    ("cce_compile.loss_math", "op: loss math (per-row ops)"),
    ("cce_compile.row_metrics", "op: loss math (per-row ops)"),
    ("cce_compile.implementations", "implementation"),
    ("cce_compile.kernels", "launchers (checks, descriptors)"),
    ("triton.tools.tensor_descriptor", "launchers (checks, descriptors)"),
    ("torch-alloc", "allocation"),
    ("stub", "Triton launch (stubbed on CPU)"),
)
TOP_FUNCTIONS = 20
_ALLOCATORS = ("empty", "empty_like", "zeros", "zeros_like", "full", "ones")


class Stubs:
    """The CPU stand-ins: kernel and GEMM launches counted and skipped, GPU choices taken, and
    the policy told shape C's D for the narrow tensors (``TENSOR_DIM``)."""

    TENSOR_DIM = 64
    POLICY_DIM = SHAPE_C[1]

    def __init__(self) -> None:
        self.launches: collections.Counter = collections.Counter()

    def kernel_run(self, jit, *args, grid, warmup, **kwargs):
        name = jit.fn.__name__
        self.launches[name] += 1
        if name == "_kept_first_kernel":  # its count is read on the host: compute it
            valid, order, count = args[:3]
            with torch.profiler.record_function("stub"):
                order.copy_(torch.argsort(~valid, stable=True))
                count.fill_(int(valid.sum()))

    def gemm(self, a, b, out, *rest, **kwargs):
        self.launches["cuBLAS GEMM"] += 1
        return out

    def patches(self) -> list:
        cuda = torch.device("cuda")
        tile, fused = shared.tile_config, shared.fused_tile_config
        problem, pays = policy.problem, policy.skipping_pays

        def wide(dim):
            return self.POLICY_DIM if dim == self.TENSOR_DIM else dim

        def policy_problem(rows, shape, logit_dtype, device, **kwargs):
            return problem(rows, (shape[0], wide(shape[1])), logit_dtype, "cuda", **kwargs)

        def scale(x, s):
            return scale_cast_module.scale_cast(x, s, x.dtype, out=x)

        def check_targets(targets, *rest):
            return None  # on a GPU only with CCE_CHECK_TARGETS (a host read)

        stub = self

        def run(jit, *args, **kwargs):
            return stub.kernel_run(jit, *args, **kwargs)

        return [
            mock.patch.object(triton.runtime.jit.JITFunction, "run", run),
            mock.patch.object(shared, "tile_config", lambda d, *a, **k: tile(cuda, *a, **k)),
            mock.patch.object(shared, "fused_tile_config", lambda d, *a, **k: fused(cuda, *a, **k)),
            mock.patch.object(shared, "work_dtype", lambda t: t.dtype),
            mock.patch.object(shared, "matmul", self.gemm),
            mock.patch.object(shared, "addmm_", lambda acc, a, b, first: self.gemm(a, b, acc)),
            mock.patch.object(shared, "scale_", scale),
            mock.patch.object(triton_path, "scale_", scale),
            mock.patch.object(policy, "problem", policy_problem),
            mock.patch.object(
                policy, "skipping_pays", lambda d, n, v, dim: pays("cuda", n, v, wide(dim))
            ),
            mock.patch.object(decide, "check_targets", check_targets),
        ]


class LayerClock:
    """Exclusive time per layer: every package function wrapped, each call's time less its
    wrapped callees' charged to its own layer."""

    def __init__(self) -> None:
        self.totals: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.functions: collections.Counter = collections.Counter()  # exclusive, by name
        self._stack: list[float] = []  # callees' time of each open frame
        self._wrapped: dict = {}

    def wrap(self, fn, layer: str):
        if fn in self._wrapped:
            return self._wrapped[fn]
        clock = self
        label = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}"

        def timed(*args, **kwargs):
            clock._stack.append(0.0)
            start = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter_ns() - start
                inner = clock._stack.pop()
                clock.totals[layer] += spent - inner
                clock.functions[label] += spent - inner
                clock.calls[layer] += 1
                if clock._stack:
                    clock._stack[-1] += spent

        timed.__wrapped__ = fn
        self._wrapped[fn] = timed
        return timed

    def patches(self) -> list:
        """Every package function in every package module's namespace (``from x import f``
        copies included), the allocators, TensorDescriptor and the kernel stub, wrapped."""
        found = []
        for name, module in list(sys.modules.items()):
            if not name.startswith("cce_compile") or module is None:
                continue
            for attr, value in list(vars(module).items()):
                layer = _layer_of(value)
                if layer is not None and inspect.isfunction(value):
                    found.append(mock.patch.object(module, attr, self.wrap(value, layer)))
                elif inspect.isclass(value) and value.__module__ == name:
                    found.extend(self._method_patches(value))
        for name in _ALLOCATORS:
            found.append(
                mock.patch.object(torch, name, self.wrap(getattr(torch, name), "allocation"))
            )
        for name in ("new_empty", "new_zeros", "new_full"):
            method = getattr(torch.Tensor, name)
            found.append(mock.patch.object(torch.Tensor, name, self.wrap(method, "allocation")))
        run = triton.runtime.jit.JITFunction.run
        found.append(
            mock.patch.object(
                triton.runtime.jit.JITFunction,
                "run",
                self.wrap(run, "Triton launch (stubbed on CPU)"),
            )
        )
        return found

    def _method_patches(self, cls) -> list:
        """The methods of a package class (its ``__init__``, no other dunder; static methods
        too): the launchers' prepared launches are classes."""
        found = []
        for attr, value in list(vars(cls).items()):
            if attr.startswith("__") and attr != "__init__":
                continue
            static = isinstance(value, staticmethod)
            fn = value.__func__ if static else value
            layer = _layer_of(fn) if inspect.isfunction(fn) else None
            if layer is not None:
                timed = self.wrap(fn, layer)
                found.append(mock.patch.object(cls, attr, staticmethod(timed) if static else timed))
        return found


def _layer_of(value) -> str | None:
    module = getattr(value, "__module__", None) or ""
    if getattr(value, "__wrapped__", None) is not None:
        return None
    for prefix, layer in LAYERS:
        if module.startswith(prefix):
            return layer
    return None


def make_inputs(device: str, n: int, d: int, v: int):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=gen).to(device, torch.bfloat16).requires_grad_()
    classifier = (torch.randn(v, d, generator=gen) / d**0.5).to(device, torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[torch.rand(n, generator=gen) < IGNORED] = -100
    return hidden, classifier.requires_grad_(), targets.to(device)


@dataclasses.dataclass
class CaseResult:
    forward_us: float
    backward_us: float
    wall_us: float | None
    launches: dict
    torch_ops: int
    layers: dict


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_case(case: str, inputs, reps: int, device: str, stubs: Stubs | None) -> CaseResult:
    mode, skip, forced = CASES[case]
    hidden, classifier, targets = inputs

    def forward():
        return cce_compile.linear_cross_entropy(hidden, classifier, targets, mode=mode)

    with contextlib.ExitStack() as stack:
        stack.enter_context(cce_compile.config.override(skip_ignored=skip))
        if forced:
            stack.enter_context(mock.patch.object(policy, "MIN_SKIP_MACS", 0))
        for patch in stubs.patches() if stubs else []:
            stack.enter_context(patch)
        fwd, bwd, wall = [], [], []
        for i in range(reps + 5):
            hidden.grad = classifier.grad = None
            _sync(device)
            t0 = time.perf_counter_ns()
            loss = forward()
            t1 = time.perf_counter_ns()
            loss.backward()
            t2 = time.perf_counter_ns()
            _sync(device)
            t3 = time.perf_counter_ns()
            if i >= 5:
                fwd.append(t1 - t0), bwd.append(t2 - t1), wall.append(t3 - t0)
        launches = _launches(forward, hidden, classifier, stubs)
        torch_ops = _torch_ops(forward, hidden, classifier)
        layers = _layers(forward, hidden, classifier, reps, device)
    med = statistics.median
    return CaseResult(
        med(fwd) / 1e3,
        med(bwd) / 1e3,
        med(wall) / 1e3 if device == "cuda" else None,
        launches,
        torch_ops,
        layers,
    )


def _launches(forward, hidden, classifier, stubs: Stubs | None) -> dict:
    """Launches of one forward and of its backward: Triton kernels by name, GEMMs (stubbed)."""
    counter = stubs or Stubs()
    with contextlib.ExitStack() as stack:
        if stubs is None:  # on a GPU: count, and launch
            real = triton.runtime.jit.JITFunction.run

            def run(jit, *args, **kwargs):
                counter.launches[jit.fn.__name__] += 1
                return real(jit, *args, **kwargs)

            stack.enter_context(mock.patch.object(triton.runtime.jit.JITFunction, "run", run))
        hidden.grad = classifier.grad = None
        before = collections.Counter(counter.launches)
        loss = forward()
        middle = collections.Counter(counter.launches)
        loss.backward()
        return {
            "forward": dict(middle - before),
            "backward": dict(collections.Counter(counter.launches) - middle),
        }


# aten ops that launch no kernel on a GPU (views, allocations, metadata).
_FREE = frozenset(
    "view slice as_strided reshape alias detach unsqueeze squeeze expand select transpose "
    "permute t lift_fresh unbind _reshape_alias empty empty_like empty_strided new_empty "
    "new_empty_strided result_type item _local_scalar_dense is_nonzero split narrow expand_as "
    "view_as flatten _unsafe_view contiguous to _to_copy clone".split()
)


def _torch_ops(forward, hidden, classifier) -> int:
    """PyTorch's kernel launches in one forward+backward: the profiler's leaf aten ops that are
    no view, allocation or metadata (the stubs' own left out)."""
    hidden.grad = classifier.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        forward().backward()
    count = 0
    for event in prof.events():
        if not event.name.startswith("aten::") or event.name[6:] in _FREE:
            continue
        if any(c.name.startswith("aten::") for c in event.cpu_children) or _in_stub(event):
            continue
        count += 1
    return count


def _in_stub(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == "stub":
            return True
        parent = parent.cpu_parent
    return False


def _layers(forward, hidden, classifier, reps: int, device: str) -> dict:
    """Exclusive us per forward+backward of each layer (``LayerClock``), and the total."""
    clock = LayerClock()
    total = 0
    with contextlib.ExitStack() as stack:
        for patch in clock.patches():
            stack.enter_context(patch)
        for i in range(reps + 5):
            if i == 5:
                clock.totals.clear()
                clock.functions.clear()
                total = 0
            hidden.grad = classifier.grad = None
            _sync(device)
            start = time.perf_counter_ns()
            forward().backward()
            total += time.perf_counter_ns() - start
    layers = {layer: clock.totals[layer] / reps / 1e3 for _, layer in LAYERS}
    charged = sum(layers.values())
    layers["PyTorch autograd + rest (unwrapped)"] = total / reps / 1e3 - charged
    layers["total (with wrappers)"] = total / reps / 1e3
    top = clock.functions.most_common(TOP_FUNCTIONS)
    layers["_top"] = [(name, ns / reps / 1e3) for name, ns in top]
    return layers


def profile_case(case: str, inputs, reps: int, stubs: Stubs | None, top: int) -> str:
    mode, skip, forced = CASES[case]
    hidden, classifier, targets = inputs
    with contextlib.ExitStack() as stack:
        stack.enter_context(cce_compile.config.override(skip_ignored=skip))
        if forced:
            stack.enter_context(mock.patch.object(policy, "MIN_SKIP_MACS", 0))
        for patch in stubs.patches() if stubs else []:
            stack.enter_context(patch)
        profiler = cProfile.Profile()
        for _ in range(reps):
            hidden.grad = classifier.grad = None
            profiler.enable()
            cce_compile.linear_cross_entropy(hidden, classifier, targets, mode=mode).backward()
            profiler.disable()
    stream = __import__("io").StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(top)
    return stream.getvalue()


def table(results: dict[str, CaseResult]) -> str:
    cases = list(results)
    lines = ["| | " + " | ".join(cases) + " |", "|---" * (len(cases) + 1) + "|"]

    def row(label, values):
        lines.append(f"| {label} | " + " | ".join(values) + " |")

    row("host us, forward", [f"{r.forward_us:.0f}" for r in results.values()])
    row("host us, backward", [f"{r.backward_us:.0f}" for r in results.values()])
    if any(r.wall_us for r in results.values()):
        row("wall us, fwd+bwd", [f"{r.wall_us:.0f}" for r in results.values()])
    for phase in ("forward", "backward"):
        row(f"launches, {phase}", [_launch_text(r.launches[phase]) for r in results.values()])
    row("PyTorch compute ops, fwd+bwd", [str(r.torch_ops) for r in results.values()])
    for layer in results[cases[0]].layers:
        if layer.startswith("_"):
            continue
        row(f"us: {layer}", [f"{r.layers[layer]:.0f}" for r in results.values()])
    return "\n".join(lines)


def _launch_text(counts: dict) -> str:
    total = sum(counts.values())
    parts = ", ".join(
        f"{name.strip('_').replace('_kernel', '')} {n}" for name, n in sorted(counts.items())
    )
    return f"{total} ({parts})" if parts else "0"


def describe(device: str) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    where = torch.cuda.get_device_name() if device == "cuda" else f"{platform.processor() or 'CPU'}"
    return (
        f"{datetime.date.today()}, commit {commit.stdout.strip()}, {where}, "
        f"torch {torch.__version__}, triton {triton.__version__}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", action="store_true", help="real kernels on CUDA, no stubs")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--profile", default=None, help="a case to cProfile after the table")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    device = "cuda" if args.gpu else "cpu"
    if not args.gpu:
        torch.set_num_threads(1)
    n, d, v = SHAPE_C
    inputs = make_inputs(device, n, d if args.gpu else Stubs.TENSOR_DIM, v)
    if device == "cpu":
        patch = mock.patch.object(dispatch, "implementation_for", lambda device: triton_path)
    else:
        patch = contextlib.nullcontext()
    results = {}
    with patch:
        for case in args.cases.split(","):
            stubs = None if args.gpu else Stubs()
            results[case] = run_case(case, inputs, args.reps, device, stubs)
        print(describe(device))
        print(f"shape C {SHAPE_C} (N, D, V) bf16, {IGNORED:.0%} ignored, mean, {args.reps} calls")
        print(table(results))
        for case, result in results.items():
            print(f"\n{case}: the functions of most exclusive us per call")
            for name, us in result.layers["_top"]:
                print(f"  {us:8.1f}  {name}")
        if args.profile:
            stubs = None if args.gpu else Stubs()
            print(profile_case(args.profile, inputs, args.reps, stubs, args.top))


if __name__ == "__main__":
    main()
