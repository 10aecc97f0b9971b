"""Skipping ignored rows: the op computes only on the loss rows whose target counts.

A row whose target is ``ignore_index`` contributes no loss and no gradient, so no GEMM, kernel or
chunk needs to touch it. Supervised fine-tuning masks its prompts (often 30-80% of the tokens)
and padding, so this is most of the work there. With ``skip_ignored`` the forward:

1. learns which rows count (``valid.nonzero()``: the op's one host synchronisation);
2. gathers them into a compact (1, n, D) hidden and (1, n) targets with no shift;
3. runs the implementation on those rows only (every mode, every device);
4. scatters the per-row results back: 0 at ignored rows, and exact zero gradients there.

Every reduction keeps its value: ignored rows add nothing to the sums, the class-weight sums or
the counts that 'mean' and the z-loss divide by, and 'none' gets its zeros back. An out-of-range
target is not ignored, so its row is kept and stays NaN.

A fused fast-mode forward on a GPU (``dispatch``'s choice) waits for step 1's count later
(``select(args, order_of)``): the rows go into a kept-first order on the device (the kept ones
ascending, then the ignored ones: the Triton implementation's ``kept_first``, one launch), all
N are gathered, and the count is copied to the host behind an event (``interface.KeptRows``).
The implementation queues its first chunk's logits GEMM, stopped at the count on the device,
before it waits, so that the GPU computes while the host waits and plans the other chunks
(waiting first leaves the GPU idle from the synchronisation to the first GEMM's launch, ~0.8 ms
at E: bench/results/profiles.md). Its copy is of all N rows, not only the kept ones.

The forward returns the rows it computed on (``row_index``, int64); the backward gathers the
same rows from it with no second synchronisation, since its size is known on the host. Its size
says what happened: N entries when no row was skipped (the index is then the identity and is not
read), fewer when the rows were compacted (possibly none).

No compaction, and no synchronisation:

* ``skip_ignored`` off (``CCE_SKIP_IGNORED=0``; the graph pass also turns it off for graphs that
  Inductor runs as CUDA graphs);
* during CUDA-graph capture, where a synchronisation is an error;
* ``lse_all_rows``: the returned lse must then be computed at ignored rows too;
* a GPU problem too small for the synchronisation to pay (``policy.skipping_pays``: the
  whole vocabulary's size, so every rank of the vocabulary-parallel op decides alike).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .. import policy
from ..implementations.interface import KeptRows
from ..loss_math import valid_rows
from .signature import Bound


@dataclasses.dataclass(frozen=True)
class Selection:
    """The loss rows one call of the op computes on."""

    index: torch.Tensor  # (n,) int64 loss rows, ascending
    n_rows: int  # N, every loss row

    @property
    def compacted(self) -> bool:
        return self.index.numel() != self.n_rows

    def cells(self, rows_per_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, t) of the rows of ``index`` in a (B, T - shift) grid."""
        rows_per_seq = max(rows_per_seq, 1)  # no rows at all: the index is empty
        return self.index // rows_per_seq, self.index % rows_per_seq


# An implementation's ``kept_first``: bool rows -> (kept-first order, count), on the device.
OrderOf = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class KeptFirst(Selection):
    """A deferred selection: every loss row in kept-first order (``index``: the kept rows
    ascending, then the ignored ones), and the count of kept ones on its way to the host."""

    kept: KeptRows

    @property
    def compacted(self) -> bool:
        return True  # every row is gathered, in this order

    def resolved(self) -> Selection:
        """The selection of the kept rows (waits for their count, if nothing has yet)."""
        return Selection(self.index[: self.kept.count()], self.n_rows)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def select(args: Bound, order_of: OrderOf | None = None) -> Selection | None:
    """The rows this forward computes on (all of them where it may not compact: module
    docstring); None without ``skip_ignored``. Learning them is a host synchronisation;
    ``order_of`` (an implementation's ``kept_first``): a ``KeptFirst`` instead, whose count the
    implementation waits for when it needs it."""
    if not args.skip_ignored:
        return None
    valid = valid_rows(args.targets[:, args.shift :].reshape(-1), args.ignore_index)
    every_row = args.lse_all_rows or (args.has("metrics_all_rows") and args.metrics_all_rows)
    if every_row or _capturing(valid.device) or not _pays(args, valid.numel()):
        return Selection(torch.arange(valid.numel(), device=valid.device), valid.numel())
    if order_of is not None:
        return _kept_first(valid, order_of)
    return Selection(valid.nonzero().squeeze(1), valid.numel())


