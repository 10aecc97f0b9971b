"""Finding ``linear -> row-wise ops -> cross_entropy`` sites in a Dynamo graph.

``find_sites`` walks back from every loss node (``F.cross_entropy``, ``F.nll_loss`` over a
last-dim ``log_softmax``) through the ops that keep each row's logits a row: casts up to
float32, view/reshape/flatten of the leading dims, contiguous, row slices (Hugging Face's
``logits[..., :-1, :]``), scaling by a constant and the softcap ``c * tanh(x / c)``, until it
reaches the head (``F.linear``, ``x @ W.T`` ...). Each candidate becomes a :class:`Site` or a
:class:`Rejection` whose reason says why it is left alone.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from .. import config
from . import predicates as p
from . import safety, tensor_parallel
from .verdicts import (  # noqa: F401  (re-exported: matching is where readers look)
    DISABLED,
    DISABLED_DETAIL,
    DTENSOR,
    ESCAPES,
    GRAPH_BREAK,
    MUTATION,
    NO_HEAD,
    UNSUPPORTED_OP,
    UNSUPPORTED_OPTION,
    Rejection,
)

log = logging.getLogger("cce_compile")


@dataclasses.dataclass
class Site:
    """One rewritable linear -> cross-entropy site."""

    loss: Node
    head: Node
    hidden: Node
    classifier: Node
    classifier_is_transposed: bool  # the head was x @ W with W (D, V): classifier is W.T
    bias: Node | None
    chain: list[Node]  # head output .. loss input, in forward order (head excluded)
    log_softmax: Node | None  # the nll_loss form's log_softmax
    loss_views: list[Node]  # between the loss and log_softmax / logits: views, class-dim move
    transposes: list[Node]  # W.T nodes of a matmul head: erased with the chain when unused
    operand_casts: list[Node]  # casts to the head's dtype looked through: erased when unused
    row_indices: list[Any]  # row slices to replay on hidden, in forward order
    targets: Node  # what the op reads: the loss's target through views (element_source)
    loss_targets: Node  # the loss's own target argument
    class_weights: Node | None
    ignore_index: int
    reduction: str
    label_smoothing: Any  # float or SymFloat node
    softcap: Any  # None, float or SymFloat node
    scale_factors: list[tuple[Any, bool]]  # (scalar, divides), product = logit_scale
    compute_dtype: torch.dtype
    lse_users: list[Node]  # logsumexp nodes the op's lse can serve (z-loss)
    lse_shapes: list[Any]  # per lse user: "targets", "rows" (at hidden), "flat", or sizes
    lse_side_nodes: list[Node]  # casts between the chain and a served logsumexp
    anchor: Node  # the op goes right before it: the loss, or an lse user's earlier consumer
    detach_operands: bool  # the logits carry no gradient (no_grad / detach on the way)
    kept_logits: list[Node] = dataclasses.field(default_factory=list)  # escaping, kept alive
    dropped_logits: list[Node] = dataclasses.field(default_factory=list)  # returned, dropped

    @property
    def rows(self) -> Any:
        """Number of loss rows (int or SymInt) from the loss input's example value."""
        value = p.tensor_value(self.chain[-1] if self.chain else self.head)
        return math.prod(value.shape[:-1]) if value.dim() > 1 else 1

    @property
    def vocab(self) -> Any:
        return p.tensor_value(self.head).shape[-1]


# What the pass rewrites: a plain head's site, or a vocabulary-sharded DTensor head's.
REWRITABLE = (Site, tensor_parallel.TensorParallelSite)


def find_sites(graph: Graph) -> list[Site | Rejection | Any]:
    """Every cross-entropy candidate of ``graph``, matched or rejected, in graph order."""
    found: list[Site | Rejection] = []
    order = safety.node_order(graph)
    for node in graph.nodes:
        if p.is_cross_entropy(node) or p.is_nll_loss(node):
            result = match_site(node, order)
            if isinstance(result, Rejection):
                log.debug(
                    "cce_compile: not rewriting %s: %s (%s)",
                    node.name,
                    result.reason,
                    result.detail,
                )
            found.append(result)
    return found


