"""A single-device head (``F.linear``, ``x @ W.T``, ``x @ W``): its site, what matching checks
for it beyond the shared walk, and its surgery into ``cce::linear_cross_entropy``.

Beyond the walk (``walk.py``) the plain matcher looks through explicit casts of the head's
operands (the op rounds them itself, without a V x D copy), serves z-loss ``logsumexp`` users
from the op's lse, makes sure nothing writes what the op reads while eager reads it, and applies
``CCE_ESCAPING_LOGITS`` to logits with other users (``escapes.py``).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch.fx import Graph, Node

from .. import config, decide, policy
from ..op.custom_ops import IMPLEMENTATION_VERSION
from ..op.signature import FORWARD, FORWARD_RETURNS, GRAD_FLAGS
from . import canonical, escapes, placeholder, safety
from . import predicates as p
from . import walk as w
from .emit import (
    Emitter,
    canonical_hidden,
    cast,
    erase_unused,
    loss_arguments,
    loss_target_path,
    loss_value,
    rows_of_hidden,
    save_inputs_not_views,
    shape_of,
    targets_as_rows,
)
from .report_types import location
from .verdicts import (
    DTENSOR,
    ESCAPES,
    INEXACT_FORM,
    NO_HEAD,
    UNSUPPORTED_OPTION,
    Rejection,
    Site,
)

aten = torch.ops.aten
OP = torch.ops.cce.linear_cross_entropy.default


@dataclasses.dataclass
class PlainSite(Site):
    """A single-device head's site."""

    classifier_is_transposed: bool  # the head was x @ W with W (D, V): classifier is W.T
    log_softmax: Node | None  # the nll_loss form's log_softmax
    transposes: list[Node]  # W.T nodes of a matmul head: erased with the chain when unused
    operand_casts: list[Node]  # casts to the head's dtype looked through: erased when unused
    lse_users: list[Node]  # logsumexp nodes the op's lse can serve (z-loss)
    lse_shapes: list[Any]  # per lse user: "targets", "rows" (at hidden), "flat", or sizes
    lse_side_nodes: list[Node]  # casts between the chain and a served logsumexp
    entropy_users: list[Node]  # cce::softmax_entropy nodes the op's entropy serves
    entropy_shapes: list[Any]  # per entropy user, as lse_shapes
    entropy_side_nodes: list[Node]  # casts and row views between the chain and an entropy
    entropy_detached: list[bool]  # per entropy user: read without a gradient (no_grad)
    dummy_targets: bool  # an entropy's site (canonical.ENTROPY): its loss is unused
    anchor: Node  # the op goes right before it: the loss, or an lse user's earlier consumer
    detach_operands: bool  # the logits carry no gradient (no_grad / detach on the way)
    kept_logits: list[Node]  # escaping, kept alive (CCE_ESCAPING_LOGITS=rewrite)
    dropped_logits: list[Node]  # returned (or their returned casts): a placeholder (=drop)

    @property
    def logits_fate(self) -> str:
        return "kept" if self.kept_logits else "dropped" if self.dropped_logits else "gone"

    def rewrite(self, graph: Graph) -> Node:
        return _rewrite(graph, self)

    def nodes(self) -> list[Node]:
        served = [*self.lse_users, *self.lse_side_nodes, *self.entropy_users]
        return [*super().nodes(), *served, *self.entropy_side_nodes, *self.kept_logits]


# --- matching --------------------------------------------------------------------------------


def match(loss: Node, order: dict[Node, int]) -> PlainSite | Rejection:
    """The site of a loss over a single-device head, or why it is left alone."""
    options = w.loss_options(loss)
    if isinstance(options, Rejection):
        return options
    walk = w.walk_to_head(loss, options.logits)
    if isinstance(walk, Rejection):
        return walk
    operands = _operands(loss, walk)
    if isinstance(operands, Rejection):
        return operands
    return _site(loss, options, walk, operands, order)


@dataclasses.dataclass
class _Operands:
    """The head's operands as the op takes them (float32 sources of looked-through casts)."""

    hidden: Node
    classifier: Node
    bias: Node | None
    transposed: bool
    transposes: list[Node]
    casts: list[Node]  # the looked-through casts


