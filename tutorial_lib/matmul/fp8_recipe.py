"""The FP8 linear layer's recipe (:class:`Fp8Recipe`) and what its GEMMs need of the token count.

An :class:`~tutorial_lib.matmul.fp8_linear.Fp8Linear` runs three GEMMs on ``M`` tokens (rows of x)::

    GEMM    tokens are          rule on M                         why
    -----   -----------------   -------------------------------   -----------------------------------------
    fprop   rows of x, y        hybrid: none; blockwise: M % 4    cuBLASLt's M-major 1x128 scales, 16-byte
    dgrad   rows of dy, dx      (the same)                        aligned columns
    wgrad   K of dW = dy.T @ x  hybrid: M % 16; blockwise: % 128  torch._scaled_mm's K rule; 1x128 blocks
                                                                  of dy.T and x.T run along the tokens

By default a batch that breaks wgrad's rule is refused in forward (:func:`check_wgrad_tokens`). With
``Fp8Recipe(pad_tokens=True)`` the layer zero-pads the token dimension instead (:func:`token_rows`,
:func:`pad_rows`), and the results are EXACT:

* wgrad: zero rows of x and of dy add exact zeros to every fp32 sum of dW = dy.T @ x, and change no
  amax -- so neither the per-tensor current scales of x and dy nor, for blockwise, the scale of a
  partial last 1x128 block along the tokens change. Only the wgrad operands are padded, to the
  recipe's multiple: x (cast with x.T in forward, or, with ``save_fp8_input=False``, padded in
  backward) and dy.
* fprop and dgrad run on the first M rows of those same codes (a row's codes depend on its own values
  and the unchanged scale), so y and dx are those of the unpadded GEMMs, with their shapes; the
  blockwise GEMMs, which need M % 4, run on M rounded up to 4 rows (zero codes), outputs sliced. (A
  GEMM at the wgrad's padded size would multiply the same codes, but a GEMM library may sum a row in
  another fp32 order when the row count changes.)

Cost: a zero-padded copy of x and of dy, in their dtype (transient: made to be cast), and wgrad's FP8
codes of x.T at the padded size (saved for backward with ``save_fp8_input=True``); at most 15 (hybrid)
or 127 (blockwise) extra rows each. A token count that already fits makes no copy at all.

Example::

    from tutorial_lib.matmul.fp8_recipe import Fp8Recipe, token_rows
    recipe = Fp8Recipe("blockwise", pad_tokens=True)       # any token count: exact zero padding
    assert token_rows(17, recipe, wgrad=True) == (20, 128)   # fprop/dgrad rows, wgrad rows
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from tutorial_lib.matmul.scaled_mm import BACKENDS, FP8LayoutError

__all__ = ["RECIPES", "Fp8Recipe", "as_recipe", "check_wgrad_tokens", "pad_rows", "token_rows"]

RECIPES = ("hybrid", "blockwise")

_FPROP_TOKEN_MULTIPLE = {"hybrid": 1, "blockwise": 4}
_WGRAD_TOKEN_MULTIPLE = {"hybrid": 16, "blockwise": 128}


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How an :class:`~tutorial_lib.matmul.fp8_linear.Fp8Linear` quantizes its operands and which GEMMs it runs.

    ``pad_tokens=True`` accepts any token count: the wgrad operands (x, dy) are zero-padded along the tokens
    to the recipe's multiple (16 hybrid, 128 blockwise), exactly (module docstring), at the cost of a padded
    copy of x and of dy; the default refuses such a batch in forward with an :class:`FP8LayoutError`."""

    kind: str = "hybrid"  # "hybrid": per-tensor E4M3 x/W, E5M2 grads | "blockwise": E4M3, 1x128 / 128x128 scales
    save_fp8_input: bool = True  # save x as FP8 codes + scale (1 B/element) for wgrad, not x itself
    use_fast_accum: bool = False  # fprop GEMM in the tensor cores' fast accumulation (dgrad/wgrad never)
    pow2_scales: bool = False  # power-of-two scales (hybrid: rounded down; blockwise: rounded up)
    backend: str = "auto"  # scaled_mm backend: "auto", "torch", "triton" (blockwise), "emulated"
    pad_tokens: bool = False  # zero-pad the tokens to wgrad's multiple (exact; a padded copy of x and dy)

    def __post_init__(self):
        if self.kind not in RECIPES:
            raise ValueError(f"Fp8Recipe kind must be one of {RECIPES}, got {self.kind!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"Fp8Recipe backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.kind == "blockwise" and self.use_fast_accum:
            raise ValueError("the blockwise recipe has no fast accumulation (block scales promote every 128-wide "
                             "partial sum to fp32); use_fast_accum applies to the hybrid recipe")


def as_recipe(recipe: Fp8Recipe | str) -> Fp8Recipe:
    """``"hybrid"`` / ``"blockwise"`` -> the default :class:`Fp8Recipe` of that kind; a recipe passes through."""
    return recipe if isinstance(recipe, Fp8Recipe) else Fp8Recipe(kind=recipe)


def check_wgrad_tokens(m: int, recipe: Fp8Recipe) -> None:
    """wgrad contracts over the tokens (rows of x): they are its K, so they obey K's rule -- checked in forward."""
    need = _WGRAD_TOKEN_MULTIPLE[recipe.kind]
    if m % need:
        why = ("K and N multiples of 16" if recipe.kind == "hybrid" else
               "1x128 blocks of dy.T and x.T run along the tokens")
        raise FP8LayoutError(f"FP8 GEMM rule '{why}' broken by the weight-gradient GEMM dW = dy.T @ x, which "
                             f"contracts over the {m} tokens (rows of x). Fix: Fp8Recipe(pad_tokens=True) "
                             f"(zero-pads them to a multiple of {need}, exact), or pad the batch to a multiple of "
                             f"{need} rows" + (", or use the 'hybrid' recipe" if recipe.kind == "blockwise" else ""))


def _round_up(m: int, multiple: int) -> int:
    return -(-m // multiple) * multiple


def token_rows(m: int, recipe: Fp8Recipe, wgrad: bool) -> tuple[int, int]:
    """``(fprop rows, wgrad rows)`` for ``m`` tokens: the rows the fprop/dgrad GEMMs and the wgrad GEMM run on.
    ``(m, m)`` without ``pad_tokens`` (a wgrad that breaks its rule raises here; fprop's rule is the GEMM
    check's); with it, ``m`` rounded up to each GEMM's multiple (wgrad's only when ``wgrad``)."""
    if not recipe.pad_tokens:
        if wgrad:
            check_wgrad_tokens(m, recipe)
        return m, m
    return (_round_up(m, _FPROP_TOKEN_MULTIPLE[recipe.kind]),
            _round_up(m, _WGRAD_TOKEN_MULTIPLE[recipe.kind]) if wgrad else m)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A 2-D ``t`` with zero rows appended up to ``rows`` (a copy); ``t`` itself when it has ``rows`` already."""
    return t if t.shape[0] == rows else F.pad(t, (0, 0, 0, rows - t.shape[0]))
