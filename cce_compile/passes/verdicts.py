"""What the pass decides about a loss node it leaves alone: a Rejection and its reason codes
(counter keys and report text), shared by the plain and the tensor-parallel matchers."""

from __future__ import annotations

import dataclasses

from torch.fx import Node

ESCAPES = "logits_escape"
GRAPH_BREAK = "logits_from_graph_input"
UNSUPPORTED_OP = "unsupported_op_in_chain"
UNSUPPORTED_OPTION = "unsupported_option"
DTENSOR = "dtensor_weights"
MUTATION = "mutation_in_region"  # an in-place write the op would not see (or would)
NO_HEAD = "no_linear_head"
DISABLED = "disabled"  # a match that CCE_DISABLE keeps from being rewritten
DISABLED_DETAIL = "CCE_DISABLE is set"


@dataclasses.dataclass
class Rejection:
    """A loss node left alone, and why."""

    loss: Node
    reason: str
    detail: str