def _operands(loss: Node, walk: w.Walk) -> _Operands | Rejection:
    """The head's operands, or why the op cannot take them."""
    head = walk.head
    found = w.head_operands(head)
    if found is None:
        return Rejection(loss, NO_HEAD, f"{head.name}: matmul operand is not a 2-D weight")
    hidden, classifier, transposed, bias, transposes = found
    bias = walk.bias if walk.bias is not None else bias
    rejected = _unsupported_operands(loss, head, hidden, classifier)
    rejected = rejected or _unsupported_bias(loss, head, bias)
    rejected = rejected or w.unsupported_head_dtype(loss, head)
    if rejected is not None:
        return rejected
    casts: list[Node] = []  # explicit casts of the operands the op does itself (AMP)
    dtype = p.tensor_value(head).dtype
    hidden, classifier, bias = (
        _rounded_source(n, dtype, casts) for n in (hidden, classifier, bias)
    )
    return _Operands(hidden, classifier, bias, transposed, transposes, casts)


def _unsupported_operands(
    loss: Node, head: Node, hidden: Node, classifier: Node
) -> Rejection | None:
    """Why the op cannot take the head's input and weight, or None."""
    nodes = (head, hidden, classifier)
    if any(p.tensor_value(n) is None for n in nodes):
        return Rejection(loss, NO_HEAD, f"{head.name}: operands without example values")
    if any(p.functorch_wrapped(n) for n in nodes):
        return Rejection(
            loss,
            UNSUPPORTED_OPTION,
            "traced inside a torch.func transform (grad / vmap / jvp): the fused op would need "
            "functorch rules; call cce_compile.linear_cross_entropy inside the transform instead",
        )
    if p.is_dtensor(p.tensor_value(hidden)) or p.is_dtensor(p.tensor_value(classifier)):
        return Rejection(loss, DTENSOR, "DTensor weights or activations (distributed)")
    return None


def _unsupported_bias(loss: Node, head: Node, bias: Any) -> Rejection | None:
    """A bias must be a tensor with one value per class, or None."""
    value = p.tensor_value(bias)
    if bias is None:
        return None
    if value is None:
        return Rejection(loss, UNSUPPORTED_OPTION, "bias is not a tensor")
    if value.dim() != 1 or not p.same_size(value.shape[0], p.tensor_value(head).shape[-1]):
        shape = tuple(value.shape)
        return Rejection(loss, UNSUPPORTED_OPTION, f"bias of shape {shape} broadcasts over classes")
    return None


def _rounded_source(node: Any, dtype: torch.dtype, casts: list[Node]) -> Any:
    """For an explicit cast of a float32 operand to the head's lower dtype (``w.bfloat16()``,
    ``x.to(torch.float16)``), the float32 source: the op rounds it to ``compute_dtype`` itself,
    as the cast would, without a V x D copy. Anything else: the node itself."""
    if dtype == torch.float32 or not isinstance(node, Node) or p.cast_dtype(node) != dtype:
        return node
    source = node.args[0]
    before, after = p.tensor_value(source), p.tensor_value(node)
    if before is None or before.dtype != torch.float32 or before.device != after.device:
        return node
    casts.append(node)
    return source


@dataclasses.dataclass
class _Candidate:
    """A loss, its options, the walk to its head, the head's operands and the logits' other
    users: a site once the checks pass."""

    loss: Node
    options: w.LossOptions
    walk: w.Walk
    operands: _Operands
    inside: list[Node]  # the chain, the loss and the nodes between: the users the op replaces
    users: escapes.LogitsUsers
    notes: list[str] = dataclasses.field(default_factory=list)  # why a user is not served

    @property
    def targets(self) -> Node:
        return p.element_source(self.options.target)

    @property
    def op_inputs(self) -> list[Any]:
        """What the op reads besides the logits' source: it can run once they all exist."""
        options, walk, operands = self.options, self.walk, self.operands
        return [
            *(operands.hidden, operands.classifier, operands.bias, self.targets, options.weight),
            *(options.label_smoothing, walk.softcap, walk.scale_factors, walk.row_indices),
        ]


