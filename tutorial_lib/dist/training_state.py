"""Exact resume of a quantized FSDP2 training run from a DCP checkpoint (and the runs lesson 09 launches).

What must come back for the next step to equal the run that never stopped::

    model        FP8 bytes + scale_inv per shard, fp32 LayerNorm/bias shards       model.state_dict()
    optimizer    step, exp_avg, exp_avg_sq, fp32 master weights (DTensors)           FusedAdam.state_dict()
    quantizers   delayed-scaling amax history + scale (the NEXT step's scale)       QuantizerStates (fixed size)
    data order   which batch comes next                                              the step number

:class:`TrainingState` bundles the three as one DCP ``Stateful``. Loading needs the optimizer
state to EXIST first (DCP loads in place); :func:`init_optimizer_state` creates it without
touching the weights (torch's own helper does it with a hidden lr=0 step, which requantizes
quantized weights and advances delayed-scaling histories).

The launched runs (each returns picklable per-rank results)::

    checkpoint_run(root, cfg)      train cfg.steps, save sync + async, export fp32 safetensors,
                                   continue one step (the reference), then resume two fresh models
                                   from the two checkpoints and compare: loss and state, bitwise
    reshard_load_run(root, cfg, expected)   load at another world size; compare shards with the
                                   full tensors assembled from checkpoint_run's snapshots

Example::

    from tutorial_lib.dist.training_state import RunConfig, checkpoint_run, assemble_full
    with checkpoint_dir() as root:
        per_rank = launch(checkpoint_run, world_size=2, device=dev, args=(root, RunConfig()))
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from tutorial_lib.dist.checkpoint import (
    clean_quantized,
    load_checkpoint,
    mismatched_keys,
    save_checkpoint,
    shared_checkpoint_dir,
)
from tutorial_lib.dist.extra_state import QuantizerStates
from tutorial_lib.quant.tensor import QuantizedTensor, is_quantized, local_tensor
from tutorial_lib.dist.runtime import deterministic_cuda

__all__ = [
    "RESUME_MODES",
    "RunConfig",
    "TrainingState",
    "assemble_full",
    "build_model_and_optimizer",
    "checkpoint_run",
    "init_optimizer_state",
    "load_unsharded",
    "reshard_load_run",
    "snapshot",
    "train_step",
]


# ----------------------------------------------------------------------------- the application state


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (so DCP can load into it) without changing any parameter.

    FusedAdam builds its state on a ``step()`` with no gradients and returns before updating.
    Other optimizers fall back to torch's helper, which steps with zero gradients and lr=0.
    """
    if optimizer.state:
        return
    from tutorial_lib.optim.fused_adam import FusedAdam

    if any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        raise RuntimeError("init_optimizer_state: parameters already have gradients; zero_grad(set_to_none=True) first")
    if isinstance(optimizer, FusedAdam):
        optimizer.step()
        return
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


class TrainingState:
    """DCP ``Stateful``: model + optimizer + quantizer state, everything an exact resume needs.

    ``quantizers=False`` leaves the quantizer state out: the broken variant lesson 09 and the
    tests use to show that the delayed-scaling history is part of the training state.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, quantizers: bool = True):
        self.model, self.optimizer, self.quantizers = model, optimizer, quantizers

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        init_optimizer_state(self.optimizer)
        state = {"model": get_model_state_dict(self.model),
                 "optim": get_optimizer_state_dict(self.model, self.optimizer)}
        if self.quantizers:
            state["quantizers"] = QuantizerStates(self.model).state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, state_dict["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state_dict["optim"])
        if self.quantizers:
            QuantizerStates(self.model).load_state_dict(state_dict["quantizers"])


# ----------------------------------------------------------------------------- a small run


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A tiny BlockMLP trained with FusedAdam: fc1 weights delayed-scaling FP8, fc2 current-scaling FP8."""

    dim: int = 32
    hidden: int = 64
    n_blocks: int = 2
    batch: int = 8
    steps: int = 3
    lr: float = 1e-2
    weight_decay: float = 0.01
    history_len: int = 4
    seed: int = 0


