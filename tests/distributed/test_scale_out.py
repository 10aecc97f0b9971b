"""FSDP2 x TP at 8 ranks, simulated with gloo on the CPU: the collectives of one training step
of the head and the fused loss, per rank, against ``per_rank_collectives`` (which also gives
docs/distributed.md's "Past one host" table at 8 to 1024 GPUs).

Each mesh of 8 ranks (dp x tp: 8 x 1, 4 x 2, 2 x 4, 1 x 8) holds a head as torchtitan lays it
out: the weight ``Shard(0)`` over the vocabulary on the tp mesh (uneven: V = 8191), then
``fully_shard`` over the dp mesh in the root unit (not resharded after the forward). The head
is called, returning its input as torchtitan's fused head does (so FSDP2 gathers the weight),
and the loss is ``vocab_parallel_cross_entropy`` on the weight (``linear_cross_entropy`` at
tp 1) with hidden a DTensor on the tp mesh, replicated (what the graph pass emits) or sequence
sharded, in lean and fast mode. Every collective that reaches gloo in the forward and the
backward is recorded (``comm_trace``) and must be exactly the predicted list: FSDP2's
all-gather and reduce-scatter of the head over dp, the loss's all-gather(s) of packed per-row
statistics over tp, hidden's reduction over tp; nothing else, whatever dp is.

The 8 ranks are forked from the test's process (which has imported torch and cce_compile
once) rather than spawned: 8 fresh interpreters on 2 cores spend ~60 s importing.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import pathlib
import queue
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from comm_trace import traced
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import cce_compile
from cce_compile.distributed import vocab_parallel_cross_entropy

WORLD = 8
MESHES = {"dp8": (8, 1), "dp4xtp2": (4, 2), "dp2xtp4": (2, 4), "tp8": (1, 8)}
BATCH, SEQ, DIM, VOCAB = 2, 24, 16, 8191  # SEQ divisible by every tp; V uneven over each
CASES = [
    (mesh, mode, hidden)
    for mesh, (_, tp) in MESHES.items()
    for mode in ("lean", "fast")
    for hidden in (("replicate", "sequence") if tp > 1 else ("replicate",))
]
TIMEOUT_S = 120


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective a rank issues: its kind, the group it runs over ('dp' or 'tp', of
    ``size`` ranks), the elements this rank sends in (its input) and their bytes each."""

    phase: str  # forward, backward
    kind: str  # all_gather, all_reduce, reduce_scatter
    group: str
    size: int
    elements: int
    itemsize: int

    @property
    def ring_bytes(self) -> float:
        """Bytes this rank sends over the wire in a ring algorithm (NCCL's default within a
        host; across hosts its tree and ring cost the same order)."""
        total = self.elements * self.itemsize
        if self.kind == "all_gather":  # input is this rank's piece
            return (self.size - 1) * total
        if self.kind == "reduce_scatter":  # input is the whole
            return (self.size - 1) / self.size * total
        return 2 * (self.size - 1) / self.size * total  # all_reduce


