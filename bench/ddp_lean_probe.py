"""Locate the lean-mode body-gradient error of ``bench/multi_gpu_ddp.py``'s plain model under DDP.

The plain model (body Linear + relu, lm_head without bias, mean cross-entropy), compiled with the
pass, against eager DDP over ``--steps`` SGD steps, each rank its own batch (as in
multi_gpu_ddp.py). At every step each rank also checks, against float64 recomputed from the
op's own inputs:

* ``saved``: did the op's backward read the hidden and classifier its forward read (largest
  difference; a non-zero one is a buffer written between them), and the classifier of now;
* ``dh``: the op's d hidden (relative error, worst row, rows off by more than 1e-4 and the first
  few of them); against two wrong ones, from TF32-rounded operands and from the previous step's
  classifier (a defect of either kind lies much nearer its own than the ~2e-4 between them and
  float64); ``replay``: the same backward call again after the step on copies of its inputs (a
  right replay of a wrong call points at the state of that moment: thread, stream, memory); the
  thread and TF32 settings the call saw;
* ``dW_lm``: the op's d classifier;
* ``body``: this rank's body gradients rebuilt from the op's d hidden (``from_op``) and from the
  float64 one (``f64``), and, after an all-reduce of each, the compiled and eager models' body
  gradients against both: which of the op, Inductor's code after it, or DDP is wrong.

The records are host copies (no device memory), taken from step ``--check-from`` (2) on, so
that the steps before run as in multi_gpu_ddp.py: a defect that depends on the caching
allocator's state stays. ``--check-from 99`` checks nothing (the bare reproduction).

One command, on 2 GPUs (about a minute)::

    torchrun --standalone --nproc-per-node 2 bench/ddp_lean_probe.py --out OUT

``--one-gpu``: the ranks share GPU 0 and all-reduce over gloo (a machine of one GPU).
``--emulate-ranks 2`` on one GPU (``--nproc-per-node 1``): both ranks' batches in one process
without DDP, gradients averaged, each call checked (does rank 1's data alone bring it back?).

What it showed on CPU (2026-11-28, torch 2.13, gloo, dim 64, V 2000, 256 rows a rank, 3-5
steps): exact at every step (d hidden 2.2e-7 from float64, body gradients 2.7e-7), through the
PyTorch path under AOTAutograd and under Inductor, and through the Triton path in the
interpreter under both (V 1000, 128 rows); ``--emulate-ranks 2`` gives the same numbers as the
two ranks (the same weights at every step).

On CPU (gloo, toy sizes; ``--backend aot-eager``: the pass without Inductor's C++ compile;
``--triton`` with TRITON_INTERPRET=1: the Triton path in the interpreter)::

    torchrun --standalone --nproc-per-node 2 bench/ddp_lean_probe.py --cpu --backend aot-eager
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cce_compile  # noqa: E402
from cce_compile import config  # noqa: E402
from cce_compile.op import dispatch  # noqa: E402
from cce_compile.op.signature import BACKWARD  # noqa: E402

ROW_TOLERANCE = 1e-4


class Plain(nn.Module):
    def __init__(self, dim: int, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.body = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x, labels):
        h = torch.relu(self.body(x))
        logits = self.lm_head(h)
        return F.cross_entropy(logits.view(-1, self.vocab), labels.view(-1))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _on_host(args, names) -> dict[str, torch.Tensor]:
    """Host copies of the tensors among ``args``' arguments ``names``: nothing is allocated
    on the device, so the caching allocator's state (which a defect may depend on) is kept."""
    values = {name: getattr(args, name) for name in names}
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    return {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}


def record_op_calls(records: dict, armed: list) -> None:
    """Keep host copies of what the op's forward and lean backward read and return, on calls
    made while ``armed[0]``."""
    real_forward, real_recompute = dispatch.forward, dispatch.recompute

    def forward(args):
        out = real_forward(args)
        if armed[0]:
            records["forward"] = _on_host(args, ("hidden", "classifier"))
        return out

    def recompute(args, needs, gradients_rows):
        grads = real_recompute(args, needs, gradients_rows)
        if not armed[0]:
            return grads
        inputs = _on_host(args, BACKWARD.names)
        on_host = args.replace(**inputs)  # holds none of the call's own tensors
        matmul = torch.backends.cuda.matmul
        records["backward"] = dict(
            inputs=inputs,
            # The same call again after the step, on device copies of its inputs.
            replay=lambda device: real_recompute(
                on_host.replace(**{k: v.to(device) for k, v in inputs.items()}),
                needs,
                gradients_rows,
            ),
            classifier_is_parameter=args.classifier.data_ptr(),
            grads=[None if g is None else g.detach().to("cpu", copy=True) for g in grads],
            thread=threading.current_thread().name,
            tf32=(matmul.allow_tf32, getattr(matmul, "fp32_precision", None)),
            matmul_precision=torch.get_float32_matmul_precision(),
        )
        return grads

    dispatch.forward, dispatch.recompute = forward, recompute


def tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to TF32's 10-bit mantissa (to nearest), as float64."""
    bits = t.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).double()


def float64_head(hidden, classifier, targets, grad_loss, previous=None, chunk: int = 512):
    """Mean cross-entropy's lse, d hidden and d classifier in float64 (rows in chunks), and
    two wrong d hiddens to tell defects apart: from TF32-rounded operands, and from the
    ``previous`` step's classifier."""
    h = hidden.reshape(-1, hidden.shape[-1]).double()
    w = classifier.double()
    w_tf32 = tf32(w)
    w_prev = None if previous is None else previous.to(w.device).double()
    t = targets.reshape(-1)
    n = h.shape[0]
    lse, dh, dw = torch.empty(n, dtype=torch.float64, device=h.device), torch.empty_like(h), 0
    dh_tf32, dh_prev = torch.empty_like(h), torch.zeros_like(h)
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        z = h[rows] @ w.T
        lse[rows] = torch.logsumexp(z, -1)
        g = torch.softmax(z, -1)
        g[torch.arange(g.shape[0], device=g.device), t[rows]] -= 1
        g *= grad_loss.double() / n
        dh[rows] = g @ w
        dh_tf32[rows] = tf32(g) @ w_tf32
        if w_prev is not None:
            dh_prev[rows] = g @ w_prev
        dw = dw + g.T @ h[rows]
    return lse, dh, dw, dh_tf32, (None if w_prev is None else dh_prev)


def diagnose(records: dict, x: torch.Tensor, module: Plain, previous) -> tuple[dict, dict]:
    """This rank's checks of the op's last call (module docstring), and its body gradients
    (from the op's d hidden and from float64) for the all-reduce; ``previous``: the
    classifier of the step before."""
    fwd, bwd = records["forward"], records["backward"]
    inputs, device = bwd["inputs"], x.device
    out = dict(thread=bwd["thread"], tf32=bwd["tf32"], matmul_precision=bwd["matmul_precision"])
    row_index = inputs.get("row_index")
    out["row_index"] = None if row_index is None else row_index.numel()
    out["saved hidden"] = float((fwd["hidden"] - inputs["hidden"]).abs().max())
    out["saved classifier"] = float((fwd["classifier"] - inputs["classifier"]).abs().max())
    now = module.lm_head.weight.detach()
    out["classifier vs now"] = float((inputs["classifier"].to(device) - now).abs().max())
    out["classifier is the parameter"] = bwd["classifier_is_parameter"] == now.data_ptr()
    h, targets = inputs["hidden"].to(device), inputs["targets"].to(device)
    lse64, dh64, dw64, dh_tf32, dh_prev = float64_head(
        h, inputs["classifier"].to(device), targets, inputs["grad_loss"].to(device), previous
    )
    out["lse"] = rel(inputs["lse"].to(device).reshape(-1), lse64)
    grad_h, grad_w, _ = (None if g is None else g.to(device) for g in bwd["grads"])
    dim = h.shape[-1]
    got = grad_h.reshape(-1, dim).double()
    out["dh"] = rel(got, dh64)
    out["dh vs tf32 operands"] = rel(got, dh_tf32)
    if dh_prev is not None:
        out["dh vs previous classifier"] = rel(got, dh_prev)
    replayed = bwd["replay"](device)[0].reshape(-1, dim)
    out["replay dh"] = rel(replayed, dh64)
    out["replay vs op dh (max abs)"] = float((replayed.double() - got).abs().max())
    row_err = (got - dh64).norm(dim=1) / dh64.norm(dim=1).clamp_min(1e-300)
    bad = (row_err > ROW_TOLERANCE).nonzero().squeeze(1)
    out["dh worst row"] = (int(row_err.argmax()), float(row_err.max()))
    out["dh rows off"] = int(bad.numel())
    out["dh first rows off"] = bad[:8].tolist()
    if grad_w is not None:
        out["dW_lm"] = rel(grad_w, dw64)
    mask = (h.reshape(-1, dim) > 0).double()
    x2 = x.reshape(-1, x.shape[-1]).double()
    body = {}
    for label, dh in (("from_op", got), ("f64", dh64)):
        pre = dh * mask
        body[label] = (pre.T @ x2, pre.sum(0))
    out["body local from_op vs f64"] = [rel(a, b) for a, b in zip(body["from_op"], body["f64"])]
    return out, body


