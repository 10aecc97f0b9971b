"""torchtitan 0.2's tensor-parallel plan, 2 gloo ranks: what the fused head (``llama3_cce``)
sends, against torchtitan's own head and loss, over one step of a tiny llama3.

Both models are parallelised by torchtitan's own ``apply_tp`` (sequence parallelism: the final
norm's output is ``Shard(1)``, which the head's plan gathers to ``Replicate``) and run as
torchtitan's trainer runs a step (forward, loss, backward; inside ``loss_parallel`` when it is
on). Every collective that reaches gloo is recorded (``comm_trace``). The transformer block's
collectives are the same in both steps; the difference must be exactly the loss's own:

* unfused, loss parallel: 3 all-reduces of N floats (``loss_parallel``'s cross-entropy);
  without loss parallel, the all-gather of the logits over the vocabulary (N x V / tp a rank);
* fused: 1 all-gather of the packed per-row statistics (2 x the kept rows, float32, lean mode;
  docs/distributed.md).

So the head's hidden-sized collectives (the sequence all-gather in the forward, the
reduce-scatter of hidden's gradient in the backward) are the same in both. When FusedHead
returned its gathered input through the plan's output hook, the fused step also all-gathered
the hidden states over D in the forward (the hook had split them as logits), and its backward
all-reduced N x D and all-gathered N x D / tp instead of one reduce-scatter: this test failed
on that (docs/torchtitan.md has the counts).

The 2 ranks are forked from the test's process (it has imported torch, torchtitan and
cce_compile once); spawning them costs ~20 s of imports each on 2 shared cores.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import multiprocessing
import os
import pathlib
import queue
import tempfile
import traceback
import types

import pytest
import torch
import torch.distributed as dist

torchtitan = pytest.importorskip("torchtitan")
if not torchtitan.__version__.startswith("0.2."):
    pytest.skip(
        f"torchtitan 0.2.x's TrainSpec (llama3_cce); torchtitan {torchtitan.__version__} is "
        "installed (0.3's hook refuses tensor parallelism)",
        allow_module_level=True,
    )
from comm_trace import traced  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor.parallel import loss_parallel  # noqa: E402
from torchtitan.components.loss import cross_entropy_loss  # noqa: E402
from torchtitan.models.llama3 import Transformer, TransformerModelArgs  # noqa: E402
from torchtitan.models.llama3.infra.parallelize import apply_tp  # noqa: E402
from torchtitan.protocols.train_spec import get_train_spec  # noqa: E402

import cce_compile  # noqa: E402
from cce_compile.integrations import torchtitan as cce_titan  # noqa: E402

TP = 2
BATCH, SEQ, DIM, VOCAB = 2, 16, 48, 160  # N = 32 tokens; every size below is distinct
ROWS = BATCH * SEQ
IGNORED = 5  # labels[0, :5]: rows the op skips (skip_ignored), whose statistics do not travel
LAYOUTS = ("loss-parallel", "replicated-logits")  # torchtitan's default; disable_loss_parallel
TIMEOUT_S = 120


def _args() -> TransformerModelArgs:
    return TransformerModelArgs(
        dim=DIM, n_layers=1, n_heads=4, vocab_size=VOCAB, max_seq_len=SEQ, multiple_of=16
    )


def _step(mesh, *, fused: bool, layout: str) -> dict:
    """One training step of the tiny llama3 under torchtitan's TP plan: the collectives of the
    forward (model and loss) and of the backward, the loss and every parameter's gradient."""
    is_loss_parallel = layout == "loss-parallel"
    torch.manual_seed(0)
    plain = Transformer(_args())
    with torch.no_grad():
        plain.init_weights()
    if fused:
        cce_titan._heads.clear()  # the loss finds the one live FusedHead
        model = get_train_spec("llama3_cce").model_cls(_args())
        model.load_state_dict(plain.state_dict())
        loss_fn = cce_titan.build_fused_loss(_job(), parallel_dims=None)
    else:
        model, loss_fn = plain, cross_entropy_loss
    apply_tp(model, mesh, loss_parallel=is_loss_parallel, enable_float8_tensorwise_tp=False)
    gen = torch.Generator().manual_seed(1)  # the same batch on both tp ranks, as in torchtitan
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[0, :IGNORED] = -100
    context = loss_parallel() if is_loss_parallel else contextlib.nullcontext()
    with context, cce_compile.config.override(mode="lean", skip_ignored=True):
        with traced() as forward:
            pred = model(tokens)
            loss = loss_fn(pred, labels)
        with traced() as backward:
            loss.backward()
    if fused:  # the hidden states of a forward are handed to one loss
        with pytest.raises(cce_titan.TorchtitanIntegrationError, match="once per forward"):
            loss_fn(pred, labels)
    grads = {  # numpy: torch tensors would cross the queue as shared memory of a dead rank
        name: _full(p.grad).numpy().copy()
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    return dict(
        forward=[c.key for c in forward.collectives],
        backward=[c.key for c in backward.collectives],
        loss=_full(loss).item(),
        grads=grads,
    )


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _job():
    return types.SimpleNamespace(
        parallelism=types.SimpleNamespace(fsdp_reshard_after_forward="default")
    )


def _worker(rank: int) -> dict:
    mesh = init_device_mesh("cpu", (TP,))
    results = {}
    for layout in LAYOUTS:
        for fused in (False, True):
            try:
                results[(layout, fused)] = _step(mesh, fused=fused, layout=layout)
            except Exception:  # noqa: BLE001  (one case's failure is its test's, not all)
                results[(layout, fused)] = dict(error=traceback.format_exc())
    return results


def _entry(rank: int, store: str, results) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(TP), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=TP,
            timeout=datetime.timedelta(seconds=TIMEOUT_S // 2),
        )
        results.put((rank, _worker(rank), None))
    except BaseException:  # noqa: BLE001  (reported to the parent, which fails the test)
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_forked() -> list[dict]:
    """``_worker`` on TP forked gloo ranks: each rank's results, or an error naming the ranks
    that failed or never answered."""
    # A forked rank inherits the parent's process-group state: the parent must have none.
    assert not dist.is_initialized(), "a process group is left open in the test process"
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(pathlib.Path(tmp) / "store")
        procs = [ctx.Process(target=_entry, args=(r, store, results)) for r in range(TP)]
        for proc in procs:
            proc.start()
        outs, errors = {}, []
        try:
            for _ in range(TP):
                rank, out, error = results.get(timeout=TIMEOUT_S)
                outs[rank] = out
                if error:
                    errors.append(f"rank {rank}:\n{error}")
        except queue.Empty:
            errors.append(f"timed out waiting for ranks {set(range(TP)) - set(outs)}")
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    return [outs[rank] for rank in range(TP)]


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_forked()


def _case(ranks, rank, layout, fused) -> dict:
    got = ranks[rank][(layout, fused)]
    assert "error" not in got, f"rank {rank}, {layout}, fused={fused}:\n{got.get('error')}"
    return got


# What only one of the two steps sends, per rank: (kind, elements sent, dtype) -> count. The
# fused loss: one all-gather of the kept rows' packed (lse, target logit), float32.
FUSED_STATS = {"forward": {("all_gather", 2 * (ROWS - IGNORED), "float32"): 1}}
LOSS_OWN = {
    ("loss-parallel", False): {"forward": {("all_reduce", ROWS, "float32"): 3}},
    ("replicated-logits", False): {"forward": {("all_gather", ROWS * VOCAB // TP, "float32"): 1}},
    ("loss-parallel", True): FUSED_STATS,
    ("replicated-logits", True): FUSED_STATS,
}
# The head's own, in both steps: the all-gather of the sequence-sharded hidden states (the
# last of the forward's before the loss's) and the reduce-scatter of their gradient (the
# first of the backward).
HEAD_FORWARD = ("all_gather", ROWS * DIM // TP, "float32")
HEAD_BACKWARD = ("reduce_scatter", ROWS * DIM, "float32")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_head_sends_the_unfused_heads_hidden_sized_collectives(ranks, layout):
    for rank in range(TP):
        plain, fused = (_case(ranks, rank, layout, f) for f in (False, True))
        for phase in ("forward", "backward"):
            plain_sent = collections.Counter(plain[phase])
            fused_sent = collections.Counter(fused[phase])
            only_plain = dict(plain_sent - fused_sent)
            only_fused = dict(fused_sent - plain_sent)
            assert only_plain == LOSS_OWN[(layout, False)].get(phase, {}), (rank, plain[phase])
            assert only_fused == LOSS_OWN[(layout, True)].get(phase, {}), (rank, fused[phase])
        for step in (plain, fused):
            loss_own = sum(LOSS_OWN[(layout, step is fused)]["forward"].values())
            assert step["forward"][-1 - loss_own] == HEAD_FORWARD, (rank, step["forward"])
            assert step["backward"][0] == HEAD_BACKWARD, (rank, step["backward"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fused_step_equals_the_unfused_step(ranks, layout):
    # float32: the op and PyTorch's cross-entropy round in different orders (the tolerances of
    # test_torchtitan.py's single-process comparison)
    for rank in range(TP):
        plain, fused = (_case(ranks, rank, layout, f) for f in (False, True))
        assert fused["loss"] == pytest.approx(plain["loss"], rel=1e-5)
        assert fused["grads"].keys() == plain["grads"].keys()
        for name, grad in fused["grads"].items():
            torch.testing.assert_close(
                torch.from_numpy(grad),
                torch.from_numpy(plain["grads"][name]),
                rtol=1e-4,
                atol=1e-6,
                msg=name,
            )


if __name__ == "__main__":  # the collectives of each case, per rank
    for rank, per_rank in enumerate(run_forked()):
        for case, got in per_rank.items():
            print(rank, case, got.get("error") or {k: got[k] for k in ("forward", "backward")})
