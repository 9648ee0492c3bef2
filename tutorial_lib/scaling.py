"""Per-tensor FP8 scaling: the torch reference casts and the two quantizers.

FP8 has a tiny range (E4M3: +-448, smallest subnormal 2**-9), so a tensor is multiplied by a
``scale`` before the cast and the FP8 bytes are stored with ``scale_inv = 1 / scale``::

    x (bf16/fp16/fp32) --* scale--> saturating RNE cast --> data (uint8 FP8 bytes)
    x_hat = fp8(data) * scale_inv                       scale = fmt.max / amax(x)

* **current scaling**: ``amax`` of *this* tensor; always in range, but the tensor must be
  read twice (amax, then cast) -- or cast speculatively, see ``kernels/fp8_cast.py``.
* **delayed scaling**: the scale comes from a history of earlier amaxes (``max`` or
  ``most_recent``), the cast records this tensor's amax for the next steps: one pass, but a
  spike larger than the history saturates (the stale-scale pitfall, lesson 01).

This module is THE torch reference that the Triton kernels (``tutorial_kernels.fp8_cast``, same
function names and results, byte for byte), their tests, lesson 01 and the benchmark share.

Documented results for special input (all tested):

* dtypes other than float32/bfloat16/float16 -> ``TypeError``; fmt other than e4m3/e5m2 -> ``ValueError``.
* empty tensors: ``amax`` is 0 (the identity of a max of magnitudes); casts return empty data
  (FSDP2 shards can be empty on some ranks).
* zero tensors: ``amax_eps`` bounds the scale: ``scale = max / max(amax, amax_eps)``. ``amax_eps``
  must be > 0 and small enough that the scale stays a finite fp32 -> no scale overflow, ever.
* NaN / inf input: amax is NaN / inf (NaN wins over inf), and current scaling then sets
  ``scale = NaN`` so *every* element and ``scale_inv`` are NaN. A finite scale would hide the
  overflow (inf saturates to +-max). Delayed scaling casts with its (finite) scale -- inf
  saturates, NaN stays NaN -- records the non-finite amax, and keeps its previous scale.
* the cast saturates ("satfinite"): ``|x * scale| > max`` and +-inf give +-max; NaN stays NaN.
  The sign of a NaN that went through ``x * scale`` is platform-dependent (x86 keeps it, CUDA
  arithmetic returns a canonical positive NaN); both are NaN codes.

Example::

    from tutorial_lib.scaling import CurrentScaling, DelayedScaling, cast_current_scaling
    res = cast_current_scaling(w, "e4m3")          # CastResult(data, scale, scale_inv, amax)
    q = CurrentScaling("e4m3", pow2=True).quantize(w)   # a Float8Tensor
    dq = DelayedScaling("e4m3", history_len=16, algo="max")
    for step in range(3):
        q = dq.quantize(activation(step))           # uses the scale from earlier steps
"""

from __future__ import annotations

import copy
import struct
from collections.abc import Callable
from typing import NamedTuple

import torch

from tutorial_lib.formats import get_format

