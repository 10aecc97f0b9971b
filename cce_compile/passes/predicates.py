"""Small predicates over the nodes of a Dynamo (torch-level, pre-autograd) FX graph.

What the forms look like is catalogued in docs/graph_forms.md: tensor methods are
``call_method`` nodes with string targets, functions and operators ``call_function`` nodes,
parameters are placeholders, and every value node carries ``meta["example_value"]``.
"""

from __future__ import annotations

import inspect
import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

_LINEAR = {torch._C._nn.linear, F.linear}
_MATMUL_FUNCTIONS = {operator.matmul, torch.matmul, torch.mm}
_TANH = {torch.tanh}
_LOGSUMEXP = {torch.logsumexp}
_LOG_SOFTMAX = {F.log_softmax, torch.log_softmax}
# Same values, same rows (gradient flow aside: the pass reads it from requires_grad).
_PASSTHROUGH_METHODS = {"contiguous", "clone", "detach"}
_VIEW_METHODS = {"view", "reshape", "flatten"}
_VIEW_FUNCTIONS = {torch.reshape, torch.flatten}


def is_call(node: Any, targets) -> bool:
    """A call_function node whose target is in ``targets``."""
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def is_method(node: Any, names) -> bool:
    """A call_method node named one of ``names``."""
    return isinstance(node, Node) and node.op == "call_method" and node.target in names


