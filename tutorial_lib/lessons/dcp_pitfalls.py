"""Rank functions for lesson 10 (DCP pitfalls): train, checkpoint, resume and reshard a quantized FSDP2 run.

The run: a tiny ``BlockMLP`` sharded with FSDP2 and quantized at init (lesson 06), trained with
``FusedAdam`` and fp32 master weights (lesson 08). fc1 weights are delayed-scaling FP8 (FusedAdam's
fused FP8 write), fc2 weights current-scaling FP8 (requantized from the masters), so a checkpoint
exercises both optimizer routes and the quantizer state::

    checkpoint_run(root, cfg)               train cfg.steps; save sync + async; export fp32 safetensors;
      -> CheckpointRunResult                take one more step (the reference); resume fresh models from
                                            the checkpoints (RESUME_MODES) and compare, bitwise
    reshard_load_run(root, cfg, expected)   load at THIS world size (or on its first load_world_size ranks);
      -> ReshardLoadResult                  compare every local shard with the full tensors assembled
                                            from checkpoint_run's snapshots
    load_unsharded(path, cfg, planner)      world size 1, in the calling process: the unsharded twin,
      -> Snapshot                           loaded with our planner or DCP's default one
    unreduced_amax_run(root)                a delayed-scaling quantizer without its group: plain DCP saves
      -> UnreducedAmaxResult                one rank's amax history; save_checkpoint refuses, naming it

Every result is a dataclass of CPU tensors and plain values (picklable, so ``launch`` returns it).

Example::

    import os
    from tutorial_lib.dist.checkpoint import checkpoint_dir, mismatched_keys
    from tutorial_lib.dist.launcher import launch
    from tutorial_lib.lessons.dcp_pitfalls import RunConfig, assemble_full, checkpoint_run, load_unsharded

    cfg = RunConfig()
    with checkpoint_dir() as root:
        per_rank = launch(checkpoint_run, world_size=2, device="cpu", args=(root, cfg))
        per_rank[0].resumes["sync"].after_mismatch                  # []: the resume is bit-exact
        expected = assemble_full([r.saved for r in per_rank])       # full tensors at save time
        got = load_unsharded(os.path.join(root, "sync"), cfg)       # loaded at world size 1
        mismatched_keys(got.tensors, expected)                      # []
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from tutorial_lib.dist.checkpoint import (
    ReplicatedStateMismatchError,
    clean_quantized,
    load_checkpoint,
    mismatched_keys,
    save_checkpoint,
    shared_checkpoint_dir,
)
from tutorial_lib.dist.export import export_fp32_safetensors
from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.dist.quantized_init import build_sharded_quantized, quantize_params_
from tutorial_lib.dist.runtime import deterministic_mode_restored
from tutorial_lib.dist.training_state import TrainingState, optimizer_step_count
from tutorial_lib.models import BlockMLP, local_rows
from tutorial_lib.optim.fused_adam import FusedAdam
from tutorial_lib.quant.float8 import DelayedScaling
from tutorial_lib.quant.registry import make_quantizer
from tutorial_lib.quant.serialization import register_safe_globals
from tutorial_lib.quant.tensor import QuantizedTensor, is_quantized, local_tensor

__all__ = [
    "RESUME_MODES",
    "CheckpointRunResult",
    "ReshardLoadResult",
    "ResumeResult",
    "RunConfig",
    "Snapshot",
    "assemble_full",
    "batch",
    "build_model_and_optimizer",
    "checkpoint_run",
    "compare_with_full",
    "load_unsharded",
    "reshard_load_run",
    "resume_and_step",
    "snapshot",
    "train_step",
    "weight_recipe",
]


# ----------------------------------------------------------------------------- a small run


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A tiny BlockMLP trained with FusedAdam: fc1 weights delayed-scaling FP8, fc2 current-scaling FP8."""

    dim: int = 32  # model width
    hidden: int = 64  # MLP hidden width
    n_blocks: int = 2  # MLP blocks
    batch: int = 8  # rows per batch and rank
    steps: int = 3  # training steps before the checkpoint
    lr: float = 1e-2  # FusedAdam learning rate
    weight_decay: float = 0.01  # FusedAdam (decoupled) weight decay
    history_len: int = 4  # amax history length of the delayed-scaling quantizers
    seed: int = 0  # model init and data seed


