"""The argument lists of the vocabulary-parallel ops: the one place that names and orders them.

The op ``cce::vocab_parallel_cross_entropy`` is called by the public function
(``distributed.functional``) and by the graph pass (``passes.tensor_parallel``); its autograd
formula (``distributed.ops``) reads the arguments back by name. The loss options are
``LossSpec``'s fields, as for ``cce::linear_cross_entropy`` (``op.signature``).
"""

from __future__ import annotations

from ..op import signature as single_device
from ..op.signature import FAST_BUFFERS, GRAD_FLAGS, LOSS_OPTIONS, Argument, Returns, Signature

# The loss options as the single-device op declares them (LossSpec's fields).
_OPTIONS = [a for a in single_device.FORWARD.arguments if a.name in LOSS_OPTIONS]
_GRAD_FLAGS = [Argument(name, "bool") for name in GRAD_FLAGS]
_INPUTS = [
    Argument("hidden", "Tensor"),  # (B, T, D), the same on every rank of the group
    Argument("classifier", "Tensor"),  # (V_local, D): classes [vocab_start, vocab_start + V_local)
    Argument("targets", "Tensor"),  # (B, T) int, global class ids, the same on every rank
    Argument("bias", "Tensor?"),  # (V_local,): this rank's slice
    Argument("class_weights", "Tensor?"),  # (vocab_size,): the whole vocabulary's
    Argument("compute_dtype", "ScalarType?", default=None),  # as in op.signature
]
_SHARD = [
    Argument("vocab_start", "int"),  # the first class of this rank's shard
    Argument("vocab_size", "int"),  # the whole vocabulary V (the shards' union)
    Argument("group_name", "str"),  # the process group the vocabulary is split over
    # True: the backward all-reduces hidden's gradient over the group. False: it returns this
    # rank's partial sum, which the caller reduces exactly once (a DTensor Partial placement:
    # all-reduce, or reduce-scatter under sequence parallelism).
    Argument("reduce_hidden_grad", "bool"),
]

FORWARD = Signature(
    [
        *_INPUTS,
        *_OPTIONS,
        *_SHARD,
        Argument("lse_all_rows", "bool"),  # the returned lse is valid at ignored rows too
        # "lean" or "fast" (vocab_parallel's module docstring); every rank must pass the same.
        Argument("mode", "str"),
        *_GRAD_FLAGS,  # the gradients fast mode computes in the forward
        Argument("implementation_version", "int"),  # distributed.ops.IMPLEMENTATION_VERSION
        # Compact away rows whose target is ignore_index first (compaction.py); every rank
        # holds the same targets, so every rank keeps the same rows.
        Argument("skip_ignored", "bool", default=False),
    ]
)
# lse: over the whole vocabulary, (B, T - shift); fast_*: fast mode's gradients for a unit
# upstream gradient (hidden's: this rank's partial sum, float32 where the op reduces it, else in
# hidden's dtype), empty where not computed; row_index: the rows computed on (compaction.py)
FORWARD_RETURNS = Returns("loss", "lse", *FAST_BUFFERS.values(), "row_index")

BACKWARD = Signature(
    [
        Argument("grad_loss", "Tensor?"),
        Argument("grad_lse", "Tensor?"),
        *_INPUTS,
        Argument("lse", "Tensor"),
        Argument("row_index", "Tensor?", default=None),  # the forward's rows
        *_OPTIONS,
        *_SHARD,
        Argument("lse_all_rows", "bool"),
        *_GRAD_FLAGS,
        # Fast mode's hidden buffer (FORWARD_RETURNS): hidden's gradient is then this buffer
        # scaled by grad_loss (and reduced over the group), not recomputed.
        Argument("fast_grad_hidden", "Tensor?", default=None),
    ]
)
