"""Every head / chain / loss form the pass must recognise, and the ones it must leave alone.

Each case compiles with the pass (and AOTAutograd, no Inductor codegen: see test_backend.py for
Inductor) and compares the loss and all gradients with eager.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import OP, check

import cce_compile
from cce_compile.op.signature import FORWARD

REPLACED = {
    F.cross_entropy,
    F.nll_loss,
    torch._C._nn.linear,
    torch.matmul,
    torch.mm,
    operator.matmul,
}


def fused(outcome) -> bool:
    """The op is in the graph and the head, the logits chain's loss and the loss are gone."""
    return outcome.has_op and not REPLACED & set(outcome.targets())


B, T, D, V = 2, 7, 12, 37


def inputs(seed=0, dtype=torch.float32, vocab=V, ignored=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, D, generator=gen) / D**0.5).to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=gen) * 0.1).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (B, T), generator=gen)
    if ignored:
        y[0, 1] = -100
    return x, w, b, y


def ce(logits, y, **kw):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), **kw)


# --- heads -----------------------------------------------------------------------------------

HEADS = {
    "F.linear": lambda x, w, b: F.linear(x, w),
    "F.linear-bias": lambda x, w, b: F.linear(x, w, b),
    "matmul-T": lambda x, w, b: x @ w.T,
    "matmul-t()": lambda x, w, b: x @ w.t(),
    "torch.matmul-transpose": lambda x, w, b: torch.matmul(x, w.transpose(0, 1)),
    "mm-flattened": lambda x, w, b: torch.mm(x.view(-1, x.shape[-1]), w.t()),
    "matmul-stored-DV": lambda x, w, b: x @ w.T.contiguous(),
}


@pytest.mark.parametrize("head", HEADS.values(), ids=HEADS.keys())
def test_heads(head):
    x, w, b, y = inputs()
    outcome = check(lambda x, w, b, y: ce(head(x, w, b), y), (x, w, b, y))
    assert outcome.rewritten == 1 and fused(outcome)


def test_nn_linear_and_cross_entropy_modules():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(D, V, bias=False)
            self.loss_fct = nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.1)

        def forward(self, x, y):
            return self.loss_fct(self.lm_head(x).view(-1, V), y.view(-1))

    torch.manual_seed(0)
    x, _, _, y = inputs(ignored=False)
    y[1, 2] = -1
    outcome = check(Head(), (x, y))
    assert outcome.rewritten == 1


def test_tied_embeddings():
    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, D)
            self.block = nn.Linear(D, D)
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, ids, y):
            logits = self.lm_head(torch.tanh(self.block(self.wte(ids))))
            return ce(logits, y)

    torch.manual_seed(0)
    _, _, _, y = inputs()
    ids = torch.randint(0, V, (B, T))
    model = TinyLM()
    outcome = check(model, (ids, y))
    assert outcome.rewritten == 1


# --- chains ----------------------------------------------------------------------------------

CHAINS = {
    "float": lambda z: z.float(),
    "to-float32": lambda z: z.to(torch.float32),
    "view-size": lambda z: z.view(-1, z.size(-1)),
    "reshape": lambda z: z.reshape(B * T, V),
    "flatten": lambda z: z.flatten(0, 1),
    "contiguous": lambda z: z.contiguous(),
    "scale-mul": lambda z: z * 0.5,
    "scale-rmul-div": lambda z: 3.0 * z / 2.0,
    "softcap": lambda z: torch.tanh(z / 4.0) * 4.0,
    "softcap-cap-first": lambda z: 4.0 * (z / 4.0).tanh(),
    "scale-then-softcap": lambda z: torch.tanh((z * 2.0) / 4.0) * 4.0,
    # A temperature after the softcap: s c tanh(y / c) = c' tanh(s y / c'), c' = s c.
    "softcap-then-scale": lambda z: torch.tanh(z / 4.0) * 4.0 / 0.7,
    "everything": lambda z: (torch.tanh((z * 0.7).float() / 3.0) * 3.0).contiguous().view(-1, V),
}


