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
all-reduces it, and under sequence parallelism the gather's backward reduce-scatters it.

Left alone, with the reason: a classifier not sharded ``Shard(0)`` on a 1-D mesh, logits read
per shard (``to_local()`` of vocabulary-sharded logits: each rank's loss over its own classes),
partial-sum logits, DTensor targets or class weights, the nll_loss form, logits with other users.

``match`` returns None for a loss without DTensors on its chain (the single-device matcher's
business), else a :class:`TensorParallelSite` or a ``verdicts.Rejection``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from . import predicates as p
from . import safety, verdicts

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # a torch built without distributed: no DTensor reaches the pass
    DTensor = None

aten = torch.ops.aten


def _dtensor_method(node, name: str) -> bool:
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


def _ops():
    """The op, registered on first use (importing cce_compile.distributed imports
    torch.distributed, which the single-device pass does not need)."""
    from ..distributed import ops, sharding
    from ..distributed.signature import FORWARD

    return ops, sharding, FORWARD


@dataclasses.dataclass
class TensorParallelSite:
    """A vocabulary-parallel lm_head and its cross-entropy."""

    loss: Node
    head: Node
    hidden: Node  # the head's DTensor input
    classifier: Node  # DTensor (V, D), Shard(0)
    bias: Node | None  # DTensor (V,), Shard(0)
    chain: list[Node]  # head output .. loss input, forward order (head excluded)
    row_indices: list[Any]  # row slices to replay on hidden, forward order
    targets: Node
    loss_targets: Node
    class_weights: Node | None
    ignore_index: int
    reduction: str
    label_smoothing: Any
    softcap: Any
    scale_factors: list[tuple[Any, bool]]
    compute_dtype: torch.dtype
    shard: Any  # distributed.sharding.VocabShard
    dtensor_loss: bool  # the graph's loss is a DTensor (else the logits went through to_local)
    kept_logits: list[Node] = dataclasses.field(default_factory=list)  # report compatibility
    dropped_logits: list[Node] = dataclasses.field(default_factory=list)

    @property
    def rows(self) -> Any:
        value = p.tensor_value(self.chain[-1] if self.chain else self.head)
        return math.prod(value.shape[:-1]) if value.dim() > 1 else 1

    @property
    def vocab(self) -> Any:
        """Classes per rank: the logits this rank would hold."""
        return self.shard.rows


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


def _reject(loss: Node, detail: str, reason: str | None = None) -> Any:
    return verdicts.Rejection(loss, reason or verdicts.DTENSOR, detail)


def match(loss: Node, order: dict[Node, int] | None = None) -> TensorParallelSite | Any | None:
    """The site, a Rejection, or None where no DTensor is on the loss's input chain."""
    if DTensor is None or not (p.is_cross_entropy(loss) or p.is_nll_loss(loss)):
        return None
    first = loss.args[0] if loss.args else loss.kwargs.get("input")
    if not _reaches_dtensor(first):
        return None
    if p.is_nll_loss(loss):
        return _reject(loss, "nll_loss over DTensor log-probabilities (use cross_entropy)")
    order = order or safety.node_order(loss.graph)
    args = p.bind(loss, F.cross_entropy)
    bad = _bad_options(args)
    if bad is not None:
        return _reject(loss, bad, verdicts.UNSUPPORTED_OPTION)
    walked = _walk(loss, args["input"])
    if isinstance(walked, verdicts.Rejection):
        return walked
    head, chain, walk = walked
    return _site(loss, args, head, chain, walk, order)


def _reaches_dtensor(node: Any) -> bool:
    """Is a DTensor on the chain from the loss input back through each node's first tensor
    operand (the logits' path: views, casts, scaling, softcap, to_local)?"""
    for _ in range(64):
        if not isinstance(node, Node):
            return False
        if _is_dtensor(node):
            return True
        if node.op not in ("call_method", "call_function"):
            return False
        node = next((a for a in node.args if p.tensor_value(a) is not None), None)
    return False


def _bad_options(args: dict) -> str | None:
    if args["size_average"] is not None or args["reduce"] is not None:
        return "legacy size_average/reduce arguments"
    if isinstance(args["ignore_index"], Node) or not isinstance(args["ignore_index"], int):
        return "ignore_index is not a constant int"
    if args["reduction"] not in ("mean", "sum", "none"):
        return f"reduction {args['reduction']!r}"
    smoothing = args["label_smoothing"]
    if isinstance(smoothing, Node) or not 0.0 <= float(smoothing) <= 1.0:
        return f"label_smoothing {smoothing} is not a constant in [0, 1]"
    target = p.tensor_value(args["target"])
    if target is None or target.dtype.is_floating_point:
        return "targets are not class indices"
    return None


@dataclasses.dataclass
class _Walk:
    row_indices: list[Any] = dataclasses.field(default_factory=list)  # reversed
    scale_factors: list[tuple[Any, bool]] = dataclasses.field(default_factory=list)
    softcap: Any = None
    local: bool = False  # the logits became plain through to_local() of replicated ones


def _walk(loss: Node, start: Node) -> tuple[Node, list[Node], _Walk] | Any:
    """From the loss input back to the DTensor head: (head, chain in forward order, walk)."""
    walk = _Walk()
    chain: list[Node] = []
    node = start
    while True:
        if p.is_linear(node):
            if not _is_dtensor(node):
                return _reject(loss, f"{node.name}: a plain head under DTensor logits")
            return node, list(reversed(chain)), walk
        if not isinstance(node, Node):
            return _reject(loss, f"{node!r} on the logits' chain", verdicts.UNSUPPORTED_OP)
        chain.append(node)
        if _is_dtensor(node) and not (_class_sharded(node) or _replicated(node)):
            return _reject(loss, f"{node.name} has placements {_placements(node)}")
        if _dtensor_method(node, "to_local"):
            source = node.args[0]
            if not _replicated(source):
                return _reject(
                    loss,
                    f"{node.name}: to_local() of logits placed {_placements(source)}: each "
                    "rank's loss over its own vocabulary shard, not the vocabulary-parallel "
                    "cross-entropy",
                )
            walk.local = True
            node = source
            continue
        if _dtensor_method(node, "redistribute"):  # moves data, never changes values
            node = node.args[0]
            continue
        dtype = p.cast_dtype(node)
        if dtype is not None:
            if dtype != torch.float32:
                return _reject(
                    loss, f"{node.name} casts the logits to {dtype}", verdicts.UNSUPPORTED_OP
                )
            node = node.args[0]
            continue
        if p.is_method(node, {"contiguous"}) or p.is_row_view(node):
            if p.is_row_view(node) and walk.row_indices:
                return _reject(
                    loss, f"{node.name}: rows sliced after a reshape", verdicts.UNSUPPORTED_OP
                )
            node = node.args[0]
            continue
        index = p.row_index(node)
        if index is not None:
            walk.row_indices.append(index)
            node = node.args[0]
            continue
        capped = _softcap(node)
        if capped is not None and walk.softcap is None and not walk.scale_factors:
            node, walk.softcap, tanh_nodes = capped
            chain.extend(tanh_nodes)
            continue
        scaled = p.is_scale(node)
        if scaled is not None and not isinstance(scaled[1], Node):
            tensor, factor, divides = scaled
            if safety.bad_constant("factor", factor, zero_ok=not divides) is not None:
                return _reject(
                    loss, f"{node.name}: logits scaled by {factor}", verdicts.UNSUPPORTED_OPTION
                )
            walk.scale_factors.append((factor, divides))
            node = tensor
            continue
        what = node.target if node.op != "placeholder" else "a graph input"
        return _reject(
            loss, f"{node.name}: {what} on the DTensor logits' chain", verdicts.UNSUPPORTED_OP
        )


def _softcap(node: Node) -> tuple[Node, Any, list[Node]] | None:
    """``p.softcap`` with a constant c the op can take (0 or inf is no softcap)."""
    capped = p.softcap(node)
    if capped is None or isinstance(capped[1], Node):
        return None
    if safety.bad_constant("the softcap", capped[1], zero_ok=False) is not None:
        return None
    return capped


def _site(loss, args, head, chain, walk, order) -> TensorParallelSite | Any:
    _, sharding, _ = _ops()
    hidden, classifier, bias = p.linear_operands(head)
    weight = p.tensor_value(classifier)
    shard = sharding.vocab_shard(weight)
    if isinstance(shard, str):
        return _reject(loss, shard)
    hidden_value = p.tensor_value(hidden)
    if not isinstance(hidden_value, DTensor):
        return _reject(loss, f"{hidden.name}: plain hidden states with a DTensor classifier")
    why = sharding.replicated_input(hidden_value, weight.device_mesh)
    if why is not None:
        return _reject(loss, why)
    if bias is not None and (
        not isinstance(p.tensor_value(bias), DTensor) or _placements(bias) != (Shard(0),)
    ):
        return _reject(loss, "the bias is not a Shard(0) DTensor like the classifier")
    head_dtype = p.tensor_value(head).dtype
    if head_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return _reject(loss, f"head computes in {head_dtype}", verdicts.UNSUPPORTED_OPTION)
    for name in ("target", "weight"):
        if _is_dtensor(args[name]):
            return _reject(loss, f"the {name} of the loss is a DTensor (a plain tensor expected)")
    if safety.grad_mode_changes(head, loss, order):  # eager's logits would carry no gradient
        return _reject(loss, "grad mode changes between the head and the loss (no_grad?)")
    targets = p.element_source(args["target"])
    written = safety.first_write([hidden, classifier, bias, head, *chain], head, loss, order)
    written = written or safety.first_write([targets, args["weight"]], head, loss, order)
    if written is not None:
        writer, target = written
        return _reject(loss, f"{writer.name} writes {target.name} in place", verdicts.MUTATION)
    # (after the writes: an in-place op on the logits is also one of their users)
    outside = [u.name for n in (head, *chain) for u in n.users if u not in (*chain, loss)]
    if outside:
        return _reject(
            loss,
            f"the logits are also used by {', '.join(sorted(set(outside)))}",
            verdicts.ESCAPES,
        )
    return TensorParallelSite(
        loss=loss,
        head=head,
        hidden=hidden,
        classifier=classifier,
        bias=bias,
        chain=chain,
        row_indices=list(reversed(walk.row_indices)),
        targets=targets,
        loss_targets=args["target"],
        class_weights=args["weight"],
        ignore_index=args["ignore_index"],
        reduction=args["reduction"],
        label_smoothing=float(args["label_smoothing"]),
        softcap=walk.softcap,
        scale_factors=list(reversed(walk.scale_factors)),
        compute_dtype=head_dtype,
        shard=shard,
        dtensor_loss=not walk.local,
    )


class _Emitter:
    """Creates nodes before ``anchor``, evaluated under the graph's fake mode for their
    example values, with the anchor's source meta."""

    def __init__(self, graph: Graph, anchor: Node):
        self.graph, self.anchor = graph, anchor
        self.fake_mode = _fake_mode(graph)

    def __call__(self, op: str, target, *args: Any, **kwargs: Any) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, args, kwargs)
        p.copy_source_meta(node, self.anchor)
        with self.fake_mode:
            if op == "call_method":
                this, *rest = p.example_args(args)
                value = getattr(this, target)(*rest, **p.example_args(kwargs))
            else:
                value = target(*p.example_args(args), **p.example_args(kwargs))
        node.meta["example_value"] = value
        if not isinstance(value, DTensor):
            node.meta["val"] = value
        return node

    def call(self, target, *args: Any, **kwargs: Any) -> Node:
        return self("call_function", target, *args, **kwargs)

    def method(self, name: str, *args: Any, **kwargs: Any) -> Node:
        return self("call_method", name, *args, **kwargs)


