"""Compile a function three ways and compare it with eager: the pass's test harness.

``check(fn, args)`` runs ``fn`` eagerly and compiled, compares outputs and the gradients of
every floating tensor that requires grad (inputs and module parameters), and returns what the
pass did: the counters and the graphs after the rewrite.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from unittest import mock

import torch
from oracle import COMPILED_VS_EAGER_RTOL, rel_error
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func

import cce_compile
from cce_compile.passes import ddp_split, tracing
from cce_compile.passes.graph_pass import run_on_module

OP = torch.ops.cce.linear_cross_entropy.default


@dataclasses.dataclass
class Outcome:
    rewritten: int
    skipped: dict[str, int]
    graphs: list[torch.fx.GraphModule]
    frames: int  # backend calls over all calls
    first_frames: int  # backend calls during the first call (Dynamo may restart analysis)
    gradients: int = 0  # gradients compared with eager's and present (not None), first call

    @property
    def recompiled(self) -> bool:
        """Did a later call (a new size) compile again?"""
        return self.frames > self.first_frames

    def targets(self) -> list:
        return [
            n.target
            for g in self.graphs
            for _, m in g.named_modules()
            if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes
        ]

    @property
    def has_op(self) -> bool:
        return OP in self.targets()


def _capturing(inner: str, graphs: list, frames: list):
    def backend(gm, example_inputs, **kwargs):
        frames.append(1)
        if inner == "cce-eager":  # the pass + AOTAutograd, no Inductor codegen (fast)
            run_on_module(gm)
            graphs.append(gm)
            return aot_eager(gm, example_inputs)
        compiled = cce_compile.backend(gm, example_inputs, **kwargs)
        graphs.append(gm)
        return compiled

    backend.runs_cce_pass = True  # as cce_compile.backend: DDP's graph cut runs the pass first
    return backend


@contextlib.contextmanager
def hook_enabled() -> Iterator[None]:
    """cce_compile.enable() for the block, restoring Inductor's previous hook."""
    from torch._inductor import config as inductor_config

    before = inductor_config.pre_grad_custom_pass
    cce_compile.enable()
    try:
        yield
    finally:
        inductor_config.pre_grad_custom_pass = before


