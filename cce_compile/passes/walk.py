"""From a loss node back to its head: the loss's options, then the walk through the row-wise ops
between them. Shared by every kind of head; the tensor-parallel matcher extends the walk with
its DTensor steps (``extra_step``).

The loss is ``F.cross_entropy`` (also over ``(B, V, T)`` logits moved from ``(B, T, V)``) or
``F.nll_loss`` over a last-dim ``log_softmax``. The walk goes back from the loss input through
the ops that keep each row's logits a row: casts up to float32, view/reshape/flatten of the
leading dims, contiguous, row slices (Hugging Face's ``logits[..., :-1, :]``), scaling by a
constant, the softcap ``c * tanh(x / c)`` and a bias added to a matmul head, until it reaches
the head (``F.linear``, ``x @ W.T`` ...). Anything else is a :class:`Rejection` with its reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from . import predicates as p
from . import safety
from .verdicts import ESCAPES, GRAPH_BREAK, UNSUPPORTED_OP, UNSUPPORTED_OPTION, Rejection


@dataclasses.dataclass
class LossOptions:
    """The loss's input, target and options, normalised from any argument layout."""

    logits: Node  # where the walk starts: the loss input, under any class-dim move / log_softmax
    target: Node
    weight: Node | None
    ignore_index: int
    reduction: str
    label_smoothing: Any  # float or SymFloat node (0.0 for nll_loss)
    log_softmax: Node | None  # the nll_loss form's log_softmax
    views: list[Node]  # between the loss and its log_softmax / logits (loss order)

    @property
    def loss_side(self) -> list[Node]:
        """The nodes between the loss and the logits, which the loss alone uses."""
        return [n for n in (self.log_softmax, *self.views) if n is not None]


def loss_options(loss: Node) -> LossOptions | Rejection:
    """The options of a ``cross_entropy`` / ``nll_loss`` node, or why the op cannot take them."""
    if p.is_cross_entropy(loss):
        args = p.bind(loss, F.cross_entropy)
        log_softmax, (logits, views) = None, _class_dim_moved_back(args["input"])
    else:
        args = p.bind(loss, F.nll_loss)
        args["label_smoothing"] = 0.0
        log_softmax, views = _regrouped_rows(args["input"])
        logits = p.log_softmax_input(log_softmax)
        if logits is None:
            return Rejection(loss, UNSUPPORTED_OP, "nll_loss input is not a last-dim log_softmax")
    options = LossOptions(
        logits=logits,
        target=args["target"],
        weight=args["weight"],
        ignore_index=args["ignore_index"],
        reduction=args["reduction"],
        label_smoothing=args["label_smoothing"],
        log_softmax=log_softmax,
        views=views,
    )
    for node in options.loss_side:
        if len(safety.live_users(node)) != 1:
            return Rejection(loss, ESCAPES, f"{node.name} has other users")
    why = _unsupported_option(args, options, moved=p.is_cross_entropy(loss) and bool(views))
    return options if why is None else Rejection(loss, UNSUPPORTED_OPTION, why)


def _class_dim_moved_back(node: Node) -> tuple[Node, list[Node]]:
    """(the logits, [the move]) for a (B, V, T) input moved from (B, T, V) logits."""
    source = p.class_dim_moved_last(node)
    return (node, []) if source is None else (source, [node])


def _regrouped_rows(node: Node) -> tuple[Node, list[Node]]:
    """(the log_softmax, the row views after it) for ``log_softmax(x).view(-1, V)``."""
    views: list[Node] = []
    while p.is_row_view(node) or p.is_passthrough(node):
        views.append(node)
        node = node.args[0]
    return node, views


def _unsupported_option(args: dict[str, Any], options: LossOptions, moved: bool) -> str | None:
    """Why the op cannot take the loss's options as the graph gives them, or None."""
    if args["size_average"] is not None or args["reduce"] is not None:
        return "legacy size_average/reduce arguments"
    if isinstance(options.ignore_index, Node) or not isinstance(options.ignore_index, int):
        return "ignore_index is not a constant int"
    if options.reduction not in ("mean", "sum", "none"):
        return f"reduction {options.reduction!r}"
    smoothing = options.label_smoothing
    if p.scalar(smoothing) is None:
        return "label_smoothing is not a scalar"
    if not isinstance(smoothing, Node) and not 0.0 <= smoothing <= 1.0:
        return f"label_smoothing {smoothing} outside [0, 1]"
    logits, target = p.tensor_value(options.logits), p.tensor_value(options.target)
    if logits is None or target is None:
        return "input or target without example value"
    if target.dtype.is_floating_point:
        return "class-probability targets"
    if p.tensor_value(args["input"]).dim() > 2 and not moved:
        return "class dimension is dim 1 of a >2-D input"
    return None