def _reject(loss: Node, reason: str, detail: str) -> Rejection:
    return Rejection(loss, reason, detail)


def _loss_options(loss: Node) -> dict[str, Any] | Rejection:
    """The loss's input, target and options, normalised from any argument layout."""
    views: list[Node] = []  # between the loss and its log_softmax / logits (loss order)
    if p.is_cross_entropy(loss):
        args = p.bind(loss, F.cross_entropy)
        log_softmax = None
        logits = args["input"]
        source = p.class_dim_moved_last(logits)  # (B, V, T) input of a (B, T, V) tensor
        if source is not None:
            views.append(logits)
            logits = source
    else:
        args = p.bind(loss, F.nll_loss)
        args["label_smoothing"] = 0.0
        log_softmax = args["input"]
        while p.is_row_view(log_softmax) or p.is_passthrough(log_softmax):
            views.append(log_softmax)  # log_softmax(x).view(-1, V): rows regrouped after it
            log_softmax = log_softmax.args[0]
        logits = p.log_softmax_input(log_softmax)
        if logits is None:
            return _reject(loss, UNSUPPORTED_OP, "nll_loss input is not a last-dim log_softmax")
    for node in [log_softmax, *views]:
        if node is not None and len(node.users) != 1:
            return _reject(loss, ESCAPES, f"{node.name} has other users")
    if args["size_average"] is not None or args["reduce"] is not None:
        return _reject(loss, UNSUPPORTED_OPTION, "legacy size_average/reduce arguments")
    if isinstance(args["ignore_index"], Node) or not isinstance(args["ignore_index"], int):
        return _reject(loss, UNSUPPORTED_OPTION, "ignore_index is not a constant int")
    if args["reduction"] not in ("mean", "sum", "none"):
        return _reject(loss, UNSUPPORTED_OPTION, f"reduction {args['reduction']!r}")
    smoothing = args["label_smoothing"]
    if p.scalar(smoothing) is None:
        return _reject(loss, UNSUPPORTED_OPTION, "label_smoothing is not a scalar")
    if not isinstance(smoothing, Node) and not 0.0 <= smoothing <= 1.0:
        return _reject(loss, UNSUPPORTED_OPTION, f"label_smoothing {smoothing} outside [0, 1]")
    logits_value, target_value = p.tensor_value(logits), p.tensor_value(args["target"])
    if logits_value is None or target_value is None:
        return _reject(loss, UNSUPPORTED_OPTION, "input or target without example value")
    if target_value.dtype.is_floating_point:
        return _reject(loss, UNSUPPORTED_OPTION, "class-probability targets")
    moved = p.is_cross_entropy(loss) and bool(views)  # classes in dim 1, moved back last
    if p.tensor_value(args["input"]).dim() > 2 and not moved:
        return _reject(loss, UNSUPPORTED_OPTION, "class dimension is dim 1 of a >2-D input")
    return dict(
        logits=logits,
        target=args["target"],
        weight=args["weight"],
        ignore_index=args["ignore_index"],
        reduction=args["reduction"],
        label_smoothing=smoothing,
        log_softmax=log_softmax,
        loss_views=views,
    )


@dataclasses.dataclass
class _Walk:
    chain: list[Node] = dataclasses.field(default_factory=list)  # loss input .. head, reversed
    row_indices: list[Any] = dataclasses.field(default_factory=list)  # reversed
    scale_factors: list[tuple[Any, bool]] = dataclasses.field(default_factory=list)
    softcap: Any = None
    bias: Node | None = None  # ``h @ W.T + b``: the bias added to a matmul head
    z_level: list[Node] = dataclasses.field(default_factory=list)  # nodes whose value is z


