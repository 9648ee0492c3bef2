"""What a quantized tensor does with a view its layout cannot honour: strict, scoped, or warn.

A block-scaled tensor keeps its trailing block dims (``quant_layout.fixed_dims``): an MXFP8
weight [M, K] can be viewed as [2, M/2, K] but not as [M*K] -- the scales are laid out per
row of K. Yet FSDP2 flattens every local shard::

    fully_shard()          FSDPParam._init_sharded_param:   _sharded_param_data = padded.view(-1)
    first forward          lazy_init -> reset_sharded_param: _sharded_param_data = local.view(-1)
    module.to()/_apply     reset_sharded_param                (same)
    load_state_dict        post-hook -> reset_sharded_param   (same)

With all-gather hooks (``fsdp_pre_all_gather``) FSDP2 never all-gathers ``_sharded_param_data``,
but ``reset_sharded_param`` inspects its type and storage. What should ``view(-1)`` return? Three
policies, chosen here::

    policy                     view(-1) inside FSDP2        view(-1) anywhere else
    -------------------------  ---------------------------  ----------------------------------
    strict (default)           QuantizedViewError           QuantizedViewError
    scoped allowance           RawBytes: zero-copy uint8    QuantizedViewError
      `with allow_flat_views()`  alias of the element bytes   (only this thread, only 1-D flatten)
    warn_dequantize (global,   a dequantized COPY           a dequantized COPY, with a warning:
      demo only)               (stale, 2 B/element kept)    writes to it never reach the weight

The production library chose the last one for every caller. Lesson 04 measures its two costs
(a non-aliasing "view" that silently drops writes and rounds block scales to bf16; a stale
high-precision copy kept per shard) and shows that the scoped raw-byte view avoids both.

``RawBytes`` cannot be mistaken for weights: it is ``uint8``, its numel is the byte count (half
the element count for FP4), and arithmetic on it raises ``RawBytesError``.

Example (inside a launched rank: ``fully_shard`` needs a process group; pass the rank's mesh:
without one, FSDP2 builds its default mesh on the machine's accelerator -- CUDA on a GPU machine, even in
gloo ranks whose tensors are on the CPU)::

    from torch.distributed.fsdp import fully_shard
    from tutorial_lib.dist.mesh import world_mesh
    from tutorial_lib.quant.fallback import QuantizedViewError
    from tutorial_lib.quant.mxfp8 import MXFP8Quantizer
    from tutorial_lib.quant.view_policy import allow_flat_views, view_policy, flat_raw_bytes
    mesh, dev = world_mesh()
    q = MXFP8Quantizer().quantize(torch.randn(64, 128, dtype=torch.bfloat16, device=dev))
    layer = torch.nn.Linear(128, 64, bias=False, device=dev)
    layer.weight = torch.nn.Parameter(q)
    try:
        q.view(-1)                              # strict by default
    except QuantizedViewError as e:
        print(e)                                # names the layout rule and the ways out
    with allow_flat_views():
        fully_shard(layer, mesh=mesh)           # FSDP2's view(-1) -> RawBytes alias, no copy
    raw = flat_raw_bytes(q)                     # the same alias, asked for explicitly
    with view_policy("warn_dequantize"):        # demo: the production behaviour
        v = q.view(-1)                          # a bf16 copy + QuantizedViewWarning
"""

from __future__ import annotations

import collections
import contextlib
import threading
import warnings
from collections.abc import Iterator

import torch

from tutorial_lib.quant.fallback import QuantizedViewError, set_disallowed_view_handler
from tutorial_lib.quant.tensor import QuantizedTensor, local_tensor

__all__ = [
    "POLICIES",
    "SCOPED_RESULTS",
    "VIEW_COPIES",
    "QuantizedViewWarning",
    "RawBytes",
    "RawBytesError",
    "allow_flat_views",
    "flat_raw_bytes",
    "flat_view_scope",
    "get_view_policy",
    "install_view_policy",
    "set_view_policy",
    "view_policy",
]

