"""The public function: ``cce_compile.distributed.vocab_parallel_cross_entropy``.

Two entries, one op:

* plain tensors: the caller names its shard (``vocab_start``, ``vocab_size``) and ``group``;
  hidden's gradient is all-reduced inside the op's backward.
* DTensors (a tensor-parallel ``lm_head``): the classifier is sharded ``Shard(0)`` on a 1-D
  mesh; hidden may be a DTensor (replicated, or sequence-sharded: it is gathered first) or a
  plain replica. The op runs on the local tensors and hidden's gradient comes back as a
  ``Partial`` placement, so DTensor reduces it exactly once: an all-reduce, or under sequence
  parallelism the reduce-scatter of the gather's backward. The loss is a replicated DTensor,
  as ``loss_parallel`` gives. This is what ``local_map`` would build; it is written out with
  ``to_local``/``from_local`` because the graph pass emits the same nodes (``passes.
  tensor_parallel``), and one form serves both.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ..functional import as_ignore_index, autocast_dtype, skips_ignored
from ..loss_math import LossSpec
from ..op_signature import LOSS_OPTIONS
from . import ops as _ops
from . import sharding
from .signature import FORWARD

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TARGET_DTYPES = (torch.int64, torch.int32)


def _check_tensors(hidden, classifier, targets, bias, class_weights, shard) -> None:
    """Shapes and dtypes of the local tensors against this rank's shard."""
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension (..., D)")
    if classifier.dim() != 2 or classifier.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"classifier must be this rank's shard (V_local, D) with D={hidden.shape[-1]} "
            f"(hidden's last dim), got {tuple(classifier.shape)}"
        )
    if classifier.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"classifier must be a float tensor, got {classifier.dtype}")
    if targets.dtype not in _TARGET_DTYPES:
        raise TypeError(f"targets must hold class indices (int64 or int32), got {targets.dtype}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden's leading shape "
            f"{tuple(hidden.shape[:-1])}"
        )
    if not (0 <= shard.start and shard.start + classifier.shape[0] <= shard.size):
        raise ValueError(
            f"vocab_start={shard.start} with a shard of {classifier.shape[0]} classes does not "
            f"fit in vocab_size={shard.size}"
        )
    if bias is not None and tuple(bias.shape) != (classifier.shape[0],):
        raise ValueError(
            f"bias must be this rank's slice ({classifier.shape[0]},), got {tuple(bias.shape)}"
        )
    if class_weights is not None and tuple(class_weights.shape) != (shard.size,):
        raise ValueError(
            f"class_weights must cover the whole vocabulary ({shard.size},), got "
            f"{tuple(class_weights.shape)}"
        )
    devices = {
        t.device for t in (hidden, classifier, targets, bias, class_weights) if t is not None
    }
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _local(value: Tensor | None, name: str) -> Tensor | None:
    """The local tensor of a replicated DTensor argument (targets, class weights)."""
    if not isinstance(value, DTensor):
        return value
    if any(not isinstance(p, Replicate) for p in value.placements):
        raise ValueError(f"{name} as a DTensor must be replicated, got {value.placements}")
    return value.to_local()


