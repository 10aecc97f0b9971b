"""The vocabulary-parallel op on 2 and 4 gloo processes against the float64 oracle.

Each rank builds the same full case, keeps its DTensor-style shard of the classifier (uneven:
the first ranks get ceil(V / world) classes), computes the loss and gradients with
``vocab_parallel_cross_entropy``, and compares the loss, hidden's gradient and its own rows of
the classifier's and bias's gradients with the single-process oracle. The collectives each
call issued are counted: two all-reduces forward, one backward (where hidden needs a
gradient), whatever the vocabulary size.

All cases of one world size run in one spawn (module-scoped fixture); each case is its own
test id.
"""

from __future__ import annotations

import contextlib
import traceback

import launcher
import pytest
import torch
from oracle import GRAD_RTOL, LOSS_RTOL, gradient_scale, loss_scale, oracle, rel_error
from strategies import build_case

VOCAB = 4097  # odd: uneven shards on 2 and 4 ranks

# name -> (build_case options, call options); every case: (2, 6) rows, D = 16.
CASES = {
    "plain": (dict(), dict()),
    "ignore_index": (dict(ignore_index=-1, ignored_fraction=0.4), dict()),
    # int32 targets wrap 2**32 + 5 to class 5, which must still count (PyTorch: int64)
    "int32-ignore_index_outside_int32": (
        dict(target_dtype=torch.int32, ignore_index=2**32 + 5, ignored_fraction=0.4),
        dict(),
    ),
    "ignore_index-0d_tensor": (
        dict(ignore_index=7, ignored_fraction=0.4),
        dict(ignore_index_as=torch.tensor),
    ),
    "smoothing-class_weights": (dict(label_smoothing=0.1, class_weights=True), dict()),
    "z_loss": (dict(z_loss=1e-3), dict()),
    "softcap-logit_scale": (dict(softcap=3.0, logit_scale=1.7), dict()),
    "bias": (dict(bias=True), dict()),
    "sum": (dict(reduction="sum", label_smoothing=0.05), dict()),
    "none-shift1": (dict(reduction="none", shift=1), dict()),
    "return_lse": (dict(z_loss=1e-4), dict(return_lse=True)),
    "all_ignored": (dict(ignored_fraction=1.0), dict()),
    "bf16": (dict(dtype=torch.bfloat16, bias=True), dict()),
    "no_hidden_grad": (dict(), dict(hidden_grad=False)),
    "compiled-aot_eager": (dict(bias=True, label_smoothing=0.1), dict(compile="aot_eager")),
    "compiled-inductor": (dict(shift=1), dict(compile="inductor")),
    "dtensor-replicated": (dict(bias=True), dict(dtensor="replicate")),
    "dtensor-sequence_parallel": (dict(), dict(dtensor="sequence")),
}
WORLD4_CASES = ["plain", "smoothing-class_weights", "bias", "compiled-aot_eager", "tiny_vocab"]
TINY_VOCAB = 3  # fewer classes than 4 ranks: the last rank's shard is empty


def _shard(vocab: int, rank: int, world: int) -> tuple[int, int]:
    sizes = [len(c) for c in torch.arange(vocab).chunk(world)]
    sizes += [0] * (world - len(sizes))
    return sum(sizes[:rank]), sizes[rank]