def example_value(node: Any) -> Any:
    """The node's example value (FakeTensor, SymInt, SymFloat), or None."""
    if not isinstance(node, Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def tensor_value(node: Any) -> torch.Tensor | None:
    """The node's example value if it is a tensor."""
    value = example_value(node)
    return value if isinstance(value, torch.Tensor) else None


def functorch_wrapped(node: Any) -> bool:
    """Is the node's example value a functorch wrapper (traced inside torch.func.grad / vmap)?"""
    value = tensor_value(node)
    return value is not None and torch._C._functorch.is_functorch_wrapped_tensor(value)


def example_args(value: Any) -> Any:
    """An emitted node's arguments with nodes replaced by their example values (inside lists,
    tuples and slices: a row slice can have symbolic bounds)."""
    if isinstance(value, Node):
        return example_value(value)
    if isinstance(value, (list, tuple)):
        return type(value)(example_args(x) for x in value)
    if isinstance(value, dict):
        return {key: example_args(x) for key, x in value.items()}
    if isinstance(value, slice):
        return slice(*(example_args(x) for x in (value.start, value.stop, value.step)))
    return value


SOURCE_META_KEYS = ("stack_trace", "nn_module_stack", "source_fn_stack")


def copy_source_meta(node: Node, anchor: Node) -> None:
    """Give an emitted node the source location of the node it is emitted for."""
    for key in SOURCE_META_KEYS:
        if key in anchor.meta:
            node.meta[key] = anchor.meta[key]


def bind(node: Node, fn) -> dict[str, Any]:
    """The node's args and kwargs bound to ``fn``'s signature, defaults filled in."""
    bound = inspect.signature(fn).bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def is_dtensor(value: Any) -> bool:
    """A distributed tensor (DTensor), which the op does not take yet."""
    return type(value).__name__ == "DTensor"


def is_linear(node: Any) -> bool:
    """``F.linear(x, W[, b])`` (also ``nn.Linear`` inlined by Dynamo)."""
    return is_call(node, _LINEAR)


def linear_operands(node: Node) -> tuple[Node, Node, Any]:
    """(input, weight, bias) of a linear node, positional or keyword."""
    args = bind(node, lambda input, weight, bias=None: None)
    return args["input"], args["weight"], args["bias"]


def is_matmul(node: Any) -> bool:
    """``x @ y``, ``torch.matmul``, ``torch.mm`` or ``x.matmul(y)``."""
    return is_call(node, _MATMUL_FUNCTIONS) or is_method(node, {"matmul", "mm"})


def transposed_matrix(node: Any) -> Node | None:
    """W for ``W.T``, ``W.t()``, ``W.mT``, ``W.transpose(0, 1)`` or ``W.permute(1, 0)``; W 2-D."""
    if not isinstance(node, Node):
        return None
    source = None
    if node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"):
        source = node.args[0]
    elif is_method(node, {"t"}) or is_call(node, {torch.t}):
        source = node.args[0]
    elif is_method(node, {"transpose"}) or is_call(node, {torch.transpose}):
        dims = tuple(node.args[1:3])
        if sorted(d % 2 for d in dims if isinstance(d, int)) == [0, 1]:
            source = node.args[0]
    elif is_method(node, {"permute"}):
        dims = node.args[1] if len(node.args) == 2 else node.args[1:]
        if tuple(d % 2 for d in dims) == (1, 0):
            source = node.args[0]
    value = tensor_value(source)
    return source if value is not None and value.dim() == 2 else None


def is_cross_entropy(node: Any) -> bool:
    """``F.cross_entropy`` (also ``nn.CrossEntropyLoss`` and 2.13's linear_cross_entropy
    reference path, which Dynamo inlines to it)."""
    return is_call(node, {F.cross_entropy})


def is_nll_loss(node: Any) -> bool:
    """``F.nll_loss``."""
    return is_call(node, {F.nll_loss})


def log_softmax_input(node: Any) -> Node | None:
    """x for ``log_softmax(x, dim=<last>)`` in float32 or x's dtype, else None."""
    if is_call(node, _LOG_SOFTMAX):
        args = bind(node, lambda input, dim=None, _stacklevel=3, dtype=None: None)
    elif is_method(node, {"log_softmax"}):
        args = bind(node, lambda self, dim, dtype=None: None)
        args["input"] = args.pop("self")
    else:
        return None
    value = tensor_value(args["input"])
    if value is None or not _is_last_dim(args["dim"], value.dim()):
        return None
    if args["dtype"] not in (None, torch.float32, value.dtype):
        return None
    return args["input"]


def logsumexp_input(node: Any) -> Node | None:
    """x for ``torch.logsumexp(x, -1)`` / ``x.logsumexp(-1)`` over the last dim, no keepdim."""
    if is_call(node, _LOGSUMEXP):
        args = bind(node, lambda input, dim, keepdim=False, out=None: None)
    elif is_method(node, {"logsumexp"}):
        args = bind(node, lambda self, dim, keepdim=False: None)
        args["input"] = args.pop("self")
    else:
        return None
    value = tensor_value(args["input"])
    dim = args["dim"]
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    if value is None or args["keepdim"] or args.get("out") is not None:
        return None
    return args["input"] if _is_last_dim(dim, value.dim()) else None


def _is_last_dim(dim: Any, ndim: int) -> bool:
    return isinstance(dim, int) and dim % max(ndim, 1) == ndim - 1


def is_tanh(node: Any) -> bool:
    """``torch.tanh(x)`` or ``x.tanh()``."""
    return is_call(node, _TANH) or is_method(node, {"tanh"})


def scalar(arg: Any) -> Any:
    """A Python number, or a node holding a SymInt/SymFloat; None for anything else."""
    if isinstance(arg, bool):
        return None
    if isinstance(arg, (int, float)):
        return arg
    if isinstance(example_value(arg), (torch.SymInt, torch.SymFloat)):
        return arg
    return None


def same_scalar(a: Any, b: Any) -> bool:
    """Two scalars that are provably the same value (equal constants or one node)."""
    if isinstance(a, Node) or isinstance(b, Node):
        if a is b:
            return True
        # Two `.item()` reads of one tensorified float (Dynamo's form for config floats).
        return is_method(a, {"item"}) and is_method(b, {"item"}) and a.args[0] is b.args[0]
    return a == b


def cast_dtype(node: Any) -> torch.dtype | None:
    """The dtype of a pure cast (``.float()``, ``.to(dtype)``, ``.type(dtype)``), else None."""
    if is_method(node, {"float"}):
        return torch.float32
    if is_method(node, {"half"}):
        return torch.float16
    if is_method(node, {"bfloat16"}):
        return torch.bfloat16
    if is_method(node, {"to", "type"}):
        value = tensor_value(node)
        extra = [a for a in (*node.args[1:], *node.kwargs.values()) if not isinstance(a, Node)]
        if value is not None and any(isinstance(a, torch.dtype) for a in extra):
            return value.dtype
    return None


def is_passthrough(node: Any) -> bool:
    """``contiguous()`` / ``clone()`` / ``detach()``: same values, same rows."""
    return is_method(node, _PASSTHROUGH_METHODS)


def is_no_op_move(node: Any) -> bool:
    """``x.to(...)`` that keeps x's dtype and device (Hugging Face's ``labels.to(device)``)."""
    if not is_method(node, {"to"}):
        return False
    before, after = tensor_value(node.args[0]), tensor_value(node)
    return (
        before is not None
        and after is not None
        and (before.dtype, before.device) == (after.dtype, after.device)
    )


def element_source(node: Any) -> Any:
    """The tensor whose elements, in order, ``node`` holds: through views, reshapes, flattens,
    contiguous() and no-op moves (the op reshapes targets itself)."""
    while isinstance(node, Node) and (
        is_method(node, _VIEW_METHODS | {"contiguous"})
        or is_call(node, _VIEW_FUNCTIONS)
        or is_no_op_move(node)
    ):
        node = node.args[0]
    return node


def is_row_view(node: Any) -> bool:
    """view / reshape / flatten that only regroups the leading (row) dimensions."""
    if not (is_method(node, _VIEW_METHODS) or is_call(node, _VIEW_FUNCTIONS)):
        return False
    before, after = tensor_value(node.args[0]), tensor_value(node)
    if before is None or after is None or before.dim() == 0 or after.dim() == 0:
        return False
    return _same_size(before.shape[-1], after.shape[-1])


def _same_size(a: Any, b: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def size_hint(size: Any) -> int | None:
    """An int size, or a SymInt's example value without adding a guard (None if unbacked)."""
    if isinstance(size, torch.SymInt):
        hint = getattr(size.node, "hint", None)
        return None if hint is None else int(hint)
    return int(size)


def size_range(size: Any) -> tuple[int, bool, int | None]:
    """A size's example value (1 if unbacked), whether it is symbolic, and the largest value it
    may take (``mark_dynamic``'s max; None where unbounded), without adding a guard."""
    if not isinstance(size, torch.SymInt):
        return int(size), False, int(size)
    import sympy

    upper = size.node.shape_env.bound_sympy(size.node.expr).upper
    return size_hint(size) or 1, True, int(upper) if isinstance(upper, sympy.Integer) else None


def same_size(a: Any, b: Any) -> bool:
    """Sizes that are provably equal (ints or SymInts), without adding guards."""
    return _same_size(a, b)


def same_shape(a: Any, b: Any) -> bool:
    """Two tensor nodes of provably equal shapes, without adding guards."""
    x, y = tensor_value(a), tensor_value(b)
    if x is None or y is None or x.dim() != y.dim():
        return False
    return all(_same_size(m, n) for m, n in zip(x.shape, y.shape))


def guarded_same_size(a: Any, b: Any) -> bool:
    """Sizes provably equal, or equal in this compile's example (backed SymInts), with a
    guard so that the graph recompiles where they differ: ids beside the logits are two
    inputs whose sizes Dynamo makes separate symbols when it recompiles for a new shape."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return _same_size(a, b) or bool(guard_or_false(a == b))


def row_index(node: Any) -> Any:
    """The index of ``x[index]`` when it selects rows only (the last dim whole), else None."""
    if not is_call(node, {operator.getitem}):
        return None
    source = tensor_value(node.args[0])
    if source is None or source.dim() == 0:
        return None
    index = node.args[1]
    parts = index if isinstance(index, tuple) else (index,)
    if any(not isinstance(p, (slice, int)) and p is not Ellipsis for p in parts):
        return None  # tensors, None: not plain row selection
    if Ellipsis in parts:
        after = parts[parts.index(Ellipsis) + 1 :]
        touches_last = bool(after)
        last = after[-1] if after else None
    else:
        touches_last = len(parts) >= source.dim()
        last = parts[source.dim() - 1] if touches_last else None
    if touches_last and last != slice(None, None, None):
        return None
    return index


def is_scale(node: Any) -> tuple[Node, Any, bool] | None:
    """(tensor, scalar, divides) for ``x * c``, ``c * x`` or ``x / c``."""
    if is_call(node, {operator.mul, torch.mul}) or is_method(node, {"mul"}):
        a, b = node.args[0], node.args[1]
        if tensor_value(a) is not None and scalar(b) is not None:
            return a, b, False
        if tensor_value(b) is not None and scalar(a) is not None:
            return b, a, False
    if is_call(node, {operator.truediv, torch.div}) or is_method(node, {"div"}):
        if node.kwargs.get("rounding_mode") is not None:
            return None
        a, b = node.args[0], node.args[1]
        if tensor_value(a) is not None and scalar(b) is not None:
            return a, b, True
    return None


def is_tensor_scale(node: Any) -> bool:
    """A product or quotient of two tensors (e.g. logits times a learned temperature)."""
    if not (
        is_call(node, {operator.mul, torch.mul, operator.truediv, torch.div})
        or is_method(node, {"mul", "div"})
    ):
        return False
    return all(tensor_value(a) is not None for a in node.args[:2])


def softcap(node: Any) -> tuple[Node, Any, list[Node]] | None:
    """(x, c, [tanh, x/c]) for ``c * tanh(x / c)`` in either operand order."""
    scaled = is_scale(node)
    if scaled is None or scaled[2]:
        return None
    tanh, cap, _ = scaled
    if not is_tanh(tanh):
        return None
    inner = is_scale(tanh.args[0])
    if inner is None or not inner[2] or not same_scalar(inner[1], cap):
        return None
    return inner[0], cap, [tanh, tanh.args[0]]


def symint_holders(graph) -> dict[str, Node]:
    """Nodes whose example value is a SymInt, by the symbol expression they hold (Dynamo keeps
    every symbolic input size as such a placeholder)."""
    holders: dict[str, Node] = {}
    for node in graph.nodes:
        value = example_value(node)
        if isinstance(value, torch.SymInt):
            holders.setdefault(str(value.node.expr), node)
    return holders


def size_source(size: Any, holders: dict[str, Node], sources: list[Node]) -> Any:
    """Where a size can be read without the tensor that has it: the int itself, a node holding
    the SymInt, ``(source, i)`` for dim i of a source tensor, ``(source, None)`` for the product
    of all but its last dim (a flattening view of the logits), ``(source, "numel")`` for its
    number of elements (logits flattened to the rows of the targets); None if nowhere."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    if size.node.maybe_as_int() is not None:  # a SymInt specialised to a constant
        return size.node.maybe_as_int()
    if str(size.node.expr) in holders:
        return holders[str(size.node.expr)]
    for source in sources:
        value = tensor_value(source)
        if value is None:
            continue
        for i, candidate in enumerate(value.shape):
            if same_size(candidate, size):
                return source, i
        if value.dim() > 1 and same_size(math.prod(value.shape[:-1]), size):
            return source, None
        if value.dim() > 1 and same_size(math.prod(value.shape), size):
            return source, "numel"
    return None


def class_dim_moved_last(node: Any) -> Node | None:
    """x for ``x.transpose(1, 2)`` / ``x.permute(0, 2, 1)`` of a 3-D x: the (B, V, T) input
    that cross_entropy reads with classes in dim 1, as the (B, T, V) rows of x."""
    if not isinstance(node, Node):
        return None
    source = node.args[0] if node.args else None
    value = tensor_value(source)
    if value is None or value.dim() != 3:
        return None
    if is_method(node, {"transpose"}) or is_call(node, {torch.transpose}):
        dims = tuple(d % 3 for d in node.args[1:3] if isinstance(d, int))
        return source if sorted(dims) == [1, 2] else None
    if is_method(node, {"permute"}) or is_call(node, {torch.permute}):
        dims = node.args[1] if len(node.args) == 2 else node.args[1:]
        return source if tuple(d % 3 for d in dims) == (0, 2, 1) else None
    return None


def bias_add(node: Any) -> tuple[Node, Node] | None:
    """(x, b) for ``x + b`` / ``b + x`` with b a 1-D tensor as long as x's last dim."""
    if not (is_call(node, {operator.add, torch.add}) or is_method(node, {"add"})):
        return None
    if len(node.args) != 2 or node.kwargs:
        return None
    for x, b in (node.args, reversed(node.args)):
        x_value, b_value = tensor_value(x), tensor_value(b)
        if (
            x_value is not None
            and b_value is not None
            and b_value.dim() == 1
            and x_value.dim() >= 1
            and same_size(b_value.shape[0], x_value.shape[-1])
            and b_value.dtype == x_value.dtype
        ):
            return x, b
    return None
