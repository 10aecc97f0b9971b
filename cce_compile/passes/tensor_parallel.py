"""The tensor-parallel lm_head: recognised in a Dynamo graph, rewritten into
``cce::vocab_parallel_cross_entropy``.

``ColwiseParallel`` on the lm_head (torchtitan's plan, with or without sequence parallelism)
leaves this in the graph, every value from the head on a DTensor::

    h   = from_local(x, mesh, (R,))               # or x.redistribute((R,)) under SP
    z   = linear(h, W, b)                          # W: DTensor (Shard(0),) -> z: (Shard(-1),)
    z   = z.redistribute((S(-1),))                 # use_local_output=False: no change
          [row views / slices, float32 casts, scaling, softcap]
    loss = cross_entropy(z, y)                     # DTensor (R,), under loss_parallel or not

or, with ``output_layouts=Replicate()``, ``z.redistribute((R,)).to_local()`` and a plain
cross_entropy on the gathered logits. ``redistribute`` never changes values, so both compute
the cross-entropy over the whole vocabulary: the op computes it from each rank's shard without
the logits. The replacement works on local tensors::

    h_local = h.to_local(grad_placements=(Partial(),))   # hidden's gradient: a partial sum
    loss    = cce.vocab_parallel_cross_entropy(h_local, W.to_local(), y, ...)
    loss    = DTensor.from_local(loss, W.device_mesh, (R,))   # where the graph had a DTensor

so hidden's gradient is reduced exactly once, by DTensor: ``from_local(x, (R,))``'s backward
all-reduces it, and under sequence parallelism the gather's backward reduce-scatters it. The
op's mode is ``decide.mode``'s for the share of the vocabulary every rank plans for
(``decide.shard_vocab``), on the example sizes: every rank compiles the same graph, so every
rank chooses alike.

Left alone, with the reason: a classifier not sharded ``Shard(0)`` on a 1-D mesh, logits read
per shard (``to_local()`` of vocabulary-sharded logits: each rank's loss over its own classes),
partial-sum logits, DTensor targets or class weights, the nll_loss form, logits with other users.

What is shared with a single-device head (the loss's options, the walk from the loss input to
the head, the emitter and the op's loss options) lives in ``walk.py`` and ``emit.py``; this
module adds only the DTensor steps of the walk, the sharding checks and the op call.
``on_dtensors`` tells ``matching`` which loss nodes are this module's to ``match``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.fx import Graph, Node

from .. import decide, policy
from ..op.signature import GRAD_FLAGS
from . import escapes, safety
from . import predicates as p
from . import walk as w
from .emit import (
    Emitter,
    canonical_hidden,
    erase_unused,
    loss_arguments,
    loss_target_path,
    loss_value,
    rows_of_hidden,
    targets_as_rows,
)
from .verdicts import DTENSOR, ESCAPES, UNSUPPORTED_OP, UNSUPPORTED_OPTION, Rejection, Site

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # a torch built without distributed: no DTensor reaches the pass
    DTensor = None


def _ops():
    """The op, registered on first use (importing cce_compile.distributed imports
    torch.distributed, which the single-device pass does not need)."""
    from ..distributed import ops, sharding
    from ..distributed.signature import FORWARD

    return ops, sharding, FORWARD


@dataclasses.dataclass
class TensorParallelSite(Site):
    """A vocabulary-parallel lm_head and its cross-entropy (hidden, classifier and bias are
    the head's DTensors: the classifier and bias ``Shard(0)``)."""

    shard: Any  # distributed.sharding.VocabShard
    dtensor_loss: bool  # the graph's loss is a DTensor (else the logits went through to_local)

    @property
    def vocab(self) -> Any:
        """Classes per rank: the logits this rank would hold."""
        return self.shard.rows

    def rewrite(self, graph: Graph) -> Node:
        return _rewrite(graph, self)


def _is_dtensor(node: Any) -> bool:
    return isinstance(p.tensor_value(node), DTensor)


def _placements(node: Any) -> tuple:
    return tuple(p.tensor_value(node).placements)


def _class_sharded(node: Node) -> bool:
    """A DTensor split along its last (class) dimension."""
    value = p.tensor_value(node)
    return _placements(node) == (Shard(value.dim() - 1),) or _placements(node) == (Shard(-1),)


def _replicated(node: Node) -> bool:
    return all(isinstance(pl, Replicate) for pl in _placements(node))


def _dtensor_method(node: Any, name: str) -> bool:
    """``x.<name>(...)`` of a DTensor: a call_method node, or (torch 2.11) a call of the
    ``<name>_fn_with_prim_types`` wrapper Dynamo builds around it (renamed ``prim_<name>``),
    taking x first."""
    if p.is_method(node, {name}):
        return True
    target = getattr(node, "target", None)
    wrapper = getattr(target, "__name__", "") == f"prim_{name}" or getattr(
        target, "__qualname__", ""
    ).endswith(f"{name}_fn_with_prim_types")
    return getattr(node, "op", None) == "call_function" and wrapper


def on_dtensors(loss: Node) -> bool:
    """Is a DTensor on the chain from the loss input back through each node's first tensor
    operand (the logits' path: views, casts, scaling, softcap, to_local)?"""
    if DTensor is None:
        return False
    node = loss.args[0] if loss.args else loss.kwargs.get("input")
    for _ in range(64):
        if not isinstance(node, Node):
            return False
        if _is_dtensor(node):
            return True
        if node.op not in ("call_method", "call_function"):
            return False
        node = next((a for a in node.args if p.tensor_value(a) is not None), None)
    return False


def match(loss: Node, order: dict[Node, int]) -> TensorParallelSite | Rejection:
    """The site of a loss over DTensor logits, or why it is left alone."""
    if p.is_nll_loss(loss):
        return Rejection(
            loss, DTENSOR, "nll_loss over DTensor log-probabilities (use cross_entropy)"
        )
    options = w.loss_options(loss)
    if isinstance(options, Rejection):
        return options
    steps = _DTensorSteps()
    walk = _unsupported_loss(loss, options) or w.walk_to_head(loss, options.logits, steps)
    if isinstance(walk, Rejection):
        return walk
    shard = _unsupported_head(loss, walk.head) or _vocab_shard(loss, walk.head)
    if isinstance(shard, Rejection):
        return shard
    rejected = _why_unsafe(loss, options, walk, order)
    if rejected is not None:
        return rejected
    hidden, classifier, bias = p.linear_operands(walk.head)
    return TensorParallelSite(
        **w.site_fields(loss, options, walk, hidden, classifier, bias),
        shard=shard,
        dtensor_loss=not steps.local,
    )


def _unsupported_loss(loss: Node, options: w.LossOptions) -> Rejection | None:
    """What the vocabulary-parallel op does not take of a loss the single-device op takes."""
    if options.views:
        return Rejection(
            loss, UNSUPPORTED_OP, "cross_entropy over DTensor logits with the classes in dim 1"
        )
    if isinstance(options.label_smoothing, Node):
        return Rejection(loss, UNSUPPORTED_OPTION, "label_smoothing is not a constant")
    for name, node in (("target", options.target), ("weight", options.weight)):
        if _is_dtensor(node):
            return Rejection(
                loss, DTENSOR, f"the {name} of the loss is a DTensor (a plain tensor expected)"
            )
    return None


class _DTensorSteps:
    """The walk's steps through DTensor logits, tried before the shared ones: placements
    checked at every node, ``redistribute`` (moves data, never changes values) and
    ``to_local`` of replicated logits gone through; constants the op takes as they are."""

    def __init__(self) -> None:
        self.local = False  # the logits became plain through to_local() of replicated ones

    def __call__(self, loss: Node, node: Node, walk: w.Walk) -> Node | Rejection | None:
        if _is_dtensor(node) and not (_class_sharded(node) or _replicated(node)):
            return Rejection(loss, DTENSOR, f"{node.name} has placements {_placements(node)}")
        if _dtensor_method(node, "to_local"):
            return self._to_local(loss, node)
        if _dtensor_method(node, "redistribute"):
            return node.args[0]
        if p.is_passthrough(node) and not p.is_method(node, {"contiguous"}):
            return Rejection(loss, UNSUPPORTED_OP, f"{node.name}: {node.target} of DTensor logits")
        if _symbolic_constant(node):
            return Rejection(
                loss, UNSUPPORTED_OP, f"{node.name}: a symbolic constant on DTensor logits"
            )
        return None

    def _to_local(self, loss: Node, node: Node) -> Node | Rejection:
        source = node.args[0]
        if not _replicated(source):
            return Rejection(
                loss,
                DTENSOR,
                f"{node.name}: to_local() of logits placed {_placements(source)}: each rank's "
                "loss over its own vocabulary shard, not the vocabulary-parallel cross-entropy",
            )
        self.local = True
        return source


def _symbolic_constant(node: Node) -> bool:
    """A softcap or scale whose constant is a graph node: the vocabulary-parallel op takes
    constants only."""
    return any(
        found is not None and isinstance(found[1], Node)
        for found in (p.softcap(node), p.is_scale(node))
    )


def _unsupported_head(loss: Node, head: Node) -> Rejection | None:
    """The head must be a ``linear`` of DTensors, computing in a dtype the op takes."""
    if not p.is_linear(head):
        return Rejection(loss, UNSUPPORTED_OP, f"{head.name}: {head.target} of DTensors")
    if not _is_dtensor(head):
        return Rejection(loss, DTENSOR, f"{head.name}: a plain head under DTensor logits")
    return w.unsupported_head_dtype(loss, head)


def _vocab_shard(loss: Node, head: Node) -> Any:
    """The shard of the vocabulary this rank's classifier holds (``sharding.VocabShard``), or
    why the head is no vocabulary-parallel head: the classifier must be ``Shard(0)`` on a 1-D
    mesh, hidden a DTensor that DTensor can gather, the bias sharded like the classifier."""
    _, sharding, _ = _ops()
    hidden, classifier, bias = p.linear_operands(head)
    weight = p.tensor_value(classifier)
    shard = sharding.vocab_shard(weight)
    if isinstance(shard, str):
        return Rejection(loss, DTENSOR, shard)
    hidden_value = p.tensor_value(hidden)
    if not isinstance(hidden_value, DTensor):
        return Rejection(
            loss, DTENSOR, f"{hidden.name}: plain hidden states with a DTensor classifier"
        )
    why = sharding.replicated_input(hidden_value, weight.device_mesh)
    if why is not None:
        return Rejection(loss, DTENSOR, why)
    if bias is not None and (not _is_dtensor(bias) or _placements(bias) != (Shard(0),)):
        return Rejection(loss, DTENSOR, "the bias is not a Shard(0) DTensor like the classifier")
    return shard


def _why_unsafe(
    loss: Node, options: w.LossOptions, walk: w.Walk, order: dict[Node, int]
) -> Rejection | None:
    """Eager's logits would carry no gradient, something writes what the op reads, or the
    logits have other users."""
    head, chain = walk.head, walk.chain
    if safety.grad_mode_changes(head, loss, order):
        return Rejection(
            loss, DTENSOR, "grad mode changes between the head and the loss (no_grad?)"
        )
    hidden, classifier, bias = p.linear_operands(head)
    targets = p.element_source(options.target)
    regions = [
        ([hidden, classifier, bias, head, *chain], head, loss),
        ([targets, options.weight], head, loss),
    ]
    written = safety.write_in_region(loss, regions, order)
    if written is not None:
        return written
    # (after the writes: an in-place op on the logits is also one of their users)
    outside = escapes.outside_users([head, *chain], [*chain, loss, *options.loss_side])
    if outside:
        users = ", ".join(sorted(u.name for u in outside))
        return Rejection(loss, ESCAPES, f"the logits are also used by {users}")
    return None


def _rewrite(graph: Graph, site: TensorParallelSite) -> Node:
    """Replace ``site`` in ``graph`` (module docstring); returns the op node."""
    ops, _, forward = _ops()
    emit = Emitter(graph, site.loss)
    hidden = site.hidden
    if not _replicated(hidden):  # a sequence-sharded input: DTensor gathers it
        hidden = emit.method("redistribute", hidden, placements=(Replicate(),))
    # The op's hidden gradient is this rank's partial sum; DTensor reduces it once.
    rows = emit.method("to_local", hidden, grad_placements=(Partial(),))
    hidden = canonical_hidden(emit, rows_of_hidden(emit, rows, site))
    classifier = emit.method("to_local", site.classifier)
    bias = None if site.bias is None else emit.method("to_local", site.bias)
    needs = _needs(site)
    op = emit(
        torch.ops.cce.vocab_parallel_cross_entropy.default,
        *forward.build(
            hidden=hidden,
            classifier=classifier,
            targets=targets_as_rows(emit, site.targets, hidden),
            bias=bias,
            class_weights=site.class_weights,
            compute_dtype=site.compute_dtype,
            **loss_arguments(emit, site),
            vocab_start=site.shard.start,
            vocab_size=site.shard.size,
            group_name=site.shard.group_name,
            reduce_hidden_grad=False,
            lse_all_rows=False,
            mode=_site_mode(site, needs),
            **needs,
            implementation_version=ops.IMPLEMENTATION_VERSION,
            skip_ignored=decide.site_compacts_ignored_rows(),
        ),
    )
    new_loss = loss_value(emit, site, op)
    if site.dtensor_loss:
        mesh = emit(getattr, site.classifier, "device_mesh")
        new_loss = emit(DTensor.from_local, new_loss, mesh, (Replicate(),), run_check=False)
    site.loss.replace_all_uses_with(new_loss)
    erase_unused(
        graph,
        [
            site.loss,
            *loss_target_path(site),
            *reversed(site.loss_views),
            *reversed(site.chain),
            site.head,
        ],
    )
    return op


def _needs(site: TensorParallelSite) -> dict[str, bool]:
    """The op's gradient flags: the operands that require grad, where the loss does."""
    flows = p.tensor_value(site.loss).requires_grad
    operands = (site.hidden, site.classifier, site.bias)
    return {
        flag: bool(flows and n is not None and p.tensor_value(n).requires_grad)
        for flag, n in zip(GRAD_FLAGS, operands)
    }


def _site_mode(site: TensorParallelSite, needs: dict[str, bool]) -> str:
    """The op's mode (``decide.mode``) for the share of the vocabulary each rank plans for,
    on the example sizes (hints: a performance choice, no guard; a symbolic row count as
    ``decide.planned_rows`` plans it)."""
    _, sharding, _ = _ops()
    hidden, classifier = p.tensor_value(site.hidden), p.tensor_value(site.classifier)
    ranks = sharding.group_size(site.shard.group_name)
    problem = policy.problem(
        decide.planned_rows(*p.size_range(site.rows)),
        (decide.shard_vocab(site.shard.size, ranks), p.size_hint(classifier.shape[1]) or 1),
        site.compute_dtype,
        hidden.device.type,
        compute_dtype=site.compute_dtype,
        dtypes=(hidden.dtype, classifier.dtype),
    )
    bias = None if site.bias is None else p.tensor_value(site.bias)
    dtypes = decide.operand_dtypes(hidden, classifier, bias)
    return decide.mode(
        None,
        problem,
        needs,
        dtypes=dtypes,
        reduction=site.reduction,
        softcap=site.softcap is not None,
        vocab_parallel=True,
    )
