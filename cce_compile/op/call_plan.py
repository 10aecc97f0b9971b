"""What one call of an op runs on: its implementation, numerics, memory budget and needs.

Both ops (``cce::linear_cross_entropy`` and the vocabulary-parallel one) read their calls
through these helpers, so each rule is written once:

* the implementation for the inputs' device (``triton_path`` on CUDA with Triton, else
  ``torch_path``);
* autocast off around it (the op rounds its inputs to ``compute_dtype`` itself, as autocast
  rounds ``F.linear``'s, so an enclosing region changes neither dtypes nor precision between
  forward and backward);
* the compute dtype where it rounds an input;
* the extra memory the settings give the call (``decide.budget_bytes``);
* the gradients the call asks for.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from .. import decide
from ..implementations import torch_path
from ..implementations.interface import Implementation, Needs
from .signature import Bound


@functools.cache
def _triton_path() -> Implementation | None:
    """The Triton implementation, or None where Triton cannot run."""
    try:
        from ..implementations import triton_path
    except ImportError:
        return None
    return triton_path if triton_path.available() else None


def implementation_for(device: torch.device) -> Implementation:
    if device.type == "cuda":
        impl = _triton_path()
        if impl is not None:
            return impl
    return torch_path


@contextlib.contextmanager
def float32_math(device: torch.device) -> Iterator[None]:
    """Autocast off for ``device`` inside the block (the implementations pick dtypes)."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        with torch.autocast(device.type, enabled=False):
            yield
    else:
        yield


def compute_dtype_of(args: Bound) -> torch.dtype | None:
    """The compute dtype where it rounds an input (None where every input has it)."""
    dtype = args.compute_dtype
    inputs = (args.hidden, args.classifier, args.bias)
    if dtype is None or all(t is None or t.dtype == dtype for t in inputs):
        return None
    return dtype


def needs_of(args: Bound) -> Needs:
    """The gradients a call asks for (a bias gradient only where there is a bias)."""
    return Needs(args.grad_hidden, args.grad_classifier, args.grad_bias and args.bias is not None)


def budget_of(args: Bound) -> int:
    """The memory budget (``decide.budget_bytes``) of a bound call: its loss rows, its shard
    of the vocabulary."""
    problem = decide.problem_of(args.hidden, args.classifier, args.shift, compute_dtype_of(args))
    return decide.budget_bytes(problem)
