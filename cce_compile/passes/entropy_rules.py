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
logits that may hold -inf, ``-(p * p.log()).sum(-1)`` (NaN where p underflows),
``-(p * torch.log(p + eps)).sum(-1)`` (the epsilon changes the value) and
``Categorical(probs=softmax(z)).entropy()`` (re-normalised, clamped probabilities). Each such
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
EPS_IN_LOG = (
    "the entropy takes the log of softmax(z) plus an epsilon (log(p + eps), or of p clamped at "
    "eps): the epsilon changes its value, which the op does not compute"
)
PROBS_RENORMALISED = (
    "Categorical(probs=softmax(z)) re-normalises the probabilities and clamps them at "
    "finfo.eps before their log: its entropy is not the op's softmax entropy"
)
# What to write instead (the report's fix for a site left alone for that reason).
FIXES = {
    NAN_AT_MINUS_INF: f"write {_CATEGORICAL} (fused, 0 at a masked class); or, where no logit "
    "is ever -inf, write the head without its bias",
    LOG_OF_SOFTMAX: "take the entropy's log-probabilities with F.log_softmax(z, -1), not "
    f"softmax(z).log(): `{_LOG_SOFTMAX}` is fused for a linear head without a bias, and its "
    f"0 * log p is 0 where a probability underflows; {_CATEGORICAL} is fused for any head",
    EPS_IN_LOG: f"drop the epsilon: {_CATEGORICAL} is fused and counts a probability of 0 as 0 "
    f"(so does `{_LOG_SOFTMAX}`, fused for a linear head without a bias)",
    PROBS_RENORMALISED: f"pass the logits, not their softmax: {_CATEGORICAL} is fused (and its "
    "log_prob)",
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
    L).sum(-1)``: negated), ``keepdim=True`` or not; L ``log_softmax(z)`` or a log of
    probabilities (``_log_of_probs``), either clamped at the least float (Categorical's), P
    ``exp(L)`` or ``softmax(z)`` (or ``softmax(L)``, re-normalised or not); inexact: why the
    op's entropy would differ from eager's, or None."""
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
    """((z, the form's nodes), why) for ``log(P)``, P ``softmax(z, -1)`` (``p.log()``,
    ``torch.log(p)``; why: LOG_OF_SOFTMAX, None where clamped at the least float), plus an
    epsilon or clamped at one (EPS_IN_LOG), re-normalised and clamped as
    ``Categorical(probs=...)`` does (PROBS_RENORMALISED); (None, None) for any other node."""
    named = c.LOG.args(node)
    if named is None:
        return None, None
    nodes, probs = [node], named["input"]
    why = None if clamped else LOG_OF_SOFTMAX
    shifted = _plus_epsilon(probs)
    if shifted is not None:
        nodes.append(probs)
        probs, why = shifted, EPS_IN_LOG
    renormalised = _renormalised(probs)
    if renormalised is not None:
        nodes += [probs, probs.args[1]]
        probs, why = renormalised, PROBS_RENORMALISED
    z = c.over_last_dim(c.SOFTMAX, probs)
    return (None, None) if z is None else ((z, [*nodes, probs]), why)


def _plus_epsilon(node: Any) -> Node | None:
    """p for ``p + eps``, ``eps + p`` or ``p.clamp(min=eps)`` (a max too), eps a number."""
    named = c.ADD.args(node)
    if named is not None and len(named) == 2:
        for tensor, number in ((named["input"], named["other"]), (named["other"], named["input"])):
            if isinstance(tensor, Node) and isinstance(number, (int, float)):
                return tensor
    named = categorical.CLAMP.args(node)
    if named is not None and isinstance(named.get("min"), (int, float)):
        return named["input"]
    return None


def _renormalised(node: Any) -> Node | None:
    """p for ``p / p.sum(-1, keepdim=True)`` (Categorical's ``probs``)."""
    named = c.DIV.args(node)
    if named is None or len(named) != 2 or not isinstance(named["input"], Node):
        return None
    total = c.over_last_dim(c.SUM, named["other"], keepdim=True)
    return named["input"] if total is named["input"] else None


def _probs_source(probs: Node) -> Node | None:
    """x for ``exp(log_softmax(x))`` or ``softmax(x)`` (re-normalised or not)."""
    exponent = c.EXP.args(probs)
    if exponent is None:
        return c.over_last_dim(c.SOFTMAX, _renormalised(probs) or probs)
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
