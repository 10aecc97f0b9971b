"""``enable()`` / ``disable()``: the pass on Inductor's pre-grad hook, for plain torch.compile.

The hook takes one callable on torch 2.11 and a callable or a list on 2.13; a pass the user
installed is kept and chained with ours in a pass whose uuid combines both.

Timing: torch 2.13 runs a pre-grad pass that has a uuid "late", after Inductor's cache lookup,
so on a warm cache the pass would not run at all and nothing could say what the cached graph
holds. ``enable()`` therefore sets ``pre_grad_pass_timing`` to "early" (when the user left it
at "default"): the pre-grad passes run on every compile, before the lookup, and the cache key
is taken from the rewritten graph. ``disable()`` puts "default" back. torch 2.11 always runs
them before the lookup.
"""

from __future__ import annotations

from typing import Any

from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .. import config
from ..integrations import accelerate_fsdp2
from . import ddp_split, tracing
from .graph_pass import CCEGraphPass, is_cce_pass

_PASS = CCEGraphPass()


class ChainedPass(CustomGraphPass):
    """Runs the user's pre-grad pass(es), then ours; cacheable only if all of them are."""

    def __init__(self, passes: list[Any]):
        self.passes = passes

    def __call__(self, graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> Any:
        parts = []
        for graph_pass in self.passes:
            part = graph_pass.uuid() if isinstance(graph_pass, CustomGraphPass) else None
            if part is None:
                return None  # an uncacheable user pass makes the chain uncacheable
            parts.append(part)
        return get_hash_for_files((__file__,), extra=repr(parts))


def _flatten(current: Any) -> list[Any]:
    if current is None:
        return []
    if isinstance(current, ChainedPass):
        return list(current.passes)
    if isinstance(current, (list, tuple)):
        return [p for item in current for p in _flatten(item)]
    return [current]


def enabled() -> bool:
    """Is the pass on Inductor's pre-grad hook?"""
    return any(is_cce_pass(p) for p in _flatten(inductor_config.pre_grad_custom_pass))


def _install(passes: list[Any]) -> None:
    """Put ``passes`` on the hook: none, the one, or a chain of them in order."""
    if not passes:
        inductor_config.pre_grad_custom_pass = None
    elif len(passes) == 1:
        inductor_config.pre_grad_custom_pass = passes[0]
    else:
        inductor_config.pre_grad_custom_pass = ChainedPass(passes)


_timing_changed = False  # enable() set pre_grad_pass_timing to "early"


def _run_before_cache_lookup(on: bool) -> None:
    global _timing_changed
    timing = getattr(inductor_config, "pre_grad_pass_timing", None)
    if on and timing == "default":
        inductor_config.pre_grad_pass_timing = "early"
        _timing_changed = True
    elif not on and _timing_changed:
        if timing == "early":
            inductor_config.pre_grad_pass_timing = "default"
        _timing_changed = False


def enable() -> None:
    """Install the pass for every ``torch.compile`` that uses Inductor (idempotent), make
    Dynamo ignore transformers' once-only logging calls (``tracing.py``), and keep the head
    of a compiled model in accelerate's FSDP2 root unit (``integrations/accelerate_fsdp2.py``).
    A bad setting in the environment is raised here, in one line, rather than inside the first
    compile."""
    config.get()
    if not enabled():
        _install([*_flatten(inductor_config.pre_grad_custom_pass), _PASS])
    _run_before_cache_lookup(True)
    tracing.install()
    ddp_split.install()
    accelerate_fsdp2.install()  # the head in accelerate's FSDP2 root unit, with its loss


def disable() -> None:
    """Remove the pass, leaving any other installed pass in place."""
    _install([p for p in _flatten(inductor_config.pre_grad_custom_pass) if not is_cce_pass(p)])
    _run_before_cache_lookup(False)
