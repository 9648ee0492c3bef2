"""``div_rn_by_scale`` (one reciprocal per block, then FMAs) vs torch's IEEE division, bit for bit.

The quotients a blockwise quantize forms: every element ``x`` of a block over its scale ``s`` (``|x| <= 448 s``
up to rounding; here up to 512 s). On the CPU a sample of scales runs in the interpreter; on a GPU the compiled
helper sees every bf16 value against the scale of every bf16 block amax.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from tutorial_kernels.scale_div import EXACT_FMA, div_rn_by_scale

from tutorial_lib.quant.blockwise import blockwise_scale_inv
from tutorial_lib.quant.per_tensor import quantize_per_tensor

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _divide_rows_kernel(x_ptr, s_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """Row r of x [R, N] over s[r]: one scale per row, as a kernel's block."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=ok, other=1.0)
    s = tl.load(s_ptr + row + tl.zeros([1], tl.int32))
    tl.store(out_ptr + row * N + cols, div_rn_by_scale(x, s), mask=ok)


def divide_rows(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    block = 1024
    _divide_rows_kernel[(x.shape[0], triton.cdiv(x.shape[1], block))](x, s, out, x.shape[1], BLOCK=block)
    return out


def _assert_bits_equal(x, s, got):
    """The IEEE quotient's bits wherever it can round to a non-zero E4M3 value (|q| >= 2**-11); below that the
    helper promises the E4M3 code only (+-0, the sign of x), which is checked everywhere."""
    want = x / s[:, None]
    for what, bad in (("quotients", (got.view(torch.int32) != want.view(torch.int32)) & (want.abs() >= 2.0**-11)),
                      ("E4M3 codes", quantize_per_tensor(got, 1.0) != quantize_per_tensor(want, 1.0))):
        bad = bad.nonzero()
        if bad.numel():
            r, c = bad[0].tolist()
            raise AssertionError(f"{len(bad)} of {x.numel()} {what} differ; first: x={x[r, c].item()!r} "
                                 f"s={s[r].item()!r}: got {got[r, c].item()!r}, IEEE {want[r, c].item()!r}")


def _bf16_values() -> torch.Tensor:
    """Every finite bf16 value (-0.0 included) as fp32."""
    v = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return v[v.isfinite()]


def _rows_within(values: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """One row per scale: the values with |x| <= 512 s, the rest replaced by s (a harmless quotient, 1)."""
    x = values.expand(s.numel(), -1).clone()
    return torch.where(x.abs() <= 512 * s[:, None], x, s[:, None].expand_as(x))


def test_every_bf16_value_over_sampled_block_scales():
    """bf16 tensors (activations, gradients) against scales from amaxes across the whole bf16 range:
    subnormal scales, the 2**-92 switch point's neighbours, 2**-127 (the underflow rule) and ordinary ones."""
    vals = _bf16_values()
    amax = vals[vals > 0]
    picks = amax[torch.linspace(0, amax.numel() - 1, 48 if DEV == "cpu" else 4096).long()]
    edges = torch.tensor([2.0**-92, 2.0**-83, 2.0**-84, 448 * 2.0**-92, 1.0, 448.0, 3.0e38])
    below_switch = torch.tensor([2.0**-92]).nextafter(torch.tensor(0.0))
    s = torch.cat([blockwise_scale_inv(torch.cat([picks, edges])), below_switch,
                   torch.tensor([2.0**-92, 2.0**-127, 2.0**-149, 1.1 * 2.0**-100])])
    x = _rows_within(vals, s)
    got = divide_rows(x.to(DEV), s.to(DEV)).cpu()
    _assert_bits_equal(x, s, got)


def test_signed_zeros_keep_their_sign():
    s = torch.tensor([1.0, 0.37, 2.0**-100, 2.0**-127], device=DEV)
    x = torch.tensor([0.0, -0.0, 1.0, -1.0], device=DEV).expand(4, 4).contiguous() * s[:, None]
    x[:, :2] = torch.tensor([0.0, -0.0], device=DEV)
    got = divide_rows(x, s).cpu()
    assert (got[:, :2].view(torch.int32) == torch.tensor([0, -(2**31)], dtype=torch.int32)).all()
    _assert_bits_equal(x.cpu(), s.cpu(), got)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_fp32_over_every_scale_exponent(seed):
    """fp32 blocks (weights, fp32 activations): scales with every exponent from 2**-149 to 2**118 and random
    mantissas, elements log-uniform over 60 binades below 448 s (tiny quotients flush to +-0 codes, so they
    are checked too), random signs."""
    g = torch.Generator().manual_seed(seed)
    e = torch.arange(-149, 119, dtype=torch.float64)  # s < 2**119: 448 s is finite
    s = (2.0**e * (1 + torch.rand(e.numel(), generator=g, dtype=torch.float64))).float()
    s = torch.where(s == 0, torch.tensor(2.0**-149), s)
    n = 512 if DEV == "cpu" else 1 << 16
    mag = 2.0 ** (-torch.rand(s.numel(), n, generator=g, dtype=torch.float64) * 60) * 448
    sign = torch.where(torch.rand(s.numel(), n, generator=g) < 0.5, -1.0, 1.0).double()
    x = (sign * mag * s.double()[:, None]).float()
    got = divide_rows(x.to(DEV), s.to(DEV)).cpu()
    _assert_bits_equal(x, s, got)


@pytest.mark.skipif(DEV == "cuda", reason="compiled kernels always take the FMA path")
def test_the_interpreter_runs_the_fma_path():
    """On the CPU the tests above must exercise the FMA sequence itself, not the per-element fallback division."""
    assert EXACT_FMA, "this Triton's interpreter rounds tl.fma twice: only the div_rn fallback was tested"


@pytest.mark.skipif(DEV != "cuda", reason="compiled helper: the exhaustive sweep takes seconds on a GPU only")
def test_every_bf16_value_over_every_bf16_amax_scale():
    """All ~2**31 (x, scale) pairs a bf16 block can produce: every finite bf16 x with |x| <= amax over
    amax / 448 for every positive finite bf16 amax."""
    vals = _bf16_values().cuda()
    amaxes = vals[vals > 0]
    for chunk in amaxes.split(512):
        s = blockwise_scale_inv(chunk)
        x = torch.where(vals.abs() <= chunk[:, None], vals, chunk[:, None])
        _assert_bits_equal(x, s, divide_rows(x, s))
