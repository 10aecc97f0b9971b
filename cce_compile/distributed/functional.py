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

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .. import decide
from . import ops as _ops
from . import sharding
from .signature import FORWARD, FORWARD_RETURNS


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
    mode: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Cross-entropy of ``hidden @ W.T (+ b)`` with the classifier ``W`` split by vocabulary
    over a process group, no logits stored: ``cce_compile.linear_cross_entropy``'s loss and
    gradients over the whole vocabulary, from each rank's shard.

    Every rank calls it with the same ``hidden``, ``targets`` and options (SPMD). Forward: one
    all-gather of each rank's packed per-row statistics (in fast mode one per chunk of rows);
    backward: hidden's gradient is reduced once over the group (``distributed.vocab_parallel``).

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
        ignore_index ... return_lse: as in ``cce_compile.linear_cross_entropy``.
        mode: 'lean', 'fast' or 'auto' (None: the configured mode, CCE_MODE), chosen by
            ``decide.mode`` for the share of the vocabulary every rank plans for
            (``decide.shard_vocab``), so every rank chooses alike.

    Returns:
        The loss (float32; a replicated DTensor when the classifier is a DTensor), and with
        ``return_lse`` the per-row lse over the whole vocabulary.
    """
    given_hidden = hidden
    hidden, classifier, bias, shard, mesh = _local_inputs(
        hidden, classifier, bias, (vocab_start, vocab_size, group)
    )
    targets, class_weights = _local(targets, "targets"), _local(class_weights, "class_weights")
    decide.check_tensors(hidden, classifier, targets, bias, class_weights, shard)
    decide.check_mode(mode)
    options = (ignore_index, reduction, label_smoothing, softcap, logit_scale, shift, z_loss)
    spec = decide.loss_spec(hidden, *options)
    route = decide.route((hidden, classifier, targets, bias, class_weights), logit_scale, softcap)
    if route is not None:  # the single-device function serves these with PyTorch's autograd
        raise NotImplementedError(
            f"vocab_parallel_cross_entropy does not serve {route}: its op has no formula for "
            "it (pass numbers that need no gradient, outside torch.func transforms)"
        )
    spec = decide.with_scalars(spec, logit_scale, softcap)
    hidden, targets, rows_shape = decide.canonical_form(hidden, targets, spec.shift)
    tensors = (hidden, classifier, targets, bias, class_weights)
    # A DTensor hidden takes its gradient back as Partial: DTensor reduces it once.
    reduce_hidden_grad = not isinstance(given_hidden, DTensor)
    output = _call_op(tensors, spec, shard, mode, (return_lse, reduce_hidden_grad))
    out = FORWARD_RETURNS.unpack(output)
    loss = out.loss.reshape(rows_shape) if reduction == "none" else out.loss
    returned = (loss, out.lse.reshape(rows_shape)) if return_lse else (loss,)
    if mesh is not None:  # the loss as loss_parallel gives it: a replicated DTensor
        returned = [DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in returned]
    return tuple(returned) if return_lse else returned[0]


def _call_op(tensors, spec, shard: sharding.VocabShard, mode: str | None, flags) -> tuple:
    """``torch.ops.cce.vocab_parallel_cross_entropy`` in the mode ``decide`` chooses for the
    share of the vocabulary every rank plans for; ``flags``: (return_lse,
    reduce_hidden_grad)."""
    hidden, classifier, targets, bias, class_weights = tensors
    return_lse, reduce_hidden_grad = flags
    compute_dtype = decide.compute_dtype(hidden, classifier, bias)
    _check_covered(shard)
    needs = decide.gradients_asked(hidden, classifier, bias)
    share = decide.shard_vocab(shard.size, sharding.group_size(shard.group_name))
    chosen = decide.mode(
        mode,
        decide.problem_of(hidden, classifier, spec.shift, compute_dtype, vocab=share),
        needs,
        dtypes=decide.operand_dtypes(hidden, classifier, bias),
        reduction=spec.reduction,
        lse_has_grad=return_lse and torch.is_grad_enabled(),
        softcap=bool(spec.softcap),
        vocab_parallel=True,
    )
    return torch.ops.cce.vocab_parallel_cross_entropy(
        *FORWARD.build(
            **decide.op_inputs(tensors, compute_dtype),
            spec=spec,
            vocab_start=shard.start,
            vocab_size=shard.size,
            group_name=shard.group_name,
            reduce_hidden_grad=reduce_hidden_grad,
            lse_all_rows=return_lse,
            mode=chosen,
            **needs,
            implementation_version=_ops.IMPLEMENTATION_VERSION,
            skip_ignored=decide.compacts_ignored_rows(),
        )
    )


def _replicated_hidden(hidden: Tensor, mesh) -> Tensor:
    """Hidden's full local replica. A DTensor is gathered by DTensor (whose backward then
    reduce-scatters under sequence parallelism) and takes the op's partial gradient back as
    ``Partial``; a plain replica's gradient must be reduced by the op."""
    if not isinstance(hidden, DTensor):
        return hidden
    why = sharding.replicated_input(hidden, mesh)
    if why is not None:
        raise ValueError(f"hidden: {why}")
    full = hidden.redistribute(mesh, [Replicate()] * mesh.ndim)
    return full.to_local(grad_placements=[Partial()] * mesh.ndim)


def _local_inputs(hidden, classifier, bias, shard_given):
    """(hidden, classifier, bias, shard, mesh): this rank's tensors and shard, from a DTensor
    classifier (on its mesh) or from ``shard_given`` (vocab_start, vocab_size, group) for
    plain tensors (mesh None: the op then all-reduces hidden's gradient itself)."""
    vocab_start, vocab_size, group = shard_given
    if isinstance(classifier, DTensor):
        given = [n for n, v in (("vocab_start", vocab_start), ("vocab_size", vocab_size),
                                ("group", group)) if v is not None]  # fmt: skip
        if given:
            raise ValueError(f"{', '.join(given)}: derived from the DTensor classifier; leave out")
        shard = sharding.vocab_shard(classifier)
        if isinstance(shard, str):
            raise ValueError(f"classifier: {shard}")
        mesh = classifier.device_mesh
        hidden = _replicated_hidden(hidden, mesh)
        classifier = classifier.to_local()
        if isinstance(bias, DTensor):
            if tuple(bias.placements) != (Shard(0),):
                raise ValueError(
                    f"bias as a DTensor must be placed Shard(0), got {bias.placements}"
                )
            bias = bias.to_local()
        return hidden, classifier, bias, shard, mesh
    if vocab_start is None or vocab_size is None:
        raise ValueError(
            "vocab_start and vocab_size: required with a plain-tensor classifier shard"
        )
    start, size = (decide.int_argument(n, v) for n, v in _named(vocab_start, vocab_size))
    shard = sharding.VocabShard(start, classifier.shape[0], size, sharding.group_name(group))
    if isinstance(hidden, DTensor):
        raise TypeError("hidden: a DTensor needs a DTensor classifier (or pass hidden's local)")
    return hidden, classifier, bias, shard, None


def _named(vocab_start, vocab_size):
    return (("vocab_start", vocab_start), ("vocab_size", vocab_size))


def _check_covered(shard: sharding.VocabShard) -> None:
    """A group of one rank must hold the whole vocabulary (larger groups cannot tell without a
    collective)."""
    if sharding.group_size(shard.group_name) == 1 and (shard.start, shard.rows) != (0, shard.size):
        raise ValueError(
            f"vocab_start={shard.start} with a shard of {shard.rows} classes: on a group of one "
            f"rank the shard must be the whole vocabulary (vocab_size={shard.size})"
        )