def _site(
    loss: Node,
    options: w.LossOptions,
    walk: w.Walk,
    operands: _Operands,
    order: dict[Node, int],
) -> PlainSite | Rejection:
    """The site, once the logits' other users, the op's place and the writes in the region
    allow it."""
    inside = [*walk.chain, loss, *options.loss_side, *canonical.dummy_target_nodes(loss)]
    users = escapes.classify_users(walk.head, walk.chain, inside, set(walk.z_level))
    found = _Candidate(loss, options, walk, operands, inside, users)
    left_alone = _left_alone(found)
    if left_alone is not None:
        return left_alone
    anchor, lse_shapes, entropy_shapes = _serve_row_outputs(found, order)
    rejected = _write_in_region(found, anchor, order)
    dropped = _escape(found)
    if rejected is not None:
        return rejected
    if isinstance(dropped, Rejection):
        return dropped
    return PlainSite(
        **w.site_fields(loss, options, walk, operands.hidden, operands.classifier, operands.bias),
        classifier_is_transposed=operands.transposed,
        log_softmax=options.log_softmax,
        transposes=operands.transposes,
        operand_casts=operands.casts,
        lse_users=users.lse_users,
        lse_shapes=lse_shapes,
        lse_side_nodes=users.side_nodes,
        entropy_users=users.entropy_users,
        entropy_shapes=entropy_shapes,
        entropy_side_nodes=users.entropy_side_nodes,
        entropy_detached=[
            safety.requires_grad(loss) > safety.requires_grad(user) for user in users.entropy_users
        ],
        dummy_targets=canonical.form(loss) == canonical.ENTROPY,
        anchor=anchor,
        detach_operands=not safety.requires_grad(options.log_softmax or options.logits),
        kept_logits=[] if dropped else users.escaping,
        dropped_logits=dropped,
    )


def _serve_row_outputs(found: _Candidate, order: dict[Node, int]) -> tuple[Node, list, list]:
    """(anchor, lse shapes, entropy shapes): the logsumexp and entropy users the op can serve
    stay in ``users`` with their shapes, the others move to ``users.escaping``; the op goes
    right before the first consumer of a served one (or the loss)."""
    users = found.users
    anchor, lse_shapes = _serve(found, users.lse_users, order, found.loss, entropy=False)
    anchor, entropy_shapes = _serve(found, users.entropy_users, order, anchor, entropy=True)
    return anchor, lse_shapes, entropy_shapes


def _serve(
    found: _Candidate, served: list[Node], order: dict[Node, int], anchor: Node, entropy: bool
) -> tuple[Node, list[Any]]:
    """The shapes of the ``served`` users that the op can serve (the others move to
    ``users.escaping``), and the anchor moved before the first consumer of any of them."""
    loss, users = found.loss, found.users
    dummy = canonical.form(loss) == canonical.ENTROPY
    target = None if dummy else found.options.target  # (dummy targets are not kept)
    ready = safety.ready_after(found.op_inputs, order)
    rows = escapes.rows_at_hidden(found.walk.head, found.walk.chain)
    shapes = []
    for user in list(served):
        shape = escapes.lse_shape(user, target, rows)
        # The op serves a row output only with its rows, before the output's first consumer,
        # at a point where its inputs exist and the loss's grad mode holds (an entropy read
        # without a gradient is served detached).
        first = min([loss, *safety.live_users(user)], key=order.__getitem__)
        sizes_from = [shape, target if shape == "targets" else None]
        grad = safety.requires_grad(user), safety.requires_grad(loss)
        servable = (
            shape is not None
            and order[first] > max(ready, safety.ready_after(sizes_from, order))
            and (grad[0] == grad[1] or (entropy and grad[1]))
            and not safety.grad_mode_changes(first, loss, order)
        )
        if servable:
            shapes.append(shape)
            anchor = min(anchor, first, key=order.__getitem__)
        else:
            served.remove(user)
            users.escaping.append(_logits_read(user, found) if entropy else user)
    return anchor, shapes


