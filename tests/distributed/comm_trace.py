"""What a block of code sends over gloo and where it would wait for the device, read from the
profiler: every collective that reaches the process group, whoever issued it (the op's own,
DTensor's, a stray ``dist.all_reduce``), with what this rank sent, and the operations that are
a host synchronisation on a GPU.

A collective is two profiler events: the c10d dispatcher's op (``c10d::allreduce_``, ...),
which names the collective but records no shapes, and the gloo backend's (``gloo:all_reduce``,
on gloo's own thread), which records the tensor sent but names gloo's algorithm (it runs a
reduce-scatter as an all-reduce). gloo runs one group's collectives in the order they were
issued, so the n-th of each are the same collective.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
from collections.abc import Iterator

from torch.profiler import ProfilerActivity, profile

# c10d dispatcher op -> the collective's kind.
_KINDS = {
    "c10d::allreduce_": "all_reduce",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_": "all_gather",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::broadcast_": "broadcast",
    "c10d::alltoall_base_": "all_to_all",
}
# On a GPU these wait for the device: a scalar read to the host, and nonzero's output size.
_SYNCS = ("aten::_local_scalar_dense", "aten::nonzero")
_DTYPES = {"float": "float32", "double": "float64", "c10::BFloat16": "bfloat16",
           "c10::Half": "float16", "long int": "int64", "int": "int32"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce, all_gather, reduce_scatter, ...
    shape: tuple[int, ...]  # the tensor this rank sent
    dtype: str

    @property
    def key(self) -> tuple[str, int, str]:
        """(kind, elements sent, dtype): what a test compares (the layout is the issuer's)."""
        return self.kind, math.prod(self.shape), self.dtype


@dataclasses.dataclass
class Trace:
    collectives: list[Collective] = dataclasses.field(default_factory=list)
    syncs: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


@contextlib.contextmanager
def traced() -> Iterator[Trace]:
    """Profile the block; the yielded ``Trace`` is filled in when it ends.

    It reads the profiler's own events (name, start, input shapes and dtypes), as
    ``prof.events()`` would give them, without building its FunctionEvent tree: that parse
    took ~0.1 s per block of the op's CPU path, a third of a vocabulary-parallel case."""
    trace = Trace()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        yield trace
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if not _hidden(e)),
        key=lambda e: e.start_ns(),
    )
    names = [e.name() for e in events]
    kinds = [_KINDS.get(name, name) for name in names if name.startswith("c10d::")]
    sent = [e for e, name in zip(events, names) if name.startswith("gloo:")]
    assert len(kinds) == len(sent), (kinds, [e.name() for e in sent])
    for kind, event in zip(kinds, sent):
        shape = tuple(event.shapes()[0])
        dtype = _DTYPES.get(event.dtypes()[0], event.dtypes()[0])
        trace.collectives.append(Collective(kind, shape, dtype))
    trace.syncs.update(name.split("::")[1] for name in names if name in _SYNCS)


def _hidden(event) -> bool:
    """What the profiler's own parse leaves out of ``events()`` (none of the names read here)."""
    return getattr(event, "is_hidden_event", lambda: False)()
