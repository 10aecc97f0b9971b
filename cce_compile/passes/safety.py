"""When a matched site would not compute what the graph computes: in-place writes, grad mode,
constants, and consumers the op cannot reach in time; and which nodes are dead code.

The op runs at one point of the graph (its *anchor*: the loss, or an earlier logsumexp it
serves) and reads ``hidden``, the classifier and the targets there; eager reads them at the head
and at the loss. Between the head and the last consumer nothing may write any of those tensors,
nor the logits (which ``CCE_ESCAPING_LOGITS=rewrite`` keeps for other users), or the rewrite
would read other values than eager did. Inductor's own passes leave regions with mutations
alone the same way.
"""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Iterable
from typing import Any

import torch
from torch.fx import Graph, Node

from . import predicates as p
from .canonical import KEPT_IN_PLACE
from .verdicts import MUTATION, Rejection

# Operators that write their first operand (Dynamo keeps `x += 1`, `x[i] = v` as these).
_INPLACE_OPERATORS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.imatmul,
    operator.iand,
    operator.ior,
    operator.ixor,
    operator.ilshift,
    operator.irshift,
    operator.setitem,
}
# Calls that switch grad mode inside a graph (Dynamo records `with torch.no_grad()` as these).
_GRAD_MODE_SWITCHES = {
    torch._C._set_grad_enabled,
    torch.autograd.grad_mode._enter_inference_mode,
    torch.autograd.grad_mode._exit_inference_mode,
}
# Parts of the names of torch's functions and methods that draw random numbers (dropout,
# rand_like, bernoulli, multinomial, normal, rrelu, gumbel_softmax, fractional_max_pool...).
_RANDOM_NAME_PARTS = (
    "rand",
    "dropout",
    "bernoulli",
    "multinomial",
    "normal",
    "poisson",
    "rrelu",
    "gumbel",
    "fractional",
)
# Trailing-underscore methods that change metadata, not values.
_METADATA_ONLY = {"requires_grad_", "retain_grad", "share_memory_", "record_stream"}


def node_order(graph: Graph) -> dict[Node, int]:
    """Each node's position in the graph."""
    return {node: i for i, node in enumerate(graph.nodes)}