def _logits_read(user: Node, found: _Candidate) -> Node:
    """The head or chain node an entropy user reads (through its casts and row views)."""
    logits = [found.walk.head, *found.walk.chain]
    node = user.args[0]
    while node not in logits:
        node = node.args[0]
    return node


def _left_alone(found: _Candidate) -> Rejection | None:
    """Why a form the rules marked as not to be fused (``canonical.LEFT_ALONE``), an entropy
    the op would serve or the loss made for one, keeps the site unfused; beside the user's own
    loss under CCE_ESCAPING_LOGITS=rewrite, the kept logits serve it instead (the journal puts
    the user's form back), as any other use."""
    users = found.users
    marked = [u for u in users.entropy_users if canonical.LEFT_ALONE in u.meta]
    own_loss = canonical.LEFT_ALONE not in found.loss.meta
    if marked and own_loss and config.get().escaping_logits == "rewrite":
        for user in marked:
            users.entropy_users.remove(user)
            logits = _logits_read(user, found)
            users.escaping += [] if logits in users.escaping else [logits]
        return None
    if not own_loss:  # (the entropy's own site: its reason alone)
        return Rejection(found.loss, INEXACT_FORM, found.loss.meta[canonical.LEFT_ALONE])
    if marked:
        why = marked[0].meta[canonical.LEFT_ALONE]
        return Rejection(found.loss, INEXACT_FORM, f"an entropy of these logits: {why}")
    return None


def _write_in_region(found: _Candidate, anchor: Node, order: dict[Node, int]) -> Rejection | None:
    """Eager reads the head's operands and the logits from the head to their last consumer,
    the targets and weights at the loss; the op reads all of them at the anchor."""
    loss, walk, operands = found.loss, found.walk, found.operands
    last = max([loss, *found.users.lse_users], key=order.__getitem__)
    # Through a looked-through cast, eager read the operand at the cast, before the head.
    read_from = min([walk.head, *operands.casts], key=order.__getitem__)
    logits_side = [operands.hidden, operands.classifier, operands.bias, walk.head, *walk.chain]
    loss_side = [found.targets, found.options.target, found.options.weight]
    regions = [(logits_side, read_from, last), (loss_side, anchor, loss)]
    return safety.write_in_region(loss, regions, order)


def _escape(found: _Candidate) -> Rejection | list[Node]:
    """Under the CCE_ESCAPING_LOGITS setting: why escaping logits keep the site from being
    rewritten, or the returned nodes a placeholder replaces (``drop``; [] if none)."""
    escaping = found.users.escaping
    policy = config.get().escaping_logits
    if not escaping or policy == "rewrite":
        return []
    logits = [found.walk.head, *found.walk.chain]
    # The users the op serves (an entropy, a z-loss's logsumexp) are the site's own: returned
    # logits are dropped beside them as beside the loss alone.
    users = found.users
    served = [*users.lse_users, *users.side_nodes, *users.entropy_users, *users.entropy_side_nodes]
    inside = [*found.inside, *served]
    forms = escapes.returned_forms(escaping, logits, inside)
    training = safety.requires_grad(found.loss)
    droppable = (
        forms is not None
        and training
        and escapes.shapes_rebuildable(forms, found.operands.hidden, found.targets)
    )
    if policy == "drop" and droppable:
        return forms
    detail = escapes.escape_detail(escaping, inside, policy, training, forms is not None)
    detail = "; ".join([detail, *found.notes])
    return Rejection(found.loss, ESCAPES, detail, quiet=escapes.quiet(policy, training))


# --- surgery ---------------------------------------------------------------------------------


