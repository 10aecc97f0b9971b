"""cce_compile's op under TRL 1.16's fused LM head. Opt-in::

    from cce_compile.integrations import trl as cce_trl

    cce_trl.install()              # raises TRLIntegrationError unless TRL is the one below
    SFTTrainer(...).train()        # the fused head's log-probs come from cce_compile's op
    cce_trl.counts()               # {'served': ..., 'handed_to_trl': ..., 'reasons': {...}}
    cce_trl.uninstall()            # TRL's own function again

Why a hook and not the graph pass: every TRL 1.16 trainer (SFT, DPO, KTO, GRPO, RLOO) patches
its model with ``trl.trainer.utils.add_fused_lm_head``, whose ``fused_lm_head=True`` forward
never builds the logits: it calls, looked up at call time, the module global
``trl.trainer.utils._ChunkedLogProbFunction`` (TRL's ``ChunkedLogProbFunction``)::

    apply(hidden[N, D], weight[V, D], bias | None, targets[N], temperature, chunk_size,
          final_logit_softcapping, logit_scale, outputs)
      -> (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1), None where not in outputs

So there is no ``linear -> cross_entropy`` for the pass to find. ``install()`` assigns that
global, once it has checked that TRL is the version, global, signature and set of outputs this
code was written for, and that ours agrees with TRL's function on a tiny problem.

Served by the op (``reduction='none'``; temperature folded into ``logit_scale`` and
``softcap``): SFTTrainer's ``("log_probs", "entropy", "is_top1")``, whose entropy it detaches,
and a reference model's ``("log_probs",)``. Entropy and argmax are the op's ``return_entropy`` /
``return_argmax`` outputs, from the loss's own pass, without gradient. Handed to TRL's own
function unchanged (``_reason_to_hand_over``): ``log_sum_sq_probs`` / ``mean_logits`` (DPO, KTO),
the RL policies' ``("log_probs", "entropy")`` (GRPO, RLOO: their loss may differentiate the
entropy, and their no-grad and grad calls must use one kernel for the importance ratio),
float64, DTensors, DeepSpeed ZeRO-3 (its backward must re-gather the head), a temperature or
softcap <= 0.

Numerics: the op keeps float32 logits from the (autocast-rounded) operands; TRL rounds each
logits tile to the compute dtype. In float32 the two agree to ~1e-7; under bf16 autocast
(SFTConfig's default ``bf16=True``) the logged loss, entropy and accuracy differ slightly, ours
closer to the exact values. Hence opt-in. docs/trl.md.
"""

from __future__ import annotations

import inspect
import logging
import math
import sys

import torch
from torch import Tensor

from ..functional import linear_cross_entropy

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = ()

log = logging.getLogger("cce_compile")

# What this code was written against (checked on TRL 1.16.0).
SUPPORTED_TRL = (1, 16)
_FORWARD_PARAMS = (
    "ctx",
    "hidden",
    "weight",
    "bias",
    "targets",
    "temperature",
    "chunk_size",
    "final_logit_softcapping",
    "logit_scale",
    "outputs",
)
_OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
SERVED_OUTPUTS = frozenset({"log_probs", "entropy", "is_top1"})
_GLOBAL = "_ChunkedLogProbFunction"  # in trl.trainer.utils

_original: type | None = None  # TRL's function, while ours is installed
_counts: dict[str, int] = {"served": 0, "handed_to_trl": 0}
_reasons: dict[str, int] = {}
_logged: set[str] = set()


class TRLIntegrationError(RuntimeError):
    """The installed TRL is not the one this integration was written for (nothing changed)."""


def _refuse(found: str) -> TRLIntegrationError:
    import trl

    low = f"{SUPPORTED_TRL[0]}.{SUPPORTED_TRL[1]}"
    return TRLIntegrationError(
        f"cce_compile.integrations.trl is written for TRL {low}.x; installed trl "
        f"{trl.__version__}: {found}. Nothing was changed: TRL's own fused LM head still runs. "
        f"Install trl=={low}.* to use cce_compile's op under it, or do not call install()."
    )


def _trl_modules():
    """(kernel module, trainer utils module) of the installed TRL."""
    try:
        import trl.kernels.chunked_logprob as kernel
        import trl.trainer.utils as trainer_utils
    except ImportError as exc:
        raise TRLIntegrationError(
            f"cce_compile.integrations.trl needs trl {SUPPORTED_TRL[0]}.{SUPPORTED_TRL[1]}.x "
            f"importable: {exc}"
        ) from exc
    return kernel, trainer_utils


