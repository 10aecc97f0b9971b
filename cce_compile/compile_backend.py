"""``cce_compile.backend``: a torch.compile backend that rewrites, then hands over to Inductor.

(The module is not named ``backend``: importing a submodule sets the package attribute of its
name, which would replace the function ``cce_compile.backend`` with the module.)

    torch.compile(model, backend=cce_compile.backend)
    torch.compile(model, backend="cce", mode="max-autotune")   # by name (entry point)

``mode=`` and ``options=`` are applied exactly as the default backend applies them (through
``torch._TorchCompileInductorWrapper``), and the pass also runs on the sub-graphs of
higher-order ops such as activation checkpointing. Importing it makes Dynamo ignore
transformers' once-only logging calls, which would otherwise break the graph between lm_head
and the loss (``passes/tracing.py`` says how and for how long).

A bad setting in the environment (``CCE_MODE=turbo``) is raised when this module is imported:
when ``torch.compile(..., backend="cce")`` looks the backend up, or when the code names
``cce_compile.backend``. Raised from inside the backend, Dynamo would wrap it in its
``BackendCompilerFailed`` and bury its one line under some 40 lines of Dynamo's frames and
notes; raised here, nothing wraps it, and if nothing catches it the package's excepthook
(``cce_compile/__init__.py``) prints it as its one line, without the ~25 lines of frames through
torch.compile, Dynamo's registry and importlib. The environment is read once and
``config.update`` checks what it is given, so the settings cannot go bad after this point.
"""

from __future__ import annotations

from typing import Any

import torch

from . import config

try:
    config.get()
except config.SettingsError as error:
    # Without the frames of config.py's reading of the environment, at import time.
    raise error.with_traceback(None) from None

from .passes import ddp_split, tracing  # noqa: E402  (after the check: no side effects on a bad setting)
from .passes.graph_pass import run_on_module  # noqa: E402


def backend(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any):
    """Rewrite ``linear -> cross_entropy`` sites of the Dynamo graph, then compile with Inductor.

    Accepts the ``mode`` and ``options`` that ``torch.compile`` passes to a custom backend.
    """
    mode = kwargs.pop("mode", None)
    options = kwargs.pop("options", None)
    if kwargs:
        raise TypeError(f"cce_compile.backend got unexpected arguments {sorted(kwargs)}")
    tracing.ignore_library_logging()  # for the next compiles, if transformers came late
    inductor = torch._TorchCompileInductorWrapper(mode, options, None)
    # The pass sees Inductor's settings for this compile (CUDA graphs under "reduce-overhead"
    # and "max-autotune" change what it emits), as it does when Inductor's hook runs it.
    with torch._inductor.config.patch(inductor.config):
        run_on_module(gm)
    return inductor(gm, example_inputs)


def _reset() -> None:
    # What torch.compile's reset does for the default backend (CUDA graph trees).
    torch._TorchCompileInductorWrapper(None, None, None).reset()


backend.reset = _reset  # type: ignore[attr-defined]
setattr(backend, ddp_split.RUNS_THE_PASS, True)  # DDP's graph cut runs the pass first
tracing.install()
ddp_split.install()

# Registered by name on import too, for environments without the entry point (source trees).
if "cce" not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(backend, name="cce")
