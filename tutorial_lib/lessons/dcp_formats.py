"""Every weight format through every FSDP2 + DCP path: the format matrix of lesson 10 (and its tests).

One launch at world size W runs, for one registry format, every cell its ranks allow::

    shard group (ranks)   shape                    paths
    -------------------   ----------------------   ----------------------------------------------------
    2 (ranks 0-1)         even, uneven, empty      init, unshard, train (FusedAdam), resume-sync/-async
                                                   (+ FP32 export); saves the even run's checkpoints
                                                   (the async one while the next step runs)
    1 (rank 0)            even ("one-rank")        the same paths on a 1-rank FSDP2 group; reshard 2->1
                                                   from the sync and the async checkpoint, then a step
    3 (ranks 0-2)         even                     reshard 2->3 (sync checkpoint)
    4 (ranks 0-3)         even                     reshard 2->4, then saves; reshard 4->2 on ranks 0-1
    1, 3, 4               uneven, empty            reshard 2->k of those shapes' sync checkpoints

Shapes a format cannot shard (uneven dim 0 or an empty shard for a format with block-scale
buffers; 128x128 blocks over 3 ranks) are checked to be REFUSED up front with
:class:`~tutorial_lib.dist.fsdp2.UnshardableError` instead (outcome ``"refused"``).

Why every comparison is bitwise (``"exact"``), except the export of delayed scaling (``"bound"``):

* init/unshard: the counter-based init gives every row the same fp32 values as the single-process
  model; a shared scale is all-reduced with MAX (exact); block scales never straddle a shard
  boundary (checked). So the quantized bytes equal the reference's, and FSDP2's all-gather moves bytes.
* train: each rank's micro-batch loss equals the reference's for that micro-batch (same weights,
  same matmul shapes). The reference's loss is the mean over the micro-batches; at 2 ranks its
  gradient ``g0/2 + g1/2`` equals FSDP2's reduce-scatter average exactly (scaling by 2 is exact, a
  two-term sum commutes); then Adam is elementwise and requantization sees equal masters.
* train also checks that training happened: every quantized weight's bytes moved from their init and every
  step was counted (two untouched models would compare equal).
* resume/reshard: the load restores raw bytes and scales (``QuantizedLoadPlanner``) and fp32 state. The
  async save runs while the next step updates the same tensors (on a group of its own): it must have
  staged a copy. After a reshard to 1 or 2 ranks one more step equals the 2-rank run's next step (1 rank:
  the mean over both micro-batches, as in train).
* export (every parameter, plain ones as they are; every shape): the exported fp32 master, requantized,
  gives the model's bytes back exactly (the weight IS the quantized master); delayed scaling used a scale
  from its history instead, so there the check is the round-to-nearest bound
  ``|dequantize(w) - master| <= (rounding_error_bound(y) + 2**-22 |y|) * scale_inv``, ``y = master / scale_inv``
  (the second term: the cast's own fp32 roundings of ``master * scale`` and ``1 / scale``).

Example::

    from tutorial_lib.dist.checkpoint import checkpoint_dir
    from tutorial_lib.dist.launcher import launch
    from tutorial_lib.lessons.dcp_formats import format_matrix_run

    with checkpoint_dir() as root:
        per_rank = launch(format_matrix_run, world_size=4, device="cpu", args=("mxfp8", root))
    [c for r in per_rank for c in r.cells if c.mismatch]      # []: every cell holds
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from tutorial_lib.dist.checkpoint import clean_quantized, load_checkpoint, mismatched_keys, save_checkpoint
from tutorial_lib.dist.export import export_fp32_safetensors, exported_values
from tutorial_lib.dist.fsdp2 import UnshardableError, dim0_granularity
from tutorial_lib.dist.launcher import rank_device
from tutorial_lib.dist.quantized_init import build_sharded_quantized, quantize_params_, quantize_params_on_meta_
from tutorial_lib.dist.training_state import TrainingState
from tutorial_lib.lessons.dcp_pitfalls import Snapshot, assemble_full, compare_with_full, snapshot
from tutorial_lib.models import BlockMLP, counter_uniform
from tutorial_lib.optim.fused_adam import FusedAdam
from tutorial_lib.quant.block import rounding_error_bound
from tutorial_lib.quant.formats import all_values
from tutorial_lib.quant.registry import get_format_info, make_quantizer, recipe
from tutorial_lib.quant.tensor import is_quantized, local_tensor

__all__ = ["MATRIX_PATHS", "MATRIX_SHAPES", "FormatMatrixResult", "MatrixCell", "format_matrix_run", "matrix_sizes"]

MATRIX_PATHS = ("train", "resume", "reshard")
"""Groups of cells :func:`format_matrix_run` can run: init/unshard/train/export, resume, reshard."""
_PHASE_TIMEOUT_S = 300  # a phase of this small matrix takes seconds; the launch timeout bounds the run
MATRIX_SHAPES = ("even", "uneven", "empty", "one-rank")
"""Shard shapes: dim 0 divisible by the ranks, not divisible, a rank with 0 rows, a 1-rank shard group."""


@dataclasses.dataclass
class MatrixCell:
    """One cell of the format matrix, as one rank of its shard group saw it."""

    fmt: str  # registry format name
    shape: str  # "even", "uneven", "empty" (a rank holds 0 rows) or "one-rank" (a 1-rank shard group)
    path: str  # "init", "unshard", "train", "export", "resume-sync", "resume-async", "reshard 2->3", ...
    world_size: int  # ranks of the shard group the cell ran on
    outcome: str  # "exact" (bitwise), "bound" (derived bound), "refused" (UnshardableError) or "skipped"
    mismatch: list[str]  # what differs bitwise or exceeds the bound; empty when the cell holds
    detail: str  # the refusal message, the skip reason, or what was compared


@dataclasses.dataclass
class FormatMatrixResult:
    """One rank's cells of :func:`format_matrix_run`."""

    rank: int  # the rank that produced it
    fmt: str  # registry format name
    options: dict  # the quantizer options every weight of the run was made with ({} = the format's defaults)
    sizes: dict[str, tuple[int, int]]  # shape -> (dim, hidden) of the BlockMLP used
    cells: list[MatrixCell]  # every cell this rank took part in