@dataclasses.dataclass
class Walk:
    """What lies between the head and the loss input. Lists are in walk order (from the loss
    back) while walking, in forward order once ``walk_to_head`` returns."""

    head: Node | None = None
    chain: list[Node] = dataclasses.field(default_factory=list)  # head output .. loss input
    row_indices: list[Any] = dataclasses.field(default_factory=list)  # to replay on hidden
    scale_factors: list[tuple[Any, bool]] = dataclasses.field(default_factory=list)
    softcap: Any = None  # None, float or SymFloat node
    bias: Node | None = None  # ``h @ W.T + b``: the bias added to a matmul head
    z_level: list[Node] = dataclasses.field(default_factory=list)  # nodes whose value is z

    def note_z_level(self, node: Node) -> None:
        """Is ``node``'s value z at the loss rows? Not before a scale, softcap or bias (it is
        not z there), nor before a row slice (rows the op's lse does not cover)."""
        transformed = self.scale_factors or self.softcap is not None or self.bias is not None
        if not transformed and not self.row_indices:
            self.z_level.append(node)


# A step through one node of the chain: the node to go on from, a Rejection, or None when
# the step does not apply to this node.
Step = Callable[[Node, Node, Walk], "Node | Rejection | None"]


def walk_to_head(loss: Node, start: Node, extra_step: Step | None = None) -> Walk | Rejection:
    """Follow the chain from the loss input ``start`` back to the head. ``extra_step`` is tried
    on each node before the shared steps (the tensor-parallel matcher's DTensor steps)."""
    steps = [extra_step, *_STEPS] if extra_step is not None else _STEPS
    walk = Walk()
    node = start
    while not (p.is_linear(node) or p.is_matmul(node)):
        walk.note_z_level(node)
        walk.chain.append(node)
        node = _take_step(loss, node, walk, steps)
        if isinstance(node, Rejection):
            return node
    walk.note_z_level(node)
    walk.head = node
    for reversed_list in (walk.chain, walk.row_indices, walk.scale_factors):
        reversed_list.reverse()
    return walk


def _take_step(loss: Node, node: Any, walk: Walk, steps: list[Step]) -> Any:
    """The node the first step that applies goes on from, or why none applies."""
    for step in steps:
        moved = step(loss, node, walk)
        if moved is not None:
            return moved
    return _not_a_step(loss, node)


def _bias_of_matmul(loss: Node, node: Node, walk: Walk) -> Node | None:
    """``h @ W.T + b``: the head's own output plus a (V,) bias, nothing between."""
    added = p.bias_add(node)
    if added is None or not p.is_matmul(added[0]) or walk.bias is not None:
        return None
    node, walk.bias = added
    return node


def _cast(loss: Node, node: Node, walk: Walk) -> Node | Rejection | None:
    dtype = p.cast_dtype(node)
    if dtype is None:
        return None
    if dtype != torch.float32:
        return Rejection(loss, UNSUPPORTED_OP, f"{node.name} casts the logits to {dtype}")
    return node.args[0]


def _passthrough(loss: Node, node: Node, walk: Walk) -> Node | None:
    return node.args[0] if p.is_passthrough(node) else None


def _row_view(loss: Node, node: Node, walk: Walk) -> Node | Rejection | None:
    if not p.is_row_view(node):
        return None
    if walk.row_indices:  # forward order: a reshape, then a row slice of its rows
        return Rejection(loss, UNSUPPORTED_OP, f"{node.name}: rows sliced after a reshape")
    return node.args[0]


def _row_index(loss: Node, node: Node, walk: Walk) -> Node | None:
    index = p.row_index(node)
    if index is None:
        return None
    walk.row_indices.append(index)
    return node.args[0]


