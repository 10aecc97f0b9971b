"""``enable()`` / ``disable()``: the pass on Inductor's pre-grad hook, for plain torch.compile.

The hook takes one callable on torch 2.11 and a callable or a list on 2.13; a pass the user
installed is kept and chained with ours in a pass whose uuid combines both.
"""

from __future__ import annotations

from typing import Any

from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

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


def enable() -> None:
    """Install the pass for every ``torch.compile`` that uses Inductor (idempotent)."""
    if not enabled():
        _install([*_flatten(inductor_config.pre_grad_custom_pass), _PASS])


def disable() -> None:
    """Remove the pass, leaving any other installed pass in place."""
    _install([p for p in _flatten(inductor_config.pre_grad_custom_pass) if not is_cce_pass(p)])
