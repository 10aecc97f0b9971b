"""Cut Cross-Entropy with the vocabulary split over ranks (tensor-parallel lm_head).

Public surface::

    cce_compile.distributed.vocab_parallel_cross_entropy(hidden, classifier_shard, targets, ...)
    cce_compile.distributed.deferred_head(model, "lm_head")   # FSDP2 recipe (recipes.py)

and ``torch.ops.cce.vocab_parallel_cross_entropy`` (``distributed.ops``), which the graph pass
inserts for a ``ColwiseParallel`` lm_head (``cce_compile.passes.tensor_parallel``). See
docs/distributed.md.
"""

from __future__ import annotations

from .functional import vocab_parallel_cross_entropy
from .recipes import deferred_head

__all__ = ["deferred_head", "vocab_parallel_cross_entropy"]
