"""DCP round trips of an FSDP2-sharded FP8 model trained with FusedAdam, on real ranks.

One launch at world size 2 (module fixture) trains a small BlockMLP (fc1: delayed-scaling FP8 on
the fused kernel path, fc2: current-scaling FP8 on the requantize path), saves sync + async
checkpoints and an fp32 export, takes one more step (the reference), and resumes fresh models
from the checkpoints. The tests then check, bitwise:

* resume: next loss and the whole post-step state (weights, scales, moments, masters, step,
  quantizer history) equal the uninterrupted run -- and NOT without the quantizer state (broken);
* resharding: loading at another world size restores every shard exactly -- and not with DCP's
  default load planner (broken); 2 -> 1 runs on CPU, 2 -> 4 and 4 -> 2 where 4 GPUs are lent;
* export: one fp32 safetensors file with the model's keys and full shapes, masters as values.

Run the GPU cases with ``pytest tests/dist/test_checkpoint_dist.py --nb-device cuda``.
"""

import math
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

from tutorial_lib.dist.checkpoint import (
    CheckpointExistsError,
    NonFiniteCheckpointError,
    QuantizedLoadPlanner,
    SharedScaleError,
    checkpoint_dir,
    load_checkpoint,
    mismatched_keys,
    save_checkpoint,
)
from tutorial_lib.dist.export import export_fp32_safetensors, exported_values
from tutorial_lib.dist.launcher import launch
from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.dist.runtime import resolve_device
from tutorial_lib.lessons.dcp_pitfalls import (
    RunConfig,
    assemble_full,
    checkpoint_run,
    load_unsharded,
    reshard_load_run,
)
from tutorial_lib.quant.float8 import Float8Tensor
from tutorial_lib.quant.serialization import register_safe_globals
from tutorial_lib.quant.tensor import QuantizedTensor

