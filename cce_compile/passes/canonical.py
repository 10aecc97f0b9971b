"""The two canonical forms the RL rules rewrite into (``rules.py``), as ops of the graph.

* ``cce::token_log_probs(logits, index)``: ``log_softmax(logits, -1)`` at ``index`` (the
  logits' leading shape), in the logits' dtype: the log-prob of each sampled token.
* ``cce::softmax_entropy(logits)``: ``-sum_j p_j log p_j`` over the last dim, in the logits'
  dtype.

Both are ``CompositeImplicitAutograd``: one left in a graph decomposes, under AOTAutograd or
eagerly, into the aten math below, so it can never compute a wrong number. They live only
between the rules and the matcher: the rules lower ``token_log_probs`` into the
``cross_entropy`` form the matcher knows, a fused site serves ``softmax_entropy`` from the op's
entropy output, and what is not fused is rolled back to the user's own nodes (``journal.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.fx import Node

_LIBRARY = torch.library.Library("cce", "FRAGMENT")
_LIBRARY.define("token_log_probs(Tensor logits, Tensor index) -> Tensor")
_LIBRARY.define("softmax_entropy(Tensor logits) -> Tensor")


def _token_log_probs(logits: Tensor, index: Tensor) -> Tensor:
    return torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def _softmax_entropy(logits: Tensor) -> Tensor:
    log_p = torch.log_softmax(logits, -1)
    return -(log_p.exp() * log_p).sum(-1)


_LIBRARY.impl("token_log_probs", _token_log_probs, "CompositeImplicitAutograd")
_LIBRARY.impl("softmax_entropy", _softmax_entropy, "CompositeImplicitAutograd")

TOKEN_LOG_PROBS = torch.ops.cce.token_log_probs.default
SOFTMAX_ENTROPY = torch.ops.cce.softmax_entropy.default

# What a cross-entropy node the rules made computes (``node.meta[FORM]``); the reports name it.
FORM = "cce_form"
LOG_PROBS = "log-probs"
ENTROPY = "entropy"  # a cross-entropy of dummy targets: only its entropy is used
# Why an in-place scaling of the logits (``z.div_(T)``) was left in place (``node.meta``): the
# site's mutation rejection says it.
KEPT_IN_PLACE = "cce_kept_in_place"
# Why a canonical node must not be fused (``node.meta``): the user's form differs from the op
# (eager's NaN at a -inf logit or where p underflows: ``entropy_rules``). A site serving it, or
# the loss the rules made for it, is left alone with this reason, and the journal puts the
# user's form back.
LEFT_ALONE = "cce_left_alone"


def form(node: Any) -> str | None:
    """What a cross-entropy node made by the rules stands for (None: the user's own)."""
    return node.meta.get(FORM) if isinstance(node, Node) else None


def dummy_target_nodes(loss: Node) -> list[Node]:
    """The nodes of an entropy's cross-entropy's dummy targets (``rules.dummy_loss``), users
    first; [] for any other loss."""
    if form(loss) != ENTROPY:
        return []
    targets = loss.args[1]
    return [targets, targets.args[0]]


def entropy_input(node: Any) -> Node | None:
    """x for ``cce::softmax_entropy(x)``."""
    if isinstance(node, Node) and node.op == "call_function" and node.target is SOFTMAX_ENTROPY:
        return node.args[0]
    return None


def is_token_log_probs(node: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is TOKEN_LOG_PROBS
