"""Who else uses the logits, and whether that stops a rewrite.

Every user of the head's output or of a node of the chain, besides the chain, the loss and the
nodes between them, is one of:

* dead code (an unused ``logits.view(-1, V)``, a chain of them): ignored, and erased with the
  chain when the site is rewritten;
* a ``logsumexp`` over the logits at the loss rows (a z-loss), possibly through float32 casts:
  the op's lse can serve it;
* anything else: the logits escape. ``CCE_ESCAPING_LOGITS`` decides: drop (the default: fuse
  a training loss whose logits are only returned, directly or through float casts such as
  accelerate's mixed-precision ``.float()``, and return a ``LogitsNotComputed`` placeholder in
  their place), keep (leave the site alone), rewrite (fuse and keep the logits). Evaluation
  graphs (the loss needs no gradient) keep their logits under drop, quietly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.fx import Node

from . import categorical, safety
from . import predicates as p
from .canonical import LEFT_ALONE, entropy_input
from .journal import user_name

# Why an entropy of the logits a site computes is not served by its op call when the two
# differ in having a gradient (old log-probs under no_grad beside an entropy bonus), and what
# to change: the detail's fix replaces logits_escape's usual one (``report_types``).
GRAD_MODES_DIFFER = (
    "an entropy of the same logits that takes a gradient, where this site takes none (it is "
    "computed under torch.no_grad()): one op call computes its outputs with a gradient or "
    "without"
)
GRAD_MODES_DIFFER_FIX = (
    "compute both in one grad mode: the log-probs with a gradient, then .detach() them where "
    "they are kept without (one op call serves both), or the entropy under torch.no_grad() "
    "too where it needs no gradient"
)


def outside_users(nodes: list[Node], inside: list[Node]) -> list[Node]:
    """The live users of ``nodes`` that are not in ``inside``, each once, in order."""
    users: dict[Node, None] = {}
    for node in nodes:
        for user in safety.live_users(node):
            if user not in inside:
                users.setdefault(user)
    return list(users)


@dataclasses.dataclass
class LogitsUsers:
    """The users of the logits outside the site, by what the rewrite can do with them."""

    lse_users: list[Node]  # logsumexp nodes the op's lse can serve
    side_nodes: list[Node]  # casts between the logits and a served logsumexp, erased with it
    escaping: list[Node]  # head / chain nodes that something else uses
    entropy_users: list[Node] = dataclasses.field(default_factory=list)  # softmax_entropy
    entropy_side_nodes: list[Node] = dataclasses.field(default_factory=list)  # casts, views


def classify_users(
    head: Node, chain: list[Node], inside: list[Node], z_level: set[Node]
) -> LogitsUsers:
    """Sort the live users of ``head`` and ``chain`` that are not in ``inside`` (the chain, the
    loss and the nodes between them): a logsumexp or an entropy (``cce::softmax_entropy``,
    through row views too) over z (``z_level``), or escaping."""
    found = LogitsUsers([], [], [])
    for node in [head, *chain]:
        for user in outside_users([node], inside):
            path, end = _through_casts(user)
            source = path[-1] if path else node
            views, entropy = _through_casts(user, row_views=True)
            if node in z_level and p.logsumexp_input(end) is source:
                found.lse_users.append(end)
                found.side_nodes.extend(path)
            elif node in z_level and entropy_input(entropy) is (views[-1] if views else node):
                found.entropy_users.append(entropy)
                found.entropy_side_nodes.extend(views)
            elif node not in found.escaping:
                found.escaping.append(node)
    return found


def _through_casts(user: Node, row_views: bool = False) -> tuple[list[Node], Node]:
    """Follow single-user float32 casts and contiguous() (and row views) from ``user``:
    (those nodes, end)."""
    path: list[Node] = []
    while (
        p.cast_dtype(user) == torch.float32
        or p.is_passthrough(user)
        or (row_views and p.is_row_view(user))
    ):
        users = safety.live_users(user)
        if len(users) != 1:
            break
        path.append(user)
        user = users[0]
    return path, user


def rows_at_hidden(head: Node, chain: list[Node]) -> tuple:
    """Leading shape of the logits where the op sees hidden: after the row slices."""
    shape = p.tensor_value(head).shape[:-1]
    for node in chain:
        if p.row_index(node) is not None:
            shape = p.tensor_value(node).shape[:-1]
    return tuple(shape)


def lse_shape(user: Node, targets: Node | None, rows: tuple) -> Any:
    """How the op's lse (or another per-row output) reshapes to ``user``'s shape, if it can:
    "targets" (the loss target's shape; ``targets`` None: not one to read), "rows" (``rows``,
    the leading shape at hidden), "flat", or the user's sizes as ints and the graph's SymInt
    nodes; None if a size has no node."""
    shape = tuple(p.tensor_value(user).shape)

    def same(a, b):
        return len(a) == len(b) and all(p.same_size(x, y) for x, y in zip(a, b))

    if targets is not None and same(shape, tuple(p.tensor_value(targets).shape)):
        return "targets"
    if same(shape, rows):
        return "rows"
    if len(shape) == 1:
        return "flat"
    # Dynamo keeps every symbolic size as a SymInt node (its placeholders), so a shape the
    # logits had can be rebuilt without keeping the logits alive.
    holders = p.symint_holders(user.graph)
    sizes = [
        holders.get(str(size.node.expr)) if isinstance(size, torch.SymInt) else int(size)
        for size in shape
    ]
    return None if any(size is None for size in sizes) else sizes


def returned_forms(
    escaping: list[Node], logits: list[Node], inside: list[Node]
) -> list[Node] | None:
    """The nodes by which the escaping logits leave the graph, if leaving it is all they do:
    each escaping node (one of the ``logits``, head or chain) that the output uses, and each
    floating-point cast of it (``.float()``, ``.to(dtype)``, through further casts) that only
    the output uses. None if anything else uses them."""
    forms: list[Node] = []
    for node in escaping:
        found = node in logits and _returned(node, outside_users([node], inside))
        if not found:
            return None
        forms += [form for form in found if form not in forms]
    return forms


def _returned(node: Node, users: list[Node]) -> list[Node] | None:
    """``node`` and its casts that ``users`` (output, casts to output) return; None (or []) if
    one of them does something else."""
    forms: list[Node] = []
    for user in users:
        if user.op == "output":
            forms.append(node)
            continue
        dtype = p.cast_dtype(user)
        found = (
            dtype is not None
            and dtype.is_floating_point
            and _returned(user, safety.live_users(user))
        )
        if not found:
            return None
        forms += found
    return forms


def cast_path(form: Node, logits: list[Node]) -> list[Node]:
    """The casts from one of the ``logits`` to a returned ``form`` (``returned_forms``), the
    form first: what the rewrite erases once the output no longer uses it."""
    path = []
    while form not in logits:
        path.append(form)
        form = form.args[0]
    return path


def shapes_rebuildable(logits: list[Node], hidden: Node, targets: Node) -> bool:
    """Can every size of these logits be read from a node that outlives them (for the
    placeholder that replaces them)?"""
    holders = p.symint_holders(hidden.graph)
    return all(
        p.size_source(size, holders, [hidden, targets]) is not None
        for node in logits
        for size in p.tensor_value(node).shape
    )


def escape_detail(
    escaping: list[Node], inside: list[Node], policy: str, training: bool, returned: bool
) -> str:
    """Who else uses the logits, and the setting that would fuse the loss anyway."""
    users = sorted({_named(u, training) for u in outside_users(escaping, inside)})
    what = "returned by the graph" if returned else f"also used by {', '.join(users)}"
    if not training and returned:  # (what drop keeps: other uses keep the logits in any graph)
        return (
            f"the logits are {what} and the loss needs no gradient (an evaluation or "
            "generation graph): its logits are kept; CCE_ESCAPING_LOGITS=rewrite fuses its "
            "loss and keeps them"
        )
    if returned and policy == "keep":
        return (
            f"the logits are {what}; CCE_ESCAPING_LOGITS=keep leaves this training loss "
            "unfused (=drop, the default, fuses it and returns a placeholder in their place; "
            "=rewrite fuses it and keeps them)"
        )
    if returned:
        return (
            f"the logits are {what}, but a size of theirs cannot be read from the graph's "
            "inputs for the placeholder; CCE_ESCAPING_LOGITS=rewrite fuses the loss and keeps "
            "them"
        )
    return f"the logits are {what}; CCE_ESCAPING_LOGITS=rewrite fuses the loss and keeps them"


def _named(user: Node, training: bool) -> str:
    """What the user is, where that says why the logits escape: an entropy this site's op
    does not serve (it serves only the entropy of the rows it computes, at their scaling, in
    its grad mode) or that is left as written, Categorical's log_prob of broadcast ids, or
    rows of them another cross-entropy reads; else the user's name."""
    _, end = _through_casts(user, row_views=True)
    if entropy_input(end) is not None and LEFT_ALONE in end.meta:
        return f"an entropy left as written ({end.meta[LEFT_ALONE]})"
    if entropy_input(end) is not None and safety.requires_grad(end) and not training:
        return GRAD_MODES_DIFFER
    if entropy_input(end) is not None:
        return (
            "an entropy of other rows or another scaling of the logits than this site's (the op "
            "serves only the entropy of the rows it computes; take it of the same rows, e.g. "
            "z[:, :-1] beside a shifted loss, to fuse both in one call)"
        )
    log_prob = categorical.broadcast_log_prob(user)
    if log_prob is not None:
        return log_prob
    node = user
    while p.row_index(node) is not None or p.is_row_view(node) or p.is_passthrough(node):
        users = safety.live_users(node)
        if len(users) != 1:
            break
        node = users[0]
    if p.is_cross_entropy(node) and node is not user:
        return f"{user_name(user)} (the rows the cross-entropy {user_name(node)} reads)"
    return user_name(user)


def quiet(policy: str, training: bool) -> bool:
    """Is leaving the site alone what the user asked for (evaluation graphs keep their logits;
    CCE_ESCAPING_LOGITS=keep): said at INFO, not as a warning."""
    return not training or policy == "keep"
