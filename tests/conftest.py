"""Shared pytest set-up: GPU marker handling, option for larger fuzzing budgets, and what the
test processes run with (threads, garbage collection, Triton's interpreter)."""

from __future__ import annotations

import os
import pathlib

# One thread per test process, set before torch and numpy load (children inherit it): `make
# test` runs two workers on two cores, at sizes where more threads only add spinning
# (OpenMP's and, under the Triton interpreter's numpy, OpenBLAS's). Measured on two files of
# op and pass tests: 25% less CPU time than two threads per worker.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor compiles its C++ in this process, not in a pool of compile workers: on two cores
# shared by two test workers a pool computes nothing sooner, and starting one (a Python that
# imports Inductor) cost ~3 s of CPU in every process that compiles with Inductor.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import atexit  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402

import file_order  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors through Triton's interpreter; it must be chosen before
    # any kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import list_builtins_once

    list_builtins_once()  # ~30% of each interpreted kernel's time (triton_interpreter.py)


def pytest_addoption(parser):
    parser.addoption(
        "--fuzz-examples",
        type=int,
        default=None,
        help="hypothesis examples per fuzzing test (default: the CI budget set in each test)",
    )
    parser.addoption(
        "--record-file-seconds",
        action="store_true",
        help="write each test file's seconds to tests/file_seconds.json (file_order.py)",
    )


_FILE_SECONDS = pytest.StashKey[dict]()


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        return
    recording = config.getoption("--record-file-seconds")
    if recording or getattr(config.option, "numprocesses", None):
        config.stash[_FILE_SECONDS] = file_order.recorded_seconds()  # read once, for every worker
    if recording:
        file_order.refuse_partial_runs(config)
        config.pluginmanager.register(file_order.Recorder(config), "file_seconds_recorder")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    node.workerinput["file_seconds"] = node.config.stash.get(_FILE_SECONDS, {})


_MULTIPROCESS_DIR = pathlib.Path(__file__).parent / "distributed"
# A test process holds torch, transformers and Dynamo's caches (~700,000 objects), which every
# full collection walked: 47 and 51 s of the two workers' ~600 s (make test's single-process
# tests, cold).
# What collection imported is frozen (never walked again), and the youngest generation is
# collected every 50,000 net allocations instead of 700: 18 s a worker.
GC_THRESHOLDS = (50_000, 20, 100)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


_finished_sessions: list[pytest.Session] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    _finished_sessions.append(session)


def pytest_unconfigure(config):
    if hasattr(config, "workerinput") and _finished_sessions:
        # An xdist worker's results are with the controller by now: freeing what it holds
        # (torch, transformers, Dynamo's caches; ~1M objects) one by one took 4-7 s of CPU
        # after its last test, which the controller waits for. It ends at once instead, before
        # any other exit handler (those registered before this one).
        atexit.register(_end_now, int(_finished_sessions[-1].exitstatus))
    else:
        gc.unfreeze()  # the objects frozen above are freed at exit as usual


def _end_now(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with every file of tests/distributed in one unit of work: one worker
    runs their process groups one after another (none beside another group) from one fork
    server (tests/distributed/launcher.py: ~10 s of CPU to start in each worker that needs
    one), while the other worker runs other files."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    unit_of = _unit_of(config)
    # The queue in the workers' collection order, which file_order.py sorted costliest first.
    config.option.loadscopereorder = False

    class DistributedTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(super()._split_scope(nodeid))

    return DistributedTogether(config, log)


def _unit_of(config):
    """A test file's unit of work under ``--dist loadfile``: tests/distributed is one."""
    distributed = pathlib.Path(os.path.relpath(_MULTIPROCESS_DIR, config.rootpath)).as_posix() + "/"
    return lambda name: distributed if name.startswith(distributed) else name


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # an xdist worker (its "dist" option reads "no")
        seconds = config.workerinput["file_seconds"]
        file_order.costliest_first(items, _unit_of(config), seconds, config.rootpath)
    # The tests that start groups of processes (tests/distributed/) are marked, to run them
    # apart (-m multiprocess) or leave them out; `make test` runs them among the others.
    multiprocess = pytest.mark.multiprocess
    for item in items:
        if _MULTIPROCESS_DIR in pathlib.Path(item.fspath).parents:
            item.add_marker(multiprocess)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def fuzz_examples(request):
    """Examples for a hypothesis test: its CI default unless --fuzz-examples raises it."""

    def pick(default: int) -> int:
        return request.config.getoption("--fuzz-examples") or default

    return pick


@pytest.fixture
def skip_at_any_size(monkeypatch):
    """Skipping ignored rows at the tests' small sizes on a GPU too (policy.MIN_SKIP_MACS
    turns it off below ~2^39 multiply-adds there, where its host sync costs more than it
    saves), so that GPU runs of the compaction tests exercise it."""
    from cce_compile import policy

    monkeypatch.setattr(policy, "MIN_SKIP_MACS", 0)


@pytest.fixture
def mode_calls(monkeypatch):
    """The keyword arguments of every ``decide.mode`` call from here on, in order (the mode
    is still decide's own)."""
    from cce_compile import decide

    calls: list[dict] = []
    real_mode = decide.mode

    def recording_mode(*args, **kwargs):
        calls.append(kwargs)
        return real_mode(*args, **kwargs)

    monkeypatch.setattr(decide, "mode", recording_mode)
    return calls
