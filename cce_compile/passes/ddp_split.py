"""DistributedDataParallel under torch.compile: the pass runs before DDP cuts the graph.

Dynamo's ``DDPOptimizer`` cuts each compiled frame of a DDP model at its gradient buckets'
boundaries and compiles every piece on its own, so that a bucket's all-reduce can start while
the backward of the pieces before it runs. A boundary between the head and its loss (a
parameter used after the head, such as a value head, an auxiliary loss or a multi-token
predictor, filling a bucket) left the logits an input of the loss's piece: no piece could fuse
them. The pass therefore runs on the whole graph first: the fused op reads hidden, the
classifier and the targets, so it lands in the classifier's bucket, and the pieces that the
backend or Inductor's hook then sees hold it already (the pass leaves a rewritten site alone).

It runs there only for compiles that get the pass anyway: the ``cce`` backend, or Inductor
with the pass on its pre-grad hook (``enable()``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .graph_pass import run_on_module

# The attribute by which a backend says it runs the pass on the graphs it gets (the cce
# backend sets it).
RUNS_THE_PASS = "runs_cce_pass"


def _gets_the_pass(backend_compile_fn: Any) -> bool:
    """Does the backend the pieces go to run the pass: one that says so (the cce backend), or
    Inductor with the pass on its pre-grad hook?"""
    from .install import enabled

    backend = getattr(backend_compile_fn, "compiler_fn", backend_compile_fn)
    if getattr(backend, RUNS_THE_PASS, False):
        return True
    inductor = isinstance(backend, torch._TorchCompileInductorWrapper) or getattr(
        backend, "__name__", ""
    ) in ("compile_fx", "inductor")
    return inductor and enabled()


def install() -> None:
    """Run the pass on each graph ``DDPOptimizer`` is about to cut (idempotent)."""
    from torch._dynamo.backends import distributed

    optimizer = getattr(distributed, "DDPOptimizer", None)
    compile_fn = getattr(optimizer, "compile_fn", None)
    if compile_fn is None or getattr(compile_fn, "_cce_runs_the_pass_first", False):
        return

    @functools.wraps(compile_fn)
    def compile_whole_first(self, gm, example_inputs, **compiler_configs):
        if _gets_the_pass(self.backend_compile_fn):
            run_on_module(gm)
        return compile_fn(self, gm, example_inputs, **compiler_configs)

    compile_whole_first._cce_runs_the_pass_first = True  # type: ignore[attr-defined]
    optimizer.compile_fn = compile_whole_first
