"""The collectives the vocabulary-parallel op issues, and a count of them.

They run inside the op's implementation, below autograd and opaque to torch.compile, so they
are the functional collectives' plain ops (``_c10d_functional``), not their differentiable
Python wrappers: ``funcol.all_reduce`` differentiates to a sum over ranks, which would scale a
replicated loss's gradients by the group size. The group is passed by name (a custom op's
schema cannot hold a ProcessGroup). Waiting on the result makes the current stream wait for
the collective; the host does not.

``ISSUED`` counts what was issued, by kind, at run time: CommDebugMode does not see inside a
custom op and cannot be combined with torch.compile, and these counts can (the tests read it).
"""

from __future__ import annotations

import collections

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

_functional = torch.ops._c10d_functional

ISSUED: collections.Counter[str] = collections.Counter()


def all_gather(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    """Every rank's ``tensor``, stacked in rank order: (group size, *tensor.shape)."""
    ISSUED["all_gather"] += 1
    size = _resolve_process_group(group_name).size()
    gathered = _functional.all_gather_into_tensor(tensor.contiguous(), size, group_name)
    return _functional.wait_tensor(gathered).view(size, *tensor.shape)


def all_reduce_(tensor: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """``tensor`` reduced over the group with ``op`` ("sum" or "max") in place: for a buffer
    the caller owns, so the reduction allocates no second one."""
    ISSUED[f"all_reduce:{op}"] += 1
    return _functional.wait_tensor(_functional.all_reduce_(tensor, op, group_name))
