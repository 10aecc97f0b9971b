"""Run a function on N gloo processes (CPU) and collect what each rank returns.

One start serves a whole test module (module-scoped fixtures): starting processes and
importing torch costs seconds, the cases themselves milliseconds. The ranks are forked from
multiprocessing's fork server, a fresh interpreter that imports what ranks use (PRELOAD) once
per test run: a spawned rank spent ~7 s of CPU importing them, each time (2 cores: ~15 s for a
2-rank start, ~30 s for 4). Forked from a fresh server, no rank inherits the test process's
state (its process group, Dynamo's caches), as with a spawn. A worker catches each case's
exception and reports it as text, so one failing case does not hide the others, and a hang (a
collective one rank never reaches) ends at the timeout instead of blocking CI.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 240
# Imported once by the fork server (a module that is not installed is left out): torch, the
# compiler that ranks which compile load, the package, and the test modules' own imports.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "cce_compile",
    "cce_compile.distributed",
    "hypothesis",
    "transformers",
    "accelerate",
]


def _entry(rank: int, world: int, store: str, fn: Callable, args: tuple, results) -> None:
    torch.set_num_threads(1)  # N processes on 2 cores
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=TIMEOUT_S // 2),
        )
        out = fn(rank, world, *args)
        results.put((rank, out, None))
    except BaseException:  # noqa: BLE001  (reported to the parent, which fails the test)
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(fn: Callable, world: int, *args: Any, timeout: float = TIMEOUT_S) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` processes; returns each rank's result.

    ``fn`` must be a module-level function (it is pickled by name) and return picklable data.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (read when the server starts: the first run)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(pathlib.Path(tmp) / "store")
        procs = [
            ctx.Process(target=_entry, args=(rank, world, store, fn, args, results))
            for rank in range(world)
        ]
        for proc in procs:
            proc.start()
        outs: dict[int, Any] = {}
        errors = []
        try:
            for _ in range(world):
                rank, out, error = results.get(timeout=timeout)
                outs[rank] = out
                if error:
                    errors.append(f"rank {rank}:\n{error}")
        except queue.Empty:
            errors.append(
                f"timed out after {timeout} s waiting for ranks {set(range(world)) - set(outs)}"
            )
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    if errors:
        raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
    return [outs[rank] for rank in range(world)]
