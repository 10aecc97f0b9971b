"""The rules that rewrite RL's forms (cce_compile/passes/rules.py, piecewise.py), each on the
forms it must rewrite and on near forms it must leave alone; then the lowering, and the journal
that puts back what no fused site uses.

One Dynamo graph holds every case, each on its own logits (a graph input, as the rules need no
head): the rules run over it once, and each case's output is read from the graph's output.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from rl_forms import trl_entropy, trl_log_probs, verl_entropy, verl_log_probs

from cce_compile.passes import canonical, entropy_rules, rules
from cce_compile.passes.canonical import LEFT_ALONE
from cce_compile.passes.journal import Journal

B, T, V = 2, 5, 11
TEMPERATURE = 0.7
LOG_PROBS, ENTROPY, KEPT = "log-probs", "entropy", "kept"


def _scaled(z):
    return z * 1.0  # (in place only on a tensor the graph made: not on the caller's)


def _in_place_div(z, ids):
    z = _scaled(z)
    z.div_(TEMPERATURE)
    return F.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1)


def _in_place_itruediv(z, ids):
    z = _scaled(z)
    z /= TEMPERATURE
    return F.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1)


def _in_place_view_read_after(z, ids):
    z = _scaled(z)
    flat = z.view(-1, V)
    z.mul_(2.0)
    return z.sum(-1) + flat.sum()


def _in_place_graph_input(z, ids):
    z.div_(TEMPERATURE)  # the caller's tensor: the write is theirs to see
    return z.sum(-1)


def _gather_minus_flat_logsumexp(z, ids):
    lse = torch.logsumexp(z.reshape(-1, V), -1).view(*ids.shape)  # OpenRLHF's
    return torch.gather(z, -1, ids.unsqueeze(-1)).squeeze(-1) - lse


def _categorical_log_prob(z, ids):
    return torch.distributions.Categorical(logits=z).log_prob(ids)


def _categorical_entropy(z, ids):
    return torch.distributions.Categorical(logits=z).entropy()


def _categorical_log_prob_of_broadcast_ids(z, ids):
    return torch.distributions.Categorical(logits=z).log_prob(ids[0])  # (T,) against (B, T)


def _log_of_probs_plus_eps(z, ids):
    p = F.softmax(z, -1)
    return -(p * torch.log(p + 1e-10)).sum(-1)


def _categorical_of_probs_entropy(z, ids):
    return torch.distributions.Categorical(probs=torch.softmax(z, -1)).entropy()


def _clamped_at_another_bound(z, ids):
    log_p = F.log_softmax(z, -1)
    return -(torch.clamp(log_p, min=-10.0) * log_p.exp()).sum(-1)


def _cat_of_different_functions(z, ids):
    chunks = z.reshape(-1, V).split(4)
    return torch.cat([c.logsumexp(-1) if i == 0 else c.sum(-1) for i, c in enumerate(chunks)])


# name -> (the form of logits z (B, T, V) float32 and ids (B, T), what it becomes). The
# "2-byte" cases read bf16 logits.
CASES = {
    "log_softmax gather": (lambda z, i: F.log_softmax(z, -1).gather(-1, i[..., None]), LOG_PROBS),
    "log_softmax gather squeeze": (
        lambda z, i: z.log_softmax(dim=-1).gather(-1, i.unsqueeze(-1)).squeeze(-1),
        LOG_PROBS,
    ),
    "gather - logsumexp keepdim": (
        lambda z, i: z.gather(-1, i[..., None]) - z.logsumexp(-1, keepdim=True),
        LOG_PROBS,
    ),
    "gather - logsumexp unsqueezed": (
        lambda z, i: torch.gather(z, -1, i[..., None]) - torch.logsumexp(z, -1).unsqueeze(-1),
        LOG_PROBS,
    ),
    "gather squeeze - flat logsumexp": (_gather_minus_flat_logsumexp, LOG_PROBS),
    "TRL log-probs, float32": (trl_log_probs, LOG_PROBS),
    "TRL log-probs, 2-byte": (trl_log_probs, LOG_PROBS),
    "verl log-probs, float32": (verl_log_probs, LOG_PROBS),
    "verl log-probs, 2-byte": (verl_log_probs, LOG_PROBS),
    "in-place div_": (_in_place_div, LOG_PROBS),
    "in-place /=": (_in_place_itruediv, LOG_PROBS),
    "-(exp(logp) * logp).sum(-1)": (
        lambda z, i: -(torch.exp(F.log_softmax(z, -1)) * F.log_softmax(z, -1)).sum(-1),
        ENTROPY,
    ),
    "-(softmax * log_softmax).sum(-1)": (
        lambda z, i: -torch.sum(F.log_softmax(z, -1) * F.softmax(z, -1), dim=-1),
        ENTROPY,
    ),
    "logsumexp - (softmax * z).sum(-1)": (lambda z, i: verl_entropy(z), ENTROPY),
    "TRL entropy chunks": (lambda z, i: trl_entropy(z, chunk_size=3), ENTROPY),
    "row loop of entropies": (
        lambda z, i: torch.stack([verl_entropy(r) for r in z.unbind(0)]),
        ENTROPY,
    ),
    # the sign and keepdim variants, the NLL spelling and torch.distributions.Categorical
    "(exp(logp) * logp).sum(-1), added with +": (
        lambda z, i: (F.log_softmax(z, -1).exp() * F.log_softmax(z, -1)).sum(-1),
        ENTROPY,
    ),
    "-(exp(logp) * logp).sum(-1, keepdim=True)": (
        lambda z, i: -(F.log_softmax(z, -1).exp() * F.log_softmax(z, -1)).sum(-1, keepdim=True),
        ENTROPY,
    ),
    "logsumexp - gather (NLL)": (
        lambda z, i: torch.logsumexp(z, -1) - z.gather(-1, i[..., None])[..., 0],
        LOG_PROBS,
    ),
    "gather[..., 0] - logsumexp": (
        lambda z, i: z.gather(-1, i[..., None])[..., 0] - torch.logsumexp(z, -1),
        LOG_PROBS,
    ),
    "Categorical log_prob": (_categorical_log_prob, LOG_PROBS),
    "Categorical entropy": (_categorical_entropy, ENTROPY),
    # rewritten, marked as not to be fused: eager's 0 * log 0 is NaN (test_rl_left_alone.py)
    "-(p * p.log()).sum(-1)": (
        lambda z, i: -(z.softmax(-1) * z.softmax(-1).log()).sum(-1),
        ENTROPY,
    ),
    # an epsilon in the log, Categorical's re-normalised probabilities: marked, as p.log()
    "-(p * log(p + eps)).sum(-1)": (_log_of_probs_plus_eps, ENTROPY),
    "Categorical(probs=softmax(z)) entropy": (_categorical_of_probs_entropy, ENTROPY),
    # near forms, left as they are
    "gather of fewer rows": (
        lambda z, i: F.log_softmax(z, -1).gather(-1, i[:, :2, None]),
        KEPT,
    ),
    "logsumexp of other logits": (
        lambda z, i: z.gather(-1, i[..., None]).squeeze(-1) - (z * 2).logsumexp(-1),
        KEPT,
    ),
    "sum over rows": (
        lambda z, i: -(torch.exp(F.log_softmax(z, -1)) * F.log_softmax(z, -1)).sum(0),
        KEPT,
    ),
    "rows that do not cover": (lambda z, i: torch.stack([torch.logsumexp(z[0], -1)]), KEPT),
    "a different function per chunk": (_cat_of_different_functions, KEPT),
    "in-place, a view read after": (_in_place_view_read_after, KEPT),
    "in-place on a graph input": (_in_place_graph_input, KEPT),
    "Categorical log_prob of broadcast ids": (_categorical_log_prob_of_broadcast_ids, KEPT),
    "log-probs clamped at another bound": (_clamped_at_another_bound, KEPT),
}


def _all_cases(logits, ids):
    return tuple(fn(z, ids) for (fn, _), z in zip(CASES.values(), logits))


@pytest.fixture(scope="module")
def captured():
    """The Dynamo graph of every case (before any rule), and its output nodes in order."""
    gen = torch.Generator().manual_seed(0)
    logits = [
        torch.randn(B, T, V, generator=gen).to(torch.bfloat16 if "2-byte" in n else torch.float32)
        for n in CASES
    ]
    ids = torch.randint(0, V, (B, T), generator=gen)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(_all_cases, backend=backend, fullgraph=True, dynamic=False)(logits, ids)
    (gm,) = graphs
    return gm


def _outputs(gm):
    (outputs,) = gm.graph.output_node().args
    return dict(zip(CASES, outputs))


def _canonical(node):
    """The node a case's output reads through a negation, an unsqueeze or a reshape."""
    if node.op == "call_function" and node.target is operator.neg:
        node = node.args[0]
    if node.op == "call_method" and node.target in ("unsqueeze", "reshape"):
        node = node.args[0]
    return node