def vocab_parallel_cross_entropy(
    hidden: Tensor,
    classifier: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    group=None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weights: Tensor | None = None,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    shift: int = 0,
    z_loss: float = 0.0,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of ``hidden @ W.T (+ b)`` with the classifier ``W`` split by vocabulary
    over a process group, no logits stored: ``cce_compile.linear_cross_entropy``'s loss and
    gradients over the whole vocabulary, from each rank's shard.

    Every rank calls it with the same ``hidden``, ``targets`` and options (SPMD). Forward: one
    all-gather of each rank's packed per-row lse, target logit and, with smoothing, weighted
    sum (2 or 3 floats a row), combined locally. Backward (lean: the shard's logits are
    recomputed): hidden's gradient is reduced once over the group; the classifier's and
    bias's stay local.

    Args:
        hidden: (..., D), the same on every rank; or a DTensor on the classifier's mesh (any
            Shard/Replicate placement, e.g. ``Shard(1)`` under sequence parallelism).
        classifier: this rank's shard (V_local, D) of the (V, D) weight, classes
            [vocab_start, vocab_start + V_local); or a DTensor (V, D) placed ``Shard(0)`` on a
            1-D mesh (a ``ColwiseParallel`` lm_head weight), uneven shards allowed.
        targets: (...) int64/int32 global class ids, hidden's leading shape.
        bias: this rank's (V_local,) slice, or a ``Shard(0)`` DTensor (V,).
        vocab_start, vocab_size, group: the shard's first class, the whole vocabulary's size
            and the group (ProcessGroup, 1-D DeviceMesh, group name; None: the default group)
            for plain tensors; derived from a DTensor classifier (then leave them out).
        class_weights: optional (V,) weights of the whole vocabulary.
        ignore_index, reduction, label_smoothing, softcap, logit_scale, shift, z_loss,
        return_lse: as in ``cce_compile.linear_cross_entropy``.

    Returns:
        The loss (float32; a replicated DTensor when the classifier is a DTensor), and with
        ``return_lse`` the per-row lse over the whole vocabulary.
    """
    spec = LossSpec(
        ignore_index=as_ignore_index(ignore_index),
        reduction=reduction,
        label_smoothing=float(label_smoothing),
        softcap=None if softcap is None else float(softcap),
        logit_scale=float(logit_scale),
        shift=shift,
        z_loss=float(z_loss),
    )
    mesh = None
    if isinstance(classifier, DTensor):
        given = [n for n, v in (("vocab_start", vocab_start), ("vocab_size", vocab_size),
                                ("group", group)) if v is not None]  # fmt: skip
        if given:
            raise ValueError(f"{', '.join(given)}: derived from the DTensor classifier; leave out")
        shard = sharding.vocab_shard(classifier)
        if isinstance(shard, str):
            raise ValueError(f"classifier: {shard}")
        mesh = classifier.device_mesh
        hidden, reduce_hidden_grad = _replicated_hidden(hidden, mesh)
        classifier = classifier.to_local()
        if isinstance(bias, DTensor):
            if tuple(bias.placements) != (Shard(0),):
                raise ValueError(
                    f"bias as a DTensor must be placed Shard(0), got {bias.placements}"
                )
            bias = bias.to_local()
    else:
        if vocab_start is None or vocab_size is None:
            raise ValueError(
                "vocab_start and vocab_size: required with a plain-tensor classifier shard"
            )
        shard = sharding.VocabShard(
            int(vocab_start), classifier.shape[0], int(vocab_size), sharding.group_name(group)
        )
        if isinstance(hidden, DTensor):
            raise TypeError("hidden: a DTensor needs a DTensor classifier (or pass hidden's local)")
        reduce_hidden_grad = True
    targets, class_weights = _local(targets, "targets"), _local(class_weights, "class_weights")
    _check_tensors(hidden, classifier, targets, bias, class_weights, shard)
    if shift and (hidden.dim() < 2 or not 0 <= shift < hidden.shape[-2]):
        raise ValueError(f"shift must be in [0, T) for hidden of shape {tuple(hidden.shape)}")
    compute_dtype = autocast_dtype(hidden.device)
    if compute_dtype is None and (
        classifier.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype)
    ):
        raise TypeError(
            f"classifier ({classifier.dtype}) and bias must have hidden's dtype {hidden.dtype} "
            "(or run under autocast, which casts them)"
        )

    leading = tuple(hidden.shape[:-1])
    time = leading[-1] if leading else 1
    batch = math.prod(leading[:-1])
    rows_shape = leading[:-1] + (time - shift,) if leading else ()
    loss, lse, _ = torch.ops.cce.vocab_parallel_cross_entropy(
        *FORWARD.build(
            hidden=hidden.reshape(batch, time, hidden.shape[-1]),
            classifier=classifier,
            targets=targets.reshape(batch, time),
            bias=bias,
            class_weights=class_weights,
            compute_dtype=compute_dtype,
            **{name: getattr(spec, name) for name in LOSS_OPTIONS},
            vocab_start=shard.start,
            vocab_size=shard.size,
            group_name=shard.group_name,
            reduce_hidden_grad=reduce_hidden_grad,
            lse_all_rows=return_lse,
            implementation_version=_ops.IMPLEMENTATION_VERSION,
            skip_ignored=skips_ignored(),
        )
    )
    if reduction == "none":
        loss = loss.reshape(rows_shape)
    lse = lse.reshape(rows_shape)
    if mesh is not None:
        loss = DTensor.from_local(loss, mesh, [Replicate()], run_check=False)
        lse = DTensor.from_local(lse, mesh, [Replicate()], run_check=False)
    return (loss, lse) if return_lse else loss


def _replicated_hidden(hidden: Tensor, mesh) -> tuple[Tensor, bool]:
    """(hidden's full local replica, whether the op must all-reduce its gradient).

    A DTensor is gathered by DTensor (whose backward then reduce-scatters under sequence
    parallelism) and hands the op's partial gradient back as ``Partial``; a plain replica's
    gradient is all-reduced by the op.
    """
    if not isinstance(hidden, DTensor):
        return hidden, True
    why = sharding.replicated_input(hidden, mesh)
    if why is not None:
        raise ValueError(f"hidden: {why}")
    full = hidden.redistribute(mesh, [Replicate()] * mesh.ndim)
    return full.to_local(grad_placements=[Partial()] * mesh.ndim), False