def _walk_to_head(loss: Node, start: Node) -> tuple[Node, _Walk] | Rejection:
    """Follow the chain from the loss input back to the head."""
    walk = _Walk()
    node = start
    while True:
        # z-level: the value is z at the loss rows. Before a scale / softcap it is not z, and
        # before a row slice it has rows the op's lse does not cover.
        transformed = walk.scale_factors or walk.softcap is not None or walk.bias is not None
        if not transformed and not walk.row_indices:
            walk.z_level.append(node)
        if p.is_linear(node) or p.is_matmul(node):
            if walk.bias is not None and not p.is_matmul(node):
                return _reject(loss, UNSUPPORTED_OP, f"a bias added to {node.name}'s output")
            return node, walk
        walk.chain.append(node)
        added = p.bias_add(node)
        if added is not None and p.is_matmul(added[0]) and walk.bias is None:
            node, walk.bias = added  # the head's own output plus a (V,) bias, nothing between
            continue
        dtype = p.cast_dtype(node)
        if dtype is not None:
            if dtype != torch.float32:
                return _reject(loss, UNSUPPORTED_OP, f"{node.name} casts the logits to {dtype}")
            node = node.args[0]
            continue
        if p.is_passthrough(node):
            node = node.args[0]
            continue
        if p.is_row_view(node):
            if walk.row_indices:  # forward order: a reshape, then a row slice of its rows
                return _reject(loss, UNSUPPORTED_OP, f"{node.name}: rows sliced after a reshape")
            node = node.args[0]
            continue
        index = p.row_index(node)
        if index is not None:
            walk.row_indices.append(index)
            node = node.args[0]
            continue
        capped = p.softcap(node)
        if capped is not None:
            if walk.softcap is not None:
                return _reject(loss, UNSUPPORTED_OP, "two softcaps")
            if walk.scale_factors:
                return _reject(loss, UNSUPPORTED_OP, "logits scaled after the softcap")
            inner, walk.softcap, tanh_nodes = capped
            bad = safety.bad_constant("the softcap", walk.softcap, zero_ok=False)
            if bad is not None:  # c * tanh(x / c) with c = 0 or inf is no softcap the op has
                return _reject(loss, UNSUPPORTED_OPTION, bad)
            walk.chain.extend(tanh_nodes)
            node = inner
            continue
        scaled = p.is_scale(node)
        if scaled is not None:
            tensor, factor, divides = scaled
            bad = safety.bad_constant(f"{node.name}'s factor", factor, zero_ok=not divides)
            if bad is not None:
                return _reject(loss, UNSUPPORTED_OPTION, f"logits scaled by a constant: {bad}")
            walk.scale_factors.append((factor, divides))
            node = tensor
            continue
        if isinstance(node, Node) and node.op == "placeholder":
            return _reject(
                loss,
                GRAPH_BREAK,
                f"logits come from graph input {node.name} "
                "(a graph break between the head and the loss?)",
            )
        if p.is_tensor_scale(node):
            return _reject(
                loss,
                UNSUPPORTED_OP,
                f"{node.name}: logits scaled by a tensor (the op takes a constant logit_scale; "
                "multiply the hidden states or the classifier by the tensor instead)",
            )
        what = node.target if isinstance(node, Node) else type(node).__name__
        return _reject(loss, UNSUPPORTED_OP, f"{getattr(node, 'name', node)}: {what}")


def _head_operands(head: Node) -> tuple[Node, Node, bool, Any, list[Node]] | None:
    """(hidden, classifier, classifier_is_transposed, bias, transpose nodes) of a head."""
    if p.is_linear(head):
        hidden, weight, bias = p.linear_operands(head)
        return hidden, weight, False, bias, []
    hidden, right = head.args[0], head.args[1]
    weight = p.transposed_matrix(right)
    if weight is not None:
        return hidden, weight, False, None, [right]
    value = p.tensor_value(right)
    if value is not None and value.dim() == 2:  # x @ W with W (D, V)
        return hidden, right, True, None, []
    return None


