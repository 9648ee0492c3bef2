"""Lesson 05 (DTensor): placements, redistribution, quantized locals, seeded init -- as rank functions.

A DTensor is a *global* tensor described by a device mesh and one placement per mesh dim;
each rank holds a *local* tensor::

    global x [4, 6]        Shard(0)            Shard(1)            Replicate()      Partial()
                           rank 0: rows 0-1    rank 0: cols 0-2    rank 0: all      rank 0: x0
                           rank 1: rows 2-3    rank 1: cols 3-5    rank 1: all      rank 1: x1   (x = x0 + x1)

Every op on a DTensor first goes through DTensor's dispatch (sharding propagation: which
placements the output has, which collectives the inputs need), then the op on the LOCAL
tensors. When a local tensor is a :class:`~tutorial_lib.quant.tensor.QuantizedTensor`, that
second step lands in *its* ``__torch_dispatch__``: ops in its table (views, ``clone``, ``copy_``,
``detach``, ...) stay quantized, anything else (arithmetic, the functional all-gather inside
``full_tensor()``) falls back to dequantizing::

    dt.t()  ->  DTensor: Shard(0) -> Shard(1)  ->  Float8Tensor: aten.t handler (still FP8)
    dt * 2  ->  DTensor: same placements       ->  Float8Tensor: fallback (plain result)

Two demos look at the edges: :func:`uneven_from_local_demo` (``from_local`` of uneven shards needs
``shape=``/``stride=``; ``view(-1)`` of uneven row shards raises) and :func:`scatter_dispatch_demo` (why
``distribute_tensor`` cannot scatter quantized shards: its output comes from ``empty_like``, and the
dispatcher finds subclasses in the scatter's outputs, not in its ``Tensor[][]`` inputs).

Each ``*_demo`` function runs on every rank (:func:`tutorial_lib.dist.launcher.launch`) and
returns a dataclass of plain values and CPU tensors for the notebook to print, plot and check.

Example::

    from tutorial_lib.dist.launcher import launch, run_sequence
    from tutorial_lib.lessons.dtensor import init_pitfall_demo, placements_demo

    res = launch(placements_demo, world_size=2, device="cpu", args=(4, 6))
    res[1].shard0.local                  # rows 2-3 of the global tensor
    per_rank = launch(run_sequence, world_size=2, device="cpu",
                      args=([(placements_demo, {}), (init_pitfall_demo, {"dim": 8, "hidden": 6})],))
    per_rank[0][1].all_params_equal_reference       # True: counter-based init
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._pytree import tree_leaves, tree_map_only

from tutorial_lib.dist.mesh import world_mesh
from tutorial_lib.models import BlockMLP, counter_uniform, naive_reset_parameters, shard_rows
from tutorial_lib.quant.fallback import FALLBACKS, fallback_mode
from tutorial_lib.quant.float8 import CurrentScaling
from tutorial_lib.quant.tensor import QuantizedTensor

__all__ = [
    "DispatchStep",
    "InitPitfallResult",
    "LocalShard",
    "PartialResult",
    "PlacementsResult",
    "ProbeTensor",
    "QuantizedDTensorResult",
    "RedistributeResult",
    "Redistribution",
    "ScatterDispatchResult",
    "UnevenFromLocalResult",
    "UnevenResult",
    "comm_counts",
    "init_pitfall_demo",
    "placements_demo",
    "quantized_dtensor_demo",
    "record_quantized_dispatch",
    "redistribute_demo",
    "scatter_dispatch_demo",
    "uneven_from_local_demo",
]


# ----------------------------------------------------------------------------- results


@dataclasses.dataclass
class LocalShard:
    """One placement of the global tensor, seen from one rank."""

    placement: str  # str(placement): "S(0)", "S(1)", "R"
    local: torch.Tensor  # this rank's local tensor
    full_equal: bool  # full_tensor() rebuilt the global tensor exactly


@dataclasses.dataclass
class PartialResult:
    """A ``Partial()`` DTensor (each rank holds a summand) redistributed to ``Replicate()``."""

    local: torch.Tensor  # this rank's summand: x * (rank + 1)
    reduced: torch.Tensor  # after the redistribution: the sum over the ranks
    expected: torch.Tensor  # x * world_size * (world_size + 1) / 2
    comms: dict[str, int]  # collectives the redistribution ran


@dataclasses.dataclass
class UnevenResult:
    """``Shard(0)`` of a tensor with ``world_size + 1`` rows."""

    rows: int  # rows of this rank's local tensor
    expected: tuple[int, int]  # shard_rows(): this rank's row range by torch.chunk
    full_equal: bool  # full_tensor() equals the original tensor


@dataclasses.dataclass
class UnevenFromLocalResult:
    """:func:`uneven_from_local_demo` on one rank: ``from_local`` of uneven row shards, and ``view(-1)``."""

    rank: int  # this rank
    local_rows: int  # rows of this rank's shard of the (world_size + 1)-row tensor
    shape_without: tuple[int, ...]  # global shape from_local computed without shape=/stride= (local rows x ws)
    shape_with: tuple[int, ...]  # global shape with shape= and stride= passed
    with_full_equal: bool  # full_tensor() of the DTensor built with shape= rebuilt the tensor
    even_view: str  # placements of view(-1) of an evenly row-sharded DTensor
    even_view_full_equal: bool  # that flat DTensor's full_tensor() is the flattened tensor
    uneven_view_error: str | None  # what view(-1) of the uneven DTensor raised (None: it did not raise)


@dataclasses.dataclass
class ScatterDispatchResult:
    """:func:`scatter_dispatch_demo` on one rank: which ops of ``distribute_tensor``'s scatter reach a subclass."""

    rank: int  # this rank
    scatter_schema: str  # c10d.scatter_'s schema: outputs Tensor[], inputs Tensor[][]
    distribute_ops: list[str]  # ops that reached ProbeTensor's __torch_dispatch__ in distribute_tensor(probe)
    distribute_local_equal: bool  # the scattered local shard holds this rank's rows
    plain_output_ops: list[str]  # ops that reached it in scatter(plain output, [probes]): none
    plain_output_equal: bool  # that scatter still delivered the rows (gloo read the probes' storage)
    quantized_empty_like: str  # type of torch.empty_like(Float8Tensor): what _shard_tensor's output would be