def _graph_run_eagerly(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    return make_boxed_func(gm.forward)


@contextlib.contextmanager
def inductor_without_codegen() -> Iterator[None]:
    """Every Inductor compile in the block (backend "inductor" or "cce", enable()'s hook, a
    Trainer's ``torch_compile``) runs as Inductor does up to its code generation: the pre-grad
    hook, Inductor's decompositions, AOTAutograd and the joint-graph passes; then the forward
    and backward graphs run as FX code instead of generated C++ (a tiny model's training step
    compiles in ~4 s of CPU instead of ~37 s). For tests of the pass and its routes; the
    tests of Inductor's code for the op compile for real. Inductor's caches are off: there is
    no generated code to cache."""
    from torch._inductor import compile_fx as compile_fx_module

    real_compile_fx = compile_fx_module.compile_fx

    def compile_fx(*args, **kwargs):
        kwargs.setdefault("inner_compile", _graph_run_eagerly)
        return real_compile_fx(*args, **kwargs)

    with (
        mock.patch.object(compile_fx_module, "compile_fx", compile_fx),
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield


def _grad_leaves(fn, args, parameters) -> list[torch.Tensor]:
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if isinstance(fn, torch.nn.Module):
        leaves += [p for p in fn.parameters() if p.requires_grad]
    return leaves + [p for p in parameters if p.requires_grad]


def _outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _outputs(o)]
    return [t for t in (getattr(out, "loss", None), getattr(out, "logits", None)) if t is not None]


def run_and_grad(fn, args, leaves, backward_all=False):
    out = fn(*args)
    outputs = _outputs(out)
    if backward_all:
        total = sum(o.float().sum() for o in outputs if o.requires_grad)
    else:
        total = outputs[0].float().sum()  # the loss: the first output
    if not isinstance(total, torch.Tensor) or not total.requires_grad:  # an evaluation step
        return [o.detach() for o in outputs], [None] * len(leaves)
    grads = torch.autograd.grad(total, leaves, allow_unused=True) if leaves else []
    return [o.detach() for o in outputs], grads


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    got, want = (t.full_tensor() if hasattr(t, "full_tensor") else t for t in (got, want))
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    err = rel_error(got, want)
    assert err <= rtol, f"{name}: relative error {err:.3e} > {rtol:.1e} against eager"


def _recording_backend(backend: str, graphs: list, frames: list):
    """The backend ``check`` compiles with, recording each graph and call, and the context it
    runs in: "hook" is Inductor with enable()'s pre-grad hook, the others ``_capturing``."""
    if backend != "hook":
        return _capturing(backend, graphs, frames), contextlib.nullcontext()

    def recorder(gm, example_inputs):
        frames.append(1)
        graphs.append(gm)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    # With a uuid the pass runs "late" on torch 2.13: not at all on a cache hit (the cached
    # artifact already holds the op). Caches off, so that counters see every compile;
    # test_backend.py checks the cache-hit path itself.
    context = contextlib.ExitStack()
    context.enter_context(hook_enabled())
    context.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
    context.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return recorder, context


def _compare_call(fn, compiled, call_args, parameters, backward_all, rtol, dropped_logits) -> int:
    """One call of ``fn`` eagerly and compiled: outputs and gradients compared (a dropped
    logits output by shape and dtype only); returns how many gradients are present."""
    leaves = _grad_leaves(fn, call_args, parameters)
    want, want_grads = run_and_grad(fn, call_args, leaves, backward_all)
    got, got_grads = run_and_grad(compiled, call_args, leaves, backward_all)
    present = sum(g is not None for g in got_grads)
    assert len(got) == len(want)
    dropped = 0
    for i, (g, w) in enumerate(zip(got, want)):
        if g.device.type == "meta" and w.device.type != "meta":
            assert dropped_logits, f"output {i} is a meta tensor"
            assert (g.shape, g.dtype) == (w.shape, w.dtype), f"output {i}: {g} vs {w}"
            dropped += 1
        else:
            _assert_close(f"output {i}", g, w, rtol)
    assert dropped or not dropped_logits, "no output was dropped"
    assert len(got_grads) == len(want_grads)
    for i, (g, w) in enumerate(zip(got_grads, want_grads)):
        assert (g is None) == (w is None), f"gradient {i}: {g} vs eager {w}"
        if g is not None:
            _assert_close(f"gradient {i}", g, w, rtol)
    return present


def check(
    fn: Callable,
    args: tuple,
    *,
    backend: str = "cce-eager",
    dynamic: bool | None = False,
    fullgraph: bool = True,
    dtype: torch.dtype = torch.float32,
    rtol: float | None = None,
    backward_all: bool = False,
    extra_calls: list[tuple] = (),
    parameters: Iterable[torch.Tensor] = (),
    dropped_logits: bool = False,
    **compile_kwargs,
) -> Outcome:
    """Compile ``fn`` (backend "cce-eager", "cce" or "hook"), compare with eager on ``args``
    and on each of ``extra_calls`` (new sizes), return what the pass did. Gradients are
    compared for the tensor arguments that require grad, the parameters of ``fn`` if it is a
    module, and ``parameters`` (those of a model that a step function closes over).

    Outputs and gradients are compared by the oracle's NaN-aware relative error, within the
    oracle's tolerance for the head's ``dtype`` unless ``rtol`` is given (a caller that also
    compiles the rest of a model with Inductor says why it needs more). ``dropped_logits``:
    the compiled call returns its logits as data-less 'meta' tensors (CCE_ESCAPING_LOGITS=drop),
    which must have eager's shape and dtype; the other outputs are compared."""
    rtol = COMPILED_VS_EAGER_RTOL[dtype] if rtol is None else rtol
    parameters = list(parameters)
    counters.clear()
    torch._dynamo.reset()
    tracing.install()  # what importing the cce backend does
    ddp_split.install()
    graphs, frames = [], []
    compiled_backend, context = _recording_backend(backend, graphs, frames)
    with context:
        compiled = torch.compile(
            fn, backend=compiled_backend, dynamic=dynamic, fullgraph=fullgraph, **compile_kwargs
        )
        first_frames = None
        gradients = None
        for call_args in (args, *extra_calls):
            present = _compare_call(
                fn, compiled, call_args, parameters, backward_all, rtol, dropped_logits
            )
            if first_frames is None:
                first_frames, gradients = len(frames), present
    stats = dict(counters["cce_compile"])
    skipped = {k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith("skipped:")}
    return Outcome(
        stats.get("rewritten", 0), skipped, graphs, len(frames), first_frames, gradients or 0
    )