def tp_shard_rows(vocab: int, tp: int, tp_rank: int) -> int:
    """DTensor's Shard(0) split (torch.chunk) of the vocabulary: rows of tp rank ``tp_rank``."""
    per = -(-vocab // tp)
    return max(0, min(per, vocab - per * tp_rank))


def per_rank_collectives(
    dp: int,
    tp: int,
    *,
    rows: int,
    dim: int,
    vocab: int,
    mode: str,
    sequence: bool,
    tp_rank: int = 0,
    chunk_rows: int | None = None,
    kept_rows: int | None = None,
    param_bytes: int = 4,
    hidden_bytes: int = 4,
    packed: int = 2,
) -> list[Collective]:
    """The collectives of one step of the head and its fused loss on one rank, in order.

    ``rows`` tokens of one tp group (B x T), hidden ``dim``, vocabulary ``vocab``; ``mode``
    lean or fast (fast: one statistics all-gather per chunk of ``chunk_rows``); ``sequence``:
    hidden arrives sharded over the sequence (sequence parallelism) rather than replicated;
    ``kept_rows``: rows whose target counts (the op skips the others; default all). FSDP2's
    unsharded parameter and its gradient are ``param_bytes`` an element (2: bf16 under
    torchtitan's mixed precision; its reduce-scatter then runs in float32, 4), hidden
    ``hidden_bytes``. ``packed``: 2 statistics a row (lse, target logit), 3 with label
    smoothing."""
    v_local = tp_shard_rows(vocab, tp, tp_rank)
    fsdp_piece = -(-v_local // dp) * dim  # FSDP2 pads dim 0 to dp equal pieces
    kept = rows if kept_rows is None else kept_rows
    forward, backward = [], []
    if dp > 1:
        forward.append(Collective("forward", "all_gather", "dp", dp, fsdp_piece, param_bytes))
    if tp > 1:
        if sequence:  # DTensor gathers hidden before the op
            piece = rows * dim // tp
            forward.append(Collective("forward", "all_gather", "tp", tp, piece, hidden_bytes))
        chunks = [kept] if mode == "lean" or not chunk_rows else [
            min(chunk_rows, kept - start) for start in range(0, kept, chunk_rows)
        ]  # fmt: skip
        forward += [Collective("forward", "all_gather", "tp", tp, packed * n, 4) for n in chunks]
        # hidden's gradient comes back Partial: DTensor reduces it once
        kind = "reduce_scatter" if sequence else "all_reduce"
        backward.append(Collective("backward", kind, "tp", tp, rows * dim, hidden_bytes))
    if dp > 1:
        backward.append(
            Collective("backward", "reduce_scatter", "dp", dp, fsdp_piece * dp, max(param_bytes, 4))
        )
    return forward + backward


class PassThroughHead(nn.Linear):
    """torchtitan's fused head: called where the model calls its head (FSDP2's hooks run),
    it returns its input; the loss reads the weight."""

    def forward(self, hidden):
        return hidden


class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.output = PassThroughHead(DIM, VOCAB, bias=False)

    def forward(self, hidden):
        return self.output(hidden)


def _step(name: str, mode: str, hidden_kind: str, mesh) -> dict:
    dp, tp = MESHES[name]
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    torch.manual_seed(0)
    root = Root()
    weight = root.output.weight.detach().clone()
    if tp > 1:
        root.output.weight = nn.Parameter(distribute_tensor(weight, tp_mesh, [Shard(0)]))
    if dp > 1:
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=False)
    gen = torch.Generator().manual_seed(dp_mesh.get_local_rank())  # each dp rank its batch
    hidden = torch.randn(BATCH, SEQ, DIM, generator=gen)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    if tp > 1:
        sequence = hidden_kind == "sequence"
        tp_rank = tp_mesh.get_local_rank()
        local = hidden.chunk(tp, 1)[tp_rank] if sequence else hidden
        local = local.clone().requires_grad_()
        placement = Shard(1) if sequence else Replicate()
        hidden_in = DTensor.from_local(local, tp_mesh, [placement], run_check=False)
    else:
        hidden_in = local = hidden.clone().requires_grad_()
    with cce_compile.config.override(mode=mode):
        with traced() as forward:
            out = root(hidden_in)
            weight = root.output.weight
            if isinstance(weight, DTensor):
                loss = vocab_parallel_cross_entropy(out, weight, targets, reduction="sum")
            else:
                loss = cce_compile.linear_cross_entropy(out, weight, targets, reduction="sum")
        with traced() as backward:
            loss.backward()
    gathers = [c for c in forward.collectives if c.kind == "all_gather"]
    # fast mode's chunk: the rows of the loss's first statistics all-gather (every chunk but
    # the last has it): the (2, rows) float32 packed lse and target logits
    stats = [c.shape[1] for c in gathers if len(c.shape) == 2 and c.shape[0] == 2]
    return dict(
        forward=[c.key for c in forward.collectives],
        backward=[c.key for c in backward.collectives],
        tp_rank=tp_mesh.get_local_rank(),
        chunk_rows=stats[0] if stats else None,
        grad_is_set=root.output.weight.grad is not None and local.grad is not None,
    )


def _worker(rank: int, world: int) -> dict:
    results = {}
    meshes = {
        name: init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        for name, (dp, tp) in MESHES.items()
    }
    for name, mode, hidden in CASES:
        try:
            results[(name, mode, hidden)] = _step(name, mode, hidden, meshes[name])
        except Exception:  # noqa: BLE001  (one case's failure is that test's, not all)
            results[(name, mode, hidden)] = dict(error=traceback.format_exc())
    return results


def _entry(rank: int, world: int, store: str, results) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=TIMEOUT_S // 2),
        )
        results.put((rank, _worker(rank, world), None))
    except BaseException:  # noqa: BLE001  (reported to the parent, which fails the test)
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_forked(world: int) -> list[dict]:
    """``_worker`` on ``world`` gloo processes forked from this one (launcher.run forks from a
    fork server); each rank's result, or an error naming the ranks that failed or never
    answered."""
    # A forked rank inherits the parent's process-group state: the parent must have none.
    assert not dist.is_initialized(), "a process group is left open in the test process"
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(pathlib.Path(tmp) / "store")
        procs = [ctx.Process(target=_entry, args=(r, world, store, results)) for r in range(world)]
        for proc in procs:
            proc.start()
        outs, errors = {}, []
        try:
            for _ in range(world):
                rank, out, error = results.get(timeout=TIMEOUT_S)
                outs[rank] = out
                if error:
                    errors.append(f"rank {rank}:\n{error}")
        except queue.Empty:
            errors.append(f"timed out waiting for ranks {set(range(world)) - set(outs)}")
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    return [outs[rank] for rank in range(world)]