def _softcap(loss: Node, node: Node, walk: Walk) -> Node | Rejection | None:
    capped = p.softcap(node)
    if capped is None:
        return None
    if walk.softcap is not None:
        return Rejection(loss, UNSUPPORTED_OP, "two softcaps")
    inner, walk.softcap, tanh_nodes = capped
    bad = safety.bad_constant("the softcap", walk.softcap, zero_ok=False)
    if bad is not None:  # c * tanh(x / c) with c = 0 or inf is no softcap the op has
        return Rejection(loss, UNSUPPORTED_OPTION, bad)
    if walk.scale_factors:  # a temperature after the softcap (Gemma in RL): s c tanh(y / c)
        after = _constant_product(walk.scale_factors)
        if after is None or isinstance(walk.softcap, Node):
            return Rejection(
                loss, UNSUPPORTED_OP, "logits scaled after the softcap by a symbolic factor"
            )
        # = c' tanh(s y / c') with c' = s c: the cap takes the factor, and the factor stays
        # among the scales, which multiply y as logit_scale.
        bad = safety.bad_constant("the factor after the softcap", after, zero_ok=False)
        if bad is not None:
            return Rejection(loss, UNSUPPORTED_OPTION, f"logits scaled by a constant: {bad}")
        walk.softcap = walk.softcap * after
    walk.chain.extend(tanh_nodes)
    return inner


def _constant_product(factors: list[tuple[Any, bool]]) -> float | None:
    """The product of (factor, divides) constants; None if one is symbolic."""
    product = 1.0
    for factor, divides in factors:
        if isinstance(factor, Node) or p.scalar(factor) is None:
            return None
        product = product / float(factor) if divides else product * float(factor)
    return product


def _scale(loss: Node, node: Node, walk: Walk) -> Node | Rejection | None:
    scaled = p.is_scale(node)
    if scaled is None:
        return None
    tensor, factor, divides = scaled
    bad = safety.bad_constant(f"{node.name}'s factor", factor, zero_ok=not divides)
    if bad is not None:
        return Rejection(loss, UNSUPPORTED_OPTION, f"logits scaled by a constant: {bad}")
    walk.scale_factors.append((factor, divides))
    return tensor


_STEPS: list[Step] = [
    _bias_of_matmul,
    _cast,
    _passthrough,
    _row_view,
    _row_index,
    _softcap,
    _scale,
]


def _not_a_step(loss: Node, node: Any) -> Rejection:
    """Why the walk stops at ``node`` before reaching a head."""
    if isinstance(node, Node) and node.op == "placeholder":
        return Rejection(
            loss,
            GRAPH_BREAK,
            f"logits come from graph input {node.name} "
            "(a graph break between the head and the loss?)",
        )
    if p.is_tensor_scale(node):
        return Rejection(
            loss,
            UNSUPPORTED_OP,
            f"{node.name}: logits scaled by a tensor (the op takes a constant logit_scale; "
            "multiply the hidden states or the classifier by the tensor instead)",
        )
    what = node.target if isinstance(node, Node) else type(node).__name__
    return Rejection(loss, UNSUPPORTED_OP, f"{getattr(node, 'name', node)}: {what}")


def head_operands(head: Node) -> tuple[Node, Node, bool, Any, list[Node]] | None:
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


def unsupported_head_dtype(loss: Node, head: Node) -> Rejection | None:
    """The op computes in float32, bfloat16 or float16 (a float64 head is left alone)."""
    dtype = p.tensor_value(head).dtype
    if dtype in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return Rejection(loss, UNSUPPORTED_OPTION, f"head computes in {dtype} (the op: float32)")


def site_fields(
    loss: Node, options: LossOptions, walk: Walk, hidden: Node, classifier: Node, bias: Any
) -> dict[str, Any]:
    """The fields every kind of ``Site`` has, from the loss's options, the walk and the head's
    operands as the op takes them."""
    return dict(
        loss=loss,
        head=walk.head,
        hidden=hidden,
        classifier=classifier,
        bias=bias,
        chain=walk.chain,
        loss_views=options.views,
        row_indices=walk.row_indices,
        targets=p.element_source(options.target),
        loss_targets=options.target,
        class_weights=options.weight,
        ignore_index=options.ignore_index,
        reduction=options.reduction,
        label_smoothing=options.label_smoothing,
        softcap=walk.softcap,
        scale_factors=walk.scale_factors,
        compute_dtype=p.tensor_value(walk.head).dtype,
    )