@pytest.mark.parametrize("chain", CHAINS.values(), ids=CHAINS.keys())
def test_chains(chain):
    x, w, b, y = inputs()
    outcome = check(lambda x, w, y: ce(chain(F.linear(x, w)), y), (x, w, y))
    assert outcome.rewritten == 1 and fused(outcome)
    assert torch.tanh not in outcome.targets()


def test_hugging_face_shift_slicing():
    def loss(x, w, labels):
        logits = F.linear(x, w)
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return F.cross_entropy(shift_logits.view(-1, V), shift_labels.view(-1))

    x, w, _, y = inputs()
    assert check(loss, (x, w, y)).rewritten == 1


def test_hugging_face_padded_labels():
    def loss(x, w, labels):
        logits = F.linear(x, w).float()
        labels = F.pad(labels, (0, 1), value=-100)
        shift_labels = labels[..., 1:].contiguous()
        return (
            F.cross_entropy(
                logits.view(-1, V), shift_labels.view(-1), ignore_index=-100, reduction="sum"
            )
            / 5
        )

    x, w, _, y = inputs()
    assert check(loss, (x, w, y)).rewritten == 1


def test_logits_to_keep_slice_before_head():
    def loss(x, w, labels, keep):
        return ce(F.linear(x[:, -keep:, :], w), labels[:, -keep:])

    x, w, _, y = inputs()
    assert check(loss, (x, w, y, 4)).rewritten == 1


# --- losses ----------------------------------------------------------------------------------

LOSSES = {
    "positional": lambda z, y, cw: F.cross_entropy(z, y, None, None, -1, None, "sum", 0.1),
    "keywords": lambda z, y, cw: F.cross_entropy(input=z, target=y, reduction="mean"),
    "weights": lambda z, y, cw: F.cross_entropy(z, y, cw, ignore_index=-100),
    "none": lambda z, y, cw: F.cross_entropy(z, y, reduction="none", label_smoothing=0.2),
    "module": lambda z, y, cw: nn.CrossEntropyLoss(weight=cw, label_smoothing=0.05)(z, y),
    "log_softmax-nll": lambda z, y, cw: F.nll_loss(F.log_softmax(z, dim=-1), y),
    "torch.log_softmax-nll": lambda z, y, cw: F.nll_loss(
        torch.log_softmax(z, 1), y, reduction="sum"
    ),
    "method-log_softmax-nll": lambda z, y, cw: F.nll_loss(
        z.log_softmax(-1), y.clamp(min=0), ignore_index=3
    ),
    "sum-over-num-items": lambda z, y, cw: F.cross_entropy(z, y, reduction="sum") / 9,
}


@pytest.mark.parametrize("loss", LOSSES.values(), ids=LOSSES.keys())
def test_losses(loss):
    x, w, _, y = inputs(ignored=False)
    y[1, 3] = -1 if loss is LOSSES["positional"] else -100  # that case has ignore_index=-1
    cw = torch.rand(V) + 0.5
    fn = lambda x, w, y, cw: loss(F.linear(x, w).view(-1, V), y.view(-1), cw)  # noqa: E731
    outcome = check(fn, (x, w, y, cw))
    assert outcome.rewritten == 1 and fused(outcome)


FORMS = {  # written as users write them; each compared with eager
    "log_softmax-then-view-nll": lambda x, w, b, y: F.nll_loss(
        F.log_softmax(F.linear(x, w).float(), -1).view(-1, V), y.view(-1)
    ),
    "class-dim-1-transpose": lambda x, w, b, y: F.cross_entropy(
        F.linear(x, w).transpose(1, 2), y, label_smoothing=0.1
    ),
    "class-dim-1-permute-none": lambda x, w, b, y: F.cross_entropy(
        F.linear(x, w).permute(0, 2, 1), y, reduction="none"
    ).sum(),
    "matmul-plus-bias": lambda x, w, b, y: ce(x @ w.T + b, y),
    "bias-plus-matmul-softcap": lambda x, w, b, y: ce(torch.tanh((b + x @ w.t()) / 5.0) * 5.0, y),
}


