"""The neutral interface between the op and its implementations.

An implementation (``torch_path`` for any device, ``triton_path`` for CUDA) is a module that
provides the three functions of :class:`Implementation`. Shapes follow the op's canonical form:
``hidden`` (B, T, D), ``classifier`` (V, D), ``targets`` (B, T); the loss's rows are
(b, t < T - shift), flattened to N = B * (T - shift).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from .loss_math import LossSpec


@dataclasses.dataclass(frozen=True)
class Needs:
    """Which gradients the caller wants."""

    hidden: bool = False
    classifier: bool = False
    bias: bool = False

    @property
    def any(self) -> bool:
        return self.hidden or self.classifier or self.bias

    def without(self, served: Needs) -> Needs:
        """The needs that ``served`` does not cover."""
        return Needs(
            self.hidden and not served.hidden,
            self.classifier and not served.classifier,
            self.bias and not served.bias,
        )


@dataclasses.dataclass
class ForwardOut:
    loss: torch.Tensor  # float32: a scalar, or (N,) for reduction 'none'
    lse: torch.Tensor  # (N,) float32
    grad_hidden: torch.Tensor | None = None  # fast mode: hidden's dtype, (B, T, D)
    grad_classifier: torch.Tensor | None = None  # fast mode: float32 accumulator (V, D)
    grad_bias: torch.Tensor | None = None  # fast mode: float32 accumulator (V,)


Gradients = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


class Implementation(Protocol):
    def forward(
        self,
        hidden: torch.Tensor,
        classifier: torch.Tensor,
        targets: torch.Tensor,
        bias: torch.Tensor | None,
        class_weights: torch.Tensor | None,
        spec: LossSpec,
        *,
        lse_all_rows: bool,
        fast: bool,
        needs: Needs,
        budget_bytes: int,
        compute_dtype: torch.dtype | None = None,
    ) -> ForwardOut:
        """Loss and per-row lse; with ``fast``, also the gradients in ``needs`` for a unit
        upstream gradient of the loss. ``compute_dtype``: the dtype the head's operands are
        rounded to before the GEMM (None: their own, which then agree)."""

    def backward(
        self,
        grad_loss: torch.Tensor | None,
        grad_lse: torch.Tensor | None,
        hidden: torch.Tensor,
        classifier: torch.Tensor,
        targets: torch.Tensor,
        bias: torch.Tensor | None,
        class_weights: torch.Tensor | None,
        lse: torch.Tensor,
        spec: LossSpec,
        *,
        lse_all_rows: bool,
        needs: Needs,
        budget_bytes: int,
        compute_dtype: torch.dtype | None = None,
    ) -> Gradients:
        """Gradients in ``needs`` from upstream ``grad_loss`` ('none': (N,)) and ``grad_lse``
        ((N,)), either may be None; hidden's in its dtype, the others float32 or input dtype."""

    def scale_to(self, x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(x * scale).to(dtype) with one rounding; ``scale`` is a 0-d tensor."""
