"""An FP8 linear layer: the three GEMMs of ``nn.Linear`` run on FP8 codes, not on dequantized copies.

``y = x @ W.T + b`` costs three GEMMs per step. :class:`Fp8Linear` runs each one as a scaled FP8
GEMM (:mod:`tutorial_lib.matmul.scaled_mm`), with the operand layouts Hopper's FP8 GEMM needs
(A row-major, B column-major)::

    GEMM    computes                A (row-major)          B (column-major)            copies made
    -----   ---------------------   --------------------   -------------------------   --------------------------
    fprop   y  [M, N] = x  @ W.T    x codes  [M, K]        W.T: W [N, K] as stored     none
    dgrad   dx [M, K] = dy @ W      dy codes [M, N]        W  : needs W.T row-major    W.T codes [K, N] (1 B/el)
    wgrad   dW [N, K] = dy.T @ x    dy.T codes [N, M]      x  : needs x.T row-major    dy.T and x.T codes
    (M = tokens, K = in_features, N = out_features. W.T's codes are a transposed copy of the 1-byte
     codes, exact for a per-tensor scale and for 128x128 tiles, whose scales transpose with them; on
     CUDA the tiled Triton transpose of ``tutorial_kernels.transpose``. dy.T and x.T are written by
     the cast that makes dy and x -- their second layout, not a copy: see the recipes.)

Recipes (:class:`Fp8Recipe`):

* ``"hybrid"`` (per-tensor, current scaling): x and W in E4M3, the output gradient dy in E5M2
  (range over precision: gradients span more binades), so dgrad and wgrad are E5M2 x E4M3 GEMMs
  (E5M2 x E5M2 does not exist). x and dy are cast by :class:`~tutorial_lib.quant.float8.CurrentScaling`,
  which on CUDA runs the repository's Triton casts (amax computed in the kernels, the scale derived
  on the device, no host sync); with ``pow2_scales=True`` the one-pass speculative cast, guessing
  each layer's previous scale (:class:`ScaleGuess`). When wgrad needs them, x.T's and dy.T's codes come
  with the cast (``CurrentScaling.cast_with_transpose``: on CUDA the cast, then a transpose of its codes).
* ``"blockwise"``: E4M3 everywhere, one scale per 1x128 block of x and dy and per 128x128 tile of
  W (the tensors of :mod:`tutorial_lib.quant.blockwise`). wgrad contracts over the TOKENS, so it
  needs dy and x with blocks along M, i.e. 128x1 blocks: we quantize ``dy.T`` and ``x.T`` with
  1x128 blocks (from high precision, not by requantizing FP8 codes) and run a 1x128 x 1x128 GEMM;
  this needs M % 128 == 0 (or ``pad_tokens=True``, below). x and x.T (and dy and dy.T) come from one call
  (``quantize_fp8_1x128_with_transpose``: on CUDA the 1x128 kernel on t, then on the view t.t()). dgrad
  uses W.T's tiles (the transposed 128x128 codes and scales, exact).

The weight. If the parameter already IS a quantized tensor of the recipe's format -- under FSDP2
the unsharded weight is a :class:`~tutorial_lib.quant.float8.Float8Tensor` holding the all-gathered
FP8 bytes (lesson 06) -- its codes and scale go straight into the GEMMs: no dequantize, no
fallback. A high-precision weight is quantized on every forward. Either way the weight's gradient
is a plain tensor of the parameter's nominal dtype (what FSDP2's reduce-scatter and the optimizers
expect). The bias is added inside the fprop GEMM, to its fp32 result before the one rounding to
x's dtype (the GEMM's epilogue, as ``nn.Linear``'s cuBLAS GEMM does it) -- not by a separate kernel
that reads and writes the whole output again; a bias of another dtype than x is added after the
GEMM, with torch's type promotion. Its gradient is summed in high precision.

What is saved for backward: the weight (the parameter itself; FSDP2 refills its bytes in place
before backward) or its FP8 copy, and x as FP8 codes + scale (``save_fp8_input=True``: 1 byte
per element instead of 2 (bf16) or 4) -- for blockwise, x.T's codes, which wgrad reads -- or the
high-precision x itself (``save_fp8_input=False``), requantized in backward. Current scaling is
deterministic, so both give the same codes and bit-identical gradients.

Tokens (:mod:`~tutorial_lib.matmul.fp8_recipe`). wgrad needs M % 16 (hybrid) / % 128 (blockwise), the
blockwise fprop and dgrad M % 4: a batch that breaks wgrad's rule is refused in forward, unless
``Fp8Recipe(pad_tokens=True)``, which zero-pads the wgrad operands x and dy along the tokens -- exact: zeros
add nothing to dW and change no scale -- and runs fprop and dgrad on the first M rows of the same codes (M
rounded up to 4, outputs sliced, for blockwise), at the cost of a padded copy of x and of dy.

Host work. A layer runs on every step, so its Python is lean: operands travel as raw codes + scales
(no wrapper tensor per GEMM operand), the fprop GEMM -- whose operands come from the caller -- is
checked against the FP8 rules once per forward (:func:`~tutorial_lib.matmul.gemm_rules.check_fp8_gemm`,
:func:`~tutorial_lib.matmul.gemm_rules.check_blockwise_codes`), dgrad and wgrad, built here from those
checked operands, are not re-checked (:func:`~tutorial_lib.matmul.scaled_mm.fp8_mm_codes`,
:func:`~tutorial_lib.matmul.scaled_mm.blockwise_mm_codes`), and the :data:`PROFILE_LABELS` ranges exist
only while a ``torch.profiler`` runs. The results are those of the public checked GEMMs, bit for bit.

Example::

    from tutorial_lib.matmul.fp8_linear import Fp8Linear, Fp8Recipe, fp8_linear, swap_linears
    from tutorial_lib.quant.float8 import CurrentScaling
    layer = Fp8Linear(256, 512, recipe="hybrid")              # an nn.Linear: same parameters, FP8 GEMMs
    y = layer(torch.randn(64, 256))
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    swap_linears(model, recipe=Fp8Recipe("blockwise"))          # every nn.Linear / QLinear, before fully_shard
    x, w8, bias = torch.randn(64, 256), CurrentScaling("e4m3").quantize(torch.randn(512, 256)), torch.randn(512)
    y = fp8_linear(x, w8, bias, Fp8Recipe("hybrid", save_fp8_input=False))   # functional form, E4M3 weight
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.autograd.profiler as autograd_profiler
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function
from tutorial_kernels.transpose import transpose

from tutorial_lib.matmul.fp8_recipe import RECIPES, Fp8Recipe, as_recipe, pad_rows, token_rows
from tutorial_lib.matmul.scaled_mm import (
    FP8LayoutError,
    blockwise_mm_codes,
    check_blockwise_codes,
    check_fp8_gemm,
    fp8_mm_codes,
)
from tutorial_lib.quant.blockwise import (
    FP8Blockwise128x128Tensor,
    quantize_fp8_1x128_with_transpose,
    quantize_fp8_blockwise,
)
from tutorial_lib.quant.float8 import CurrentScaling, Float8Tensor
from tutorial_lib.quant.tensor import is_quantized

__all__ = ["PROFILE_LABELS", "RECIPES", "Fp8Linear", "Fp8Recipe", "ScaleGuess", "as_recipe", "fp8_linear",
           "swap_linears"]

PROFILE_LABELS = ("fp8_linear.quantize", "fp8_linear.transpose", "fp8_linear.fprop", "fp8_linear.dgrad",
                  "fp8_linear.wgrad")
"""``torch.profiler`` ranges around each phase: casts to FP8, transposed copies of codes, the three GEMMs."""

_NO_RANGE = contextlib.nullcontext()


def _phase(name: str):
    """The profiler range ``fp8_linear.<name>`` while a torch profiler runs, else nothing: a ``record_function``
    costs two dispatcher calls even when no profiler listens (torch's own flag, as torch's compiler uses it)."""
    if getattr(autograd_profiler, "_is_profiler_enabled", True):
        return record_function("fp8_linear." + name)
    return _NO_RANGE


# ----------------------------------------------------------------------------- operand helpers
# Operands travel as raw (codes, scale_inv) pairs: no wrapper tensor per GEMM operand. The fprop GEMM, whose
# operands come from the caller (x's shape, the weight), is checked once per forward; dgrad's and wgrad's
# operands are made here from those checked ones (and the token rules of fp8_recipe.token_rows), so they are not
# re-validated.

_CASTS = {(fmt, pow2): CurrentScaling(fmt, pow2_scales=pow2) for fmt in ("e4m3", "e5m2") for pow2 in (False, True)}
"""The stateless current-scaling quantizers of the hybrid recipe, built once (no process group)."""


def _transposed(codes: torch.Tensor) -> torch.Tensor:
    """``codes.t().contiguous()``: on CUDA the tiled Triton transpose (torch's strided copy of 1-byte codes runs
    far below copy bandwidth, and backward makes three per layer), on the CPU torch's copy. Same bytes."""
    return transpose(codes) if codes.is_cuda else codes.t().contiguous()


