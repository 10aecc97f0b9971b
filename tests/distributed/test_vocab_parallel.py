"""The vocabulary-parallel op on 2 and 4 gloo processes against the float64 oracle.

Each rank builds the same full case, keeps its DTensor-style shard of the classifier (uneven:
the first ranks get ceil(V / world) classes), computes the loss and gradients with
``vocab_parallel_cross_entropy``, and compares the loss, hidden's gradient and its own rows of
the classifier's and bias's gradients with the single-process oracle. ``CASES`` run in lean
mode, ``FAST_CASES`` in fast mode (three GEMMs, the gradients computed in the forward).

Every collective that reaches gloo during the forward and during the backward is recorded
from the profiler (``comm_trace``: the op's own, DTensor's, any other), with what this rank
sent, and so are the operations that synchronise the host on a GPU. Per call the op issues,
forward, one all-gather of 2 float32 a kept row (3 with label smoothing): each rank's packed
lse, target logit (and weighted sum), in fast mode one such all-gather per chunk of rows; and
backward only hidden's gradient reduction, of the kept rows, by the op (plain tensors) or by
DTensor (DTensor inputs), in both modes. The forward's one synchronisation is compaction's
(``nonzero``), the backward has none. The autograd contract on the shards is
``test_vp_autograd_contract.py``'s.

All cases of one world size run in one start of the ranks (module-scoped fixture); each case is
its own test id.
"""

from __future__ import annotations

import dataclasses
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
# Fast mode. ``leading=(4, 24)``: 96 rows, in chunks of 42 at the smallest budget (the share
# of 2049 classes), so one all-gather per chunk shows; ``flow``: how the gradients are taken.
FAST_CASES = {
    "fast-bias": (dict(bias=True), dict()),
    "fast-chunks-ignored-smoothing-class_weights": (
        dict(leading=(4, 24), ignored_fraction=0.4, label_smoothing=0.1, class_weights=True),
        dict(chunks=True),
    ),
    "fast-chunks-every_row-softcap-shift1-sum": (
        dict(leading=(4, 24), shift=1, softcap=3.0, logit_scale=1.3, reduction="sum"),
        dict(chunks=True, skip_ignored=False),
    ),
    "fast-z_loss-int32_targets": (dict(z_loss=1e-3, target_dtype=torch.int32), dict()),
    "fast-bf16-ignored-smoothing-softcap": (
        dict(
            dtype=torch.bfloat16, bias=True, ignored_fraction=0.5, label_smoothing=0.1, softcap=30.0
        ),
        dict(),
    ),  # fmt: skip
    "fast-amp-bias-ignored": (dict(bias=True, ignored_fraction=0.4), dict(amp=True)),
    "fast-all_ignored": (dict(ignored_fraction=1.0), dict()),
    "fast-no_hidden_grad": (dict(bias=True), dict(hidden_grad=False)),
    # a gradient of the returned lse: the backward recomputes (lean), reducing hidden's once
    "fast-return_lse": (dict(), dict(return_lse=True)),
    "fast-accumulate_two_micro_batches": (dict(bias=True), dict(flow="accumulate")),
    "fast-retained_second_backward": (dict(bias=True, ignored_fraction=0.4), dict(flow="retain")),
    "fast-autograd_grad": (dict(bias=True), dict(flow="autograd_grad")),
    "fast-auto": (dict(), dict(mode=None)),  # auto picks fast here (a CPU, a scalar loss)
    "fast-compiled-inductor": (dict(bias=True, label_smoothing=0.1), dict(compile="inductor")),
    "fast-dtensor-replicated": (dict(bias=True), dict(dtensor="replicate")),
    "fast-dtensor-sequence_parallel": (dict(ignored_fraction=0.4), dict(dtensor="sequence")),
}
for _cases, _mode in ((CASES, "lean"), (FAST_CASES, "fast")):
    for _, _call in _cases.values():
        _call.setdefault("mode", _mode)
ALL_CASES = {**CASES, **FAST_CASES}
WORLD4_CASES = [
    "plain",
    "smoothing-class_weights",
    "bias",
    "compiled-aot_eager",
    "tiny_vocab",
    "ignored-none-weights-smoothing-z_loss",
    "ignore_index_0-full_smoothing",
    "fast-tiny_vocab",
    "fast-chunks-every_row-softcap-shift1-sum",  # 92 rows: chunks of 85 (a share of 1025)
]
TINY_VOCAB = 3  # fewer classes than 4 ranks: the last rank's shard is empty


def shard_of(vocab: int, rank: int, world: int) -> tuple[int, int]:
    """(first class, classes) of this rank's shard: DTensor's uneven split, empty past V."""
    sizes = [len(c) for c in torch.arange(vocab).chunk(world)]
    sizes += [0] * (world - len(sizes))
    return sum(sizes[:rank]), sizes[rank]


