"""RL's graph forms (issue 39): per-token log-probs and entropy as TRL 1.16, verl and OpenRLHF
write them, each fused into one op call per head and exact against float64, values and
gradients, in float32, bf16 and under AMP; the forms that cannot fuse are left as written and
say why.

Every fused form runs on its own head in one compiled graph (one compile per dtype: the forms
also meet each other there), with the pass and AOTAutograd (no Inductor codegen, as
``harness.check``). The rules themselves have their unit tests in test_rl_rules.py.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F
from harness import check
from oracle import GRAD_RTOL, assert_close
from rl_forms import trl_entropy, trl_log_probs, verl_entropy, verl_log_probs
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters

import cce_compile
from cce_compile.passes import safety, tracing
from cce_compile.passes.graph_pass import run_on_module

OP = torch.ops.cce.linear_cross_entropy.default
B, T, D, V, K = 2, 7, 12, 37, 4  # K: the completion tokens TRL keeps (logits_to_keep)
TEMPERATURE = 0.7
# Outputs are rounded once to their dtype (bf16: half an ulp, 2^-9); float32's accumulate.
VALUE_RTOL = {torch.float32: 2e-5, torch.bfloat16: 2**-8}


# --- the forms, as the libraries write them (rl_forms.py), one per head ----------------------


def log_softmax_gather(x, w, ids):
    z = F.linear(x, w) / TEMPERATURE
    return F.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1), trl_entropy(z)


def gather_minus_logsumexp(x, w, ids):
    z = F.linear(x, w) * (1 / TEMPERATURE)
    log_probs = z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, -1)
    return log_probs, -(F.softmax(z, -1) * F.log_softmax(z, -1)).sum(-1)


def trl_sliced(x, w, ids):
    logits = F.linear(x, w)[:, :-1, :]
    logits = logits[:, -K:, :] / TEMPERATURE
    return trl_log_probs(logits, ids), trl_entropy(logits)


def verl_in_place_temperature(x, w, ids):
    logits = F.linear(x, w)
    logits.div_(TEMPERATURE)
    logits = logits[:, -K - 1 : -1, :]
    return verl_log_probs(logits, ids), verl_entropy(logits)


def negated_cross_entropy(x, w, ids):
    z = F.linear(x, w) / TEMPERATURE
    return -F.cross_entropy(z.reshape(-1, V), ids.reshape(-1), reduction="none").view_as(ids)


def entropy_alone(x, w, ids):
    return trl_entropy(F.linear(x, w) / TEMPERATURE, chunk_size=4)


def row_loops(x, w, ids):
    z = F.linear(x, w) / TEMPERATURE
    rows = torch.stack([z.select(0, i).log_softmax(-1) for i in range(z.shape[0])])
    log_probs = rows.gather(-1, ids[..., None]).squeeze(-1)
    return log_probs, torch.cat([verl_entropy(c) for c in z.chunk(2, dim=0)])


def entropy_without_grad(x, w, ids):
    """TRL's selective_log_softmax_and_entropy(entropy_requires_grad=False)."""
    z = F.linear(x, w) / TEMPERATURE
    log_probs = F.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1)
    with torch.no_grad():
        entropy = trl_entropy(z)
    return log_probs, entropy


def reference_log_probs(x, w, ids):
    """An old or reference policy's log-probs: no gradient."""
    with torch.no_grad():
        return trl_log_probs(F.linear(x, w) / TEMPERATURE, ids)


def categorical(x, w, ids):
    """torch.distributions, as PPO and A2C code writes it."""
    dist = torch.distributions.Categorical(logits=F.linear(x, w) / TEMPERATURE)
    return dist.log_prob(ids), dist.entropy()