def _became(node) -> str:
    """What a case's output is after the rules: the canonical op it reads (negated, unsqueezed
    or reshaped), or kept."""
    node = _canonical(node)
    if node.target is canonical.TOKEN_LOG_PROBS:
        return LOG_PROBS
    if node.target is canonical.SOFTMAX_ENTROPY:
        return ENTROPY
    return KEPT


def test_each_rule_rewrites_its_forms_and_leaves_near_forms_alone(captured):
    gm = captured
    before = [(n.op, str(n.target)) for n in gm.graph.nodes]
    originals = _outputs(gm)
    journal = Journal(gm.graph)
    names = ("sizes_read", "in_place_scale", "join_pieces", "broadcast_value", "log_probs")
    names += ("entropy",)
    chosen = [rule for rule in rules.RULES if rule.__name__ in names]
    counts = {rule.__name__: rules.apply(gm.graph, rule, journal) for rule in chosen}
    expected = dict(sizes_read=0, in_place_scale=2, join_pieces=6, broadcast_value=1)
    assert counts == dict(expected, log_probs=14, entropy=11), counts
    became = {name: _became(node) for name, node in _outputs(gm).items()}
    assert became == {name: expected for name, (_, expected) in CASES.items()}
    for name, (_, expected) in CASES.items():
        if expected == KEPT:  # the very node the user's code made
            assert _outputs(gm)[name] is originals[name], name
    kept = [n.meta.get(canonical.KEPT_IN_PLACE) for n in gm.graph.nodes]
    assert any(why and "another view of" in why for why in kept), [k for k in kept if k]
    assert any(why and "is an input of the graph" in why for why in kept), kept
    # Marked not to be fused: the log of softmax(z) (NaN where p underflows), and the spellings
    # that are NaN at a -inf logit in eager, as these logits (a graph input, not a linear head
    # without a bias) may hold one. Categorical's clamp makes 0 log 0 count 0, as the op does:
    # its entropy is not marked, whatever the logits.
    entropies = [name for name, (_, became) in CASES.items() if became == ENTROPY]
    whys = {name: _canonical(_outputs(gm)[name]).meta.get(LEFT_ALONE) for name in entropies}
    expected_whys = {name: entropy_rules.NAN_AT_MINUS_INF for name in entropies}
    expected_whys["-(p * p.log()).sum(-1)"] = entropy_rules.LOG_OF_SOFTMAX
    expected_whys["Categorical entropy"] = None
    expected_whys["-(p * log(p + eps)).sum(-1)"] = entropy_rules.EPS_IN_LOG
    expected_whys["Categorical(probs=softmax(z)) entropy"] = entropy_rules.PROBS_RENORMALISED
    assert whys == expected_whys, whys

    # Lowering: each log-prob becomes a cross_entropy marked as such; an entropy whose rows
    # no cross_entropy reads gets one of its own.
    assert rules.apply(gm.graph, rules.lower_log_probs, journal) == 14
    assert rules.apply(gm.graph, rules.dummy_loss, journal) == 11
    forms = [canonical.form(n) for n in gm.graph.nodes if n.target is F.cross_entropy]
    assert sorted(forms) == [canonical.ENTROPY] * 11 + [canonical.LOG_PROBS] * 14
    # (each marked entropy's loss carries the mark: its site is left alone, saying why)
    marked = 2 * sum(why is not None for why in whys.values())
    assert sum(canonical.LEFT_ALONE in n.meta for n in gm.graph.nodes) == marked == 20
    gm.graph.lint()

    # With no fused site, the journal puts the graph back as the user's code made it.
    journal.settle([])
    journal.finish()
    gm.graph.lint()
    assert [(n.op, str(n.target)) for n in gm.graph.nodes] == before
    assert list(_outputs(gm).values()) == list(originals.values())


