"""out = (x * scale).to(out's dtype) in one pass, float32 math, one rounding: fast mode's
backward scaling its gradients by the upstream gradient, in place (``out`` is ``x``).

Against torch's ``x.mul_(scale)`` on a bf16 ``x``: the scale is not rounded to bf16 first (a
second rounding of every element's gradient), and no float32 temporary is made. In place with
a scale of exactly 1 (``loss.backward()``'s upstream gradient) nothing is read or written: the
programs read the scale on the device and mask their work off, with no host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv


@triton.jit
def _scale_cast_kernel(x, scale, out, numel, UNIT_IS_NOOP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    factor = tl.load(scale)
    if UNIT_IS_NOOP:  # in place, same dtype: x * 1 is x, so nothing is read or written
        numel = tl.where(factor == 1.0, 0, numel)
    ok = offs < numel
    value = tl.load(x + offs, mask=ok, other=0.0).to(tl.float32) * factor
    tl.store(out + offs, value.to(out.dtype.element_ty), mask=ok)


def scale_cast(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """(x * scale) in ``dtype``, one rounding; ``scale`` is a 0-d tensor on x's device;
    ``out`` (x itself for in place) is written if given."""
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if scale.numel() != 1 or scale.device != x.device:
        raise ValueError("scale must be a one-element tensor on x's device")
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError("out must be a contiguous tensor of x's shape in dtype")
    if x.numel():
        block = 4096
        _scale_cast_kernel[(cdiv(x.numel(), block),)](
            x,
            scale.float().reshape(()),
            out,
            x.numel(),
            UNIT_IS_NOOP=out.data_ptr() == x.data_ptr() and out.dtype == x.dtype,
            BLOCK=block,
            num_warps=8,
        )
    return out