def _recipe(cfg: RunConfig):
    from tutorial_lib.quant.per_tensor import CurrentScaling, DelayedScaling

    def recipe(fqn, p):  # both FusedAdam routes: fused FP8 write (delayed) and requantize (current)
        return DelayedScaling("e4m3", history_len=cfg.history_len) if ".fc1." in fqn else CurrentScaling("e4m3")

    return recipe


def _reset_meta_probed_quantizers(model: nn.Module) -> None:
    """Workaround: quantize_params_on_meta_ probes each quantizer on a META tensor, and a delayed-scaling
    quantizer records that probe (history moved to meta, steps = 1). Give it back its initial state."""
    for p in model.parameters():
        q = local_tensor(p).quantizer if is_quantized(p) else None
        if q is not None and getattr(q, "amax_history", None) is not None and q.amax_history.is_meta:
            q.amax_history = torch.zeros(q.history_len, dtype=torch.float32)
            q.scale = torch.ones((), dtype=torch.float32)
            q.steps = 0


def build_model_and_optimizer(cfg: RunConfig, device, mesh=None):
    """FSDP2-sharded quantized BlockMLP on ``mesh`` (quantized init), or the unsharded twin (mesh None)."""
    from tutorial_lib.dist.fsdp2 import fully_shard_blocks
    from tutorial_lib.optim.fused_adam import FusedAdam
    from tutorial_lib.models import BlockMLP
    from tutorial_lib.dist.quantized_init import materialize_sharded_, quantize_params_, quantize_params_on_meta_

    def build():
        return BlockMLP(cfg.dim, cfg.hidden, cfg.n_blocks, seed=cfg.seed)

    if mesh is None:
        with torch.device(device):
            model = quantize_params_(build(), _recipe(cfg), preserve_high_precision=True)
    else:  # build_sharded_quantized's four steps, with the meta-probe workaround between 2 and 3
        with torch.device("meta"):
            model = build()
        quantize_params_on_meta_(model, _recipe(cfg), mesh.size())
        _reset_meta_probed_quantizers(model)
        fully_shard_blocks(model, mesh)
        materialize_sharded_(model, device, preserve_high_precision=True)
    opt = FusedAdam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, master_weights=True)
    return model, opt


def batch(cfg: RunConfig, step: int, rank: int, device):
    """The batch of ``step`` on ``rank``: a pure function of (seed, step, rank), so a resumed run sees it again."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1_009 + rank)
    x = torch.randn(cfg.batch, cfg.dim, generator=g)
    return x.to(device), torch.randn(cfg.batch, cfg.dim, generator=g).to(device)


def train_step(model: nn.Module, opt, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _flat(state: dict, prefix: str = ""):
    for k, v in state.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            yield from _flat(v, key)
        else:
            yield key, v


def snapshot(state: dict) -> dict:
    """``{key: (placement, CPU copy of the local tensor)}``; placement "shard0" or "replicated".

    Quantized tensors are copied clean (bytes, scale, meta). The test process stitches the ranks'
    snapshots into full tensors with :func:`assemble_full`.
    """
    out = {}
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
        loc = (clean_quantized(loc) if isinstance(loc, QuantizedTensor) else loc).to("cpu", copy=True)
        out[key] = (placement, loc)
    return out


def assemble_full(snapshots: list[dict]) -> dict:
    """Full tensors from every rank's :func:`snapshot` (rank order): shard0 pieces concatenated on dim 0."""
    full = {}
    for key, (placement, first) in snapshots[0].items():
        if placement == "replicated":
            full[key] = first
            continue
        pieces = [s[key][1] for s in snapshots]
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


def _shard_of(full: torch.Tensor, local: torch.Tensor, rows: tuple[int, int]):
    """The rows of ``full`` this rank holds (quantized: the same scale, the rows of the bytes)."""
    start, stop = rows
    if isinstance(full, QuantizedTensor):
        bufs = {n: (b if b.dim() == 0 else b[start:stop]) for n, b in full.raw_buffers().items()}
        return type(full).from_buffers(bufs, full.meta(), tuple(local.shape), full.dtype)
    return full[start:stop]


def _compare_with_full(state: dict, expected: dict) -> list[str]:
    """Keys whose local value differs from the matching rows of ``expected`` (bitwise)."""
    from tutorial_lib.models import local_rows

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


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    from tutorial_lib.dist.launcher import rank_device

    dev = rank_device()
    if dev.type == "cuda":
        deterministic_cuda()
    return dev, init_device_mesh(dev.type, (dist.get_world_size(),))