def check_trl() -> type:
    """TRL's ``ChunkedLogProbFunction`` if the installed TRL is what this integration was
    written for (version, the global it patches, ``forward``'s parameters, the optional
    outputs); raises ``TRLIntegrationError`` naming what differs otherwise."""
    import trl

    kernel, trainer_utils = _trl_modules()
    try:
        version = tuple(int(part) for part in trl.__version__.split(".")[:2])
    except ValueError:
        version = None
    if version != SUPPORTED_TRL:
        raise _refuse("not a version this integration was checked against")
    function = getattr(kernel, "ChunkedLogProbFunction", None)
    current = getattr(trainer_utils, _GLOBAL, None)
    if function is None or current is not function:
        raise _refuse(
            f"trl.trainer.utils.{_GLOBAL} is {current!r}, not trl's ChunkedLogProbFunction "
            "(another integration replaced it)"
        )
    params = tuple(inspect.signature(function.forward).parameters)
    if params != _FORWARD_PARAMS:
        raise _refuse(f"ChunkedLogProbFunction.forward takes {params}, expected {_FORWARD_PARAMS}")
    optional = tuple(getattr(kernel, "OPTIONAL_OUTPUTS", ()))
    if optional != _OPTIONAL_OUTPUTS:
        raise _refuse(f"its OPTIONAL_OUTPUTS are {optional}, expected {_OPTIONAL_OUTPUTS}")
    return function


def _zero3() -> bool:
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:
        return False
    return bool(is_deepspeed_zero3_enabled())


def _reason_to_hand_over(hidden, weight, bias, temperature, softcap, outputs) -> str | None:
    """Why the op cannot serve this call exactly as TRL would (TRL's function then does)."""
    extra = set(outputs) - SERVED_OUTPUTS
    if extra:
        return f"outputs {sorted(extra)}"
    if "entropy" in outputs and "is_top1" not in outputs:
        # ("log_probs", "entropy") is the RL policies' request (GRPO, RLOO, async GRPO): their
        # loss may differentiate the entropy (an entropy bonus), which the op's has no
        # gradient for, and the no-grad call that gives the old log-probs must use the same
        # kernel as the one with gradients. SFTTrainer asks for is_top1 too, and detaches.
        return "entropy of an RL policy"
    tensors = [t for t in (hidden, weight, bias) if t is not None]
    if any(t.dtype == torch.float64 for t in tensors):
        return "float64"
    if any(isinstance(t, DTensor) for t in tensors):
        return "DTensor"
    if hidden.dim() != 2:
        return "hidden is not 2-D"
    if not temperature > 0 or (softcap is not None and not softcap > 0):
        return "temperature or softcap <= 0"
    if _zero3():
        return "DeepSpeed ZeRO-3 (the backward must re-gather the head)"
    return None


def _serve(hidden, weight, bias, targets, temperature, softcap, logit_scale, outputs):
    """TRL's 5-tuple from cce_compile's op: float32 log-probs (differentiable), float32 entropy
    and bool is_top1 (no gradient), None for the fields not asked for."""
    # TRL's logits: softcap * tanh(logit_scale * y / softcap) / T, the op's: c * tanh(s * y / c);
    # with s = logit_scale / T and c = softcap / T they are the same.
    scale = float(logit_scale) / float(temperature)
    cap = None if softcap is None else float(softcap) / float(temperature)
    if not torch.is_autocast_enabled(hidden.device.type):
        # Without autocast TRL computes in hidden's dtype (cast_lm_head_to_fp32 gives a float32
        # hidden beside a bf16 head): so does the op, with gradients in the head's own dtype.
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
    want_entropy, want_top1 = "entropy" in outputs, "is_top1" in outputs
    # The op's entropy and argmax come from the loss's own pass, without gradient: SFTTrainer
    # detaches its entropy; an RL policy's entropy is handed to TRL (_reason_to_hand_over).
    result = linear_cross_entropy(
        hidden,
        weight,
        targets,
        bias,
        reduction="none",
        logit_scale=scale,
        softcap=cap,
        return_entropy=want_entropy,
        return_argmax=want_top1,
    )
    # (a bare tensor when neither metric is asked for: a reference model's log-probs)
    nll, *metrics = result if isinstance(result, tuple) else (result,)
    entropy = metrics.pop(0) if want_entropy else None
    is_top1 = metrics.pop(0) == targets if want_top1 else None
    return -nll, entropy, None, None, is_top1


@torch.compiler.assume_constant_result
def _tally(key: str, reason: str = "") -> bool:
    """Count a served or handed-over call, and log a reason to hand over the first time.

    Under torch.compile Dynamo runs this once per trace instead of putting it in the graph (a
    counter in the graph would be a guard on its value: a recompile per step), so compiled
    code is counted per trace (one or a few per compilation: Dynamo may restart a trace), not
    per call.
    """
    _counts[key] += 1
    if reason:
        _reasons[reason] = _reasons.get(reason, 0) + 1
        if reason not in _logged:
            _logged.add(reason)
            log.warning("cce_compile.integrations.trl: %s: handed to TRL's function", reason)
    return True


