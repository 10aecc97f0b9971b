"""cce_compile: Cut Cross-Entropy as a torch.compile graph rewrite.

Public surface::

    torch.compile(model, backend=cce_compile.backend)   # or backend="cce"
    cce_compile.enable() / cce_compile.disable()        # plain torch.compile(model)
    cce_compile.linear_cross_entropy(hidden, classifier, targets, ...)
    cce_compile.linear_log_probs(hidden, classifier, targets, temperature=..., ...)
    cce_compile.explain(fn_or_model, *args, **kwargs)
    with cce_compile.watch() as report: ...              # what the compiles in a block did
    cce_compile.config                                   # settings (docs/settings.md)

Attributes load lazily, so ``import cce_compile`` (and the CCE_COMPILE=1 start-up hook) does
not import torch until something is used.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

from . import config

__version__ = "0.1.0"

_LAZY = {
    "linear_cross_entropy": ("functional", "linear_cross_entropy"),
    "linear_log_probs": ("functional", "linear_log_probs"),
    "backend": ("compile_backend", "backend"),
    "enable": ("passes.install", "enable"),
    "disable": ("passes.install", "disable"),
    "explain": ("passes.report", "explain"),
    "watch": ("passes.report", "watch"),
}

__all__ = [
    "backend",
    "config",
    "disable",
    "enable",
    "explain",
    "linear_cross_entropy",
    "linear_log_probs",
    "watch",
]

if TYPE_CHECKING:
    from .compile_backend import backend
    from .functional import linear_cross_entropy, linear_log_probs
    from .passes.install import disable, enable
    from .passes.report import explain, watch


def _end_in_one_line(error: config.SettingsError) -> None:
    """A bad setting in the environment that nothing catches ends the program as its one line
    (``cce_compile.config.SettingsError: CCE_MODE='turbo' is not one of ...``), whatever route
    raised it: ``backend="cce"`` (through Dynamo's registry and importlib), ``enable()``, the op.
    The frames would only show where the settings were first used, not where the value came
    from. Only that error object is shortened: every other exception reaches the previous hook.
    """
    previous = sys.excepthook

    def excepthook(kind, value, traceback):
        if value is not error:
            return previous(kind, value, traceback)
        import traceback as tb

        sys.stderr.write("".join(tb.format_exception_only(kind, value)))

    sys.excepthook = excepthook


if config.torch_logs_names_cce():
    # torch refuses a TORCH_LOGS name it does not know when it is imported: register 'cce'
    # before (the start-up hook's .pth imports the package at interpreter start when
    # TORCH_LOGS names cce). logs.py imports nothing of torch until torch loads.
    from .passes import logs

    logs.register_before_torch()


try:  # the environment is read once, at the import of config
    config.get()
except config.SettingsError as _error:
    _end_in_one_line(_error)
    del _error


def __getattr__(name: str):
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(f".{module}", __name__), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cce_compile' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
