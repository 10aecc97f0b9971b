"""The vocabulary-parallel op on 2 and 4 gloo processes against the float64 oracle.

Each rank builds the same full case, keeps its DTensor-style shard of the classifier (uneven:
the first ranks get ceil(V / world) classes), computes the loss and gradients with
``vocab_parallel_cross_entropy``, and compares the loss, hidden's gradient and its own rows of
the classifier's and bias's gradients with the single-process oracle.

Every collective that reaches gloo during the forward and during the backward is recorded
from the profiler (``comm_trace``: the op's own, DTensor's, any other), with what this rank
sent, and so are the operations that synchronise the host on a GPU. Per call the op issues
one all-gather forward, of 2 float32 a kept row (3 with label smoothing): each rank's packed
lse, target logit (and weighted sum); and backward only hidden's gradient reduction, of the
kept rows, by the op (plain tensors) or by DTensor (DTensor inputs). The forward's one
synchronisation is compaction's (``nonzero``), the backward has none.

All cases of one world size run in one spawn (module-scoped fixture); each case is its own
test id.
"""

from __future__ import annotations

import traceback

import launcher
import pytest
import torch
from comm_trace import traced
from oracle import GRAD_RTOL, LOSS_RTOL, gradient_scale, loss_scale, oracle, rel_error
from strategies import build_case

from cce_compile.loss_math import valid_rows

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
    "every_row": (dict(ignored_fraction=0.4), dict(skip_ignored=False)),
    # Half the rows ignored (compacted away before the all-gather) under every reduction.
    "ignored-sum-smoothing-softcap": (
        dict(reduction="sum", ignored_fraction=0.5, label_smoothing=0.1, softcap=2.5),
        dict(),
    ),
    "ignored-none-weights-smoothing-z_loss": (
        dict(
            reduction="none",
            ignored_fraction=0.5,
            class_weights=True,
            label_smoothing=0.2,
            z_loss=1e-3,
        ),
        dict(),
    ),
    "ignored-mean-every_row-smoothing-softcap": (
        dict(ignored_fraction=0.5, label_smoothing=0.1, softcap=3.0, logit_scale=0.5),
        dict(skip_ignored=False),
    ),
    "ignored-none-return_lse": (
        dict(reduction="none", ignored_fraction=0.5),
        dict(return_lse=True),
    ),
    "ignore_index_0-full_smoothing": (dict(ignore_index=0, label_smoothing=1.0), dict()),
    "int32_targets-shift2": (dict(target_dtype=torch.int32, shift=2, ignored_fraction=0.3), dict()),
    "bf16-ignored-smoothing-softcap": (
        dict(dtype=torch.bfloat16, ignored_fraction=0.5, label_smoothing=0.1, softcap=30.0),
        dict(),
    ),
    "bf16": (dict(dtype=torch.bfloat16, bias=True), dict()),
    "no_hidden_grad": (dict(), dict(hidden_grad=False)),
    "compiled-aot_eager": (dict(bias=True, label_smoothing=0.1), dict(compile="aot_eager")),
    "compiled-inductor": (dict(shift=1), dict(compile="inductor")),
    "dtensor-replicated": (dict(bias=True), dict(dtensor="replicate")),
    "dtensor-sequence_parallel": (dict(), dict(dtensor="sequence")),
}
WORLD4_CASES = [
    "plain",
    "smoothing-class_weights",
    "bias",
    "compiled-aot_eager",
    "tiny_vocab",
    "ignored-none-weights-smoothing-z_loss",
    "ignore_index_0-full_smoothing",
]
TINY_VOCAB = 3  # fewer classes than 4 ranks: the last rank's shard is empty


def _shard(vocab: int, rank: int, world: int) -> tuple[int, int]:
    sizes = [len(c) for c in torch.arange(vocab).chunk(world)]
    sizes += [0] * (world - len(sizes))
    return sum(sizes[:rank]), sizes[rank]


