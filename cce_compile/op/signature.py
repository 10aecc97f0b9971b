"""The argument lists of the ``cce`` ops: the one place that names and orders them.

Everything that builds or reads a call of the ops goes through a :class:`Signature`: the
schema strings registered with ``torch.library`` (``custom_ops``), the public function and the graph
rewrite that build calls (``functional``, ``passes.plain``), and the autograd formula that
reads them back. Arguments are looked up by name, never by position. The loss options are the
fields of :class:`~cce_compile.loss_math.LossSpec`, so a new option is declared there once.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from .. import row_metrics
from ..loss_math import LossSpec

# Python annotation of a LossSpec field -> its type in an op schema.
_SCHEMA_TYPES = {"int": "int", "str": "str", "float": "float", "float | None": "float?"}


_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class Argument:
    name: str
    schema_type: str  # as written in a torch.library schema: "Tensor", "Tensor?", "int", ...
    default: Any = _REQUIRED  # what ``Signature.build`` passes when a caller leaves it out


class Bound:
    """One call's arguments, by name (``args.hidden``), as read from the op's inputs."""

    def __init__(self, signature: Signature, values: Sequence[Any]):
        if len(values) != len(signature.names):
            raise TypeError(f"{len(values)} values for {len(signature.names)} arguments")
        self._values = dict(zip(signature.names, values))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def has(self, name: str) -> bool:
        """Does the op's signature have this argument?"""
        return name in self._values

    def replace(self, **changes: Any) -> Bound:
        """The same call with some arguments changed (by name)."""
        unknown = sorted(set(changes) - set(self._values))
        if unknown:
            raise TypeError(f"unknown arguments {unknown}")
        bound = object.__new__(Bound)
        bound._values = {**self._values, **changes}
        return bound

    def pick(self, names: Iterable[str]) -> dict[str, Any]:
        return {name: self._values[name] for name in names}

    def spec(self) -> LossSpec:
        return LossSpec(**self.pick(LOSS_OPTIONS))


class Signature:
    """An ordered argument list: builds calls and binds inputs by name."""

    def __init__(self, arguments: Iterable[Argument]):
        self.arguments = tuple(arguments)
        self.names = tuple(a.name for a in self.arguments)
        # Once, not per call (``build`` runs on every call of the loss, on the host's hot path).
        self._defaults = {a.name: a.default for a in self.arguments if a.default is not _REQUIRED}
        self._name_set = frozenset(self.names)

    def schema(self, returns: Returns) -> str:
        params = ", ".join(f"{a.schema_type} {a.name}" for a in self.arguments)
        return f"({params}) -> {returns.schema()}"

    def build(self, *, spec: LossSpec | None = None, **values: Any) -> tuple:
        """The positional arguments of a call: every argument without a default must be
        given, and no unknown name; ``spec``: the loss options, all at once."""
        # The spec's fields read by name (LOSS_OPTIONS: its fields in order): what
        # dataclasses.asdict gives for its plain values (numbers, strings, None), without
        # asdict's recursive deep copy (~18 us a call). Dynamo traces this (torch.compile of
        # the public function): no dataclasses.fields here, which it cannot trace.
        options = {n: getattr(spec, n) for n in LOSS_OPTIONS} if spec is not None else {}
        values = {**self._defaults, **options, **values}
        if len(values) != len(self.names) or not self._name_set.issuperset(values):
            missing = [n for n in self.names if n not in values]
            unknown = sorted(set(values) - self._name_set)
            raise TypeError(f"op arguments: missing {missing}, unknown {unknown}")
        return tuple(values[n] for n in self.names)

    def bind(self, values: Sequence[Any]) -> Bound:
        return Bound(self, values)

    def gradients(self, **grads: Any) -> tuple:
        """A backward's return value: the given gradients by name, None for the rest."""
        unknown = sorted(set(grads) - set(self.names))
        if unknown:
            raise TypeError(f"gradients for unknown arguments {unknown}")
        return tuple(grads.get(n) for n in self.names)

    def index(self, name: str) -> int:
        return self.names.index(name)


