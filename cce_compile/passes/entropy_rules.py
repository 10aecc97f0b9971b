"""The entropy rule (``rules.py``'s fourth): the forms RL code writes a softmax's entropy in ->
``cce::softmax_entropy(z)``, which a fused site serves from the op's entropy output.

The op's entropy is ``-sum_j p_j log p_j`` with ``0 log 0 = 0``: a class of logit -inf adds 0
and its gradient is finite. Where the user's form gives the same numbers, it is fused:

* Categorical's ``-(clamp(lp, min=finfo.min) * softmax(lp)).sum(-1)`` (``.entropy()``): its
  clamp makes ``0 log 0`` count 0 too, whatever the logits;
* ``-(exp(logp) * logp).sum(-1)`` (TRL), ``-(softmax(z) * log_softmax(z)).sum(-1)``,
  ``logsumexp(z) - (softmax(z) * z).sum(-1)`` (verl, OpenRLHF): ``0 * -inf`` is NaN in eager at
  a -inf logit, so these are fused only where the logits cannot hold -inf
  (``categorical.finite_logits``: a linear head without a bias, scaled or softcapped).

Elsewhere the form is still rewritten, marked ``canonical.LEFT_ALONE`` with why (its site is
left alone as ``inexact_form``; the journal puts the user's form back): the NaN spellings of
logits that may hold -inf, and ``-(p * p.log()).sum(-1)`` (NaN where p underflows). Each such
reason has its fix in ``FIXES``, which the report gives.

Either operand order; the sum without its minus (the negative entropy) ->
``-softmax_entropy(z)``; ``keepdim=True`` -> ``softmax_entropy(z).unsqueeze(-1)``.
"""

from __future__ import annotations

import operator
from typing import Any

from torch.fx import Node

from . import calls as c
from . import canonical, categorical, safety
from . import predicates as p
from .emit import Emitter
from .journal import REPLACES, Journal

_CATEGORICAL = "torch.distributions.Categorical(logits=z).entropy()"
_LOG_SOFTMAX = "-(p * F.log_softmax(z, -1)).sum(-1)"

# Why a recognised entropy is not fused (``canonical.LEFT_ALONE``, the site's detail), by form.
NAN_AT_MINUS_INF = (
    "eager's entropy is NaN at a -inf logit (0 * -inf) where the op's is 0 (0 log 0 = 0), and "
    "these logits may hold -inf: they are not a linear head's without a bias (scaled or "
    "softcapped)"
)
LOG_OF_SOFTMAX = (
    "the entropy takes the log of softmax(z) (p * p.log()): where a probability underflows to "
    "0, eager's 0 * log 0 is NaN and the op's entropy would be a number"
)
# What to write instead (the report's fix for a site left alone for that reason).
FIXES = {
    NAN_AT_MINUS_INF: f"write {_CATEGORICAL} (fused, 0 at a masked class); or, where no logit "
    "is ever -inf, write the head without its bias",
    LOG_OF_SOFTMAX: "take the entropy's log-probabilities with F.log_softmax(z, -1), not "
    f"softmax(z).log(): `{_LOG_SOFTMAX}` is fused for a linear head without a bias, and its "
    f"0 * log p is 0 where a probability underflows; {_CATEGORICAL} is fused for any head",
}


def entropy(node: Node, journal: Journal) -> bool:
    """The entropy forms (module docstring) -> ``cce::softmax_entropy``: the negative entropy,
    ``(p * log p).sum(-1)`` added with a plus sign, -> its negation; a sum with
    ``keepdim=True`` -> the entropy unsqueezed."""
    found = _sum_p_log_p(node) or _logsumexp_minus_expected_logit(node)
    if found is None:
        return False
    z, matched, keeps_dim, negated, inexact = found
    emit = Emitter(node.graph, node)
    created = [emit(canonical.SOFTMAX_ENTROPY, z)]
    created[0].meta[REPLACES] = node.meta.get(REPLACES, node.name)  # (the report's name)
    if inexact:  # (why the op would compute otherwise)
        created[0].meta[canonical.LEFT_ALONE] = inexact
    if keeps_dim:
        created.append(emit.method("unsqueeze", created[-1], -1))
    if negated:
        created.append(emit(operator.neg, created[-1]))
    if p.tensor_value(created[-1]).dtype != p.tensor_value(node).dtype:
        journal.erase(created)
        return False
    journal.replaced("entropy", node, created[-1], [z, *matched], created)
    return True