POLICIES = ("strict", "warn_dequantize")
SCOPED_RESULTS = ("raw_bytes", "dequantize")

VIEW_COPIES: collections.Counter = collections.Counter()
"""Class name -> how many disallowed views were answered with a dequantized copy."""


class RawBytesError(RuntimeError):
    """Arithmetic on RawBytes: the bytes of a quantized tensor are not its values.

    (A RuntimeError, not a TypeError: torch turns a TypeError inside ``x + 1`` into
    ``NotImplemented`` and Python would then report a generic operand error.)"""


class QuantizedViewWarning(UserWarning):
    """A disallowed view returned a dequantized copy (global warn_dequantize policy)."""


_policy = "strict"
_local = threading.local()  # .scopes: stack of SCOPED_RESULTS entries for this thread


def set_view_policy(policy: str) -> str:
    """Process-wide policy for views outside any scope: "strict" or "warn_dequantize". Returns the old one."""
    global _policy
    if policy not in POLICIES:
        raise ValueError(f"view policy must be one of {POLICIES}, got {policy!r}")
    install_view_policy()
    previous, _policy = _policy, policy
    return previous


def get_view_policy() -> str:
    return _policy


@contextlib.contextmanager
def view_policy(policy: str) -> Iterator[None]:
    """``with view_policy("warn_dequantize"): ...`` -- change the global policy temporarily (demo)."""
    previous = set_view_policy(policy)
    try:
        yield
    finally:
        set_view_policy(previous)


@contextlib.contextmanager
def allow_flat_views(result: str = "raw_bytes") -> Iterator[None]:
    """Scoped allowance: inside the block (this thread only) a flatten to 1-D of a quantized tensor
    returns ``RawBytes`` (``result="raw_bytes"``, zero copy) or a dequantized copy
    (``result="dequantize"``, kept for comparison). Any other disallowed view goes to the global policy
    (strict: raises)."""
    if result not in SCOPED_RESULTS:
        raise ValueError(f"result must be one of {SCOPED_RESULTS}, got {result!r}")
    install_view_policy()
    scopes = _local.__dict__.setdefault("scopes", [])
    scopes.append(result)
    try:
        yield
    finally:
        scopes.pop()


def flat_view_scope() -> str | None:
    """The innermost active :func:`allow_flat_views` result on this thread ("raw_bytes" /
    "dequantize"), or None outside any scope. The FSDP2 integration records it when FSDP2 first
    flattens a shard, so FSDP2's later re-flattens of that shard get the same answer."""
    scopes = _local.__dict__.get("scopes")
    return scopes[-1] if scopes else None