def test_the_canonical_ops_decompose_to_the_math_they_stand_for():
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(3, 4, V, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (3, 4), generator=gen)
    log_p = z.log_softmax(-1)
    torch.testing.assert_close(
        canonical.TOKEN_LOG_PROBS(z, ids), log_p.gather(-1, ids[..., None])[..., 0]
    )
    entropy = canonical.SOFTMAX_ENTROPY(z)
    torch.testing.assert_close(entropy, -(log_p.exp() * log_p).sum(-1))
    (grad,) = torch.autograd.grad(entropy.sum(), z)  # (CompositeImplicitAutograd: autograd's)
    torch.testing.assert_close(grad, torch.autograd.grad(verl_entropy(z).sum(), z)[0])


def _graph_of(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    (gm,) = graphs
    return gm


def _write_between_slices(z):
    first = z[:, :-1].sum()
    z.add_(1.0)
    return first, z[:, :-1].sum()


def _write_between_scalings(z):
    first = z / TEMPERATURE
    z.mul_(2.0)
    return first, z / TEMPERATURE


ONE_SCALING_CASES = {
    # name: (function of z, how many nodes the rule makes read an earlier equal one)
    "the same scaling twice": (lambda z: (z / TEMPERATURE, z / TEMPERATURE), 1),
    "the same slice twice": (lambda z: (z[:, :-1].sum(-1), z[:, :-1].exp()), 1),
    "other slices": (lambda z: (z[:, :-1], z[:, 1:]), 0),
    "other factors": (lambda z: (z / TEMPERATURE, z / 0.5), 0),
    "a write between the slices": (_write_between_slices, 0),
    "a write between the scalings": (_write_between_scalings, 0),
}


@pytest.mark.parametrize("case", ONE_SCALING_CASES, ids=list(ONE_SCALING_CASES))
def test_one_scaling_merges_only_equal_computations_of_unwritten_logits(case):
    fn, expected = ONE_SCALING_CASES[case]
    z = torch.randn(B, T, V, generator=torch.Generator().manual_seed(2))
    gm = _graph_of(lambda x: fn(x * 1.0), z)  # (made by the graph: writable in place)
    journal = Journal(gm.graph)
    assert rules.apply(gm.graph, rules.one_scaling, journal) == expected
    journal.settle([])
    journal.finish()
    gm.graph.lint()