@dataclasses.dataclass
class PlacementsResult:
    """:func:`placements_demo` on one rank."""

    rank: int  # this rank
    global_tensor: torch.Tensor  # the tensor every placement distributes
    shard0: LocalShard  # its local piece under Shard(0)
    shard1: LocalShard  # ... under Shard(1)
    replicate: LocalShard  # ... under Replicate()
    partial: PartialResult  # a Partial(sum) DTensor and its reduction
    uneven: UnevenResult  # Shard(0) of a tensor whose rows do not divide evenly


@dataclasses.dataclass
class Redistribution:
    """One ``redistribute`` from placement ``src`` to ``dst``."""

    src: str  # e.g. "S(0)", "P(sum)"
    dst: str  # the target placement, same notation
    comms: dict[str, int]  # collectives it ran
    local_shape: tuple[int, ...]  # this rank's local shape afterwards
    max_err: float  # max |full_tensor() - x|


@dataclasses.dataclass
class RedistributeResult:
    """:func:`redistribute_demo` on one rank."""

    rank: int  # this rank
    rows: list[Redistribution]  # one per (src, dst) pair tried


@dataclasses.dataclass
class DispatchStep:
    """One op on a DTensor of Float8Tensor shards, traced through both dispatch layers."""

    op: str  # the expression, e.g. "dt.t()"
    result: str  # type of the result (with placements for a DTensor)
    local: str  # type of the result's local tensor
    quantized_layer_saw: list[str]  # aten ops that reached QuantizedTensor.__torch_dispatch__
    fallbacks: list[str]  # ops counted as dequantizing fallbacks
    comms: dict[str, int]  # collectives it ran