def _run_case(name: str, rank: int, world: int, mesh) -> dict:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import cce_compile
    from cce_compile.distributed import vocab_parallel_cross_entropy

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
    return_lse = call.get("return_lse", False)
    settings = dict(skip_ignored=call.get("skip_ignored", True))
    with cce_compile.config.override(**settings), traced() as forward:
        out = fn(*inputs, **shard_args, **options, return_lse=return_lse)
    ours = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(7)
    upstream = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in ours]
    ours = [o.full_tensor() if isinstance(o, DTensor) else o for o in ours]
    total = sum((o.double() * u).sum() for o, u in zip(ours, upstream))
    with traced() as backward:
        total.backward()

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
        outputs=[o.detach().double().tolist() for o in ours],  # (a tensor cannot leave)
        forward=[c.key for c in forward.collectives],
        backward=[c.key for c in backward.collectives],
        forward_syncs=dict(forward.syncs),
        backward_syncs=dict(backward.syncs),
        expected=_expected_collectives(case, call, world),
    )


def _expected_collectives(case, call: dict, world: int) -> dict:
    """(kind, elements sent, dtype) of each collective forward and backward: the op's one
    packed all-gather of the kept rows' statistics, and hidden's gradient reduction (of the
    kept rows by the op; of every row by DTensor), plus DTensor's gather of a sequence-sharded
    hidden. No collective of no rows: every rank knows the count."""
    batch, time, dim = case.hidden.shape
    rows = batch * (time - case.shift)
    valid = int(valid_rows(case.targets[:, case.shift :], case.ignore_index).sum())
    compacts = call.get("skip_ignored", True) and not call.get("return_lse", False)
    kept = valid if compacts else rows
    packed = 3 if case.label_smoothing > 0 else 2
    dtype = str(case.hidden.dtype).removeprefix("torch.")
    forward = [("all_gather", packed * kept, "float32")] if kept else []
    backward = []
    mode = call.get("dtensor")
    if mode == "sequence":  # DTensor gathers hidden, and reduce-scatters its gradient
        forward.insert(0, ("all_gather", batch * time * dim // world, dtype))
        backward.append(("reduce_scatter", batch * time * dim, dtype))
    elif mode == "replicate":  # from_local's backward reduces the Partial gradient
        backward.append(("all_reduce", batch * time * dim, dtype))
    elif call.get("hidden_grad", True) and kept:
        backward.append(("all_reduce", kept * dim, "float32"))
    return dict(forward=forward, backward=backward, compacts=compacts)


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
        expected = got["expected"]
        assert got["forward"] == expected["forward"], got
        assert got["backward"] == expected["backward"], got
        _, call = CASES.get(name, (dict(), dict()))
        if "compile" in call:  # compiling synchronises at will; the run is the eager one's
            continue
        # Scalar reads that are no device sync on a GPU: decide.check_targets' range check
        # (CPU only, unless check_targets is set), and for a DTensor classifier DTensor's own
        # shard-offset arithmetic (on a CPU tensor: tensor._utils._get_first_offset); an
        # ignore_index given as a tensor is read once, as F.cross_entropy reads it.
        scalar_reads = 1 + ("dtensor" in call) + (call.get("ignore_index_as") is torch.tensor)
        assert got["forward_syncs"] == {
            "_local_scalar_dense": scalar_reads,
            **({"nonzero": 1} if expected["compacts"] else {}),
        }, got["forward_syncs"]
        assert got["backward_syncs"] == {}, got["backward_syncs"]
    # Every rank combines the same gathered rows in the same order: the same bits everywhere.
    first = results[0][name]["outputs"]
    for rank, per_rank in enumerate(results[1:], 1):
        for mine, theirs in zip(per_rank[name]["outputs"], first):
            mine, theirs = torch.tensor(mine).nan_to_num(), torch.tensor(theirs).nan_to_num()
            assert torch.equal(mine, theirs), f"rank {rank} differs"


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks(world2, name):
    _check(world2, name)


@pytest.mark.parametrize("name", WORLD4_CASES)
def test_four_ranks(world4, name):
    _check(world4, name)
