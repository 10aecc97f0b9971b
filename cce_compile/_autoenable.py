"""Start-up hook behind ``CCE_COMPILE=1``: enable the graph pass when torch is imported.

``cce_compile_autoenable.pth`` (installed into site-packages) imports this module at
interpreter start, and only when a ``CCE_*`` variable is set: without one, no process imports
cce_compile at start-up. It must stay cheap and harmless: it reads the settings (no torch
import; a misspelt ``CCE_*`` name is reported then) and, only when CCE_COMPILE asks for the hook
(CCE_COMPILE=0 does not), installs a finder that runs :func:`cce_compile.enable` right after
``import torch`` finishes, so a script that never imports cce_compile still gets the pass for
plain ``torch.compile(model)``. It never prints a traceback: a bad setting or a failure to
enable is one line on stderr (only when CCE_COMPILE asks for the hook), and the script runs on.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys

from . import config

log = logging.getLogger("cce_compile")


def _enable() -> None:
    try:
        from .passes.install import enable

        enable()
    except Exception as error:  # never break the user's `import torch`
        log.warning(
            "cce_compile: CCE_COMPILE=1 could not enable the pass: %s: %s",
            type(error).__name__,
            error,
        )


class _AfterTorchImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps torch's loader so that _enable runs after torch loads."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # one shot, and no recursion below
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            _enable()

        loader.exec_module = exec_module
        return spec


def install() -> None:
    if not config.auto_enable_requested():
        return
    try:
        if not config.get().auto_enable:
            return
    except config.SettingsError as error:
        log.warning("cce_compile: %s; CCE_COMPILE did not enable the pass", error)
        return
    if "torch" in sys.modules:
        _enable()
    elif not any(isinstance(f, _AfterTorchImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorchImport())


install()