def match_site(loss: Node, order: dict[Node, int] | None = None) -> Site | Rejection | Any:
    """Match one loss node against the pattern; a Site (a TensorParallelSite for a
    vocabulary-sharded DTensor head), or a Rejection saying why not."""
    order = order or safety.node_order(loss.graph)
    found = tensor_parallel.match(loss, order)
    if found is not None:  # a DTensor head: its site, or why not
        return found
    options = _loss_options(loss)
    if isinstance(options, Rejection):
        return options
    walked = _walk_to_head(loss, options["logits"])
    if isinstance(walked, Rejection):
        return walked
    head, walk = walked
    operands = _head_operands(head)
    if operands is None:
        return _reject(loss, NO_HEAD, f"{head.name}: matmul operand is not a 2-D weight")
    hidden, classifier, transposed, bias, transposes = operands
    bias = walk.bias if walk.bias is not None else bias
    hidden_value, weight_value = p.tensor_value(hidden), p.tensor_value(classifier)
    head_value = p.tensor_value(head)
    if hidden_value is None or weight_value is None or head_value is None:
        return _reject(loss, NO_HEAD, f"{head.name}: operands without example values")
    if any(p.functorch_wrapped(n) for n in (head, hidden, classifier)):
        return _reject(
            loss,
            UNSUPPORTED_OPTION,
            "traced inside a torch.func transform (grad / vmap / jvp): the fused op would need "
            "functorch rules; call cce_compile.linear_cross_entropy inside the transform instead",
        )
    if p.is_dtensor(weight_value) or p.is_dtensor(hidden_value):
        return _reject(loss, DTENSOR, "DTensor weights or activations (distributed)")
    if bias is not None and (not isinstance(bias, Node) or p.tensor_value(bias) is None):
        return _reject(loss, UNSUPPORTED_OPTION, "bias is not a tensor")
    if bias is not None and not (
        p.tensor_value(bias).dim() == 1
        and p.same_size(p.tensor_value(bias).shape[0], head_value.shape[-1])
    ):
        shape = tuple(p.tensor_value(bias).shape)
        return _reject(loss, UNSUPPORTED_OPTION, f"bias of shape {shape} broadcasts over classes")
    if head_value.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return _reject(
            loss, UNSUPPORTED_OPTION, f"head computes in {head_value.dtype} (the op: float32)"
        )
    casts: list[Node] = []  # explicit casts of the operands the op does itself (AMP)
    hidden, classifier, bias = (
        _rounded_source(n, head_value.dtype, casts) for n in (hidden, classifier, bias)
    )

    chain = list(reversed(walk.chain))
    z_level = set(walk.z_level)
    lse_users, side_nodes, escaping = _classify_users(
        head, chain, loss, [options["log_softmax"], *options["loss_views"]], z_level
    )
    rows_at_hidden = _rows_at_hidden(head, chain)
    targets = p.element_source(options["target"])
    inputs = [
        hidden,
        classifier,
        bias,
        targets,
        options["weight"],
        options["label_smoothing"],
        walk.softcap,
        walk.scale_factors,
        walk.row_indices,
    ]
    ready = safety.ready_after(inputs, order)
    anchor = loss
    lse_shapes = []
    for user in list(lse_users):
        shape = _lse_shape(user, options["target"], rows_at_hidden)
        # The op serves a logsumexp only with its rows, before the logsumexp's first consumer,
        # at a point where its inputs exist and the loss's grad mode holds.
        first = min([loss, *user.users], key=order.__getitem__)
        sizes_from = [shape, options["target"] if shape == "targets" else None]
        servable = (
            shape is not None
            and order[first] > max(ready, safety.ready_after(sizes_from, order))
            and safety.requires_grad(user) == safety.requires_grad(loss)
            and not safety.grad_mode_changes(first, loss, order)
        )
        if servable:
            lse_shapes.append(shape)
            anchor = min(anchor, first, key=order.__getitem__)
        else:
            lse_users.remove(user)
            escaping.append(user)
    # Eager reads the head's operands and the logits from the head to their last consumer,
    # the targets and weights at the loss; the op reads all of them at the anchor.
    last = max([loss, *lse_users], key=order.__getitem__)
    # Through a looked-through cast, eager read the operand at the cast, before the head.
    read_from = min([head, *casts], key=order.__getitem__)
    written = safety.first_write([hidden, classifier, bias, head, *chain], read_from, last, order)
    written = written or safety.first_write(
        [targets, options["target"], options["weight"]], anchor, loss, order
    )
    if written is not None:
        writer, target = written
        return _reject(
            loss,
            MUTATION,
            f"{writer.name} ({safety.target_name(writer)}) writes {target.name} in place "
            "between the head and the loss",
        )
    policy = config.get().escaping_logits
    returned_only = _returned_only(escaping, head, chain, loss)
    training = safety.requires_grad(loss)
    droppable = returned_only and training and _shapes_rebuildable(escaping, hidden, targets)
    if escaping and not (policy == "rewrite" or (policy == "drop" and droppable)):
        detail = _escape_detail(escaping, chain, loss, policy, training, returned_only)
        return _reject(loss, ESCAPES, detail)
    dropped = escaping if policy == "drop" else []
    loss_input = options["log_softmax"] or options["logits"]
    return Site(
        anchor=anchor,
        detach_operands=not safety.requires_grad(loss_input),
        loss=loss,
        head=head,
        hidden=hidden,
        classifier=classifier,
        classifier_is_transposed=transposed,
        bias=bias,
        chain=chain,
        log_softmax=options["log_softmax"],
        loss_views=options["loss_views"],
        transposes=transposes,
        operand_casts=casts,
        row_indices=list(reversed(walk.row_indices)),
        targets=targets,
        loss_targets=options["target"],
        class_weights=options["weight"],
        ignore_index=options["ignore_index"],
        reduction=options["reduction"],
        label_smoothing=options["label_smoothing"],
        softcap=walk.softcap,
        scale_factors=list(reversed(walk.scale_factors)),
        compute_dtype=head_value.dtype,
        lse_users=lse_users,
        lse_shapes=lse_shapes,
        lse_side_nodes=side_nodes,
        kept_logits=[] if dropped else escaping,
        dropped_logits=dropped,
    )