def choose_site_mode(site: PlainSite, needs: tuple[bool, bool, bool]) -> str:
    """The op's mode for a site (``decide.mode``), on the example sizes.

    Under dynamic shapes the sizes are hints: the choice is a performance decision only (both
    modes compute the same values), so it adds no guard; a symbolic row count is planned for
    the larger calls the graph also runs (``decide.planned_rows``).
    """
    classifier = p.tensor_value(site.classifier)
    vocab, dim = (p.size_hint(s) or 1 for s in classifier.shape)
    if site.classifier_is_transposed:
        vocab, dim = dim, vocab
    operands = (p.tensor_value(site.hidden), classifier)
    rows = decide.planned_rows(*p.size_range(site.rows))
    device = operands[0].device.type
    dtypes = tuple(t.dtype for t in operands)
    compute = site.compute_dtype
    problem = policy.problem(
        rows, (vocab, dim), compute, device, compute_dtype=compute, dtypes=dtypes
    )
    bias = None if site.bias is None else p.tensor_value(site.bias)
    return decide.mode(
        None,
        problem,
        dict(zip(GRAD_FLAGS, needs)),
        dtypes=decide.operand_dtypes(*operands, bias),
        reduction=site.reduction,
        grad_filter=site_grad_filter(site),
        lse_has_grad=bool(site.lse_users),
        softcap=bool(site.softcap),
        entropy=bool(site.entropy_users),
        entropy_has_grad=not all(site.entropy_detached),
    )


def site_grad_filter(site: PlainSite) -> float | None:
    """CCE_GRAD_FILTER for this site (``decide.site_grad_filter``)."""
    return decide.site_grad_filter(site.label_smoothing, site.softcap)


def _operand(emit: Emitter, node: Node | None, site: PlainSite) -> Node | None:
    """An operand as the head saw it: no gradient flows to it if none flows to the logits.
    Inside inference_mode no gradient flows at all, and detach() there would fail."""
    if node is None or not site.detach_operands or not p.tensor_value(node).requires_grad:
        return node
    if safety.inference_mode_at(emit.anchor):
        return node
    return emit(aten.detach.default, node)


def _rewrite(graph: Graph, site: PlainSite) -> Node:
    """Replace ``site`` in ``graph`` by the op; returns the op node."""
    emit = Emitter(graph, site.anchor)
    rows = rows_of_hidden(emit, _operand(emit, site.hidden, site), site)
    op = emit(OP, *_op_arguments(emit, site, rows))
    save_inputs_not_views(op)
    if safety.live_users(site.loss):  # (an entropy's site has no loss to give)
        site.loss.replace_all_uses_with(loss_value(Emitter(graph, site.loss), site, op))
    _serve_users(emit, site, op, rows, "lse", site.lse_users, site.lse_shapes)
    detached = [u for u, d in zip(site.entropy_users, site.entropy_detached) if d]
    entropy_users = (site.entropy_users, site.entropy_shapes, detached)
    _serve_users(emit, site, op, rows, "entropy", *entropy_users)
    _drop_returned_logits(graph, site)
    erase_unused(
        graph,
        [
            *site.lse_users,
            *site.entropy_users,
            site.loss,
            *loss_target_path(site),
            *canonical.dummy_target_nodes(site.loss),
            *reversed(site.lse_side_nodes),
            *reversed(site.entropy_side_nodes),
            *reversed(site.loss_views),
            site.log_softmax,
            *reversed(site.chain),
            site.head,
            *site.transposes,
            *site.operand_casts,
        ],
    )
    return op


def _serve_users(
    emit: Emitter, site: PlainSite, op: Node, rows: Node, output: str, users, shapes, detached=()
) -> None:
    """Replace each of ``users`` by the op's per-row ``output``, in its shape and dtype
    (detached for those in ``detached``: read without a gradient)."""
    if not users:
        return
    value = emit(operator.getitem, op, FORWARD_RETURNS.index(output))
    for user, shape in zip(users, shapes):
        served = emit(aten.reshape.default, value, _lse_sizes(emit, user, shape, site, rows))
        if user in detached:
            served = emit(aten.detach.default, served)
        user.replace_all_uses_with(cast(emit, served, p.tensor_value(user).dtype))


