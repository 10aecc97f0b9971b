"""Cut Cross-Entropy with the vocabulary split over ranks (tensor-parallel lm_head).

Public surface::

    cce_compile.distributed.vocab_parallel_cross_entropy(hidden, classifier_shard, targets, ...)

and ``torch.ops.cce.vocab_parallel_cross_entropy`` (``ops``), which the graph pass inserts for
a ``ColwiseParallel`` lm_head (``cce_compile.passes.tensor_parallel``). See docs/distributed.md.
"""

from __future__ import annotations

from .functional import vocab_parallel_cross_entropy

__all__ = ["vocab_parallel_cross_entropy"]