def _resume(cfg: RunConfig, path: str, dev, mesh, rank: int, quantizers: bool = True):
    """Fresh model + optimizer, load ``path``, take the next step: (loss, loaded snapshot, post-step snapshot)."""
    model, opt = build_model_and_optimizer(cfg, dev, mesh)
    load_checkpoint({"app": TrainingState(model, opt, quantizers=quantizers)}, path)
    loaded = snapshot(TrainingState(model, opt).state_dict())
    loss = train_step(model, opt, *batch(cfg, cfg.steps, rank, dev))
    return loss, loaded, snapshot(TrainingState(model, opt).state_dict())


def checkpoint_run(root: str, cfg: RunConfig = RunConfig(), export: bool = True) -> dict:
    """Train, checkpoint (sync + async + fp32 export), continue; resume (:data:`RESUME_MODES`); compare.

    Writes ``root/sync``, ``root/async`` and ``root/export.safetensors`` (kept for resharding loads);
    the resume comparisons themselves use a per-run scratch directory made and removed inside the
    ranks (:func:`shared_checkpoint_dir`).
    """
    from tutorial_lib.dist.export import export_fp32_safetensors

    rank = dist.get_rank()
    dev, mesh = _mesh()
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
    out = {"rank": rank, "losses": losses, "ref_loss": ref_loss, "saved": saved, "export_sources": sources,
           "ref_after": ref_after}
    for mode in RESUME_MODES:
        loss, loaded, after = _resume(cfg, os.path.join(root, mode.split("-")[0]), dev, mesh, rank,
                                      quantizers=mode != "sync-without-quantizer-state")
        out[mode] = {
            "loss": loss,
            "loaded_mismatch": mismatched_keys({k: v[1] for k, v in loaded.items()},
                                               {k: v[1] for k, v in saved.items()}),
            "after_mismatch": mismatched_keys({k: v[1] for k, v in after.items()},
                                              {k: v[1] for k, v in ref_after.items()}),
        }
    # hygiene inside the ranks: a scratch checkpoint in a shared, unique dir that is gone afterwards
    pending = []
    with shared_checkpoint_dir(root=root, prefix="scratch-", pending=pending) as scratch:
        pending.append(save_checkpoint(app, os.path.join(scratch, "c"), mode="async"))
        out["scratch_dir"] = scratch
    return out


def load_unsharded(path: str, cfg: RunConfig = RunConfig(), planner: str = "quantized") -> dict:
    """World size 1, this process: the unsharded twin model + FusedAdam loaded from a sharded checkpoint.

    ``planner="quantized"`` uses :func:`load_checkpoint`; ``"default"`` plain ``dcp.load`` with DCP's
    default planner (safe globals registered), whose partial-view copies requantize. Returns the
    :func:`snapshot` of the loaded training state.
    """
    model, opt = build_model_and_optimizer(cfg, "cpu")
    state = {"app": TrainingState(model, opt)}
    if planner == "quantized":
        load_checkpoint(state, path)
    elif planner == "default":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        from tutorial_lib.quant.tensor import register_safe_globals

        register_safe_globals()
        dcp.load(state, checkpoint_id=path, planner=DefaultLoadPlanner(), no_dist=True)
    else:
        raise ValueError(f"planner must be 'quantized' or 'default', got {planner!r}")
    return snapshot(TrainingState(model, opt).state_dict())


def reshard_load_run(root: str, cfg: RunConfig, expected: dict, mode: str = "sync") -> dict:
    """Load ``root/<mode>`` at THIS world size; compare every local shard with ``expected`` (full tensors)."""
    rank = dist.get_rank()
    dev, mesh = _mesh()
    model, opt = build_model_and_optimizer(cfg, dev, mesh)
    state = {"app": TrainingState(model, opt)}
    load_checkpoint(state, os.path.join(root, mode))
    return {"rank": rank, "mismatch": _compare_with_full(TrainingState(model, opt).state_dict(),
                                                         expected),
            "quantized_local_rows": {n: local_tensor(p).shape[0] for n, p in model.named_parameters()
                                     if is_quantized(p)}}