def target_name(node: Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", "")


def _schema_writes(node: Node) -> list[Any]:
    """Arguments an OpOverload's schema marks as written (aten ops in the graph)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.append(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
    return written


def _in_place_name(name: str) -> bool:
    """``mul_``, ``torch._foreach_add_``, ``__setitem__``, ``__iadd__``: names of writes (not
    other dunders, nor metadata-only methods)."""
    if name.startswith("__") and name.endswith("__"):
        return name == "__setitem__" or name.startswith("__i")
    return name.endswith("_") and name not in _METADATA_ONLY


def _inplace_argument(node: Node) -> bool:
    """An ``inplace=True`` argument, given by keyword or by position (``F.relu(x, True)``,
    ``F.dropout(x, p, training, True)``)."""
    if node.kwargs.get("inplace") is True:
        return True
    try:
        parameters = list(inspect.signature(node.target).parameters)
    except (TypeError, ValueError):  # builtins and methods without a Python signature
        return False
    if "inplace" not in parameters:
        return False
    position = parameters.index("inplace")
    return position < len(node.args) and node.args[position] is True


def written_operands(node: Node) -> list[Node]:
    """The nodes whose tensors ``node`` writes in place: the first operand (or each tensor of
    a first list operand: ``_foreach_*_``) of in-place operators, methods and functions
    (``mul_``, ``torch.relu_``, ``x[i] = v``, ``x += y``, ``inplace=True`` by keyword or
    position), ``out=`` tensors, and what an aten schema marks as written."""
    if node.op not in ("call_function", "call_method"):
        return []
    written: list[Any] = []
    first = node.args[0] if node.args else node.kwargs.get("input")
    operator_write = node.op == "call_function" and node.target in _INPLACE_OPERATORS
    if operator_write or _in_place_name(target_name(node)):
        written.append(first)
    if node.op == "call_function" and callable(node.target) and _inplace_argument(node):
        written.append(first)
    written.append(node.kwargs.get("out"))
    if node.op == "call_function":
        written.extend(_schema_writes(node))
    return nodes_in(written)


def storage(node: Any) -> Any:
    """An identity for the memory behind a node's tensor (views share it), or None."""
    value = p.tensor_value(node)
    if value is None:
        return None
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(value.untyped_storage()).cdata
    except (RuntimeError, NotImplementedError):  # e.g. sparse or opaque subclass tensors
        return None


def first_write(
    read: Iterable[Any], start: Node, stop: Node, order: dict[Node, int]
) -> tuple[Node, Node] | None:
    """(writer, node read) for the first node after ``start`` up to ``stop`` that writes the
    memory of a node in ``read`` (non-nodes are skipped); None if there is none."""
    by_storage: dict[Any, Node] = {}
    for node in read:
        if not isinstance(node, Node):
            continue
        key = storage(node)
        if key is not None:
            by_storage.setdefault(key, node)
    first, last = order[start], order[stop]
    for node in list(start.graph.nodes)[first + 1 : last + 1]:
        for target in written_operands(node):
            key = storage(target)
            if key is None:  # an untracked write: assume the worst of any operand we read
                return node, target
            if key in by_storage:
                return node, by_storage[key]
    return None


def write_in_region(
    loss: Node, regions: Iterable[tuple[list[Any], Node, Node]], order: dict[Node, int]
) -> Rejection | None:
    """Why not, if anything writes in place what the op reads while eager reads it: for each
    ``(read, start, stop)`` region, the first write after ``start`` up to ``stop``."""
    for read, start, stop in regions:
        written = first_write(read, start, stop, order)
        if written is not None:
            writer, target = written
            kept = writer.meta.get(KEPT_IN_PLACE)
            why = f" (left in place: {kept})" if kept else ""
            return Rejection(
                loss,
                MUTATION,
                f"{writer.name} ({target_name(writer)}) writes {target.name} in place "
                f"between the head and the loss{why}",
            )
    return None


def grad_mode_changes(start: Node, stop: Node, order: dict[Node, int]) -> bool:
    """Does grad mode switch anywhere between ``start`` and ``stop`` (either order)?"""
    first, last = sorted((order[start], order[stop]))
    return any(
        node.op == "call_function" and node.target in _GRAD_MODE_SWITCHES
        for node in list(start.graph.nodes)[first:last]
    )


def grad_enabled_at(node: Node) -> bool:
    """Is grad mode on where ``node`` runs: the last ``torch.no_grad()`` / ``enable_grad()``
    switch recorded before it in its graph, else the mode the graph was traced in."""
    enabled = torch.is_grad_enabled()
    for other in node.graph.nodes:
        if other is node:
            break
        if other.op == "call_function" and other.target is torch._C._set_grad_enabled:
            enabled = bool(other.args[0])
    return enabled


def inference_mode_at(node: Node) -> bool:
    """Does ``node`` run inside a ``torch.inference_mode()`` region recorded in its graph?"""
    modes: list[bool] = []
    for other in node.graph.nodes:
        if other is node:
            break
        if other.op != "call_function":
            continue
        if other.target is torch.autograd.grad_mode._enter_inference_mode:
            modes.append(bool(other.args[0]) if other.args else True)
        elif other.target is torch.autograd.grad_mode._exit_inference_mode and modes:
            modes.pop()
    return bool(modes and modes[-1])


def nodes_in(value: Any) -> list[Node]:
    """The graph nodes inside an argument (nested tuples, lists and slices)."""
    if isinstance(value, Node):
        return [value]
    if isinstance(value, (tuple, list)):
        return [n for item in value for n in nodes_in(item)]
    if isinstance(value, slice):
        return nodes_in((value.start, value.stop, value.step))
    return []


def ready_after(inputs: Iterable[Any], order: dict[Node, int]) -> int:
    """The position after which every node in ``inputs`` exists."""
    return max((order[n] for n in nodes_in(list(inputs)) if n in order), default=-1)


def requires_grad(node: Any) -> bool:
    value = p.tensor_value(node)
    return bool(value is not None and value.requires_grad)


def bad_constant(name: str, value: Any, *, zero_ok: bool = True) -> str | None:
    """Why a constant option cannot be handed to the op as is, or None (nodes pass: the op
    checks their run-time values)."""
    if isinstance(value, Node) or value is None:
        return None
    if not -math.inf < float(value) < math.inf:
        return f"{name} is {value}"
    if not zero_ok and float(value) == 0.0:
        return f"{name} is 0"
    return None


# What a pure computation returns (a size read is one: ``logits.view(logits.shape)``).
_VALUES = (torch.Tensor, torch.Size, torch.SymInt, torch.SymFloat, torch.SymBool, int, float)


# Calls that cut a tensor into a tuple of views (what a loop over rows or chunks iterates), or
# return a tuple of views of their operands (Categorical.log_prob's broadcast_tensors).
_CUTS = {"split", "chunk", "unbind", "tensor_split", "broadcast_tensors"}


def is_dead(node: Node) -> bool:
    """Dead code: a node whose value only dead code reads (a chain of unused views), and
    which, like all those, is a pure computation."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if not _pure_computation(current):
            return False
        stack.extend(current.users)
    return True


def _pure_computation(node: Node) -> bool:
    """A call that computes a tensor, its sizes or a number, writes nothing, draws no random
    numbers (erasing it would shift every later random draw) and is not impure by FX's rules.
    A call that returns None (a grad-mode switch, a print) is not one."""
    if node.op not in ("call_function", "call_method"):
        return False
    value = p.example_value(node)
    pieces = target_name(node) in _CUTS and isinstance(value, (tuple, list))
    if not isinstance(value, _VALUES) and not pieces:
        return False
    if any(part in target_name(node).lower() for part in _RANDOM_NAME_PARTS):
        return False
    return not node.is_impure() and not written_operands(node)


def dead_nodes(graph: Graph) -> set[Node]:
    """Every node of ``graph`` that ``is_dead``, in one pass from the output back."""
    dead: set[Node] = set()
    for node in reversed(graph.nodes):
        if all(user in dead for user in node.users) and _pure_computation(node):
            dead.add(node)
    return dead


def live_users(node: Node) -> list[Node]:
    """The users of ``node`` that are not dead code: dead code decides nothing."""
    return [user for user in node.users if not is_dead(user)]