def weight_recipe(cfg: RunConfig):
    """fc1 weights: delayed-scaling FP8 (FusedAdam's fused FP8 write); fc2: current-scaling FP8 (requantize)."""

    def recipe(fqn, param):
        if ".fc1." in fqn:
            return make_quantizer("fp8_delayed", history_len=cfg.history_len)
        return make_quantizer("fp8")

    return recipe


def build_model_and_optimizer(cfg: RunConfig, device, mesh=None) -> tuple[nn.Module, FusedAdam]:
    """FSDP2-sharded quantized BlockMLP on ``mesh`` (quantized init), or the unsharded twin (mesh None)."""

    def build():
        return BlockMLP(cfg.dim, cfg.hidden, cfg.n_blocks, seed=cfg.seed)

    if mesh is None:
        with torch.device(device):
            model = quantize_params_(build(), weight_recipe(cfg), preserve_high_precision=True)
    else:
        model = build_sharded_quantized(build, mesh, weight_recipe(cfg), device, preserve_high_precision=True)
    opt = FusedAdam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, master_weights=True)
    return model, opt


def batch(cfg: RunConfig, step: int, rank: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` on ``rank``: a pure function of (seed, step, rank), so a resumed run sees it again."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1_009 + rank)
    x = torch.randn(cfg.batch, cfg.dim, generator=g)
    return x.to(device), torch.randn(cfg.batch, cfg.dim, generator=g).to(device)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One MSE step; returns the (detached) loss."""
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


# ----------------------------------------------------------------------------- snapshots and comparisons


@dataclasses.dataclass
class Snapshot:
    """CPU copies of one rank's training state (:meth:`TrainingState.state_dict`), for comparisons."""

    tensors: dict[str, torch.Tensor]  # dotted state key -> copy of the LOCAL tensor (quantized: bytes, scale, meta)
    placements: dict[str, str]  # dotted state key -> "shard0" (this rank's rows of dim 0) or "replicated"


def _flat(state: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    for k, v in state.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            yield from _flat(v, key)
        else:
            yield key, v


def snapshot(state: dict) -> Snapshot:
    """Copy every tensor of ``state`` to the CPU: quantized tensors clean (no quantizer, no attributes).

    The caller stitches the ranks' snapshots into full tensors with :func:`assemble_full`.
    """
    tensors, placements = {}, {}
    for key, v in _flat(state):
        if not isinstance(v, torch.Tensor):
            continue
        placement = "replicated"
        if isinstance(v, DTensor):
            (pl,) = v.placements
            if isinstance(pl, Shard) and pl.dim == 0:
                placement = "shard0"
            elif not isinstance(pl, Replicate):
                raise NotImplementedError(f"{key}: placement {pl}")
        loc = local_tensor(v).detach()
        # a COPY: .to("cpu") of a CPU tensor is the tensor itself, and the run goes on training it
        tensors[key] = (clean_quantized(loc) if isinstance(loc, QuantizedTensor) else loc).to("cpu", copy=True)
        placements[key] = placement
    return Snapshot(tensors, placements)


def assemble_full(snapshots: list[Snapshot]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's :func:`snapshot` (rank order): shard0 pieces concatenated on dim 0."""
    first_rank = snapshots[0]
    full = {}
    for key, first in first_rank.tensors.items():
        if first_rank.placements[key] == "replicated":
            full[key] = first
            continue
        pieces = [s.tensors[key] for s in snapshots]
        if isinstance(first, QuantizedTensor):
            bufs = {}
            for name, b in first.raw_buffers().items():
                if b.dim() == 0:  # the shared per-tensor scale: every shard must carry the same one
                    if any(not torch.equal(p.raw_buffers()[name], b) for p in pieces):
                        raise ValueError(f"{key}: shards carry different {name!r}")
                    bufs[name] = b
                else:
                    bufs[name] = torch.cat([p.raw_buffers()[name] for p in pieces])
            rows = sum(p.shape[0] for p in pieces)
            full[key] = type(first).from_buffers(bufs, first.meta(), (rows, *first.shape[1:]), first.dtype)
        else:
            full[key] = torch.cat(pieces)
    return full


def _shard_of(full: torch.Tensor, local: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor:
    """The rows of ``full`` this rank holds (quantized: the same scale, the rows of the bytes)."""
    start, stop = rows
    if isinstance(full, QuantizedTensor):  # a buffer row may span several tensor rows (16x16, 128x128 blocks)
        bufs = {n: (b if b.dim() == 0 else b[start * b.shape[0] // full.shape[0]: stop * b.shape[0] // full.shape[0]])
                for n, b in full.raw_buffers().items()}
        return type(full).from_buffers(bufs, full.meta(), tuple(local.shape), full.dtype)
    return full[start:stop]


def compare_with_full(state: dict, expected: dict) -> list[str]:
    """Keys of ``state`` (a rank's, possibly sharded, state dict) whose local value differs bitwise from
    the matching rows of ``expected`` (full tensors, e.g. from :func:`assemble_full`)."""
    local, want = {}, {}
    for key, v in _flat(state):
        if not isinstance(v, torch.Tensor):
            continue
        loc = local_tensor(v).detach().cpu()
        local[key] = clean_quantized(loc) if isinstance(loc, QuantizedTensor) else loc
        if key in expected:
            sharded = isinstance(v, DTensor) and any(isinstance(pl, Shard) for pl in v.placements)
            want[key] = _shard_of(expected[key], loc, local_rows(v)) if sharded else expected[key]
    return mismatched_keys(local, want)


# ----------------------------------------------------------------------------- the launched runs

RESUME_MODES = ("sync", "async", "sync-without-quantizer-state")
"""How :func:`checkpoint_run` resumes: from the sync / async checkpoint, and (broken) without quantizer state."""


@dataclasses.dataclass
class ResumeResult:
    """A fresh model + optimizer loaded from a checkpoint, then one step (on one rank)."""

    step: int  # the step it took: the loaded optimizer's step count (the data position)
    loss: torch.Tensor  # loss of that step; equals CheckpointRunResult.ref_loss when the resume is exact
    loaded_mismatch: list[str]  # state keys that differ (bitwise) from the saved state right after the load
    after_mismatch: list[str]  # state keys that differ (bitwise) from the reference after the step


@dataclasses.dataclass
class CheckpointRunResult:
    """One rank's outcome of :func:`checkpoint_run`."""

    rank: int  # the rank that produced it
    losses: list[float]  # losses of steps 0 .. cfg.steps-1 (before the checkpoint)
    ref_loss: torch.Tensor  # loss of step cfg.steps in the run that never stopped (the reference)
    saved: Snapshot  # the training state that was checkpointed
    ref_after: Snapshot  # the reference's training state after step cfg.steps
    export_sources: dict[str, str] | None  # export_fp32_safetensors's {key: "master" | ...}; None without export
    resumes: dict[str, ResumeResult]  # one per RESUME_MODES entry, keyed by the mode
    scratch_dir: str  # the directory shared_checkpoint_dir made inside the ranks (removed before returning)


def resume_and_step(cfg: RunConfig, path: str, mesh, dev, rank: int, saved: Snapshot, ref_after: Snapshot,
                    quantizers: bool = True) -> ResumeResult:
    """Inside a rank (:func:`checkpoint_run` calls it): a fresh model + optimizer on ``mesh``, load ``path``,
    take the next step -- its batch from the loaded optimizer's step count (``optimizer_step_count``, returned
    as ``step``: the caller checks that it equals ``cfg.steps``); compare the loaded state with ``saved`` and
    the state after the step with ``ref_after`` (``quantizers=False``: load without the quantizer state, the
    broken resume)."""
    model, opt = build_model_and_optimizer(cfg, dev, mesh)
    load_checkpoint({"app": TrainingState(model, opt, quantizers=quantizers)}, path)
    loaded = snapshot(TrainingState(model, opt).state_dict())
    step = optimizer_step_count(opt)  # the data position comes back with the optimizer state (the lesson checks it)
    loss = train_step(model, opt, *batch(cfg, step, rank, dev))
    after = snapshot(TrainingState(model, opt).state_dict())
    return ResumeResult(step=step, loss=loss, loaded_mismatch=mismatched_keys(loaded.tensors, saved.tensors),
                        after_mismatch=mismatched_keys(after.tensors, ref_after.tensors))


@deterministic_mode_restored()  # deterministic on CUDA ranks for the bit-exact claims, restored on return
def checkpoint_run(root: str, cfg: RunConfig = RunConfig(), export: bool = True) -> CheckpointRunResult:
    """Train, checkpoint (sync + async + fp32 export), continue; resume (:data:`RESUME_MODES`); compare.

    Writes ``root/sync``, ``root/async`` and ``root/export.safetensors`` (kept for resharding loads);
    a scratch checkpoint goes to a directory made and removed inside the ranks
    (:func:`~tutorial_lib.dist.checkpoint_dirs.shared_checkpoint_dir`).
    """
    rank = dist.get_rank()
    mesh, dev = world_mesh(deterministic=True)
    model, opt = build_model_and_optimizer(cfg, dev, mesh)
    losses = [train_step(model, opt, *batch(cfg, s, rank, dev)).item() for s in range(cfg.steps)]
    app = {"app": TrainingState(model, opt)}
    save_checkpoint(app, os.path.join(root, "sync"))
    save_checkpoint(app, os.path.join(root, "async"), mode="async").result()
    saved = snapshot(TrainingState(model, opt).state_dict())
    sources = export_fp32_safetensors(model, os.path.join(root, "export.safetensors"), optimizer=opt) \
        if export else None
    # the run that never stopped: one more step
    ref_loss = train_step(model, opt, *batch(cfg, cfg.steps, rank, dev))
    ref_after = snapshot(TrainingState(model, opt).state_dict())
    resumes = {mode: resume_and_step(cfg, os.path.join(root, mode.split("-")[0]), mesh, dev, rank, saved,
                                     ref_after, quantizers=mode != "sync-without-quantizer-state")
               for mode in RESUME_MODES}
    # hygiene inside the ranks: a scratch checkpoint in a shared, unique dir that is gone afterwards
    pending = []
    with shared_checkpoint_dir(root=root, prefix="scratch-", pending=pending) as scratch:
        pending.append(save_checkpoint(app, os.path.join(scratch, "c"), mode="async"))
    return CheckpointRunResult(rank=rank, losses=losses, ref_loss=ref_loss, saved=saved, ref_after=ref_after,
                               export_sources=sources, resumes=resumes, scratch_dir=scratch)


def load_unsharded(path: str, cfg: RunConfig = RunConfig(), planner: str = "quantized") -> Snapshot:
    """World size 1, this process: the unsharded twin model + FusedAdam loaded from a sharded checkpoint.

    ``planner="quantized"`` uses :func:`~tutorial_lib.dist.checkpoint.load_checkpoint`; ``"default"``
    plain ``dcp.load`` with DCP's default planner (safe globals registered), whose partial-view
    copies requantize. Returns the :func:`snapshot` of the loaded training state.
    """
    model, opt = build_model_and_optimizer(cfg, "cpu")
    state = {"app": TrainingState(model, opt)}
    if planner == "quantized":
        load_checkpoint(state, path)
    elif planner == "default":
        register_safe_globals()
        dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(), no_dist=True)
    else:
        raise ValueError(f"planner must be 'quantized' or 'default', got {planner!r}")
    return snapshot(TrainingState(model, opt).state_dict())


@dataclasses.dataclass
class ReshardLoadResult:
    """One rank's outcome of :func:`reshard_load_run`."""

    rank: int  # the rank that produced it
    mismatch: list[str]  # state keys whose local shard differs (bitwise) from the rows of the expected tensor
    quantized_local_rows: dict[str, int]  # parameter name -> rows of its quantized shard held by this rank
    load_world_size: int  # ranks that loaded the checkpoint (the shard group of the loaded model)


@deterministic_mode_restored()  # deterministic on CUDA ranks for the bit-exact claims, restored on return
def reshard_load_run(root: str, cfg: RunConfig, expected: dict, mode: str = "sync",
                     load_world_size: int | None = None) -> ReshardLoadResult | None:
    """Load ``root/<mode>`` at THIS world size; compare every local shard with ``expected`` (full tensors).

    ``load_world_size`` (1 .. world size): only ranks ``0 .. load_world_size-1`` build the model (on a
    mesh of their own) and load; the other ranks return None. Every rank must call it (it makes a group).
    """
    mesh, dev = world_mesh(deterministic=True)
    group, world = None, dist.get_world_size()
    load_world_size = world if load_world_size is None else load_world_size
    if not 1 <= load_world_size <= world:
        raise ValueError(f"load_world_size must be between 1 and the world size {world}, got {load_world_size}")
    if load_world_size < world:
        group = dist.new_group(list(range(load_world_size)))  # a collective: every rank takes part
        # the other ranks wait as long as the load takes: a gloo group without the launch's short timeout
        waiting = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=300))
        if dist.get_rank() >= load_world_size:
            dist.barrier(group=waiting)
            return None
        mesh = DeviceMesh.from_group(group, dev.type)
    model, opt = build_model_and_optimizer(cfg, dev, mesh)  # a fresh model, sharded over the loading ranks
    load_checkpoint({"app": TrainingState(model, opt)}, os.path.join(root, mode), process_group=group)
    result = ReshardLoadResult(
        rank=dist.get_rank(),
        mismatch=compare_with_full(TrainingState(model, opt).state_dict(), expected),
        quantized_local_rows={n: local_tensor(p).shape[0] for n, p in model.named_parameters() if is_quantized(p)},
        load_world_size=load_world_size,
    )
    if group is not None:
        dist.barrier(group=waiting)
    return result


@dataclasses.dataclass
class UnreducedAmaxResult:
    """One rank's outcome of :func:`unreduced_amax_run`."""

    rank: int  # the rank that produced it
    own_history: list[float]  # this rank's amax history: its quantizer saw only its own shard
    plain_loaded: list[float]  # the history plain dcp.save + dcp.load gives this rank back
    refusal: str  # what save_checkpoint raised on this rank ("" if it saved)
    refused_keys: list[str]  # the keys the refusal names


def unreduced_amax_run(root: str) -> UnreducedAmaxResult:
    """A delayed-scaling quantizer created WITHOUT its shard group (so its amax is not all-reduced) quantizes
    this rank's shard of a weight whose rows grow with the row index: every rank records a different amax.
    Its history and scale are plain tensors under the same keys on every rank -- what DCP saves once.

    Saves ``{"w": the sharded weight, "amax_history", "scale"}`` twice: with plain ``dcp.save`` under
    ``root/plain`` (then loads it back into zeros) and with :func:`save_checkpoint` under ``root/checked``.
    """
    mesh, dev = world_mesh()  # no bit-exact claim here: deterministic mode stays as it is
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(10)
    full = torch.randn(4 * world, 8, generator=g) * torch.arange(1.0, 4 * world + 1)[:, None]
    shard = full.chunk(world)[rank].to(dev)
    q = DelayedScaling(history_len=4)  # group=None: the mistake -- each rank's amax stays its own
    q.quantize(shard)
    state = {"w": DTensor.from_local(shard, mesh, (Shard(0),), run_check=False, shape=full.shape,
                                     stride=full.stride()),
             "amax_history": q.amax_history.clone(), "scale": q.scale.clone()}
    dcp.save(state, checkpoint_id=os.path.join(root, "plain"))
    back = {"w": DTensor.from_local(torch.zeros_like(shard), mesh, (Shard(0),), run_check=False, shape=full.shape,
                                    stride=full.stride()),
            "amax_history": torch.zeros_like(state["amax_history"]), "scale": torch.zeros_like(state["scale"])}
    dcp.load(back, checkpoint_id=os.path.join(root, "plain"))
    refusal, keys = "", []
    try:
        save_checkpoint(state, os.path.join(root, "checked"))
    except ReplicatedStateMismatchError as exc:
        refusal, keys = f"{type(exc).__name__}: {exc}", list(exc.keys)
    return UnreducedAmaxResult(rank=rank, own_history=state["amax_history"].tolist(),
                               plain_loaded=back["amax_history"].tolist(), refusal=refusal, refused_keys=keys)