@dataclasses.dataclass
class QuantizedDTensorResult:
    """:func:`quantized_dtensor_demo` on one rank."""

    rank: int  # this rank
    local_type: str  # class of the DTensor's local tensor
    scale_inv: torch.Tensor  # this rank's shard scale (the same on every rank: amax all-reduced)
    steps: list[DispatchStep]  # each op, traced through DTensor and QuantizedTensor dispatch
    full: torch.Tensor  # dt.full_tensor()
    full_equals_reference: bool  # == quantize-dequantize of the whole tensor in one process


@dataclasses.dataclass
class InitPitfallResult:
    """:func:`init_pitfall_demo` on one rank: ``blocks[0].fc1.weight`` initialised three ways."""

    rank: int  # the rank that returned this result
    naive_local: torch.Tensor  # this rank's shard after manual_seed + nn.init
    naive_full: torch.Tensor  # the gathered naive weight
    fixed_full: torch.Tensor  # the gathered weight after counter-based init
    reference: torch.Tensor  # the single-process model's weight, same seed
    all_params_equal_reference: bool  # every counter-initialised parameter equals the reference
    naive_single: torch.Tensor  # the naive recipe (manual_seed + nn.init) run on the unsharded model, same seed


# ----------------------------------------------------------------------------- helpers


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    """``{collective name: count}`` recorded by a CommDebugMode (names without the op namespace)."""
    return {str(k).split(".")[-1]: int(v) for k, v in mode.get_comm_counts().items()}


@contextlib.contextmanager
def record_quantized_dispatch() -> Iterator[list[str]]:
    """Log every op that reaches ``QuantizedTensor.__torch_dispatch__`` (after DTensor did its part)."""
    seen: list[str] = []
    original = QuantizedTensor.__dict__["__torch_dispatch__"]

    def logged(cls, func, types, args=(), kwargs=None):
        seen.append(str(func))
        return original.__func__(cls, func, types, args, kwargs)

    QuantizedTensor.__torch_dispatch__ = classmethod(logged)
    try:
        yield seen
    finally:
        QuantizedTensor.__torch_dispatch__ = original