__all__ = [
    "SUPPORTED_DTYPES", "FP8_FORMATS", "CastResult", "amax", "scale_from_amax", "quantize_per_tensor",
    "dequantize_per_tensor", "cast_current_scaling", "cast_delayed_scaling", "check_input",
    "check_amax_eps", "all_reduce_amax", "CurrentScaling", "DelayedScaling", "fake_quantize_per_tensor",
    "synthetic_activations", "track_scaling",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_FORMATS = ("e4m3", "e5m2")
_ABS_MASK = 0x7FFFFFFF
_EXP_MASK = 0x7F800000
_FP32_MAX = 3.4028234663852886e38


class CastResult(NamedTuple):
    """What a per-tensor cast returns (fp32 0-d tensors besides ``data``)."""

    data: torch.Tensor  # uint8 FP8 bytes, same shape as the input
    scale: torch.Tensor  # the scale the bytes were made with
    scale_inv: torch.Tensor  # 1 / scale, stored next to the bytes
    amax: torch.Tensor  # amax of the input (for current scaling: after any group reduction)


# --------------------------------------------------------------------------- validation


def check_input(x: torch.Tensor, fmt: str = "e4m3") -> None:
    """Raise a clear error for inputs the FP8 casts do not accept."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"FP8 casts take {names} input, got {x.dtype}")
    if fmt not in FP8_FORMATS:
        raise ValueError(f"per-tensor FP8 format must be one of {FP8_FORMATS}, got {fmt!r}")


def check_amax_eps(amax_eps: float, fmt: str) -> None:
    """``amax_eps`` must be > 0 and keep ``max / amax_eps`` a finite fp32 (no scale overflow)."""
    fmax = get_format(fmt).max
    try:  # pure Python (no tensor, so torch.compile does not break the graph here)
        eps32 = struct.unpack("f", struct.pack("f", amax_eps))[0]  # the fp32 the kernels will see
    except (OverflowError, TypeError, struct.error):
        eps32 = float("nan")
    if not (0 < eps32 < float("inf")) or not (fmax / eps32 <= _FP32_MAX):
        raise ValueError(
            f"amax_eps={amax_eps!r} must be finite, > 0 and >= {fmax / 3.4e38:.3g} so that the largest scale "
            f"{fmt} max / amax_eps is a finite fp32"
        )


def _check_scale_arg(scale, device) -> torch.Tensor:
    """A Python scale is checked (finite, > 0); a tensor scale must be a single fp32 value."""
    if isinstance(scale, torch.Tensor):
        if scale.dtype != torch.float32 or scale.numel() != 1:
            raise TypeError(f"scale must be a single float32 value, got {scale.dtype} of shape {tuple(scale.shape)}")
        return scale.reshape(()).to(device)
    scale = float(scale)
    if not (scale > 0 and scale < float("inf")):
        raise ValueError(f"scale must be finite and > 0, got {scale!r}")
    t = torch.tensor(scale, dtype=torch.float32, device=device)
    if not torch.isfinite(t) or t == 0:
        raise ValueError(f"scale {scale!r} is not a finite, nonzero fp32")
    return t


# --------------------------------------------------------------------------- reference ops


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 0-d tensor: NaN if x holds NaN, inf if it holds inf, 0 if empty.

    Computed as an integer max over the fp32 bit patterns with the sign cleared: for
    non-negative floats integer order is float order and NaN > inf > finite, so NaN wins
    deterministically (the Triton kernel does the same with an atomic integer max)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    bits = x.float().view(torch.int32) & _ABS_MASK
    return bits.amax().view(torch.float32)


def scale_from_amax(amax: torch.Tensor, fmt: str = "e4m3", *, pow2: bool = False,
                    amax_eps: float = 1e-12, margin: int = 0) -> torch.Tensor:
    """``scale = fmt.max / max(amax, amax_eps) / 2**margin`` in fp32; NaN for a non-finite amax.

    ``pow2`` rounds the scale *down* to a power of two (so ``amax * scale <= max`` still holds
    and ``scale_inv`` is exact); taken from the exponent bits, not from ``log2``, which can
    round up near a power of two."""
    fmax = get_format(fmt).max
    a = amax.float()
    # tensor / tensor: one IEEE division. (`fmax / tensor` would be reciprocal() * fmax in torch,
    # two roundings, and differ from the kernel's correctly rounded division in ~25% of cases.)
    scale = torch.full_like(a, fmax) / torch.clamp_min(a, amax_eps)  # clamp_min keeps NaN
    if margin:
        scale = scale * 2.0 ** (-int(margin))  # exact power-of-two step
    if pow2:
        scale = (scale.view(torch.int32) & _EXP_MASK).view(torch.float32)
    return torch.where(a < float("inf"), scale, torch.full_like(scale, float("nan")))


def quantize_per_tensor(x: torch.Tensor, scale, fmt: str = "e4m3") -> torch.Tensor:
    """FP8 bytes (uint8, same shape, contiguous) of ``x * scale``: saturating RNE cast.

    The product is formed in fp32 (``x.float() * scale``), then clamped to +-max (so inf
    saturates and NaN stays NaN) and cast with torch's RNE cast."""
    check_input(x, fmt)
    spec = get_format(fmt)
    s = _check_scale_arg(scale, x.device)
    y = x.float() * s
    return y.clamp(-spec.max, spec.max).to(spec.torch_dtype).view(torch.uint8).contiguous()


def check_dequantize_args(data: torch.Tensor, fmt: str, dtype: torch.dtype) -> None:
    """The argument rules every per-tensor dequantize (reference and kernel) enforces."""
    if data.dtype != torch.uint8:
        raise TypeError(f"data must be uint8 FP8 bytes, got {data.dtype}")
    if fmt not in FP8_FORMATS:
        raise ValueError(f"per-tensor FP8 format must be one of {FP8_FORMATS}, got {fmt!r}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dequantize to one of {SUPPORTED_DTYPES}, got {dtype}")


def dequantize_per_tensor(data: torch.Tensor, scale_inv: torch.Tensor | float, fmt: str = "e4m3",
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fp8(data) * scale_inv`` computed in fp32, then rounded (RNE) to ``dtype``."""
    check_dequantize_args(data, fmt, dtype)
    values = data.view(get_format(fmt).torch_dtype).float()
    return (values * torch.as_tensor(scale_inv, dtype=torch.float32, device=data.device)).to(dtype)


def cast_current_scaling(x: torch.Tensor, fmt: str = "e4m3", *, pow2: bool = False, amax_eps: float = 1e-12,
                         reduce_amax: Callable[[torch.Tensor], None] | None = None,
                         scale_guess: torch.Tensor | None = None, out: torch.Tensor | None = None) -> CastResult:
    """Current scaling: amax of ``x`` -> scale -> saturating cast.

    ``reduce_amax(amax)`` (e.g. :func:`all_reduce_amax`) may update the amax in place between
    the amax and the cast, so every rank casts with one shared scale. ``scale_guess`` is a
    performance hint for the Triton kernel (one-pass speculative cast) and ignored here:
    results never depend on it. ``out`` (uint8, shape of ``x``) receives the bytes."""
    check_input(x, fmt)
    check_amax_eps(amax_eps, fmt)
    a = amax(x)
    if reduce_amax is not None:
        reduce_amax(a)
    scale = scale_from_amax(a, fmt, pow2=pow2, amax_eps=amax_eps)
    data = _into(out, quantize_per_tensor(x, scale, fmt))
    return CastResult(data, scale, scale.reciprocal(), a)


def cast_delayed_scaling(x: torch.Tensor, scale, fmt: str = "e4m3", *, out: torch.Tensor | None = None) -> CastResult:
    """Delayed scaling: cast with a given ``scale`` and record ``amax(x)`` for later steps."""
    check_input(x, fmt)
    s = _check_scale_arg(scale, x.device)
    return CastResult(_into(out, quantize_per_tensor(x, s, fmt)), s, s.reciprocal(), amax(x))


def _into(out: torch.Tensor | None, data: torch.Tensor) -> torch.Tensor:
    if out is None:
        return data
    if out.dtype != torch.uint8 or out.shape != data.shape:
        raise ValueError(f"out must be uint8 of shape {tuple(data.shape)}, got {out.dtype} {tuple(out.shape)}")
    return out.copy_(data)


def all_reduce_amax(a: torch.Tensor, group=None) -> None:
    """In-place MAX all-reduce of an fp32 amax over ``group``, NaN-propagating.

    Reduced as int32 bit patterns (non-negative floats order like their bits, NaN > inf),
    because a float MAX in NCCL/gloo may drop NaN depending on rank order."""
    import torch.distributed as dist

    dist.all_reduce(a.view(torch.int32), op=dist.ReduceOp.MAX, group=group)


# --------------------------------------------------------------------------- quantizers


def _backend(name: str, x: torch.Tensor):
    """The module with the cast functions: this one (torch) or the Triton kernels.

    ``auto`` picks Triton for contiguous CUDA tensors, torch otherwise (non-contiguous
    input, CPU where the kernels would run in the slow interpreter). Both give identical bytes."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {name!r}")
    if name == "torch" or (name == "auto" and not (x.is_cuda and x.is_contiguous())):
        import tutorial_lib.scaling as ref

        return ref
    import tutorial_kernels.fp8_cast as kernels

    return kernels


class _PerTensorQuantizer:
    """Shared plumbing: format checks, the optional process group, pickling and copying.

    A ``torch.distributed.ProcessGroup`` can be neither pickled nor deep-copied. Pickling
    (``torch.save``, DCP, sending to another process) drops it: the group means nothing in
    another process. The unpickled quantizer then *refuses* to quantize until
    :meth:`set_group` is called -- silently scaling per shard instead would give every rank a
    different scale. ``copy.deepcopy`` stays in this process and shares the group."""

    def __init__(self, fmt: str, group, backend: str):
        if fmt not in FP8_FORMATS:
            raise ValueError(f"per-tensor FP8 format must be one of {FP8_FORMATS}, got {fmt!r}")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        self.fmt = fmt
        self.group = group
        self.group_dropped = False
        self.backend = backend

    # -- process group handling
    def set_group(self, group) -> None:
        """(Re)attach the amax-reduction group (None: scale from the local tensor only)."""
        self.group = group
        self.group_dropped = False

    def __getstate__(self):
        state = self.__dict__.copy()
        if state.get("group") is not None:  # a ProcessGroup does not pickle
            state["group"] = None
            state["group_dropped"] = True
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __deepcopy__(self, memo):
        if self.group is not None:
            memo[id(self.group)] = self.group  # share the handle instead of copying it
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def _reduce(self):
        if self.group_dropped:
            raise RuntimeError(
                f"this {type(self).__name__} reduced its amax over a process group that was dropped when it "
                "was pickled; call .set_group(group) to restore it (or .set_group(None) to scale locally)"
            )
        if self.group is None:
            return None
        group = self.group
        return lambda a: all_reduce_amax(a, group)

    # -- building the quantized tensor
    def _make(self, x: torch.Tensor, res: CastResult):
        from tutorial_lib.float8_tensor import Float8Tensor  # lazy: float8_tensor imports this module

        return Float8Tensor.from_buffers({"data": res.data, "scale_inv": res.scale_inv}, {"fmt": self.fmt},
                                         x.shape, x.dtype, quantizer=self)

    def _check_dst(self, dst, x: torch.Tensor) -> dict:
        bufs = dst.raw_buffers()
        meta = dst.meta()
        if set(bufs) != {"data", "scale_inv"} or meta.get("fmt") not in FP8_FORMATS:
            raise TypeError(f"{type(self).__name__}.quantize_into needs a per-tensor FP8 tensor, "
                            f"got buffers {sorted(bufs)} and meta {meta}")
        if meta["fmt"] != self.fmt:
            raise ValueError(f"destination is {meta['fmt']}, this quantizer makes {self.fmt}")
        if tuple(dst.shape) != tuple(x.shape):
            raise ValueError(f"shape mismatch: destination {tuple(dst.shape)}, source {tuple(x.shape)}")
        return bufs

    @staticmethod
    def _out(bufs: dict, x: torch.Tensor):
        """Write straight into the destination's bytes when the layout allows, else copy after."""
        data = bufs["data"]
        return data if data.is_contiguous() and data.device == x.device else None

    @staticmethod
    def _write(bufs: dict, res: CastResult) -> None:
        if res.data.data_ptr() != bufs["data"].data_ptr():
            bufs["data"].copy_(res.data)
        bufs["scale_inv"].copy_(res.scale_inv)


class CurrentScaling(_PerTensorQuantizer):
    """Scale from this tensor's amax (all-reduced over ``group`` if given).

    Args: ``fmt`` e4m3/e5m2; ``pow2`` rounds the scale down to a power of two; ``amax_eps``
    bounds the scale of all-zero tensors; ``group`` a process group for the amax MAX
    all-reduce (every rank then uses one scale); ``backend`` auto/torch/triton."""

    def __init__(self, fmt: str = "e4m3", pow2: bool = False, amax_eps: float = 1e-12, group=None,
                 backend: str = "auto"):
        super().__init__(fmt, group, backend)
        check_amax_eps(amax_eps, fmt)
        self.pow2 = pow2
        self.amax_eps = amax_eps

    def __repr__(self):
        return (f"CurrentScaling(fmt={self.fmt!r}, pow2={self.pow2}, amax_eps={self.amax_eps:g}, "
                f"group={'dropped' if self.group_dropped else self.group})")

    def cast(self, x: torch.Tensor, *, out: torch.Tensor | None = None, scale_guess=None) -> CastResult:
        check_input(x, self.fmt)
        reduce = self._reduce()
        be = _backend(self.backend, x)
        return be.cast_current_scaling(x, self.fmt, pow2=self.pow2, amax_eps=self.amax_eps, reduce_amax=reduce,
                                       scale_guess=scale_guess, out=out)

    def quantize(self, x: torch.Tensor):
        """A Float8Tensor of ``x`` (nominal dtype and shape of ``x``) holding this quantizer."""
        return self._make(x, self.cast(x))

    def quantize_into(self, dst, x: torch.Tensor) -> None:
        """Requantize ``x`` into ``dst``'s buffers in place. With ``pow2`` the destination's old
        scale is the guess of the one-pass speculative Triton cast (same bytes either way)."""
        bufs = self._check_dst(dst, x)
        guess = bufs["scale_inv"].reciprocal() if self.pow2 else None
        self._write(bufs, self.cast(x, out=self._out(bufs, x), scale_guess=guess))


class DelayedScaling(_PerTensorQuantizer):
    """Scale from a history of earlier amaxes; each cast records its own amax.

    The scale used by call ``t`` comes from amaxes of calls ``< t`` (``algo="max"`` over the
    last ``history_len`` or ``"most_recent"``), divided by ``2**margin`` for headroom. It
    starts at 1.0 (as in TransformerEngine). A non-finite or zero amax is recorded in
    ``amax_history`` but leaves the scale unchanged (TransformerEngine's rule): a step that
    overflowed does not poison the scale."""

    def __init__(self, fmt: str = "e4m3", history_len: int = 16, algo: str = "max", margin: int = 0, group=None,
                 *, pow2: bool = False, amax_eps: float = 1e-12, backend: str = "auto"):
        super().__init__(fmt, group, backend)
        if algo not in ("max", "most_recent"):
            raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
        if int(history_len) < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        if int(margin) != margin or not 0 <= margin <= 64:
            raise ValueError(f"margin must be an integer in [0, 64], got {margin!r}")
        check_amax_eps(amax_eps, fmt)
        self.history_len = int(history_len)
        self.algo = algo
        self.margin = int(margin)
        self.pow2 = pow2
        self.amax_eps = amax_eps
        self.amax_history = torch.zeros(self.history_len, dtype=torch.float32)  # [0] is the most recent
        self.scale = torch.ones((), dtype=torch.float32)
        self.steps = 0

    def __repr__(self):
        return (f"DelayedScaling(fmt={self.fmt!r}, history_len={self.history_len}, algo={self.algo!r}, "
                f"margin={self.margin}, steps={self.steps})")

    def _to(self, device) -> None:
        if self.scale.device != torch.device(device):
            self.amax_history = self.amax_history.to(device)
            self.scale = self.scale.to(device)

    def record_amax(self, a: torch.Tensor) -> None:
        """Push an amax into the history and update the scale for the next call (no host sync)."""
        self._to(a.device)
        self.amax_history = torch.roll(self.amax_history, 1)
        self.amax_history[0] = a.reshape(())
        h = self.amax_history[0] if self.algo == "most_recent" else self.amax_history.amax()
        new = scale_from_amax(h, self.fmt, pow2=self.pow2, amax_eps=self.amax_eps, margin=self.margin)
        self.scale = torch.where(torch.isfinite(h) & (h > 0), new, self.scale)
        self.steps += 1

    def cast(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> CastResult:
        check_input(x, self.fmt)
        reduce = self._reduce()
        self._to(x.device)
        be = _backend(self.backend, x)
        res = be.cast_delayed_scaling(x, self.scale, self.fmt, out=out)
        if reduce is not None:
            reduce(res.amax)
        self.record_amax(res.amax)
        return res

    def quantize(self, x: torch.Tensor):
        return self._make(x, self.cast(x))

    def quantize_into(self, dst, x: torch.Tensor) -> None:
        bufs = self._check_dst(dst, x)
        self._write(bufs, self.cast(x, out=self._out(bufs, x)))


# --------------------------------------------------------------------------- lesson helpers


def fake_quantize_per_tensor(x: torch.Tensor, scale, fmt: str = "e4m3") -> torch.Tensor:
    """The fp32 values ``x`` turns into after an FP8 round trip with ``scale`` (quantize, dequantize)."""
    s = _check_scale_arg(scale, x.device)
    return dequantize_per_tensor(quantize_per_tensor(x, s, fmt), s.reciprocal(), fmt)


def synthetic_activations(steps: int, n: int, *, spike_step: int | None = None, spike_factor: float = 30.0,
                          drift: float = 0.02, seed: int = 0) -> list[torch.Tensor]:
    """Per-step Gaussian "activations" whose scale drifts slowly; at ``spike_step`` a few
    elements (1%) are ``spike_factor`` times larger -- the event delayed scaling is blind to."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        x = torch.randn(n, generator=g) * (1.0 + drift * t)
        if t == spike_step:
            idx = torch.randperm(n, generator=g)[: max(1, n // 100)]
            x[idx] *= spike_factor
        out.append(x)
    return out


def track_scaling(xs: list[torch.Tensor], quantizer) -> dict[str, list[float]]:
    """Quantize each tensor with ``quantizer.cast`` and record, per step: the scale used, the
    tensor's amax, the fraction of elements clipped by saturation (``|x * scale|`` beyond the
    rounding boundary above max, e.g. 464 for E4M3), the fraction of non-zeros that flushed
    to zero, and the relative RMS error of the round trip."""
    from tutorial_lib.formats import all_values

    grid = all_values(quantizer.fmt)
    clip = (grid[-1] + (grid[-1] - grid[-2]) / 2).item()  # values at or below round to max anyway
    rec: dict[str, list[float]] = {k: [] for k in ("scale", "amax", "saturated", "underflow", "rel_rms_error")}
    for x in xs:
        res = quantizer.cast(x)
        back = dequantize_per_tensor(res.data, res.scale_inv, quantizer.fmt)
        xf = x.float()
        rec["scale"].append(res.scale.item())
        rec["amax"].append(amax(x).item())
        rec["saturated"].append(((xf * res.scale).abs() > clip).float().mean().item())
        rec["underflow"].append(((back == 0) & (xf != 0)).float().mean().item())
        rec["rel_rms_error"].append(((back - xf).norm() / xf.norm()).item())
    return rec


def _register_safe_globals() -> None:
    """Let ``torch.load(weights_only=True)`` rebuild tensors that hold these quantizers."""
    from tutorial_lib.quantized_tensor import add_safe_global

    add_safe_global(CurrentScaling)
    add_safe_global(DelayedScaling)


_register_safe_globals()
