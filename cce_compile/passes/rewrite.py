"""Graph surgery: replace a matched site's logits chain and loss with ``cce::linear_cross_entropy``.

Only ``torch.ops`` overloads and builtins are emitted (a Python-function target would make
AOTAutograd bypass its cache), every new node gets ``example_value`` (and ``val``) computed under
the graph's fake mode, no placeholder is added, and only the replaced nodes that became dead
are erased. The op takes ``hidden`` as (B, T, D) and ``targets`` as (B, T): hidden keeps the
leading shape it has at the head (after any replayed row slices) and targets are reshaped to it.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings

from .. import config, policy
from ..op_signature import FORWARD
from ..ops import IMPLEMENTATION_VERSION
from . import predicates as p
from . import safety
from .matching import Site

aten = torch.ops.aten
OP = torch.ops.cce.linear_cross_entropy.default


class _Emitter:
    """Creates nodes before ``anchor`` with example values and the anchor's source meta."""

    def __init__(self, graph: Graph, anchor: Node, fake_mode: Any = None):
        self.graph = graph
        self.anchor = anchor
        fake = p.tensor_value(anchor)
        self.fake_mode = fake.fake_mode if fake is not None else fake_mode

    def __call__(self, target, *args: Any, **kwargs: Any) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        p.copy_source_meta(node, self.anchor)
        with self.fake_mode:
            value = target(*p.example_args(args), **p.example_args(kwargs))
        node.meta["example_value"] = value
        node.meta["val"] = value
        # A size that depends on data (the op's row_index) is a new unbacked symbol: bind it
        # to this node, as Dynamo does for the nodes it traces.
        shape_env = getattr(self.fake_mode, "shape_env", None)
        if shape_env is not None:
            bindings = compute_unbacked_bindings(shape_env, value)
            if bindings:
                node.meta["unbacked_bindings"] = bindings
        return node


def _scalar_product(emit: _Emitter, factors: list[tuple[Any, bool]]) -> Any:
    """The product of (scalar, divides) factors: a float, or a node when any is symbolic."""
    constant, nodes = 1.0, []
    for factor, divides in factors:
        if isinstance(factor, Node):
            nodes.append((factor, divides))
        else:
            constant = constant / factor if divides else constant * factor
    result: Any = constant
    for factor, divides in nodes:
        result = emit(operator.truediv if divides else operator.mul, result, factor)
    return result


def _as_float(value: Any) -> Any:
    """Python numbers become floats; SymFloat/SymInt nodes stay nodes."""
    return value if isinstance(value, Node) else float(value)


def _cast(emit: _Emitter, node: Node | None, dtype: torch.dtype) -> Node | None:
    if node is None or p.tensor_value(node).dtype == dtype:
        return node
    return emit(aten._to_copy.default, node, dtype=dtype)


def _canonical_hidden(emit: _Emitter, hidden: Node) -> Node:
    """hidden (..., D) -> (B, T, D), a view: rows keep their order."""
    ndim = p.tensor_value(hidden).dim()
    if ndim == 1:
        return emit(aten.view.default, hidden, [1, 1, -1])
    if ndim == 2:
        return emit(aten.unsqueeze.default, hidden, 0)
    if ndim == 3:
        return hidden
    return emit(aten.flatten.using_ints, hidden, 0, ndim - 3)


def choose_site_mode(site: Site, needs: tuple[bool, bool, bool]) -> str:
    """The op's mode for a site: the configured one, resolved on the example sizes.

    Under dynamic shapes the sizes are hints: the choice is a performance decision only (both
    modes compute the same values), so it adds no guard.
    """
    settings = config.get()
    vocab, dim = (p.size_hint(s) or 1 for s in p.tensor_value(site.classifier).shape)
    if site.classifier_is_transposed:
        vocab, dim = dim, vocab
    common = dict(
        reduction=site.reduction,
        needs_grad=any(needs),
        needs_classifier=needs[1],
        lse_has_grad=bool(site.lse_users),
    )
    operands = (site.hidden, site.classifier)
    problem = policy.Problem(
        rows=p.size_hint(site.rows) or 1,
        vocab=vocab,
        dim=dim,
        logit_bytes=site.compute_dtype.itemsize,
        rounds_inputs=any(p.tensor_value(n).dtype != site.compute_dtype for n in operands),
    )
    budget = policy.budget_bytes(problem, settings.memory_budget_mb, settings.memory_fraction)
    requested = "lean" if site_grad_filter(site) is not None else settings.mode
    return policy.choose_mode(requested, problem=problem, budget=budget, **common)


