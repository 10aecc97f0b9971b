"""The report types: what the pass did with one cross-entropy site (:class:`SiteReport`, made by
``describe`` from a match), where Dynamo cut a graph (:class:`GraphBreak`), and everything seen
while compiling (:class:`Report`, what ``explain()`` and ``watch()`` return).
"""

from __future__ import annotations

import dataclasses
import re
import sys
import sysconfig

from . import canonical, categorical, entropy_rules, escapes
from . import predicates as p
from .verdicts import (
    DISABLED,
    DISABLED_DETAIL,
    DTENSOR,
    ESCAPES,
    GRAPH_BREAK,
    MUTATION,
    NO_HEAD,
    UNSUPPORTED_OP,
    Rejection,
    Site,
)

_FIX = {
    ESCAPES: "compile the step that computes the loss from the model's outputs so the "
    "logits die inside the graph (e.g. `lambda x, y: model(x, labels=y).loss`), or use the "
    "CCE_ESCAPING_LOGITS setting named above",
    GRAPH_BREAK: "remove the graph break between lm_head and the loss "
    "(cce_compile.explain() shows where it is and what removes it)",
    DTENSOR: "only a ColwiseParallel lm_head (weight Shard(0) on a 1-D mesh) with a "
    "cross_entropy over the whole vocabulary is fused; see docs/distributed.md",
    DISABLED: "unset CCE_DISABLE",
    MUTATION: "move the in-place operation before the head or after the loss, or make it "
    "out of place",
    UNSUPPORTED_OP: "the pass fuses lm_head -> casts, views, row slices, a constant scale or "
    "softcap -> cross_entropy (docs/graph_forms.md); write the loss in that form, or move "
    "other ops after it",
}
# Details that name a form with a fix of its own, which replaces the reason's usual one: the
# entropies the rules leave alone (inexact_form, ``entropy_rules.FIXES``), and logits kept for
# a Categorical log_prob the rules do not recognise or for an entropy in another grad mode.
_FIX_IN_DETAIL = {
    **entropy_rules.FIXES,
    categorical.BROADCAST_IDS: categorical.BROADCAST_IDS_FIX,
    categorical.LOG_PROB_WRITTEN_IN_PLACE: categorical.LOG_PROB_WRITTEN_IN_PLACE_FIX,
    categorical.LOG_PROB_LEFT_AS_WRITTEN: categorical.LOG_PROB_LEFT_AS_WRITTEN_FIX,
    escapes.GRAD_MODES_DIFFER: escapes.GRAD_MODES_DIFFER_FIX,
}
# Added to UNSUPPORTED_OP's fix where the op in the chain is an addition to the logits: a
# vector of one value per class (a vocabulary mask) is a bias.
_ADDED_VECTOR_FIX = (
    "if it adds a vector of shape (V,) to every row (a vocabulary mask or a bias), pass it as the "
    "head's bias, F.linear(h, W, b), which fuses (with "
    "torch.distributions.Categorical(logits=z).entropy() for the entropy, 0 at a class of -inf)"
)
# Added to UNSUPPORTED_OP's fix where the op in the chain is an addition to the logits: what a
# LoRA adapter on lm_head makes (``_adds_to_the_logits``).
_LORA_ON_HEAD_FIX = (
    "if the addition is a LoRA adapter on lm_head (its low-rank branch), leave lm_head out of "
    "PEFT's target_modules (or train it whole with modules_to_save), docs/stacks.md"
)
# GRAPH_BREAK's fix in a process that uses FSDP2 (``fsdp2_in_use``): its hooks break the graph
# at every fully_shard-ed module, so the usual suspects are a head with a unit of its own and a
# loss computed outside the compiled frame that holds the head.
FSDP2_FIX = (
    "FSDP2's hooks break the graph at each fully_shard-ed module, so a head in an FSDP2 unit of "
    "its own runs eagerly between two graphs: accelerate's FSDP2 makes one of [final norm, "
    "lm_head], fully_shard([norm, output]) another. Keep the head in the root unit: under "
    "accelerate, cce_compile does so when the pass is on before accelerator.prepare "
    "(CCE_COMPILE=1 or cce_compile.enable()) and accelerate compiles the model "
    "(TrainingArguments(torch_compile=True)); elsewhere, do not fully_shard the head apart "
    "from the root. A head in the root unit whose loss is computed outside the model's "
    "compiled forward: cce_compile.distributed.deferred_head (docs/distributed.md)"
)
_ADDITION = re.compile(r":\s*(aten\.add\b|<built-in function (iadd|add)>|(torch\.)?add\b)")
# A mask or an addition written into the logits (``mutation_in_region``'s detail names the
# writer as ``node (target)``, ``unsupported_op_in_chain``'s as ``node: target``): neither form
# fuses, in place or out of place; a mask shared by every row fuses as the head's bias.
_MASK_WRITE = re.compile(
    r"\((masked_fill_|index_put_|index_fill_|setitem|add_|iadd|sub_|isub)\) writes"
)
_MASK_OP = re.compile(r":\s*(masked_fill|index_fill|<built-in method where\b|(torch\.)?where\b)")
MASK_AS_BIAS_FIX = (
    "a mask or a vector written into the logits (masked_fill, torch.where, z[..., ids] = -inf, "
    "z + b) is not fused, in place or out of place, and a per-row mask cannot be; a vocabulary "
    "mask shared by every row fuses as the head's bias: F.linear(h, W, bias) with -inf at the "
    "masked classes (e.g. torch.zeros(V).masked_fill(mask, float('-inf')), added to the head's "
    "own bias if it has one), with torch.distributions.Categorical(logits=z).entropy() for the "
    "entropy (0 at a masked class)"
)


