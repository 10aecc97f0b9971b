"""Which vocabulary shard a rank holds: from a DTensor classifier, or from a process group.

The one place that decides which DTensor layouts are a vocabulary-parallel head (the public
function and the graph pass both ask it) and how a group becomes the name the op takes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """Classes [start, start + rows) of a vocabulary of ``size`` classes, split over a group."""

    start: int
    rows: int
    size: int
    group_name: str


def group_name(group: dist.ProcessGroup | DeviceMesh | str | None) -> str:
    """The name the op takes for a process group, a 1-D device mesh, or None (the default
    group)."""
    if isinstance(group, str):
        return group
    if group is None:
        group = dist.group.WORLD
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"group: a device mesh must be 1-D (the vocabulary's dimension), got "
                f"{group.ndim}-D; pass mesh['tp'] or its process group"
            )
        group = group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a ProcessGroup, a 1-D DeviceMesh, a group name or None, "
            f"got {type(group).__name__}"
        )
    return group.group_name


@torch.compiler.assume_constant_result
def group_size(name: str) -> int:
    """The number of ranks in the named group. A constant of a compiled graph: Dynamo calls
    this at trace time rather than tracing the group's lookup."""
    return _resolve_process_group(name).size()


def vocab_shard(weight: torch.Tensor) -> VocabShard | str:
    """The shard a DTensor classifier (V, D) holds on this rank, or why it is no
    vocabulary-parallel head: it must be sharded on dim 0 over a 1-D mesh."""
    if not isinstance(weight, DTensor):
        return "the classifier is not a DTensor"
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if weight.dim() != 2:
        return f"the classifier is {weight.dim()}-D, not (V, D)"
    if mesh.ndim != 1 or placements != (Shard(0),):
        return (
            f"the classifier's placements are {placements} on a {mesh.ndim}-D mesh, not "
            "(Shard(0),) on a 1-D mesh (vocabulary-parallel)"
        )
    rows = weight.to_local().shape[0]
    return VocabShard(_shard_start(weight), rows, int(weight.shape[0]), group_name(mesh))


@torch.compiler.assume_constant_result
def _shard_start(weight: DTensor) -> int:
    """This rank's first row of a ``Shard(0)`` DTensor, as DTensor lays shards out (uneven:
    like torch.chunk). A constant of this rank's compiled graph: traced, DTensor's offset
    arithmetic would become a data-dependent symbol."""
    _, offset = compute_local_shape_and_global_offset(
        weight.shape, weight.device_mesh, weight.placements
    )
    return int(offset[0])


def replicated_input(value: torch.Tensor, mesh: DeviceMesh) -> str | None:
    """Why a DTensor input of the head cannot be gathered to a plain replica on ``mesh``, or
    None if it can (any Shard or Replicate placement on the same mesh)."""
    if value.device_mesh != mesh:
        return "the hidden states live on another device mesh than the classifier"
    bad = [p for p in value.placements if not isinstance(p, (Shard, Replicate))]
    if bad:
        return f"the hidden states have placements {tuple(value.placements)} (partial sums)"
    return None