def signs_and_keepdim(x, w, ids):
    """The negative log-prob (logsumexp - gather, an NLL), the negative entropy (sum p log p,
    added to a loss with a plus sign) and the entropy with keepdim=True."""
    z = F.linear(x, w) / TEMPERATURE
    nll = torch.logsumexp(z, -1) - z.gather(-1, ids[..., None])[..., 0]
    log_p = F.log_softmax(z, -1)
    return nll, (log_p.exp() * log_p).sum(-1), -(log_p.exp() * log_p).sum(-1, keepdim=True)


@dataclasses.dataclass(frozen=True)
class Form:
    fn: object
    sliced: bool = False  # the rows TRL keeps: logits[:, :-1][:, -K:]
    outputs: tuple[str, ...] = ("log_probs", "entropy")


FUSED = {
    "log_softmax-gather, TRL entropy": Form(log_softmax_gather),
    "gather-logsumexp, softmax-log_softmax entropy": Form(gather_minus_logsumexp),
    "TRL selective_log_softmax, sliced": Form(trl_sliced, sliced=True),
    "verl in-place temperature": Form(verl_in_place_temperature, sliced=True),
    "negated cross_entropy": Form(negated_cross_entropy, outputs=("log_probs",)),
    "entropy alone": Form(entropy_alone, outputs=("entropy",)),
    "row loops": Form(row_loops),
    "entropy without grad": Form(entropy_without_grad),
    "reference log-probs": Form(reference_log_probs, outputs=("log_probs",)),
    "Categorical log_prob and entropy": Form(categorical),
    "NLL, negative entropy, keepdim entropy": Form(
        signs_and_keepdim, outputs=("nll", "negative_entropy", "entropy_keepdim")
    ),
}
NAMES = list(FUSED)


def all_forms(x, ws, ids, kept_ids):
    """Every fused form, each on its own head: a list of output tuples."""
    out = []
    for name, w in zip(NAMES, ws):
        form = FUSED[name]
        result = form.fn(x, w, kept_ids if form.sliced else ids)
        out.append(result if isinstance(result, tuple) else (result,))
    return out


