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

_functional = torch.ops._c10d_functional

ISSUED: collections.Counter[str] = collections.Counter()


def all_reduce(tensor: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """``tensor`` reduced over the group with ``op`` ("sum" or "max"), out of place."""
    ISSUED[f"all_reduce:{op}"] += 1
    return _functional.wait_tensor(_functional.all_reduce(tensor.contiguous(), op, group_name))