def site_skips_ignored() -> bool:
    """CCE_SKIP_IGNORED, unless Inductor runs this graph as CUDA graphs: compaction sizes
    the work by the targets' values (a host sync), which a captured graph cannot do."""
    import torch._inductor.config as inductor_config

    return config.get().skip_ignored and not inductor_config.triton.cudagraphs


def site_grad_filter(site: Site) -> float | None:
    """CCE_GRAD_FILTER for this site, unless its label smoothing is under a softcap (then
    the smoothing term's gradient needs every logit: filtering.check_options)."""
    beta = config.get().grad_filter
    smoothing = site.label_smoothing
    if beta is None or (site.softcap is not None and (isinstance(smoothing, Node) or smoothing)):
        return None
    return beta


def _operand(emit: _Emitter, node: Node | None, site: Site) -> Node | None:
    """An operand as the head saw it: no gradient flows to it if none flows to the logits.
    Inside inference_mode no gradient flows at all, and detach() there would fail."""
    if node is None or not site.detach_operands or not p.tensor_value(node).requires_grad:
        return node
    if safety.inference_mode_at(emit.anchor):
        return node
    return emit(aten.detach.default, node)


def rewrite_site(graph: Graph, site: Site) -> Node:
    """Replace ``site`` in ``graph``; returns the op node."""
    loss = site.loss
    emit = _Emitter(graph, site.anchor)
    dtype = site.compute_dtype
    rows = _operand(emit, site.hidden, site)  # the logits' leading shape at the head
    for index in site.row_indices:
        rows = emit(operator.getitem, rows, index)
    # Operands in a wider dtype than the head's (autocast, or a cast looked through) go to the
    # op as they are, with compute_dtype: it rounds them as autocast would, and returns their
    # gradients in their own dtypes, so no rounded V x D copy of the classifier is made.
    operands = [n for n in (site.hidden, site.classifier, site.bias) if n is not None]
    rounds = any(p.tensor_value(n).dtype != dtype for n in operands)
    hidden = _canonical_hidden(emit, rows)
    classifier = _operand(emit, site.classifier, site)
    if site.classifier_is_transposed:
        classifier = emit(aten.t.default, classifier)
    bias = _operand(emit, site.bias, site)
    hidden_value = p.tensor_value(hidden)
    targets = emit(
        aten.reshape.default,
        site.targets,
        [emit(aten.sym_size.int, hidden, 0), emit(aten.sym_size.int, hidden, 1)]
        if any(isinstance(s, torch.SymInt) for s in hidden_value.shape[:2])
        else list(hidden_value.shape[:2]),
    )

    flows = p.tensor_value(loss).requires_grad and not site.detach_operands
    needs = tuple(
        bool(flows and n is not None and p.tensor_value(n).requires_grad)
        for n in (site.hidden, site.classifier, site.bias)
    )
    op = emit(
        OP,
        *FORWARD.build(
            hidden=hidden,
            classifier=classifier,
            targets=targets,
            bias=bias,
            class_weights=site.class_weights,
            compute_dtype=dtype if rounds else None,
            ignore_index=site.ignore_index,
            reduction=site.reduction,
            label_smoothing=_as_float(site.label_smoothing),
            softcap=None if site.softcap is None else _as_float(site.softcap),
            logit_scale=_as_float(_scalar_product(emit, site.scale_factors)),
            shift=0,  # row slices were replayed on hidden
            z_loss=0.0,  # a user's z-loss reads the op's lse instead
            lse_all_rows=bool(site.lse_users),
            mode=choose_site_mode(site, needs),
            grad_hidden=needs[0],
            grad_classifier=needs[1],
            grad_bias=needs[2],
            implementation_version=IMPLEMENTATION_VERSION,
            grad_filter=site_grad_filter(site),
            skip_ignored=site_skips_ignored(),
        ),
    )
    at_loss = _Emitter(graph, loss)  # the loss's replacement may need its target's sizes
    new_loss = at_loss(operator.getitem, op, 0)
    if site.reduction == "none":
        new_loss = at_loss(aten.reshape.default, new_loss, _shape_of(at_loss, site.loss_targets))
    new_loss = _cast(at_loss, new_loss, p.tensor_value(loss).dtype)
    loss.replace_all_uses_with(new_loss)
    if site.lse_users:
        lse = emit(operator.getitem, op, 1)
        for user, shape in zip(site.lse_users, site.lse_shapes):
            served = emit(aten.reshape.default, lse, _lse_shape(emit, user, shape, site, rows))
            served = _cast(emit, served, p.tensor_value(user).dtype)
            user.replace_all_uses_with(served)
            graph.erase_node(user)
    graph.erase_node(loss)
    _drop_returned_logits(graph, site, emit.fake_mode)
    _erase_dead(
        graph,
        [
            *reversed(site.lse_side_nodes),
            *reversed(site.loss_views),
            site.log_softmax,
            *reversed(site.chain),
            site.head,
            *site.transposes,
            *site.operand_casts,
        ],
    )
    return op


