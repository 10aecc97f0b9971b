"""What the pass did, told to the user: ``explain()`` for one call, ``watch()`` for the compiles
of a block.

``explain(fn_or_model, *args, **kwargs)`` compiles the call with a recording backend that runs
the matcher without rewriting, executes it once (eagerly, through Dynamo), and returns a
:class:`~.report_types.Report`: every site, rewritten or not, why, the logits memory a rewrite
saves, and the graph breaks (``graph_breaks.py``). ``watch()`` collects the reports of the
pass's own runs (``graph_pass.py`` hands them over with ``record``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._dynamo.utils import counters

from .. import config
from . import graph_breaks, rules, tracing
from .matching import settled_sites
from .report_types import Report, SiteReport, describe
from .verdicts import GRAPH_BREAK, Rejection

_watchers: list[Report] = []


def record(reports: list[SiteReport]) -> None:
    """Hand one graph's reports to every active ``watch()`` block."""
    for report in _watchers:
        report.sites.extend(reports)
        report.graphs += 1
        report._runs.append(reports)


def forget(reports: list[SiteReport]) -> None:
    """Take back one graph's reports (a compile attempt Dynamo abandoned)."""
    for report in _watchers:
        if any(run is reports for run in report._runs):
            report._runs[:] = [run for run in report._runs if run is not reports]
            report.sites[:] = [s for s in report.sites if not any(s is r for r in reports)]
            report.graphs -= 1


@contextlib.contextmanager
def watch() -> Iterator[Report]:
    """What the pass did in every compile that runs inside the block::

        with cce_compile.watch() as report:
            loss = compiled_step(x, y)      # compiles here (first call, new shapes)
        log.info("%s", report)              # sites, rewritten or not and why, memory saved

    The pass runs on every compile, including those Inductor serves from its caches (the
    backend runs it before Inductor; ``enable()`` makes Inductor run it before its cache
    lookup), so the report is right on a warm cache. A call that compiles nothing (Dynamo
    reuses a compiled frame) adds nothing.
    """
    report = Report()
    compiled_before = counters["stats"]["unique_graphs"]
    _watchers.append(report)
    try:
        yield report
    finally:
        _watchers.remove(report)
        compiled = counters["stats"]["unique_graphs"] - compiled_before
        if report.graphs == 0 and compiled > 0:
            report.unseen_graphs = compiled


@contextlib.contextmanager
def recording() -> Iterator[list[SiteReport]]:
    """The site reports of every pass run inside the block (``watch()``'s sites)."""
    with watch() as report:
        yield report.sites


def explain(fn_or_model, *args, **kwargs) -> Report:
    """Compile ``fn_or_model(*args, **kwargs)`` with a recording backend and report every
    cross-entropy site: rewritten or not, why, and the estimated logits memory saved; every
    graph break (where, why, and what would remove it when it separates a head from its
    loss); and every frame Dynamo ran without compiling.

    The call runs once, eagerly through Dynamo (nothing is rewritten or compiled by Inductor),
    with Dynamo set up as the cce backend sets it up (transformers' logging calls ignored).
    """
    disabled = config.get().disable
    report = Report()

    def recording_backend(gm, example_inputs):
        graph_breaks.breaks_from_metrics(report.breaks, graph_breaks.new_metrics(seen))
        for _, module in gm.named_modules():
            if isinstance(module, torch.fx.GraphModule):
                report.graphs += 1
                journal = rules.canonicalize(module.graph)  # the RL forms, as the pass sees them
                for found, would_rewrite in settled_sites(module.graph, journal, not disabled):
                    described = describe(found, rewritten=would_rewrite)
                    if isinstance(found, Rejection) and found.reason == GRAPH_BREAK:
                        graph_breaks.blame_break(described, report.breaks)
                    report.sites.append(described)
                journal.settle([])  # the graph runs as it was written
        cut = graph_breaks.graph_break(gm)
        if cut is not None:
            report.breaks.append(cut)
        return gm.forward

    tracing.install()
    seen = (
        graph_breaks.compilation_metrics()
    )  # a bounded deque: the new entries are told by identity
    compiled = torch.compile(fn_or_model, backend=recording_backend)
    # DDP's graph cut (DDPOptimizer) comes after the pass (ddp_split.py): the whole graph is
    # what the pass sees.
    with torch._dynamo.config.patch(optimize_ddp=False):
        compiled(*args, **kwargs)
    metrics = graph_breaks.new_metrics(seen)
    graph_breaks.breaks_from_metrics(report.breaks, metrics)
    report.skipped_frames = graph_breaks.skipped_frames(metrics)
    return report
