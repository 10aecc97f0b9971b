"""The single-device op's autograd contract (``tests/op/test_autograd_contract.py``) carried to
the vocabulary-parallel op's classifier shards, on 2 gloo processes, in lean and fast mode: the
shard tied to a vocabulary-parallel input embedding (its gradient sums the loss's and the
embedding's), one shard in two losses of one backward, and hooks on the shard (a tensor hook that
sees the gradient, one that replaces it, a post-accumulate-grad hook) over two micro-batches.
Each rank compares its shard's gradient with its rows of the float64 oracle's, computed the same
way, and the backward's collectives with those expected (``test_vocab_parallel.py``'s: hidden's
gradient reduced once per loss backward, nothing else).

All cases run in one start of the ranks (module-scoped fixture); each case is its own test id.
"""

from __future__ import annotations

import collections
import dataclasses

import launcher
import pytest
import torch
from comm_trace import traced
from oracle import GRAD_RTOL, oracle, rel_error
from strategies import build_case
from test_vocab_parallel import VOCAB, expected_collectives, run_cases, shard_of

# The autograd contract on the shards, in each mode: name -> (flow, mode).
CONTRACT_FLOWS = ("tied_embeddings", "one_classifier_in_two_losses", "hooks_on_the_classifier")
CONTRACT_CASES = {
    f"contract-{mode}-{flow}": (flow, mode) for flow in CONTRACT_FLOWS for mode in ("lean", "fast")
}
UPSTREAM = 0.37  # a non-unit upstream gradient: fast mode scales its buffers by it


class _SumOverShards(torch.autograd.Function):
    """A vocabulary-parallel embedding's all-reduce (Megatron's reduce from the model-parallel
    region): the forward sums the shards' partial lookups; the backward passes the gradient
    through, since the loss already reduced hidden's gradient over the group."""

    @staticmethod
    def forward(ctx, partial, group):
        total = partial.clone()
        torch.distributed.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _vocab_parallel_embedding(tokens, shard, start: int, group):
    """Each token's row of the whole table from the rank whose shard holds it."""
    local = tokens - start
    inside = (local >= 0) & (local < shard.shape[0])
    rows = torch.nn.functional.embedding(torch.where(inside, local, 0), shard)
    return _SumOverShards.apply(rows * inside[..., None], group)


