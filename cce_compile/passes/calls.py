"""The spellings of one torch op in a Dynamo graph, read by argument name: what the RL rules
(``rules.py``, ``piecewise.py``) match.

Dynamo keeps a call as the user wrote it: ``torch.logsumexp(z, -1)`` is a ``call_function``,
``z.logsumexp(dim=-1)`` a ``call_method`` whose first argument is ``z``. A :class:`Call` names
the functions and methods of one op and its leading parameters, and ``Call.args`` reads a node
of any spelling as ``{"input": z, "dim": -1}``.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from . import predicates as p

# Keyword names that mean the op's tensor operand, in some spelling.
_INPUT_NAMES = {"input", "self", "tensor"}
_ALIASES = {"split_size_or_sections": "split_size"}


@dataclasses.dataclass(frozen=True)
class Call:
    """One op: its function and method spellings, the names of its positional parameters
    (the tensor first, as ``input``), and the keywords a match may carry besides those."""

    functions: frozenset
    methods: frozenset
    params: tuple[str, ...]
    keywords: frozenset = frozenset()

    def args(self, node: Any) -> dict[str, Any] | None:
        """The node's arguments by name if it is a call of this op (defaults left out), else
        None; also None for arguments the rules do not read (an ``out=``, an ``alpha``)."""
        if not (p.is_call(node, self.functions) or p.is_method(node, self.methods)):
            return None
        if len(node.args) > len(self.params):
            return None
        named = dict(zip(self.params, node.args))
        for key, value in node.kwargs.items():
            key = "input" if key in _INPUT_NAMES else _ALIASES.get(key, key)
            if key not in self.params and key not in self.keywords:
                return None
            named[key] = value
        return named if "input" in named else None


def call(functions=(), methods=(), params=("input",), keywords=()) -> Call:
    return Call(frozenset(functions), frozenset(methods), tuple(params), frozenset(keywords))


LOG_SOFTMAX = call(
    {F.log_softmax, torch.log_softmax}, {"log_softmax"}, ("input", "dim"), {"dtype", "_stacklevel"}
)
SOFTMAX = call({F.softmax, torch.softmax}, {"softmax"}, ("input", "dim"), {"dtype", "_stacklevel"})
LOGSUMEXP = call({torch.logsumexp}, {"logsumexp"}, ("input", "dim", "keepdim"))
SUM = call({torch.sum}, {"sum"}, ("input", "dim", "keepdim"), {"dtype"})
GATHER = call({torch.gather}, {"gather"}, ("input", "dim", "index"))
EXP = call({torch.exp}, {"exp"})
LOG = call({torch.log}, {"log"})
NEG = call({operator.neg, torch.neg}, {"neg"})
MUL = call({operator.mul, torch.mul}, {"mul"}, ("input", "other"))
SUB = call({operator.sub, torch.sub}, {"sub"}, ("input", "other"))
ADD = call({operator.add, torch.add}, {"add"}, ("input", "other"))
DIV = call({operator.truediv, torch.div}, {"div"}, ("input", "other"))
SQUEEZE = call({torch.squeeze}, {"squeeze"}, ("input", "dim"))
UNSQUEEZE = call({torch.unsqueeze}, {"unsqueeze"}, ("input", "dim"))
SELECT = call({torch.select}, {"select"}, ("input", "dim", "index"))
UNBIND = call({torch.unbind}, {"unbind"}, ("input", "dim"))
SPLIT = call({torch.split}, {"split"}, ("input", "split_size", "dim"))
CHUNK = call({torch.chunk}, {"chunk"}, ("input", "chunks", "dim"))
STACK = call({torch.stack}, (), ("input", "dim"))  # "input": the list of tensors
CAT = call({torch.cat, torch.concat, torch.concatenate}, (), ("input", "dim"))
# In-place scaling of a tensor by a factor: ``z.div_(T)``, ``z /= T`` (Dynamo's itruediv).
DIV_ = call({operator.itruediv}, {"div_"}, ("input", "other"))
SIZE = call({torch.ops.aten.sym_size.int}, {"size"}, ("input", "dim"))
MUL_ = call({operator.imul}, {"mul_"}, ("input", "other"))


def last_dim(value: Any, node: Any) -> bool:
    """Is ``value`` (a dim argument, or a one-element list of one) the last dim of ``node``?"""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        value = value[0]
    tensor = p.tensor_value(node)
    if tensor is None or not isinstance(value, int) or isinstance(value, bool):
        return False
    ndim = max(tensor.dim(), 1)
    return value % ndim == ndim - 1


def over_last_dim(spelling: Call, node: Any, **expected: Any) -> Node | None:
    """The tensor a call of ``spelling`` reduces or normalises over its last dim (``dim``
    given and last), with the other named arguments as ``expected`` (their defaults when
    left out: ``keepdim=False``, no ``dtype``); None otherwise."""
    named = spelling.args(node)
    if named is None or not last_dim(named.get("dim"), named["input"]):
        return None
    defaults = {"keepdim": False, "dtype": None, "_stacklevel": 3}
    for key in (set(named) | set(expected)) - {"input", "dim"}:
        default = defaults.get(key)
        if named.get(key, default) != expected.get(key, default):
            return None
    return named["input"]


def single(value: Any) -> Any:
    """A one-element dim list as its element."""
    return value[0] if isinstance(value, (tuple, list)) and len(value) == 1 else value
