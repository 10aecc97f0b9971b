"""The entropy rule (``rules.py``'s fourth): the forms RL code writes a softmax's entropy in ->
``cce::softmax_entropy(z)``, which a fused site serves from the op's entropy output.

The op's entropy is ``-sum_j p_j log p_j`` with ``0 log 0 = 0``: a class of logit -inf adds 0
and its gradient is finite. Where the user's form gives the same numbers, it is fused:

* Categorical's ``-(clamp(lp, min=finfo.min) * softmax(lp)).sum(-1)`` (``.entropy()``): its
  clamp makes ``0 log 0`` count 0 too, whatever the logits;
* ``-(exp(logp) * logp).sum(-1)`` (TRL), ``-(softmax(z) * log_softmax(z)).sum(-1)``,
  ``logsumexp(z) - (softmax(z) * z).sum(-1)`` (verl, OpenRLHF): ``0 * -inf`` is NaN in eager at
  a -inf logit, so these are fused only where the logits cannot hold -inf
  (``categorical.finite_logits``: a linear head without a bias, scaled or softcapped); so are
  their ``nansum`` and ``nan_to_num`` spellings (eager's gradient is NaN there), a negated
  factor, and ``dtype=`` on the softmaxes or the sum (float32 of narrower logits: the entropy
  of ``z.float()``);
* ``-(p * torch.where(p > 0, logp, 0)).sum(-1)`` and ``logp.clamp_min(finfo.min)``: the op's
  value and gradient whatever the logits, as Categorical's.

Elsewhere the form is still rewritten, marked ``canonical.LEFT_ALONE`` with why (its site is
left alone as ``inexact_form``; the journal puts the user's form back): the NaN spellings of
logits that may hold -inf, ``-(p * p.log()).sum(-1)`` (NaN where p underflows),
``-(p * torch.log(p + eps)).sum(-1)`` (the epsilon changes the value) and
``Categorical(probs=softmax(z)).entropy()`` (re-normalised, clamped probabilities),
``entr(p)``, ``xlogy(p, p)`` and a clamped or zeroed ``p.log()`` (eager's gradient is NaN
wherever p is 0, an underflow included). Each such
reason has its fix in ``FIXES``, which the report gives.

Either operand order; the sum without its minus (the negative entropy) ->
``-softmax_entropy(z)``; ``keepdim=True`` -> ``softmax_entropy(z).unsqueeze(-1)``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node

from . import calls as c
from . import canonical, categorical, safety
from . import predicates as p
from .emit import Emitter
from .journal import REPLACES, Journal

_CATEGORICAL = "torch.distributions.Categorical(logits=z).entropy()"
_LOG_SOFTMAX = "-(p * F.log_softmax(z, -1)).sum(-1)"
_ZERO_AT_P_0 = "-(p * torch.where(p > 0, F.log_softmax(z, -1), 0)).sum(-1)"

NANSUM = c.call({torch.nansum}, {"nansum"}, ("input", "dim", "keepdim"), {"dtype"})
_NAN_TO_NUM = c.call({torch.nan_to_num}, {"nan_to_num"}, ("input", "nan", "posinf", "neginf"))
_ENTR = c.call({torch.special.entr}, {"entr"})
_XLOGY = c.call({torch.xlogy, torch.special.xlogy}, {"xlogy"}, ("input", "other"))
_WHERE = c.call({torch.where}, {"where"}, ("condition", "input", "other"))
_GREATER = c.call({operator.gt, torch.gt}, {"gt"}, ("input", "other"))

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
NAN_GRADIENT_AT_MINUS_INF = (
    "the entropy drops eager's 0 * -inf at a -inf logit from its value (nansum, nan_to_num) "
    "but not from its gradient, which is NaN there where the op's is finite, and these logits "
    "may hold -inf: they are not a linear head's without a bias (scaled or softcapped)"
)
NAN_GRADIENT_WHERE_P_IS_0 = (
    "the entropy takes the log of softmax(z) and counts 0 log 0 as 0 (entr(p), xlogy(p, p), "
    "p.log() clamped or zeroed where p is 0, or under nansum / nan_to_num): its value is the "
    "op's, but eager's gradient is NaN wherever a probability is 0 (a -inf logit, or one that "
    "underflows), where the op's is finite"
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
    NAN_GRADIENT_AT_MINUS_INF: f"write {_CATEGORICAL} or `{_ZERO_AT_P_0}` (both fused, 0 at a "
    "masked class, with a finite gradient)",
    NAN_GRADIENT_WHERE_P_IS_0: f"write {_CATEGORICAL} or `{_ZERO_AT_P_0}` (both fused, 0 at a "
    "masked class, with a finite gradient)",
}


def entropy(node: Node, journal: Journal) -> bool:
    """The entropy forms (module docstring) -> ``cce::softmax_entropy``: the negative entropy,
    ``(p * log p).sum(-1)`` added with a plus sign, -> its negation; a sum with
    ``keepdim=True`` -> the entropy unsqueezed; probabilities and log-probs computed in float32
    of narrower logits (``softmax(z, -1, dtype=torch.float32)``) -> the entropy of
    ``z.float()``, which is what they compute."""
    found = _sum_p_log_p(node) or _logsumexp_minus_expected_logit(node)
    if found is None:
        return False
    z, matched, keeps_dim, negated, inexact, upcast = found
    emit = Emitter(node.graph, node)
    created = [emit.method("float", z)] if upcast else []
    created.append(emit(canonical.SOFTMAX_ENTROPY, created[-1] if created else z))
    created[-1].meta[REPLACES] = node.meta.get(REPLACES, node.name)  # (the report's name)
    if inexact:  # (why the op would compute otherwise)
        created[-1].meta[canonical.LEFT_ALONE] = inexact
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
    """(z, matched, keeps_dim, negated, inexact, upcast) for ``-(P * L).sum(-1)`` (or ``(P *
    L).sum(-1)``: negated; a factor negated flips it), ``keepdim=True`` or not, the sum also
    a ``nansum`` or of the terms' ``nan_to_num()``; L ``log_softmax(z)`` or a log of
    probabilities (``_log_of_probs``), either clamped at the least float (Categorical's) or
    ``torch.where(P > 0, L, 0)``, P ``exp(L)`` or ``softmax(z)`` (or ``softmax(L)``,
    re-normalised or not); also ``entr(P).sum(-1)`` and ``-xlogy(P, P).sum(-1)``. inexact: why
    the op's entropy would differ from eager's, or None; upcast: P and L are float32 of
    narrower logits."""
    named = c.NEG.args(node)
    total, negated = (named["input"], False) if named is not None else (node, True)
    users = safety.live_users(node)
    if negated and len(users) == 1 and c.NEG.args(users[0]) is not None:
        return None  # -(sum): the negation's own match
    summed = _summed_terms(total)
    if summed is None:
        return None
    terms, keeps_dim, nan_masked, sum_nodes = summed
    found = _entr_or_xlogy(terms)
    if found is not None:
        z, nodes, flips = found
        upcast = _upcast(z, terms, terms)
        return (
            z,
            [*sum_nodes, *nodes],
            keeps_dim,
            negated ^ flips,
            NAN_GRADIENT_WHERE_P_IS_0,
            upcast,
        )
    factors = _signed_factors(terms)
    if factors is None:
        return None
    probs_factor, log_factor, flips, sign_nodes = factors
    for probs, log_probs_node in ((probs_factor, log_factor), (log_factor, probs_factor)):
        found = _log_probs_of(log_probs_node, nan_masked)
        if found is None:
            continue
        z, nodes, inexact = found
        source = _probs_source(probs)
        if source is not None and _logits_of(source) is _logits_of(z):
            matched = [*sum_nodes, *sign_nodes, probs, *nodes, *probs.all_input_nodes]
            upcast = _upcast(_logits_of(z), probs, nodes[0])
            return _logits_of(z), matched, keeps_dim, negated ^ flips, inexact, upcast
    return None


def _summed_terms(total: Any) -> tuple | None:
    """(terms, keeps_dim, nan_masked, nodes) for ``terms.sum(-1)`` (``keepdim=True`` too; a
    ``dtype=`` of the terms' own dtype), ``terms.nansum(-1)`` or ``terms.nan_to_num().sum(-1)``
    (nan_masked: eager's NaN terms count 0; a ``nan=0`` only)."""
    for spelling in (c.SUM, NANSUM):
        named = spelling.args(total)
        value = p.tensor_value(named["input"]) if named is not None else None
        dtype = named.get("dtype") if named is not None else None
        if value is None or dtype not in (None, value.dtype):
            continue
        for keeps_dim in (False, True):
            terms = c.over_last_dim(spelling, total, keepdim=keeps_dim, dtype=dtype)
            if terms is not None:
                break
        else:
            continue
        nodes, nan_masked = [total], spelling is NANSUM
        masked = _NAN_TO_NUM.args(terms)
        if masked is not None and masked.get("nan", 0) == 0:
            nodes, terms, nan_masked = [total, terms], masked["input"], True
        return terms, keeps_dim, nan_masked, nodes
    return None


def _entr_or_xlogy(terms: Any) -> tuple | None:
    """(z, nodes, flips) for ``entr(P)`` (``-P log P``: flips the sign) or ``xlogy(P, P')``
    (``P log P'``), P and P' probabilities of the same logits z."""
    named = _ENTR.args(terms)
    if named is not None and len(named) == 1:
        z = _probs_source(named["input"])
        return None if z is None else (_logits_of(z), [terms, named["input"]], True)
    named = _XLOGY.args(terms)
    if named is None or len(named) != 2:
        return None
    probs, other = named["input"], named["other"]
    if not (isinstance(probs, Node) and isinstance(other, Node)):
        return None
    z, z_other = _probs_source(probs), _probs_source(other)
    if z is None or z_other is None or _logits_of(z) is not _logits_of(z_other):
        return None
    return _logits_of(z), [terms, probs, other], False


def _signed_factors(terms: Any) -> tuple | None:
    """(a, b, flips, the negations' nodes) for ``a * b`` with either factor negated (``p *
    -log_p``): flips when one is."""
    factors = _factors(terms)
    if factors is None:
        return None
    signed, flips, nodes = [], False, [terms]
    for factor in factors:
        named = c.NEG.args(factor)
        if named is not None and isinstance(named["input"], Node):
            nodes.append(factor)
            factor, flips = named["input"], not flips
        signed.append(factor)
    return signed[0], signed[1], flips, nodes


def _log_probs_of(node: Node, nan_masked: bool) -> tuple | None:
    """(z, the form's nodes, why the op would differ or None) for a log-prob factor: a
    ``log_softmax`` (exact if clamped at the least float or zeroed where P is 0, whatever
    the logits; else NaN at a -inf logit: exact only of logits that cannot hold one) or a log
    of probabilities (``_log_of_probs``); the form's first node is the factor."""
    log_p = categorical.unclamped(node)
    if log_p is node:
        log_p = _zeroed_where_p_is_0(node) or node
    clamped = log_p is not node  # (0 log 0 counts 0, as the op's)
    found = _log_softmax_of(log_p)
    if found is None:
        found, why = _log_of_probs(log_p, clamped, nan_masked)
        return None if found is None else (found[0], [node, *found[1]], why)
    z, nodes = found
    if clamped or categorical.finite_logits(_logits_of(z)):
        why = None
    else:
        why = NAN_GRADIENT_AT_MINUS_INF if nan_masked else NAN_AT_MINUS_INF
    return z, [node, *nodes], why


def _zeroed_where_p_is_0(node: Any) -> Node | None:
    """L for ``torch.where(P > 0, L, 0)``, P probabilities of the logits L is a log-softmax
    (or a log of probabilities) of: 0 at a class whose probability is 0, as the op's ``0 log
    0``."""
    named = _WHERE.args(node)
    if named is None or len(named) != 3 or named["other"] != 0:
        return None
    log_p, condition = named["input"], _GREATER.args(named["condition"])
    if condition is None or condition.get("other") != 0 or not isinstance(log_p, Node):
        return None
    found = _log_softmax_of(log_p) or _log_of_probs(log_p, True, False)[0]
    source = _probs_source(condition["input"])
    if found is None or source is None or _logits_of(source) is not _logits_of(found[0]):
        return None
    return log_p


def _log_softmax_of(node: Any) -> tuple[Node, list[Node]] | None:
    """``log_softmax_nodes``, the log-softmax also with a ``dtype=``."""
    named = c.LOG_SOFTMAX.args(node)
    if named is not None and named.get("dtype") is not None:
        z = c.over_last_dim(c.LOG_SOFTMAX, node, dtype=named["dtype"])
        return None if z is None else (z, [node])
    return log_softmax_nodes(node)


def _upcast(z: Node, probs: Node, log_probs: Node) -> bool:
    """Are the probabilities and log-probs float32 of narrower logits ``z`` (a ``dtype=`` on
    the softmaxes, or autocast's float32 softmax)? Then they are those of ``z.float()``."""
    dtypes = {p.tensor_value(n).dtype for n in (probs, log_probs)}
    return dtypes == {torch.float32} and p.tensor_value(z).dtype in (torch.bfloat16, torch.float16)


def _log_of_probs(node: Node, clamped: bool, nan_masked: bool) -> tuple:
    """((z, the form's nodes), why) for ``log(P)``, P ``softmax(z, -1)`` (``p.log()``,
    ``torch.log(p)``; why: LOG_OF_SOFTMAX, or NAN_GRADIENT_WHERE_P_IS_0 where clamped or the
    NaN terms are masked: the value is the op's, eager's gradient is 0/0 where p is 0), plus
    an epsilon or clamped at one (EPS_IN_LOG), re-normalised and clamped as
    ``Categorical(probs=...)`` does (PROBS_RENORMALISED); (None, None) for any other node."""
    named = c.LOG.args(node)
    if named is None:
        return None, None
    nodes, probs = [node], named["input"]
    why = NAN_GRADIENT_WHERE_P_IS_0 if clamped or nan_masked else LOG_OF_SOFTMAX
    shifted = _plus_epsilon(probs)
    if shifted is not None:
        nodes.append(probs)
        probs, why = shifted, EPS_IN_LOG
    renormalised = _renormalised(probs)
    if renormalised is not None:
        nodes += [probs, probs.args[1]]
        probs, why = renormalised, PROBS_RENORMALISED
    z = _softmax_of(probs)
    return (None, None) if z is None else ((z, [*nodes, probs]), why)


def _softmax_of(node: Any) -> Node | None:
    """z for ``softmax(z, -1)``, with a ``dtype=`` too."""
    named = c.SOFTMAX.args(node)
    dtype = named.get("dtype") if named is not None else None
    return c.over_last_dim(c.SOFTMAX, node, dtype=dtype)


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
        return _softmax_of(_renormalised(probs) or probs)
    found = _log_softmax_of(exponent["input"])
    return None if found is None else found[0]


def _logits_of(node: Node) -> Node:
    """The logits a log-softmax of log-softmaxes is of: the distribution is the same."""
    found = log_softmax_nodes(node)
    while found is not None:
        node = found[0]
        found = log_softmax_nodes(node)
    return node


def _logsumexp_minus_expected_logit(node: Node) -> tuple | None:
    """(z, matched, False, False, inexact, False) for ``logsumexp(z, -1) - (softmax(z) *
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
            matched = [named["input"], named["other"], product, probs]
            return z, matched, False, False, inexact, False
    return None


def _factors(node: Any) -> tuple[Node, Node] | None:
    named = c.MUL.args(node)
    if named is None or len(named) != 2:
        return None
    a, b = named["input"], named["other"]
    return (a, b) if isinstance(a, Node) and isinstance(b, Node) else None
