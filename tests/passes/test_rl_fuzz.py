"""Hypothesis fuzzing of RL's graph forms, as test_fuzz.py fuzzes the loss forms.

A step is composed from a head, an optional float32 cast, a temperature (by div, by mul, in
place with ``div_`` / ``mul_``, or none), an optional sequence slice (TRL's before the
temperature, verl's after it), a log-prob form and an entropy form (either may be absent, not
both; the entropy with or without a gradient), in float32 or bf16, and a hazard: another view of
the logits read after the in-place temperature, or an entropy of the logits before the
temperature. Each is compiled with the pass and checked: (a) fused into one op call iff legal,
else left alone for the expected reason, (b) the same log-probs, entropy and gradients as eager,
(c) no graph break. ``--fuzz-examples N`` raises the CI budget.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from harness import check
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from rl_forms import trl_entropy, trl_log_probs, verl_entropy, verl_log_probs

LOG_PROBS = ["log_softmax-gather", "gather-logsumexp", "trl", "verl", "cross_entropy", "none"]
ENTROPIES = ["trl-chunks", "softmax-log_softmax", "verl", "chunk-cat", "none"]
TEMPERATURES = ["div", "mul", "div_", "mul_", "none"]
SLICES = ["none", "trl", "verl"]
HAZARDS = ["none", "view-read-after", "entropy-before-temperature"]
KEEP = 3  # completion tokens kept by the slices


@dataclasses.dataclass
class Step:
    log_probs: str
    entropy: str
    temperature: str
    slice: str
    cast: bool
    entropy_grad: bool
    chunk: int
    hazard: str

    def legal(self) -> set[str]:
        """The reasons the pass may give for leaving the site(s) alone; empty if it fuses."""
        reasons = set()
        if self.hazard == "view-read-after":
            # in place: the write stays, a mutation; out of place: the view escapes
            reasons |= {"mutation_in_region", "logits_escape"}
        if self.hazard == "entropy-before-temperature":
            if self.temperature != "none" or self.slice == "verl":  # two sets of logits
                reasons.add("logits_escape")
            elif self.log_probs == "none" and self.entropy_grad:
                # A known limit: a differentiated entropy beside a no-grad one of the same
                # logits, with no log-prob site, is left alone (exact, with this reason); with
                # a log-prob site both fuse into one call.
                reasons.add("logits_escape")
        return reasons

    def __call__(self, x, w, ids):
        z = F.linear(x, w)
        if self.cast:
            z = z.float()
        if self.slice == "trl":
            z = z[:, :-1][:, -KEEP:]
        view = z[0] if self.hazard == "view-read-after" else None  # (a view of any layout)
        early = None
        if self.hazard == "entropy-before-temperature":
            with torch.no_grad():  # (eager cannot differentiate it once z is divided in place)
                early = verl_entropy(z)
        z = self._temperature(z)
        if self.slice == "verl":
            z = z[:, -KEEP - 1 : -1]
        outputs = [self._log_probs(z, ids), self._entropy(z)]
        outputs = [o for o in outputs if o is not None]
        if view is not None:
            outputs.append(view.sum(-1))
        if early is not None:
            outputs.append(early)
        return tuple(outputs)

    def _temperature(self, z):
        if self.temperature == "div":
            return z / 0.7
        if self.temperature == "mul":
            return z * 1.25
        if self.temperature == "div_":
            z.div_(0.7)
        elif self.temperature == "mul_":
            z.mul_(1.25)
        return z

    def _log_probs(self, z, ids):
        if self.log_probs == "log_softmax-gather":
            return F.log_softmax(z, -1).gather(-1, ids[..., None]).squeeze(-1)
        if self.log_probs == "gather-logsumexp":
            return z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, -1)
        if self.log_probs == "trl":
            return trl_log_probs(z, ids)
        if self.log_probs == "verl":
            return verl_log_probs(z, ids)
        if self.log_probs == "cross_entropy":
            flat = z.reshape(-1, z.shape[-1])
            return -F.cross_entropy(flat, ids.reshape(-1), reduction="none").view_as(ids)
        return None

    def _entropy(self, z):
        with contextlib.nullcontext() if self.entropy_grad else torch.no_grad():
            if self.entropy == "trl-chunks":
                return trl_entropy(z, chunk_size=self.chunk)
            if self.entropy == "softmax-log_softmax":
                return -(F.softmax(z, -1) * F.log_softmax(z, -1)).sum(-1)
            if self.entropy == "verl":
                return verl_entropy(z)
            if self.entropy == "chunk-cat":
                return torch.cat([verl_entropy(c) for c in z.chunk(2, dim=0)])
        return None


@st.composite
def steps(draw):
    log_probs = draw(st.sampled_from(LOG_PROBS))
    entropies = [e for e in ENTROPIES if e != "none" or log_probs != "none"]
    hazard = draw(st.sampled_from(HAZARDS))
    temperature = draw(st.sampled_from(TEMPERATURES))
    if hazard == "view-read-after" and temperature not in ("div_", "mul_"):
        hazard = "none"  # (a view read after an out-of-place temperature is test_rl_forms')
    return Step(
        log_probs=log_probs,
        entropy=draw(st.sampled_from(entropies)),
        temperature=temperature,
        slice=draw(st.sampled_from(SLICES)),
        cast=draw(st.booleans()),
        entropy_grad=draw(st.booleans()),
        chunk=draw(st.integers(1, 7)),
        hazard=hazard,
    )


def make_inputs(time, dim, vocab, dtype, sliced, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, time, dim, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, dim, generator=gen) / dim**0.5).to(dtype).requires_grad_()
    ids = torch.randint(0, vocab, (2, KEEP if sliced else time), generator=gen)
    return x, w, ids


# Every example compiles: shrinking would take minutes. The failing example is printed as is.
NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]


def test_fuzz_rl_forms_with_the_pass_and_aot_autograd(fuzz_examples):
    @settings(
        max_examples=fuzz_examples(8),
        deadline=None,
        print_blob=True,
        phases=NO_SHRINK,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(
        steps(),
        st.integers(5, 8),  # T
        st.integers(7, 11),  # D
        st.integers(12, 19),  # V
        st.sampled_from([torch.float32, torch.bfloat16]),
        st.integers(0, 1000),
    )
    def run(step, time, dim, vocab, dtype, seed):
        args = make_inputs(time, dim, vocab, dtype, step.slice != "none", seed)
        outcome = check(step, args, dtype=dtype, backward_all=True)
        reasons = step.legal()
        if not reasons:
            assert outcome.rewritten == 1 and outcome.skipped == {}, outcome
            ops = [n for n in outcome.targets() if n is torch.ops.cce.linear_cross_entropy.default]
            assert len(ops) == 1, outcome  # log-probs and entropy: one call
        else:
            assert outcome.rewritten == 0 and outcome.skipped, outcome
            assert set(outcome.skipped) <= reasons, outcome

    run()