def _fake_mode(graph: Graph) -> Any:
    """The fake mode of the graph's example values (a DTensor's is its local tensor's)."""
    for node in graph.nodes:
        value = p.tensor_value(node)
        if isinstance(value, DTensor):
            value = value._local_tensor
        if getattr(value, "fake_mode", None) is not None:
            return value.fake_mode
    raise RuntimeError("a Dynamo graph without fake example values")


def _logit_scale(site: TensorParallelSite) -> float:
    scale = 1.0
    for factor, divides in site.scale_factors:
        scale = scale / factor if divides else scale * factor
    return float(scale)


def rewrite(graph: Graph, site: TensorParallelSite) -> Node:
    """Replace ``site`` in ``graph`` (module docstring); returns the op node."""
    ops, _, forward = _ops()
    loss = site.loss
    emit = _Emitter(graph, loss)
    hidden = site.hidden
    if not _replicated(hidden):  # a sequence-sharded input: DTensor gathers it
        hidden = emit.method("redistribute", hidden, placements=(Replicate(),))
    # The op's hidden gradient is this rank's partial sum; DTensor reduces it once.
    rows = emit.method("to_local", hidden, grad_placements=(Partial(),))
    for index in site.row_indices:
        rows = emit.call(operator.getitem, rows, index)
    hidden3 = _canonical(emit, rows)
    classifier = emit.method("to_local", site.classifier)
    bias = None if site.bias is None else emit.method("to_local", site.bias)
    shape = p.tensor_value(hidden3).shape
    sizes = (
        [emit.call(aten.sym_size.int, hidden3, i) for i in (0, 1)]
        if any(isinstance(s, torch.SymInt) for s in shape[:2])
        else list(shape[:2])
    )
    targets = emit.call(aten.reshape.default, site.targets, sizes)
    op = emit.call(
        torch.ops.cce.vocab_parallel_cross_entropy.default,
        *forward.build(
            hidden=hidden3,
            classifier=classifier,
            targets=targets,
            bias=bias,
            class_weights=site.class_weights,
            compute_dtype=site.compute_dtype,
            ignore_index=site.ignore_index,
            reduction=site.reduction,
            label_smoothing=site.label_smoothing,
            softcap=None if site.softcap is None else float(site.softcap),
            logit_scale=_logit_scale(site),
            shift=0,  # row slices were replayed on hidden
            z_loss=0.0,
            vocab_start=site.shard.start,
            vocab_size=site.shard.size,
            group_name=site.shard.group_name,
            reduce_hidden_grad=False,
            lse_all_rows=False,
            implementation_version=ops.IMPLEMENTATION_VERSION,
        ),
    )
    new_loss = emit.call(operator.getitem, op, 0)
    if site.reduction == "none":
        target_shape = p.tensor_value(site.loss_targets).shape
        if any(isinstance(s, torch.SymInt) for s in target_shape):
            target_shape = [
                emit.call(aten.sym_size.int, site.loss_targets, i) for i in range(len(target_shape))
            ]
        new_loss = emit.call(aten.reshape.default, new_loss, list(target_shape))
    dtype = p.tensor_value(loss).dtype
    if dtype != torch.float32:
        new_loss = emit.call(aten._to_copy.default, new_loss, dtype=dtype)
    if site.dtensor_loss:
        mesh = emit.call(getattr, site.classifier, "device_mesh")
        new_loss = emit.call(DTensor.from_local, new_loss, mesh, (Replicate(),), run_check=False)
    loss.replace_all_uses_with(new_loss)
    graph.erase_node(loss)
    for node in [*reversed(site.chain), site.head]:
        if not node.users:
            graph.erase_node(node)
    return op


def _canonical(emit: _Emitter, hidden: Node) -> Node:
    """hidden (..., D) -> (B, T, D), a view."""
    ndim = p.tensor_value(hidden).dim()
    if ndim == 1:
        return emit.call(aten.view.default, hidden, [1, 1, -1])
    if ndim == 2:
        return emit.call(aten.unsqueeze.default, hidden, 0)
    if ndim == 3:
        return hidden
    return emit.call(aten.flatten.using_ints, hidden, 0, ndim - 3)
