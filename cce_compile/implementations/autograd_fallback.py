"""PyTorch's own autograd over chunked float32 logits, for the calls the op's autograd formula
cannot serve: forward-mode AD, functorch transforms, a logit_scale or softcap tensor that
requires grad.

The math is the CPU path's (``torch_path``: the same float32 operands, chunks of whole rows of
the budget's size), written out of place: functorch transforms forbid writing into a shared
buffer, and autograd records each step.
"""

from __future__ import annotations

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