def step_report(compiled, eager, body, world: int) -> dict:
    """After the all-reduce: the compiled and eager body gradients against the rebuilt ones."""
    averaged = {}
    for label, (dw, db) in body.items():
        for t in (dw, db):
            dist.all_reduce(t)
            t /= world
        averaged[label] = (dw, db)
    report = {}
    for name, model in (("compiled", compiled), ("eager", eager)):
        grads = (model.body.weight.grad, model.body.bias.grad)
        for label, ref in averaged.items():
            report[f"{name} vs {label}"] = [rel(g, r) for g, r in zip(grads, ref)]
    return report


def _backend(kind: str):
    if kind == "cce":
        return cce_compile.backend
    if kind == "hook":
        cce_compile.enable()
        return "inductor"
    from torch._dynamo.backends.debugging import aot_eager

    from cce_compile.passes.graph_pass import run_on_module

    def pass_then_aot_eager(gm, example_inputs, **kwargs):
        run_on_module(gm)
        return aot_eager(gm, example_inputs)

    pass_then_aot_eager.runs_cce_pass = True
    return pass_then_aot_eager


def compared(losses: list, module: Plain, eager_module: Plain) -> dict[str, float]:
    """The compiled model's loss and gradients against the eager model's."""
    errors = {"loss": rel(losses[0], losses[1])}
    for (label, got), (_, want) in zip(module.named_parameters(), eager_module.named_parameters()):
        errors[f"grad {label}"] = rel(got.grad, want.grad)
    return errors


