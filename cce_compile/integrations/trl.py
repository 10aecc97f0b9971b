"""cce_compile's op under TRL 1.16's fused LM head, for every trainer. Opt-in::

    from cce_compile.integrations import trl as cce_trl

    cce_trl.install()              # raises TRLIntegrationError unless TRL is the one below
    GRPOTrainer(...).train()       # the fused head's outputs come from cce_compile's op
    cce_trl.counts()               # {'served': ..., 'handed_to_trl': ..., 'reasons': {...}}
    cce_trl.uninstall()            # TRL's own function again

or, with no change to the script, the start-up hook (``CCE_COMPILE=1``) calls
``install_on_import()``, which installs it when TRL's trainer utilities are imported.

Why a hook and not the graph pass: every TRL 1.16 trainer (SFT, DPO and WPO, KTO, GRPO, RLOO)
patches its model with ``trl.trainer.utils.add_fused_lm_head``, whose ``fused_lm_head=True``
forward never builds the logits: it calls, looked up at call time, the module global
``trl.trainer.utils._ChunkedLogProbFunction`` (TRL's ``ChunkedLogProbFunction``)::

    apply(hidden[N, D], weight[V, D], bias | None, targets[N], temperature, chunk_size,
          final_logit_softcapping, logit_scale, outputs)
      -> (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1), None where not in outputs

That one global serves the policy's call with gradients, the no-grad calls for old log-probs
(GRPO, RLOO) and KTO's KL term, and the reference model's calls. ``install()`` assigns it once
it has checked that TRL is the version, global, signature and set of outputs this code was
written for, and that ours agrees with TRL's function on a tiny problem.

Every request is served by the op (``reduction='none'``, lean mode; TRL's temperature, which it
applies after the softcap, folded exactly into ``logit_scale / T`` and ``softcap / T``):
log-probs and entropy with gradients (an RL entropy bonus), ``is_top1`` as ``argmax ==
target``, DPO's and KTO's ``mean_logits`` and WPO's ``log_sum_sq_probs``. So a trainer's grad
and no-grad calls, and its policy and reference calls, run one kernel: a row's log-prob has the
same bits whatever the grad mode and the outputs asked for, and GRPO's importance ratio is
exactly 1, DPO's step-0 loss exactly log 2. Handed to TRL's own function, for reasons that are
the same for all of a model's calls (said once each at WARNING): float64, DTensors, DeepSpeed
ZeRO-3 (its backward must re-gather the head), a temperature or softcap <= 0.

Numerics: the op keeps float32 logits from the (autocast-rounded) operands; TRL rounds each
logits tile to the compute dtype. In float32 the two agree to ~1e-7; under bf16 autocast the
logged values differ slightly, ours closer to the exact ones. docs/trl.md.

This module imports neither torch nor TRL until it is used: the start-up hook imports it in
every process.
"""

from __future__ import annotations

import importlib
import importlib.abc
import inspect
import logging
import math
import sys
from typing import TYPE_CHECKING

from .. import import_hooks

if TYPE_CHECKING:
    from torch import Tensor

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
# TRL's optional outputs -> the op's row metrics (its ``return_<name>`` flags), and the order
# in which linear_cross_entropy returns those after the loss.
_OP_METRIC = {
    "entropy": "entropy",
    "is_top1": "argmax",
    "log_sum_sq_probs": "log_sum_sq_probs",
    "mean_logits": "mean_logits",
}
_OP_ORDER = ("entropy", "argmax", "log_sum_sq_probs", "mean_logits")
_UTILS = "trl.trainer.utils"
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
    """(kernel module, trainer utils module) of the installed TRL. By import_module, which
    also returns trl.trainer.utils while its import is finishing (install_on_import)."""
    try:
        kernel = importlib.import_module("trl.kernels.chunked_logprob")
        trainer_utils = importlib.import_module(_UTILS)
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


