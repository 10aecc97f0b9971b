"""Graph breaks: where Dynamo cut a graph and why, which break separates a head from its loss
(and what removes it), and the frames Dynamo ran without compiling, read from its compilation
metrics.
"""

from __future__ import annotations

import re

import torch

from .report_types import FSDP2_FIX, GraphBreak, SiteReport, is_library_frame


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
    own = [f for f in frames if not is_library_frame(f)]
    location = (own or frames or ["<unknown>"])[-1]
    if frames and own and frames[-1] != own[-1]:
        location += f" (inside {frames[-1]})"
    return GraphBreak(location, headline, " ".join(hints), text)


def breaks_from_metrics(breaks: list[GraphBreak], metrics: list) -> None:
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


def blame_break(site: SiteReport, breaks: list[GraphBreak]) -> None:
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
    elif "require_grads" in text:
        site.fix = (
            "transformers' enable_input_require_grads hook (added with activation "
            "checkpointing when the embeddings are frozen, e.g. under PEFT) breaks the graph: "
            "call model.disable_input_require_grads() (non-reentrant checkpointing does not "
            "need it); the loss after the break is fused only if its logits are merely "
            "returned from a training graph (CCE_ESCAPING_LOGITS=drop, the default)"
        )
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
    elif "fsdp" in text:
        site.fix = FSDP2_FIX
    else:
        site.fix = (
            f"remove what breaks the graph at {cut.location}"
            + (f" ({cut.hint})" if cut.hint else "")
            + ", or compute the loss in the same compiled function as the head"
        )


_DDP_FIX = (
    "DistributedDataParallel's forward always breaks the graph, so a loss computed outside "
    "the wrapped module cannot meet its head: compute it inside the module's forward "
    "(`ddp_model(x, labels=y).loss`; logits it also returns are dropped under the default "
    "CCE_ESCAPING_LOGITS=drop), or set torch._dynamo.config.optimize_ddp = 'python_reducer' "
    "before wrapping the model and run the backward under compiled autograd"
)


def compilation_metrics() -> list:
    """Dynamo's compilation metrics so far (none on a torch without them)."""
    try:
        return list(torch._dynamo.utils.get_compilation_metrics())
    except Exception:  # a torch without them: no skipped-frame report
        return []


def new_metrics(seen: list) -> list:
    """Entries recorded since ``seen`` was taken (holding ``seen`` keeps their ids unique)."""
    old = {id(m) for m in seen}
    return [m for m in compilation_metrics() if id(m) not in old]


def skipped_frames(metrics: list) -> list[str]:
    """The frames of these compilation metrics that Dynamo ran without compiling, each as
    ``name (file:line): reason``."""
    return [_skipped(m) for m in metrics if _was_skipped(m)]


def _was_skipped(metrics) -> bool:
    return bool(getattr(metrics, "fail_type", None)) and not getattr(
        metrics, "has_guarded_code", True
    )


def _skipped(metrics) -> str:
    reason = str(getattr(metrics, "fail_reason", "") or "").strip().splitlines()
    where = f"{metrics.co_filename}:{metrics.co_firstlineno}"
    return f"{metrics.co_name} ({where}): {reason[0] if reason else metrics.fail_type}"