def matrix_sizes(fmt: str) -> dict[str, tuple[int, int] | None]:
    """``(dim, hidden)`` per shape: even = divisible by 2, 3 and 4 ranks in whole scale blocks (128x128:
    by 2 and 4 only, or the model would be 1536 wide); uneven/empty only for per-tensor formats (None:
    the format must refuse them). A block format's scales are a buffer not shaped like the tensor, and FSDP2
    requires every all-gather input of a short (or empty) shard to have the padded shard's shape, so
    ``check_fsdp_shardable`` refuses those shapes up front -- the matrix's cell for them is that refusal."""
    probe = make_quantizer(fmt).quantize(torch.zeros(256, 256))
    g, k = dim0_granularity(probe), (get_format_info(fmt).tensor_class.quant_layout.block or (1, 1))[-1]
    n = math.lcm(12 * g, k)
    n = n if n <= 512 else math.lcm(4 * g, k)
    n = max(n, 24)
    per_tensor = not get_format_info(fmt).tensor_class.quant_layout.block
    return {"even": (n, n), "uneven": (n, n + 1) if per_tensor else None, "empty": (n, 1) if per_tensor else None}


# ----------------------------------------------------------------------------- building blocks


def _mesh(group) -> DeviceMesh:
    return DeviceMesh.from_group(group, rank_device().type)


def _build(fmt: str, size, mesh=None, options: dict | None = None):
    """The FSDP2-sharded model on ``mesh`` (or the plain single-process twin) + FusedAdam with masters; the
    weights quantized with ``recipe(fmt, **options)``."""
    build = lambda: BlockMLP(*size, 1, seed=3)  # noqa: E731
    dev = rank_device()
    if mesh is None:
        with torch.device(dev):
            model = quantize_params_(build(), recipe(fmt, **(options or {})), preserve_high_precision=True)
    else:
        model = build_sharded_quantized(build, mesh, recipe(fmt, **(options or {})), dev, preserve_high_precision=True)
    return model, FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01, master_weights=True)


def _batch(dim: int, step: int, rank: int):
    dev = rank_device()
    x = counter_uniform(7_000 + step, f"x{rank}", (4, dim), low=-1.0, high=1.0, device=dev)
    return x, counter_uniform(7_000 + step, f"y{rank}", (4, dim), low=-1.0, high=1.0, device=dev)


