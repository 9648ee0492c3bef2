"""``load_checkpoint(..., requantize="allow")`` -- a quantized model initialised from a high-precision DCP
checkpoint -- when a target's shard spans several checkpoint chunks, or none.

Saved: plain fp32 weights sharded over 2 ranks (two chunks each). Loaded: into FP8 current-scaling targets
(the amax all-reduced over the load's ranks) and MXFP8 targets at 1 and at 3 ranks. Each target must equal
``quantize(full weight)`` bit for bit -- one rounding from the saved values, one amax -- whichever chunks its
shard took: at 3 ranks rank 1's rows span both saved chunks and a 2-row weight leaves rank 2 an empty shard.
Requantizing chunk by chunk rounded the first chunk's values again at the second chunk's scale, and issued one
amax all-reduce per chunk: a rank with two chunks waited in an all-reduce the others never joined."""


import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from tutorial_lib.dist.checkpoint import checkpoint_dir, load_checkpoint, save_checkpoint
from tutorial_lib.dist.launcher import launch
from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.quant.float8 import CurrentScaling
from tutorial_lib.quant.mxfp8 import MXFP8Quantizer

pytestmark = pytest.mark.distributed

SHAPES = {"w": (12, 64), "small": (2, 64)}  # "small": 1 row per rank at 3 ranks -> rank 2's shard is empty


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(name))
    return torch.randn(SHAPES[name], generator=g) * torch.logspace(-2, 2, SHAPES[name][1])  # spread amaxes


def _sharded(full: torch.Tensor, mesh, make) -> DTensor:
    """FSDP2's dim-0 split: ceil(N / ws) rows per rank, the last ones short or empty."""
    ws, rank = mesh.size(), mesh.get_local_rank()
    rows = -(-full.shape[0] // ws)
    local = make(full[rank * rows: (rank + 1) * rows].clone())
    return DTensor.from_local(local, mesh, (Shard(0),), run_check=False, shape=full.shape, stride=full.stride())


def _save_plain(root: str) -> None:
    mesh, _ = world_mesh()
    save_checkpoint({name: _sharded(_full(name), mesh, lambda x: x) for name in SHAPES}, root)


def _targets(mesh):
    """Per format: fresh quantized targets (zeros) whose quantizers reduce their amax over the load's ranks."""
    group = dist.group.WORLD
    return {"fp8": lambda x: CurrentScaling("e4m3", group=group).quantize(torch.zeros_like(x)),
            "mxfp8": lambda x: MXFP8Quantizer().quantize(torch.zeros_like(x))}


def _expected(fmt: str, full: torch.Tensor):
    return (CurrentScaling("e4m3") if fmt == "fp8" else MXFP8Quantizer()).quantize(full)


def _load_and_compare(root: str) -> dict:
    """Rank function: load into fresh targets of each format; per format, does every local shard equal the
    matching rows of quantize(full) (bytes and scales)?"""
    mesh, _ = world_mesh()
    ws, rank = mesh.size(), mesh.get_local_rank()
    out = {}
    for fmt, make in _targets(mesh).items():
        state = {name: _sharded(_full(name), mesh, make) for name in SHAPES}
        load_checkpoint(state, root, requantize="allow")
        same = []
        for name in SHAPES:
            want, got = _expected(fmt, _full(name)), state[name]._local_tensor
            rows = -(-SHAPES[name][0] // ws)
            for buf_name, buf in got.raw_buffers().items():
                ref = want.raw_buffers()[buf_name]
                ref = ref if ref.dim() == 0 else ref[rank * rows: rank * rows + buf.shape[0]]
                same.append(torch.equal(buf, ref))
        out[fmt] = all(same)
    return out


@pytest.fixture(scope="module")
def saved():
    with checkpoint_dir() as root:
        launch(_save_plain, world_size=2, device="cpu", args=(root,), timeout=120, echo=False)
        yield root


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_allow_at_one_process_requantizes_each_weight_once(saved, fmt):
    """2 -> 1: each target receives two chunks; the result is quantize(full), not the first chunk re-rounded."""
    make = {"fp8": CurrentScaling("e4m3"), "mxfp8": MXFP8Quantizer()}[fmt]
    state = {name: make.quantize(torch.zeros(SHAPES[name])) for name in SHAPES}
    load_checkpoint(state, saved, requantize="allow")
    for name in SHAPES:
        want = _expected(fmt, _full(name))
        for buf_name, buf in state[name].raw_buffers().items():
            assert torch.equal(buf, want.raw_buffers()[buf_name]), (name, buf_name)


def test_allow_at_three_ranks_with_a_shard_over_two_chunks_and_an_empty_shard(saved):
    """2 -> 3: rank 1's 4 rows of "w" span both saved chunks (one amax all-reduce, not two), rank 2's shard of
    "small" is empty (it joins the all-reduce all the same); every rank's bytes and scale equal quantize(full)."""
    results = launch(_load_and_compare, world_size=3, device="cpu", args=(saved,), timeout=180,
                     collective_timeout=30.0, echo=False)
    assert results == [{"fp8": True, "mxfp8": True}] * 3, results
