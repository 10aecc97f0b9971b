"""The pass's log under torch's logging controls, and its tlparse artifacts.

* ``TORCH_LOGS=cce`` (in code: ``torch._logging.set_logs(modules={"cce": logging.INFO})``):
  every site of every graph the pass runs on, rewritten or not, and why (INFO on the
  ``cce_compile`` logger).
  ``TORCH_LOGS=+cce``: also each rewritten graph (DEBUG). ``cce`` is registered with torch's
  ``register_log`` when the pass is imported; named in ``TORCH_LOGS`` at start-up, it is
  registered by the package's ``__init__`` (which the start-up hook's .pth imports at
  interpreter start when ``TORCH_LOGS`` names cce) as soon as ``torch._logging`` loads,
  before ``import torch`` reads ``TORCH_LOGS`` and refuses names it does not know.
  ``TORCH_LOGS=cce_compile`` (the logger's module name) needs neither.
* ``TORCH_TRACE`` / tlparse: each pass run that finds a site leaves a structured artifact
  ``cce_compile_sites`` (JSON, one entry per site), and one that rewrites leaves
  ``cce_compile_rewritten_graph`` (the graph's code after the rewrite), as Inductor's passes
  leave theirs.

Without these, the ``cce_compile`` logger says only what needs attention: a site left alone
that the user did not ask for, once per site, as a warning.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

from .. import import_hooks

ALIAS = "cce"
LOGGER = "cce_compile"
_TORCH_LOGGING = "torch._logging"

log = logging.getLogger(LOGGER)


def register() -> None:
    """Make ``cce`` a name of torch's logging controls (``TORCH_LOGS``, ``set_logs``)."""
    sys.modules[_TORCH_LOGGING + "._internal"].register_log(ALIAS, LOGGER)


def register_before_torch() -> None:
    """Register ``cce`` when torch loads (now, if it has): for ``TORCH_LOGS=cce`` at start-up."""
    import_hooks.after_import(_TORCH_LOGGING, _register_on)


def _register_on(_module) -> None:
    register()


def rewritten_graph(graph) -> None:
    """The graph after the rewrite: DEBUG (``TORCH_LOGS=+cce``) and a tlparse artifact."""
    from torch._logging import LazyString, trace_structured

    code = LazyString(lambda: graph.python_code(root_module="self").src)
    log.debug("cce_compile: the graph after the rewrite:%s", code)
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": "cce_compile_rewritten_graph", "encoding": "string"},
        payload_fn=lambda: str(code),
    )


def site_artifact(reports: list) -> None:
    """The sites of one graph as a tlparse artifact (JSON)."""
    from torch._logging import trace_structured

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": "cce_compile_sites", "encoding": "json"},
        payload_fn=lambda: [dataclasses.asdict(r) for r in reports],
    )