class ProbeTensor(torch.Tensor):
    """A tensor subclass WITH storage (it aliases ``inner``) that appends the name of every op reaching its
    ``__torch_dispatch__`` to ``log``, then runs the op on the plain tensors and wraps tensor results."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # ops go straight to dispatch

    @staticmethod
    def __new__(cls, inner: torch.Tensor, log: list[str]):
        t = torch.Tensor._make_subclass(cls, inner)
        t.inner, t.log = inner, log
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        log = next(t.log for t in tree_leaves((args, kwargs)) if isinstance(t, cls))
        log.append(str(func))
        args, kwargs = tree_map_only(cls, lambda t: t.inner, (args, kwargs or {}))
        return tree_map_only(torch.Tensor, lambda t: cls(t, log), func(*args, **kwargs))


# ----------------------------------------------------------------------------- rank functions


def placements_demo(rows: int = 4, cols: int = 6) -> PlacementsResult:
    """The same global tensor under Shard(0), Shard(1), Replicate and Partial; plus an uneven Shard(0)."""
    mesh, dev = world_mesh()
    rank, ws = dist.get_rank(), dist.get_world_size()
    x = torch.arange(rows * cols, dtype=torch.float32, device=dev).reshape(rows, cols)
    shards = []
    for pl in (Shard(0), Shard(1), Replicate()):
        dt = distribute_tensor(x, mesh, [pl])
        shards.append(LocalShard(str(pl), dt.to_local(), bool(torch.equal(dt.full_tensor(), x))))
    # Partial: each rank holds a summand; the global value is their sum (a pending all-reduce).
    part = DTensor.from_local(x * (rank + 1), mesh, [Partial()], run_check=False)
    with CommDebugMode() as comm:
        rep = part.redistribute(mesh, [Replicate()])
    partial = PartialResult(part.to_local(), rep.to_local(), x * ws * (ws + 1) / 2, comm_counts(comm))
    # Uneven: dim 0 not divisible by the world size -> torch.chunk sizes (the last ranks get fewer rows).
    odd = torch.arange((ws + 1) * cols, dtype=torch.float32, device=dev).reshape(ws + 1, cols)
    dt = distribute_tensor(odd, mesh, [Shard(0)])
    uneven = UnevenResult(dt.to_local().shape[0], shard_rows(ws + 1, ws, rank),
                          bool(torch.equal(dt.full_tensor(), odd)))
    return PlacementsResult(rank, x, shard0=shards[0], shard1=shards[1], replicate=shards[2], partial=partial,
                            uneven=uneven)


def uneven_from_local_demo(cols: int = 4) -> UnevenFromLocalResult:
    """``DTensor.from_local`` of uneven row shards with and without ``shape=``; ``view(-1)`` even vs uneven."""
    mesh, dev = world_mesh()
    rank, ws = dist.get_rank(), dist.get_world_size()
    odd = torch.arange((ws + 1) * cols, dtype=torch.float32, device=dev).reshape(ws + 1, cols)
    start, stop = shard_rows(ws + 1, ws, rank)
    guessed = DTensor.from_local(odd[start:stop], mesh, [Shard(0)])  # shape: local rows x ws, per rank
    told = DTensor.from_local(odd[start:stop], mesh, [Shard(0)], shape=odd.shape, stride=odd.stride())
    even = torch.arange(2 * ws * cols, dtype=torch.float32, device=dev).reshape(2 * ws, cols)
    flat = distribute_tensor(even, mesh, [Shard(0)]).view(-1)
    try:
        told.view(-1)
        error = None
    except RuntimeError as exc:  # DTensor's sharding propagation refuses to flatten uneven shards
        error = str(exc)
    return UnevenFromLocalResult(rank, stop - start, tuple(guessed.shape), tuple(told.shape),
                                 bool(torch.equal(told.full_tensor(), odd)), str(list(flat.placements)),
                                 bool(torch.equal(flat.full_tensor(), even.view(-1))), error)


def scatter_dispatch_demo(rows: int = 2, cols: int = 3) -> ScatterDispatchResult:
    """``distribute_tensor`` of a :class:`ProbeTensor`, and a scatter whose only subclass tensors are its inputs."""
    mesh, dev = world_mesh()
    rank, ws = dist.get_rank(), dist.get_world_size()
    x = torch.arange(ws * rows * cols, dtype=torch.float32, device=dev).reshape(ws * rows, cols)
    mine = x[rank * rows:(rank + 1) * rows]
    seen: list[str] = []
    local = distribute_tensor(ProbeTensor(x.clone(), seen), mesh, [Shard(0)]).to_local()
    plain_seen: list[str] = []
    out = torch.empty(rows, cols, device=dev)  # a PLAIN output, as torch.empty_like makes for a Float8Tensor
    probes = [ProbeTensor(c.clone(), plain_seen) for c in x.chunk(ws)] if rank == 0 else None
    dist.scatter(out, probes, src=0, group=mesh.get_group())
    q = CurrentScaling("e4m3").quantize(x)
    return ScatterDispatchResult(rank, str(torch.ops.c10d.scatter_.default._schema), seen,
                                 bool(torch.equal(local.inner, mine)), plain_seen, bool(torch.equal(out, mine)),
                                 type(torch.empty_like(q)).__name__)


def redistribute_demo(rows: int = 8, cols: int = 8) -> RedistributeResult:
    """Which collective each redistribution runs (CommDebugMode), and that the values survive."""
    mesh, dev = world_mesh()
    x = counter_uniform(0, "redistribute", (rows, cols), device=dev)
    dt = distribute_tensor(x, mesh, [Shard(0)])
    moves = []
    for src, dst in ((Shard(0), Shard(1)), (Shard(0), Replicate()), (Replicate(), Shard(0)), (Partial(), Replicate())):
        start = DTensor.from_local(x / dist.get_world_size(), mesh, [src], run_check=False) if src == Partial() \
            else dt.redistribute(mesh, [src])
        with CommDebugMode() as comm:
            moved = start.redistribute(mesh, [dst])
        moves.append(Redistribution(str(src), str(dst), comm_counts(comm), tuple(moved.to_local().shape),
                                    float((moved.full_tensor() - x).abs().max())))
    return RedistributeResult(dist.get_rank(), moves)


def quantized_dtensor_demo(rows: int = 8, cols: int = 16) -> QuantizedDTensorResult:
    """A DTensor whose local shards are Float8Tensors sharing one scale (amax all-reduced).

    ``rows`` must divide by the world size: ``dt.view(-1)`` of uneven row shards raises
    (:func:`uneven_from_local_demo`)."""
    mesh, dev = world_mesh()
    rank, ws = dist.get_rank(), dist.get_world_size()
    hp = counter_uniform(1, "w", (rows, cols), device=dev)  # every rank can make the same global tensor
    start, stop = shard_rows(rows, ws, rank)
    q_local = CurrentScaling("e4m3", group=mesh.get_group()).quantize(hp[start:stop])  # one scale for all shards
    dt = DTensor.from_local(q_local, mesh, [Shard(0)], run_check=False, shape=hp.shape, stride=hp.stride())
    reference = CurrentScaling("e4m3").quantize(hp).dequantize()  # single process, whole tensor
    steps = {
        "dt.t()": lambda: dt.t(),
        "dt.view(-1)": lambda: dt.view(-1),
        "dt * 2": lambda: dt * 2,
        "dt.full_tensor()": lambda: dt.full_tensor(),
    }
    traced, full = [], None
    with fallback_mode("allow"):
        for name, fn in steps.items():
            before = FALLBACKS.copy()
            with record_quantized_dispatch() as seen, CommDebugMode() as comm:
                res = fn()
            local = res.to_local() if isinstance(res, DTensor) else res
            traced.append(DispatchStep(
                op=name,
                result=type(res).__name__ + (f"{list(res.placements)}" if isinstance(res, DTensor) else ""),
                local=type(local).__name__,
                quantized_layer_saw=sorted(set(seen)),
                fallbacks=sorted((FALLBACKS - before).keys()),
                comms=comm_counts(comm),
            ))
            if name == "dt.full_tensor()":
                full = res
    return QuantizedDTensorResult(rank, type(dt.to_local()).__name__, q_local.scale_inv.clone(), traced, full,
                                  bool(torch.equal(full, reference)))


def init_pitfall_demo(dim: int = 8, hidden: int = 6, seed: int = 0) -> InitPitfallResult:
    """Meta init + fully_shard + per-rank init: the naive way (identical shards) and the counter-based way."""
    mesh, dev = world_mesh()
    with torch.device("meta"):
        model = BlockMLP(dim, hidden, 1, seed=seed)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=dev)  # uninitialised local shards

    def fc1():
        return model.blocks[0].fc1.weight

    naive_reset_parameters(model, seed)  # manual_seed(seed) then nn.init on the LOCAL shard, every rank
    naive_local, naive_full = fc1().to_local().clone(), fc1().full_tensor()
    model.reset_parameters()  # counter-based: rows of my shard, keyed by (seed, name, index)
    fixed_full = fc1().full_tensor()
    ref = BlockMLP(dim, hidden, 1, seed=seed).to(dev)  # the single-process model with the same seed
    all_equal = all(torch.equal(p.full_tensor(), r.detach()) for p, r in zip(model.parameters(), ref.parameters()))
    single = BlockMLP(dim, hidden, 1, seed=seed).to(dev)
    naive_reset_parameters(single, seed)  # the naive recipe in one process: what the script meant to build
    return InitPitfallResult(dist.get_rank(), naive_local, naive_full, fixed_full,
                             ref.blocks[0].fc1.weight.detach(), all_equal, single.blocks[0].fc1.weight.detach())
