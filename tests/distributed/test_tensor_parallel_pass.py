"""The tensor-parallel lm_head in Dynamo graphs: ``passes.tensor_parallel`` on 2 gloo ranks.

Each case parallelises a tiny model's lm_head (``ColwiseParallel`` in the forms torchtitan and
users write), compiles the loss step with a backend that runs the recogniser and AOTAutograd,
and compares the loss and every parameter's gradient with the same model run in one process,
eagerly and unsharded. The op runs in the mode ``CCE_MODE`` asks (lean unless the case's name
says fast or auto; auto chooses fast on a CPU), which the rewritten graph's op must carry. The
AOT graphs show the collectives DTensor issues around the op (the op's own are counted at run
time): forward none, backward one reduction of hidden's gradient (all-reduce, or
reduce-scatter under sequence parallelism), in either mode; ``loss_parallel``'s own forward
has three all-reduces of N x V_local work.

Forms left alone are checked for their reason, and for running unchanged.
"""

from __future__ import annotations

import contextlib
import traceback

import launcher
import pytest
import torch
import torch.nn.functional as F
from oracle import COMPILED_VS_EAGER_RTOL, rel_error

DIM, VOCAB = 16, 97  # 49 + 48 classes
RTOL = COMPILED_VS_EAGER_RTOL[torch.float32]

# name -> (plan, loss form, loss options, expectation)
REWRITTEN = {
    "colwise-loss_parallel": ("colwise", "flat", dict()),
    "colwise-bias-hf_shift": ("colwise_bias", "hf_shift", dict()),
    "colwise-ignore_index-sum": ("colwise", "flat", dict(ignore_index=5, reduction="sum")),
    "sequence_parallel": ("sequence_parallel", "flat", dict()),
    "fast-colwise-bias-hf_shift": ("colwise_bias", "hf_shift", dict()),
    "fast-sequence_parallel-ignore_index": ("sequence_parallel", "flat", dict(ignore_index=5)),
    "auto-replicated_logits-smoothing": ("replicated", "flat", dict(label_smoothing=0.1)),
    "replicated_logits-smoothing-scale": (
        "replicated",
        "scaled",
        dict(label_smoothing=0.1, reduction="sum"),
    ),
    "replicated_logits-softcap-none": ("replicated", "softcap", dict(reduction="none")),
    "replicated_logits-class_weights": ("replicated", "flat", dict(weight=True)),
}
LEFT_ALONE = {
    "per_shard_logits": ("colwise_local", "flat_local", dict(), "to_local() of logits placed"),
    "rowwise_head": ("rowwise", "flat", dict(), "not (Shard(0),)"),
    "no_grad_head": ("replicated", "no_grad_head", dict(), "grad mode changes"),
}


def _plan(kind: str):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    head = {
        "colwise": ColwiseParallel(use_local_output=False),
        "colwise_bias": ColwiseParallel(use_local_output=False),
        "colwise_local": ColwiseParallel(),
        "replicated": ColwiseParallel(output_layouts=Replicate()),
        "rowwise": RowwiseParallel(input_layouts=Replicate()),
    }
    if kind == "sequence_parallel":
        return {
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
        }
    return {"lm_head": head[kind]}


def _loss(logits, targets, form: str, options: dict, weight):
    if form == "hf_shift":  # Hugging Face's causal-LM loss
        logits = logits[..., :-1, :].float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets[..., 1:].reshape(-1), **options)
    if form == "scaled":
        logits = logits * 0.5
    if form == "softcap":
        logits = 4.0 * torch.tanh(logits / 4.0)
    if form == "flat_local":  # each rank's own classes: local targets
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten() % logits.shape[-1])
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), weight=weight, **options)


def _mode(name: str) -> str:
    """The CCE_MODE a case runs under: lean unless its name asks for fast or auto."""
    return next((m for m in ("fast", "auto") if name.startswith(f"{m}-")), "lean")