def _drop_returned_logits(graph: Graph, site: Site, fake_mode: Any) -> None:
    """CCE_ESCAPING_LOGITS=drop: the graph returns, for each of the logits it returned, an
    empty tensor of their shape and dtype on the 'meta' device. It holds no data, so any use
    that would read a value (``.item()``, ``.cpu()``, printing numbers, comparing with a real
    tensor) raises instead of producing a plausible number."""
    output = graph.output_node()
    emit = _Emitter(graph, output, fake_mode)
    for node in site.dropped_logits:
        value = p.tensor_value(node)
        dropped = emit(
            aten.empty.memory_format,
            _sizes(emit, value.shape, [site.hidden, site.targets]),
            dtype=value.dtype,
            device=torch.device("meta"),
        )
        output.replace_input_with(node, dropped)


def _sizes(emit: _Emitter, shape: Any, sources: list[Node]) -> list[Any]:
    """``shape`` as op arguments, each symbolic size read from where ``p.size_source`` finds
    it (matching made sure every size has a source)."""
    holders = p.symint_holders(emit.graph)
    sizes: list[Any] = []
    for size in shape:
        source = p.size_source(size, holders, sources)
        if isinstance(source, tuple):
            tensor, dim = source
            ndim = p.tensor_value(tensor).dim()
            dims = [dim] if dim is not None else range(ndim - 1)
            source = None
            for i in dims:
                read = emit(aten.sym_size.int, tensor, i)
                source = read if source is None else emit(operator.mul, source, read)
        sizes.append(source)
    return sizes


def _shape_of(emit: _Emitter, node: Node) -> list[Any]:
    value = p.tensor_value(node)
    if not any(isinstance(s, torch.SymInt) for s in value.shape):
        return list(value.shape)
    return [emit(aten.sym_size.int, node, i) for i in range(value.dim())]


def _lse_shape(emit: _Emitter, user: Node, shape: Any, site: Site, rows: Node) -> list[Any]:
    """Sizes for the lse served to a logsumexp user, from nodes that outlive the logits."""
    if isinstance(shape, list):  # the user's own sizes: ints and the graph's SymInt nodes
        return shape
    if shape == "targets":
        return _shape_of(emit, site.loss_targets)
    if shape == "rows":
        value = p.tensor_value(rows)
        if not any(isinstance(s, torch.SymInt) for s in value.shape):
            return list(value.shape[:-1])
        return [emit(aten.sym_size.int, rows, i) for i in range(value.dim() - 1)]
    return [-1]


def _erase_dead(graph: Graph, nodes: list[Node]) -> None:
    """Erase the given nodes that have no users left, in order (users before producers)."""
    for node in nodes:
        if isinstance(node, Node) and not node.users and node.graph is graph:
            graph.erase_node(node)