def _kept_first(valid: torch.Tensor, order_of: OrderOf) -> KeptFirst:
    """Every row, the kept ones first, and their count on its way to the host."""
    order, count = order_of(valid.contiguous())
    return KeptFirst(order, valid.numel(), KeptRows(count, _host_reader(count)))


def _host_reader(count: torch.Tensor):
    """A function that returns ``count`` on the host. On a GPU the value is copied now, behind
    an event on the stream that copies it, so that the reader waits for the copy alone and not
    for the work queued after it (``.item()`` would wait for the first chunk's GEMM too)."""
    if count.device.type != "cuda":
        return lambda: int(count)
    host = torch.empty((), dtype=count.dtype, pin_memory=True)  # its own: no reuse to race
    host.copy_(count, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(count.device))

    def read() -> int:
        copied.synchronize()
        return int(host)

    return read


def _pays(args: Bound, rows: int) -> bool:
    """``policy.skipping_pays`` for this call, on the whole vocabulary."""
    vocab = args.vocab_size if args.has("vocab_size") else args.classifier.shape[0]
    return policy.skipping_pays(args.hidden.device.type, rows, vocab, args.hidden.shape[-1])


def of_backward(args: Bound) -> Selection | None:
    """The forward's selection, read back from its ``row_index`` (no synchronisation)."""
    index = args.row_index
    if index is None:
        return None
    batch, time = args.targets.shape
    return Selection(index, batch * (time - args.shift))


def copy_bytes(args: Bound, selection: Selection) -> int:
    """The memory the compact copy of hidden takes (counted against the budget)."""
    return selection.index.numel() * args.hidden.shape[-1] * args.hidden.element_size()


def _row_matrix(hidden: torch.Tensor, shift: int, selection: Selection):
    """(matrix, positions): a (P, D) view of hidden's rows and the kept rows' indices into it,
    so that gathers and scatters are row copies (``index_select``), not element indexing.
    None where hidden's strides have no such view (e.g. a batch dimension of stride 0)."""
    batch, time, dim = hidden.shape
    stride_b, stride_t, stride_d = hidden.stride()
    b, t = selection.cells(time - shift)
    if stride_d != 1 or stride_t <= 0:
        return None
    if batch == 1:
        seq_stride = time
    elif stride_b % stride_t == 0 and stride_b // stride_t >= time:
        seq_stride = stride_b // stride_t
    else:
        return None
    rows = (batch - 1) * seq_stride + time if batch * time else 0
    return hidden.as_strided((rows, dim), (stride_t, 1)), b * seq_stride + t


def gather_hidden(hidden: torch.Tensor, shift: int, selection: Selection) -> torch.Tensor:
    """The selection's rows of hidden (B, T, D) as a compact (1, n, D) copy (a ``KeptFirst``:
    all N, kept first)."""
    view = _row_matrix(hidden, shift, selection)
    if view is None:
        b, t = selection.cells(hidden.shape[1] - shift)
        return hidden[b, t].unsqueeze(0)
    matrix, positions = view
    return matrix.index_select(0, positions).unsqueeze(0)


def compact(args: Bound, selection: Selection, **row_values: torch.Tensor | None) -> Bound:
    """``args`` on the selection's rows (the kept ones; a ``KeptFirst``: all N, kept first):
    hidden (1, n, D), targets (1, n), no shift; ``row_values`` (per loss row, flattened to (N,
    ...)) restricted to the same rows."""
    shift = args.shift
    targets = args.targets[:, shift:].reshape(-1)
    changes: dict = dict(
        hidden=gather_hidden(args.hidden, shift, selection),
        targets=targets.index_select(0, selection.index).unsqueeze(0),
        shift=0,
    )
    for name, value in row_values.items():
        changes[name] = None if value is None else value.index_select(0, selection.index)
    return args.replace(**changes)


def expand_rows(values: torch.Tensor, selection: Selection, fill: float = 0) -> torch.Tensor:
    """(n, ...) values of the kept rows -> (N, ...), ``fill`` at the skipped rows."""
    out = values.new_full((selection.n_rows, *values.shape[1:]), fill)
    return out.index_copy_(0, selection.index, values)


def expand_hidden(
    grad: torch.Tensor, selection: Selection, hidden: torch.Tensor, shift: int
) -> torch.Tensor:
    """A (1, n, D) gradient of the compact hidden -> hidden's (B, T, D), exact zeros at every
    other position."""
    out = grad.new_zeros(hidden.shape)
    matrix, positions = _row_matrix(out, shift, selection)  # ``out`` is contiguous
    matrix.index_copy_(0, positions, grad[0])
    return out
