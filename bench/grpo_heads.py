"""What TRL's fused LM head runs in each of bench/grpo_e2e.py's variants: TRL's own kernel,
cce_compile's op (its TRL integration, optionally under a memory budget), or the logits
materialised as TRL did before its fused head; each wrapped by a ``Recorder`` that keeps the
first calls' inputs and log-probs for the step-0 checks."""

from __future__ import annotations

import contextlib
import re

import torch


class LogitsLogProb:
    """Stands in for TRL's fused-head kernel (same ``apply`` and 5-tuple) with TRL's logits
    path: the logits of the head in the trainer's autocast dtype, then TRL 1.16's
    ``selective_log_softmax_and_entropy`` / ``selective_log_softmax``."""

    @staticmethod
    def apply(
        hidden,
        weight,
        bias,
        targets,
        temperature,
        chunk_size,
        softcap=None,
        logit_scale=1.0,
        outputs=("log_probs",),
    ):
        import torch.nn.functional as F
        from trl.trainer import utils

        logits = F.linear(hidden, weight, bias) * logit_scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        entropy = None
        if "entropy" in outputs:
            logp, entropy = utils.selective_log_softmax_and_entropy(
                logits,
                targets,
                entropy_requires_grad=torch.is_grad_enabled(),
                temperature=temperature,
            )
            entropy = entropy.float()
        else:
            logp = utils.selective_log_softmax(logits, targets, temperature=temperature)
        return logp.float(), entropy, None, None, None


def _copy(tensor):
    return tensor.detach().to("cpu", copy=True)


class Recorder:
    """Wraps the kernel TRL's fused head calls: keeps the first calls' inputs and log-probs
    (on the CPU, so that they weigh nothing in the run's peak)."""

    def __init__(self, inner, keep: int = 3):
        self.inner, self.keep, self.calls = inner, keep, []

    def apply(self, hidden, weight, bias, targets, temperature, *rest):
        out = self.inner.apply(hidden, weight, bias, targets, temperature, *rest)
        if len(self.calls) < self.keep:
            self.calls.append(
                dict(
                    grad=torch.is_grad_enabled(),
                    outputs=tuple(rest[-1]),
                    temperature=temperature,
                    hidden=_copy(hidden),
                    targets=_copy(targets),
                    weight=None if self.calls else _copy(weight),  # (the step updates it)
                    logp=_copy(out[0]),
                )
            )
        return out


@contextlib.contextmanager
def head_kernel(variant: str):
    """TRL's fused head running ``variant``'s kernel, wrapped by a Recorder. ``cce_<N>mb``: cce
    with its memory budget set to N MiB (``CCE_MEMORY_BUDGET_MB``) instead of 1/5 of the logits."""
    import trl.trainer.utils as trl_utils

    import cce_compile
    from cce_compile.integrations import trl as cce_trl

    trl_kernel = trl_utils._ChunkedLogProbFunction
    budget = re.fullmatch(r"cce_(\d+)mb", variant)
    with contextlib.ExitStack() as stack:
        if variant.startswith("cce"):
            cce_trl.install()
            stack.callback(cce_trl.uninstall)
            cce_trl.reset_counts()
        if budget:
            stack.enter_context(cce_compile.config.override(memory_budget_mb=int(budget[1])))
        inner = LogitsLogProb if variant == "logits" else trl_utils._ChunkedLogProbFunction
        recorder = Recorder(inner)
        trl_utils._ChunkedLogProbFunction = recorder
        try:
            yield recorder
        finally:  # ours (or TRL's) back before uninstall() checks that it is ours
            trl_utils._ChunkedLogProbFunction = inner if variant != "logits" else trl_kernel
