"""Rules that rewrite the forms RL code is written in into the form the matcher knows, before
matching: a log-prob becomes a ``cross_entropy(reduction="none")`` the matcher fuses, and an
entropy becomes ``cce::softmax_entropy``, which a fused site serves from the op's entropy.

Each rule is a function of one node, the last of its form; it rewrites through the journal
(``journal.py``: what is not fused is put back as it was) and says whether it did. In order:

1. ``in_place_scale``: ``z.div_(T)``, ``z.mul_(c)``, ``z /= T`` (verl, OpenRLHF) -> ``z / T``,
   read by every later use of ``z``; left in place, with the reason on the node, where another
   view of ``z`` is read after the write or ``z`` is the caller's tensor.
2. ``piecewise.join_pieces``: a loop over rows or chunks (``stack`` / ``cat`` of the same
   row-wise function of pieces that cover a tensor) -> that function of the whole tensor;
   ``categorical.broadcast_value``: ``Categorical.log_prob``'s ``broadcast_tensors`` of the ids
   and the log-probs, where it changes neither, -> its operands.
3. ``log_probs`` -> ``cce::token_log_probs(z, ids)``:
   ``F.log_softmax(z, -1).gather(-1, ids[..., None])`` (the log-softmax also as Categorical
   writes it, ``z - z.logsumexp(-1, keepdim=True)``),
   ``z.gather(-1, ids[..., None]) - z.logsumexp(-1, keepdim=True)`` (or its ``unsqueeze``),
   ``z.gather(-1, ids[..., None]).squeeze(-1) - z.logsumexp(-1)`` (the squeeze also as
   ``[..., 0]``; the logsumexp may be taken on a row view of ``z``: OpenRLHF's
   ``z.reshape(-1, V)`` then ``.view(*batch)``); ``logsumexp - gather``, the negative
   log-prob, -> ``-token_log_probs``.
4. ``entropy_rules.entropy`` -> ``cce::softmax_entropy(z)``: the entropy forms of TRL, verl,
   OpenRLHF and ``torch.distributions.Categorical``, their sign and keepdim variants; the
   spellings that are NaN at a -inf logit in eager (``0 * -inf``) only of logits that cannot
   hold one, and other forms the op would compute otherwise (``softmax(z).log()``, an epsilon
   in the log, ``Categorical(probs=...)``) marked ``canonical.LEFT_ALONE``: their site is left
   alone, says why, and the journal undoes them (``entropy_rules.py``).
5. ``lower_log_probs``: ``token_log_probs(z, ids)`` ->
   ``-F.cross_entropy(z.flatten(0, -2), ids.flatten(), reduction="none",
   ignore_index=NO_ID).view_as(ids)``: eager's values wherever its ``gather`` has them. No id
   equals ``NO_ID`` (int64's least), so an id out of range (-100 included) is out of range for
   the op too: an error on the CPU, as ``gather``'s, and NaN on a GPU, never a plausible 0.
6. ``dummy_loss``: an entropy whose logits no cross-entropy reads gets one, of zero targets and
   unused, marked as such (``canonical.ENTROPY``): the site that carries its entropy.

Before them, ``sizes_read``: a size read from a tensor (``z.size(0)``, ``z.size()[0]``,
``z.shape[:-1]``'s parts, as TRL's ``entropy_from_logits`` reshapes its result) becomes the
size itself, an int or the graph's node holding that SymInt, so that reading the logits' shape
keeps no logits alive (under dynamic batch sizes it was an escaping use). After the in-place
temperature, ``one_scaling``: the same constant scaling of one tensor written twice (TRL's
``selective_log_softmax(z, ids, temperature=T)`` beside ``entropy_from_logits(z / T)``), or the
same slice (``z[:, :-1]`` for the loss and again for the entropy), is one node, so that both read
the same logits.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from . import calls as c
from . import canonical, categorical, entropy_rules, piecewise, safety
from . import predicates as p
from .emit import Emitter
from .journal import REPLACES, Journal


def sizes_read(node: Node, journal: Journal) -> bool:
    """``getitem(z.size(), i)`` or ``z.size(i)`` of a floating-point tensor ``z`` -> the size's
    value: its int, or the node that holds its SymInt (``predicates.symint_holders``)."""
    named = c.SIZE.args(node)
    if named is not None and named.get("dim") is not None:
        read, tensor = node, named["input"]
    elif node.target is operator.getitem and isinstance(node.args[1], int):
        whole = c.SIZE.args(node.args[0])
        if whole is None or whole.get("dim") is not None:
            return False
        read, tensor = node, whole["input"]
    else:
        return False
    value, source = p.example_value(read), p.tensor_value(tensor)
    if source is None or not source.dtype.is_floating_point:
        return False
    if isinstance(value, torch.SymInt):
        known = value.node.maybe_as_int()
        value = (
            known if known is not None else p.symint_holders(node.graph).get(str(value.node.expr))
        )
    if value is None or isinstance(value, bool) or not isinstance(value, (int, Node)):
        return False
    readers = {user: (user.args, user.kwargs) for user in read.users}
    for user in readers:
        user.replace_input_with(read, value)

    def undo() -> None:
        for user, (args, kwargs) in readers.items():
            user.args, user.kwargs = args, kwargs

    journal.record("size read", [tensor, read], [], undo)
    return True


def one_scaling(node: Node, journal: Journal) -> bool:
    """``z / c`` (or ``z * c``), or a basic slice ``z[:, :-1]``, where an earlier node computes
    the same of the same ``z`` (and constant ``c``) with nothing written to ``z`` between them:
    its uses read the earlier node."""
    spelling = next((s for s in (c.DIV, c.MUL, _SLICE) if s.args(node) is not None), None)
    if spelling is None:
        return False
    named = spelling.args(node)
    z, other_operand = named["input"], named.get("other", named.get("index"))
    value = p.tensor_value(z)
    if value is None or not _constant_operand(spelling, other_operand):
        return False
    if spelling is _SLICE and not value.dtype.is_floating_point:
        return False  # (logits only: the ids' slices are read by what the site replaces)
    order = safety.node_order(node.graph)
    same = [
        other
        for other in z.users
        if other is not node
        and order[other] < order[node]
        and spelling.args(other) == named
        and (other.target, other.kwargs) == (node.target, node.kwargs)
        and safety.first_write([z], other, node, order) is None
    ]
    if not same:
        return False
    readers = {user: (user.args, user.kwargs) for user in node.users}
    node.replace_all_uses_with(same[0])

    def undo() -> None:
        for user, (args, kwargs) in readers.items():
            user.args, user.kwargs = args, kwargs

    journal.record("one scaling", [z, node, same[0]], [], undo)
    return True


_SLICE = c.call({operator.getitem}, params=("input", "index"))


def _constant_operand(spelling: Any, operand: Any) -> bool:
    """A scaling's constant factor, or a slice's index of slices, ints, None and ``...``
    with no tensor or symbolic part (the same index picks the same elements)."""
    if spelling is not _SLICE:
        return not isinstance(operand, Node) and p.scalar(operand) is not None
    parts = operand if isinstance(operand, tuple) else (operand,)

    def plain(value: Any) -> bool:
        return value is None or (isinstance(value, int) and not isinstance(value, bool))

    return all(
        part is None
        or part is Ellipsis
        or plain(part)
        or (isinstance(part, slice) and all(plain(v) for v in (part.start, part.stop, part.step)))
        for part in parts
    )


def canonicalize(graph: Graph) -> Journal:
    """Apply the rules to ``graph`` (module docstring), each over the whole graph in turn;
    returns what they changed."""
    journal = Journal(graph)
    if any(_might_match(node) for node in graph.nodes):
        for rule in RULES:
            apply(graph, rule, journal)
    return journal


_STARTS = (c.LOG_SOFTMAX, c.SOFTMAX, c.LOGSUMEXP, c.GATHER, c.DIV_, c.MUL_, c.SIZE)


def _might_match(node: Node) -> bool:
    """Could a rule start at ``node``? (Graphs without any are left untouched, cheaply.)"""
    return any(spelling.args(node) is not None for spelling in _STARTS)


def apply(graph: Graph, rule, journal: Journal) -> int:
    """Apply ``rule`` at every live node of ``graph`` where its form can end (not at dead
    code, such as the forms an earlier rule replaced); returns how many times it rewrote."""
    ends = [n for n in graph.nodes if any(s.args(n) is not None for s in _ENDS[rule.__name__])]
    dead = safety.dead_nodes(graph) if ends else set()
    return sum(bool(rule(n, journal)) for n in ends if n not in dead and not n._erased)


# --- 1. in-place temperature -------------------------------------------------------------


def in_place_scale(write: Node, journal: Journal) -> bool:
    """``z.div_(T)`` / ``z.mul_(c)`` / ``z /= T`` / ``z *= c`` -> ``scaled = z / T`` (or
    ``z * c``) in its place, every later use of ``z`` (and of the write's result) reading
    ``scaled``. Left in place where that would change what something reads, the reason
    written on the node (``canonical.KEPT_IN_PLACE``) for the site's report."""
    found = [(s.args(write), op) for s, op in ((c.DIV_, operator.truediv), (c.MUL_, operator.mul))]
    found = [(named, op) for named, op in found if named is not None]
    if not found:
        return False
    ((named, out_of_place),) = found
    z, factor = named["input"], named.get("other")
    if factor is None or p.tensor_value(z) is None:
        return False
    why = _kept_in_place(write, z, factor)
    if why is not None:
        write.meta[canonical.KEPT_IN_PLACE] = why
        return False
    graph = write.graph
    scaled = Emitter(graph, write)(out_of_place, z, factor)
    scaled.meta[REPLACES] = write.name
    order = safety.node_order(graph)
    later = [u for u in z.users if u is not write and order[u] > order[write]]
    for user in later:
        user.replace_input_with(z, scaled)
    readers = list(write.users)
    write.replace_all_uses_with(scaled)
    saved = (write.op, write.target, write.args, write.kwargs, dict(write.meta))
    graph.erase_node(write)

    def undo() -> None:
        with graph.inserting_before(scaled):
            restored = graph.create_node(*saved[:4])
        restored.meta.update(saved[4])
        for user in later:
            user.replace_input_with(scaled, z)
        for user in readers:
            user.replace_input_with(scaled, restored)
        graph.erase_node(scaled)

    journal.record("in-place scale", [z, scaled], [scaled], undo)
    return True


def _kept_in_place(write: Node, z: Node, factor: Any) -> str | None:
    """Why the write must stay in place, or None."""
    value, factor_value = p.tensor_value(z), p.tensor_value(factor)
    if factor_value is None and p.scalar(factor) is None:
        return "its factor is neither a number nor a tensor"
    if factor_value is not None and (
        factor_value.dim() > value.dim() or torch.result_type(value, factor_value) != value.dtype
    ):
        return "its factor would change the logits' shape or dtype out of place"
    if z.op == "placeholder":
        return f"{z.name} is an input of the graph (the write is seen by the caller)"
    key = safety.storage(z)
    if key is None:
        return f"the memory of {z.name} cannot be told apart from other tensors'"
    order = safety.node_order(write.graph)
    for node in write.graph.nodes:
        if node is write:
            break
        if node is z or safety.storage(node) != key:
            continue
        if node.op == "placeholder":
            return f"{z.name} is a view of graph input {node.name} (the caller sees the write)"
        after = [u for u in safety.live_users(node) if order[u] > order[write]]
        if after:
            return f"{node.name}, another view of {z.name}, is read after it (by {after[0].name})"
    return None


# --- 3. log-probs ------------------------------------------------------------------------


def log_probs(node: Node, journal: Journal) -> bool:
    """The log-prob forms (module docstring, 3.) -> ``cce::token_log_probs``; the negative
    log-prob, ``logsumexp - gather``, -> its negation."""
    found = _log_softmax_gather(node) or _gather_minus_logsumexp(node)
    if found is None:
        return False
    z, index, keeps_dim, negated, matched = found
    old = node
    users = list(node.users)
    if keeps_dim and len(users) == 1 and _squeezes_last(users[0]):
        old, keeps_dim = users[0], False  # fold the user's squeeze(-1)
    emit = Emitter(node.graph, old)
    created: list[Node] = []
    ids = _unsqueezed_source(index)
    if ids is None:
        ids = _made(created, emit.method("squeeze", index, -1))
    new = _made(created, emit(canonical.TOKEN_LOG_PROBS, z, ids))
    if keeps_dim:
        new = _made(created, emit.method("unsqueeze", new, -1))
    if negated:
        new = _made(created, emit(operator.neg, new))
    if p.tensor_value(new).dtype != p.tensor_value(old).dtype:
        journal.erase(created)
        return False
    journal.replaced("log-probs", old, new, [node, *matched], created)
    return True


def _made(created: list[Node], node: Node) -> Node:
    created.append(node)
    return node


def _log_softmax_gather(node: Node) -> tuple | None:
    """(z, index, True, False, matched) for ``log_softmax(z, -1).gather(-1, index)`` (also
    Categorical's ``z - z.logsumexp(-1, keepdim=True)``)."""
    gathered = _gather(node)
    if gathered is None:
        return None
    log_softmax, index = gathered
    found = entropy_rules.log_softmax_nodes(log_softmax)
    if found is None or not _indexes(index, found[0]):
        return None
    z, nodes = found
    return z, index, True, False, [*nodes, z, index]


def _gather_minus_logsumexp(node: Node) -> tuple | None:
    """(z, index, keeps_dim, negated, matched) for ``gather(z, -1, index) - logsumexp`` over
    the same rows: keepdim / unsqueezed (keeps_dim), or both squeezed; or for ``logsumexp -
    gather(...)``, the negative log-prob (negated)."""
    named = c.SUB.args(node)
    if named is None or len(named) != 2:
        return None
    for picked, lse in ((named["input"], named["other"]), (named["other"], named["input"])):
        found = _picked_and_logsumexp(picked, lse)
        if found is not None:
            z, index, keeps_dim, matched = found
            return z, index, keeps_dim, picked is named["other"], matched
    return None


def _picked_and_logsumexp(picked: Any, lse: Any) -> tuple | None:
    """(z, index, keeps_dim, matched) for ``picked`` a gather of z over the last dim and
    ``lse`` the logsumexp of the same rows, alike in shape and in having a gradient (a detach
    or no_grad on one side: eager's gradient flows through the other alone, the op's through
    both or neither)."""
    keeps_dim = not _squeezes_last(picked)
    gathered = _gather(picked if keeps_dim else picked.args[0])
    if gathered is None:
        return None
    z, index = gathered
    rows = _logsumexp_rows(lse, keepdim=keeps_dim)
    if rows is None or not _indexes(index, z) or _root(rows[0]) is not _root(z):
        return None
    if not p.same_shape(picked, lse) or safety.requires_grad(picked) != safety.requires_grad(lse):
        return None
    return z, index, keeps_dim, [picked, z, index, lse, *rows]


def _gather(node: Any) -> tuple[Node, Node] | None:
    """(input, index) of ``gather`` over the last dim."""
    named = c.GATHER.args(node)
    if named is None or "index" not in named or not c.last_dim(named.get("dim"), node):
        return None
    return named["input"], named["index"]


def _indexes(index: Any, z: Node) -> bool:
    """Is ``index`` one int64 class per row of ``z``, as (..., 1)? (Guarded where symbolic.)"""
    value, logits = p.tensor_value(index), p.tensor_value(z)
    if value is None or logits is None or value.dtype != torch.int64:
        return False
    if value.dim() != logits.dim() or not p.same_size(value.shape[-1], 1):
        return False
    return all(p.guarded_same_size(a, b) for a, b in zip(value.shape[:-1], logits.shape[:-1]))


def _logsumexp_rows(node: Any, keepdim: bool) -> list[Node] | None:
    """[logsumexp input, the nodes on the way] for a logsumexp over the last dim, through
    views of its result, and its unsqueeze(-1) or keepdim=True where ``keepdim``."""
    path = []
    while p.is_method(node, {"view", "reshape", "contiguous"}) or p.is_call(node, {torch.reshape}):
        path.append(node)
        node = node.args[0]
    if keepdim and c.over_last_dim(c.LOGSUMEXP, node, keepdim=True) is not None:
        return [c.over_last_dim(c.LOGSUMEXP, node, keepdim=True), *path, node]
    if keepdim:
        named = c.UNSQUEEZE.args(node)
        if named is None or not c.last_dim(named.get("dim"), node):
            return None
        path.append(node)
        node = named["input"]
    source = c.over_last_dim(c.LOGSUMEXP, node)
    return None if source is None else [source, *path, node]


def _squeezes_last(node: Any) -> bool:
    """``x.squeeze(-1)``, or ``x[..., 0]`` of an x whose last dim is 1."""
    named = c.SQUEEZE.args(node)
    if named is not None:
        return c.last_dim(named.get("dim"), named["input"])
    if not p.is_call(node, {operator.getitem}) or not isinstance(node.args[1], tuple):
        return False
    value, index = p.tensor_value(node.args[0]), node.args[1]
    first = len(index) == 2 and index[0] is Ellipsis and type(index[1]) is int
    if not first or index[1] not in (0, -1) or value is None or value.dim() == 0:
        return False
    return p.same_size(value.shape[-1], 1)


def _unsqueezed_source(index: Node) -> Node | None:
    """ids for ``ids.unsqueeze(-1)`` or ``ids[..., None]``."""
    named = c.UNSQUEEZE.args(index)
    if named is not None and c.last_dim(named.get("dim"), index):
        return named["input"]
    if p.is_call(index, {operator.getitem}) and index.args[1] in ((Ellipsis, None), (..., None)):
        return index.args[0]
    return None


def _root(node: Any) -> Any:
    """The tensor whose rows ``node`` holds, through row views, contiguous and float32 casts."""
    while p.is_row_view(node) or p.is_passthrough(node) or p.cast_dtype(node) == torch.float32:
        node = node.args[0]
    return node


# --- 5, 6. lowering -----------------------------------------------------------------------


# The lowered log-probs' ignore_index: no id holds it (``gather`` ignores no id).
NO_ID = -(2**63)


def lower_log_probs(node: Node, journal: Journal) -> bool:
    """``token_log_probs(z, ids)`` -> ``-cross_entropy(z.flatten(0, -2), ids.flatten(),
    reduction="none").view_as(ids)``, the cross-entropy marked as log-probs."""
    if not canonical.is_token_log_probs(node) or p.tensor_value(node.args[0]).dim() < 2:
        return False
    z, ids = node.args
    emit = Emitter(node.graph, node)
    rows = emit.method("flatten", z, 0, -2)
    targets = emit.method("flatten", ids)
    loss = emit(F.cross_entropy, rows, targets, reduction="none", ignore_index=NO_ID)
    loss.meta[canonical.FORM] = canonical.LOG_PROBS
    negated = emit(operator.neg, loss)
    shaped = emit.method("view_as", negated, ids)
    created = [rows, targets, loss, negated, shaped]
    dtype = p.tensor_value(node).dtype
    if p.tensor_value(shaped).dtype != dtype:  # autocast computes cross_entropy in float32
        shaped = emit.method("to", shaped, dtype)
        created.append(shaped)
    journal.replaced("lowering", node, shaped, [z], created)
    return True


def dummy_loss(node: Node, journal: Journal) -> bool:
    """For ``softmax_entropy(x)`` where no cross-entropy reads the rows of ``x``:
    ``cross_entropy(x.flatten(0, -2), zeros, reduction="none")``, unused, marked as an
    entropy's (``canonical.ENTROPY``): the op's entropy output serves ``x``'s entropy. An
    entropy not to be fused passes its ``canonical.LEFT_ALONE`` on: the site says why."""
    x = canonical.entropy_input(node)
    if x is None or p.tensor_value(x).dim() < 2:
        return False
    if _root(x) in {_root(logits) for logits in _loss_inputs(node.graph)}:
        return False
    emit = Emitter(node.graph, node)
    rows = emit.method("flatten", x, 0, -2)
    first = emit(operator.getitem, rows, (Ellipsis, 0))
    targets = emit(torch.zeros_like, first, dtype=torch.int64)
    loss = emit(F.cross_entropy, rows, targets, reduction="none")
    loss.meta[canonical.FORM] = canonical.ENTROPY
    if canonical.LEFT_ALONE in node.meta:
        loss.meta[canonical.LEFT_ALONE] = node.meta[canonical.LEFT_ALONE]
    created = [rows, first, targets, loss]
    journal.record("lowering", [x, node], created, lambda: journal.erase(created))
    return True


RULES = (
    sizes_read,
    in_place_scale,
    one_scaling,
    piecewise.join_pieces,
    categorical.broadcast_value,
    log_probs,
    entropy_rules.entropy,
    lower_log_probs,
    dummy_loss,
)
# The last node of each rule's forms, by its spellings.
_ENDS = {
    "sizes_read": (c.SIZE, c.call({operator.getitem}, params=("input", "index"))),
    "one_scaling": (c.DIV, c.MUL, _SLICE),
    "in_place_scale": (c.DIV_, c.MUL_),
    "join_pieces": (c.STACK, c.CAT),
    "broadcast_value": (categorical.BROADCAST,),
    "log_probs": (c.GATHER, c.SUB),
    "entropy": (c.NEG, c.SUB, c.SUM, entropy_rules.NANSUM),
    "lower_log_probs": (c.call({canonical.TOKEN_LOG_PROBS}, params=("input", "index")),),
    "dummy_loss": (c.call({canonical.SOFTMAX_ENTROPY}),),
}


def _loss_inputs(graph: Graph) -> list[Node]:
    """The logits every cross-entropy and nll_loss of the graph reads."""
    inputs = []
    for node in graph.nodes:
        if p.is_cross_entropy(node):
            logits = p.bind(node, F.cross_entropy)["input"]
            inputs.append(p.class_dim_moved_last(logits) or logits)
        elif p.is_nll_loss(node):
            source = p.log_softmax_input(_root(p.bind(node, F.nll_loss)["input"]))
            inputs.extend([source] if source is not None else [])
    return inputs