def fsdp2_in_use() -> bool:
    """Has this process fully_shard-ed a module (an FSDP2 state in torch's composable
    registry)? Imports nothing."""
    registry = sys.modules.get("torch.distributed._composable_state")
    states = getattr(registry, "_module_state_mapping", None) or {}
    try:
        return any(type(ref()).__name__ == "FSDPState" for ref in list(states.values()))
    except Exception:  # a torch whose registry differs: the usual fix
        return False


def _adds_to_the_logits(detail: str) -> bool:
    """Does an unsupported-op rejection's detail name an addition (``node: target``)?"""
    return bool(_ADDITION.search(detail))


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
    quiet: bool = False  # left alone as asked (an evaluation graph's logits): logged at INFO
    form: str = "cross-entropy"  # or the RL forms the rules made it from: "log-probs" ...

    @property
    def advice(self) -> str:
        if self.fix:
            return self.fix
        own = [fix for why, fix in _FIX_IN_DETAIL.items() if why in self.detail]
        if own:
            return "; ".join(own)
        usual = _FIX.get(self.reason, "")
        if self.reason == MUTATION and _MASK_WRITE.search(self.detail):
            return MASK_AS_BIAS_FIX
        if self.reason == UNSUPPORTED_OP and _MASK_OP.search(self.detail):
            return MASK_AS_BIAS_FIX
        if self.reason == UNSUPPORTED_OP and _adds_to_the_logits(self.detail):
            return f"{usual}; {_ADDED_VECTOR_FIX}; {_LORA_ON_HEAD_FIX}"
        return usual

    def __str__(self) -> str:
        state = "REWRITTEN" if self.rewritten else "skipped"
        head = f"{state}  {self.loss} ({self.form})  at {self.location}"
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
                    memory += (
                        " (the returned logits are a LogitsNotComputed placeholder, a 'meta' "
                        "tensor without data: CCE_ESCAPING_LOGITS=drop)"
                    )
            lines.append(memory)
        if not self.rewritten:
            lines.append(f"    reason: {self.reason}: {self.detail}")
            if self.advice:
                lines.append(f"    fix: {self.advice}")
        return "\n".join(lines)

    def one_line(self) -> str:
        """What the pass tells the log once per site it leaves alone (a warning unless quiet)."""
        if self.rewritten:
            return self._fused_line()
        fix = f" Fix: {self.advice}." if self.advice and not self.quiet else ""
        return (
            f"cce_compile: left the {self.form} at {self.location} alone "
            f"({self.reason}): {self.detail}.{fix}"
        )

    def _fused_line(self) -> str:
        size = f" ({self.rows} x {self.vocab} logits)" if self.rows is not None else ""
        fate = {
            "kept": "; the logits are kept for their other users (CCE_ESCAPING_LOGITS=rewrite)",
            "dropped": "; the graph returns a LogitsNotComputed placeholder in place of its "
            "logits (CCE_ESCAPING_LOGITS=drop): reading it raises",
        }.get(self.logits, "")
        return f"cce_compile: fused the {self.form} at {self.location}{size}{fate}"


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
            f"{len(self.rewritten)} rewritten, ~{self.saved_bytes / 2**20:,.1f} MiB saved (the "
            "logits in their dtype and their float32 log-softmax, as eager keeps both)"
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


def is_library_frame(frame: str) -> bool:
    """A stack-trace line of an installed package (transformers, torch) or of Python itself."""
    path = frame.split('"')[1] if '"' in frame else frame
    return any(part in path for part in ("site-packages", "dist-packages")) or path.startswith(
        _STDLIB
    )


_STDLIB = sysconfig.get_paths()["stdlib"]


def location(node) -> str:
    """Where the user wrote the call: the innermost frame of their own code; in a compiled
    library model (no user frame), the innermost model ``forward`` (the line that calls the
    loss), not the loss helper or a decorator."""
    trace = node.meta.get("stack_trace") or ""
    frames = [
        line.strip() for line in trace.strip().splitlines() if line.strip().startswith("File ")
    ]
    if not frames:
        return "<unknown>"
    own = [f for f in frames if not is_library_frame(f)]
    forwards = [f for f in frames if f.endswith(" in forward") and "/torch/" not in f]
    return (own or forwards or frames)[-1].replace("File ", "")


def _form(found: Site | Rejection) -> str:
    """What the site computes for the user: the cross-entropy they wrote, or the RL forms
    the rules made it from (``canonical.FORM``), and whether it serves their entropy."""
    made = canonical.form(found.loss)
    what = {canonical.LOG_PROBS: "log-probs", canonical.ENTROPY: "entropy"}.get(
        made, "cross-entropy"
    )
    if made != canonical.ENTROPY and getattr(found, "entropy_users", None):
        what += " and entropy"
    return what


def describe(found: Site | Rejection, rewritten: bool) -> SiteReport:
    """A SiteReport for a site (rewritten, or matched but kept by CCE_DISABLE; a
    TensorParallelSite's vocab is the classes per rank) or a Rejection."""
    result = SiteReport(found.loss.name, location(found.loss), rewritten, form=_form(found))
    if isinstance(found, Rejection):
        result.reason, result.detail, result.quiet = found.reason, found.detail, found.quiet
        # RL forms with no head in their graph (verl compiles its entropy alone): the user
        # wrote no loss there; said at INFO.
        result.quiet |= result.form != "cross-entropy" and found.reason in (GRAPH_BREAK, NO_HEAD)
        if found.reason == GRAPH_BREAK and fsdp2_in_use():
            result.fix = FSDP2_FIX
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
                kept = found.logits_fate == "kept"
                result.saved_bytes = rows * vocab * 4 if kept else result.logits_bytes
        if rewritten:
            result.logits = found.logits_fate
    return result