def _case(name: str) -> tuple[dict, dict]:
    """(build_case options, call options) of a case, by name."""
    if name in ALL_CASES:
        case_opts, call = ALL_CASES[name]
        return dict(case_opts), dict(call)
    fast = name.startswith("fast-")  # fast-tiny_vocab
    return dict(), dict(mode="fast" if fast else "lean")


def _run_case(name: str, rank: int, world: int, mesh) -> dict:
    from torch.distributed.tensor import DTensor

    import cce_compile

    case_opts, call = _case(name)
    vocab = TINY_VOCAB if name.endswith("tiny_vocab") else VOCAB
    dtype = case_opts.pop("dtype", torch.float32)
    leading = case_opts.pop("leading", (2, 6))
    case = build_case(leading=leading, dim=16, vocab=vocab, dtype=dtype, seed=3, **case_opts)
    start, rows = shard_of(vocab, rank, world)
    leaves, inputs, shard_args = _inputs(case, call, (start, rows), rank, world, mesh)
    fn = _loss_function(call)
    options = case.options()
    options["ignore_index"] = call.get("ignore_index_as", int)(options["ignore_index"])
    return_lse = call.get("return_lse", False)
    settings = dict(skip_ignored=call.get("skip_ignored", True))

    def step(targets):
        amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=call.get("amp", False))
        with cce_compile.config.override(**settings), amp:
            out = fn(*inputs[:2], targets, inputs[3], **shard_args, **options,
                     return_lse=return_lse, mode=call["mode"])  # fmt: skip
        out = out if isinstance(out, tuple) else (out,)
        return [o.full_tensor() if isinstance(o, DTensor) else o for o in out]

    with traced() as forward:
        ours = step(case.targets)
    gen = torch.Generator().manual_seed(7)
    upstream = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in ours]
    total = sum((o.double() * u).sum() for o, u in zip(ours, upstream))
    with traced() as backward:
        taken = _take_gradients(total, leaves, call.get("flow"))
    # The targets of each micro-batch, and how many backward passes each had.
    batches, passes = [case.targets], 2.0 if call.get("flow") == "retain" else 1.0
    if call.get("flow") == "accumulate":  # a second micro-batch, its gradients added in .grad
        batches.append(case.targets.roll(1, dims=1))
        sum((o.double() * u).sum() for o, u in zip(step(batches[1]), upstream)).backward()
    outputs = (ours, upstream, batches, passes)
    errors = _errors(case, call, leaves, taken, outputs, (start, rows, rank))
    return dict(
        errors=errors,
        outputs=[o.detach().double().tolist() for o in ours],  # (a tensor cannot leave)
        forward=[c.key for c in forward.collectives],
        backward=[c.key for c in backward.collectives],
        forward_syncs=dict(forward.syncs),
        backward_syncs=dict(backward.syncs),
        expected=expected_collectives(case, call, world),
    )


