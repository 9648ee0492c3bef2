"""A save refuses replicated items the ranks disagree on (DCP would keep one rank's copy without comparing)."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from tutorial_lib.dist.checkpoint import ReplicatedStateMismatchError, checkpoint_dir, save_checkpoint
from tutorial_lib.dist.checkpoint_replicated import raise_if_replicated_differ, replicated_checksums
from tutorial_lib.dist.launcher import launch
from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.quant.float8 import CurrentScaling

pytestmark = pytest.mark.distributed


def _save(root: str, differ: str | None, mode: str) -> str:
    """Rank function: a sharded weight plus replicated items; ``differ`` names the one made rank-dependent."""
    mesh, _ = world_mesh()
    rank = dist.get_rank()
    full = torch.arange(8.0).reshape(4, 2)
    state = {"w": DTensor.from_local(full[2 * rank: 2 * rank + 2].clone(), mesh, (Shard(0),), run_check=False,
                                     shape=full.shape, stride=full.stride()),
             "step": torch.tensor(3.0 + (rank if differ == "step" else 0)),
             "q": CurrentScaling().quantize(torch.ones(4, 4) * (1 + (rank if differ == "q" else 0))),
             "lr": 1e-3 * (1 + (rank if differ == "lr" else 0))}
    try:
        out = save_checkpoint(state, os.path.join(root, f"{differ}-{mode}"), mode=mode)
        if out is not None:
            out.result()
    except Exception as exc:  # noqa: BLE001 - returned: the test compares every rank's outcome
        return f"{type(exc).__name__}: {exc}"
    return "saved"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("differ", [None, "step", "q", "lr"])
def test_a_save_refuses_replicated_items_the_ranks_disagree_on(differ, mode):
    with checkpoint_dir() as root:
        results = launch(_save, world_size=2, device="cpu", args=(root, differ, mode), timeout=120, echo=False)
    if differ is None:
        assert results == ["saved", "saved"]
    else:
        for r in results:  # every rank raises, none waits
            assert "ReplicatedStateMismatchError" in r and f"['{differ}']" in r, results


def test_checksums_see_values_dtype_shape_and_position():
    a = torch.arange(6, dtype=torch.float32)
    base = replicated_checksums({"x": a})
    for other in (a.flip(0), a.to(torch.float64), a.reshape(2, 3), a + 1):
        with pytest.raises(ReplicatedStateMismatchError, match=r"\['x'\]"):
            raise_if_replicated_differ([base, replicated_checksums({"x": other})])
    raise_if_replicated_differ([base, replicated_checksums({"x": a.clone()}), {}])  # a rank without it: not compared