def run_emulated(args, device) -> list[dict]:
    """One process, no DDP: each step the batches of ``--emulate-ranks`` ranks in turn, their
    gradients averaged as DDP's all-reduce does (the same weights at every step as a run on
    that many ranks): a data-dependent defect on one GPU, each batch's call checked."""
    ranks = args.emulate_ranks
    torch.manual_seed(0)
    module = Plain(args.dim, args.vocab).to(device)
    eager_module = copy.deepcopy(module)
    compiled = torch.compile(module, backend=_backend(args.backend))
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (module, eager_module)]
    gens = [
        torch.Generator(device=device).manual_seed(100 + r + args.seed_offset) for r in range(ranks)
    ]
    batch, length = max(args.rows // 2048, 1), min(args.rows, 2048)
    records: dict = {}
    armed = [False]
    record_op_calls(records, armed)
    steps, previous = [], None
    for step in range(1, args.steps + 1):
        armed[0] = step >= args.check_from
        for optimiser in optimisers:
            optimiser.zero_grad()
        losses, checks = [0.0, 0.0], []
        for gen in gens:
            x = torch.randn(batch, length, args.dim, device=device, generator=gen)
            labels = torch.randint(0, args.vocab, x.shape[:-1], device=device, generator=gen)
            records.clear()
            loss = compiled(x, labels)
            loss.backward()
            losses[0] += loss.detach() / ranks
            if "backward" in records:
                checks.append(diagnose(records, x, module, previous)[0])
            loss = eager_module(x, labels)
            loss.backward()
            losses[1] += loss.detach() / ranks
        for parameter in (*module.parameters(), *eager_module.parameters()):
            parameter.grad /= ranks
        errors = compared(losses, module, eager_module)
        print(f"step {step}: " + " ".join(f"{k} {v:.1e}" for k, v in errors.items()))
        for r, check in enumerate(checks):
            print(f"  batch of rank {r}: {check}", flush=True)
        steps.append(dict(step=step, errors=errors, checks=checks))
        records.clear()
        previous = module.lm_head.weight.detach().to("cpu", copy=True)
        for optimiser in optimisers:
            optimiser.step()
    return steps


def run(args, device) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = Plain(args.dim, args.vocab).to(device)
    eager_module = copy.deepcopy(module)
    ids = [device.index] if device.type == "cuda" else None
    compiled_ddp = nn.parallel.DistributedDataParallel(module, device_ids=ids)
    eager_ddp = nn.parallel.DistributedDataParallel(eager_module, device_ids=ids)
    torch._dynamo.config.optimize_ddp = args.optimize_ddp
    compiled = torch.compile(compiled_ddp, backend=_backend(args.backend))
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (module, eager_module)]
    gen = torch.Generator(device=device).manual_seed(100 + rank + args.seed_offset)
    batch, length = max(args.rows // 2048, 1), min(args.rows, 2048)
    records: dict = {}
    armed = [False]  # record only the steps checked: step 1's copies would change step 2's memory
    record_op_calls(records, armed)
    steps = []
    previous = None  # the classifier of the step before
    for step in range(1, args.steps + 1):
        x = torch.randn(batch, length, args.dim, device=device, generator=gen)
        labels = torch.randint(0, args.vocab, x.shape[:-1], device=device, generator=gen)
        records.clear()
        armed[0] = step >= args.check_from
        losses = []
        for model, optimiser in zip((compiled, eager_ddp), optimisers):
            optimiser.zero_grad()
            loss = model(x, labels)
            loss.backward()
            losses.append(loss.detach())
        errors = compared(losses, module, eager_module)
        row = dict(step=step, errors=errors)
        if "backward" in records:
            local, body = diagnose(records, x, module, previous)
            row["rank checks"] = local
            row["after all-reduce"] = step_report(module, eager_module, body, world)
        gathered = [None] * world
        dist.all_gather_object(gathered, row)
        if rank == 0:
            print(f"step {step}: " + " ".join(f"{k} {v:.1e}" for k, v in errors.items()))
            for r, got in enumerate(gathered):
                print(f"  rank {r}: {got.get('rank checks')}")
            print(f"  all-reduced body grads: {row.get('after all-reduce')}", flush=True)
        steps.append(gathered)
        records.clear()
        # On the host, like the records (see ``armed``).
        previous = module.lm_head.weight.detach().to("cpu", copy=True)
        for optimiser in optimisers:
            optimiser.step()
    return steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--triton", action="store_true", help="CPU: the Triton path")
    parser.add_argument("--backend", choices=("cce", "hook", "aot-eager"), default="cce")
    parser.add_argument("--mode", default="lean")
    parser.add_argument("--dim", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--rows", type=int)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed-offset", type=int, default=0)
    parser.add_argument(
        "--emulate-ranks", type=int, default=0, help="one process: run_emulated's ranks"
    )
    parser.add_argument(
        "--check-from", type=int, default=2, help="first step checked (records nothing before)"
    )
    parser.add_argument("--no-optimize-ddp", dest="optimize_ddp", action="store_false")
    parser.add_argument(
        "--one-gpu", action="store_true", help="every rank on GPU 0, over gloo (NCCL: one each)"
    )
    args = parser.parse_args(argv)
    small = dict(dim=64, vocab=2000, rows=256) if args.cpu else {}
    full = dict(dim=1024, vocab=128256, rows=4096)
    for key, value in full.items():
        if getattr(args, key) is None:
            setattr(args, key, small.get(key, value))
    if args.cpu:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
        if args.triton:
            from cce_compile.implementations import triton_path

            dispatch.implementation_for = lambda device: triton_path
    else:
        local = 0 if args.one_gpu else int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("gloo" if args.one_gpu else "nccl")
        device = torch.device("cuda", local)
    if args.emulate_ranks and dist.get_world_size() != 1:
        raise SystemExit("--emulate-ranks runs in one process (--nproc-per-node 1)")
    with config.override(mode=args.mode):
        steps = (run_emulated if args.emulate_ranks else run)(args, device)
    if dist.get_rank() == 0 and args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        shape = dict(dim=args.dim, vocab=args.vocab, rows=args.rows)
        text = json.dumps(dict(shape=shape, backend=args.backend, steps=steps), indent=1)
        (args.out / "ddp_lean_probe.json").write_text(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