def _run_case(name: str, rank: int, world: int, mesh) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from cce_compile.distributed import collectives, vocab_parallel_cross_entropy

    case_opts, call = CASES.get(name, (dict(), dict()))
    vocab = TINY_VOCAB if name == "tiny_vocab" else VOCAB
    dtype = case_opts.pop("dtype", torch.float32)
    case = build_case(leading=(2, 6), dim=16, vocab=vocab, dtype=dtype, seed=3, **case_opts)
    case_opts["dtype"] = dtype
    start, rows = _shard(vocab, rank, world)
    hidden = case.hidden.clone().requires_grad_(call.get("hidden_grad", True))
    classifier = case.classifier[start : start + rows].clone().requires_grad_()
    bias = None if case.bias is None else case.bias[start : start + rows].clone().requires_grad_()
    options = case.options()
    options["ignore_index"] = call.get("ignore_index_as", int)(options["ignore_index"])
    comm = CommDebugMode()
    mode = call.get("dtensor")
    if mode is None:
        shard_args = dict(vocab_start=start, vocab_size=vocab, group=mesh.get_group())
        inputs = (hidden, classifier, case.targets, bias)
    else:
        # The DTensor entry: the classifier's rows come from distribute_tensor's own split.
        full_w = case.classifier.clone().requires_grad_()
        weight = distribute_tensor(full_w.detach(), mesh, [Shard(0)]).requires_grad_()
        classifier = weight
        if bias is not None:
            bias = distribute_tensor(case.bias.detach(), mesh, [Shard(0)]).requires_grad_()
        placement = Shard(1) if mode == "sequence" else Replicate()
        local = hidden.chunk(world, 1)[rank] if mode == "sequence" else hidden
        local = local.detach().requires_grad_()
        hidden_in = DTensor.from_local(local, mesh, [placement], run_check=False)
        shard_args = {}
        inputs = (hidden_in, weight, case.targets, bias)
    fn = vocab_parallel_cross_entropy
    if "compile" in call:
        torch._dynamo.reset()
        fn = torch.compile(fn, backend=call["compile"], fullgraph=True)
    collectives.ISSUED.clear()
    return_lse = call.get("return_lse", False)
    with comm if "compile" not in call else contextlib.nullcontext():
        out = fn(*inputs, **shard_args, **options, return_lse=return_lse)
        ours = out if isinstance(out, tuple) else (out,)
        forward_collectives = sum(collectives.ISSUED.values())
        gen = torch.Generator().manual_seed(7)
        upstream = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in ours]
        ours = [o.full_tensor() if isinstance(o, DTensor) else o for o in ours]
        total = sum((o.double() * u).sum() for o, u in zip(ours, upstream))
        total.backward()
    backward_collectives = sum(collectives.ISSUED.values()) - forward_collectives

    for t in case.leaves():
        t.requires_grad_()
    if not call.get("hidden_grad", True):
        case.hidden.requires_grad_(False)
    expected = oracle(case, return_lse=return_lse)
    expected = expected if isinstance(expected, tuple) else (expected,)
    errors = {}
    for label, a, e, scale in zip(("loss", "lse"), ours, expected, (loss_scale(case), 0.0)):
        errors[label] = (rel_error(a, e, scale), LOSS_RTOL[dtype])
    leaves = [t for t in case.leaves() if t.requires_grad]
    want = torch.autograd.grad(
        sum((e * u).sum() for e, u in zip(expected, upstream)), leaves, allow_unused=True
    )
    scales = gradient_scale(case, upstream[0], upstream[1] if return_lse else None, leaves)
    wanted = dict(zip([id(t) for t in leaves], zip(want, scales)))
    if mode is None:
        got = {"hidden": (hidden, case.hidden), "classifier": (classifier, case.classifier)}
        if bias is not None:
            got["bias"] = (bias, case.bias)
        slices = {"classifier": slice(start, start + rows), "bias": slice(start, start + rows)}
    else:
        got = {"hidden": (local, case.hidden), "classifier": (weight, case.classifier)}
        if bias is not None:
            got["bias"] = (bias, case.bias)
        hidden_rows = local.shape[1]
        seq = slice(rank * hidden_rows, (rank + 1) * hidden_rows) if mode == "sequence" else None
        slices = {"hidden": (slice(None), seq) if seq else slice(None)}
    for label, (leaf, full) in got.items():
        if not leaf.requires_grad:
            continue
        expect, scale = wanted[id(full)]
        grad = leaf.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        expect = expect[slices.get(label, slice(None))]
        errors[f"grad_{label}"] = (rel_error(grad, expect, scale), GRAD_RTOL[dtype])
        errors[f"grad_{label}_dtype"] = (float(grad.dtype != leaf.dtype), 0.0)
    return dict(
        errors=errors,
        forward_collectives=forward_collectives,
        backward_collectives=backward_collectives,
        dtensor_collectives=None
        if "compile" in call
        else {str(k): v for k, v in comm.get_comm_counts().items()},
    )


def _worker(rank: int, world: int, names: list[str]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name in names:
        try:
            results[name] = _run_case(name, rank, world, mesh)
        except Exception:  # noqa: BLE001  (one case's failure is that test's, not all)
            results[name] = dict(error=traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return launcher.run(_worker, 2, list(CASES))


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return launcher.run(_worker, 4, WORLD4_CASES)


def _check(results: list[dict], name: str) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert "error" not in got, f"rank {rank}:\n{got.get('error')}"
        for label, (err, tol) in got["errors"].items():
            assert err <= tol, f"rank {rank}: {label} relative error {err:.3e} > {tol:.1e}"
        _, call = CASES.get(name, (dict(), dict()))
        # The op's own collectives: the row max and the packed sums; hidden's gradient once.
        assert got["forward_collectives"] == 2, got
        reduces_in_op = call.get("dtensor") is None and call.get("hidden_grad", True)
        assert got["backward_collectives"] == int(reduces_in_op), got
        dtensor = got["dtensor_collectives"]
        if call.get("dtensor") == "replicate":  # from_local's backward: one all-reduce
            assert dtensor == {"c10d_functional.all_reduce": 1}, dtensor
        elif call.get("dtensor") == "sequence":  # gather forward, reduce-scatter backward
            assert dtensor == {
                "c10d_functional.all_gather_into_tensor": 1,
                "c10d_functional.reduce_scatter_tensor": 1,
            }, dtensor
        elif dtensor is not None:
            assert dtensor == {}, dtensor


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks(world2, name):
    _check(world2, name)


@pytest.mark.parametrize("name", WORLD4_CASES)
def test_four_ranks(world4, name):
    _check(world4, name)
