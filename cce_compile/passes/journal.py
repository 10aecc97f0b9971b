"""What the rules changed in a graph, so that what is not fused can be put back as it was.

The rules (``rules.py``) rewrite RL forms before matching: a per-row loop becomes one call on
the whole tensor, ``log_softmax`` + ``gather`` a ``cce::token_log_probs``, and so on. Where the
result is fused, the logits are gone and so is the cost of the user's form. Where it is not
(the logits escape, a graph break, an in-place write), keeping the rewrite would change the
user's graph for nothing, and sometimes for the worse: TRL chunks its entropy 128 rows at a
time to bound its memory, and the merged form computes it on every row at once. So every
rewrite is recorded here, and ``settle`` rolls back each one that touches no fused site.

An entry replaces the uses of the user's node by its own (``replaced``), leaving the user's
nodes in the graph, dead, until the pass is done; rolling it back points the uses back and
erases what it added. Entries and sites are linked by the floating-point nodes they share (the
logits, their views, the nodes a later rule rewrote again): an entry is kept if its group
reaches a node of a site that is being rewritten.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from torch.fx import Graph, Node

from . import predicates as p
from . import safety
from .canonical import LEFT_ALONE

# The name of the user's node a rewritten node stands for (``node.meta``): reports name it.
REPLACES = "cce_replaces"


def user_name(node: Node) -> str:
    """The name the user's graph has for ``node``'s value (a rewritten node's original)."""
    return node.meta.get(REPLACES, node.name)


@dataclasses.dataclass
class Entry:
    """One rewrite: the rule's name, the nodes it matched or made, and how to undo it."""

    rule: str
    nodes: list[Node]  # every node it read, replaced or made: what links it to others
    created: list[Node]  # the nodes it added, in graph order
    undo: Callable[[], None]  # points the uses back and erases ``created``


class Journal:
    """The rules' rewrites of one graph, in the order they were made."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.entries: list[Entry] = []

    def __bool__(self) -> bool:
        return bool(self.entries)

    def replaced(
        self, rule: str, old: Node, new: Node, matched: Iterable[Node], created: list[Node]
    ) -> None:
        """Record (and make) the rewrite of ``old`` into ``new``: every use of ``old`` now
        reads ``new``; ``old`` and what only it read stay, dead, until ``finish``."""
        old.replace_all_uses_with(new)
        new.meta[REPLACES] = old.meta.get(REPLACES, old.name)

        def undo() -> None:
            new.replace_all_uses_with(old)
            self.erase(created)

        self.record(rule, [old, new, *matched], created, undo)

    def record(self, rule: str, nodes: Iterable[Node], created: list[Node], undo) -> None:
        self.entries.append(Entry(rule, [*nodes, *created], created, undo))

    def erase(self, nodes: list[Node]) -> None:
        """Erase ``nodes`` (users after the nodes they read), which nothing else uses."""
        for node in reversed(nodes):
            if not node._erased:
                self.graph.erase_node(node)

    def settle(self, fused_sites: Iterable[Iterable[Node]]) -> list[str]:
        """Roll back, latest first, every entry whose group reaches none of the nodes of the
        ``fused_sites`` (each given by its nodes), and every entry that made a node not to be
        fused (``LEFT_ALONE``: a site keeping the logits for it reaches it); returns the rules
        rolled back."""
        kept = self._groups_reaching({n for site in fused_sites for n in site})
        marked = [any(LEFT_ALONE in n.meta for n in e.created) for e in self.entries]
        kept -= {index for index, left_alone in enumerate(marked) if left_alone}
        rolled_back = []
        for index in reversed(range(len(self.entries))):
            if index not in kept:
                entry = self.entries.pop(index)
                entry.undo()
                rolled_back.append(entry.rule)
        return rolled_back

    def finish(self) -> None:
        """Erase what the kept entries left dead: the user's nodes they replaced, what only
        those read, and what they made that the rewrite no longer uses."""
        candidates = [n for e in self.entries for n in e.nodes]
        order = safety.node_order(self.graph)
        live = sorted({n for n in candidates if not n._erased}, key=order.__getitem__)
        for node in reversed(live):
            if not node._erased and node.op != "placeholder" and safety.is_dead(node):
                for dead in [*_dead_users(node), node]:
                    if not dead._erased:
                        self.graph.erase_node(dead)
        self.entries.clear()

    def _groups_reaching(self, site_nodes: set[Node]) -> set[int]:
        """The indices of the entries connected to ``site_nodes`` through shared links."""
        parent = list(range(len(self.entries)))

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        owner: dict[Node, int] = {}
        for index, entry in enumerate(self.entries):
            for node in filter(_links, entry.nodes):
                if node in owner:
                    parent[find(index)] = find(owner[node])
                else:
                    owner[node] = index
        reaching = {find(owner[n]) for n in site_nodes if n in owner}
        return {i for i in range(len(self.entries)) if find(i) in reaching}


def _links(node: Node) -> bool:
    """Nodes that tie rewrites together: floating-point tensors computed in the graph (the
    logits and what is made of them), not the targets nor the graph's inputs, which
    unrelated heads may share."""
    value = p.tensor_value(node)
    return node.op != "placeholder" and value is not None and value.dtype.is_floating_point


def _dead_users(node: Node) -> list[Node]:
    """The dead nodes that use ``node``, directly or through each other, users first."""
    found: list[Node] = []
    for user in list(node.users):
        for dead in [*_dead_users(user), user]:
            if dead not in found:
                found.append(dead)
    return found
