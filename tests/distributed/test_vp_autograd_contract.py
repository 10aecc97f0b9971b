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


@dataclasses.dataclass
class _ContractRun:
    """One case's state on this rank: the oracle's case, this rank's classifier shard, and
    what the flow records (gradient errors, the loss calls whose backward reduces hidden's
    gradient, the collectives each backward sent)."""

    case: object  # strategies.build_case's
    shard: torch.Tensor  # rows start..start + rows of the classifier, a leaf
    start: int
    rows: int
    group: object
    mode: str
    errors: dict = dataclasses.field(default_factory=dict)
    calls: list = dataclasses.field(default_factory=list)
    collectives: list = dataclasses.field(default_factory=list)

    def loss(self, hidden, targets):
        from cce_compile.distributed import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(
            hidden, self.shard, targets, vocab_start=self.start, vocab_size=VOCAB,
            group=self.group, mode=self.mode,
        )  # fmt: skip

    def oracle_grads(self, hidden, targets, upstream, tokens=None):
        """(hidden's, the classifier's) float64 gradients of ``oracle * upstream``; with
        ``tokens`` hidden is 2 x the classifier's embedding of them (no hidden gradient)."""
        c = self.case.classifier.double().requires_grad_()
        if tokens is None:
            h = hidden.double().requires_grad_()
        else:
            h = torch.nn.functional.embedding(tokens, c) * 2.0
        total = oracle(dataclasses.replace(self.case, hidden=h, classifier=c, targets=targets))
        leaves = [c] if tokens is not None else [h, c]
        grads = torch.autograd.grad(total * upstream, leaves)
        return (None, *grads) if tokens is not None else grads

    def mine(self, classifier_grad: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a gradient of the whole classifier."""
        return classifier_grad[self.start : self.start + self.rows]

    def compare(self, label, got, want):
        if got is None:
            self.errors[label] = (float("inf"), 0.0)
            return
        self.errors[label] = (rel_error(got, want), GRAD_RTOL[torch.float32])
        self.errors[f"{label}_dtype"] = (float(got.dtype != torch.float32), 0.0)

    def backward(self, total):
        with traced() as trace:
            total.backward()
        self.collectives.extend(c.key for c in trace.collectives)


def _tied_embeddings(run: _ContractRun) -> None:
    """The shard is also the input embedding's: its gradient sums the loss's and the
    embedding's."""
    case = run.case
    tokens = case.targets.clamp(min=0)
    hidden = _vocab_parallel_embedding(tokens, run.shard, run.start, run.group) * 2.0
    out = run.loss(hidden, case.targets)
    run.calls.append(case)
    run.backward(out * UPSTREAM)
    want = run.oracle_grads(None, case.targets, UPSTREAM, tokens=tokens)[1]
    run.compare("grad_classifier", run.shard.grad, run.mine(want))


def _one_classifier_in_two_losses(run: _ContractRun) -> None:
    case = run.case
    other = build_case(leading=(2, 6), dim=16, vocab=VOCAB, seed=4, ignored_fraction=0.3)
    hidden = case.hidden.clone().requires_grad_()
    other_hidden = other.hidden.clone().requires_grad_()
    total = run.loss(hidden, case.targets) + 0.5 * run.loss(other_hidden, other.targets)
    run.calls += [case, other]
    run.backward(total)
    want_h, want_c = run.oracle_grads(case.hidden, case.targets, 1.0)
    other_h, other_c = run.oracle_grads(other.hidden, other.targets, 0.5)
    run.compare("grad_hidden", hidden.grad, want_h)
    run.compare("grad_other_hidden", other_hidden.grad, other_h)
    run.compare("grad_classifier", run.shard.grad, run.mine(want_c + other_c))


def _hooks_on_the_classifier(run: _ContractRun) -> None:
    """Hooks over two micro-batches: the second's gradient adds into .grad."""
    case, shard = run.case, run.shard
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
        run.backward(run.loss(hidden, targets) * UPSTREAM)
        run.calls.append(dataclasses.replace(case, targets=targets))
    wants = [run.oracle_grads(case.hidden, targets, UPSTREAM) for targets in batches]
    mine = [run.mine(want_c) for _, want_c in wants]
    counts = [len(seen), len(replaced), len(accumulated)]
    run.errors["hook_calls"] = (float(counts != [2, 2, 2]), 0.0)
    for i, want_c in enumerate(mine[: min(counts)]):
        run.compare(f"seen_by_hook_{i}", seen[i], want_c)
        run.compare(f"replaced_by_hook_{i}", replaced[i], want_c)
    if min(counts) == 2:  # the replaced gradients, accumulated in .grad
        run.compare("post_accumulate_0", accumulated[0], 2 * mine[0])
        run.compare("post_accumulate_1", accumulated[1], 2 * (mine[0] + mine[1]))
    run.compare("grad_classifier", shard.grad, 2 * (mine[0] + mine[1]))
    run.compare("grad_hidden", hidden.grad, wants[0][0] + wants[1][0])


CONTRACT_FLOW_RUNS = {
    "tied_embeddings": _tied_embeddings,
    "one_classifier_in_two_losses": _one_classifier_in_two_losses,
    "hooks_on_the_classifier": _hooks_on_the_classifier,
}


def run_contract_case(name: str, rank: int, world: int, mesh) -> dict:
    """One ``CONTRACT_CASES`` case on this rank: each gradient's relative error against the
    float64 oracle's (this rank's rows of the classifier's), the hooks' calls, and the
    backward's collectives with those expected (hidden's reduction once per loss backward)."""
    flow, mode = CONTRACT_CASES[name]
    case = build_case(leading=(2, 6), dim=16, vocab=VOCAB, seed=3, ignored_fraction=0.3)
    start, rows = shard_of(VOCAB, rank, world)
    shard = case.classifier[start : start + rows].clone().requires_grad_()
    run = _ContractRun(case, shard, start, rows, mesh.get_group(), mode)
    CONTRACT_FLOW_RUNS[flow](run)
    expected = [expected_collectives(c, dict(mode=mode), world)["backward"] for c in run.calls]
    return dict(
        errors=run.errors,
        backward=run.collectives,
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