@pytest.fixture(scope="module")
def world8() -> list[dict]:
    return run_forked(WORLD)


def _key(c: Collective) -> tuple:
    dtype = {2: "bfloat16", 4: "float32"}[c.itemsize]
    return (c.kind, c.elements, dtype)


@pytest.mark.parametrize("case", CASES, ids=["-".join(case) for case in CASES])
def test_the_step_issues_the_predicted_collectives_on_every_rank(world8, case):
    name, mode, hidden = case
    dp, tp = MESHES[name]
    for rank, per_rank in enumerate(world8):
        got = per_rank[case]
        assert "error" not in got, f"rank {rank}:\n{got.get('error')}"
        assert got["grad_is_set"], f"rank {rank}: no gradient reached the head or hidden"
        expected = per_rank_collectives(
            dp,
            tp,
            rows=BATCH * SEQ,
            dim=DIM,
            vocab=VOCAB,
            mode=mode,
            sequence=hidden == "sequence",
            tp_rank=got["tp_rank"],
            chunk_rows=got["chunk_rows"],
        )
        want = {
            phase: [_key(c) for c in expected if c.phase == phase]
            for phase in ("forward", "backward")
        }
        assert [tuple(k) for k in got["forward"]] == want["forward"], (rank, got["forward"])
        assert [tuple(k) for k in got["backward"]] == want["backward"], (rank, got["backward"])


def test_fast_mode_runs_several_chunks_where_the_shard_is_wide(world8):
    """At tp 2 the share of 4096 classes makes fast mode's chunks smaller than the 48 rows (the
    per-chunk count above is then more than one all-gather); at tp 8, one chunk."""
    wide = world8[0][("dp4xtp2", "fast", "replicate")]["chunk_rows"]
    narrow = world8[0][("tp8", "fast", "replicate")]["chunk_rows"]
    assert wide is not None and wide < BATCH * SEQ, wide
    assert narrow == BATCH * SEQ, narrow
