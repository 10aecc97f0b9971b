"""What the pass did, per cross-entropy site, and ``explain()``.

``explain(fn_or_model, *args, **kwargs)`` compiles the call with a recording backend that runs
the matcher without rewriting, executes it once (eagerly, through Dynamo), and returns a
:class:`Report`: every site, rewritten or not, why, and the logits memory a rewrite saves.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
    "logits die inside the graph (e.g. `lambda x, y: model(x, labels=y).loss`), or set "
    "CCE_ESCAPING_LOGITS=rewrite to fuse the loss and keep the logits",
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

    def __str__(self) -> str:
        head = f"{'REWRITTEN' if self.rewritten else 'skipped'}  {self.loss}  at {self.location}"
        lines = [head]
        if self.rows is not None:
            size = f"{self.logits_bytes / 2**20:,.1f} MiB" if self.logits_bytes else "?"
            lines.append(
                f"    logits {self.rows} x {self.vocab}: ~{size} of logits memory "
                + ("saved" if self.rewritten else "not saved")
            )
        if not self.rewritten:
            lines.append(f"    reason: {self.reason}: {self.detail}")
            if self.reason in _FIX:
                lines.append(f"    fix: {_FIX[self.reason]}")
        return "\n".join(lines)


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
        return sum(s.logits_bytes or 0 for s in self.rewritten)

    def __str__(self) -> str:
        header = (
            f"cce_compile: {len(self.sites)} cross-entropy site(s) in {self.graphs} graph(s), "
            f"{len(self.rewritten)} rewritten, ~{self.saved_bytes / 2**20:,.1f} MiB of logits "
            "memory saved"
        )
        return "\n".join([header, *map(str, self.sites)])


def _location(node) -> str:
    trace = node.meta.get("stack_trace") or ""
    frames = [
        line.strip() for line in trace.strip().splitlines() if line.strip().startswith("File ")
    ]
    return frames[-1].replace("File ", "") if frames else "<unknown>"


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