@pytest.mark.parametrize("fn", FORMS.values(), ids=FORMS.keys())
def test_forms_users_write(fn):
    outcome = check(fn, inputs())
    assert outcome.rewritten == 1 and fused(outcome)
    assert operator.add not in outcome.targets()  # the bias went into the op


def test_class_dim_1_without_a_move_is_left_alone():
    x, w, b, y = inputs()
    # A (B, V, T) tensor straight from a head over another layout: classes really in dim 1.
    fn = lambda x, w, b, y: F.cross_entropy(F.linear(x, w).view(B, V, T), y)  # noqa: E731
    outcome = check(fn, (x, w, b, y))
    assert outcome.rewritten == 0


def test_num_items_in_batch_tensor():
    def loss(x, w, y, n):
        return F.cross_entropy(F.linear(x, w).view(-1, V), y.view(-1), reduction="sum") / n.to(
            x.device
        )

    x, w, _, y = inputs()
    assert check(loss, (x, w, y, torch.tensor(11))).rewritten == 1


@pytest.mark.skipif(not hasattr(F, "linear_cross_entropy"), reason="torch < 2.13")
def test_torch_linear_cross_entropy():
    x, w, _, y = inputs()
    fn = lambda x, w, y: F.linear_cross_entropy(x.view(-1, D), w, y.view(-1))  # noqa: E731
    assert check(fn, (x, w, y)).rewritten == 1


def test_z_loss_through_returned_lse():
    def loss(x, w, y):
        logits = F.linear(x, w).float()
        z = torch.logsumexp(logits, dim=-1)
        return ce(logits, y) + 1e-3 * z.pow(2).mean()

    x, w, _, y = inputs()
    outcome = check(loss, (x, w, y))
    assert outcome.rewritten == 1
    assert torch.logsumexp not in outcome.targets()


def _z_loss_of_all_rows_with_shifted_ce(x, w, y):
    logits = F.linear(x, w)
    z = torch.logsumexp(logits, dim=-1)  # every row; the loss sees all but the last
    return ce(logits[:, :-1], y[:, 1:]) + 1e-2 * z.pow(2).mean()


def _z_loss_of_all_rows_with_flat_slice(x, w, y):
    logits = F.linear(x.view(-1, D), w)
    z = torch.logsumexp(logits, dim=-1)
    return F.cross_entropy(logits[:-1], y.view(-1)[1:]) + 1e-2 * z.pow(2).mean()


def _z_loss_on_a_reshaped_view(x, w, y):
    logits = F.linear(x, w).view(T, B, V)  # the same rows, in another leading shape
    z = torch.logsumexp(logits, dim=-1)
    return ce(logits, y.view(T, B)) + 1e-2 * z[0].pow(2).sum()


# The op's lse covers the loss rows only: a logsumexp over rows the loss slices away cannot
# be served by it and keeps the logits (left alone); one over the loss rows in another shape
# is served, reshaped.
LSE_ROWS = {
    "all-rows-shifted-ce": (_z_loss_of_all_rows_with_shifted_ce, 0),
    "all-rows-flat-slice": (_z_loss_of_all_rows_with_flat_slice, 0),
    "reshaped-view": (_z_loss_on_a_reshaped_view, 1),
}


@pytest.mark.parametrize("fn, rewritten", LSE_ROWS.values(), ids=LSE_ROWS.keys())
def test_logsumexp_rows_must_be_the_loss_rows(fn, rewritten):
    x, w, _, y = inputs()
    outcome = check(fn, (x, w, y), backward_all=True)
    assert outcome.rewritten == rewritten
    if not rewritten:
        assert outcome.skipped == {"logits_escape": 1}


# --- autocast ---------------------------------------------------------------------------------


def no_rounded_copies(outcome) -> bool:
    """The rewritten graphs hold no cast of an operand: the op rounds (compute_dtype)."""
    casts = {"to", "bfloat16", "half", "type"}
    return not any(
        n.target is torch.ops.aten._to_copy.default or (n.op == "call_method" and n.target in casts)
        for g in outcome.graphs
        for n in g.graph.nodes
    )