def _rounded_source(node: Any, dtype: torch.dtype, casts: list[Node]) -> Any:
    """For an explicit cast of a float32 operand to the head's lower dtype (``w.bfloat16()``,
    ``x.to(torch.float16)``), the float32 source: the op rounds it to ``compute_dtype`` itself,
    as the cast would, without a V x D copy. Anything else: the node itself."""
    if dtype == torch.float32 or not isinstance(node, Node) or p.cast_dtype(node) != dtype:
        return node
    source = node.args[0]
    before, after = p.tensor_value(source), p.tensor_value(node)
    if before is None or before.dtype != torch.float32 or before.device != after.device:
        return node
    casts.append(node)
    return source


def _rows_at_hidden(head: Node, chain: list[Node]) -> tuple:
    """Leading shape of the logits where the op sees hidden: after the row slices."""
    shape = p.tensor_value(head).shape[:-1]
    for node in chain:
        if p.row_index(node) is not None:
            shape = p.tensor_value(node).shape[:-1]
    return tuple(shape)


def _lse_shape(user: Node, targets: Node, rows_at_hidden: tuple) -> Any:
    """How the op's lse (one per row) reshapes to ``user``'s shape, if it can."""
    shape = tuple(p.tensor_value(user).shape)

    def same(a, b):
        return len(a) == len(b) and all(p.same_size(x, y) for x, y in zip(a, b))

    if same(shape, tuple(p.tensor_value(targets).shape)):
        return "targets"
    if same(shape, rows_at_hidden):
        return "rows"
    if len(shape) == 1:
        return "flat"
    sizes = _size_nodes(user.graph, shape)
    return sizes  # ints and SymInt nodes of the graph, or None


