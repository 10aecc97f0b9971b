"""What the pass did, per cross-entropy site, and ``explain()``.

``explain(fn_or_model, *args, **kwargs)`` compiles the call with a recording backend that runs
the matcher without rewriting, executes it once (eagerly, through Dynamo), and returns a
:class:`Report`: every site, rewritten or not, why, and the logits memory a rewrite saves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sysconfig
from collections.abc import Iterator

import torch

from .. import config
from . import predicates as p
from .matching import (
    DISABLED,
    DISABLED_DETAIL,
    DTENSOR,
    ESCAPES,
    GRAPH_BREAK,
    MUTATION,
    Rejection,
    Site,
    find_sites,
)

_FIX = {
    ESCAPES: "compile the step that computes the loss from the model's outputs so the "
    "logits die inside the graph (e.g. `lambda x, y: model(x, labels=y).loss`); when the "
    "model returns them, CCE_ESCAPING_LOGITS=drop fuses the loss of training graphs and "
    "returns the logits as a tensor without data; CCE_ESCAPING_LOGITS=rewrite fuses it and "
    "keeps them",
    GRAPH_BREAK: "remove the graph break between lm_head and the loss "
    "(TORCH_LOGS=graph_breaks shows where it is)",
    DTENSOR: "distributed (DTensor) weights are not supported yet",
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
            if self.reason in _FIX:
                lines.append(f"    fix: {_FIX[self.reason]}")
        return "\n".join(lines)

    def one_line(self) -> str:
        """What the pass tells the log once per site it leaves alone."""
        fix = f" Fix: {_FIX[self.reason]}." if self.reason in _FIX else ""
        return (
            f"cce_compile: left the cross-entropy at {self.location} alone "
            f"({self.reason}): {self.detail}.{fix}"
        )


def _mib(count: int | None) -> str:
    return f"{(count or 0) / 2**20:,.1f} MiB"


@dataclasses.dataclass
class Report:
    """All sites seen while compiling one call."""

    sites: list[SiteReport]
    graphs: int

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
        return "\n".join([header, *map(str, self.sites)])


def _is_library(frame: str) -> bool:
    """A stack-trace line of an installed package (transformers, torch) or of Python itself."""
    path = frame.split('"')[1] if '"' in frame else frame
    return any(part in path for part in ("site-packages", "dist-packages")) or path.startswith(
        _STDLIB
    )


_STDLIB = sysconfig.get_paths()["stdlib"]


def _location(node) -> str:
    """Where the user wrote the call: the innermost frame of their own code, else the
    outermost compiled frame (a compiled library model's forward), not the loss helper."""
    trace = node.meta.get("stack_trace") or ""
    frames = [
        line.strip() for line in trace.strip().splitlines() if line.strip().startswith("File ")
    ]
    if not frames:
        return "<unknown>"
    own = [f for f in frames if not _is_library(f)]
    return (own[-1] if own else frames[0]).replace("File ", "")


def describe(found: Site | Rejection, rewritten: bool) -> SiteReport:
    """A SiteReport for a Site (rewritten, or matched but kept by CCE_DISABLE) or a
    Rejection."""
    result = SiteReport(found.loss.name, _location(found.loss), rewritten)
    if isinstance(found, Rejection):
        result.reason, result.detail = found.reason, found.detail
    elif not rewritten:
        result.reason, result.detail = DISABLED, DISABLED_DETAIL
    if isinstance(found, Site):
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


_recorders: list[list[SiteReport]] = []


def record(reports: list[SiteReport]) -> None:
    """Hand reports to any active ``recording()`` block."""
    for sink in _recorders:
        sink.extend(reports)


@contextlib.contextmanager
def recording() -> Iterator[list[SiteReport]]:
    """Collect the reports of every pass run inside the block."""
    sink: list[SiteReport] = []
    _recorders.append(sink)
    try:
        yield sink
    finally:
        _recorders.remove(sink)


def explain(fn_or_model, *args, **kwargs) -> Report:
    """Compile ``fn_or_model(*args, **kwargs)`` with a recording backend and report every
    cross-entropy site: rewritten or not, why, and the estimated logits memory saved.

    The call runs once, eagerly through Dynamo (nothing is rewritten or compiled by Inductor).
    """
    disabled = config.get().disable
    sites: list[SiteReport] = []
    graphs = 0

    def recording_backend(gm, example_inputs):
        nonlocal graphs
        for _, module in gm.named_modules():
            if isinstance(module, torch.fx.GraphModule):
                graphs += 1
                for found in find_sites(module.graph):
                    would_rewrite = isinstance(found, Site) and not disabled
                    sites.append(describe(found, rewritten=would_rewrite))
        return gm.forward

    compiled = torch.compile(fn_or_model, backend=recording_backend)
    compiled(*args, **kwargs)
    return Report(sites, graphs)
