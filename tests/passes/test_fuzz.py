"""Hypothesis fuzzing of matched graphs.

Small models are composed from a head, a chain of row-wise ops, a loss, an optional extra
user of the logits and optional dead uses of them (views nothing reads), with random shapes and
options. Each is compiled with the pass and checked:
(a) rewritten iff legal (else skipped for the expected reason), (b) the same loss and gradients
as eager, (c) no graph break (fullgraph) and, with dynamic=True, no recompile for a second size.
``--fuzz-examples N`` raises the CI budget.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from harness import check, inductor_without_codegen
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

HEADS = ["linear", "linear-bias", "matmul-T", "matmul-t", "mm-flat"]
CHAIN_OPS = ["float", "view", "contiguous", "scale", "softcap", "slice"]
LOSSES = ["mean", "sum", "none", "smoothing", "weights", "nll", "sum-div", "class-dim-1"]
EXTRA = ["none", "returned", "z-loss", "second-loss"]
# Uses of the logits that nothing reads (dead code decides no escape): a view of the head's
# output, a reshape of the loss input, a chain of views of the head's output. Their sizes are
# read from the logits: a constant would specialise a dynamic size.
DEAD_USES = ["none", "view", "reshape", "chain-of-views"]
# What users do around the site that must not change the result: in-place writes (to what the
# op reads, or to later targets, which it may), grad mode, and edge constants.
HAZARDS = [
    "none",
    "mutate-hidden",
    "mutate-logits",
    "mutate-targets",
    "no-grad-head",
    "detach-logits",
    "zero-constants",
    "divide-by-zero",
]


@dataclasses.dataclass
class Model:
    head: str
    chain: list[str]
    loss: str
    extra: str
    cap: float
    scale: float
    hazard: str = "none"
    dead: str = "none"

    def legal(self) -> set[str]:
        """The reasons the pass may give for leaving the site alone; empty if it must
        rewrite. (Several apply to some models: the pass names the first it finds.)"""
        chain = (["view"] if self.head == "mm-flat" else []) + self.chain  # mm-flat reshapes
        reasons = set()
        if "slice" in chain and "view" in chain[: chain.index("slice")]:
            reasons.add("unsupported_op_in_chain")  # rows sliced after a reshape
        # Returned logits: fused, with a placeholder in their place, where the loss trains
        # (CCE_ESCAPING_LOGITS=drop, the default); kept as they are where it does not.
        untrained = self.hazard in ("no-grad-head", "detach-logits")
        if self.extra == "second-loss" or (self.extra == "returned" and untrained):
            reasons.add("logits_escape")
        if self.hazard in ("mutate-hidden", "mutate-logits"):
            reasons.add("mutation_in_region")
        if (self.hazard == "zero-constants" and "softcap" in chain) or (
            self.hazard == "divide-by-zero"
        ):
            reasons.add("unsupported_option")
        return reasons

    def __call__(self, x, w, b, y, cw):
        if self.hazard == "mutate-hidden":
            # Written after the head: w's gradient would need the old x, so w takes none.
            x, w = x * 1.0, w.detach()
        with torch.no_grad() if self.hazard == "no-grad-head" else contextlib.nullcontext():
            z = self._head(x, w, b)
        if self.dead == "view":
            z.view(-1, z.shape[-1])
        elif self.dead == "chain-of-views":
            z.view(-1, z.shape[-1]).float().view(z.shape).contiguous()
        if self.hazard == "mutate-hidden":
            x.mul_(2.0)
        elif self.hazard == "mutate-logits":
            z.add_(0.5)  # (an in-place scaling, z.mul_(c), is made out of place and fused)
        elif self.hazard == "detach-logits":
            z = z.detach()
        loss = self._loss(z, y, cw)
        if self.hazard in ("no-grad-head", "detach-logits", "mutate-hidden"):
            loss = _add_to_first(loss, (x * 0).sum())  # a gradient path besides the logits
        return loss

    @property
    def cap_value(self) -> float:
        return 0.0 if self.hazard == "zero-constants" else self.cap

    @property
    def scale_value(self) -> float:
        return 0.0 if self.hazard == "zero-constants" else self.scale

    def _head(self, x, w, b):
        if self.head == "linear":
            return F.linear(x, w)
        if self.head == "linear-bias":
            return F.linear(x, w, b)
        if self.head == "matmul-T":
            return x @ w.T
        if self.head == "matmul-t":
            return torch.matmul(x, w.t())
        return torch.mm(x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], -1)

    def _loss(self, z, y, cw):
        targets = y
        if self.hazard == "mutate-targets":
            targets = y.clone()
            targets[targets == 1] = -100  # read at the loss: fine to rewrite
        for op in self.chain:
            if op == "float":
                z = z.float()
            elif op == "view":  # reshape: a sliced z may not be viewable
                z = z.reshape(-1, z.shape[-1])
                targets = targets.reshape(-1)
            elif op == "contiguous":
                z = z.contiguous()
            elif op == "scale":
                z = z * self.scale_value
            elif op == "softcap":
                z = torch.tanh(z / self.cap_value) * self.cap_value
            elif op == "slice":
                if z.dim() == 3:
                    z, targets = z[:, :-1, :], targets[:, 1:]
                else:
                    z, targets = z[1:], targets[1:]
        if self.hazard == "divide-by-zero":
            z = z / 0.0
        escaped = z
        if self.dead == "reshape":
            z.reshape(-1, z.shape[-1])
        z2, t2 = z.reshape(-1, z.shape[-1]), targets.reshape(-1)
        if self.loss == "class-dim-1" and z.dim() == 3:  # (B, V, T): classes in dim 1
            loss = F.cross_entropy(z.transpose(1, 2), targets)
        elif self.loss == "nll":
            loss = F.nll_loss(F.log_softmax(z2, dim=-1), t2)
        elif self.loss == "sum-div":
            loss = F.cross_entropy(z2, t2, reduction="sum") / 7
        elif self.loss == "none":
            loss = F.cross_entropy(z2, t2, reduction="none").sum()
        elif self.loss == "smoothing":
            loss = F.cross_entropy(z2, t2, label_smoothing=0.15)
        elif self.loss == "weights":
            loss = F.cross_entropy(z2, t2, weight=cw)
        else:  # mean, sum; class-dim-1 of 2-D logits (no class dim to move) takes the mean
            loss = F.cross_entropy(z2, t2, reduction="sum" if self.loss == "sum" else "mean")
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
        hazard=draw(st.sampled_from(HAZARDS)),
        dead=draw(st.sampled_from(DEAD_USES)),
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


def _scaled_after_softcap(model: Model) -> bool:
    chain = model.chain
    return "softcap" in chain and "scale" in chain[chain.index("softcap") :]


def _run(model, sizes, seed, backend, dynamic):
    batch, time, dim, vocab = sizes
    args = make_inputs(batch, time, dim, vocab, seed)
    extra = [make_inputs(batch + 1, time + 2, dim, vocab, seed + 1)] if dynamic else []
    # Returned logits: a placeholder where the site is fused (Model.legal); where it is left
    # alone, backward through them too.
    reasons = model.legal()
    if dynamic and _scaled_after_softcap(model):
        # dynamic=True makes the model's float scale a SymFloat, and folding a factor after
        # the softcap into the cap needs its value (walk._softcap): left alone, and said.
        reasons = reasons | {"unsupported_op_in_chain"}
    dropped = model.extra == "returned" and not reasons
    outcome = check(
        model,
        args,
        backend=backend,
        dynamic=dynamic,
        extra_calls=extra,
        backward_all=model.extra == "returned" and not dropped,
        dropped_logits=dropped,
    )
    if not reasons:
        assert outcome.rewritten >= 1 and outcome.skipped == {}, outcome
        assert outcome.has_op
    else:
        assert outcome.rewritten == 0 and set(outcome.skipped) <= reasons, outcome
        assert outcome.skipped, outcome
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
        # The hook's route into Inductor's compile, without its code generation: the verdicts
        # and the results are under test (the op's Inductor code: tests/test_backend.py).
        with inductor_without_codegen():
            _run(model, sizes, seed, "hook", False)

    run()


def _add_to_first(loss, term):
    """Add ``term`` to the loss, the first of the outputs."""
    if isinstance(loss, tuple):
        return (loss[0] + term, *loss[1:])
    return loss + term