def _size_nodes(graph: Graph, shape: tuple) -> list[Any] | None:
    """``shape`` with each symbolic size replaced by a graph node holding it, if all exist.

    Dynamo keeps every symbolic size as a SymInt node (its placeholders), so a shape the
    logits had can be rebuilt without keeping the logits alive.
    """
    holders = {}
    for node in graph.nodes:
        value = p.example_value(node)
        if isinstance(value, torch.SymInt):
            holders.setdefault(str(value.node.expr), node)
    sizes = []
    for size in shape:
        if isinstance(size, torch.SymInt):
            holder = holders.get(str(size.node.expr))
            if holder is None:
                return None
            sizes.append(holder)
        else:
            sizes.append(int(size))
    return sizes


def _returned_only(escaping: list[Node], head: Node, chain: list[Node], loss: Node) -> bool:
    """Is every escaping value one of the logits (head or chain), used outside the chain
    only as an output of the graph (a model returning its logits)?"""
    logits = {head, *chain}
    return all(
        node in logits and all(u.op == "output" for u in _outside_users(node, chain, loss))
        for node in escaping
    )


def _shapes_rebuildable(logits: list[Node], hidden: Node, targets: Node) -> bool:
    """Can every size of these logits be read from a node that outlives them (for the
    placeholder that replaces them)?"""
    holders = p.symint_holders(hidden.graph)
    return all(
        p.size_source(size, holders, [hidden, targets]) is not None
        for node in logits
        for size in p.tensor_value(node).shape
    )


def _escape_detail(
    escaping: list[Node],
    chain: list[Node],
    loss: Node,
    policy: str,
    training: bool,
    returned: bool,
) -> str:
    """Who else uses the logits, and the setting that would fuse the loss anyway."""
    users = sorted({u.name for n in escaping for u in _outside_users(n, chain, loss)})
    what = "returned by the graph" if returned else f"also used by {', '.join(users)}"
    if returned and training:
        fix = "CCE_ESCAPING_LOGITS=drop fuses this training loss (=rewrite keeps the logits)"
    elif returned and policy == "drop":
        fix = (
            "CCE_ESCAPING_LOGITS=drop applies to training graphs only (this loss needs no "
            "gradient); =rewrite fuses it and keeps the logits"
        )
    else:
        fix = "CCE_ESCAPING_LOGITS=rewrite fuses the loss and keeps them"
    return f"the logits are {what}; {fix}"


def _outside_users(node: Node, chain: list[Node], loss: Node) -> list[Node]:
    inside = set(chain) | {loss}
    return [u for u in node.users if u not in inside]


def _classify_users(head, chain, loss, loss_side, z_level):
    """Users of the head and chain outside it: a logsumexp over z, possibly through float32
    casts / contiguous (servable by the op's lse), or anything else (escaping).

    Returns (lse_users, side_nodes, escaping): side nodes are the casts leading to a served
    logsumexp, erased with it.
    """
    lse_users, side_nodes, escaping = [], [], []
    for node in [head, *chain]:
        for user in node.users:
            if user in chain or user is loss or user in loss_side:
                continue
            path, end = _through_casts(user)
            source = path[-1] if path else node
            if node in z_level and p.logsumexp_input(end) is source:
                lse_users.append(end)
                side_nodes.extend(path)
            elif node not in escaping:
                escaping.append(node)
    return lse_users, side_nodes, escaping


def _through_casts(user: Node) -> tuple[list[Node], Node]:
    """Follow single-user float32 casts and contiguous() from ``user``: (those nodes, end)."""
    path: list[Node] = []
    while (p.cast_dtype(user) == torch.float32 or p.is_passthrough(user)) and len(user.users) == 1:
        path.append(user)
        user = next(iter(user.users))
    return path, user