def _requested_shape(t: QuantizedTensor, args, kwargs) -> tuple[int, ...]:
    size = tuple(args[1] if len(args) > 1 else kwargs["size"])
    if -1 in size:
        known = 1
        for s in size:
            known *= s if s != -1 else 1
        size = tuple(t.numel() // known if s == -1 else s for s in size)
    return size


def _dequantized_copy(t: QuantizedTensor, func, args, kwargs) -> torch.Tensor:
    VIEW_COPIES[type(t).__name__] += 1
    return func(t.dequantize(), *args[1:], **kwargs)


def _handle_disallowed_view(t: QuantizedTensor, func, args, kwargs):
    """Installed into the base class: decides what a view the layout cannot honour returns."""
    shape = _requested_shape(t, args, kwargs)
    scopes = _local.__dict__.get("scopes")
    if scopes and shape == (t.numel(),):
        return flat_raw_bytes(t) if scopes[-1] == "raw_bytes" else _dequantized_copy(t, func, args, kwargs)
    if _policy == "warn_dequantize":
        warnings.warn(
            f"{func} to {list(shape)} of {type(t).__name__} {list(t.shape)} returned a dequantized "
            f"{t.dtype} COPY ({t.numel() * t.dtype.itemsize} bytes): writes to it do not reach the weight "
            "(global warn_dequantize view policy)",
            QuantizedViewWarning,
            stacklevel=5,  # the caller of .view(): above the dispatch and handler frames
        )
        return _dequantized_copy(t, func, args, kwargs)
    fixed = t.quant_layout.fixed_dims
    raise QuantizedViewError(
        f"{func} to {list(shape)} is not allowed for {type(t).__name__} {list(t.shape)}: layout "
        f"{t.quant_layout.name!r} must keep its last {fixed} dim(s) {list(t.shape[-fixed:])} unchanged, and "
        "a dequantized copy would not alias the weight (strict view policy). Options: t.dequantize() for an "
        "explicit copy; flat_raw_bytes(t) for a zero-copy byte view; FSDP2 integrations flatten shards "
        "inside `with allow_flat_views():`."
    )


def install_view_policy() -> None:
    """Make this module decide disallowed views. ``tutorial_lib.setup()`` calls it once (importing
    ``tutorial_lib`` runs it); every context manager and setter here calls it again, in case someone
    restored the base class's default handler."""
    set_disallowed_view_handler(_handle_disallowed_view)


# ----------------------------------------------------------------------------- raw-byte flat view


class RawBytes(torch.Tensor):
    """A zero-copy ``uint8`` alias of a quantized tensor's element bytes -- not its values.

    Byte-moving ops (views, slices, copy_, clone, ``.to(device)``, ``torch.equal``) work and stay ``RawBytes``;
    anything that would treat the bytes as numbers (add, matmul, sum, ...) raises RawBytesError.
    ``source`` names what the bytes encode.
    """

    _BYTE_OPS = frozenset({
        "view", "reshape", "flatten", "narrow", "split", "chunk", "__getitem__", "__setitem__", "copy_",
        "clone", "detach", "to", "cpu", "cuda", "contiguous", "numel", "size", "dim", "stride",
        "storage_offset", "data_ptr", "untyped_storage", "element_size", "is_contiguous", "is_pinned",
        "pin_memory", "equal", "__len__", "__deepcopy__", "__reduce_ex__", "new_empty", "new_zeros", "empty_like",
        "as_subclass", "requires_grad_", "__get__",
    })

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        src = next((a.__dict__.get("source") for a in args if isinstance(a, RawBytes)), None)
        if name not in cls._BYTE_OPS:
            raise RawBytesError(
                f"{name} on RawBytes: these are the raw bytes of {src or 'a quantized tensor'}, not numbers. "
                "Dequantize the quantized tensor for values (or .as_subclass(torch.Tensor) to handle bytes)."
            )
        out = super().__torch_function__(func, types, args, kwargs or {})
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, RawBytes) and o.dtype != torch.uint8:  # .to(float32), .view(float8): bytes as numbers
                raise RawBytesError(
                    f"{name} to {o.dtype} on RawBytes: these are the raw bytes of {src or 'a quantized tensor'}, "
                    "not numbers. Dequantize the quantized tensor for values (or .as_subclass(torch.Tensor) first)."
                )
            if isinstance(o, RawBytes) and src is not None:
                o.__dict__.setdefault("source", src)
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"RawBytes({self.numel()} bytes of {self.__dict__.get('source', '?')})"


def flat_raw_bytes(t) -> RawBytes:
    """Zero-copy 1-D ``uint8`` view of a quantized tensor's element bytes (its ``data`` buffer).

    The scales are not included (they travel in their own buffers, e.g. through FSDP2's
    all-gather hooks); the bytes alias ``t``'s, so requantizing ``t`` in place shows here.
    """
    t = local_tensor(t)
    if not isinstance(t, QuantizedTensor):
        raise TypeError(f"flat_raw_bytes needs a quantized tensor, got {type(t).__name__}")
    data = t.raw_buffers()[t._buffer_names[0]]
    if not data.is_contiguous():
        raise ValueError(
            f"a zero-copy flat view needs contiguous bytes; this {type(t).__name__} {list(t.shape)} is a "
            f"strided piece (data strides {data.stride()}). Flatten the whole tensor, or copy it first."
        )
    raw = data.view(-1).as_subclass(RawBytes)
    raw.source = f"{type(t).__name__} {list(t.shape)} ({t.quant_layout.name})"
    return raw
