"""``torch.distributions.Categorical(logits=z)`` as Dynamo traces it, read in the forms
``rules.py`` knows (PPO and A2C code writes its log-probs and entropy this way)::

    lp = z - z.logsumexp(dim=-1, keepdim=True)             # Categorical's logits: log_softmax(z)
    value, log_pmf = torch.broadcast_tensors(ids.long().unsqueeze(-1), lp)
    log_prob = log_pmf.gather(-1, value[..., :1]).squeeze(-1)
    entropy = -(torch.clamp(lp, min=finfo.min) * F.softmax(lp, dim=-1)).sum(-1)

``normalized_logits`` and ``unclamped`` are what the log-prob and entropy rules look through
(the clamp makes ``0 log 0`` count 0, as the op's entropy does: looked through whatever the
logits); ``finite_logits`` says where the entropy spellings that are NaN at a -inf logit fuse;
``broadcast_value`` is a rule: where the broadcast changes neither operand's rows (ids with the
logits' leading shape), its outputs are its operands.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from . import calls as c
from . import predicates as p
from . import safety
from .journal import Journal

CLAMP = c.call({torch.clamp, torch.clip}, {"clamp", "clip"}, ("input", "min", "max"))
_CLAMP_MIN = c.call({torch.clamp_min}, {"clamp_min"}, ("input", "min"))
# (two operands: the index and the log-probs, as Categorical.log_prob passes them)
BROADCAST = c.call({torch.broadcast_tensors}, (), ("input", "other"))


def normalized_logits(node: Any) -> Node | None:
    """z for ``z - z.logsumexp(-1, keepdim=True)``: ``log_softmax(z, -1)`` written out."""
    named = c.SUB.args(node)
    if named is None or len(named) != 2 or not isinstance(named["input"], Node):
        return None
    z = named["input"]
    lse = c.over_last_dim(c.LOGSUMEXP, named["other"], keepdim=True)
    return z if lse is z and p.tensor_value(z) is not None else None


def unclamped(node: Any) -> Any:
    """x for ``clamp(x, min=finfo(x.dtype).min)`` or ``clamp_min`` (Categorical's entropy: a
    log-prob of -inf becomes the least float, so that a class of logit -inf adds 0 and not
    ``0 * -inf``, as in the op's entropy, whatever the logits); ``node`` for any other node."""
    named = CLAMP.args(node) or _CLAMP_MIN.args(node)
    value = p.tensor_value(node)
    if named is None or named.get("max") is not None or value is None:
        return node
    if not value.dtype.is_floating_point or named.get("min") != torch.finfo(value.dtype).min:
        return node
    return named["input"]


def finite_logits(node: Any) -> bool:
    """Are ``node``'s values finite wherever the head's operands are (overflow aside): a
    linear head without a bias (``F.linear(h, W)``, ``h @ W.T``) through row views and row
    slices, ``contiguous``/``clone``/``detach``, widening casts, scalings (in place too), or a
    tanh (a softcap is bounded)? The entropy spellings that are NaN at a -inf logit in eager
    fuse only there (``entropy_rules``). A scaling by 0 or inf makes every row NaN in eager
    too: any factor passes. A bias, a ``masked_fill`` or any other op: no."""
    while True:
        if p.is_tanh(node) or p.is_matmul(node):
            return True
        if p.is_linear(node):
            return p.linear_operands(node)[2] is None
        scaled = p.is_scale(node) or _scaled_in_place(node)
        if scaled is not None:
            node = scaled[0]
        elif p.is_row_view(node) or p.row_index(node) is not None or _keeps_values(node):
            node = node.args[0]
        else:
            return False


def _scaled_in_place(node: Any) -> tuple[Node] | None:
    """(x,) for ``x.div_(c)`` / ``x.mul_(c)`` / ``x /= c`` / ``x *= c``, c a number."""
    for spelling in (c.DIV_, c.MUL_):
        named = spelling.args(node)
        if named is not None and p.scalar(named.get("other")) is not None:
            return (named["input"],)
    return None


def _keeps_values(node: Any) -> bool:
    """``contiguous``/``clone``/``detach``, a move that keeps the dtype, or a widening cast."""
    return p.is_passthrough(node) or p.is_no_op_move(node) or _widens(node)


def _widens(node: Any) -> bool:
    """A cast to a float type of at least the input's range (bf16 -> float32: no overflow)."""
    to = p.cast_dtype(node)
    value = None if to is None else p.tensor_value(node.args[0])
    if value is None or not (to.is_floating_point and value.dtype.is_floating_point):
        return False
    return torch.finfo(to).max >= torch.finfo(value.dtype).max


def broadcast_value(node: Node, journal: Journal) -> bool:
    """``value, lp = broadcast_tensors(index, lp)`` with ``index`` (..., 1) int64 and ``lp``
    (..., V) of the same leading shape, every use of ``value`` being ``value[..., :1]``:
    ``lp`` is read as ``lp`` and ``value[..., :1]`` as ``index``."""
    named = BROADCAST.args(node)
    if named is None or node.kwargs or len(node.args) != 2:
        return False
    index, lp = named["input"], named["other"]
    if not _one_class_per_row(index, lp):
        return False
    outputs = {u.args[1]: u for u in node.users if p.is_call(u, {operator.getitem})}
    if len(outputs) != len(node.users) or set(outputs) - {0, 1}:
        return False
    picks = list(outputs[0].users) if 0 in outputs else []
    if not all(p.is_call(u, {operator.getitem}) and _first_column(u.args[1]) for u in picks):
        return False
    replaced = [(outputs[1], lp)] if 1 in outputs else []
    replaced += [(pick, index) for pick in picks]
    readers = {u: (u.args, u.kwargs) for old, _ in replaced for u in old.users}
    for old, new in replaced:
        old.replace_all_uses_with(new)

    def undo() -> None:
        for user, (args, kwargs) in readers.items():
            user.args, user.kwargs = args, kwargs

    journal.record("broadcast", [lp, node, *outputs.values(), *picks], [], undo)
    return True


# What a log-prob left as ``broadcast_value`` found it is, in a site's detail, and its fix.
BROADCAST_IDS = (
    "Categorical's log_prob of ids that broadcast against the logits (ids of another leading "
    "shape than theirs), which the pass does not recognise"
)
BROADCAST_IDS_FIX = (
    "give log_prob ids of the logits' leading shape, e.g. d.log_prob(ids.expand(z.shape[:-1])) "
    "for ids of one row: the log-probs then fuse, with the entropy in one op call"
)


# What a log-prob ``broadcast_value`` left is where its ids have the logits' leading shape: the
# obstacle is not the ids (an in-place write to the logits, or the broadcast read otherwise).
LOG_PROB_LEFT_AS_WRITTEN = (
    "Categorical's log_prob of these logits, left as written: its ids have the logits' leading "
    "shape, but its broadcast_tensors is not read as Categorical reads it"
)
LOG_PROB_LEFT_AS_WRITTEN_FIX = (
    "write the log-probs as F.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1), "
    "which fuses with the entropy in one op call"
)
LOG_PROB_WRITTEN_IN_PLACE = "Categorical's log_prob of its logits written in place after the head"
LOG_PROB_WRITTEN_IN_PLACE_FIX = (
    "move the in-place write before the head (or drop it): Categorical's log_prob and entropy of "
    "a linear head's logits fuse in one op call"
)


def broadcast_log_prob(node: Any) -> str | None:
    """If ``node`` is the log-softmax Categorical writes (``z - z.logsumexp(-1, keepdim=True)``,
    or its logsumexp) of log-probs that a ``broadcast_tensors`` still reads (which
    ``broadcast_value`` left as they were), what that log-prob is: ``BROADCAST_IDS`` where the
    ids' leading sizes differ from the logits', else why it was left (an in-place write to the
    log-probs, or ``LOG_PROB_LEFT_AS_WRITTEN``); None for any other node."""
    if c.over_last_dim(c.LOGSUMEXP, node, keepdim=True) is not None:
        normalized = [u for u in node.users if normalized_logits(u) is not None]
        return next(filter(None, map(broadcast_log_prob, normalized)), None)
    if normalized_logits(node) is None:
        return None
    broadcasts = [named for u in node.users if (named := BROADCAST.args(u)) is not None]
    if not broadcasts:
        return None
    if any(not _same_leading_sizes(named["input"], named["other"]) for named in broadcasts):
        return BROADCAST_IDS
    writers = [u for u in node.users if node in safety.written_operands(u)]
    if writers:
        return f"{LOG_PROB_WRITTEN_IN_PLACE} ({safety.target_name(writers[0])})"
    return LOG_PROB_LEFT_AS_WRITTEN


def _same_leading_sizes(index: Any, lp: Any) -> bool:
    """Do ``index`` (..., 1) and ``lp`` (..., V) have the same leading sizes (unknown: yes)?"""
    ids, logits = p.tensor_value(index), p.tensor_value(lp)
    if ids is None or logits is None:
        return True
    if ids.dim() != logits.dim():
        return False
    return all(p.same_size(a, b) for a, b in zip(ids.shape[:-1], logits.shape[:-1]))


def _one_class_per_row(index: Any, lp: Any) -> bool:
    """Is ``index`` (..., 1) int64 and ``lp`` (..., V), with the same leading sizes?"""
    ids, logits = p.tensor_value(index), p.tensor_value(lp)
    if ids is None or logits is None or ids.dtype != torch.int64 or ids.dim() != logits.dim():
        return False
    if ids.dim() == 0 or not p.same_size(ids.shape[-1], 1):
        return False
    return all(p.same_size(a, b) for a, b in zip(ids.shape[:-1], logits.shape[:-1]))


def _first_column(index: Any) -> bool:
    """``[..., :1]`` (or ``[..., 0:1]``)."""
    if not isinstance(index, tuple) or len(index) != 2 or index[0] is not Ellipsis:
        return False
    cut = index[1]
    return isinstance(cut, slice) and cut.start in (None, 0) and cut.stop == 1 and cut.step is None
