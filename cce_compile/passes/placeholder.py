"""What a training graph returns in place of logits it no longer computes
(``CCE_ESCAPING_LOGITS=drop``, the default): a :class:`LogitsNotComputed` placeholder.

The placeholder has the logits' shape and dtype and holds no memory (a wrapper tensor without
storage, on the ``meta`` device). Reading a value from it raises one error,
:class:`LogitsNotComputedError`, that says the loss was fused and names the setting that keeps
the logits; ``repr()`` / ``print()`` say what it is. Reading a value means any op on it
(arithmetic, comparison, indexing, ``argmax``, reductions, ``.item()``, ``.tolist()``,
``.numpy()``, ``float()``, ``bool()``, iterating, moving it to a device, ``torch.save``).

Not a read, and so allowed, each giving another placeholder: ``detach()``, ``clone()``,
``view_as(itself)`` / ``alias`` and a change of floating dtype (``.float()``, ``.to(dtype)``).
Frameworks pass every output through these on a training step without reading it:
DistributedDataParallel's ``_DDPSink`` clones each output (``find_unused_parameters=True``, the
Trainer's default) and autograd views outputs it returns unchanged; accelerate's mixed-precision
wrapper converts bf16 / fp16 outputs with ``.float()`` (when that runs outside the compiled
graph). Raising there would fail steps that never use the logits; the error comes at the first
read instead. Metadata (``shape``, ``dtype``, ``device``, ``requires_grad``, ``len()``) is
readable.

The graph gets it from ``cce::logits_not_computed``, a custom op (no tensor inputs) that
Inductor calls as an opaque kernel: its fake kernel gives a tensor on the logits' device, so
Inductor and AOTAutograd return what the op returns at run time as it is (an op whose output is
on ``meta`` at compile time Inductor replaces by its own empty tensor). It is tagged
``cudagraph_unsafe``: under CUDA graphs Inductor runs it outside the captured partitions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

SETTING = "CCE_ESCAPING_LOGITS"


class LogitsNotComputedError(RuntimeError):
    """A value was read from logits that cce_compile fused away (a LogitsNotComputed)."""


# Ops that read no value: each gives another placeholder (module docstring).
_PASSTHROUGH = {aten.detach.default, aten.alias.default, aten.clone.default}
# Python-level reads that never reach __torch_dispatch__ (or fail there with a generic error).
_VALUE_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.__bool__,
    torch.Tensor.__complex__,
    torch.Tensor.__array__,
    torch.Tensor.__dlpack__,
    torch.Tensor.data_ptr,
    torch.Tensor.untyped_storage,
    torch.Tensor.storage,
}


class LogitsNotComputed(torch.Tensor):
    """Logits that cce_compile fused away: their shape and dtype, no data; any read raises
    :class:`LogitsNotComputedError` (module docstring)."""

    site: str  # where the fused cross-entropy is (a source line)

    @staticmethod
    def __new__(cls, size: Sequence[int], dtype: torch.dtype, site: str):
        made = torch.Tensor._make_wrapper_subclass(
            cls, tuple(size), dtype=dtype, device="meta", requires_grad=False
        )
        made.site = site
        return made

    def __init__(self, size: Sequence[int], dtype: torch.dtype, site: str):
        super().__init__()

    def __repr__(self, *, tensor_contents=None) -> str:
        return (
            f"LogitsNotComputed(shape={tuple(self.shape)}, dtype={self.dtype}): not computed: "
            f"cce_compile fused the cross-entropy at {self.site} ({SETTING}=drop); the logits "
            f"are kept with {SETTING}=rewrite or keep"
        )

    def __reduce_ex__(self, protocol):
        raise error(self, "pickling")

    @classmethod
    @torch._disable_dynamo
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _VALUE_READS:
            raise error(_first(args), _name(func))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self = _first(args) if _first(args) is not None else _first(kwargs)
        if _passes_through(func, args, kwargs):
            return LogitsNotComputed(self.shape, kwargs.get("dtype") or self.dtype, self.site)
        raise error(self, _name(func))


def _passes_through(func, args, kwargs) -> bool:
    """An op that reads no value of its first operand (module docstring)."""
    self = args[0] if args else None
    if not isinstance(self, LogitsNotComputed) or len(args) > 2:
        return False
    if func in _PASSTHROUGH:
        return True
    if func is aten.view.default:  # view_as(itself): what autograd does to returned inputs
        return list(args[1]) == list(self.shape)
    if func is aten._to_copy.default:  # a floating dtype change, nothing else
        dtype = kwargs.get("dtype")
        other = set(kwargs) - {"dtype", "non_blocking", "memory_format"}
        return len(args) == 1 and not other and dtype is not None and dtype.is_floating_point
    return False


def _first(values) -> LogitsNotComputed | None:
    leaves, _ = tree_flatten(values)
    return next((v for v in leaves if isinstance(v, LogitsNotComputed)), None)


def _name(func) -> str:
    """``argmax``, ``item``, ``__float__``: what read the placeholder."""
    return getattr(func, "_opname", None) or getattr(func, "__name__", None) or str(func)


def error(placeholder: LogitsNotComputed | None, what: str) -> LogitsNotComputedError:
    """The one error every read of a placeholder raises: what happened and what to set."""
    site = getattr(placeholder, "site", "<unknown>")
    shape = tuple(placeholder.shape) if placeholder is not None else "?"
    return LogitsNotComputedError(
        f"these logits were not computed ({what} read them): cce_compile fused the "
        f"cross-entropy at {site} into a loss that never materialises the logits, and the "
        f"compiled graph returned this placeholder of shape {shape} without data in their "
        f"place ({SETTING}=drop, the default, does this for training graphs whose logits are "
        f"only returned). To read the training logits, set {SETTING}=rewrite (the loss stays "
        f"fused, the logits are computed and kept) or {SETTING}=keep (this loss is left "
        f"unfused), or in code cce_compile.config.update(escaping_logits='rewrite') followed "
        f"by torch._dynamo.reset(), before compiling. Evaluation graphs (no gradient) always "
        f"return their logits."
    )


@torch.library.custom_op(
    "cce::logits_not_computed", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)
def logits_not_computed(
    size: Sequence[int], dtype: torch.dtype, device: torch.device, site: str
) -> torch.Tensor:
    """A LogitsNotComputed of ``size`` and ``dtype``; ``device`` (the logits') is the fake
    kernel's."""
    return LogitsNotComputed(size, dtype, site)


@logits_not_computed.register_fake
def _(size, dtype, device, site):
    return torch.empty(size, dtype=dtype, device=device)


OP = torch.ops.cce.logits_not_computed.default