pytestmark = [pytest.mark.distributed, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

CFG = RunConfig()


def broken(value, raises=AssertionError):
    return pytest.param(value, id="broken", marks=pytest.mark.xfail(strict=True, raises=raises,
                                                                    reason="broken variant reproduces the pitfall"))


def fixed(value, id=None):
    return pytest.param(value, id=id or "fixed")


@pytest.fixture(scope="module")
def device(request):
    return resolve_device(request.config.getoption("--nb-device"))


def _max_ranks(device) -> int:
    """One GPU per rank on CUDA; on CPU four gloo ranks (2 cores: slow, but the 2 <-> 4 reshards run in CI)."""
    return torch.cuda.device_count() if device.type == "cuda" else 4


def _saved(run, world_size, device):
    root, results = run(world_size)
    return root, results, assemble_full([r.saved for r in results])


@pytest.fixture(scope="module")
def run(device):
    """``run(world_size)`` -> (root, per-rank results) of :func:`checkpoint_run`, launched once per size."""
    done, dirs = {}, []
    with checkpoint_dir() as root:
        def get(world_size):
            if world_size not in done:
                if world_size > _max_ranks(device):
                    pytest.skip(f"needs {world_size} ranks on {device.type}")
                path = os.path.join(root, f"ws{world_size}")
                os.makedirs(path)
                done[world_size] = (path, launch(checkpoint_run, world_size=world_size, device=device,
                                                 args=(path, CFG), kwargs={"export": world_size == 2}, timeout=400))
            return done[world_size]

        dirs.append(root)
        yield get
    assert not os.path.exists(dirs[0])


# ----------------------------------------------------------------------------- exact resume


@pytest.mark.parametrize("mode", [broken("sync-without-quantizer-state"), fixed("sync", "fixed-sync"),
                                  fixed("async", "fixed-async")])
def test_contract_resume_equals_the_run_that_never_stopped(run, mode):
    _, results = run(2)
    for r in results:
        got = r.resumes[mode]
        assert torch.equal(got.loss, r.ref_loss), f"rank {r.rank}: next loss differs"
        assert got.after_mismatch == [], f"rank {r.rank}: state after one more step differs"
        assert got.loaded_mismatch == []


def test_the_reference_step_changes_every_weight_and_quantizer(run):
    """So 'equal after one more step' cannot pass by a step that does nothing."""
    _, results = run(2)
    for r in results:
        before, after = r.saved.tensors, r.ref_after.tensors
        changed = set(mismatched_keys(after, before))
        weights = {k for k in before if k.startswith("model.") and k.endswith("weight")}
        assert weights <= changed
        assert {k for k in before if k.startswith("quantizers.") and ".fc1." in k} <= changed  # delayed history
        assert r.losses[0] != r.losses[-1]


def test_scratch_checkpoint_dir_made_inside_the_ranks_is_gone(run):
    _, results = run(2)
    assert results[0].scratch_dir == results[1].scratch_dir  # one shared directory
    assert not os.path.exists(results[0].scratch_dir)


# ----------------------------------------------------------------------------- resharding


@pytest.mark.parametrize("planner", [broken("default"), fixed("quantized")])
def test_contract_reshard_2_to_1_restores_every_tensor_exactly(run, device, planner):
    root, _, expected = _saved(run, 2, device)
    got = load_unsharded(os.path.join(root, "sync"), CFG, planner)
    assert set(got.tensors) == set(expected)
    quantized = [k for k, v in expected.items() if isinstance(v, QuantizedTensor)]
    assert len(quantized) == 2 * CFG.n_blocks
    assert mismatched_keys(got.tensors, expected) == []


@pytest.mark.parametrize("save_ws,load_ws", [(2, 1), (2, 4), (4, 2)])
def test_reshard_n_to_m_on_ranks(run, device, save_ws, load_ws):
    if max(save_ws, load_ws) > _max_ranks(device):
        pytest.skip(f"needs {max(save_ws, load_ws)} ranks on {device.type}")
    root, _, expected = _saved(run, save_ws, device)
    for mode in ("sync", "async"):
        out = launch(reshard_load_run, world_size=load_ws, device=device, args=(root, CFG, expected, mode),
                     timeout=300)
        assert [r.mismatch for r in out] == [[]] * load_ws, mode


def test_reshard_on_the_first_ranks_of_a_launch(run, device):
    """``load_world_size`` < world size: the first ranks load on a group of their own, the others
    return None (lesson 10 loads on 3 of the format matrix's 4 ranks this way)."""
    world = _max_ranks(device)
    if world < 2:
        pytest.skip(f"needs 2 ranks on {device.type}")
    root, _, expected = _saved(run, 2, device)
    load_ws = world - 1
    out = launch(reshard_load_run, world_size=world, device=device, args=(root, CFG, expected),
                 kwargs={"load_world_size": load_ws}, timeout=300)
    assert out[load_ws:] == [None] * (world - load_ws)
    loaded = [(r.rank, r.load_world_size, r.mismatch) for r in out[:load_ws]]
    assert loaded == [(r, load_ws, []) for r in range(load_ws)]
    rows = [r.quantized_local_rows["blocks.0.fc1.weight"] for r in out[:load_ws]]
    assert sum(rows) == CFG.hidden and rows[0] == -(-CFG.hidden // load_ws)


# ----------------------------------------------------------------------------- export


def test_fp32_safetensors_export_has_full_shapes_and_master_values(run, device):
    root, results, expected = _saved(run, 2, device)
    values = exported_values(os.path.join(root, "export.safetensors"))
    model_keys = {k.removeprefix("model.") for k in expected if k.startswith("model.")}
    assert set(values) == model_keys  # no optimizer, quantizer or extra-state keys
    sources = results[0].export_sources
    for key, v in values.items():
        assert v.dtype == torch.float32
        assert tuple(v.shape) == tuple(expected[f"model.{key}"].shape), key  # full, not a shard
        if isinstance(expected[f"model.{key}"], QuantizedTensor):
            assert sources[key] == "master"
            assert torch.equal(v, expected[f"optim.state.{key}.master_param"]), key
        else:
            assert sources[key] == "fp32"
            assert torch.equal(v, expected[f"model.{key}"]), key


def test_export_without_optimizer_dequantizes_and_excludes_extra_state():
    from test_checkpoint import _FixedExtraStateLinear

    m = _FixedExtraStateLinear(steps=2)
    assert "_extra_state" in m.state_dict()
    with checkpoint_dir() as root:
        sources = export_fp32_safetensors(m, os.path.join(root, "m.safetensors"))
        values = exported_values(os.path.join(root, "m.safetensors"))
    assert sources == {"weight": "dequantized"} and set(values) == {"weight"}
    assert torch.equal(values["weight"], m.weight.dequantize(torch.float32))


# ----------------------------------------------------------------------------- hygiene with a real run


def test_plain_dcp_save_into_a_used_dir_mixes_two_runs(run, device):
    root, _, _ = _saved(run, 2, device)
    with checkpoint_dir() as tmp:
        reused = os.path.join(tmp, "ckpt")
        shutil.copytree(os.path.join(root, "sync"), reused)  # a 2-rank run's checkpoint
        dcp.save({"w": torch.ones(3)}, checkpoint_id=reused, no_dist=True)  # a 1-rank run reuses the path
        files = sorted(os.listdir(reused))
        assert "__1_0.distcp" in files  # the other run's shard file survives next to the new metadata
        with pytest.raises(CheckpointExistsError):
            save_checkpoint({"w": torch.ones(3)}, reused)


# ----------------------------------------------------------------------------- empty shards


def _empty_shard_run(root: str) -> dict:
    """A [1, 8] FP8 weight on 2 ranks: rank 1's shard is EMPTY, so no chunk is ever read there."""
    rank = dist.get_rank()
    mesh, dev = world_mesh()

    def param(full, scale):
        local = full[rank : rank + 1].to(dev)  # torch.chunk of 1 row over 2 ranks: rank 1 holds 0 rows
        q = Float8Tensor.from_high_precision(local, scale=scale)
        return DTensor.from_local(q, mesh, (Shard(0),), run_check=False, shape=full.shape, stride=full.stride())

    full = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    path = os.path.join(root, "empty-shard")
    save_checkpoint({"w": param(full, 16.0)}, path)
    out = {"rank": rank, "local_rows": param(full, 1.0).to_local().shape[0]}
    planner_only = {"w": param(torch.zeros(1, 8), 1.0)}
    register_safe_globals()
    dcp.load(planner_only, checkpoint_id=path, planner=QuantizedLoadPlanner())  # the planner alone
    out["broken"] = planner_only["w"].to_local().scale_inv.item()
    ours = {"w": param(torch.zeros(1, 8), 1.0)}
    load_checkpoint(ours, path)  # + the shared-scale hand-over to empty shards
    out["fixed"] = ours["w"].to_local().scale_inv.item()
    return out


@pytest.fixture(scope="module")
def empty_shard_results(device):
    if 2 > _max_ranks(device):
        pytest.skip(f"needs 2 ranks on {device.type}")
    with checkpoint_dir() as root:
        yield launch(_empty_shard_run, world_size=2, device=device, args=(root,), timeout=300)


@pytest.mark.parametrize("variant", [broken("broken"), fixed("fixed")])
def test_contract_an_empty_shard_gets_the_shared_scale(empty_shard_results, variant):
    """FSDP2's all-gather sends each rank's 0-d scale as metadata: an empty shard's stale scale would be used."""
    assert [r["local_rows"] for r in empty_shard_results] == [1, 0]
    assert [r[variant] for r in empty_shard_results] == [1 / 16, 1 / 16]


# ----------------------------------------------------------------------------- two chunks of one FP8 weight


def _two_chunk_run(root: str) -> None:
    """An [8, 16] FP8 weight saved on 2 ranks (rows 0-3, 4-7): once with ONE shared scale (16, as
    training writes it), once with a different scale per rank (a broken checkpoint: 16 and 32), once with
    the same NaN scale on both ranks (a diverged run)."""
    rank = dist.get_rank()
    mesh, _ = world_mesh()
    full = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    for name, scales in (("shared", (16.0, 16.0)), ("disagreeing", (16.0, 32.0)), ("nan", (math.nan, math.nan))):
        scale = 16.0 if math.isnan(scales[rank]) else scales[rank]  # NaN: codes of scale 16, then the NaN scale
        local = Float8Tensor.from_high_precision(full[4 * rank: 4 * rank + 4], scale=scale)
        local.raw_buffers()["scale_inv"].fill_(1 / scales[rank])
        w = DTensor.from_local(local, mesh, (Shard(0),), run_check=False, shape=full.shape, stride=full.stride())
        save_checkpoint({"w": w}, os.path.join(root, name))


@pytest.fixture(scope="module")
def two_chunks():
    """(root, the full weight quantized with the shared scale) after :func:`_two_chunk_run` on 2 CPU ranks."""
    with checkpoint_dir() as root:
        launch(_two_chunk_run, world_size=2, device="cpu", args=(root,), timeout=300)
        full = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
        yield root, Float8Tensor.from_high_precision(full, scale=16.0)


@pytest.mark.parametrize("requantize", ["error", "allow"])
def test_reshard_of_the_same_format_is_a_raw_copy_even_when_requantizing_is_allowed(two_chunks, requantize):
    """2 -> 1 ranks into a fresh target (scale 1.0, no quantizer): both chunks are Float8Tensor chunks
    of the target's meta, so ``requantize="allow"`` must not requantize them either."""
    root, want = two_chunks
    target = {"w": Float8Tensor.from_high_precision(torch.zeros(8, 16), scale=1.0)}
    load_checkpoint(target, os.path.join(root, "shared"), requantize=requantize)
    assert target["w"].raw_buffers()["scale_inv"].item() == 1 / 16  # the checkpoint's scale, not the target's
    assert mismatched_keys(target, {"w": want}) == []  # bytes and scale, bitwise


def test_a_nan_scale_on_every_chunk_is_named_by_the_nan_check_not_called_a_disagreement(two_chunks):
    """NaN != NaN: comparing the chunks' shared scale by value called two equal NaN scales a broken invariant."""
    root, _ = two_chunks
    with pytest.raises(NonFiniteCheckpointError) as info:
        load_checkpoint({"w": Float8Tensor.from_high_precision(torch.zeros(8, 16), scale=1.0)},
                        os.path.join(root, "nan"))
    assert set(info.value.keys) == {"w"} and "scale_inv non-finite" in info.value.keys["w"]


def test_chunks_that_disagree_on_the_shared_scale_are_refused(two_chunks):
    root, _ = two_chunks
    with pytest.raises(SharedScaleError, match="disagree on the shared 'scale_inv'"):
        load_checkpoint({"w": Float8Tensor.from_high_precision(torch.zeros(8, 16), scale=1.0)},
                        os.path.join(root, "disagreeing"))