def _rows_of(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` as a 2-D [rows, features] matrix (a view of a contiguous tensor; a 2-D ``t`` itself)."""
    if t.dim() == 2:
        return t
    if t.dim() < 1:
        raise ValueError(f"fp8_linear: {what} must have at least one dim, got a scalar")
    return t.reshape(-1, t.shape[-1])


def _check_weight(weight: torch.Tensor, recipe: Fp8Recipe) -> None:
    if isinstance(weight, DTensor):
        raise TypeError("fp8_linear got a DTensor weight: call it inside an FSDP2 module's forward (which unshards "
                        "the weight into a plain or quantized tensor), or pass weight.full_tensor()")
    if not is_quantized(weight):
        return
    want = Float8Tensor if recipe.kind == "hybrid" else FP8Blockwise128x128Tensor
    if not isinstance(weight, want):
        raise TypeError(f"the {recipe.kind!r} FP8 recipe multiplies {want.__name__} weights; this weight is "
                        f"{type(weight).__name__}. Quantize it with the matching format (registry 'fp8' for "
                        f"'hybrid', 'fp8_128x128' for 'blockwise') or use QLinear (dequantize-on-use)")
    if recipe.kind == "hybrid" and weight.fmt != "e4m3":
        raise TypeError(f"the hybrid recipe needs an E4M3 weight (dgrad multiplies E5M2 gradients by it, and "
                        f"E5M2 x E5M2 has no FP8 GEMM); this Float8Tensor is {weight.fmt}")


def _codes(t) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 tensor's codes and scales: its buffers ``data`` and ``scale_inv`` (stored as ``_data``/``_scale_inv``)."""
    return t._data, t._scale_inv


def _hybrid_weight(weight: torch.Tensor, recipe: Fp8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's E4M3 codes + scale: the parameter's own bytes when it is FP8, else a fresh cast (in
    forward, where autograd records nothing, so the parameter needs no ``detach``)."""
    if isinstance(weight, Float8Tensor):
        return _codes(weight)
    res = _CASTS["e4m3", recipe.pow2_scales].cast(weight)
    return res.data, res.scale_inv


def _blockwise_weight(weight: torch.Tensor, recipe: Fp8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(weight, FP8Blockwise128x128Tensor):
        return _codes(weight)
    _require_high_precision(weight)
    return quantize_fp8_blockwise(weight, (128, 128), pow2_scales=recipe.pow2_scales)


def _quantize_1x128(t: torch.Tensor, recipe: Fp8Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes and scales of ``t`` in 1x128 blocks (on CUDA the one-pass Triton kernel, strided input read in
    place)."""
    return quantize_fp8_blockwise(t, (1, 128), pow2_scales=recipe.pow2_scales)


def _quantize_1x128_pair(t: torch.Tensor, recipe: Fp8Recipe):
    """``(_quantize_1x128(t), _quantize_1x128(t.t()))`` (both dims are multiples of 128 wherever this is
    called: features by the recipe, tokens by the wgrad rule or its padding)."""
    return quantize_fp8_1x128_with_transpose(t, pow2_scales=recipe.pow2_scales)


def _epilogue_bias(bias, x_dtype: torch.dtype, n: int):
    """``bias`` when the fprop GEMM can add it in its epilogue (a contiguous [N] tensor of x's dtype -- the
    output dtype), else None: then the layer adds it after the GEMM, with torch's type promotion."""
    if bias is not None and bias.dtype == x_dtype and bias.dim() == 1 and bias.shape[0] == n and \
            bias.is_contiguous() and not isinstance(bias, DTensor):
        return bias
    return None


def _first_rows(codes, rows: int):
    """The first ``rows`` rows of codes or of ``(codes, 1x128 scales)`` (row views), what fprop / dgrad read of
    a wgrad operand cast at its padded size; the operand itself when it has ``rows`` rows."""
    if isinstance(codes, tuple):
        return codes if codes[0].shape[0] == rows else (codes[0][:rows], codes[1][:rows])
    return codes if codes.shape[0] == rows else codes[:rows]


def _require_high_precision(t: torch.Tensor) -> None:
    """Refuse a 1-byte float ``t`` before quantizing it, as a quantized tensor's nominal dtype is refused."""
    if t.dtype.itemsize < 2:
        raise TypeError(f"nominal dtype must be a high-precision float dtype (fp32/bf16/fp16), got {t.dtype}")


class ScaleGuess:
    """The last power-of-two scales of one layer's x and dy (hybrid recipe with ``pow2_scales=True``).

    They are the ``scale_guess`` of the repository's one-pass speculative current-scaling cast
    (``tutorial_kernels.fp8_cast``): amax and cast in ONE read of x when the scale did not change,
    a recast only when it did. The bytes never depend on the guess. (Without ``pow2_scales`` the
    cast is the two-kernel version: amax, then cast, scale computed on the device.)"""

    __slots__ = ("x", "dy")

    def __init__(self):
        self.x: torch.Tensor | None = None
        self.dy: torch.Tensor | None = None


def _cast(t: torch.Tensor, fmt: str, recipe: Fp8Recipe, guess: ScaleGuess | None, role: str, *,
          transposed: bool = False):
    """Current-scaling cast of ``t`` (CastResult), speculative on the layer's last scale when it can be; with
    ``transposed``, ``(CastResult, codes of t.t())`` from the same cast kernels (no transpose pass)."""
    scale_guess = getattr(guess, role) if (guess is not None and recipe.pow2_scales) else None
    if scale_guess is not None and scale_guess.device != t.device:
        scale_guess = None
    cast = _CASTS[fmt, recipe.pow2_scales]
    out = cast.cast_with_transpose(t, scale_guess=scale_guess) if transposed else cast.cast(t, scale_guess=scale_guess)
    if guess is not None and recipe.pow2_scales:
        setattr(guess, role, (out[0] if transposed else out).scale)
    return out


# ----------------------------------------------------------------------------- the autograd function


class _Fp8LinearFn(torch.autograd.Function):
    """``y = x @ W.T + b`` with FP8 fprop/dgrad/wgrad GEMMs (see the module docstring for the layouts)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, grad_enabled: bool, guess: ScaleGuess | None):
        x2 = _rows_of(x, "x")
        # needs_input_grad follows requires_grad even under no_grad: what backward will need is both
        want_x, want_w = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        m = x2.shape[0]  # tokens; fprop/dgrad run on m_f rows, wgrad on m_w (more only with pad_tokens)
        m_f, m_w = token_rows(m, recipe, want_w)  # a broken wgrad rule fails in forward, not half-way into backward
        ctx.rows = (m, m_f, m_w)
        ctx.recipe, ctx.x_shape, ctx.x_dtype, ctx.has_bias = recipe, x.shape, x.dtype, bias is not None
        ctx.guess = guess
        ctx.w_dtype = weight.dtype
        x_codes = (None, None)
        epi_bias = _epilogue_bias(bias, x.dtype, weight.shape[0])
        if recipe.kind == "hybrid":
            with _phase("quantize"):
                if want_w and recipe.save_fp8_input:  # x's codes for fprop and x.T's (m_w tokens), saved for wgrad
                    xq, x_t = _cast(pad_rows(x2, m_w), "e4m3", recipe, guess, "x", transposed=True)
                else:
                    xq = _cast(x2, "e4m3", recipe, guess, "x")
                w_data, w_scale = _hybrid_weight(weight, recipe)
            with _phase("fprop"):
                w_col = w_data.t()  # W [N, K] row-major IS the column-major B = W.T
                x_data = _first_rows(xq.data, m)
                check_fp8_gemm(x_data, w_col, "e4m3", "e4m3", x.dtype)
                y = fp8_mm_codes(x_data, "e4m3", xq.scale_inv, w_col, "e4m3", w_scale, out_dtype=x.dtype,
                                 use_fast_accum=recipe.use_fast_accum, backend=recipe.backend, bias=epi_bias)
            if want_w and recipe.save_fp8_input:
                x_codes = (x_t, xq.scale_inv)
        else:
            with _phase("quantize"):
                _require_high_precision(x2)
                if want_w and recipe.save_fp8_input:  # x for fprop AND x.T in 1x128 blocks (x in 128x1) for wgrad
                    xq, x_codes = _quantize_1x128_pair(pad_rows(x2, m_w), recipe)
                    xq = _first_rows(xq, m_f)
                else:
                    xq = _quantize_1x128(pad_rows(x2, m_f), recipe)
                w_data, w_scale = _blockwise_weight(weight, recipe)
            with _phase("fprop"):
                check_blockwise_codes(*xq, w_data, w_scale, x.dtype, recipe.use_fast_accum)
                y = blockwise_mm_codes(*xq, w_data, w_scale, w_block=(128, 128), out_dtype=x.dtype,
                                       use_fast_accum=recipe.use_fast_accum, backend=recipe.backend, bias=epi_bias)
        if bias is not None and epi_bias is None:
            y = y + bias  # a bias of another dtype than x: torch's promotion, as F.linear's add would do
        # Saved for backward. dgrad needs the weight: the parameter itself when it is FP8 (FSDP2 refills its
        # bytes in place before backward), else the codes cast above. wgrad needs x: x.T's FP8 codes + scale
        # (1 byte/element; both recipes keep the transposed operand wgrad reads; m_w tokens) or x itself
        # (requantized in backward, to the same codes; padded there).
        fp8_weight = is_quantized(weight)
        w_param = weight if (want_x and fp8_weight) else None
        w_codes = (w_data, w_scale) if (want_x and not fp8_weight) else (None, None)
        x_hp = x if (want_w and not recipe.save_fp8_input) else None
        ctx.save_for_backward(w_param, *w_codes, x_hp, *x_codes)
        # [m_f, N]: the caller (fp8_linear) cuts the padded rows and restores x's leading dims -- views made
        # OUTSIDE the Function, which autograd lets a caller modify in place (y.relu_(), ReLU(inplace=True))
        return y

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():  # create_graph=True: our GEMMs run on FP8 codes autograd cannot follow
            raise RuntimeError("fp8_linear has no second derivative (its backward GEMMs run on FP8 codes): "
                               "create_graph=True through an Fp8Linear would silently drop every second-order term")
        w_param, w_data, w_scale, x_hp, x_t_data, x_scale = ctx.saved_tensors
        if w_param is not None:
            w_data, w_scale = _codes(w_param)
        g2 = _rows_of(grad_out, "grad_output")
        if not g2.is_contiguous():
            g2 = g2.contiguous()
        want_x, want_w, want_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        w = (w_data, w_scale) if want_x else None
        x = None if not want_w else (x_t_data, x_scale) if x_t_data is not None else _rows_of(x_hp, "x")
        backward = _hybrid_backward if ctx.recipe.kind == "hybrid" else _blockwise_backward
        dx, dw = backward(ctx, g2, w, x) if (w is not None or x is not None) else (None, None)  # bias alone: no GEMM
        db = g2[:ctx.rows[0]].sum(0) if (ctx.has_bias and want_b) else None  # the real rows (padded ones are 0)
        if dx is not None and len(ctx.x_shape) != 2:
            dx = dx.reshape(ctx.x_shape)
        return dx, dw, db, None, None, None


def _hybrid_backward(ctx, g2, w, x):
    """dgrad (if ``w``: the weight's codes + scale) and wgrad (if ``x``: x.T's codes + scale, or x itself)."""
    recipe = ctx.recipe
    g_t = None
    m, _, m_w = ctx.rows
    with _phase("quantize"):  # dy in E5M2, once for both GEMMs; with wgrad, dy.T's codes from the same kernels
        if x is not None:  # dy zero-padded to m_w tokens when they are more (pad_tokens): dgrad reads its first m
            gq, g_t = _cast(pad_rows(g2, m_w), "e5m2", recipe, ctx.guess, "dy", transposed=True)
        else:
            gq = _cast(g2, "e5m2", recipe, ctx.guess, "dy")
    dx = dw = None
    if w is not None:  # dgrad: dx = dy @ W. B = W [N, K] column-major = (W.T row-major [K, N]).t(): a copy
        w_data, w_scale = w
        with _phase("transpose"):
            w_t = _transposed(w_data)
        with _phase("dgrad"):
            dx = fp8_mm_codes(_first_rows(gq.data, m), "e5m2", gq.scale_inv, w_t.t(), "e4m3", w_scale,
                              out_dtype=ctx.x_dtype, backend=recipe.backend)
    if x is not None:  # wgrad: dW = dy.T @ x. A = dy.T row-major; B = x column-major = (x.T row-major).t()
        if isinstance(x, tuple):
            x_t, x_scale = x
        else:
            with _phase("quantize"):  # the same codes the forward made, and x.T's
                xq, x_t = _CASTS["e4m3", recipe.pow2_scales].cast_with_transpose(pad_rows(x, m_w))
            x_scale = xq.scale_inv
        with _phase("wgrad"):
            dw = fp8_mm_codes(g_t, "e5m2", gq.scale_inv, x_t.t(), "e4m3", x_scale, out_dtype=ctx.w_dtype,
                              backend=recipe.backend)
    return dx, dw


def _blockwise_backward(ctx, g2, w, x):
    """dgrad (dy in 1x128 blocks x W.T's tiles) and wgrad (dy.T and x.T in 1x128 blocks, along the tokens)."""
    recipe = ctx.recipe
    m, m_f, m_w = ctx.rows
    dx = dw = None
    with _phase("quantize"):  # dy in 1x128 blocks (dgrad) and dy.T in 1x128 blocks (wgrad): one call when both
        if w is not None and x is not None:  # dy zero-padded to m_w tokens: dgrad reads its first m_f rows
            gq, g_t = _quantize_1x128_pair(pad_rows(g2, m_w), recipe)
            gq = _first_rows(gq, m_f)
        elif w is not None:
            gq = _quantize_1x128(pad_rows(g2, m_f), recipe)
        else:
            g_t = _quantize_1x128(pad_rows(g2, m_w).t(), recipe)
    if w is not None:  # dgrad: dx [M, K] = dy [M, N] @ W [N, K] = dy @ (W.T [K, N]).T; W.T's tiles are W's, transposed
        w_data, w_scale = w
        with _phase("transpose"):
            w_t = (_transposed(w_data), w_scale.t().contiguous())
        with _phase("dgrad"):
            dx = _first_rows(blockwise_mm_codes(*gq, *w_t, w_block=(128, 128), out_dtype=ctx.x_dtype,
                                                backend=recipe.backend), m)
    if x is not None:  # wgrad: dW [N, K] = dy.T [N, M] @ x [M, K] = dy.T @ (x.T [K, M]).T, 1x128 blocks along M
        with _phase("quantize"):
            x_t = x if isinstance(x, tuple) else _quantize_1x128(pad_rows(x, m_w).t(), recipe)
        with _phase("wgrad"):
            dw = blockwise_mm_codes(*g_t, *x_t, w_block=(1, 128), out_dtype=ctx.w_dtype, backend=recipe.backend)
    return dx, dw


# ----------------------------------------------------------------------------- public API


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               recipe: Fp8Recipe | str = "hybrid", guess: ScaleGuess | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with FP8 GEMMs forward and backward (see the module docstring).

    ``weight`` is a high-precision tensor (quantized on every call) or an already quantized weight
    of the recipe's format (used as is: :class:`Float8Tensor` E4M3 for "hybrid",
    :class:`FP8Blockwise128x128Tensor` for "blockwise"). Shape rules are those of the FP8 GEMMs
    (:mod:`~tutorial_lib.matmul.scaled_mm`): in/out features multiples of 16 (128 for blockwise); the
    token count (rows of x) free (hybrid) or a multiple of 4 (blockwise), and when the weight needs a
    gradient a multiple of 16 (hybrid) / 128 (blockwise), since wgrad contracts over it -- checked in
    forward, with an :class:`~tutorial_lib.matmul.scaled_mm.FP8LayoutError` naming the rule. With
    ``Fp8Recipe(pad_tokens=True)`` any token count: the wgrad operands x and dy are zero-padded along the
    tokens (a padded copy of each; exact, see :mod:`~tutorial_lib.matmul.fp8_recipe`), y and dx keep x's rows.
    There is no second derivative: a backward with ``create_graph=True`` through it raises.
    """
    recipe = as_recipe(recipe)
    _check_weight(weight, recipe)
    if is_quantized(x):
        raise TypeError("fp8_linear quantizes x itself: pass the high-precision activation")
    y = _Fp8LinearFn.apply(x, weight, bias, recipe, torch.is_grad_enabled(), guess)  # [rows, N], maybe padded
    m = math.prod(x.shape[:-1])  # the token rows of x
    if y.shape[0] != m:
        y = y[:m]
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose forward and backward GEMMs run in FP8 (:func:`fp8_linear`).

    Same parameters, names and init as ``nn.Linear``, so counter-based init, quantized init
    (``nn.Linear`` weights are selected) and FSDP2 treat it as one.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: Fp8Recipe | str = "hybrid"):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = as_recipe(recipe)
        self.scale_guess = ScaleGuess()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.recipe, self.scale_guess)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.kind}"

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8Recipe | str = "hybrid") -> Fp8Linear:
        """An Fp8Linear that takes over ``linear``'s parameter objects (no copy, no new init)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                  recipe=recipe)
        new.weight = linear.weight
        new.bias = linear.bias
        new.train(linear.training)
        return new


def swap_linears(model: nn.Module, recipe: Fp8Recipe | str = "hybrid", *, select=None) -> list[str]:
    """Replace every ``nn.Linear`` (``QLinear`` included) in ``model`` by an :class:`Fp8Linear` sharing its
    parameters; ``select(name, module) -> bool`` narrows the choice. Returns the swapped module names.

    Call it BEFORE ``fully_shard`` (FSDP2 keeps references to the modules it manages); a linear
    whose weight is already a DTensor is refused, and so is one whose features the recipe's GEMMs cannot
    take (multiples of 16; 128 for blockwise) -- leave it out with ``select``, e.g. an LM head of 50,257
    outputs. ``nn.MultiheadAttention``'s ``out_proj`` is left alone: the attention reads its weight
    directly and never calls it. A linear reachable through several parents becomes ONE Fp8Linear.
    """
    recipe = as_recipe(recipe)
    multiple = 128 if recipe.kind == "blockwise" else 16
    chosen, picked = [], set()  # every (parent, attribute, name, linear) to swap, checked before any swap
    for parent_name, parent in list(model.named_modules()):
        if isinstance(parent, nn.MultiheadAttention):  # uses out_proj.weight in F.multi_head_attention_forward
            continue
        for child_name, child in parent._modules.items():  # every attribute: named_children skips repeats
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if id(child) not in picked:  # a shared linear: selected (and checked) once, swapped everywhere
                if not isinstance(child, nn.Linear) or isinstance(child, Fp8Linear):
                    continue
                if select is not None and not select(name, child):
                    continue
                if isinstance(child.weight, DTensor):
                    raise ValueError(f"{name} is already sharded (DTensor weight): swap linears before fully_shard")
                if child.in_features % multiple or child.out_features % multiple:
                    raise FP8LayoutError(
                        f"{name} ({child.in_features} -> {child.out_features} features): the {recipe.kind} "
                        f"recipe's FP8 GEMMs need in and out features that are multiples of {multiple}; leave it "
                        f"out with select=lambda name, m: name != {name!r}, or pad its features")
                picked.add(id(child))
            chosen.append((parent, child_name, name, child))
    made = {}  # id(old linear) -> its Fp8Linear: a module shared by several parents stays one module
    for parent, child_name, _, child in chosen:
        if id(child) not in made:
            made[id(child)] = Fp8Linear.from_linear(child, recipe)
        setattr(parent, child_name, made[id(child)])
    return [name for _, _, name, _ in chosen]
