"""The one mesh helper: what a rank function calls first to get its 1-D mesh and its device.

Every rank function started by :func:`tutorial_lib.dist.launcher.launch` runs inside an
initialised process group (gloo on CPU, NCCL with one GPU per rank). It needs a mesh over
the whole world and the device its tensors live on; :func:`world_mesh` returns both, always in
the order ``(mesh, device)``::

    rank 0   rank 1   ...   rank N-1          world_mesh() -> RankMesh(mesh, device)
    +-------------------------------+          mesh:   DeviceMesh(device.type, (N,))
    |      1-D mesh over N ranks    |          device: cpu, or cuda:<local rank>
    +-------------------------------+

``deterministic=True`` also makes CUDA kernels deterministic (cuBLAS workspace and
``torch.use_deterministic_algorithms``): runs that compare bits across processes need it.

Example (a rank function lives in an importable module: spawned ranks import it by name, so one
defined in a notebook cell or in a script run as ``__main__`` is refused by ``launch``)::

    # my_ranks.py, next to the notebook
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from tutorial_lib.dist.mesh import world_mesh

    def gathered_shape():
        mesh, dev = world_mesh()
        x = torch.randn(4, 8, device=dev)
        return DTensor.from_local(x, mesh, [Shard(0)]).full_tensor().shape

    # the notebook (or a script, under `if __name__ == "__main__":`)
    from my_ranks import gathered_shape
    from tutorial_lib.dist.launcher import launch
    launch(gathered_shape, world_size=2, device="cpu")    # [torch.Size([8, 8]), torch.Size([8, 8])]
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tutorial_lib.dist.launcher import rank_device
from tutorial_lib.dist.runtime import deterministic_cuda

__all__ = ["RankMesh", "world_mesh"]


class RankMesh(NamedTuple):
    """A rank's 1-D mesh over the world and the device its tensors live on."""

    mesh: DeviceMesh
    device: torch.device


def world_mesh(*, deterministic: bool = False) -> RankMesh:
    """``(mesh, device)`` for the calling rank: a 1-D mesh over every rank of the default group."""
    if not dist.is_initialized():
        raise RuntimeError("world_mesh() runs inside a launched rank (tutorial_lib.dist.launcher.launch or torchrun): "
                           "no process group is initialised")
    dev = rank_device()
    if deterministic and dev.type == "cuda":
        deterministic_cuda()
    return RankMesh(init_device_mesh(dev.type, (dist.get_world_size(),)), dev)
