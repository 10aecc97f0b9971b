"""The pass: a ``CustomGraphPass`` that rewrites every matched site of a Dynamo graph.

Matches and rejections are counted in ``torch._dynamo.utils.counters["cce_compile"]``
(``rewritten``, ``skipped:<reason>``). Every site, rewritten or not, is logged at INFO by the
``cce_compile`` logger on every run (``TORCH_LOGS=cce``; ``+cce`` adds the rewritten graph, and
tlparse gets both as artifacts: ``logs.py``). A site left alone that the user did not ask for
is also a warning, once per site and reason (not on every recompile), with what to change: it
is never silent. Leaving alone what the user asked for (an evaluation graph's logits, which
``CCE_ESCAPING_LOGITS=drop`` keeps; ``=keep``) is INFO only.
The pass is idempotent (a rewritten site no longer matches), adds no placeholder and
recurses into nothing by itself: Inductor's pre-grad hook calls it once per (sub)graph, and the
backend calls ``run_on_module`` for sub-graphs.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import pathlib

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, GraphModule

from .. import config
from ..op.custom_ops import IMPLEMENTATION_VERSION
from . import logs, report, rules, tracing
from .matching import settled_sites
from .plain import OP
from .report_types import SiteReport, describe

log = logging.getLogger("cce_compile")
logs.register()


@functools.cache
def _source_digest() -> str:
    """The pass's own sources, and those of the package that decide what it emits (``decide``
    and the policy it applies, the settings); the op's sources come in through its version."""
    package = pathlib.Path(__file__).parent.parent
    digest = hashlib.sha256()
    sources = sorted(pathlib.Path(__file__).parent.glob("*.py"))
    deciders = [package / name for name in ("decide.py", "policy.py", "config.py")]
    for path in [*sources, *deciders]:
        digest.update(path.read_bytes())
    digest.update(str(OP._schema).encode())
    digest.update(str(IMPLEMENTATION_VERSION).encode())
    return digest.hexdigest()


def pass_uuid() -> str:
    """Covers the pass's sources, the op's schema and sources, and the settings that change
    what the rewrite emits: a cached graph is never one from another rewrite."""
    return f"cce_compile:{_source_digest()}:{config.get().rewrite_key()}"


_told: set[tuple[str, str]] = set()  # (location, reason) already warned about once


def _tell(described: SiteReport) -> None:
    """A site left alone that the user did not ask for: a warning, once per process; every
    other site, and that one again: INFO (``TORCH_LOGS=cce``)."""
    key = (described.location, described.reason)
    if not described.rewritten and not described.quiet and key not in _told:
        _told.add(key)
        log.warning("%s", described.one_line())
    else:
        log.info("%s", described.one_line())


def _tell_symbolic_once(described: SiteReport, names: list[str]) -> None:
    """A float argument of the op is specialised by Dynamo: each new value recompiles."""
    key = (described.location, "symbolic:" + ",".join(names))
    if not names or key in _told:
        return
    _told.add(key)
    log.warning(
        "cce_compile: the cross-entropy at %s is fused; its %s is traced as a symbolic "
        "Python float (it changed between calls, or dynamic=True), which the fused op takes "
        "as a constant: each new value recompiles (past torch._dynamo.config.recompile_limit "
        "the frame runs eagerly, unfused). Nothing to do if it never changes; otherwise keep "
        "it constant%s.",
        described.location,
        " and ".join(names),
        ", or scale the hidden states or the classifier by a tensor instead"
        if "logit scale" in names
        else "",
    )


def _count(reports: list[SiteReport], step: int) -> None:
    for described in reports:
        key = "rewritten" if described.rewritten else f"skipped:{described.reason}"
        counters["cce_compile"][key] += step


# The compile in progress (Dynamo's CompileContext), its attempt and that attempt's per-graph
# reports. Dynamo may restart its analysis of a frame (e.g. to tensorify Python floats): the
# graphs of the abandoned attempt never run, so what the pass counted and reported for them is
# taken back.
_compile: list = [None, 0, []]


def _account(reports: list[SiteReport]) -> None:
    """Count and report one graph's sites, replacing those of an abandoned earlier attempt."""
    context = torch._guards.CompileContext.try_get()
    if context is not None:
        if _compile[0] is not context:  # a new compile: nothing to take back
            _compile[:] = [context, context.attempt, []]
        elif _compile[1] != context.attempt:  # a restart: the earlier attempt's graphs are gone
            for abandoned in _compile[2]:
                _count(abandoned, -1)
                report.forget(abandoned)
            _compile[1:] = [context.attempt, []]
        _compile[2].append(reports)
    _count(reports, +1)
    report.record(reports)


def run_pass(graph: Graph) -> list[SiteReport]:
    """Rewrite every matched site of ``graph``; returns one report per candidate.

    The RL rules run first (``rules.py``); what they rewrote that no rewritten site uses is
    put back as it was (``journal.py``) before the sites are rewritten."""
    settings = config.get()
    tracing.ignore_library_logging()  # for the next compiles, if transformers came late
    journal = rules.canonicalize(graph)
    reports = []
    for found, rewrite in settled_sites(graph, journal, rewrite=not settings.disable):
        described = describe(found, rewritten=rewrite)
        if rewrite:
            _tell_symbolic_once(described, found.symbolic_constants())
            found.rewrite(graph)
        _tell(described)
        reports.append(described)
    journal.finish()
    if reports:
        logs.site_artifact(reports)
    if any(r.rewritten for r in reports):
        graph.lint()
        logs.rewritten_graph(graph)
    if reports or not any(n.target is OP for n in graph.nodes):
        # (a graph that holds the op and nothing new went through the pass already: the
        # backend's run, then Inductor's hook under enable())
        _account(reports)
    return reports


def run_on_module(gm: GraphModule) -> list[SiteReport]:
    """Run on a GraphModule and on the sub-graphs its higher-order ops call (checkpointing)."""
    reports = []
    for _, module in gm.named_modules():
        if isinstance(module, GraphModule):
            found = run_pass(module.graph)
            if any(r.rewritten for r in found):
                module.recompile()
            reports.extend(found)
    return reports


class CCEGraphPass(CustomGraphPass):
    """Inductor pre-grad pass inserting ``cce::linear_cross_entropy``."""

    def __call__(self, graph: Graph) -> None:
        run_pass(graph)

    def uuid(self) -> str:
        return pass_uuid()


def is_cce_pass(candidate: object) -> bool:
    return isinstance(candidate, CCEGraphPass)