def run_contract_case(name: str, rank: int, world: int, mesh) -> dict:
    """One ``CONTRACT_CASES`` case on this rank: each gradient's relative error against the
    float64 oracle's (this rank's rows of the classifier's), the hooks' calls, and the
    backward's collectives with those expected (hidden's reduction once per loss backward)."""
    from cce_compile.distributed import vocab_parallel_cross_entropy

    flow, mode = CONTRACT_CASES[name]
    case = build_case(leading=(2, 6), dim=16, vocab=VOCAB, seed=3, ignored_fraction=0.3)
    start, rows = shard_of(VOCAB, rank, world)
    shard = case.classifier[start : start + rows].clone().requires_grad_()
    group = mesh.get_group()

    def loss(hidden, targets):
        return vocab_parallel_cross_entropy(hidden, shard, targets, vocab_start=start,
                                            vocab_size=VOCAB, group=group, mode=mode)  # fmt: skip

    def oracle_grads(hidden, targets, upstream, tokens=None):
        """(hidden's, the classifier's) float64 gradients of ``oracle * upstream``; with
        ``tokens`` hidden is 2 x the classifier's embedding of them (no hidden gradient)."""
        c = case.classifier.double().requires_grad_()
        if tokens is None:
            h = hidden.double().requires_grad_()
        else:
            h = torch.nn.functional.embedding(tokens, c) * 2.0
        total = oracle(dataclasses.replace(case, hidden=h, classifier=c, targets=targets))
        leaves = [c] if tokens is not None else [h, c]
        grads = torch.autograd.grad(total * upstream, leaves)
        return (None, *grads) if tokens is not None else grads

    errors = {}

    def compare(label, got, want):
        if got is None:
            errors[label] = (float("inf"), 0.0)
            return
        errors[label] = (rel_error(got, want), GRAD_RTOL[torch.float32])
        errors[f"{label}_dtype"] = (float(got.dtype != torch.float32), 0.0)

    calls = []  # the case of each loss call whose backward reduces hidden's gradient
    collectives = []  # what each backward sent

    def backward(total):
        with traced() as trace:
            total.backward()
        collectives.extend(c.key for c in trace.collectives)

    if flow == "tied_embeddings":  # the shard is also the input embedding's
        tokens = case.targets.clamp(min=0)
        hidden = _vocab_parallel_embedding(tokens, shard, start, group) * 2.0
        out = loss(hidden, case.targets)
        calls.append(case)
        backward(out * UPSTREAM)
        want = oracle_grads(None, case.targets, UPSTREAM, tokens=tokens)[1]
        compare("grad_classifier", shard.grad, want[start : start + rows])
    elif flow == "one_classifier_in_two_losses":
        other = build_case(leading=(2, 6), dim=16, vocab=VOCAB, seed=4, ignored_fraction=0.3)
        hidden = case.hidden.clone().requires_grad_()
        other_hidden = other.hidden.clone().requires_grad_()
        total = loss(hidden, case.targets) + 0.5 * loss(other_hidden, other.targets)
        calls += [case, other]
        backward(total)
        want_h, want_c = oracle_grads(case.hidden, case.targets, 1.0)
        other_h, other_c = oracle_grads(other.hidden, other.targets, 0.5)
        compare("grad_hidden", hidden.grad, want_h)
        compare("grad_other_hidden", other_hidden.grad, other_h)
        compare("grad_classifier", shard.grad, (want_c + other_c)[start : start + rows])
    else:  # hooks, over two micro-batches: the second's gradient adds into .grad
        seen, replaced, accumulated = [], [], []
        shard.register_hook(lambda grad: seen.append(grad.detach().clone()))  # sees (None)

        def replace(grad):
            replaced.append(grad.detach().clone())
            return grad * 2

        shard.register_hook(replace)
        shard.register_post_accumulate_grad_hook(
            lambda param: accumulated.append(param.grad.detach().clone())
        )
        hidden = case.hidden.clone().requires_grad_()
        batches = [case.targets, case.targets.roll(1, dims=1)]
        for targets in batches:
            backward(loss(hidden, targets) * UPSTREAM)
            calls.append(dataclasses.replace(case, targets=targets))
        wants = [oracle_grads(case.hidden, targets, UPSTREAM) for targets in batches]
        mine = [want_c[start : start + rows] for _, want_c in wants]
        counts = [len(seen), len(replaced), len(accumulated)]
        errors["hook_calls"] = (float(counts != [2, 2, 2]), 0.0)
        for i, want_c in enumerate(mine[: min(counts)]):
            compare(f"seen_by_hook_{i}", seen[i], want_c)
            compare(f"replaced_by_hook_{i}", replaced[i], want_c)
        if min(counts) == 2:  # the replaced gradients, accumulated in .grad
            compare("post_accumulate_0", accumulated[0], 2 * mine[0])
            compare("post_accumulate_1", accumulated[1], 2 * (mine[0] + mine[1]))
        compare("grad_classifier", shard.grad, 2 * (mine[0] + mine[1]))
        compare("grad_hidden", hidden.grad, wants[0][0] + wants[1][0])
    expected = [expected_collectives(c, dict(mode=mode), world)["backward"] for c in calls]
    return dict(
        errors=errors,
        backward=collectives,
        expected_backward=[key for keys in expected for key in keys],
    )


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launcher.run(run_cases, 2, list(CONTRACT_CASES), run_contract_case)


@pytest.mark.parametrize("name", list(CONTRACT_CASES))
def test_two_ranks_autograd_contract(ranks, name):
    _, mode = CONTRACT_CASES[name]
    for rank, per_rank in enumerate(ranks):
        got = per_rank[name]
        assert "error" not in got, f"rank {rank}:\n{got.get('error')}"
        for label, (err, tol) in got["errors"].items():
            assert err <= tol, f"rank {rank}: {label} relative error {err:.3e} > {tol:.1e}"
        assert (got["fast_runs"] > 0) == (mode == "fast"), got["fast_runs"]
        # hidden's gradient reduced once per loss backward (in any order), nothing else
        backward = collections.Counter(map(tuple, got["backward"]))
        assert backward == collections.Counter(map(tuple, got["expected_backward"])), got
