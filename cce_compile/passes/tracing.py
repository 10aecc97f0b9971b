"""Graph breaks users cannot edit: transformers' logging calls between lm_head and the loss.

transformers logs from inside some forwards with ``logger.warning_once`` (GPT-2's missing
``loss_type``, gradient checkpointing's ``use_cache``). Dynamo cannot trace a logging call and
breaks the graph there, which puts the head and the loss in different graphs. Its supported
remedy is ``torch._dynamo.config.ignore_logging_functions``: calls of the functions in that set
are left out of the compiled code (the warning is not printed under compile).

What cce_compile adds to that set: transformers' once-only logging methods (``warning_once``,
``info_once``, ``warning_advice``, which transformers installs on ``logging.Logger`` when it is
imported), and nothing else; a user's own ``logger.warning`` still breaks the graph. When: as
soon as the cce backend is imported (``backend="cce"`` imports it) or ``enable()`` runs
(``CCE_COMPILE=1``), again when ``transformers.utils.logging`` is imported later (an import
hook: this holds also after ``torch._dynamo.reset()``), before every compile (a start-of-compile
callback) and at every run of the pass. For how long: for the
rest of the process, for every compile (Dynamo traces before it knows the backend, so the
setting cannot be scoped to our compiles: a backend's ``backend_ctx_ctor`` is dropped by
``torch.compile``'s wrapper, and compile callbacks are cleared by ``torch._dynamo.reset()``).
To keep those warnings under compile, remove them from the set after importing cce_compile.

On torch 2.11 a non-empty set makes Dynamo's metrics records fail, the compilation's and the
runtime's (its config dump sorts the set and serialises it to JSON: a TypeError); compiling is
unaffected, the error records it logs are filtered out here, and those frames' metrics are lost
(explain() then cannot list skipped frames or breaks that produced no graph).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from typing import Any

import torch

# Installed on logging.Logger by transformers.utils.logging.
_LIBRARY_LOGGING = ("warning_once", "info_once", "warning_advice")


def library_logging_functions() -> set[Any]:
    """transformers' once-only logging methods, if transformers has been imported."""
    return {getattr(logging.Logger, n) for n in _LIBRARY_LOGGING if hasattr(logging.Logger, n)}


def ignored() -> set[Any]:
    """The logging functions Dynamo leaves out of compiled code now."""
    return set(torch._dynamo.config.ignore_logging_functions)


def ignore_library_logging(*_: Any) -> None:
    """Add transformers' logging methods to Dynamo's ignore set (idempotent); also keeps the
    start-of-compile callback registered (``torch._dynamo.reset()`` clears callbacks)."""
    missing = library_logging_functions() - ignored()
    if missing:
        torch._dynamo.config.ignore_logging_functions = ignored() | missing
    handler = torch._dynamo.callback.callback_handler
    if ignore_library_logging not in handler.start_callbacks:
        handler.register_start_callback(ignore_library_logging)


_LOGGING_MODULE = "transformers.utils.logging"


class _AfterLibraryLogging(importlib.abc.MetaPathFinder):
    """Adds transformers' logging methods to the ignore set as soon as the module that
    installs them has run (the start-of-compile callback does not survive a reset)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _LOGGING_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        run_module = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            ignore_library_logging()

        spec.loader.exec_module = exec_module  # this module's loader instance only
        return spec


def _hook_library_import() -> None:
    if _LOGGING_MODULE in sys.modules:
        return
    if not any(isinstance(f, _AfterLibraryLogging) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLibraryLogging())


_METRICS_RECORDS = ("logging compilation metrics", "logging runtime metrics")
# Sorting two or more functions fails; one is sorted, then not serialisable.
_SET_ERRORS = ("'<' not supported between instances of", "is not JSON serializable")


class _MetricsSerialisationNoise(logging.Filter):
    """Drops torch 2.11's 'Unexpected exception logging compilation metrics' and '... runtime
    metrics' records that the functions in the ignore set cause (its config dump sorts the
    set and serialises it: a TypeError of comparing or serialising them), and only those."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        about_metrics = any(text in str(record.msg) for text in _METRICS_RECORDS)
        of_the_set = isinstance(error, TypeError) and any(e in str(error) for e in _SET_ERRORS)
        return not (about_metrics and of_the_set)


def install() -> None:
    """Ignore transformers' logging calls from now on (see the module docstring)."""
    metrics_log = logging.getLogger("torch._dynamo.metrics_context")
    if not any(isinstance(f, _MetricsSerialisationNoise) for f in metrics_log.filters):
        metrics_log.addFilter(_MetricsSerialisationNoise())
    _hook_library_import()
    ignore_library_logging()
