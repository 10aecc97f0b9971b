"""PyTorch's own autograd over chunked float32 logits, for the calls the op's autograd formula
cannot serve: forward-mode AD, functorch transforms, a logit_scale or softcap tensor that
requires grad.

The math is the CPU path's (``torch_path``: the same float32 operands, chunks of whole rows of
the budget's size), written out of place: functorch transforms forbid writing into a shared
buffer, and autograd records each step.
"""

from __future__ import annotations

import dataclasses

import torch

from ..loss_math import finish_loss, returned_lse, row_targets
from ..policy import cpu_chunk_rows
from .interface import HeadInputs
from .torch_path import Float32Operands


def _logits(h32, c32, b32, logit_scale, softcap) -> torch.Tensor:
    """z = softcap(logit_scale * (h @ c.T + b)), float32; scale and cap are numbers, or 0-d
    tensors (differentiated)."""
    z = h32 @ c32.T
    if b32 is not None:
        z += b32
    if isinstance(logit_scale, torch.Tensor):
        z = z * logit_scale  # out of place: its gradient needs z
    elif logit_scale != 1.0:
        z *= logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z


def _rounded_straight_through(head: HeadInputs) -> HeadInputs:
    """``head`` with hidden, classifier and bias rounded to its compute dtype in float32, each
    differentiated as the identity: the op's gradients are those of the rounded inputs, in the
    inputs' own float32 (a cast's backward would round them to the compute dtype too)."""

    def rounded(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.dtype == head.compute_dtype:
            return t
        return t + (t.to(head.compute_dtype).to(t.dtype) - t).detach()

    return dataclasses.replace(
        head,
        hidden=rounded(head.hidden),
        classifier=rounded(head.classifier),
        bias=rounded(head.bias),
        compute_dtype=None,
    )


def differentiable_loss(
    head: HeadInputs,
    *,
    lse_all_rows: bool,
    logit_scale: torch.Tensor | None = None,
    softcap: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) by PyTorch's own autograd over the chunked math, any AD mode.

    ``logit_scale`` / ``softcap`` given as 0-d tensors replace the spec's numbers and are
    differentiated. Reverse mode keeps every chunk's float32 logits for the backward, as eager
    PyTorch keeps its logits; forward mode keeps none.
    """
    spec = head.spec
    device = head.hidden.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        # The chunks' math is float32, as the op's (it rounds the inputs to compute_dtype
        # itself, as autocast would have): autocast off, or its matmuls would run in bf16.
        with torch.autocast(device, enabled=False):
            return differentiable_loss(
                head, lse_all_rows=lse_all_rows, logit_scale=logit_scale, softcap=softcap
            )
    if head.compute_dtype is not None:  # the op's rounding, with the op's gradient
        head = _rounded_straight_through(head)
    rows = row_targets(head.targets, head.class_weights, spec, head.vocab)
    operands = Float32Operands.of(head)
    h32, w32 = operands.hidden, operands.class_weights
    scale = spec.logit_scale if logit_scale is None else logit_scale
    cap = spec.softcap if softcap is None else softcap
    stats: list[list[torch.Tensor]] = [[], [], []]  # lse, target logit, wsum per chunk
    chunk = cpu_chunk_rows(head.vocab, head.budget_bytes)
    for start in range(0, h32.shape[0], chunk):
        stop = start + chunk
        z = _logits(h32[start:stop], operands.classifier, operands.bias, scale, cap)
        stats[0].append(torch.logsumexp(z, dim=-1))
        stats[1].append(z.gather(1, rows.safe[start:stop, None])[:, 0])
        if spec.needs_wsum:
            stats[2].append(z @ w32 if w32 is not None else z.sum(-1))
    empty = head.hidden.new_zeros(0, dtype=torch.float32)
    lse, target_logit, wsum = (torch.cat(s) if s else empty for s in stats)
    wsum = wsum if spec.needs_wsum else None
    loss = finish_loss(lse, target_logit, wsum, rows, spec, head.vocab)
    return loss, returned_lse(lse, rows, lse_all_rows)