def _op_arguments(emit: Emitter, site: PlainSite, rows: Node) -> tuple:
    """The op's arguments for the site, ``rows`` being hidden at the loss rows."""
    # Operands in a wider dtype than the head's (autocast, or a cast looked through) go to the
    # op as they are, with compute_dtype: it rounds them as autocast would, and returns their
    # gradients in their own dtypes, so no rounded V x D copy of the classifier is made.
    dtype = site.compute_dtype
    operands = [n for n in (site.hidden, site.classifier, site.bias) if n is not None]
    rounds = any(p.tensor_value(n).dtype != dtype for n in operands)
    hidden = canonical_hidden(emit, rows)
    classifier = _operand(emit, site.classifier, site)
    if site.classifier_is_transposed:
        classifier = emit(aten.t.default, classifier)
    bias = _operand(emit, site.bias, site)
    if site.dummy_targets:  # zeros, one per row: only the entropy is read
        shape = shape_of(emit, hidden, leading=2)
        device = p.tensor_value(hidden).device
        targets = emit(aten.zeros.default, shape, dtype=torch.int64, device=device)
    else:
        targets = targets_as_rows(emit, site.targets, hidden)
    flows = p.tensor_value(site.loss).requires_grad and not site.detach_operands
    needs = tuple(
        bool(flows and n is not None and p.tensor_value(n).requires_grad)
        for n in (site.hidden, site.classifier, site.bias)
    )
    return FORWARD.build(
        hidden=hidden,
        classifier=classifier,
        targets=targets,
        bias=bias,
        class_weights=site.class_weights,
        compute_dtype=dtype if rounds else None,
        **loss_arguments(emit, site),
        lse_all_rows=bool(site.lse_users),
        return_entropy=bool(site.entropy_users),
        # Beside the user's own cross_entropy, eager's entropy counts the rows it ignores.
        metrics_all_rows=bool(site.entropy_users) and canonical.form(site.loss) is None,
        mode=choose_site_mode(site, needs),
        grad_hidden=needs[0],
        grad_classifier=needs[1],
        grad_bias=needs[2],
        implementation_version=IMPLEMENTATION_VERSION,
        grad_filter=site_grad_filter(site),
        skip_ignored=decide.site_compacts_ignored_rows(),
    )


def _drop_returned_logits(graph: Graph, site: PlainSite) -> None:
    """CCE_ESCAPING_LOGITS=drop: the graph returns, for each of the logits it returned (or
    each float cast of them it returned), a ``LogitsNotComputed`` placeholder of their shape
    and dtype: it holds no data, and any read of it raises an error that says why and names
    the setting that keeps the logits (``placeholder.py``)."""
    output = graph.output_node()
    emit = Emitter(graph, output)
    where = location(site.loss)
    for node in site.dropped_logits:
        value = p.tensor_value(node)
        sizes = _sizes(emit, value.shape, [site.hidden, site.targets])
        dropped = emit(placeholder.OP, sizes, value.dtype, value.device, where)
        output.replace_input_with(node, dropped)
    logits = [site.head, *site.chain]
    erase_unused(graph, [c for n in site.dropped_logits for c in escapes.cast_path(n, logits)])


def _sizes(emit: Emitter, shape: Any, sources: list[Node]) -> list[Any]:
    """``shape`` as op arguments, each symbolic size read from where ``p.size_source`` finds
    it (matching made sure every size has a source)."""
    holders = p.symint_holders(emit.graph)
    sizes: list[Any] = []
    for size in shape:
        source = p.size_source(size, holders, sources)
        if isinstance(source, tuple) and source[1] == "numel":
            source = emit(aten.sym_numel.default, source[0])
        elif isinstance(source, tuple):
            tensor, dim = source
            ndim = p.tensor_value(tensor).dim()
            dims = [dim] if dim is not None else range(ndim - 1)
            source = None
            for i in dims:
                read = emit(aten.sym_size.int, tensor, i)
                source = read if source is None else emit(operator.mul, source, read)
        sizes.append(source)
    return sizes


def _lse_sizes(emit: Emitter, user: Node, shape: Any, site: PlainSite, rows: Node) -> list[Any]:
    """Sizes for the lse served to a logsumexp user, from nodes that outlive the logits."""
    if isinstance(shape, list):  # the user's own sizes: ints and the graph's SymInt nodes
        return shape
    if shape == "targets":
        return shape_of(emit, site.loss_targets)
    if shape == "rows":
        return shape_of(emit, rows, leading=p.tensor_value(rows).dim() - 1)
    return [-1]