AMP = {  # (loss, gradients: x, w, and b where it is used)
    "autocast-inside": (lambda x, w, b, y: _autocast_head(x, w, b, y), 3),
    "explicit-casts": (
        lambda x, w, b, y: ce(
            F.linear(x.to(torch.bfloat16), w.bfloat16(), b.to(torch.bfloat16)).float(), y
        ),
        3,
    ),
    "explicit-cast-matmul": (
        lambda x, w, b, y: ce((x.bfloat16() @ w.to(torch.bfloat16).T).float(), y),
        2,
    ),
}


def _autocast_head(x, w, b, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(x, w, b)
    return ce(logits.float(), y)


@pytest.mark.parametrize("fn, gradients", AMP.values(), ids=AMP.keys())
def test_float32_weights_with_a_bf16_head_are_rounded_by_the_op(fn, gradients):
    x, w, b, y = inputs()  # float32 leaves: their gradients must come back float32
    outcome = check(fn, (x, w, b, y), dtype=torch.bfloat16)
    assert outcome.rewritten == 1 and fused(outcome)
    assert no_rounded_copies(outcome)
    assert outcome.gradients == gradients  # compared with eager's, float32 like eager's


def test_autocast_outside_compiled_region():
    x, w, b, y = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outcome = check(
            lambda x, w, b, y: ce(F.linear(x, w, b).float(), y), (x, w, b, y), dtype=torch.bfloat16
        )
    assert outcome.rewritten == 1 and no_rounded_copies(outcome)


def test_bf16_weights_need_no_rounding():
    x, w, b, y = inputs(dtype=torch.bfloat16)
    outcome = check(lambda x, w, y: ce(F.linear(x, w).float(), y), (x, w, y), dtype=torch.bfloat16)
    assert outcome.rewritten == 1
    (op,) = [n for g in outcome.graphs for n in g.graph.nodes if n.target == OP]
    assert op.args[FORWARD.index("compute_dtype")] is None


# --- dead uses of the logits ------------------------------------------------------------------
# Dead code (a view nothing reads, a chain of them) decides nothing: the site is rewritten and
# the dead views go with the logits. Dynamo keeps them in the graph. (Sizes are read from the
# logits, not written as constants: a constant size would specialise the symbolic one under
# dynamic=True, and Dynamo then reads ``logits.shape[-1]`` as a ``size()`` of the logits.)


def _dead_view_class_dim_1(x, w, b, y):
    logits = F.linear(x, w)
    logits.view(-1, logits.shape[-1])  # never used
    return F.cross_entropy(logits.transpose(1, 2), y)


def _dead_reshape(x, w, b, y):
    logits = F.linear(x, w)
    logits.reshape(-1, logits.size(-1))
    return ce(logits, y)


def _dead_chain_of_views_class_dim_1(x, w, b, y):
    logits = F.linear(x, w, b)
    logits.flatten(0, 1).float().view(logits.shape).contiguous()
    return F.cross_entropy(logits.permute(0, 2, 1), y, reduction="none").sum()


def _dead_views_of_the_chain_and_of_log_softmax(x, w, b, y):
    logits = torch.tanh(F.linear(x, w) / 4.0) * 4.0
    logits.flatten(0, 1)
    log_probs = F.log_softmax(logits.float(), -1)
    log_probs.reshape(-1, log_probs.shape[-1])
    return F.nll_loss(log_probs.flatten(0, 1), y.view(-1))


def _dead_view_beside_a_z_loss(x, w, b, y):
    logits = F.linear(x, w).float()
    logits.view(-1, logits.shape[-1])
    z = torch.logsumexp(logits, dim=-1)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()) + 1e-3 * z.pow(2).mean()


DEAD_USES = {
    "dead-view-class-dim-1": _dead_view_class_dim_1,
    "dead-reshape": _dead_reshape,
    "dead-chain-of-views-class-dim-1": _dead_chain_of_views_class_dim_1,
    "dead-views-of-the-chain-and-of-log_softmax": _dead_views_of_the_chain_and_of_log_softmax,
    "dead-view-beside-a-z-loss": _dead_view_beside_a_z_loss,
}


