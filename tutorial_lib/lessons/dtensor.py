"""Rank functions for lesson 05 (DTensor): placements, redistribution, quantized locals, seeded init.

A DTensor is a *global* tensor described by a device mesh and one placement per mesh dim;
each rank holds a *local* tensor::

    global x [4, 6]        Shard(0)            Shard(1)            Replicate()      Partial()
                           rank 0: rows 0-1    rank 0: cols 0-2    rank 0: all      rank 0: x0
                           rank 1: rows 2-3    rank 1: cols 3-5    rank 1: all      rank 1: x1   (x = x0 + x1)

Every op on a DTensor first runs DTensor's ``__torch_dispatch__`` (sharding propagation: which
placements the output has, which collectives the inputs need), then the op on the LOCAL
tensors. When a local tensor is a :class:`~tutorial_lib.quant.tensor.QuantizedTensor`, that
second step lands in *its* ``__torch_dispatch__``: views stay quantized, anything else
(including the functional all-gather inside ``full_tensor()``) falls back to dequantizing::

    dt.t()  ->  DTensor: Shard(0) -> Shard(1)  ->  Float8Tensor: aten.t handler (still FP8)
    dt * 2  ->  DTensor: same placements       ->  Float8Tensor: fallback (plain result)

Each function here runs on every rank (``tutorial_lib.dist.launcher.launch``) and returns plain
values for the notebook to print, plot and check.

Example::

    from tutorial_lib.dist.launcher import launch
    from tutorial_lib.lessons.dtensor import placements_demo, init_pitfall_demo
    res = launch(placements_demo, world_size=2, device="cpu", args=(4, 6))
    res[1]["Shard(0)"]["local"]          # rows 2-3 of the global tensor
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

from tutorial_lib.dist.fsdp2 import rank_setup, record_quantized_dispatch
from tutorial_lib.dist.launcher import rank_device
from tutorial_lib.models import BlockMLP, counter_uniform, naive_reset_parameters, shard_rows
from tutorial_lib.quant.tensor import FALLBACKS, fallback_mode
from tutorial_lib.quant.per_tensor import CurrentScaling

__all__ = [
    "comm_counts",
    "init_pitfall_demo",
    "placements_demo",
    "quantized_dtensor_demo",
    "record_quantized_dispatch",
    "redistribute_demo",
]


def _mesh():
    return rank_setup()[0]


def comm_counts(mode: CommDebugMode) -> dict[str, int]:
    """``{collective name: count}`` recorded by a CommDebugMode (names without the op namespace)."""
    return {str(k).split(".")[-1]: int(v) for k, v in mode.get_comm_counts().items()}


def placements_demo(rows: int = 4, cols: int = 6) -> dict:
    """The same global tensor under Shard(0), Shard(1), Replicate and Partial; plus an uneven Shard(0)."""
    mesh, rank, ws = _mesh(), dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    x = torch.arange(rows * cols, dtype=torch.float32, device=dev).reshape(rows, cols)
    out = {"rank": rank, "global": x}
    for pl in (Shard(0), Shard(1), Replicate()):
        dt = distribute_tensor(x, mesh, [pl])
        out[str(pl)] = {"local": dt.to_local(), "full_equal": bool(torch.equal(dt.full_tensor(), x))}
    # Partial: each rank holds a summand; the global value is their sum (a pending all-reduce).
    part = DTensor.from_local(x * (rank + 1), mesh, [Partial()], run_check=False)
    with CommDebugMode() as comm:
        rep = part.redistribute(mesh, [Replicate()])
    out["Partial()"] = {"local": part.to_local(), "reduced": rep.to_local(), "comms": comm_counts(comm),
                        "expected": x * ws * (ws + 1) / 2}
    # Uneven: dim 0 not divisible by the world size -> torch.chunk sizes (the last ranks get fewer rows).
    odd = torch.arange((ws + 1) * cols, dtype=torch.float32, device=dev).reshape(ws + 1, cols)
    dt = distribute_tensor(odd, mesh, [Shard(0)])
    out["uneven"] = {"rows": tuple(dt.to_local().shape)[0], "expected": shard_rows(ws + 1, ws, rank),
                     "full_equal": bool(torch.equal(dt.full_tensor(), odd))}
    return out


def redistribute_demo(rows: int = 8, cols: int = 8) -> dict:
    """Which collective each redistribution runs (CommDebugMode), and that the values survive."""
    mesh = _mesh()
    x = counter_uniform(0, "redistribute", (rows, cols), device=rank_device())
    dt = distribute_tensor(x, mesh, [Shard(0)])
    rows_out = []
    for src, dst in ((Shard(0), Shard(1)), (Shard(0), Replicate()), (Replicate(), Shard(0)), (Partial(), Replicate())):
        start = DTensor.from_local(x / dist.get_world_size(), mesh, [src], run_check=False) if src == Partial() \
            else dt.redistribute(mesh, [src])
        with CommDebugMode() as comm:
            moved = start.redistribute(mesh, [dst])
        rows_out.append({"from": str(src), "to": str(dst), "comms": comm_counts(comm),
                         "local_shape": tuple(moved.to_local().shape),
                         "max_err": float((moved.full_tensor() - x).abs().max())})
    return {"rank": dist.get_rank(), "rows": rows_out}


def quantized_dtensor_demo(rows: int = 8, cols: int = 16) -> dict:
    """A DTensor whose local shards are Float8Tensors sharing one scale (amax all-reduced)."""
    mesh, rank, ws = _mesh(), dist.get_rank(), dist.get_world_size()
    dev = rank_device()
    hp = counter_uniform(1, "w", (rows, cols), device=dev)  # every rank can make the same global tensor
    start, stop = shard_rows(rows, ws, rank)
    q_local = CurrentScaling("e4m3", group=mesh.get_group()).quantize(hp[start:stop])  # one scale for all shards
    dt = DTensor.from_local(q_local, mesh, [Shard(0)], run_check=False, shape=hp.shape, stride=hp.stride())
    reference = CurrentScaling("e4m3").quantize(hp).dequantize()  # single process, whole tensor
    out = {"rank": rank, "local_type": type(dt.to_local()).__name__, "scale_inv": q_local.scale_inv.clone()}
    steps = {
        "dt.t()": lambda: dt.t(),
        "dt.view(-1)": lambda: dt.view(-1),
        "dt * 2": lambda: dt * 2,
        "dt.full_tensor()": lambda: dt.full_tensor(),
    }
    out["steps"] = []
    with fallback_mode("allow"):
        for name, fn in steps.items():
            before = FALLBACKS.copy()
            with record_quantized_dispatch() as seen, CommDebugMode() as comm:
                res = fn()
            local = res.to_local() if isinstance(res, DTensor) else res
            out["steps"].append({
                "op": name,
                "result": type(res).__name__ + (f"{list(res.placements)}" if isinstance(res, DTensor) else ""),
                "local": type(local).__name__,
                "quantized_layer_saw": sorted(set(seen)),
                "fallbacks": sorted((FALLBACKS - before).keys()),
                "comms": comm_counts(comm),
            })
            if name == "dt.full_tensor()":
                out["full"] = res
    out["full_equals_reference"] = bool(torch.equal(out["full"], reference))
    return out


def init_pitfall_demo(dim: int = 8, hidden: int = 6, seed: int = 0) -> dict:
    """Meta init + fully_shard + per-rank init: the naive way (identical shards) and the counter-based way."""
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh()
    dev = rank_device()
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
    ref_full = ref.blocks[0].fc1.weight.detach()
    all_equal = all(torch.equal(p.full_tensor(), r.detach()) for p, r in zip(model.parameters(), ref.parameters()))
    return {"rank": dist.get_rank(), "naive_local": naive_local, "naive_full": naive_full, "fixed_full": fixed_full,
            "reference": ref_full, "all_params_equal_reference": all_equal}