def _step(model, opt, dim: int, step: int, ranks) -> list[torch.Tensor]:
    """One step on the micro-batches of ``ranks`` (the sharded run passes its own rank; the
    reference passes all, with the mean loss FSDP2's gradient average corresponds to)."""
    losses = [F.mse_loss(model(x), y) for x, y in (_batch(dim, step, r) for r in ranks)]
    (sum(losses) / len(ranks)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return [loss.detach() for loss in losses]


def _state(model, opt) -> dict:
    return TrainingState(model, opt).state_dict()


def _gather_full(group, snap: Snapshot | None) -> dict:
    """Full tensors of a sharded state from the :func:`snapshot` of each of ``group``'s ranks (a rank
    of the group that holds no part passes None), gathered and assembled in rank order."""
    snaps = [None] * group.size()
    dist.all_gather_object(snaps, snap, group=group)
    return assemble_full([s for s in snaps if s is not None])


@dataclasses.dataclass
class _Expected:
    """What a shape's 2-rank run left for the reshard cells: full tensors as saved (after ``steps`` steps) and
    one step later (None when the run had no "resume" path)."""

    saved: dict  # full tensors of the saved state (key -> tensor, assembled from every rank's shard)
    steps: int  # steps the run had taken when it saved (the next step's index)
    after: dict | None  # full tensors one step later (None without the "resume" path)


def _trained(model, opt, init: Snapshot, steps: int) -> list[str]:
    """What shows training did NOT happen: a quantized weight whose bytes equal its init, a parameter whose
    optimizer step count is not ``steps`` (a train cell comparing two untouched models would pass)."""
    now = snapshot(model.state_dict()).tensors
    changed = set(mismatched_keys(now, init.tensors))
    bad = [f"{n}: unchanged by {steps} steps" for n, p in model.named_parameters()
           if is_quantized(p) and local_tensor(p).numel() and not any(k.startswith(n) for k in changed)]
    counts = {int(opt.state[p]["step"]) for p in model.parameters() if "step" in opt.state.get(p, {})}
    return bad + ([] if counts == {steps} else [f"optimizer step counts {sorted(counts)}, not {steps}"])


class _WriteAfter(FileSystemWriter):
    """DCP's file-system writer that writes its files only once ``gate`` is set (by the caller)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.where, self.gate = path, threading.Event()  # (FileSystemWriter keeps its own `path`)

    def write_data(self, plan, planner):
        if not self.gate.wait(timeout=_PHASE_TIMEOUT_S):
            raise TimeoutError(f"the gate of the async save to {self.where} was never opened")
        return super().write_data(plan, planner)


# ----------------------------------------------------------------------------- the cells


class _Cells:
    def __init__(self, fmt: str, options: dict):
        self.fmt, self.options, self.cells = fmt, options, []

    def add(self, shape, path, ws, outcome, mismatch=(), detail=""):
        self.cells.append(MatrixCell(self.fmt, shape, path, ws, outcome, list(mismatch), detail))


def _refusals(cells: _Cells, fmt: str, sizes: dict) -> None:
    """Shapes the format cannot shard: refused up front by the init path itself (``quantize_params_on_meta_``,
    which ``build_sharded_quantized`` runs first) on a META Linear of that shape: no memory, no ranks needed."""
    cases = {"uneven": (3, (32, 32 * 4)), "empty": (2, (1, 128))}
    probe = make_quantizer(fmt).quantize(torch.zeros(256, 256))
    if dim0_granularity(probe) > 1:
        g = dim0_granularity(probe)  # with multi-row blocks an empty shard needs a cut block first
        cases = {"uneven": (3, (g * 32, 128)), "empty": (2, (g, 128))}
    for shape, (ws, full) in cases.items():
        if sizes.get(shape, ()) is not None:
            continue
        with torch.device("meta"):
            layer = nn.Linear(full[1], full[0], bias=False)  # weight [rows, cols] = full
        try:
            quantize_params_on_meta_(layer, recipe(fmt, **cells.options), ws)
            cells.add(shape, "init", ws, "refused", ["no UnshardableError"], f"{list(full)} over {ws} ranks")
        except UnshardableError as exc:
            cells.add(shape, "init", ws, "refused", [], str(exc))


def _unshard_cells(cells, shape, ws, model, ref, group) -> None:
    """Local shards vs the reference rows (init); FSDP2's unshard vs a manual gather of the shards."""
    init = compare_with_full(model.state_dict(), snapshot(ref.state_dict()).tensors)  # CPU copies, clean
    cells.add(shape, "init", ws, "exact", init, "local shards == reference rows, bytes and scales")
    manual = _gather_full(group, snapshot(model.state_dict()))
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        m.unshard()
    # copies: reshard() frees the unsharded buffers' storage (reading them afterwards is a segfault)
    unsharded = {n: clean_quantized(local_tensor(p.detach())).to("cpu", copy=True)
                 for n, p in model.named_parameters() if is_quantized(p)}
    for m in fsdp_modules:
        m.reshard()
    want = {n: clean_quantized(p.detach()).to("cpu", copy=True) for n, p in ref.named_parameters() if is_quantized(p)}
    bad = mismatched_keys(unsharded, want) + mismatched_keys({k: manual[k] for k in unsharded}, unsharded)
    cells.add(shape, "unshard", ws, "exact", bad, f"{len(unsharded)} quantized weights: unshard == manual gather "
              "== reference")


def _export_cell(cells, shape, ws, model, opt, ref, ref_opt, path, group) -> None:
    export_fp32_safetensors(model, path, optimizer=opt, process_group=group)
    values, delayed = exported_values(path), cells.fmt == "fp8_delayed"
    names = [name for name, _ in ref.named_parameters()]
    bad = [] if sorted(values) == sorted(names) else [f"exported keys {sorted(values)} != parameters {sorted(names)}"]
    for name, param in ref.named_parameters():
        if name not in values:
            continue
        if not is_quantized(param):  # plain fp32 parameters (norms, biases): their values
            if not torch.equal(values[name], param.detach().float().cpu()):
                bad.append(f"{name}: export != parameter")
            continue
        master, p = ref_opt.state[param]["master_param"].cpu(), clean_quantized(param.detach()).to("cpu", copy=True)
        if not torch.equal(values[name], master):
            bad.append(f"{name}: export != master")
        if delayed:  # the bytes came from a history scale: round-to-nearest bound around the master
            sinv = p.raw_buffers()["scale_inv"].double()
            err = (p.dequantize(torch.float32).double() - master.double()).abs()
            y = master.double() / sinv
            # + the cast's fp32 roundings of master * scale and 1 / scale: |y_fp32 - y| <= 2**-23 |y| (2**-22 kept)
            bound = (rounding_error_bound(y, all_values(p.meta()["fmt"])) + 2**-22 * y.abs()) * sinv
            if (err > bound).any():
                bad.append(f"{name}: |dequantize - master| above the rounding bound")
        elif mismatched_keys({"w": clean_quantized(make_quantizer(cells.fmt, **cells.options).quantize(values[name]))},
                             {"w": p}):
            bad.append(f"{name}: requantized export != weight bytes")
    cells.add(shape, "export", ws, "bound" if delayed else "exact", bad,
              "every parameter exported: fp32 masters (requantized == the weights" + (", bound for delayed" if delayed
              else "") + "), plain parameters as they are")


def _train_and_resume(cells, fmt, shape, size, group, save_group, root, paths,
                      steps) -> tuple[Snapshot, Snapshot | None]:
    """On ``group``: init/unshard, ``steps`` FusedAdam steps vs the reference, export, save sync + async (the
    next step taken while the async save runs), resume from each. Returns the :func:`snapshot` of the saved
    state and, with "resume" in ``paths``, of the state one step later (None without)."""
    ws, rank = group.size(), dist.get_rank()
    mesh = _mesh(group)
    model, opt = _build(fmt, size, mesh, cells.options)
    ref, ref_opt = _build(fmt, size, options=cells.options)
    ranks = range(ws)
    if "train" in paths:
        _unshard_cells(cells, shape, ws, model, ref, group)
    init = snapshot(model.state_dict())
    same_loss = [torch.equal(_step(model, opt, size[0], s, [rank])[0], _step(ref, ref_opt, size[0], s, ranks)[rank])
                 for s in range(steps)]
    if "train" in paths:
        bad = compare_with_full(_state(model, opt), snapshot(_state(ref, ref_opt)).tensors)
        bad += [f"loss step {i}" for i, ok in enumerate(same_loss) if not ok]
        bad += _trained(model, opt, init, steps)
        cells.add(shape, "train", ws, "exact", bad, f"{steps} FusedAdam steps: losses, weights, masters, moments")
        _export_cell(cells, shape, ws, model, opt, ref, ref_opt, os.path.join(root, f"export-{shape}.safetensors"),
                     group)  # every shape: uneven and empty shards too (a rank with 0 rows writes none)
    tag = f"{shape}-ws{ws}"
    save_checkpoint({"app": TrainingState(model, opt)}, os.path.join(root, f"{tag}-sync"), process_group=group)
    saved_snap = snapshot(_state(model, opt))  # a copy: the run goes on training these tensors
    # on a group of its own: the save's collectives run in the background while the step's run on `group`;
    # its files are written only once the next step has changed the live tensors: a stager that did not copy
    # them writes the NEW values, and resume-async fails -- every time, not only when the writer is slow
    writer = _WriteAfter(os.path.join(root, f"{tag}-async"))
    pending = save_checkpoint({"app": TrainingState(model, opt)}, writer.where, mode="async",
                              process_group=save_group, storage_writer=writer)
    after = None
    try:
        if "resume" in paths:  # the next step runs WHILE the async save is in flight
            ref_loss = _step(model, opt, size[0], steps, [rank])[0]
            after = snapshot(_state(model, opt))
    finally:
        writer.gate.set()
    pending.result()
    if "resume" in paths:
        for mode in ("sync", "async"):
            m2, o2 = _build(fmt, size, mesh, cells.options)
            load_checkpoint({"app": TrainingState(m2, o2)}, os.path.join(root, f"{tag}-{mode}"), process_group=group)
            bad = mismatched_keys(snapshot(_state(m2, o2)).tensors, saved_snap.tensors)
            loss = _step(m2, o2, size[0], steps, [rank])[0]
            bad += mismatched_keys(snapshot(_state(m2, o2)).tensors, after.tensors)
            bad += [] if torch.equal(loss, ref_loss) else ["next loss"]
            cells.add(shape, f"resume-{mode}", ws, "exact", bad,
                      "loaded == saved (async: a step ran while it was saved); next step == the run that never "
                      "stopped")
    return saved_snap, after


def _reshard_cell(cells, fmt, size, group, expected: _Expected, path, label, shape: str = "even") -> None:
    """Load the 2-rank (or 4-rank) checkpoint on ``group``; compare every shard with the saved full tensors.
    At 1 and 2 ranks, then one step: it must equal the 2-rank run's next step exactly -- 2 ranks take their
    own micro-batch, 1 rank the mean over both (``g0/2 + g1/2``, as in the train cell). At 3 and 4 ranks the
    reduce-scatter would sum in another order, so no step is compared there."""
    ws = group.size()
    try:
        model, opt = _build(fmt, size, _mesh(group), cells.options)
    except UnshardableError as exc:
        cells.add(shape, label, ws, "refused", [], str(exc))
        return
    load_checkpoint({"app": TrainingState(model, opt)}, path, process_group=group)
    bad = compare_with_full(_state(model, opt), expected.saved)
    detail = "every local shard == the rows of the saved full tensors"
    if expected.after is not None and ws <= 2:
        _step(model, opt, size[0], expected.steps, [0, 1] if ws == 1 else [dist.get_rank()])
        bad += [f"after a step: {m}" for m in compare_with_full(_state(model, opt), expected.after)]
        detail += "; one step later == the 2-rank run's next step"
    cells.add(shape, label, ws, "exact", bad, detail)


def format_matrix_run(fmt: str, root: str, paths: tuple[str, ...] = MATRIX_PATHS, steps: int = 2,
                      shapes: tuple[str, ...] = MATRIX_SHAPES, options: dict | None = None) -> FormatMatrixResult:
    """Rank function: every cell of ``paths`` x ``shapes`` that this world size allows, for format ``fmt``.

    ``root`` is a directory every rank can write (checkpoints and exports go below it). Cells that
    need more ranks than launched are reported as ``"skipped"`` (rank 0). ``"even"`` must be among
    ``shapes`` for the reshard cells (they load the even run's checkpoints). ``options``: quantizer options of
    the format (``recipe(fmt, **options)``, e.g. ``{"pow2_scales": True}``), for every weight of every cell.
    """
    get_format_info(fmt)  # a clear error for an unknown name
    options = dict(options or {})
    make_quantizer(fmt, **options)  # a clear error for a bad option, before any collective
    bad = (set(paths) - set(MATRIX_PATHS)) | (set(shapes) - set(MATRIX_SHAPES))
    if bad or ("reshard" in paths and "even" not in shapes):
        raise ValueError(f"paths must be among {MATRIX_PATHS} and shapes among {MATRIX_SHAPES} (with 'even' for "
                         f"'reshard'), got {paths}, {shapes}")
    rank, world = dist.get_rank(), dist.get_world_size()
    cells, sizes = _Cells(fmt, options), matrix_sizes(fmt)
    groups = {k: (dist.new_group(list(range(k))) if k < world else dist.group.WORLD) for k in range(1, world + 1)}
    save_groups = {k: dist.new_group(list(range(k)), backend="gloo") for k in (1, 2) if k <= world}  # async saves
    # Ranks outside a phase's shard group wait for it here, as long as the phase takes: a gloo group
    # (CPU tensors, also next to NCCL) whose timeout is not the launch's short collective timeout.
    phases = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=_PHASE_TIMEOUT_S))
    if rank == 0:
        _refusals(cells, fmt, {k: v for k, v in sizes.items() if k in shapes})
    expected, other_shapes = None, {}  # other_shapes: uneven / empty -> what their 2-rank run left
    if world >= 2:
        for shape in ("even", "uneven", "empty"):
            if sizes[shape] is None or shape not in shapes:
                continue
            saved, after = _train_and_resume(cells, fmt, shape, sizes[shape], groups[2], save_groups[2], root, paths,
                                             steps) if rank < 2 else (None, None)
            # every rank needs the full tensors the 2-rank run saved, and one step later
            got = _Expected(_gather_full(phases, saved), steps, _gather_full(phases, after) if "resume" in paths
                            else None)
            if shape == "even":
                expected = got
            else:
                other_shapes[shape] = got
            dist.barrier(group=phases)
    if rank == 0 and "one-rank" in shapes:
        _train_and_resume(cells, fmt, "one-rank", sizes["even"], groups[1], save_groups[1], root, paths, steps)
    dist.barrier(group=phases)
    if "reshard" in paths:
        even = sizes["even"]
        for k in (1, 3, 4):
            if k > world or world < 2:
                if rank == 0:
                    cells.add("even", f"reshard 2->{k}", k, "skipped", [], f"needs {max(k, 2)} ranks")
                continue
            if rank < k:  # the async checkpoint too where it is cheap (one process)
                for mode in ("sync", "async") if k == 1 else ("sync",):
                    _reshard_cell(cells, fmt, even, groups[k], expected, os.path.join(root, f"even-ws2-{mode}"),
                                  f"reshard 2->{k} ({mode})")
            dist.barrier(group=phases)
        if world >= 4 and sizes["even"] is not None:
            if rank < 4:  # the 4-rank model lives on groups[4]; further ranks wait at the barrier
                model, opt = _build(fmt, even, _mesh(groups[4]), cells.options)
                load_checkpoint({"app": TrainingState(model, opt)}, os.path.join(root, "even-ws2-sync"),
                                process_group=groups[4])
                save_checkpoint({"app": TrainingState(model, opt)}, os.path.join(root, "even-ws4-sync"),
                                process_group=groups[4])
            dist.barrier(group=phases)
            if rank < 2:
                _reshard_cell(cells, fmt, even, groups[2], expected, os.path.join(root, "even-ws4-sync"),
                              "reshard 4->2 (sync)")
            dist.barrier(group=phases)
        elif rank == 0:
            cells.add("even", "reshard 4->2 (sync)", 2, "skipped", [], "needs 4 ranks")
        for shape, exp in other_shapes.items():  # an uneven / empty-shard checkpoint loads at 1, 3, 4 ranks too
            for k in (1, 3, 4):
                if k <= world:
                    if rank < k:
                        _reshard_cell(cells, fmt, sizes[shape], groups[k], exp, os.path.join(root, f"{shape}-ws2-sync"),
                                      f"reshard 2->{k} (sync)", shape=shape)
                    dist.barrier(group=phases)
    return FormatMatrixResult(rank=rank, fmt=fmt, options=options,
                              sizes={k: v for k, v in sizes.items() if v is not None}, cells=cells.cells)