def log_softmax_nodes(node: Any) -> tuple[Node, list[Node]] | None:
    """(z, the form's nodes) for ``log_softmax(z, -1)`` or ``z - z.logsumexp(-1,
    keepdim=True)``."""
    z = c.over_last_dim(c.LOG_SOFTMAX, node)
    if z is not None:
        return z, [node]
    z = categorical.normalized_logits(node)
    return None if z is None else (z, [node, node.args[1]])


def _sum_p_log_p(node: Node) -> tuple | None:
    """(z, matched, keeps_dim, negated, inexact) for ``-(P * L).sum(-1)`` (or ``(P *
    L).sum(-1)``: negated), ``keepdim=True`` or not; L ``log_softmax(z)`` or ``log(softmax(z))``,
    either clamped at the least float (Categorical's), P ``exp(L)`` or ``softmax(z)`` (or
    ``softmax(L)``); inexact: why the op's entropy would differ from eager's, or None."""
    named = c.NEG.args(node)
    total, negated = (named["input"], False) if named is not None else (node, True)
    users = safety.live_users(node)
    if negated and len(users) == 1 and c.NEG.args(users[0]) is not None:
        return None  # -(sum): the negation's own match
    for keeps_dim in (False, True):
        product = c.over_last_dim(c.SUM, total, keepdim=keeps_dim)
        factors = _factors(product)
        if factors is not None:
            break
    else:
        return None
    for probs, log_probs_node in (factors, factors[::-1]):
        log_p = categorical.unclamped(log_probs_node)
        clamped = log_p is not log_probs_node  # (0 log 0 counts 0, as the op's)
        found = log_softmax_nodes(log_p)
        if found is not None:
            exact = clamped or categorical.finite_logits(_logits_of(found[0]))
            inexact = None if exact else NAN_AT_MINUS_INF
        else:
            found, inexact = _log_of_probs(log_p, clamped)
        if found is None:
            continue
        z, nodes = found
        source = _probs_source(probs)
        if source is not None and _logits_of(source) is _logits_of(z):
            matched = [total, product, probs, log_probs_node, *nodes, *probs.all_input_nodes]
            return _logits_of(z), matched, keeps_dim, negated, inexact
    return None


def _log_of_probs(node: Node, clamped: bool) -> tuple[tuple[Node, list[Node]] | None, Any]:
    """((z, the form's nodes), why) for ``log(softmax(z, -1))`` (``p.log()``,
    ``torch.log(p)``; why: LOG_OF_SOFTMAX, None where clamped at the least float); (None,
    None) for any other node."""
    named = c.LOG.args(node)
    z = None if named is None else c.over_last_dim(c.SOFTMAX, named["input"])
    if z is None:
        return None, None
    return (z, [node, named["input"]]), None if clamped else LOG_OF_SOFTMAX


def _probs_source(probs: Node) -> Node | None:
    """x for ``exp(log_softmax(x))`` or ``softmax(x)``."""
    exponent = c.EXP.args(probs)
    if exponent is None:
        return c.over_last_dim(c.SOFTMAX, probs)
    found = log_softmax_nodes(exponent["input"])
    return None if found is None else found[0]


def _logits_of(node: Node) -> Node:
    """The logits a log-softmax of log-softmaxes is of: the distribution is the same."""
    found = log_softmax_nodes(node)
    while found is not None:
        node = found[0]
        found = log_softmax_nodes(node)
    return node


def _logsumexp_minus_expected_logit(node: Node) -> tuple | None:
    """(z, matched, False, False, inexact) for ``logsumexp(z, -1) - (softmax(z) *
    z).sum(-1)`` (inexact: NaN at a -inf logit, where z may hold one)."""
    named = c.SUB.args(node)
    if named is None or len(named) != 2:
        return None
    z = c.over_last_dim(c.LOGSUMEXP, named["input"])
    product = c.over_last_dim(c.SUM, named["other"])
    factors = _factors(product)
    if z is None or factors is None:
        return None
    for probs, logits in (factors, factors[::-1]):
        if logits is z and c.over_last_dim(c.SOFTMAX, probs) is z:
            inexact = None if categorical.finite_logits(z) else NAN_AT_MINUS_INF
            return z, [named["input"], named["other"], product, probs], False, False, inexact
    return None


def _factors(node: Any) -> tuple[Node, Node] | None:
    named = c.MUL.args(node)
    if named is None or len(named) != 2:
        return None
    a, b = named["input"], named["other"]
    return (a, b) if isinstance(a, Node) and isinstance(b, Node) else None
