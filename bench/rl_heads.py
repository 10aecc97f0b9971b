"""The calls and the methods of bench/rl.py: a Problem (one shape's inputs), the losses of the
four calls, and per method a head ``factory(call, problem) -> head(h, w) -> outputs``.

Outputs are a dict of (B, S) tensors: ``logp`` (every method but ``liger_grpo``, which gives
``loss``), and where the call asks for them ``entropy`` (differentiated in the ``entropy`` call,
detached in ``dpo``), ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``. A method without a
form of a call raises ``NotApplicable``.

* ``compile`` / ``eager``: TRL 1.16's default code over materialised bf16 logits,
  ``selective_log_softmax`` and ``entropy_from_logits`` (trl/trainer/utils.py). On a GPU TRL's
  functions call its own Triton kernel instead; their torch branch (what runs elsewhere) is
  written out below so that torch.compile sees that code. ``trl_logits_triton``: the Triton
  kernel TRL's functions call on a GPU, over the same logits.
* ``cce``: ``cce_compile.linear_log_probs``, and ``linear_cross_entropy`` with its metrics for
  DPO; ``cce_lean`` / ``cce_fast`` force a mode.
* ``trl_fused_head``: TRL 1.16's ``ChunkedLogProbFunction`` as its fused LM head calls it (the
  valid rows only, its chunk size, the outputs the call needs).
* ``liger_grpo``: Liger's ``LigerFusedLinearGRPOLoss`` (dapo, beta 0; the ``grad`` call only: no
  entropy bonus, no log-probs). ``liger_scaled_ce``: ``LigerFusedLinearScaledCrossEntropyFunction``
  (nll and a differentiable entropy), whose Hopper path is a CuTe DSL kernel (needs
  nvidia-cutlass-dsl); ``liger_scaled_ce_torch``: its torch path, called directly.
* ``verl_ppo``: verl's ``FusedLinearForPPO`` (torch, 512-token chunks); ``verl_triton``: verl's
  Triton ``linear_cross_entropy``. Both on the valid rows (verl removes padding), imported from
  verl's wheel without running verl's package imports (ray, hydra, ...): ``load_verl``.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import torch
import torch.nn.functional as F

from bench import _trl_chunk_size  # bench/bench.py, beside this file

CALLS = ("grad", "entropy", "nograd", "dpo")
ENTROPY_COEF, DPO_BETA, DPO_REF_SPREAD = 0.01, 0.1, 5.0
GiB = 2**30


class NotApplicable(Exception):
    """The method has no form of this call (recorded with its reason, not as a failure)."""


@dataclasses.dataclass
class Problem:
    """One shape's inputs and the constants of the losses (all on the bench's device)."""

    hidden: torch.Tensor  # (B, S, D) bf16
    classifier: torch.Tensor  # (V, D) bf16
    targets: torch.Tensor  # (B, S) int64, -100 at padding
    temperature: float
    adv: torch.Tensor  # (B,) float32, one advantage per sequence
    ref_seq: torch.Tensor | None = None  # (B,) DPO's reference sums, set by rl.references()

    def __post_init__(self):
        # Computed once, outside any compiled code (a count read in a graph would break it).
        self.valid = self.targets != -100
        self.mask = self.valid.float()
        self.safe_targets = self.targets.clamp(min=0)  # what code without ignore_index gathers
        self.count = float(self.valid.sum())

    def call_temperature(self, call):
        return 1.0 if call == "dpo" else self.temperature


def make_problem(batch, seq, dim, vocab, temperature, pad, device, seed=0) -> Problem:
    """hidden ~ N(0, 1), classifier ~ N(0, 1)/sqrt(D); targets sampled from the policy at T
    (as completions are); row i padded at its end by pad * 2i/(B-1) of its length."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(batch, seq, dim, device=device, generator=gen).bfloat16()
    classifier = (torch.randn(vocab, dim, device=device, generator=gen) / dim**0.5).bfloat16()
    flat = hidden.view(-1, dim)
    rows = max(1, GiB // (vocab * 4))
    samples = [
        torch.multinomial(
            torch.softmax((flat[s : s + rows] @ classifier.T).float() / temperature, -1),
            1,
            generator=gen,
        )[:, 0]
        for s in range(0, flat.shape[0], rows)
    ]
    targets = torch.cat(samples).view(batch, seq)
    for row in range(batch):
        share = pad * 2 * row / (batch - 1) if batch > 1 else pad
        targets[row, seq - round(share * seq) :] = -100
    adv = torch.randn(batch, device=device, generator=gen)
    return Problem(hidden, classifier, targets, temperature, adv)


# ---- losses, shared by every method and the float64 reference --------------------------------
def grpo_loss(out, p: Problem):
    return -(p.adv[:, None] * out["logp"] * p.mask).sum() / p.count


def entropy_bonus_loss(out, p: Problem):
    return grpo_loss(out, p) - ENTROPY_COEF * (out["entropy"] * p.mask).sum() / p.count


def dpo_loss(out, p: Problem):
    seq = (out["logp"] * p.mask).sum(-1)
    half = seq.shape[0] // 2
    margin = (seq[:half] - p.ref_seq[:half]) - (seq[half : 2 * half] - p.ref_seq[half : 2 * half])
    return -F.logsigmoid(DPO_BETA * margin).mean()


LOSSES = {"grad": grpo_loss, "entropy": entropy_bonus_loss, "dpo": dpo_loss}


# ---- TRL 1.16's default code (trl/trainer/utils.py), the torch branch ------------------------
def trl_selective_log_softmax(logits, index):
    """TRL 1.16 ``selective_log_softmax``'s torch branch (what runs without TRL's Triton
    kernel): gather minus a per-row logsumexp in float32/64; a row loop of log_softmax then
    gather for bf16/fp16 (whose result stays bf16)."""
    index = index.unsqueeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        per_token = selected - lse.unsqueeze(-1)
    else:
        per_token = torch.stack(
            [
                F.log_softmax(row_logits, dim=-1).gather(dim=-1, index=row_index)
                for row_logits, row_index in zip(logits, index, strict=True)
            ]
        )
    return per_token.squeeze(-1)


def trl_entropy_from_logits(logits, chunk_size=128):
    """TRL 1.16 ``entropy_from_logits``'s torch branch: 128-row chunks of -(exp(lp) lp).sum."""
    flat = logits.reshape(-1, logits.shape[-1])
    entropies = []
    for chunk in flat.split(chunk_size, dim=0):
        logps = F.log_softmax(chunk, dim=-1)
        entropies.append(-(torch.exp(logps) * logps).sum(-1))
    return torch.cat(entropies, dim=0).reshape(logits.shape[:-1])


def logits_metrics(logits, targets):
    """DPO's logged per-token metrics from materialised logits, in plain torch (no gradient)."""
    with torch.no_grad():
        z = logits.float()
        lse = torch.logsumexp(z, -1)
        return {
            "entropy": trl_entropy_from_logits(logits),
            "mean_logits": z.mean(-1),
            "log_sum_sq_probs": torch.logsumexp(2 * z, -1) - 2 * lse,
            "is_top1": logits.argmax(-1) == targets,
        }


def trl_default_head(call, p: Problem):
    temperature, targets = p.call_temperature(call), p.safe_targets

    def head(h, w):
        logits = h @ w.T  # bf16, as the model's lm_head returns them
        if temperature != 1.0:
            logits = logits / temperature
        out = {"logp": trl_selective_log_softmax(logits, targets)}
        if call == "entropy":
            out["entropy"] = trl_entropy_from_logits(logits)
        if call == "dpo":
            out.update(logits_metrics(logits, targets))
        return out

    return head


def trl_logits_triton_head(call, p: Problem):
    from trl.kernels import selective_log_softmax_and_entropy

    temperature, targets = p.call_temperature(call), p.safe_targets

    def head(h, w):
        logits = h @ w.T
        logp, entropy = selective_log_softmax_and_entropy(logits, targets, temperature)
        out = {"logp": logp}
        if call == "entropy":
            out["entropy"] = entropy
        if call == "dpo":
            out.update(logits_metrics(logits, targets), entropy=entropy.detach())
        return out

    return head


# ---- the fused methods ------------------------------------------------------------------------
def cce_head(call, p: Problem, mode=None):
    import cce_compile

    temperature, targets = p.call_temperature(call), p.targets

    def head(h, w):
        if call == "dpo":
            nll, entropy, argmax, lssp, mean = cce_compile.linear_cross_entropy(
                h,
                w,
                targets,
                reduction="none",
                mode=mode,
                return_entropy=True,
                return_argmax=True,
                return_log_sum_sq_probs=True,
                return_mean_logits=True,
            )
            return {
                "logp": -nll,
                "entropy": entropy.detach(),
                "is_top1": argmax == targets,
                "log_sum_sq_probs": lssp,
                "mean_logits": mean,
            }
        result = cce_compile.linear_log_probs(
            h, w, targets, temperature=temperature, mode=mode, return_entropy=call == "entropy"
        )
        if call == "entropy":
            return {"logp": result[0], "entropy": result[1]}
        return {"logp": result}

    return head


def scatter_rows(values, valid):
    """(B, S) from values at the valid positions (zeros elsewhere), differentiable."""
    return values.new_zeros(valid.shape).masked_scatter(valid, values)


TRL_OUTPUTS = {
    "grad": ("log_probs",),
    "entropy": ("log_probs", "entropy"),
    "nograd": ("log_probs",),
    "dpo": ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs"),
}


def trl_fused_head(call, p: Problem):
    from trl.kernels import ChunkedLogProbFunction

    chunk, valid, temperature = _trl_chunk_size(), p.valid, p.call_temperature(call)
    targets = p.targets[valid]

    def head(h, w):
        logp, entropy, lssp, mean, top1 = ChunkedLogProbFunction.apply(
            h[valid], w, None, targets, temperature, chunk, None, 1.0, TRL_OUTPUTS[call]
        )
        out = {"logp": scatter_rows(logp, valid)}
        named = {"entropy": entropy, "log_sum_sq_probs": lssp, "mean_logits": mean, "is_top1": top1}
        out.update({k: scatter_rows(v, valid) for k, v in named.items() if v is not None})
        if call == "dpo":
            out["entropy"] = out["entropy"].detach()
        return out

    return head


def liger_grpo_head(call, p: Problem):
    if call != "grad":
        raise NotApplicable(
            "LigerFusedLinearGRPOLoss returns the loss only: no entropy bonus, no log-probs"
        )
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    # beta 0 (no reference), no old log-probs (ratio exactly 1), dapo: sum / valid count
    loss_fn = LigerFusedLinearGRPOLoss(
        beta=0.0, use_ref_model=False, loss_type="dapo", temperature=p.temperature
    )
    targets, mask = p.safe_targets, p.valid.long()
    return lambda h, w: {"loss": loss_fn(h, w, targets, mask, p.adv)[0]}


def liger_scaled_head(call, p: Problem, front=True):
    if front:
        from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction as function
    else:
        from liger_kernel.ops.fused_linear_scaled_cross_entropy import (
            _FusedLinearPPOFallbackFunction as function,
        )
    temperature, targets = p.call_temperature(call), p.targets.view(-1)
    entropy_asked = call in ("entropy", "dpo")
    extra = (1,) if front else ()  # the front's m_tiles_per_cluster

    def head(h, w):
        out = function.apply(
            h.view(-1, h.shape[-1]), w, targets, temperature, -100, *extra, entropy_asked
        )
        nll, entropy = out if entropy_asked else (out, None)
        result = {"logp": -nll.view(p.targets.shape)}
        if entropy is not None:
            entropy = entropy.view(p.targets.shape)
            result["entropy"] = entropy if call == "entropy" else entropy.detach()
        return result

    return head


def load_verl(wheel):
    """verl's modules imported from its wheel (zipimport) without running verl/__init__.py and
    verl/utils/__init__.py, which import ray, tensordict, hydra and the rest of verl: bare
    parent packages whose __path__ points into the wheel."""
    if "verl.utils.experimental.torch_functional" not in sys.modules:
        if wheel is None:
            raise NotApplicable("no verl wheel (--verl-wheel, or .whl/verl-*.whl)")
        for name, sub in (("verl", "verl"), ("verl.utils", "verl/utils")):
            module = types.ModuleType(name)
            module.__path__ = [f"{wheel}/{sub}"]
            sys.modules.setdefault(name, module)
    import verl.utils.experimental.torch_functional as torch_functional

    return torch_functional


def verl_head(call, p: Problem, wheel=None, triton=False):
    temperature, valid = p.call_temperature(call), p.valid
    targets = p.targets[valid]
    if triton:
        load_verl(wheel)
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        def function(h, w):
            return linear_cross_entropy(h, w, targets, float(temperature), "none")
    else:
        fused = load_verl(wheel).FusedLinearForPPO(chunk_size=512)

        def function(h, w):
            return fused(h, w, targets, temperature)

    def head(h, w):
        logp, entropy = function(h[valid], w)
        out = {"logp": scatter_rows(logp, valid)}
        if call in ("entropy", "dpo"):
            entropy = scatter_rows(entropy, valid)
            out["entropy"] = entropy if call == "entropy" else entropy.detach()
        return out

    return head


def method_heads(wheel=None):
    """name -> (factory(call, problem) -> head(h, w) -> outputs, needs CUDA); ``wheel``:
    verl's wheel."""
    return {
        "compile": (trl_default_head, False),
        "eager": (trl_default_head, False),
        "cce": (cce_head, False),
        "cce_lean": (lambda c, p: cce_head(c, p, "lean"), False),
        "cce_fast": (lambda c, p: cce_head(c, p, "fast"), True),
        "trl_fused_head": (trl_fused_head, False),
        "trl_logits_triton": (trl_logits_triton_head, True),
        "liger_grpo": (liger_grpo_head, False),
        "liger_scaled_ce": (liger_scaled_head, True),
        "liger_scaled_ce_torch": (lambda c, p: liger_scaled_head(c, p, front=False), False),
        "verl_ppo": (lambda c, p: verl_head(c, p, wheel), False),
        "verl_triton": (lambda c, p: verl_head(c, p, wheel, triton=True), True),
    }


def forward_of(method, call, p: Problem, wheel=None, compile_backend="inductor"):
    """(h, w) -> (loss or None, outputs): the method's head and the call's loss, compiled whole
    (head and loss, ``dynamic=False``) for ``compile``."""
    factory, _ = method_heads(wheel)[method]
    head = factory(call, p)

    def forward(h, w):
        out = head(h, w)
        if call == "nograd":
            return None, out
        loss = out.pop("loss", None)
        return (LOSSES[call](out, p) if loss is None else loss), out

    if method == "compile":
        return torch.compile(forward, dynamic=False, backend=compile_backend)
    return forward