def oracle(x, w, ids, form: Form, dtype):
    """float64 log-probs and entropy of the form's rows, from the operands as the head rounds
    them (``dtype``)."""
    x, w = (t.to(dtype).double() for t in (x, w))
    z = F.linear(x, w)
    if form.sliced:
        z = z[:, :-1][:, -K:]
    log_p = (z / TEMPERATURE).log_softmax(-1)
    log_probs = log_p.gather(-1, ids[..., None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    values = {
        "log_probs": log_probs,
        "entropy": entropy,
        "nll": -log_probs,
        "negative_entropy": -entropy,
        "entropy_keepdim": entropy[..., None],
    }
    return [values[name] for name in form.outputs]


# --- compiling -------------------------------------------------------------------------------


@dataclasses.dataclass
class Compiled:
    graphs: list
    counts: dict
    reports: list


def compile_and_run(fn, args, autocast=False):
    """``fn(*args)`` compiled with the pass and AOTAutograd: its outputs, and what the pass
    did."""
    counters.clear()
    torch._dynamo.reset()
    tracing.install()
    graphs = []

    def backend(gm, example_inputs):
        run_on_module(gm)
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
    with cce_compile.watch() as report:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = compiled(*args)
    return out, Compiled(graphs, dict(counters["cce_compile"]), report.sites)


def survivors(graphs, vocab):
    """Nodes holding N x V values after the rewrite (but the graph's inputs)."""
    found = []
    for gm in graphs:
        for module in gm.modules():
            for node in getattr(module, "graph", None).nodes if hasattr(module, "graph") else ():
                value = node.meta.get("example_value")
                big = isinstance(value, torch.Tensor) and value.dim() >= 2
                if big and value.shape[-1] == vocab and node.op != "placeholder":
                    found.append(node.name)
    return found


def make_inputs(dtype, heads, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen).to(dtype).requires_grad_()
    ws = [(torch.randn(V, D, generator=gen) / D**0.5).to(dtype).requires_grad_() for _ in heads]
    ids = torch.randint(0, V, (B, T), generator=gen)
    return x, ws, ids, ids[:, -K:].clone()


MODES = {"fp32": (torch.float32, False), "bf16": (torch.bfloat16, False), "amp": (None, True)}


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_every_form_fuses_into_one_call_per_head_and_matches_float64(mode):
    dtype, autocast = mode
    x, ws, ids, kept = make_inputs(dtype or torch.float32, NAMES)
    outputs, compiled = compile_and_run(all_forms, (x, ws, ids, kept), autocast)
    assert compiled.counts == {"rewritten": len(NAMES)}, compiled.counts
    ops = [n for g in compiled.graphs for n in g.graph.nodes if n.target is OP]
    assert len(ops) == len(NAMES)  # log-probs and entropy of one head: one call
    assert not survivors(compiled.graphs, V)
    assert not safety.dead_nodes(compiled.graphs[0].graph)  # (TORCH_LOGS=+cce shows it all)
    forms = sorted(r.form for r in compiled.reports)
    assert forms.count("log-probs and entropy") == 8 and forms.count("entropy") == 1, forms
    compute = dtype or torch.bfloat16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        eager = all_forms(x, ws, ids, kept)
    gen = torch.Generator().manual_seed(1)
    got_total, want_total, leaves = 0.0, 0.0, [x, *ws]
    for name, w, got, eager_got in zip(NAMES, ws, outputs, eager):
        form = FUSED[name]
        wanted = oracle(x, w, kept if form.sliced else ids, form, compute)
        for output, value, want, same in zip(form.outputs, got, wanted, eager_got):
            label = f"{name}: {output}"
            assert value.dtype == same.dtype, label  # (AMP: cross_entropy's is float32)
            assert_close(label, value.double(), want.detach(), VALUE_RTOL[compute], 1.0)
            weight = torch.randn(want.shape, generator=gen, dtype=torch.float64)
            if value.requires_grad:
                got_total = got_total + (value.double() * weight).sum()
                want_total = want_total + (want * weight).sum()
            else:  # the no-grad forms: none flows, as in eager
                assert name in ("entropy without grad", "reference log-probs"), label
    got_grads = torch.autograd.grad(got_total, leaves, allow_unused=True)
    want_grads = torch.autograd.grad(want_total, leaves, allow_unused=True)
    for i, (got, want) in enumerate(zip(got_grads, want_grads)):
        label = "hidden" if i == 0 else f"classifier of {NAMES[i - 1]}"
        if want is None:
            assert got is None or not got.any(), label
            continue
        assert got.dtype == (dtype or torch.float32), label
        assert_close(f"gradient of {label}", got.double(), want, GRAD_RTOL[compute])


# --- what is not fused, and why -------------------------------------------------------------


def sft_loss_and_entropy(x, w, labels):
    """A training loop's loss over labels with ignored (prompt, padding) rows, and the entropy
    of every row's distribution logged beside it."""
    z = F.linear(x, w)
    loss = F.cross_entropy(z.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    return loss, -(F.softmax(z, -1) * F.log_softmax(z, -1)).sum(-1)


def openrlhf_entropy_before_temperature(x, w, ids):
    """OpenRLHF's actor: the entropy at T = 1, then the in-place division and the log-probs:
    two sets of logits of one head (the entropy without grad, as eager needs to divide)."""
    logits = F.linear(x, w).to(torch.float32)
    with torch.no_grad():
        entropy = verl_entropy(logits)
    logits.div_(TEMPERATURE)
    picked = torch.gather(logits, -1, ids.unsqueeze(-1)).squeeze(-1)
    lse = torch.logsumexp(logits.reshape(-1, V), -1).view(*ids.shape)
    return picked - lse, entropy


def in_place_with_a_view_read_after(x, w, ids):
    logits = F.linear(x, w)
    flat = logits.view(-1, V)
    logits.div_(TEMPERATURE)
    log_probs = F.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    return log_probs, flat.sum(-1)


def per_token_temperature(x, w, ids):
    temperatures = torch.linspace(0.5, 1.5, T)
    z = F.linear(x, w) / temperatures[None, :, None]
    return (F.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1),)


def logits_from_outside(x, w, ids):
    """Logits that come from outside the graph (a graph break, or verl's separately compiled
    entropy): nothing to fuse, said quietly."""
    return verl_entropy(x), trl_log_probs(x, ids % D)  # (x: D classes)


LEFT_ALONE = {
    "OpenRLHF entropy before temperature": (
        openrlhf_entropy_before_temperature,
        ["logits_escape", "logits_escape"],
        "the logits are also used by",
    ),
    "in-place temperature, view read after": (
        in_place_with_a_view_read_after,
        ["mutation_in_region"],
        "(left in place: flat, another view of logits, is read after it",
    ),
    "per-token temperature": (per_token_temperature, ["unsupported_op_in_chain"], "by a tensor"),
    "logits from outside": (logits_from_outside, ["logits_from_graph_input"], "graph input"),
}


@pytest.mark.parametrize("case", LEFT_ALONE.values(), ids=LEFT_ALONE.keys())
def test_forms_that_cannot_fuse_are_left_as_written_and_say_why(case, caplog):
    fn, reasons, detail = case
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"])
    with caplog.at_level(logging.INFO, logger="cce_compile"):
        outputs, compiled = compile_and_run(fn, (x, w, ids))
    assert "rewritten" not in compiled.counts, compiled.counts
    # As written: no node a rule made is left (no canonical op, no cross_entropy the rules
    # added), and eager's numbers come out.
    for node in compiled.graphs[0].graph.nodes:
        # (an op of the cce namespace prints as "cce.<name>"; a builtin's address may hold "cce")
        made = str(node.target).startswith("cce.") or node.meta.get("cce_form")
        assert not made, node.format_node()
    for got, want in zip(outputs, fn(x, w, ids)):
        torch.testing.assert_close(got, want)
    assert sorted(r.reason for r in compiled.reports) == reasons, compiled.reports
    assert detail in compiled.reports[0].detail, compiled.reports[0].detail
    # (an entropy under no_grad in a training graph is not an evaluation graph's loss)
    assert not any("evaluation" in r.detail for r in compiled.reports), compiled.reports
    told = [r.getMessage() for r in caplog.records]  # (TORCH_LOGS=cce: INFO and up)
    assert any(f"({reasons[0]})" in m and "left the" in m for m in told), told
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert bool(warned) != (fn is logits_from_outside), warned  # (RL forms without a head: INFO)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_an_entropy_beside_a_loss_that_ignores_rows_fuses_with_it(mode):
    """One op call for the loss and the entropy: the entropy of every row (eager's, the
    ignored ones included: the op's ``metrics_all_rows``) and the loss over the kept ones,
    values and gradients against float64."""
    dtype, autocast = mode
    x, (w,), ids, _ = make_inputs(dtype or torch.float32, ["one"], seed=1)
    labels = ids.masked_fill(torch.arange(T) < T // 3, -100)  # the prompt's rows
    (loss, entropy), compiled = compile_and_run(sft_loss_and_entropy, (x, w, labels), autocast)
    assert compiled.counts == {"rewritten": 1}, compiled.counts
    assert [n.target for g in compiled.graphs for n in g.graph.nodes].count(OP) == 1
    assert not survivors(compiled.graphs, V)
    compute = dtype or torch.bfloat16
    x64, w64 = (t.detach().to(compute).double().requires_grad_() for t in (x, w))
    want_loss, want_entropy = sft_loss_and_entropy(x64, w64, labels)
    assert_close("loss", loss.double(), want_loss.detach(), VALUE_RTOL[compute], 1.0)
    assert_close("entropy", entropy.double(), want_entropy.detach(), VALUE_RTOL[compute], 1.0)
    assert (entropy[:, : T // 3] > 0).all()  # the ignored rows' entropy is eager's, not 0
    got = torch.autograd.grad(loss.double() + 0.1 * entropy.double().sum(), (x, w))
    want = torch.autograd.grad(want_loss + 0.1 * want_entropy.sum(), (x64, w64))
    for name, g, expected in zip(("hidden", "classifier"), got, want):
        assert_close(f"gradient of {name}", g.double(), expected, GRAD_RTOL[compute])


def test_explain_names_the_rl_forms_and_counts_the_logits_at_their_dtype():
    x, ws, ids, kept = make_inputs(torch.float32, ["one"])
    report = cce_compile.explain(trl_sliced, x, ws[0], kept)
    (site,) = report.sites
    assert site.rewritten and site.form == "log-probs and entropy"
    rows = B * K
    assert site.logits_bytes == rows * V * (4 + 4)  # float32 logits and float32 log-softmax
    assert "the logits in their dtype and their float32 log-softmax" in str(report)


def test_dynamic_completion_lengths_fuse_without_recompiling():
    """TRL keeps as many logits as there are completion tokens (``logits_to_keep``, read from
    the ids): with dynamic shapes the slice and the ids share one size, and a new length runs
    the same graph."""

    def step(x, w, ids):
        logits = F.linear(x, w)[:, :-1, :]
        logits = logits[:, -ids.shape[1] :, :] / TEMPERATURE
        return trl_log_probs(logits, ids), verl_entropy(logits)

    def make(time, keep, seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(B, time, D, generator=gen, requires_grad=True)
        w = (torch.randn(V, D, generator=gen) / D**0.5).requires_grad_()
        return x, w, torch.randint(0, V, (B, keep), generator=gen)

    first, second = make(7, 4, 0), make(9, 6, 1)  # (the batch stays: the loop unrolls over it)
    outcome = check(step, first, dynamic=True, backward_all=True, extra_calls=[second])
    assert outcome.rewritten == 1 and outcome.skipped == {} and outcome.has_op, outcome
    assert not outcome.recompiled


def test_a_temperature_after_the_softcap_folds_into_the_cap():
    """Gemma's final-logit softcap in the model, the trainer's temperature after it: s c
    tanh(y / c) = c' tanh(s y / c') with c' = s c, fused (it was refused as 'scaled after the
    softcap')."""

    def gemma_rl(x, w, ids):
        z = 3.0 * torch.tanh(F.linear(x, w) / 3.0) / TEMPERATURE
        return trl_log_probs(z, ids), verl_entropy(z)

    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=2)
    with torch.no_grad():
        w.mul_(4.0)  # logits past the cap's knee
    outcome = check(gemma_rl, (x, w, ids), backward_all=True)
    assert outcome.rewritten == 1 and outcome.skipped == {} and outcome.has_op, outcome


def test_one_temperature_written_twice_is_one_scaling():
    """TRL's API divides inside ``selective_log_softmax(z, ids, temperature=T)`` while the
    entropy is taken of ``z / T`` outside: two equal divisions of one head's logits are one
    set of logits, fused in one call (each escaped the other before)."""

    def step(x, w, ids):
        z = F.linear(x, w)
        return trl_log_probs(z / TEMPERATURE, ids), trl_entropy(z / TEMPERATURE)

    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=3)
    outcome = check(step, (x, w, ids), backward_all=True)
    assert outcome.rewritten == 1 and outcome.skipped == {} and outcome.has_op, outcome


def test_a_gathered_id_out_of_range_is_an_error_as_in_eager():
    """``gather`` raises on an id outside [0, V) (-100 included); the fused log-probs ignore
    no id, so the op's target check raises too, rather than give log-prob 0."""
    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=4)
    ids[0, 1] = -100
    with pytest.raises(RuntimeError):
        log_softmax_gather(x, w, ids)
    compiled = torch.compile(log_softmax_gather, backend=_cce_eager)
    with pytest.raises(IndexError, match="Target -100 is out of bounds"):
        compiled(x, w, ids)


def _cce_eager(gm, example_inputs):
    run_on_module(gm)
    return aot_eager(gm, example_inputs)


def test_a_new_batch_size_recompiles_fused():
    """A recompile for a new batch size (a last partial batch, dynamic micro-batches) makes the
    batch symbolic: TRL's entropy reshapes its result by ``logits.shape[:-1]``, a read of the
    logits' sizes that must not keep them alive (it left the recompiled graph unfused)."""

    def step(x, w, ids):
        logits = F.linear(x, w)[:, :-1, :] / TEMPERATURE
        return trl_log_probs(logits, ids[:, 1:]), trl_entropy(logits)

    def make(batch, seed):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, T, D, generator=gen, requires_grad=True)
        w = (torch.randn(V, D, generator=gen) / D**0.5).requires_grad_()
        return x, w, torch.randint(0, V, (batch, T), generator=gen)

    outcome = check(step, make(2, 0), dynamic=True, backward_all=True, extra_calls=[make(3, 1)])
    assert outcome.skipped == {} and outcome.has_op, outcome
    computing = [g for g in outcome.graphs if any(n.op == "call_function" for n in g.graph.nodes)]
    assert outcome.recompiled and len(computing) == outcome.rewritten == 2  # both compiles fused
    assert all(OP in [n.target for n in g.graph.nodes] for g in computing)


def test_the_rewritten_graph_keeps_no_dead_node():
    """Hugging Face's shifted labels: ``labels[..., 1:].contiguous().view(-1)`` fed only the
    loss; the op reads the labels themselves, and their views go with the loss."""

    def loss(x, w, labels):
        logits = F.linear(x, w)[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return F.cross_entropy(logits.view(-1, V), shift_labels.view(-1))

    x, (w,), ids, _ = make_inputs(torch.float32, ["one"])
    _, compiled = compile_and_run(loss, (x, w, ids))
    assert compiled.counts == {"rewritten": 1}
    assert not safety.dead_nodes(compiled.graphs[0].graph), compiled.graphs[0].code


def test_the_same_rows_sliced_twice_are_one_slice():
    """``z[:, :-1]`` written for the loss and again for the entropy (and for log-probs beside
    a Categorical entropy): the same rows, fused in one call (each escaped the other before)."""
    from torch.distributions import Categorical

    def loss_and_entropy(x, w, ids):
        z = F.linear(x, w)
        loss = F.cross_entropy(z[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
        return loss - 0.01 * Categorical(logits=z[:, :-1]).entropy().mean()

    def log_probs_and_entropy(x, w, ids):
        z = F.linear(x, w) / TEMPERATURE
        log_probs = z[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return log_probs, trl_entropy(z[:, :-1])

    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=5)
    for step in (loss_and_entropy, log_probs_and_entropy):
        outcome = check(step, (x, w, ids), backward_all=True)
        assert outcome.rewritten == 1 and outcome.skipped == {} and outcome.has_op, outcome


def test_a_write_between_two_equal_scalings_keeps_them_apart():
    """``z / T`` twice with ``z`` written in place between them: two different tensors, not
    one (the second reads the written ``z``); the site is left alone, eager's values kept."""

    def step(x, w, ids):
        z = F.linear(x, w)
        first = z / TEMPERATURE
        log_probs = first.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
        z.add_(1.0)
        return log_probs, trl_entropy(z / TEMPERATURE)

    x, (w,), ids, _ = make_inputs(torch.float32, ["one"], seed=6)
    outcome = check(step, (x, w, ids), backward_all=True)
    assert outcome.rewritten == 0, outcome
