"""One rule for every per-row loop and every chunked pass over the logits: the same row-wise
function applied to pieces that cover a tensor, then joined, is that function of the whole
tensor::

    torch.stack([f(x[0]), f(x[1]), ..., f(x[n - 1])])     pieces: x[i], x.select(0, i), x.unbind()
    torch.cat([f(c) for c in x.split(k)])                 pieces: x.split(k), x.chunk(n)
        -> f(x)

TRL writes its log-probs as a loop over rows (``torch.stack([torch.logsumexp(row, -1) for row
in logits])``; ``zip(logits, index)`` in its 2-byte branch: f reads two tensors cut alike) and
its entropy in 128-row chunks, verl and OpenRLHF likewise. Once joined, ``rules.py`` sees the
form it knows on the whole tensor.

``f`` is a small graph of row-wise ops (``_ROW_WISE``): elementwise ops, casts, and ops over the
last dim (``log_softmax``, ``logsumexp``, ``sum``, ``gather`` ...), with Python numbers as the only
other operands. Every piece's graph must be the same as the first one's, each reading the
pieces of the same tensors at its own position; the pieces must cover each tensor in order
(n rows of an n-row tensor; every chunk of a split). A dim is kept as a negative index, which
names the same axis on a piece and on the whole.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

from torch.fx import Node

from . import calls as c
from . import canonical
from . import predicates as p
from .emit import Emitter
from .journal import Journal

# Ops that act on each row alone: elementwise, or over the last dims (their ``dim``).
_ELEMENTWISE = (c.EXP, c.LOG, c.NEG, c.MUL, c.SUB, c.ADD, c.DIV)
_OVER_DIMS = (c.LOG_SOFTMAX, c.SOFTMAX, c.LOGSUMEXP, c.SUM, c.GATHER, c.SQUEEZE, c.UNSQUEEZE)
_CANONICAL = {canonical.TOKEN_LOG_PROBS, canonical.SOFTMAX_ENTROPY}
_MAX_CONE = 48  # nodes per piece's graph: a loop body, not a model


@dataclasses.dataclass(frozen=True)
class _Piece:
    source: Node  # the tensor cut
    index: int  # the piece's position
    kind: str  # "row": dim 0 dropped (x[i]); "chunk": dim 0 kept (x.split(k)[i])
    cut: Node | None  # the split / chunk / unbind node, if any


def piece_of(node: Any) -> _Piece | None:
    """The piece ``node`` is: ``x[i]``, ``x.select(0, i)``, ``x.unbind()[i]``,
    ``x.split(k)[i]``, ``x.chunk(n)[i]``; else None."""
    named = c.SELECT.args(node)
    if named is not None and named.get("dim") == 0 and _is_int(named.get("index")):
        return _Piece(named["input"], named["index"], "row", None)
    if not p.is_call(node, {operator.getitem}) or not _is_int(node.args[1]):
        return None
    source, index = node.args
    if p.tensor_value(source) is not None:
        return _Piece(source, index, "row", None)
    for spelling, kind in ((c.UNBIND, "row"), (c.SPLIT, "chunk"), (c.CHUNK, "chunk")):
        named = spelling.args(source)
        if named is not None and named.get("dim", 0) == 0:
            return _Piece(named["input"], index, kind, source)
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Cone:
    """One piece's graph, from its output back to its pieces: a structural key (equal for
    the same function of pieces at the same places), its pieces and its nodes."""

    def __init__(self) -> None:
        self.pieces: dict[Node, _Piece] = {}
        self.sources: list[Node] = []
        self.nodes: list[Node] = []
        self._keys: dict[Node, Any] = {}

    def key(self, value: Any) -> Any:
        """The structural key of an argument; raises ValueError where it is not row-wise."""
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(self.key(v) for v in value))
        if not isinstance(value, Node):
            return ("constant", value)
        if value not in self._keys:
            self._keys[value] = self._node_key(value)
        return self._keys[value]

    def _node_key(self, node: Node) -> Any:
        if p.tensor_value(node) is None and p.scalar(node) is not None:
            return ("scalar", node)  # a symbolic number: the same node in every piece
        piece = piece_of(node)
        if piece is not None:
            if piece.source not in self.sources:
                self.sources.append(piece.source)
            self.pieces[node] = piece
            return ("piece", self.sources.index(piece.source), piece.kind)
        self.nodes.append(node)
        if len(self.nodes) > _MAX_CONE or not _row_wise(node):
            raise ValueError(node)
        dims = _dims(node)
        args = tuple(self.key(a) for a in node.args)
        kwargs = tuple(sorted((k, self.key(v)) for k, v in node.kwargs.items()))
        return (node.op, node.target, args, kwargs, dims)


def _row_wise(node: Node) -> bool:
    """A row-wise op whose tensor operands are all pieces' graphs' (of one rank, for an
    elementwise op of two) or numbers."""
    if node.op == "call_function" and node.target in _CANONICAL:
        return True
    if p.cast_dtype(node) is not None or p.is_method(node, {"contiguous"}):
        return True
    if any(spelling.args(node) is not None for spelling in _OVER_DIMS):
        return _dims(node) is not None
    if any(spelling.args(node) is not None for spelling in _ELEMENTWISE):
        ranks = {p.tensor_value(a).dim() for a in node.args if p.tensor_value(a) is not None}
        return len(ranks) == 1 and not node.kwargs
    return False


def _dims(node: Node) -> tuple[int, ...] | None:
    """The node's dim argument as negative indices of its input (the same axes on a piece and
    the whole), or None if it has none that can be read as such."""
    for spelling in _OVER_DIMS:
        named = spelling.args(node)
        if named is None:
            continue
        dim, value = named.get("dim"), p.tensor_value(named["input"])
        dims = list(dim) if isinstance(dim, (list, tuple)) else [dim]
        if value is None or not dims or not all(_is_int(d) for d in dims):
            return None
        rank = value.dim() + (1 if spelling is c.UNSQUEEZE else 0)
        return tuple(d - rank if d >= 0 else d for d in dims)
    return ()


def join_pieces(joined: Node, journal: Journal) -> bool:
    """``stack`` / ``cat`` (dim 0) of the same row-wise function of covering pieces -> that
    function of the whole tensors (module docstring)."""
    spelling = c.STACK if c.STACK.args(joined) is not None else c.CAT
    named = spelling.args(joined)
    if named is None or named.get("dim", 0) != 0 or not isinstance(named["input"], list):
        return False
    outputs = named["input"]
    cones = _cones(outputs, "row" if spelling is c.STACK else "chunk")
    if not cones:
        return False
    emit = Emitter(joined.graph, joined)
    created: list[Node] = []
    whole = _rebuild(emit, cones[0], outputs[0], {}, created)
    got, want = p.tensor_value(whole), p.tensor_value(joined)
    same = got is not None and got.dtype == want.dtype and got.dim() == want.dim()
    if not same or not all(p.same_size(a, b) for a, b in zip(got.shape, want.shape)):
        journal.erase(created)
        return False
    matched = [n for cone in cones for n in (*cone.nodes, *cone.pieces, *cone.sources)]
    matched += [piece.cut for cone in cones for piece in cone.pieces.values() if piece.cut]
    journal.replaced("piecewise", joined, whole, matched, created)
    return True


def _cones(outputs: list[Any], kind: str) -> list[_Cone] | None:
    """Each output's cone, if all are one function of pieces of ``kind`` that cover their
    sources in order; else None."""
    cones, keys = [], []
    for output in outputs:
        cone = _Cone()
        try:
            keys.append(cone.key(output))
        except ValueError:
            return None
        cones.append(cone)
    first = cones[0]
    if not first.sources or any(k != keys[0] for k in keys):
        return None
    for position, cone in enumerate(cones):
        if cone.sources != first.sources:
            return None
        if any(piece.index != position or piece.kind != kind for piece in cone.pieces.values()):
            return None
    return cones if all(_covered(cones, s, kind) for s in first.sources) else None


def _covered(cones: list[_Cone], source: Node, kind: str) -> bool:
    """Do the pieces of ``source`` cover it: one per row (n of n rows), or every chunk of
    one cut?"""
    pieces = [piece for cone in cones for piece in cone.pieces.values() if piece.source is source]
    cuts = {piece.cut for piece in pieces}
    if len(cuts) != 1:
        return False
    (cut,) = cuts
    if cut is not None:
        outputs = p.example_value(cut)
        return isinstance(outputs, (tuple, list)) and len(outputs) == len(cones)
    value = p.tensor_value(source)
    return kind == "row" and value.dim() > 0 and p.same_size(value.shape[0], len(cones))


def _rebuild(emit: Emitter, cone: _Cone, value: Any, built: dict, created: list[Node]) -> Any:
    """``value`` of the first piece's graph, computed on the whole tensors."""
    if isinstance(value, (list, tuple)):
        return type(value)(_rebuild(emit, cone, v, built, created) for v in value)
    if not isinstance(value, Node) or (p.tensor_value(value) is None):
        return value
    if value in cone.pieces:
        return cone.pieces[value].source
    if value not in built:
        args = [_rebuild(emit, cone, a, built, created) for a in value.args]
        kwargs = {k: _rebuild(emit, cone, v, built, created) for k, v in value.kwargs.items()}
        _negative_dims(value, args, kwargs)
        node = emit.like(value, tuple(args), kwargs)
        created.append(node)
        built[value] = node
    return built[value]


def _negative_dims(node: Node, args: list, kwargs: dict) -> None:
    """Write the node's dim argument as its negative form (``_dims``) in ``args`` /
    ``kwargs``, for the whole tensor's extra leading dim."""
    dims = _dims(node)
    if not dims:
        return
    dim = dims if isinstance(c.single(_dim_argument(node)), (list, tuple)) else dims[0]
    if "dim" in node.kwargs:
        kwargs["dim"] = dim
    else:
        args[1] = dim


def _dim_argument(node: Node) -> Any:
    for spelling in _OVER_DIMS:
        named = spelling.args(node)
        if named is not None:
            return named.get("dim")
    return None