def _run(name: str, rank: int, world: int, mesh) -> dict:
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from tp_models import Captured, HeadModel, capturing_backend, full, gradient_errors

    from cce_compile.distributed import collectives

    kind, form, options = (REWRITTEN.get(name) or LEFT_ALONE[name])[:3]
    options = dict(options)
    weight = None
    if options.pop("weight", False):
        weight = torch.rand(VOCAB, generator=torch.Generator().manual_seed(2)) + 0.5
    torch.manual_seed(0)
    reference = HeadModel(DIM, VOCAB, bias=kind == "colwise_bias")
    model = HeadModel(DIM, VOCAB, bias=kind == "colwise_bias")
    model.load_state_dict(reference.state_dict())
    parallelize_module(model, mesh, _plan(kind))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, DIM, generator=gen)
    targets = torch.randint(0, VOCAB, (2, 8), generator=gen)
    targets[0, :3] = options.get("ignore_index", -100)
    sequence = kind == "sequence_parallel"
    x_local = x.chunk(world, dim=1)[rank] if sequence else x

    def step(x, y, net):
        if form == "no_grad_head":  # eager: no gradient reaches the head or passes it
            hidden = net.norm(torch.relu(net.trunk(x)))
            with torch.no_grad():
                logits = net.lm_head(hidden)
            return _loss(logits, y, "flat", options, weight) + 0 * hidden.sum()
        return _loss(net(x), y, form, options, weight)

    # Eager, one process, unsharded; the per-shard form compares with its own eager run.
    ref_x = x_local.clone().requires_grad_() if form == "flat_local" else x.clone().requires_grad_()
    eager_net = model if form == "flat_local" else reference
    expected = step(ref_x, targets, eager_net)
    expected.sum().backward()
    expected_grads = {n: full(p.grad) for n, p in eager_net.named_parameters()}
    if form == "flat_local":
        model.zero_grad()

    captured = Captured(sites=[])
    compiled = torch.compile(
        lambda x, y: step(x, y, model), backend=capturing_backend(captured), fullgraph=True
    )
    torch._dynamo.reset()
    collectives.ISSUED.clear()
    x_in = x_local.clone().requires_grad_()
    dtensor_logits = kind in ("colwise", "colwise_bias", "sequence_parallel")
    with loss_parallel() if dtensor_logits else contextlib.nullcontext():
        loss = compiled(x_in, targets)
        loss.sum().backward()
    op_collectives = dict(collectives.ISSUED)
    if sequence:  # each rank ran the unsharded trunk on its part of the sequence
        for p in model.trunk.parameters():
            torch.distributed.all_reduce(p.grad)
    errors = {"loss": rel_error(full(loss), full(expected))}
    if form == "flat_local":
        grads = {n: rel_error(full(p.grad), expected_grads[n]) for n, p in model.named_parameters()}
    else:
        grads = gradient_errors(model, reference)
    errors.update({f"grad_{n}": e for n, e in grads.items()})
    want_x = (
        ref_x.grad.chunk(world, dim=1)[rank] if sequence and form != "flat_local" else ref_x.grad
    )
    errors["grad_input"] = rel_error(x_in.grad, want_x)
    return dict(
        errors=errors,
        rewritten=captured.rewritten,
        reasons=[(s.reason, s.detail) for s in captured.sites if hasattr(s, "reason")],
        forward=captured.collectives("forward"),
        backward=captured.collectives("backward"),
        op=op_collectives,
        op_modes=captured.op_modes(),
        loss_type=type(loss).__name__,
        head_sharded=isinstance(model.lm_head.weight, DTensor)
        and tuple(model.lm_head.weight.placements) == (Shard(0),),
    )


def _worker(rank: int, world: int, names: list[str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import cce_compile

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name in names:
        try:
            with cce_compile.config.override(mode=_mode(name)):
                results[name] = _run(name, rank, world, mesh)
        except Exception:  # noqa: BLE001
            results[name] = dict(error=traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launcher.run(_worker, 2, [*REWRITTEN, *LEFT_ALONE])


def _exact(got: dict, rank: int) -> None:
    assert "error" not in got, f"rank {rank}:\n{got.get('error')}"
    for label, err in got["errors"].items():
        assert err <= RTOL, f"rank {rank}: {label} relative error {err:.3e} > {RTOL:.1e}"


@pytest.mark.parametrize("name", list(REWRITTEN))
def test_rewritten_and_exact(results, name):
    kind = REWRITTEN[name][0]
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        _exact(got, rank)
        assert got["rewritten"] == 1 and not got["reasons"], got["reasons"]
        # auto: fast where gradients are wanted and the loss is a scalar (here, on a CPU)
        want_mode = "lean" if _mode(name) == "lean" else "fast"
        assert got["op_modes"] == [want_mode], got["op_modes"]
        # The op: one all-gather of the packed statistics (fast: one chunk of 16 rows);
        # hidden's gradient is DTensor's.
        assert got["op"] == {"all_gather": 1}, got["op"]
        if kind == "sequence_parallel":  # the norm's gather is the model's own
            assert got["forward"] == {"all_gather_into_tensor": 1}, got["forward"]
            assert got["backward"] == {"reduce_scatter_tensor": 1}, got["backward"]
        else:
            assert got["forward"] == {}, got["forward"]
            assert got["backward"] == {"all_reduce": 1}, got["backward"]
        is_dtensor = kind != "replicated"  # the graph's loss keeps its type
        assert got["loss_type"] == ("DTensor" if is_dtensor else "Tensor")


@pytest.mark.parametrize("name", list(LEFT_ALONE))
def test_left_alone_with_reason(results, name):
    words = LEFT_ALONE[name][3]
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        _exact(got, rank)
        assert got["rewritten"] == 0
        assert [r for r, _ in got["reasons"]] == ["dtensor_weights"], got["reasons"]
        assert words in got["reasons"][0][1], got["reasons"]
