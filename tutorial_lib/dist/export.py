"""Export a sharded, quantized model as ONE full-precision safetensors file (for inference/other tools).

A training checkpoint (DCP) is sharded, holds FP8 bytes + scales, optimizer state and quantizer
state, and needs this code to load. An *export* is what other tools read: one file, plain fp32
tensors, the model's own parameter names and full shapes::

    per parameter                         value exported (fp32)                 gathered how
    ─────────────                         ────────────────────                  ────────────
    optimizer keeps a master weight       the fp32 master (the best value)      DTensor.full_tensor()
    quantized, no master                  dequantize(local shard)               of the PLAIN fp32 shard
    plain (fp32 / bf16)                   the value, upcast to fp32
    _extra_state, non-tensor entries      excluded (quantizer state means nothing outside training)

Two details that bite: ``full_tensor()`` is called on a DTensor built from the *plain* fp32 shard
(the quantized DTensor's own ``full_tensor()`` all-gathers the quantized local tensor, an op with
no quantized handler: it runs through the dequantize fallback -- a warning, or
``QuantizedFallbackError`` under ``strict_dispatch()``); and every rank must take part in every
gather, so the loop runs on all ranks and only rank 0 writes (and keeps the gathered values: the other
ranks drop each one as soon as its gather is done).

Example::

    from tutorial_lib.dist.export import export_fp32_safetensors, exported_values
    from tutorial_lib.models import BlockMLP
    from tutorial_lib.optim.fused_adam import FusedAdam
    model, path = BlockMLP(64, 256, 2, dtype=torch.bfloat16), "model.safetensors"
    opt = FusedAdam(model.parameters(), lr=1e-3, master_weights=True)
    opt.init_state()                                                 # or a first step(): creates the fp32 masters
    sources = export_fp32_safetensors(model, path, optimizer=opt)   # every rank; rank 0 writes
    sources["blocks.0.fc1.weight"]                                   # "master" (here) | "dequantized" | "fp32"
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

from tutorial_lib.quant.tensor import is_quantized, local_tensor

__all__ = ["EXTRA_STATE_SUFFIX", "export_fp32_safetensors", "exported_values", "fp32_values"]

EXTRA_STATE_SUFFIX = "_extra_state"


def _full(local_fp32: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The full tensor of a plain fp32 local shard laid out like ``like`` (a DTensor or plain tensor)."""
    if not isinstance(like, DTensor):
        return local_fp32
    d = DTensor.from_local(local_fp32, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                           stride=like.stride())
    return d.full_tensor()


def _master(optimizer, p):
    if optimizer is None:
        return None
    return optimizer.state.get(p, {}).get("master_param")


def fp32_values(model: nn.Module, optimizer=None, *, keep: bool = True) -> tuple[dict[str, torch.Tensor],
                                                                                 dict[str, str]]:
    """Full fp32 tensors by state-dict key and where each came from. Collective: call on every rank.

    ``keep=False``: this rank takes part in every gather but keeps no value (an empty dict; the sources all the
    same) -- one full tensor at a time on its device, none in its host memory: what the ranks that do not
    write an export pass."""
    params = dict(model.named_parameters())
    values, sources = {}, {}
    for key, value in model.state_dict().items():
        if key.endswith(EXTRA_STATE_SUFFIX) or not isinstance(value, torch.Tensor):
            continue  # quantizer/extra state: not part of the model's weights
        p = params.get(key, value)
        master = _master(optimizer, p)
        if master is not None:
            local, src = local_tensor(master).float(), "master"
        elif is_quantized(value):
            local, src = local_tensor(value).dequantize(torch.float32), "dequantized"
        elif value.is_floating_point():
            local, src = local_tensor(value).float(), "fp32"
        else:
            local, src = local_tensor(value), "as-is"  # integer buffers (counters): exported unchanged
        full = _full(local.detach().contiguous(), value)  # a collective: every rank, every key
        if keep:
            values[key] = full.cpu()
        sources[key] = src
    return values, sources


def export_fp32_safetensors(model: nn.Module, path: str | os.PathLike, optimizer=None,
                            metadata: dict[str, str] | None = None, process_group=None) -> dict[str, str]:
    """Write ``model``'s weights as one fp32 safetensors file (the first rank of ``process_group``, default
    the world, writes; every rank of the group must call).

    Returns ``{key: "master" | "dequantized" | "fp32" | "as-is"}`` on every rank.
    """
    distributed = dist.is_available() and dist.is_initialized()
    writer = not distributed or dist.get_rank(process_group) == 0
    values, sources = fp32_values(model, optimizer, keep=writer)  # only the writer holds the fp32 model on the host
    error = tmp = None
    if writer:
        try:
            meta = {"format": "pt", "exported_by": "tutorial_lib.dist.export", **(metadata or {})}
            tmp = f"{os.fspath(path)}.part{os.getpid()}"
            save_file(values, tmp, metadata=meta)
            os.replace(tmp, path)  # readers never see a half-written file
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            error = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(OSError, TypeError):  # TypeError: no tmp (a path that is not a path)
                os.remove(tmp)  # no half-written file left behind
    if distributed:  # every rank learns whether the write worked (a bare barrier would hang on failure)
        box = [error]
        dist.broadcast_object_list(box, group_src=0, group=process_group)
        error = box[0]
    if error is not None:
        raise RuntimeError(f"export to {path} failed on rank 0: {error}")
    return sources


def exported_values(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read an export back (plain tensors, no pickle involved)."""
    return load_file(os.fspath(path))
