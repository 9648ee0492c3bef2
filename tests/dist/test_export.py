"""The fp32 export at 2 ranks: every rank joins every gather, only the writing rank keeps the gathered values."""

import os

import pytest
import torch

from tutorial_lib.dist.checkpoint import checkpoint_dir
from tutorial_lib.dist.export import export_fp32_safetensors, exported_values, fp32_values
from tutorial_lib.dist.fsdp2 import fully_shard_blocks
from tutorial_lib.dist.launcher import launch
from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.models import BlockMLP

pytestmark = pytest.mark.distributed


def _export(path: str) -> tuple[int, int, dict]:
    mesh, _ = world_mesh()
    model = fully_shard_blocks(BlockMLP(16, 24, 2, seed=3), mesh)
    kept, sources = fp32_values(model, keep=False)
    full, full_sources = fp32_values(model)
    assert sources == full_sources
    export_fp32_safetensors(model, path)
    return len(kept), len(full), sources


def test_only_the_writer_keeps_the_gathered_model():
    with checkpoint_dir() as root:
        path = os.path.join(root, "model.safetensors")
        results = launch(_export, world_size=2, device="cpu", args=(path,), timeout=120, echo=False)
        assert [r[0] for r in results] == [0, 0] and results[0][1] == results[1][1] > 0, results
        want = BlockMLP(16, 24, 2, seed=3).state_dict()
        got = exported_values(path)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k].float()) for k in want)
