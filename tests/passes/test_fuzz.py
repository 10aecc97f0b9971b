"""Hypothesis fuzzing of matched graphs.

Small models are composed from a head, a chain of row-wise ops, a loss and an optional extra
user of the logits, with random shapes and options. Each is compiled with the pass and checked:
(a) rewritten iff legal (else skipped for the expected reason), (b) the same loss and gradients
as eager, (c) no graph break (fullgraph) and, with dynamic=True, no recompile for a second size.
``--fuzz-examples N`` raises the CI budget.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from harness import check
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

HEADS = ["linear", "linear-bias", "matmul-T", "matmul-t", "mm-flat"]
CHAIN_OPS = ["float", "view", "contiguous", "scale", "softcap", "slice"]
LOSSES = ["mean", "sum", "none", "smoothing", "weights", "nll", "sum-div"]
EXTRA = ["none", "returned", "z-loss", "second-loss"]


@dataclasses.dataclass
class Model:
    head: str
    chain: list[str]
    loss: str
    extra: str
    cap: float
    scale: float

    def legal(self) -> str | None:
        """None if the pass must rewrite, else the reason it must give (chain first: the
        pass walks the chain before it looks at other users)."""
        chain = (["view"] if self.head == "mm-flat" else []) + self.chain  # mm-flat reshapes
        if "softcap" in chain and "scale" in chain[chain.index("softcap") :]:
            return "unsupported_op_in_chain"  # scaled after the softcap
        if "slice" in chain and "view" in chain[: chain.index("slice")]:
            return "unsupported_op_in_chain"  # rows sliced after a reshape
        if self.extra in ("returned", "second-loss"):
            return "logits_escape"
        return None

    def __call__(self, x, w, b, y, cw):
        if self.head == "linear":
            z = F.linear(x, w)
        elif self.head == "linear-bias":
            z = F.linear(x, w, b)
        elif self.head == "matmul-T":
            z = x @ w.T
        elif self.head == "matmul-t":
            z = torch.matmul(x, w.t())
        else:
            z = torch.mm(x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], -1)
        targets = y
        for op in self.chain:
            if op == "float":
                z = z.float()
            elif op == "view":  # reshape: a sliced z may not be viewable
                z = z.reshape(-1, z.shape[-1])
                targets = targets.reshape(-1)
            elif op == "contiguous":
                z = z.contiguous()
            elif op == "scale":
                z = z * self.scale
            elif op == "softcap":
                z = torch.tanh(z / self.cap) * self.cap
            elif op == "slice":
                if z.dim() == 3:
                    z, targets = z[:, :-1, :], targets[:, 1:]
                else:
                    z, targets = z[1:], targets[1:]
        escaped = z
        z2, t2 = z.reshape(-1, z.shape[-1]), targets.reshape(-1)
        if self.loss == "nll":
            loss = F.nll_loss(F.log_softmax(z2, dim=-1), t2)
        elif self.loss == "sum-div":
            loss = F.cross_entropy(z2, t2, reduction="sum") / 7
        elif self.loss == "none":
            loss = F.cross_entropy(z2, t2, reduction="none").sum()
        elif self.loss == "smoothing":
            loss = F.cross_entropy(z2, t2, label_smoothing=0.15)
        elif self.loss == "weights":
            loss = F.cross_entropy(z2, t2, weight=cw)
        else:
            loss = F.cross_entropy(z2, t2, reduction=self.loss)
        if self.extra == "z-loss":
            return loss + 1e-2 * torch.logsumexp(escaped.float(), -1).square().mean()
        if self.extra == "second-loss":
            return loss + escaped.float().square().mean()
        if self.extra == "returned":
            return loss, escaped
        return loss


@st.composite
def models(draw):
    # Each op at most once: repeated row slices would shrink T to 1, which Dynamo specialises.
    chain = draw(st.lists(st.sampled_from(CHAIN_OPS), max_size=3, unique=True))
    return Model(
        head=draw(st.sampled_from(HEADS)),
        chain=chain,
        loss=draw(st.sampled_from(LOSSES)),
        extra=draw(st.sampled_from(EXTRA)),
        cap=draw(st.sampled_from([3.0, 20.0])),
        scale=draw(st.sampled_from([0.5, 2.0])),
    )


def make_inputs(batch, time, dim, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, time, dim, generator=gen, requires_grad=True)
    w = (torch.randn(vocab, dim, generator=gen) / dim**0.5).requires_grad_()
    b = (torch.randn(vocab, generator=gen) * 0.1).requires_grad_()
    y = torch.randint(0, vocab, (batch, time), generator=gen)
    y[0, 0] = -100
    cw = torch.rand(vocab, generator=gen) + 0.5
    return x, w, b, y, cw


def _run(model, sizes, seed, backend, dynamic):
    batch, time, dim, vocab = sizes
    args = make_inputs(batch, time, dim, vocab, seed)
    extra = [make_inputs(batch + 1, time + 2, dim, vocab, seed + 1)] if dynamic else []
    outcome = check(
        model,
        args,
        backend=backend,
        dynamic=dynamic,
        extra_calls=extra,
        backward_all=model.extra == "returned",
    )
    reason = model.legal()
    if reason is None:
        assert outcome.rewritten >= 1 and outcome.skipped == {}, outcome
        assert outcome.has_op
    else:
        assert outcome.rewritten == 0 and set(outcome.skipped) == {reason}, outcome
    assert not outcome.recompiled, outcome


# Every example compiles: shrinking would take minutes. The failing example is printed as is.
NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]
# (B, T, D, V) from disjoint ranges: Dynamo's duck sizing would tie equal first-call sizes
# into one symbol and recompile when the second size breaks the tie.
SIZES = st.tuples(st.integers(2, 3), st.integers(4, 6), st.integers(7, 11), st.integers(12, 19))


def test_fuzz_with_the_pass_and_aot_autograd(fuzz_examples):
    @settings(
        max_examples=fuzz_examples(30),
        deadline=None,
        print_blob=True,
        phases=NO_SHRINK,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(models(), SIZES, st.integers(0, 1000), st.booleans())
    def run(model, sizes, seed, dynamic):
        _run(model, sizes, seed, "cce-eager", dynamic)

    run()


def test_fuzz_with_the_auto_enabled_hook(fuzz_examples):
    @settings(
        max_examples=fuzz_examples(6),
        deadline=None,
        print_blob=True,
        phases=NO_SHRINK,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(models(), SIZES, st.integers(0, 1000))
    def run(model, sizes, seed):
        _run(model, sizes, seed, "hook", False)

    run()