@pytest.mark.parametrize("fn", DEAD_USES.values(), ids=DEAD_USES.keys())
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_dead_uses_of_the_logits_do_not_block_the_rewrite(fn, dynamic):
    outcome = check(fn, inputs(), dynamic=dynamic)
    assert outcome.rewritten == 1 and outcome.skipped == {}, outcome
    assert fused(outcome) and torch.logsumexp not in outcome.targets()


# --- left alone ------------------------------------------------------------------------------


def _returns_logits(x, w, y):
    logits = F.linear(x, w)
    return ce(logits, y), logits


NEGATIVE = {  # (returned logits: test_escaping_logits.py)
    "argmax": (
        lambda x, w, y: (ce(F.linear(x, w), y), F.linear(x, w).argmax(-1)),
        None,
    ),  # two heads: the second is independent, the first rewrites
    "second-loss": (
        lambda x, w, y: (lambda z: ce(z, y) + z.square().mean())(F.linear(x, w)),
        "logits_escape",
    ),
    "cast-to-half": (lambda x, w, y: ce(F.linear(x, w).half(), y), "unsupported_op_in_chain"),
    "softcap-constants-differ": (
        lambda x, w, y: ce(torch.tanh(F.linear(x, w) / 4) * 5, y),
        "unsupported_op_in_chain",
    ),
    "scaled-by-a-tensor": (
        lambda x, w, y: ce(F.linear(x, w) * w.new_full((), 1.5), y),
        "unsupported_op_in_chain",
    ),
    "nonlinear-in-chain": (
        lambda x, w, y: ce(torch.relu(F.linear(x, w)), y),
        "unsupported_op_in_chain",
    ),
}


@pytest.mark.parametrize("fn, reason", NEGATIVE.values(), ids=NEGATIVE.keys())
def test_left_alone_matches_eager(fn, reason):
    x, w, _, y = inputs()
    outcome = check(fn, (x, w, y), backward_all=True)
    if reason is None:
        assert outcome.rewritten == 1
    else:
        assert outcome.rewritten == 0 and outcome.skipped == {reason: 1}
        assert not outcome.has_op


def test_escaping_logits_name_their_users_not_the_class_dim_move():
    def fn(x, w, y):
        logits = F.linear(x, w)
        return F.cross_entropy(logits.transpose(1, 2), y), logits.argmax(-1)

    x, w, _, y = inputs()
    (site,) = cce_compile.explain(fn, x, w, y).sites
    assert site.reason == "logits_escape"
    assert "also used by argmax;" in site.detail, site.detail


def test_probability_targets_left_alone():
    x, w, _, _ = inputs()
    probs = torch.softmax(torch.randn(B * T, V), -1)
    fn = lambda x, w, p: F.cross_entropy(F.linear(x, w).view(-1, V), p)  # noqa: E731
    outcome = check(fn, (x, w, probs))
    assert outcome.skipped == {"unsupported_option": 1}


def test_graph_break_between_head_and_loss():
    def fn(x, w, y):
        logits = F.linear(x, w)
        torch._dynamo.graph_break()
        return ce(logits, y)

    x, w, _, y = inputs()
    outcome = check(fn, (x, w, y), fullgraph=False)
    assert outcome.rewritten == 0 and outcome.skipped == {"logits_from_graph_input": 1}


def test_escaping_logits_policy_rewrites_and_keeps_gradients():
    from cce_compile import config

    x, w, _, y = inputs()
    with config.override(escaping_logits="rewrite"):
        # backward through the loss *and* the returned logits: both gradient paths must flow.
        outcome = check(_returns_logits, (x, w, y), backward_all=True)
    assert outcome.rewritten == 1 and outcome.has_op


def test_dtensor_weights_left_alone():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        x, w, _, y = inputs()
        dw = distribute_tensor(w.detach(), mesh, [Replicate()]).requires_grad_()
        dx = distribute_tensor(x.detach().view(-1, D), mesh, [Replicate()])
        dy = distribute_tensor(y.view(-1), mesh, [Replicate()])
        outcome = check(lambda x, w, y: F.cross_entropy(F.linear(x, w), y), (dx, dw, dy))
        assert outcome.rewritten == 0 and outcome.skipped == {"dtensor_weights": 1}
    finally:
        dist.destroy_process_group()
