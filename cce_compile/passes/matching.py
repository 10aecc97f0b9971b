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
from .journal import Journal
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


def settled_sites(
    graph: Graph, journal: Journal, rewrite: bool
) -> list[tuple[Site | Rejection, bool]]:
    """Every candidate of ``graph`` after the rules (``journal``), with whether it is to be
    rewritten (a ``Site``, and ``rewrite``), once the graph is settled: the rules' rewrites
    that no such site uses are rolled back and the graph matched again, until nothing more is
    rolled back (a write put back in place can spoil another match). A rejection keeps the
    reason it first had, in terms of the forms the rules made (why an entropy could not be
    served); a candidate the rules made and took back, the rejection it last had."""
    seen: dict[Node, tuple[Site | Rejection, bool]] = {}
    while True:
        current = [(found, isinstance(found, Site) and rewrite) for found in find_sites(graph)]
        for found, to_rewrite in current:
            if isinstance(found, Site) or not isinstance(
                seen.get(found.loss, [None])[0], Rejection
            ):
                seen[found.loss] = (found, to_rewrite)
        if not journal.settle([found.nodes() for found, to_rewrite in current if to_rewrite]):
            return list(seen.values())