def _is_dtensor(tensor) -> bool:
    # No DTensor exists unless torch.distributed.tensor was imported.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def _reason_to_hand_over(hidden, weight, bias, temperature, softcap, outputs) -> str | None:
    """Why the op cannot serve this call exactly as TRL would (TRL's function then does).
    Each reason holds for every call of a model (its dtypes, its head's sharding, its
    temperature and softcap, the process's DeepSpeed stage), with and without gradients: a
    model's grad and no-grad calls are never split between the two kernels."""
    import torch

    unknown = set(outputs) - {"log_probs", *_OPTIONAL_OUTPUTS}
    if unknown:
        return f"outputs {sorted(unknown)} unknown to this integration"
    tensors = [t for t in (hidden, weight, bias) if t is not None]
    if any(t.dtype == torch.float64 for t in tensors):
        return "float64 (the op computes in float32, bf16 or float16)"
    if any(_is_dtensor(t) for t in tensors):
        return "DTensor"
    if hidden.dim() != 2:
        return "hidden is not 2-D"
    if not temperature > 0 or (softcap is not None and not softcap > 0):
        return "temperature or softcap <= 0"
    if _zero3():
        return "DeepSpeed ZeRO-3 (the backward must re-gather the head)"
    return None


def _serve(hidden, weight, bias, targets, temperature, softcap, logit_scale, outputs):
    """TRL's 5-tuple from cce_compile's op: float32 log-probs and entropy (differentiable),
    float32 log_sum_sq_probs and mean_logits and bool is_top1 (no gradient), None for the
    fields not asked for."""
    import torch

    from ..functional import linear_cross_entropy

    # TRL's logits: softcap * tanh(logit_scale * y / softcap) / T, the op's: c * tanh(s * y / c);
    # with s = logit_scale / T and c = softcap / T they are the same.
    scale = float(logit_scale) / float(temperature)
    cap = None if softcap is None else float(softcap) / float(temperature)
    # Without autocast TRL computes in hidden's dtype (cast_lm_head_to_fp32 gives a float32
    # hidden beside a bf16 head): so does the op, rounding the head a slab at a time (no
    # V x D float32 copy), with gradients in the head's own dtype.
    autocast = torch.is_autocast_enabled(hidden.device.type)
    compute_dtype = None if autocast or weight.dtype == hidden.dtype else hidden.dtype
    wanted = {_OP_METRIC[name] for name in outputs if name in _OP_METRIC}
    asked = [name for name in _OP_ORDER if name in wanted]
    result = linear_cross_entropy(
        hidden,
        weight,
        targets,
        bias,
        reduction="none",
        logit_scale=scale,
        softcap=cap,
        # Lean, whatever CCE_MODE says: one forward for the grad and the no-grad calls.
        mode="lean",
        compute_dtype=compute_dtype,
        **{f"return_{name}": True for name in asked},
    )
    # (a bare tensor when no metric is asked for: a reference model's log-probs)
    nll, *metrics = result if isinstance(result, tuple) else (result,)
    value = dict(zip(asked, metrics))
    argmax = value.get("argmax")
    is_top1 = None if argmax is None else argmax == targets
    extras = value.get("log_sum_sq_probs"), value.get("mean_logits")
    return -nll, value.get("entropy"), *extras, is_top1


