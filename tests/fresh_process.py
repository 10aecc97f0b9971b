"""Code for the scripts that tests run in a fresh Python (the start-up hook, an installed wheel,
a launcher's ranks). Imports nothing of cce_compile: some of those scripts must not."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import tempfile

# Every Inductor compile of the script runs as Inductor does up to its code generation (the
# pre-grad hook where CCE_COMPILE=1 puts the pass, the backend "cce", decompositions,
# AOTAutograd), then its forward and backward graphs run as FX code: what tests/harness.py's
# inductor_without_codegen() does in-process. For scripts that test how the pass gets installed,
# not Inductor's C++ for the op (tests/op, test_backend.py build it): a tiny loss compiles in
# ~3 s of CPU instead of ~15 s with a cold cache. There is no generated code to cache.
INDUCTOR_WITHOUT_CODEGEN = """
import torch._functorch.config, torch._inductor.config
from torch._functorch.aot_autograd import make_boxed_func as _boxed
from torch._inductor import compile_fx as _compile_fx_module

_real_compile_fx = _compile_fx_module.compile_fx


def _compile_fx_without_codegen(*args, **kwargs):
    kwargs.setdefault("inner_compile", lambda gm, example_inputs, **_: _boxed(gm.forward))
    return _real_compile_fx(*args, **kwargs)


_compile_fx_module.compile_fx = _compile_fx_without_codegen
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
"""


def install_inductor_without_codegen() -> None:
    """INDUCTOR_WITHOUT_CODEGEN, in this process: for a script file that imports this module."""
    exec(INDUCTOR_WITHOUT_CODEGEN, {})


# Several scripts that each need a fresh Python with the same environment: one Python imports
# what they share (`preload`: torch, Dynamo and Inductor take ~6 s of CPU), then forks itself
# for each script in turn. A fork of a process that imported modules
# and ran nothing else is what a fresh `python -c SCRIPT` is once it has imported them: the
# start-up hook ran at interpreter start with the same environment, and nothing compiled,
# cached or registered in memory before the fork. Each child's stdout and stderr go to files;
# an exception the script does not catch ends the child as it ends `python -c` (sys.excepthook,
# exit status 1; SystemExit's message and code).
_FORK_RUNNER = """
import importlib, json, os, sys

job = json.loads(sys.argv[1])
for module in job["preload"]:
    importlib.import_module(module)
statuses = []
for index, script in enumerate(job["scripts"]):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, stream in ((1, "out"), (2, "err")):
            path = os.path.join(job["dir"], f"{index}.{stream}")
            target = os.open(path, os.O_WRONLY | os.O_CREAT)
            os.dup2(target, fd)
            os.close(target)
        sys.argv = ["-c"]
        exec(compile(script, "<string>", "exec"), {"__name__": "__main__"})
        sys.exit(0)
    statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(statuses))
"""


def run_in_forks(
    scripts: list[str],
    env: dict[str, str],
    preload: tuple[str, ...] = ("torch",),
    timeout: float = 600,
) -> list[subprocess.CompletedProcess]:
    """Each of ``scripts`` as ``python -c SCRIPT`` under ``env`` would run it, one after another
    (a script sees what the scripts before it left on disk), in forks of one Python that imported
    ``preload`` first: the result of each, as subprocess.run(capture_output=True, text=True)
    gives it."""
    with tempfile.TemporaryDirectory() as folder:
        job = json.dumps(dict(preload=list(preload), scripts=scripts, dir=folder))
        runner = subprocess.run(
            [sys.executable, "-c", _FORK_RUNNER, job],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if runner.returncode != 0:
            raise RuntimeError(f"the fork runner failed:\n{runner.stderr[-3000:]}")
        statuses = json.loads(runner.stdout.splitlines()[-1])
        folder_path = pathlib.Path(folder)
        return [
            subprocess.CompletedProcess(
                ["-c", script],
                status,
                (folder_path / f"{index}.out").read_text(),
                (folder_path / f"{index}.err").read_text(),
            )
            for index, (script, status) in enumerate(zip(scripts, statuses))
        ]
