"""Emitting nodes into a Dynamo graph, and what every kind of site's surgery emits alike.

The plain surgery emits only ``torch.ops`` overloads and builtins (a Python-function target
would make AOTAutograd bypass its cache); the tensor-parallel one also DTensor's methods and
``DTensor.from_local``, as Dynamo traces them. Every new node gets ``example_value`` (and
``val``, but for a DTensor) computed under the graph's fake mode, and its anchor's source
location; no placeholder is added; and only replaced nodes that became unused are erased, with
the dead code that hung on them.

The ops take ``hidden`` as (B, T, D) and ``targets`` as (B, T): hidden keeps the leading shape
it has at the head (after any replayed row slices) and targets are reshaped to it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings
from torch.utils.checkpoint import CheckpointPolicy

from . import predicates as p
from . import safety
from .verdicts import Site

aten = torch.ops.aten


class Emitter:
    """Creates nodes right before ``anchor``, with example values and the anchor's source meta."""

    def __init__(self, graph: Graph, anchor: Node):
        self.graph = graph
        self.anchor = anchor
        self.fake_mode = _fake_mode(graph, anchor)
        # (an example value made inside a no_grad region of the graph has no grad either)
        self.grad_enabled = safety.grad_enabled_at(anchor)

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> Node:
        """A call_function node."""
        return self._emit("call_function", target, args, kwargs)

    def method(self, name: str, *args: Any, **kwargs: Any) -> Node:
        """A call_method node (``args[0]`` is the tensor)."""
        return self._emit("call_method", name, args, kwargs)

    def like(self, node: Node, args: tuple, kwargs: dict) -> Node:
        """A node of ``node``'s kind and target, on other arguments."""
        return self._emit(node.op, node.target, args, kwargs)

    def _emit(self, op: str, target: Any, args: tuple, kwargs: dict) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, args, kwargs)
        p.copy_source_meta(node, self.anchor)
        values, named = p.example_args(args), p.example_args(kwargs)
        with self.fake_mode, torch.set_grad_enabled(self.grad_enabled):
            if op == "call_method":
                value = getattr(values[0], target)(*values[1:], **named)
            else:
                value = target(*values, **named)
        node.meta["example_value"] = value
        if not p.is_dtensor(value):
            node.meta["val"] = value
        # A size that depends on data (the op's row_index) is a new unbacked symbol: bind it
        # to this node, as Dynamo does for the nodes it traces.
        shape_env = getattr(self.fake_mode, "shape_env", None)
        if shape_env is not None:
            bindings = compute_unbacked_bindings(shape_env, value)
            if bindings:
                node.meta["unbacked_bindings"] = bindings
        return node


def _fake_mode(graph: Graph, anchor: Node) -> Any:
    """The fake mode of the graph's example values: the anchor's, else the first one found (a
    DTensor's is its local tensor's)."""
    for node in [anchor, *graph.nodes]:
        value = p.tensor_value(node)
        value = getattr(value, "_local_tensor", value)
        if getattr(value, "fake_mode", None) is not None:
            return value.fake_mode
    raise RuntimeError("a Dynamo graph without fake example values")


def rows_of_hidden(emit: Emitter, hidden: Node, site: Site) -> Node:
    """``hidden`` with the site's row slices replayed: the rows the loss reads."""
    for index in site.row_indices:
        hidden = emit(operator.getitem, hidden, index)
    return hidden


def save_inputs_not_views(op: Node) -> None:
    """Tag for recompute each view between a graph input and a tensor argument of ``op``, so
    that the backward saves the input itself and views it again. Inductor returns a saved view
    of an input as an alias without the input's version counter: an in-place write to the
    input between the loss and its backward would go unnoticed, and lean mode's recompute
    would read the written values. (A copy, e.g. the reshape of a transposed tensor, breaks
    the chain: the op then saves its own copy, as eager's linear does.)"""
    for argument in op.all_input_nodes:
        for view in _views_of_an_input(argument):
            view.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def _views_of_an_input(node: Node) -> list[Node]:
    """The nodes from ``node`` back to a graph input, each sharing its input's storage; none
    if the chain ends elsewhere (a computed tensor: nothing outside the graph can write it) or
    passes an in-place write (``h += 1``): the graph writes the input itself, after which the
    saved input would fail its own version check."""
    chain: list[Node] = []
    while node.op != "placeholder":
        key = safety.storage(node)
        sharing = [a for a in node.all_input_nodes if key is not None and safety.storage(a) == key]
        parent = sharing[0] if sharing else None
        if parent is None or parent in safety.written_operands(node):
            return []
        chain.append(node)
        node = parent
    return chain