def _tally(key: str, reason: str = "") -> bool:
    """Count a served or handed-over call, and log a reason to hand over the first time.

    ``install()`` marks it ``torch.compiler.assume_constant_result``: under torch.compile
    Dynamo runs it once per trace instead of putting it in the graph (a counter in the graph
    would be a guard on its value: a recompile per step), so compiled code is counted per trace
    (one or a few per compilation: Dynamo may restart a trace), not per call.
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


# The self-check's two problems: (bias, temperature, softcap, logit_scale).
_CHECK_CASES = ((False, 1.0, None, 1.0), (True, 0.7, 3.0, 0.5))


def _self_check(trl_function: type) -> None:
    """Ours against TRL's own function on tiny float32 problems (CPU, milliseconds): every
    output, and the gradients of the log-probs and of the entropy."""
    import torch

    gen = torch.Generator().manual_seed(0)
    rows, dim, vocab = 6, 8, 37
    hidden = torch.randn(rows, dim, generator=gen, requires_grad=True)
    weight = (torch.randn(vocab, dim, generator=gen) / math.sqrt(dim)).requires_grad_()
    bias = torch.randn(vocab, generator=gen).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    entropy_weights = torch.rand(rows, generator=gen)
    outputs = ("log_probs", *_OPTIONAL_OUTPUTS)
    with torch.autocast("cpu", enabled=False):
        for with_bias, temperature, softcap, scale in _CHECK_CASES:
            case_bias = bias if with_bias else None
            inputs = tuple(t for t in (hidden, weight, case_bias) if t is not None)
            args = (hidden, weight, case_bias, targets, temperature, 16, softcap, scale, outputs)
            want = trl_function.apply(*args)
            got = _serve(*args[:4], temperature, softcap, scale, outputs)
            agree = {
                name: torch.allclose(ours, theirs.detach(), rtol=1e-4, atol=1e-5)
                for name, ours, theirs in zip(("log_probs", *_OPTIONAL_OUTPUTS[:3]), got, want)
            }
            agree["is_top1"] = torch.equal(got[4], want[4])
            # a GRPO-like objective: log-probs plus an entropy bonus
            want_grads = torch.autograd.grad(
                want[0].sum() + (entropy_weights * want[1]).sum(), inputs
            )
            got_grads = torch.autograd.grad(got[0].sum() + (entropy_weights * got[1]).sum(), inputs)
            agree["gradients"] = all(
                torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(got_grads, want_grads)
            )
            if not all(agree.values()):
                raise TRLIntegrationError(
                    "cce_compile's op disagrees with TRL's ChunkedLogProbFunction on a tiny "
                    f"problem (temperature {temperature}, softcap {softcap}, logit_scale "
                    f"{scale}, bias {with_bias}): {agree}. Nothing was changed; please report "
                    "this with your trl and torch versions."
                )


def install(*, self_check: bool = True) -> None:
    """Route TRL's fused LM head through cce_compile's op (all trainers, all models in the
    process; before or after building the trainer). Idempotent. Raises
    ``TRLIntegrationError`` and changes nothing when the installed TRL is not 1.16.x as
    checked by ``check_trl``, or when ``self_check`` finds the two disagreeing."""
    global _original
    import torch

    _, trainer_utils = _trl_modules()
    if getattr(trainer_utils, _GLOBAL, None) is CCEChunkedLogProb:
        return
    trl_function = check_trl()
    if self_check:
        _self_check(trl_function)
    torch.compiler.assume_constant_result(_tally)  # marks the function itself (_tally's doc)
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
    trainer_utils = sys.modules.get(_UTILS)
    return getattr(trainer_utils, _GLOBAL, None) is CCEChunkedLogProb


def counts() -> dict:
    """Calls served by the op and calls handed to TRL's function (with why), since import or
    ``reset_counts()``. Compiled code counts once per trace (one or a few per compilation), not
    per call."""
    return {**_counts, "reasons": dict(_reasons)}


def reset_counts() -> None:
    _counts.update(served=0, handed_to_trl=0)
    _reasons.clear()


# --- installing when TRL is imported (the CCE_COMPILE=1 start-up hook) ---------------------


def install_on_import() -> None:
    """Install when ``trl.trainer.utils`` is imported (at once if it already is), for the
    start-up hook: a TRL script then needs no edit. ``import trl`` alone imports nothing of
    TRL's trainers (its package is lazy); the first trainer import (``from trl import
    GRPOTrainer``) executes ``trl.trainer.utils``, and the install follows it. A TRL this
    integration refuses, or any other error, is one WARNING line and leaves TRL's own kernel; a
    bad CCE_* setting stops the program with its one line (SystemExit), as the start-up hook's
    first torch.compile does. Imports neither torch nor TRL itself."""
    import_hooks.after_import(_UTILS, _install_or_warn)


def _install_or_warn(_utils=None) -> None:
    from .. import config

    try:
        install()
    except config.SettingsError as error:
        # A mistyped CCE_* value: the run asked to fuse stops rather than train unfused, as
        # the start-up hook's first torch.compile does.
        raise SystemExit(
            f"cce_compile: {error}; CCE_COMPILE=1 stops here rather than leave TRL's fused LM "
            "head unfused"
        ) from None
    except Exception as error:  # the user's import goes on: TRL's kernel stays
        log.warning(
            "cce_compile: CCE_COMPILE=1 left TRL's fused LM head to TRL's own kernel: %s: %s",
            type(error).__name__,
            error,
        )
