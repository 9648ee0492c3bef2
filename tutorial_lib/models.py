"""Small models whose initialisation does not depend on how their parameters are sharded.

The identical-shards pitfall. A model built on the meta device and sharded by FSDP2 is
initialised *after* sharding, one local shard per rank. The obvious code::

    torch.manual_seed(0)                       # every rank, same seed
    nn.init.uniform_(param.to_local(), -b, b)  # every rank draws the SAME numbers
                                               # -> rank 0's rows == rank 1's rows

gives every rank the same shard, so the sharded model equals no single-process model. On GPU,
DTensor's RNG tracker fixes this for DTensor ops; on a CPU mesh there is no tracker (torch 2.13:
lesson 05 shows the identical shards), and even on GPU its numbers differ from a plain ``nn.init``
of the full tensor.

The fix used here is a *counter-based* generator (the idea behind Philox and JAX's threefry):
element ``i`` of parameter ``name`` is a pure function of ``(seed, name, i)``::

    key  = crc32(f"{seed}:{name}")                 # one 32-bit key per parameter
    bits = mix32(mix32(lo32(i) + key) ^ (hi32(i) + key'))   # integer hash of the element index
    u    = ((bits >> 9) + 0.5) * 2**-23             # uniform in (0, 1), exact in fp32
    w[i] = low + (high - low) * u                   # computed in fp64, rounded once to the dtype

So a rank generates exactly the rows of its shard (``i`` runs over those rows only), nothing of
the full tensor is ever materialised, and the sharded model equals the single-process model
with the same seed **bit for bit**, on CPU and GPU alike (integer hashing and single IEEE
roundings, no transcendental functions). Uniform bounds follow ``nn.Linear``'s defaults.

Example::

    from tutorial_lib.models import BlockMLP, shard_rows, counter_uniform
    model = BlockMLP(dim=64, hidden=256, n_blocks=2, seed=0)   # built and initialised
    ref = BlockMLP(dim=64, hidden=256, n_blocks=2, seed=0)     # bit-identical to model
    with torch.device("meta"):
        big = BlockMLP(dim=4096, hidden=16384, n_blocks=8, seed=0)   # no memory, no init
    # ... fully_shard(big.blocks[i]); fully_shard(big); big.to_empty(device=dev); big.reset_parameters()
    start, stop = shard_rows(10, world_size=4, rank=3)        # (9, 10): FSDP2/DTensor Shard(0) rows
    w_rows = counter_uniform(0, "blocks.0.fc1.weight", (256, 64), rows=(0, 128), low=-0.125, high=0.125)

The quantized path (``tutorial_lib.dist.quantized_init``) uses :func:`counter_uniform` and
:func:`init_range` to generate each rank's rows in fp32 and quantize them, one parameter at a time.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from tutorial_lib.matmul.fp8_linear import Fp8Linear, Fp8Recipe
from tutorial_lib.quant.tensor import QuantizedTensor, is_quantized, local_tensor

__all__ = [
    "BlockMLP",
    "MLPBlock",
    "chunk_elems",
    "QLinear",
    "counter_uniform",
    "fill_param_",
    "init_range",
    "local_rows",
    "naive_reset_parameters",
    "quantized_linear",
    "reset_parameters_",
    "shard_rows",
]

_M32 = 0xFFFFFFFF


def chunk_elems(device) -> int:
    """Elements generated per step: bounds the generator's temporaries (a few tens of bytes per element
    generated), so a peak-memory measurement sees the model, not the generator."""
    return 1 << 20 if torch.device(device).type == "cuda" else 1 << 13


# ----------------------------------------------------------------------------- the counter-based generator


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x = (x * c) mod 2**32`` in place, for uint32 values held in int64 (no int64 overflow)."""
    hi = x * (c >> 16)
    hi &= 0xFFFF
    hi <<= 16
    x *= c & 0xFFFF
    x += hi
    x &= _M32
    return x


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (C. Wellons' "lowbias32"), in place."""
    x ^= x >> 16
    _mul32_(x, 0x7FEB352D)
    x ^= x >> 15
    _mul32_(x, 0x846CA68B)
    x ^= x >> 16
    return x


def _keys(seed: int, name: str) -> tuple[int, int]:
    key = zlib.crc32(f"{int(seed)}:{name}".encode())
    return key, zlib.crc32(f"{name}:{int(seed)}".encode()) ^ 0x9E3779B9


def counter_uniform(seed: int, name: str, shape, *, rows: tuple[int, int] | None = None, low: float = -1.0,
                    high: float = 1.0, dtype: torch.dtype = torch.float32, device=None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``rows = (start, stop)`` of a full tensor of ``shape`` filled with U(low, high) from ``(seed, name)``.

    The value of every element depends only on ``(seed, name, flat index)``: any row range of
    any sharding gives the same numbers as the full tensor. Writes into ``out`` if given (contiguous,
    floating point, shape ``[stop - start, *shape[1:]]``), chunk by chunk, so the temporaries stay small.
    """
    shape = tuple(int(s) for s in shape)
    if not shape:
        shape_rows, row_numel = 1, 1
    else:
        shape_rows, row_numel = shape[0], math.prod(shape[1:])
    start, stop = (0, shape_rows) if rows is None else (int(rows[0]), int(rows[1]))
    if not 0 <= start <= stop <= shape_rows:
        raise ValueError(f"rows {(start, stop)} outside the {shape_rows} rows of shape {list(shape)}")
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        raise ValueError(f"need finite low <= high, got ({low}, {high})")
    local_shape = (stop - start, *shape[1:]) if shape else ()
    if out is None:
        out = torch.empty(local_shape, dtype=dtype, device=device)
    elif tuple(out.shape) != local_shape:
        raise ValueError(f"out has shape {list(out.shape)}; rows {(start, stop)} of {list(shape)} need "
                         f"{list(local_shape)}")
    if not (out.is_floating_point() and out.is_contiguous()):
        raise ValueError(f"out must be a contiguous floating-point tensor, got {out.dtype} with strides "
                         f"{list(out.stride())}")
    if low == high:  # a constant (LayerNorm weight = 1, biases = 0): no randomness involved
        return out.fill_(low)
    k1, k2 = _keys(seed, name)
    flat = out.view(-1)
    first = start * row_numel
    step = chunk_elems(out.device)
    for c0 in range(0, flat.numel(), step):
        n = min(step, flat.numel() - c0)
        idx = torch.arange(first + c0, first + c0 + n, dtype=torch.int64, device=out.device)
        bits = idx & _M32  # low 32 bits of the element index ...
        bits += k1
        _mix32_(bits.bitwise_and_(_M32))
        idx >>= 32  # ... then the high 32 bits (in place: few temporaries, see chunk_elems)
        idx += k2
        bits ^= idx.bitwise_and_(_M32)
        del idx
        _mix32_(bits)
        bits >>= 9
        u = bits.to(torch.float64)
        del bits
        u += 0.5
        u *= 2.0**-23  # exact: a 23-bit integer + 1/2, times a power of two
        u *= high - low
        u += low  # fp64 arithmetic, then ONE rounding to the dtype in copy_
        flat[c0 : c0 + n].copy_(u)
    return out


# ----------------------------------------------------------------------------- which rows a rank holds


def shard_rows(n_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of dim 0 that ``rank`` holds under ``Shard(0)`` (FSDP2 and DTensor).

    ``torch.chunk`` semantics: chunks of ``ceil(n / world_size)`` rows; the last ranks get fewer
    rows, possibly none (``n = 10, world_size = 4`` -> 3, 3, 3, 1; ``n = 1`` -> 1, 0).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    chunk = -(-n_rows // world_size) if n_rows else 0
    start = min(rank * chunk, n_rows)
    return start, min(start + chunk, n_rows)


def local_rows(param: torch.Tensor) -> tuple[int, int]:
    """Global rows held locally by a plain tensor (all) or a DTensor on a 1-D mesh (Shard(0) or Replicate)."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()  # noqa: N806
    n = param.shape[0] if param.dim() else 1
    if not isinstance(param, DTensor):
        return 0, n
    mesh, placements = param.device_mesh, param.placements
    if mesh.ndim != 1 or len(placements) != 1:
        raise NotImplementedError(f"counter-based init supports 1-D meshes, got mesh shape {tuple(mesh.shape)}")
    (pl,) = placements
    if isinstance(pl, Replicate):
        return 0, n
    if not (isinstance(pl, Shard) and pl.dim == 0):
        raise NotImplementedError(f"counter-based init supports Shard(0) and Replicate placements, got {pl}")
    start, stop = shard_rows(n, mesh.size(), mesh.get_local_rank())
    got = param._local_tensor.shape[0] if param.dim() else 1
    if got != stop - start:
        raise RuntimeError(f"local shard has {got} rows, Shard(0) of {n} rows over {mesh.size()} ranks gives "
                           f"{stop - start}: a sharding this module does not know about")
    return start, stop


# ----------------------------------------------------------------------------- init ranges and fills


def init_range(module: nn.Module, param_name: str) -> tuple[float, float]:
    """``(low, high)`` of the uniform init of ``module.<param_name>``: nn.Linear / nn.LayerNorm / nn.RMSNorm
    defaults; nn.Embedding U(-sqrt(3), sqrt(3)) (unit variance like its default N(0, 1); a counter-based
    generator draws uniforms)."""
    if isinstance(module, nn.Linear):
        bound = 1.0 / math.sqrt(module.in_features)  # kaiming_uniform(a=sqrt(5)) == U(+-1/sqrt(fan_in))
        if param_name in ("weight", "bias"):
            return -bound, bound
    if isinstance(module, nn.LayerNorm):
        return {"weight": (1.0, 1.0), "bias": (0.0, 0.0)}[param_name]
    if isinstance(module, nn.RMSNorm) and param_name == "weight":
        return 1.0, 1.0
    if isinstance(module, nn.Embedding) and param_name == "weight":
        return -math.sqrt(3.0), math.sqrt(3.0)  # unit variance, as nn.Embedding's N(0, 1)
    raise TypeError(f"no init rule for {type(module).__name__}.{param_name}; add one to init_range")


@torch.no_grad()
def fill_param_(module: nn.Module, param_name: str, fqn: str, seed: int) -> None:
    """Initialise ``module.<param_name>`` in place: only the local rows of a DTensor, all of a plain tensor."""
    p = getattr(module, param_name)
    local = local_tensor(p)
    if local.is_meta:
        raise RuntimeError(f"{fqn} is on the meta device: materialise it first (module.to_empty(device=...))")
    if isinstance(local, QuantizedTensor):
        raise TypeError(f"{fqn} is quantized: initialise it with tutorial_lib.dist.quantized_init.materialize_sharded_")
    low, high = init_range(module, param_name)
    if local.is_contiguous():  # stream straight into the shard: no full-size temporary
        counter_uniform(seed, fqn, p.shape, rows=local_rows(p), low=low, high=high, out=local)
    else:
        local.copy_(counter_uniform(seed, fqn, p.shape, rows=local_rows(p), low=low, high=high, dtype=local.dtype,
                                    device=local.device))


def _named_leaf_params(model: nn.Module):
    for mod_name, mod in model.named_modules():
        for p_name, _ in mod.named_parameters(recurse=False):
            yield mod, p_name, f"{mod_name}.{p_name}" if mod_name else p_name


def reset_parameters_(model: nn.Module, seed: int) -> None:
    """Counter-based init of every parameter of ``model``, keyed by its name relative to ``model``."""
    for mod, p_name, fqn in _named_leaf_params(model):
        fill_param_(mod, p_name, fqn, seed)


@torch.no_grad()
def naive_reset_parameters(model: nn.Module, seed: int) -> None:
    """THE PITFALL (lesson 05): seed the global RNG, then ``nn.init`` each LOCAL tensor.

    Every rank draws the same sequence, so every rank's shard holds the same numbers; it also
    depends on the shard shape, so no single-process model with this seed matches it.
    """
    torch.manual_seed(seed)
    for mod, p_name, _ in _named_leaf_params(model):
        low, high = init_range(mod, p_name)
        nn.init.uniform_(local_tensor(getattr(mod, p_name)), low, high)


# ----------------------------------------------------------------------------- dequantize-on-use linear


class _QuantizedLinearFn(torch.autograd.Function):
    """``y = x @ dequantize(W).T + b``; saves the QUANTIZED weight (its codes and scales) for backward."""

    @staticmethod
    def forward(ctx, x, w, b):
        w_hp = w.dequantize(x.dtype)
        ctx.save_for_backward(x, w)  # the unsharded FSDP2 param itself: its version counter is checked
        ctx.has_bias = b is not None
        return F.linear(x, w_hp, b)

    @staticmethod
    def backward(ctx, grad_out):
        x, w = ctx.saved_tensors
        grad_x = grad_out @ w.dequantize(grad_out.dtype)
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_w = (g2.t() @ x.reshape(-1, x.shape[-1])).to(w.dtype)  # gradient w.r.t. the nominal weight
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that dequantizes a quantized weight on use (CPU emulation of an FP8 GEMM)."""
    if is_quantized(weight):
        return _QuantizedLinearFn.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class QLinear(nn.Linear):
    """``nn.Linear`` whose weight may be a quantized tensor (dequantized on use, gradient in the nominal dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, self.weight, self.bias)


# ----------------------------------------------------------------------------- the models


class _SeededModule(nn.Module):
    """A root module that knows its init seed: ``reset_parameters()`` re-runs the counter-based init."""

    def __init__(self, seed: int):
        super().__init__()
        self.init_seed = int(seed)

    def _init_if_materialised(self) -> None:
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_parameters_(self, self.init_seed)


def _linear(in_features: int, out_features: int, bias: bool, dtype, fp8: Fp8Recipe | str | None) -> nn.Linear:
    """``QLinear`` (dequantize-on-use, the default) or, with an FP8 recipe, an ``Fp8Linear`` (FP8 GEMMs)."""
    if fp8 is None:
        return QLinear(in_features, out_features, bias=bias, dtype=dtype)
    return Fp8Linear(in_features, out_features, bias=bias, dtype=dtype, recipe=fp8)


class MLPBlock(nn.Module):
    """Pre-norm residual MLP block: ``x + fc2(gelu(fc1(norm(x))))`` (the unit FSDP2 shards).

    ``fp8`` (None, "hybrid", "blockwise" or a ``tutorial_lib.matmul.fp8_linear.Fp8Recipe``): None keeps
    the dequantize-on-use ``QLinear``; a recipe makes ``fc1``/``fc2`` ``Fp8Linear`` s (same parameters)."""

    def __init__(self, dim: int, hidden: int, bias: bool = True, dtype: torch.dtype | None = None,
                 fp8: Fp8Recipe | str | None = None):
        super().__init__()
        self.norm = nn.LayerNorm(dim, dtype=dtype)
        self.fc1 = _linear(dim, hidden, bias, dtype, fp8)
        self.fc2 = _linear(hidden, dim, bias, dtype, fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class BlockMLP(_SeededModule):
    """``n_blocks`` :class:`MLPBlock` s and a final LayerNorm; initialised from ``seed`` unless on meta.

    Parameter names (the init keys): ``blocks.<i>.{norm,fc1,fc2}.{weight,bias}``, ``norm_out.*``.
    ``fp8=None`` (default): dequantize-on-use linears; ``fp8="hybrid"`` / ``"blockwise"`` / an
    ``Fp8Recipe``: FP8-GEMM linears (lesson 09), same parameters and init.
    """

    def __init__(self, dim: int = 64, hidden: int = 256, n_blocks: int = 2, *, seed: int = 0, bias: bool = True,
                 dtype: torch.dtype | None = None, fp8: Fp8Recipe | str | None = None):
        super().__init__(seed)
        self.dim, self.hidden = dim, hidden
        self.blocks = nn.ModuleList(MLPBlock(dim, hidden, bias, dtype, fp8) for _ in range(n_blocks))
        self.norm_out = nn.LayerNorm(dim, dtype=dtype)
        self._init_if_materialised()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm_out(x)
