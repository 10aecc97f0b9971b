"""What matching decides about a loss node: a :class:`Site` to rewrite, or a :class:`Rejection`
with its reason code (the counter key and the report's text).

``Site`` holds what every kind of head has; each kind (``plain.PlainSite``,
``tensor_parallel.TensorParallelSite``) adds its own fields and its surgery, ``rewrite``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.fx import Graph, Node

from . import predicates as p

ESCAPES = "logits_escape"
GRAPH_BREAK = "logits_from_graph_input"
UNSUPPORTED_OP = "unsupported_op_in_chain"
UNSUPPORTED_OPTION = "unsupported_option"
DTENSOR = "dtensor_weights"
MUTATION = "mutation_in_region"  # an in-place write the op would not see (or would)
INEXACT_FORM = "inexact_form"  # a form the op would compute otherwise (canonical.LEFT_ALONE)
NO_HEAD = "no_linear_head"
DISABLED = "disabled"  # a match that CCE_DISABLE keeps from being rewritten
DISABLED_DETAIL = "CCE_DISABLE is set"


@dataclasses.dataclass
class Rejection:
    """A loss node left alone, and why."""

    loss: Node
    reason: str
    detail: str
    quiet: bool = False  # left alone as the user asked (an evaluation graph's logits): INFO


@dataclasses.dataclass
class Site:
    """A matched linear -> cross-entropy site: the nodes the op replaces and the loss's
    options, as every kind of head has them."""

    loss: Node
    head: Node
    hidden: Node
    classifier: Node
    bias: Node | None
    chain: list[Node]  # head output .. loss input, in forward order (head excluded)
    loss_views: list[Node]  # between the loss and the logits / log_softmax: views, class-dim move
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

    @property
    def rows(self) -> Any:
        """Number of loss rows (int or SymInt) from the loss input's example value."""
        value = p.tensor_value(self.chain[-1] if self.chain else self.head)
        return math.prod(value.shape[:-1]) if value.dim() > 1 else 1

    @property
    def vocab(self) -> Any:
        """Classes of the logits this process would hold."""
        return p.tensor_value(self.head).shape[-1]

    @property
    def logits_fate(self) -> str:
        """What becomes of the logits once rewritten: "gone", "kept" (for other users) or
        "dropped" (a LogitsNotComputed placeholder returned in their place)."""
        return "gone"

    def symbolic_constants(self) -> list[str]:
        """The loss constants that are graph inputs (Python floats Dynamo made symbolic)."""
        named = [("logit scale", factor) for factor, _ in self.scale_factors]
        named += [("softcap", self.softcap), ("label_smoothing", self.label_smoothing)]
        return sorted({name for name, value in named if isinstance(value, Node)})

    def nodes(self) -> list[Node]:
        """The nodes the site reads or replaces, from the head to the loss (what ties the
        rules' rewrites to it: ``journal.py``)."""
        return [self.head, *self.chain, self.loss, *self.loss_views]

    def rewrite(self, graph: Graph) -> Node:
        """Replace the site in ``graph`` by the op; returns the op node."""
        raise NotImplementedError(f"{type(self).__name__} has no surgery")