def _inputs(case, call: dict, shard: tuple[int, int], rank: int, world: int, mesh):
    """(leaves by label: (our leaf, the case's full tensor), the function's tensors, its
    shard arguments): this rank's shard as plain tensors, or the DTensor entry's."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    start, rows = shard
    hidden = case.hidden.clone().requires_grad_(call.get("hidden_grad", True))
    bias = None
    if call.get("dtensor") is None:
        classifier = case.classifier[start : start + rows].clone().requires_grad_()
        if case.bias is not None:
            bias = case.bias[start : start + rows].clone().requires_grad_()
        vocab = case.classifier.shape[0]
        shard_args = dict(vocab_start=start, vocab_size=vocab, group=mesh.get_group())
        leaves = {"hidden": (hidden, case.hidden), "classifier": (classifier, case.classifier)}
        inputs = (hidden, classifier, case.targets, bias)
    else:
        # The DTensor entry: the classifier's rows come from distribute_tensor's own split.
        classifier = distribute_tensor(case.classifier, mesh, [Shard(0)]).requires_grad_()
        if case.bias is not None:
            bias = distribute_tensor(case.bias, mesh, [Shard(0)]).requires_grad_()
        sequence = call["dtensor"] == "sequence"
        placement = Shard(1) if sequence else Replicate()
        local = hidden.chunk(world, 1)[rank] if sequence else hidden
        local = local.detach().requires_grad_(call.get("hidden_grad", True))
        hidden_in = DTensor.from_local(local, mesh, [placement], run_check=False)
        shard_args = {}
        leaves = {"hidden": (local, case.hidden), "classifier": (classifier, case.classifier)}
        inputs = (hidden_in, classifier, case.targets, bias)
    if bias is not None:
        leaves["bias"] = (bias, case.bias)
    return leaves, inputs, shard_args


def _loss_function(call: dict):
    from cce_compile.distributed import vocab_parallel_cross_entropy

    if "compile" not in call:
        return vocab_parallel_cross_entropy
    torch._dynamo.reset()
    return torch.compile(vocab_parallel_cross_entropy, backend=call["compile"], fullgraph=True)


def _take_gradients(total, leaves: dict, flow: str | None) -> dict:
    """The gradients of ``total`` by label: ``.grad`` after a backward (twice through a
    retained graph for "retain"), or what ``torch.autograd.grad`` returns ("autograd_grad"),
    which must leave ``.grad`` alone."""
    wanted = {label: leaf for label, (leaf, _) in leaves.items() if leaf.requires_grad}
    if flow == "autograd_grad":
        grads = torch.autograd.grad(total, list(wanted.values()))
        assert all(leaf.grad is None for leaf in wanted.values()), "autograd.grad set .grad"
        return dict(zip(wanted, grads))
    total.backward(retain_graph=flow == "retain")
    if flow == "retain":  # fast mode's buffers are handed out: this one recomputes
        total.backward()
    return {label: None for label in wanted}  # read from .grad once every backward ran


def _errors(case, call: dict, leaves: dict, taken: dict, outputs, where) -> dict:
    """Relative errors (with their tolerances) of the loss, the lse and each gradient
    against the oracle (the gradients: the sum over the micro-batches' targets, each times the
    backward passes through it); under AMP the oracle computes on the bf16-rounded inputs."""
    from torch.distributed.tensor import DTensor

    ours, upstream, batches, passes = outputs
    start, rows, rank = where
    dtype = case.hidden.dtype
    if call.get("amp"):  # what the head computes on
        for name in ("hidden", "classifier", "bias"):
            if getattr(case, name) is not None:
                setattr(case, name, getattr(case, name).bfloat16().float())
    grad_dtype = torch.bfloat16 if call.get("amp") else dtype
    for t in case.leaves():
        t.requires_grad_()
    if not call.get("hidden_grad", True):
        case.hidden.requires_grad_(False)
    return_lse = call.get("return_lse", False)
    expected = oracle(case, return_lse=return_lse)
    expected = expected if isinstance(expected, tuple) else (expected,)
    errors = {}
    for label, a, e, scale in zip(("loss", "lse"), ours, expected, (loss_scale(case), 0.0)):
        errors[label] = (rel_error(a, e, scale), LOSS_RTOL[dtype])
    full = [t for t in case.leaves() if t.requires_grad]
    up = [u * passes for u in upstream]
    want, scales = [0.0] * len(full), [0.0] * len(full)
    for targets in batches:  # the gradients (and the sizes of their terms) add up
        batch = dataclasses.replace(case, targets=targets)
        out = oracle(batch, return_lse=return_lse)
        out = out if isinstance(out, tuple) else (out,)
        total = sum((e * u).sum() for e, u in zip(out, up))
        grads = torch.autograd.grad(total, full, allow_unused=True)
        want = [w + g for w, g in zip(want, grads)]
        more = gradient_scale(batch, up[0], up[1] if return_lse else None, full)
        scales = [a + b for a, b in zip(scales, more)]
    wanted = dict(zip([id(t) for t in full], zip(want, scales)))
    by_full = {"hidden": case.hidden, "classifier": case.classifier, "bias": case.bias}
    for label, (leaf, _) in leaves.items():
        if not leaf.requires_grad:
            continue
        expect, scale = wanted[id(by_full[label])]
        grad = taken.get(label) if taken.get(label) is not None else leaf.grad
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        expect = expect[_rows_of(label, leaf, call, (start, rows, rank))]
        errors[f"grad_{label}"] = (rel_error(grad, expect, scale), GRAD_RTOL[grad_dtype])
        errors[f"grad_{label}_dtype"] = (float(grad.dtype != leaf.dtype), 0.0)
    return errors


def _rows_of(label: str, leaf, call: dict, where) -> tuple | slice:
    """This rank's part of a full gradient: its classes of the classifier and bias (plain
    shards), its sequence part of hidden (a sequence-sharded DTensor hidden)."""
    start, rows, rank = where
    mode = call.get("dtensor")
    if mode is None:
        return slice(start, start + rows) if label != "hidden" else slice(None)
    if label == "hidden" and mode == "sequence":
        seq = leaf.shape[1]
        return (slice(None), slice(rank * seq, (rank + 1) * seq))
    return slice(None)


def expected_collectives(case, call: dict, world: int) -> dict:
    """(kind, elements sent, dtype) of each collective forward and backward: the op's packed
    all-gather of the kept rows' statistics (in fast mode one per chunk: ``forward_rows``
    gives the total, ``_check`` the chunks), and hidden's gradient reduction (of the kept rows
    by the op; of every row by DTensor; once per backward), plus DTensor's gather of a
    sequence-sharded hidden. No collective of no rows: every rank knows the count."""
    batch, time, dim = case.hidden.shape
    rows = batch * (time - case.shift)
    valid = int(valid_rows(case.targets[:, case.shift :], case.ignore_index).sum())
    compacts = call.get("skip_ignored", True) and not call.get("return_lse", False)
    kept = valid if compacts else rows
    packed = 3 if case.label_smoothing > 0 else 2
    dtype = str(case.hidden.dtype).removeprefix("torch.")
    forward = []
    backward = []
    mode = call.get("dtensor")
    if mode == "sequence":  # DTensor gathers hidden, and reduce-scatters its gradient
        forward.append(("all_gather", batch * time * dim // world, dtype))
        backward.append(("reduce_scatter", batch * time * dim, dtype))
    elif mode == "replicate":  # from_local's backward reduces the Partial gradient
        backward.append(("all_reduce", batch * time * dim, dtype))
    elif call.get("hidden_grad", True) and kept:  # the kept rows, or all of hidden
        reduced = kept * dim if kept < rows else batch * time * dim
        backward.append(("all_reduce", reduced, "float32"))
    if call.get("flow") == "retain":  # the second backward's own reduction
        backward *= 2
    return dict(forward=forward, backward=backward, compacts=compacts, packed=packed, kept=kept)


def run_cases(rank: int, world: int, names: list[str], run=None) -> dict:
    """Each named case on this rank, by ``run(name, rank, world, mesh)`` (``_run_case`` unless
    given), with how many times fast mode's forward ran on the shard; a case that raises has its
    traceback as its result."""
    from torch.distributed.device_mesh import init_device_mesh

    from cce_compile.distributed import vocab_parallel

    # Which mode ran: fast mode's forward on this rank's shard, counted.
    fast_runs = []
    fast_forward_rows = vocab_parallel._fast_forward_rows

    def counted(*args, **kwargs):
        fast_runs.append(1)
        return fast_forward_rows(*args, **kwargs)

    vocab_parallel._fast_forward_rows = counted
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for name in names:
        before = len(fast_runs)
        try:
            results[name] = (run or _run_case)(name, rank, world, mesh)
            results[name]["fast_runs"] = len(fast_runs) - before
        except Exception:  # noqa: BLE001  (one case's failure is that test's, not all)
            results[name] = dict(error=traceback.format_exc())
    return results


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return launcher.run(run_cases, 2, list(ALL_CASES))


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return launcher.run(run_cases, 4, WORLD4_CASES)


def _check(results: list[dict], name: str) -> None:
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert "error" not in got, f"rank {rank}:\n{got.get('error')}"
        for label, (err, tol) in got["errors"].items():
            assert err <= tol, f"rank {rank}: {label} relative error {err:.3e} > {tol:.1e}"
        expected = got["expected"]
        _, call = _case(name)
        # every fast case ran fast mode ("fast-auto" by auto's choice), no lean case did
        assert (got["fast_runs"] > 0) == (call["mode"] != "lean"), got["fast_runs"]
        _check_forward_collectives(got["forward"], expected, call)
        assert got["backward"] == expected["backward"], got
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


def _check_forward_collectives(got: list, expected: dict, call: dict) -> None:
    """DTensor's own collectives first, then the op's all-gathers of the packed statistics of
    the kept rows: one in lean mode; in fast mode one per chunk, every chunk but the last of
    the same rows (``chunks``: several)."""
    own = len(expected["forward"])
    assert got[:own] == expected["forward"], got
    gathers = got[own:]
    packed, kept = expected["packed"], expected["kept"]
    assert all(kind == "all_gather" and dtype == "float32" for kind, _, dtype in gathers), got
    sizes = [size // packed for _, size, _ in gathers]
    assert [size * packed for size in sizes] == [size for _, size, _ in gathers], got
    assert sum(sizes) == kept, (sizes, kept)
    if call["mode"] == "lean" or not kept:
        assert len(sizes) == (1 if kept else 0), sizes
    else:  # one all-gather per chunk of rows: ceil(kept / chunk) of them
        assert all(n == sizes[0] for n in sizes[:-1]) and sizes[-1] <= sizes[0], sizes
        assert len(sizes) == -(-kept // sizes[0]), sizes
        assert (len(sizes) > 1) == bool(call.get("chunks")), sizes


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_two_ranks(world2, name):
    _check(world2, name)


@pytest.mark.parametrize("name", WORLD4_CASES)
def test_four_ranks(world4, name):
    _check(world4, name)
