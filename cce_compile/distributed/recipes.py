"""Compile recipes for sharded training: getting the lm_head and the loss into one graph.

Dynamo cannot trace FSDP2's hooks (they are ``torch._dynamo.disable``d) nor resume a frame in
the middle of a loop, so a root ``forward`` that loops over FSDP-wrapped (or separately
compiled) blocks is skipped whole and runs eagerly: its lm_head materialises the logits and
the loss, compiled elsewhere, sees them as a graph input. ``deferred_head`` moves the head out
of that frame without changing the model's code: the model returns its hidden states, and the
step applies the real head inside the compiled loss function, where the pass fuses it
(docs/distributed.md)::

    with deferred_head(model, "output") as head:
        hidden = model(tokens)                         # FSDP hooks run as usual
    loss = compiled_loss(head, hidden, labels)         # CE(head(hidden)): one graph
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

# One module for every use: a compiled frame that sees it guards on it once instead of
# recompiling for a new object each step.
_PASS_THROUGH = nn.Identity()


@contextlib.contextmanager
def deferred_head(model: nn.Module, name: str) -> Iterator[nn.Module]:
    """Inside the block, ``model``'s submodule ``name`` (e.g. "lm_head", "output") is replaced
    by an identity: the model returns the hidden states the head would read. Yields the head,
    for the compiled loss function to call. Neither its forward nor its hooks run in between
    (a tensor-parallel head's input and output hooks then run inside the loss function).

    The head must belong to the root FSDP unit (not be ``fully_shard``-ed on its own), whose
    parameters stay unsharded from the root's forward to its backward: the loss function then
    reads the gathered weight, and FSDP reduce-scatters its gradient at the end of the
    backward as usual.
    """
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    head = parent._modules[attr]
    parent._modules[attr] = _PASS_THROUGH
    try:
        yield head
    finally:
        parent._modules[attr] = head
