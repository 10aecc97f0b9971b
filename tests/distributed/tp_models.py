"""Tiny models and a graph-capturing backend for the distributed pass tests (run in workers).

``capturing_backend`` runs the pass (``graph_pass.run_on_module``, as ``cce_compile.backend``
does, so tensor-parallel heads go through ``passes.tensor_parallel``), then AOTAutograd without
Inductor, keeping the forward and backward graphs so a test can count the collectives they issue.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from oracle import rel_error
from torch.distributed.tensor import DTensor

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


class HeadModel(nn.Module):
    """trunk (a linear layer) -> layer norm -> lm_head: every part has parameters."""

    def __init__(self, dim: int, vocab: int, bias: bool = False):
        super().__init__()
        self.trunk = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(torch.relu(self.trunk(x))))


@dataclasses.dataclass
class Captured:
    sites: list  # what tensor_parallel.match returned (sites and rejections)
    forward: list = dataclasses.field(default_factory=list)  # AOT forward graphs
    backward: list = dataclasses.field(default_factory=list)

    def collectives(self, which: str) -> dict[str, int]:
        """``_c10d_functional`` calls in the AOT forward or backward graphs, by name."""
        counts: dict[str, int] = {}
        for gm in getattr(self, which):
            for node in gm.graph.nodes:
                name = getattr(node.target, "__name__", "")
                if "_c10d_functional" in str(node.target) and name.split(".")[0] in COLLECTIVES:
                    key = name.split(".")[0]
                    counts[key] = counts.get(key, 0) + 1
        return counts

    def op_modes(self) -> list[str]:
        """The mode of each vocabulary-parallel op in the AOT forward graphs."""
        from cce_compile.distributed.signature import FORWARD

        op = torch.ops.cce.vocab_parallel_cross_entropy.default
        nodes = [n for gm in self.forward for n in gm.graph.nodes if n.target is op]
        return [FORWARD.bind(n.args).mode for n in nodes]

    @property
    def rewritten(self) -> int:
        from cce_compile.passes.tensor_parallel import TensorParallelSite

        return sum(isinstance(s, TensorParallelSite) for s in self.sites)


def capturing_backend(captured: Captured, rewrite: bool = True):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from cce_compile.passes.graph_pass import run_on_module
    from cce_compile.passes.matching import find_sites

    def keep(into):
        def compiler(gm, example_inputs):
            into.append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    inner = aot_autograd(fw_compiler=keep(captured.forward), bw_compiler=keep(captured.backward))

    def backend(gm, example_inputs):
        # What the pass sees, then the pass itself (as cce_compile.backend runs it).
        captured.sites.extend(find_sites(gm.graph))
        if rewrite:
            run_on_module(gm)
        return inner(gm, example_inputs)

    return backend


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if isinstance(t, DTensor) else t


def gradient_errors(model: nn.Module, reference: nn.Module) -> dict[str, float]:
    """Relative error of every parameter's gradient (gathered) against the reference's."""
    ours = dict(model.named_parameters())
    errors = {}
    for name, ref in reference.named_parameters():
        grad = full(ours[name].grad)
        if grad is None or ref.grad is None:  # both without a gradient is agreement
            errors[name] = 0.0 if grad is None and ref.grad is None else float("inf")
        else:
            errors[name] = rel_error(grad, ref.grad)
    return errors