class Returns:
    """An op's outputs, by name: the schema's return types, and the packing of a kernel's
    outputs into the op's tuple and back (``out.lse``, never ``out[1]``). Every output is a
    Tensor (one that is not computed is empty: ops return no None)."""

    def __init__(self, *names: str):
        self.names = names
        self._tuple = collections.namedtuple("Outputs", names)

    def schema(self) -> str:
        return "(" + ", ".join("Tensor" for _ in self.names) + ")"

    def pack(self, **values: Any) -> tuple:
        """The op's output tuple: every output by name."""
        return tuple(self._tuple(**values))

    def unpack(self, output: Sequence[Any]):
        """The op's outputs (tensors, or a graph's nodes for them) by name."""
        return self._tuple(*output)

    def index(self, name: str) -> int:
        return self.names.index(name)


LOSS_OPTIONS = tuple(f.name for f in dataclasses.fields(LossSpec))
_OPTIONS = [Argument(f.name, _SCHEMA_TYPES[str(f.type)]) for f in dataclasses.fields(LossSpec)]
_INPUTS = [
    Argument("hidden", "Tensor"),  # (B, T, D)
    Argument("classifier", "Tensor"),  # (V, D)
    Argument("targets", "Tensor"),  # (B, T) int
    Argument("bias", "Tensor?"),  # (V,)
    Argument("class_weights", "Tensor?"),  # (V,)
    # The head's GEMM dtype: hidden, classifier and bias are rounded to it as autocast rounds
    # F.linear's inputs (None: their own dtype, which must then agree). Gradients come back in
    # the inputs' own dtypes, so float32 weights get float32 gradients with no bf16 copy.
    Argument("compute_dtype", "ScalarType?", default=None),
]
# Which gradients the caller wants (fast mode computes exactly these in the forward).
GRAD_FLAGS = ("grad_hidden", "grad_classifier", "grad_bias")
_GRAD_FLAGS = [Argument(name, "bool") for name in GRAD_FLAGS]
# Fast mode's output holding each flag's gradient for a unit upstream gradient (both ops).
FAST_BUFFERS = {flag: f"fast_{flag}" for flag in GRAD_FLAGS}

FORWARD = Signature(
    [
        *_INPUTS,
        *_OPTIONS,
        Argument("lse_all_rows", "bool"),  # the returned lse is valid at ignored rows too
        Argument("mode", "str"),  # "lean" or "fast"
        *_GRAD_FLAGS,
        Argument("implementation_version", "int"),  # see op/versioning.py
        # Gradient filtering's per-row budget of skipped softmax mass (filtering.py); lean only.
        Argument("grad_filter", "float?", default=None),
        # Compact away rows whose target is ignore_index before computing (compaction.py).
        Argument("skip_ignored", "bool", default=False),
        # Also each row's metrics, from the same pass (row_metrics.py: the entropy, with its
        # gradient; the argmax, log sum p^2 and mean logit, without).
        *(Argument(flag, "bool", default=False) for flag in row_metrics.FLAGS),
        # The row metrics (and the returned lse) are valid at ignored rows too, as eager's
        # entropy of the logits beside a loss that ignores them (no compaction, no skipped
        # tiles); without it they are their ``ignored_value`` there.
        Argument("metrics_all_rows", "bool", default=False),
    ]
)
# What each output holds: ops._forward's docstring.
FORWARD_RETURNS = Returns(
    "loss",
    "lse",
    *FAST_BUFFERS.values(),  # fast mode's unit-upstream gradients
    "keep_blocks",
    "row_index",
    *row_metrics.NAMES,
)

BACKWARD = Signature(
    [
        Argument("grad_loss", "Tensor?"),
        Argument("grad_lse", "Tensor?"),
        # The returned entropy's gradient, and the entropy (loss_math's coef_e term).
        Argument("grad_entropy", "Tensor?", default=None),
        *_INPUTS,
        Argument("lse", "Tensor"),
        Argument("entropy", "Tensor?", default=None),
        Argument("keep_blocks", "Tensor?", default=None),  # gradient filtering's mask
        Argument("row_index", "Tensor?", default=None),  # the forward's rows (compaction.py)
        *_OPTIONS,
        Argument("lse_all_rows", "bool"),
        *_GRAD_FLAGS,
        Argument("metrics_all_rows", "bool", default=False),
    ]
)
BACKWARD_RETURNS = Returns(*GRAD_FLAGS)  # empty where not asked for