class CCEChunkedLogProb:
    """Stands in for ``ChunkedLogProbFunction`` (TRL calls only ``.apply``): same arguments,
    same 5-tuple; ``chunk_size`` is TRL's tiling and is not used by the op."""

    @staticmethod
    def apply(
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = _OPTIONAL_OUTPUTS,
    ):
        reason = _reason_to_hand_over(
            hidden, weight, bias, temperature, final_logit_softcapping, outputs
        )
        if reason is not None:
            _tally("handed_to_trl", reason)
            trl_function = _original if _original is not None else check_trl()
            return trl_function.apply(
                hidden,
                weight,
                bias,
                targets,
                temperature,
                chunk_size,
                final_logit_softcapping,
                logit_scale,
                outputs,
            )
        _tally("served")
        return _serve(
            hidden,
            weight,
            bias,
            targets,
            temperature,
            final_logit_softcapping,
            logit_scale,
            outputs,
        )


def _self_check(trl_function: type) -> None:
    """Ours against TRL's own function on tiny float32 problems (CPU, milliseconds): values of
    every served output and the gradients of the log-probs."""
    gen = torch.Generator().manual_seed(0)
    rows, dim, vocab = 6, 8, 37
    hidden = torch.randn(rows, dim, generator=gen, requires_grad=True)
    weight = (torch.randn(vocab, dim, generator=gen) / math.sqrt(dim)).requires_grad_()
    bias = torch.randn(vocab, generator=gen).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    outputs = ("log_probs", "entropy", "is_top1")
    cases = ((None, 1.0, None, 1.0), (bias, 0.7, 3.0, 0.5))  # bias, temperature, softcap, scale
    with torch.autocast("cpu", enabled=False):
        for case_bias, temperature, softcap, scale in cases:
            args = (targets, temperature, 16, softcap, scale, outputs)
            want = trl_function.apply(hidden, weight, case_bias, *args)
            got = _serve(hidden, weight, case_bias, targets, temperature, softcap, scale, outputs)
            inputs = tuple(t for t in (hidden, weight, case_bias) if t is not None)
            want_grads = torch.autograd.grad(want[0].sum(), inputs)
            got_grads = torch.autograd.grad(got[0].sum(), inputs)
            agree = {
                "log_probs": torch.allclose(got[0], want[0], rtol=1e-4, atol=1e-5),
                "entropy": torch.allclose(got[1], want[1].detach(), rtol=1e-4, atol=1e-5),
                "is_top1": torch.equal(got[4], want[4]),
                "gradients": all(
                    torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                    for a, b in zip(got_grads, want_grads)
                ),
            }
            if not all(agree.values()):
                raise TRLIntegrationError(
                    "cce_compile's op disagrees with TRL's ChunkedLogProbFunction on a tiny "
                    f"problem (temperature {temperature}, softcap {softcap}, logit_scale "
                    f"{scale}, bias {case_bias is not None}): {agree}. Nothing was changed; "
                    "please report this with your trl and torch versions."
                )


def install(*, self_check: bool = True) -> None:
    """Route TRL's fused LM head through cce_compile's op (all trainers, all models in the
    process; before or after building the trainer). Idempotent. Raises
    ``TRLIntegrationError`` and changes nothing when the installed TRL is not 1.16.x as
    checked by ``check_trl``, or when ``self_check`` finds the two disagreeing."""
    global _original
    _, trainer_utils = _trl_modules()
    if getattr(trainer_utils, _GLOBAL, None) is CCEChunkedLogProb:
        return
    trl_function = check_trl()
    if self_check:
        _self_check(trl_function)
    _original = trl_function
    setattr(trainer_utils, _GLOBAL, CCEChunkedLogProb)
    log.info("cce_compile.integrations.trl: installed under TRL's fused LM head")


def uninstall() -> None:
    """Put TRL's own function back (nothing to do if ours is not installed). Raises if another
    integration replaced ours since: restoring TRL's would silently remove theirs."""
    global _original
    if _original is None:
        return
    _, trainer_utils = _trl_modules()
    current = getattr(trainer_utils, _GLOBAL, None)
    if current is not CCEChunkedLogProb:
        raise TRLIntegrationError(
            f"trl.trainer.utils.{_GLOBAL} was replaced by {current!r} after cce_compile's "
            "install(); not restoring TRL's function over it"
        )
    setattr(trainer_utils, _GLOBAL, _original)
    _original = None


def installed() -> bool:
    """Is cce_compile's op under TRL's fused LM head now? (Does not import TRL.)"""
    trainer_utils = sys.modules.get("trl.trainer.utils")
    return getattr(trainer_utils, _GLOBAL, None) is CCEChunkedLogProb


def counts() -> dict:
    """Calls served by the op and calls handed to TRL's function (with why), since import or
    ``reset_counts()``. Compiled code counts once per trace (one or a few per compilation), not
    per call."""
    return {**_counts, "reasons": dict(_reasons)}


def reset_counts() -> None:
    _counts.update(served=0, handed_to_trl=0)
    _reasons.clear()
