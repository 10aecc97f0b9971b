"""What the pass did, per cross-entropy site, and ``explain()``.

``explain(fn_or_model, *args, **kwargs)`` compiles the call with a recording backend that runs
the matcher without rewriting, executes it once (eagerly, through Dynamo), and returns a
:class:`Report`: every site, rewritten or not, why, and the logits memory a rewrite saves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sysconfig
from collections.abc import Iterator

import torch
from torch._dynamo.utils import counters

from .. import config
from . import predicates as p
from . import tracing
from .matching import (
    DISABLED,
    DISABLED_DETAIL,
    DTENSOR,
    ESCAPES,
    GRAPH_BREAK,
    MUTATION,
    REWRITABLE,
    Rejection,
    Site,
    find_sites,
)

_FIX = {
    ESCAPES: "compile the step that computes the loss from the model's outputs so the "
    "logits die inside the graph (e.g. `lambda x, y: model(x, labels=y).loss`), or use the "
    "CCE_ESCAPING_LOGITS setting named above",
    GRAPH_BREAK: "remove the graph break between lm_head and the loss "
    "(cce_compile.explain() shows where it is and what removes it); under FSDP2, whose hooks "
    "cut the frame that holds the head, use cce_compile.distributed.deferred_head "
    "(docs/distributed.md)",
    DTENSOR: "only a ColwiseParallel lm_head (weight Shard(0) on a 1-D mesh) with a "
    "cross_entropy over the whole vocabulary is fused; see docs/distributed.md",
    DISABLED: "unset CCE_DISABLE",
    MUTATION: "move the in-place operation before the head or after the loss, or make it "
    "out of place",
}


@dataclasses.dataclass
class SiteReport:
    """One cross-entropy call site in a compiled graph."""

    loss: str  # node name
    location: str  # user source line, from the node's stack trace
    rewritten: bool
    reason: str = ""
    detail: str = ""
    rows: int | None = None
    vocab: int | None = None
    logits_bytes: int | None = None  # what eager stores for this loss: logits + float32 softmax
    saved_bytes: int = 0  # what the rewrite saves of it (logits kept for other users: less)
    logits: str = ""  # rewritten: "gone", "kept" (CCE_ESCAPING_LOGITS=rewrite) or "dropped"
    fix: str = ""  # what to change, when explain() knows better than the reason's usual fix

    @property
    def advice(self) -> str:
        return self.fix or _FIX.get(self.reason, "")

    def __str__(self) -> str:
        head = f"{'REWRITTEN' if self.rewritten else 'skipped'}  {self.loss}  at {self.location}"
        lines = [head]
        if self.rows is not None:
            size = _mib(self.logits_bytes) if self.logits_bytes else "?"
            memory = f"    logits {self.rows} x {self.vocab}: ~{size} of loss memory in eager"
            if not self.rewritten:
                memory += ", not saved"
            elif self.logits == "kept":
                memory += (
                    f"; ~{_mib(self.saved_bytes)} saved (the logits are kept for their other "
                    "users: CCE_ESCAPING_LOGITS=rewrite)"
                )
            else:
                memory += ", saved"
                if self.logits == "dropped":
                    memory += " (the returned logits are a 'meta' tensor: CCE_ESCAPING_LOGITS=drop)"
            lines.append(memory)
        if not self.rewritten:
            lines.append(f"    reason: {self.reason}: {self.detail}")
            if self.advice:
                lines.append(f"    fix: {self.advice}")
        return "\n".join(lines)

    def one_line(self) -> str:
        """What the pass tells the log once per site it leaves alone."""
        fix = f" Fix: {self.advice}." if self.advice else ""
        return (
            f"cce_compile: left the cross-entropy at {self.location} alone "
            f"({self.reason}): {self.detail}.{fix}"
        )


def _mib(count: int | None) -> str:
    return f"{(count or 0) / 2**20:,.1f} MiB"


@dataclasses.dataclass
class GraphBreak:
    """Where Dynamo cut a graph, and why (its own message's headline and hint)."""

    location: str
    reason: str
    hint: str = ""
    text: str = dataclasses.field(default="", repr=False)  # Dynamo's whole message

    def __str__(self) -> str:
        hint = f"\n    hint: {self.hint}" if self.hint else ""
        return f"graph break at {self.location}: {self.reason}{hint}"


@dataclasses.dataclass
class Report:
    """All sites seen while compiling one call (explain), or in the compiles of a block
    (watch)."""

    sites: list[SiteReport] = dataclasses.field(default_factory=list)
    graphs: int = 0
    breaks: list[GraphBreak] = dataclasses.field(default_factory=list)
    skipped_frames: list[str] = dataclasses.field(default_factory=list)  # Dynamo ran eagerly
    unseen_graphs: int = 0  # (watch) graphs Dynamo compiled in the block without the pass
    _runs: list = dataclasses.field(default_factory=list, repr=False)  # (watch) per graph

    @property
    def rewritten(self) -> list[SiteReport]:
        return [s for s in self.sites if s.rewritten]

    @property
    def saved_bytes(self) -> int:
        return sum(s.saved_bytes for s in self.rewritten)

    def __str__(self) -> str:
        header = (
            f"cce_compile: {len(self.sites)} cross-entropy site(s) in {self.graphs} graph(s), "
            f"{len(self.rewritten)} rewritten, ~{self.saved_bytes / 2**20:,.1f} MiB of logits "
            "memory saved"
        )
        lines = [header, *map(str, self.sites), *map(str, self.breaks)]
        if self.skipped_frames:
            lines.append(
                f"Dynamo ran {len(self.skipped_frames)} frame(s) without compiling them (a "
                "loss in one of them is not seen):"
            )
            lines += [f"    {frame}" for frame in self.skipped_frames]
        if self.unseen_graphs:
            lines.append(
                f"the pass did not run on the {self.unseen_graphs} graph(s) compiled in this "
                "block: compile with backend='cce' (cce_compile.backend), or call "
                "cce_compile.enable() (CCE_COMPILE=1) before compiling"
            )
        return "\n".join(lines)


def _is_library(frame: str) -> bool:
    """A stack-trace line of an installed package (transformers, torch) or of Python itself."""
    path = frame.split('"')[1] if '"' in frame else frame
    return any(part in path for part in ("site-packages", "dist-packages")) or path.startswith(
        _STDLIB
    )


_STDLIB = sysconfig.get_paths()["stdlib"]


def _location(node) -> str:
    """Where the user wrote the call: the innermost frame of their own code; in a compiled
    library model (no user frame), the innermost model ``forward`` (the line that calls the
    loss), not the loss helper or a decorator."""
    trace = node.meta.get("stack_trace") or ""
    frames = [
        line.strip() for line in trace.strip().splitlines() if line.strip().startswith("File ")
    ]
    if not frames:
        return "<unknown>"
    own = [f for f in frames if not _is_library(f)]
    forwards = [f for f in frames if f.endswith(" in forward") and "/torch/" not in f]
    return (own or forwards or frames)[-1].replace("File ", "")


def describe(found: Site | Rejection, rewritten: bool) -> SiteReport:
    """A SiteReport for a site (rewritten, or matched but kept by CCE_DISABLE; a
    TensorParallelSite's vocab is the classes per rank) or a Rejection."""
    result = SiteReport(found.loss.name, _location(found.loss), rewritten)
    if isinstance(found, Rejection):
        result.reason, result.detail = found.reason, found.detail
    elif not rewritten:
        result.reason, result.detail = DISABLED, DISABLED_DETAIL
    if isinstance(found, REWRITABLE):
        rows, vocab = p.size_hint(found.rows), p.size_hint(found.vocab)
        result.rows, result.vocab = rows, vocab
        if rows is not None and vocab is not None:
            head_bytes = p.tensor_value(found.head).element_size()
            result.logits_bytes = rows * vocab * (head_bytes + 4)
            if rewritten:
                # Kept logits stay in memory; only the float32 log-probabilities are saved.
                kept = bool(found.kept_logits)
                result.saved_bytes = rows * vocab * 4 if kept else result.logits_bytes
        if rewritten:
            result.logits = (
                "kept" if found.kept_logits else "dropped" if found.dropped_logits else "gone"
            )
    return result


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
        _breaks_from_metrics(report.breaks, _new_metrics(seen))
        for _, module in gm.named_modules():
            if isinstance(module, torch.fx.GraphModule):
                report.graphs += 1
                for found in find_sites(module.graph):
                    would_rewrite = isinstance(found, REWRITABLE) and not disabled
                    described = describe(found, rewritten=would_rewrite)
                    if isinstance(found, Rejection) and found.reason == GRAPH_BREAK:
                        _blame_break(described, report.breaks)
                    report.sites.append(described)
        cut = graph_break(gm)
        if cut is not None:
            report.breaks.append(cut)
        return gm.forward

    tracing.install()
    seen = _compilation_metrics()  # a bounded deque: the new entries are told by identity
    compiled = torch.compile(fn_or_model, backend=recording_backend)
    compiled(*args, **kwargs)
    metrics = _new_metrics(seen)
    _breaks_from_metrics(report.breaks, metrics)
    report.skipped_frames = [_skipped(m) for m in metrics if _was_skipped(m)]
    return report


def graph_break(gm: torch.fx.GraphModule) -> GraphBreak | None:
    """The break that ended this Dynamo graph, if a break (not a return) ended it."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    text = str(reason.reason).strip()
    headline = text.splitlines()[0] if text else "graph break"
    hints = [ln.strip()[len("Hint:") :].strip() for ln in text.splitlines() if "Hint:" in ln]
    stack = list(getattr(reason, "user_stack", []) or [])
    frames = [f'"{f.filename}", line {f.lineno}, in {f.name}' for f in stack]
    own = [f for f in frames if not _is_library(f)]
    location = (own or frames or ["<unknown>"])[-1]
    if frames and own and frames[-1] != own[-1]:
        location += f" (inside {frames[-1]})"
    return GraphBreak(location, headline, " ".join(hints), text)


def _breaks_from_metrics(breaks: list[GraphBreak], metrics: list) -> None:
    """Add the breaks Dynamo restarted a frame for that no graph reported (a break before
    any op, e.g. at a DistributedDataParallel call), in order, once each."""
    known = {(b.reason, b.location) for b in breaks} | {b.reason for b in breaks}
    for entry in metrics:
        for text in sorted(getattr(entry, "restart_reasons", None) or ()):
            headline = str(text).strip().splitlines()[0]
            where = f'"{entry.co_filename}", line {entry.co_firstlineno}, in {entry.co_name}'
            if headline in known or (headline, where) in known:
                continue
            known.add(headline)
            breaks.append(GraphBreak(where, headline, "", str(text)))


def _blame_break(site: SiteReport, breaks: list[GraphBreak]) -> None:
    """Name the break before the graph whose input the logits are, and what removes it."""
    if not breaks:
        return
    cut = breaks[-1]
    resumed = re.search(r"torch_dynamo_resume_in_(.+)_at_(\d+)", site.location)
    if resumed:  # the break Dynamo resumed this frame after: same function (and line)
        function, line = resumed.groups()
        same = [b for b in breaks if b.location.endswith(f", in {function}")]
        exact = [b for b in same if f"line {line}," in b.location]
        cut = (exact or same or [cut])[-1]
    site.detail += f"; the last graph break before it: {cut.reason} at {cut.location}"
    text = f"{cut.reason} {cut.location} {cut.text}".lower()
    if any(m in text for m in ("distributed.py", "ddp", "set_runtime_stats_and_log")):
        site.fix = _DDP_FIX
    elif re.search(r"\bprint\b", text):
        site.fix = (
            "a print() call breaks the graph: add print to "
            "torch._dynamo.config.reorderable_logging_functions (Dynamo then prints after the "
            "graph runs), or move it out of the forward"
        )
    elif "logging" in text or "logger" in text:
        site.fix = (
            "a logging call breaks the graph: add it to "
            "torch._dynamo.config.ignore_logging_functions (cce_compile adds transformers' "
            "warning_once/info_once), or move it out of the forward"
        )
    else:
        site.fix = (
            f"remove what breaks the graph at {cut.location}"
            + (f" ({cut.hint})" if cut.hint else "")
            + ", or compute the loss in the same compiled function as the head"
            + (" (under FSDP2: cce_compile.distributed.deferred_head)" if "fsdp" in text else "")
        )


_DDP_FIX = (
    "DistributedDataParallel's forward always breaks the graph, so a loss computed outside "
    "the wrapped module cannot meet its head: compute it inside the module's forward "
    "(`ddp_model(x, labels=y).loss`; add CCE_ESCAPING_LOGITS=drop if the model also returns "
    "its logits), or set torch._dynamo.config.optimize_ddp = 'python_reducer' before wrapping "
    "the model and run the backward under compiled autograd"
)


def _compilation_metrics() -> list:
    try:
        return list(torch._dynamo.utils.get_compilation_metrics())
    except Exception:  # a torch without them: no skipped-frame report
        return []


def _new_metrics(seen: list) -> list:
    """Entries recorded since ``seen`` was taken (holding ``seen`` keeps their ids unique)."""
    old = {id(m) for m in seen}
    return [m for m in _compilation_metrics() if id(m) not in old]


def _was_skipped(metrics) -> bool:
    return bool(getattr(metrics, "fail_type", None)) and not getattr(
        metrics, "has_guarded_code", True
    )


def _skipped(metrics) -> str:
    reason = str(getattr(metrics, "fail_reason", "") or "").strip().splitlines()
    where = f"{metrics.co_filename}:{metrics.co_firstlineno}"
    return f"{metrics.co_name} ({where}): {reason[0] if reason else metrics.fail_type}"
