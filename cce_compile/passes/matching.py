"""Finding the sites of a Dynamo graph: every loss node (``F.cross_entropy``, ``F.nll_loss``),
matched by the kind of head its logits come from.

A loss over DTensor logits goes to ``tensor_parallel``, any other to ``plain``; both start
from the same loss options and walk (``walk.py``). Each candidate becomes a ``Site`` of its
kind (rewritten by its ``rewrite``) or a ``Rejection`` whose reason says why it is left alone.
"""

from __future__ import annotations

from torch.fx import Graph, Node

from . import plain, safety, tensor_parallel
from . import predicates as p
from .verdicts import Rejection, Site


def find_sites(graph: Graph) -> list[Site | Rejection]:
    """Every cross-entropy candidate of ``graph``, matched or rejected, in graph order."""
    found: list[Site | Rejection] = []
    order = safety.node_order(graph)
    for node in graph.nodes:
        if p.is_cross_entropy(node) or p.is_nll_loss(node):
            found.append(match_site(node, order))
    return found


def match_site(loss: Node, order: dict[Node, int] | None = None) -> Site | Rejection:
    """Match one loss node: its site (a ``TensorParallelSite`` over DTensor logits, else a
    ``PlainSite``), or a Rejection saying why not."""
    order = order or safety.node_order(loss.graph)
    kind = tensor_parallel if tensor_parallel.on_dtensors(loss) else plain
    return kind.match(loss, order)