def canonical_hidden(emit: Emitter, hidden: Node) -> Node:
    """hidden (..., D) -> (B, T, D), a view: rows keep their order."""
    ndim = p.tensor_value(hidden).dim()
    if ndim == 1:
        return emit(aten.view.default, hidden, [1, 1, -1])
    if ndim == 2:
        return emit(aten.unsqueeze.default, hidden, 0)
    if ndim == 3:
        return hidden
    return emit(aten.flatten.using_ints, hidden, 0, ndim - 3)


def targets_as_rows(emit: Emitter, targets: Node, hidden: Node) -> Node:
    """The targets reshaped to the (B, T) rows of the canonical ``hidden``."""
    rows = p.tensor_value(hidden).shape[:2]
    if any(isinstance(s, torch.SymInt) for s in rows):
        rows = [emit(aten.sym_size.int, hidden, i) for i in (0, 1)]
    return emit(aten.reshape.default, targets, list(rows))


def shape_of(emit: Emitter, node: Node, leading: int | None = None) -> list[Any]:
    """``node``'s sizes (its ``leading`` first ones): ints, or ``sym_size`` nodes where any of
    its sizes is symbolic."""
    value = p.tensor_value(node)
    count = value.dim() if leading is None else leading
    if not any(isinstance(s, torch.SymInt) for s in value.shape):
        return list(value.shape[:count])
    return [emit(aten.sym_size.int, node, i) for i in range(count)]


def loss_arguments(emit: Emitter, site: Site) -> dict[str, Any]:
    """The op's loss options (``LossSpec``'s fields, the same for every op) for the site."""
    return dict(
        ignore_index=site.ignore_index,
        reduction=site.reduction,
        label_smoothing=_as_float(site.label_smoothing),
        softcap=None if site.softcap is None else _as_float(site.softcap),
        logit_scale=_as_float(_scalar_product(emit, site.scale_factors)),
        shift=0,  # row slices were replayed on hidden
        z_loss=0.0,  # a user's z-loss reads the op's lse instead
    )


def _scalar_product(emit: Emitter, factors: list[tuple[Any, bool]]) -> Any:
    """The product of (scalar, divides) factors: a float, or a node when any is symbolic."""
    constant, nodes = 1.0, []
    for factor, divides in factors:
        if isinstance(factor, Node):
            nodes.append((factor, divides))
        else:
            constant = constant / factor if divides else constant * factor
    result: Any = constant
    for factor, divides in nodes:
        result = emit(operator.truediv if divides else operator.mul, result, factor)
    return result


def _as_float(value: Any) -> Any:
    """Python numbers become floats; SymFloat/SymInt nodes stay nodes."""
    return value if isinstance(value, Node) else float(value)


def cast(emit: Emitter, node: Node | None, dtype: torch.dtype) -> Node | None:
    """``node`` in ``dtype`` (itself if it has it)."""
    if node is None or p.tensor_value(node).dtype == dtype:
        return node
    return emit(aten._to_copy.default, node, dtype=dtype)


def loss_value(emit: Emitter, site: Site, op: Node) -> Node:
    """The op's loss as the graph's loss was: the target's shape for reduction="none", the
    loss's dtype."""
    loss = emit(operator.getitem, op, 0)
    if site.reduction == "none":
        loss = emit(aten.reshape.default, loss, shape_of(emit, site.loss_targets))
    return cast(emit, loss, p.tensor_value(site.loss).dtype)


def loss_target_path(site: Site) -> list[Node]:
    """The views between the loss's target and what the op reads (``site.targets``), the
    loss's end first: erased once the loss is (``labels.view(-1)`` would stay, dead)."""
    path, node = [], site.loss_targets
    while isinstance(node, Node) and node is not site.targets:
        path.append(node)
        node = node.args[0]
    return path


def erase_unused(graph: Graph, nodes: list[Any]) -> None:
    """Erase, in order (users before producers), each of ``nodes`` that nothing but dead code
    uses any more, that dead code first."""
    for node in nodes:
        if not isinstance(node, Node) or node.graph is not graph or safety.live_users(node):
            continue
        for dead in _dead_code_on(node):
            graph.erase_node(dead)
        graph.erase_node(node)


def _dead_code_on(node: Node) -> list[Node]:
    """The dead nodes that use ``node``, directly or through each other, users first."""
    found: list[Node] = []
    for user in node.users:
        for dead in [*_dead_code_on(user), user]:
            if dead not in found:
                found.append(dead)
    return found
