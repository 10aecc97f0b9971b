"""DistributedDataParallel under torch.compile on several GPUs (NCCL): does the head stay fused
where Dynamo's DDPOptimizer cuts the graph at gradient buckets, and is it exact?

Run under torchrun, one process per GPU (``bench/multi_gpu.py`` does)::

    torchrun --standalone --nproc-per-node 2 bench/multi_gpu_ddp.py --out OUT

Models (float32; ``--dim`` 1024, V 128256, 4096 tokens a rank):

* ``head-then-aux``: a body, the LM head, then an auxiliary head (``--aux`` 8192 x dim: 32 MiB,
  over a default bucket) used after the LM head and before the loss, so its parameters close a
  bucket between the head and its loss (tests/passes/test_ddp_buckets.py's model at GPU size);
* ``plain``: the body, the head and the loss.

Cases: ``bucket_cap_mb`` 25 (DDP's default; its first bucket is 1 MiB) and 1 (small buckets),
through ``cce_compile.backend`` (each piece DDPOptimizer compiles is recorded: ``pieces``), and
through Inductor with the pass on its hook (``cce_compile.enable()``, what ``CCE_COMPILE=1``
installs). Each case runs two SGD steps compiled and eagerly (same weights, the compiled model's
reset to the eager one's after each step; each rank its own batch) and compares every step's
loss and every parameter's gradient, after DDP's all-reduce, with the eager run
(tests/oracle.py's compiled-vs-eager float32 tolerance). ``rewritten``: heads the pass fused
(``torch._dynamo.utils.counters``); ``op_in_piece``: which piece holds
the op (cce backend only).

``--cpu-smoke``: gloo on CPU at toy sizes (the cce cases through the pass and AOTAutograd's
eager backend, not Inductor's C++ compile).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

# name: (model, bucket_cap_mb, backend, cce_compile settings)
CASES = {
    "head-then-aux/default-buckets/cce": ("head-then-aux", 25, "cce", {}),
    "head-then-aux/small-buckets/cce": ("head-then-aux", 1, "cce", {}),
    "plain/default-buckets/cce": ("plain", 25, "cce", {}),
    "head-then-aux/small-buckets/inductor-hook": ("head-then-aux", 1, "hook", {}),
}
# Yardsticks and variants of the plain model, run with --cases: torch.compile's own error
# against eager DDP with no pass, and the pass in each mode.
EXTRA_CASES = {
    "plain/default-buckets/inductor": ("plain", 25, "inductor", {}),
    "plain/default-buckets/cce-lean": ("plain", 25, "cce", {"mode": "lean"}),
    "plain/default-buckets/cce-fast": ("plain", 25, "cce", {"mode": "fast"}),
    "plain/default-buckets/inductor-hook": ("plain", 25, "hook", {}),
    "head-then-aux/default-buckets/cce-lean": ("head-then-aux", 25, "cce", {"mode": "lean"}),
    "plain/one-graph/cce-lean": ("plain", 25, "cce", {"mode": "lean", "optimize_ddp": False}),
}


class LanguageModelHead(nn.Module):
    """A body and the LM head; with ``aux`` classes, an auxiliary head used after the LM head
    and before the loss (its small loss added)."""

    def __init__(self, dim: int, vocab: int, aux: int):
        super().__init__()
        self.vocab = vocab
        self.body = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.aux = nn.Linear(dim, aux) if aux else None

    def forward(self, x, labels):
        h = torch.relu(self.body(x))
        logits = self.lm_head(h)
        loss = F.cross_entropy(logits.view(-1, self.vocab), labels.view(-1))
        if self.aux is not None:
            loss = loss + 1e-2 * self.aux(h).square().mean()
        return loss


def _backend(kind: str, smoke: bool, pieces: list):
    """The compile backend of a case; for ``cce`` one that records the pieces it gets."""
    import cce_compile

    if kind == "inductor":
        cce_compile.disable()
        return "inductor"
    if kind == "hook":
        cce_compile.enable()
        return "inductor"
    cce_compile.disable()
    if smoke:
        from torch._dynamo.backends.debugging import aot_eager

        from cce_compile.passes.graph_pass import run_on_module

        def compile_piece(gm, example_inputs, **kwargs):
            run_on_module(gm)
            return aot_eager(gm, example_inputs)
    else:
        compile_piece = cce_compile.backend

    def recording(gm, example_inputs, **kwargs):
        pieces.append(gm)
        return compile_piece(gm, example_inputs, **kwargs)

    # As cce_compile.backend says of itself: DDPOptimizer runs the pass on the whole graph
    # before its cut (passes/ddp_split.py).
    recording.runs_cce_pass = True
    return recording


def _ddp_pair(model_kind: str, bucket_cap_mb: int, args, device):
    """The case's model (seed 0) and an eager copy of it, each under DDP with the case's
    buckets: (module, eager_module, compiled_ddp, eager_ddp)."""
    torch.manual_seed(0)
    aux = args.aux if model_kind == "head-then-aux" else 0
    module = LanguageModelHead(args.dim, args.vocab, aux).to(device)
    eager_module = copy.deepcopy(module)
    ddp_ids = [device.index] if device.type == "cuda" else None
    compiled_ddp = nn.parallel.DistributedDataParallel(
        module, device_ids=ddp_ids, bucket_cap_mb=bucket_cap_mb
    )
    eager_ddp = nn.parallel.DistributedDataParallel(
        eager_module, device_ids=ddp_ids, bucket_cap_mb=bucket_cap_mb
    )
    return module, eager_module, compiled_ddp, eager_ddp


def _apply_settings(settings: dict):
    """Sets a case's cce_compile settings and its ``optimize_ddp`` (default: Dynamo's own);
    returns the function that puts both back."""
    from cce_compile import config

    settings = dict(settings)
    optimize_ddp = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = settings.pop("optimize_ddp", optimize_ddp)
    restore = config.get()
    config.update(**settings)

    def put_back() -> None:
        config.update(**{key: getattr(restore, key) for key in settings})
        torch._dynamo.config.optimize_ddp = optimize_ddp

    return put_back


def _compared_step(models, modules, optimisers, x, labels) -> dict:
    """One SGD step of the compiled and the eager model on the same batch: the relative error
    of the loss and of every parameter's gradient (after DDP's all-reduce); then the compiled
    model's weights reset to the eager one's."""
    from oracle import rel_error

    losses = []
    for model, optimiser in zip(models, optimisers):
        optimiser.zero_grad()
        loss = model(x, labels)
        loss.backward()
        losses.append(loss.detach())
    module, eager_module = modules
    step_errors = {"loss": rel_error(losses[0], losses[1])}
    for (label, got), (_, want) in zip(module.named_parameters(), eager_module.named_parameters()):
        step_errors[f"grad {label}"] = rel_error(got.grad, want.grad)
    for optimiser in optimisers:
        optimiser.step()
    # Each step from the same weights: SGD's rounding differs between the runs by ~1e-7,
    # enough to flip a relu's gate whose input is near 0 and move a body gradient by 4e-4.
    with torch.no_grad():
        for got, want in zip(module.parameters(), eager_module.parameters()):
            got.copy_(want)
    return step_errors


def _pieces_holding_op(pieces: list) -> list[int]:
    """Indices of the compiled pieces whose graph (or a subgraph) calls the cce op."""
    op = torch.ops.cce.linear_cross_entropy.default
    return [
        i
        for i, gm in enumerate(pieces)
        if any(
            n.target is op
            for sub in gm.modules()
            if isinstance(sub, torch.fx.GraphModule)
            for n in sub.graph.nodes
        )
    ]


def run_case(name: str, args, device) -> dict:
    from oracle import COMPILED_VS_EAGER_RTOL
    from torch._dynamo.utils import counters

    model_kind, bucket_cap_mb, backend_kind, settings = {**CASES, **EXTRA_CASES}[name]
    rank = dist.get_rank()
    torch._dynamo.reset()
    counters.clear()
    module, eager_module, compiled_ddp, eager_ddp = _ddp_pair(
        model_kind, bucket_cap_mb, args, device
    )
    pieces: list = []
    compiled = torch.compile(compiled_ddp, backend=_backend(backend_kind, args.cpu_smoke, pieces))
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (module, eager_module)]
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    rtol = COMPILED_VS_EAGER_RTOL[torch.float32]
    errors = []
    began = time.perf_counter()
    batch, length = max(args.rows // 2048, 1), min(args.rows, 2048)
    put_back_settings = _apply_settings(settings)
    for _ in range(args.steps):
        x = torch.randn(batch, length, args.dim, device=device, generator=gen)
        labels = torch.randint(0, args.vocab, x.shape[:-1], device=device, generator=gen)
        errors.append(
            _compared_step((compiled, eager_ddp), (module, eager_module), optimisers, x, labels)
        )
    put_back_settings()
    seconds = time.perf_counter() - began
    holding = _pieces_holding_op(pieces)
    worst = max(max(step.values()) for step in errors)
    rewritten = counters["cce_compile"]["rewritten"]
    if backend_kind == "hook":
        import cce_compile

        cce_compile.disable()
    return dict(
        case=name,
        model=model_kind,
        bucket_cap_mb=bucket_cap_mb,
        backend=backend_kind,
        rewritten=rewritten,
        pieces=len(pieces) if backend_kind == "cce" else None,
        op_in_piece=holding if backend_kind == "cce" else None,
        errors=errors,
        worst_error=worst,
        tolerance=rtol,
        ok=(rewritten >= 1 or backend_kind == "inductor") and worst <= rtol,
        seconds=seconds,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--aux", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--one-gpu", action="store_true", help="ranks share GPU 0, over gloo")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.dim, args.vocab, args.aux, args.rows = 64, 96, 8192, 12
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        local = 0 if args.one_gpu else int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("gloo" if args.one_gpu else "nccl")
        device = torch.device("cuda", local)
    rows, failures = [], {}
    for name in args.cases.split(","):
        try:
            row = run_case(name, args, device)
        except Exception as exc:  # noqa: BLE001  (recorded; the other cases go on)
            failures[name] = f"{type(exc).__name__}: {exc}"[-3000:]
            continue
        rows.append(row)
        if dist.get_rank() == 0:
            print(
                f"{name}: rewritten {row['rewritten']} pieces {row['pieces']} op in "
                f"{row['op_in_piece']} worst {row['worst_error']:.1e} ok {row['ok']} "
                f"per step {[{k: f'{v:.1e}' for k, v in e.items()} for e in row['errors']]}",
                flush=True,
            )
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(rows=rows, failures=failures))
    if dist.get_rank() == 0:
        result = dict(
            optimize_ddp=str(torch._dynamo.config.optimize_ddp),
            shape=dict(dim=args.dim, vocab=args.vocab, aux=args.aux, rows=args.rows),
            ranks=gathered,
        )
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ddp.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
