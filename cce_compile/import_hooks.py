"""Run a function right after a module's code has run, without importing the module.

The start-up hook (torch.compile), the log registration (``torch._logging``) and the
integrations (TRL's trainer utilities, accelerate's FSDP2 preparation) each patch a module
they must not import themselves: importing torch, TRL or accelerate at start-up would cost
every process seconds. Imports nothing beyond the standard library.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: takes the spec the other finders give ``name`` and wraps its
    loader so that ``then(module)`` runs right after the module's code. One shot."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]):
        self.name, self.then = name, then

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # one shot, and no recursion below
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            self.then(module)

        spec.loader.exec_module = exec_module  # this module's loader instance only
        return spec

    def is_for(self, name: str, then: Callable) -> bool:
        return self.name == name and self.then == then


def after_import(name: str, then: Callable[[ModuleType], None]) -> None:
    """``then(module)`` now if ``name`` is imported, else right after its first import; asking
    twice for the same pair waits once."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
    elif not any(isinstance(f, _AfterImport) and f.is_for(name, then) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


def waiting(name: str) -> bool:
    """Is something waiting for ``name``'s first import?"""
    return any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path)


def cancel(name: str, then: Callable[[ModuleType], None]) -> None:
    """No longer wait for ``name`` with ``then``."""
    sys.meta_path[:] = [
        f for f in sys.meta_path if not (isinstance(f, _AfterImport) and f.is_for(name, then))
    ]
