"""The float64 GEMM references' own contract: their argument errors, the row-wise scale shapes they accept,
and the inputs for which ``gemm_error_bound`` has no bound to give."""

from __future__ import annotations

import pytest
import torch

from tutorial_lib.matmul import reference as R
from tutorial_lib.quant.formats import decode
from tutorial_lib.quant.per_tensor import cast_current_scaling

_CODES = torch.randint(0, 0x7F, (4, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("a, b, sa, match", [
    (_CODES.float(), _CODES, 1.0, r"a_data must be a 2-d uint8 tensor of FP8 codes, got torch.float32 \(4, 256\)"),
    (_CODES, _CODES[0], 1.0, r"b_data must be a 2-d uint8 tensor of FP8 codes, got torch.uint8 \(256,\)"),
    (_CODES, _CODES[:, :128], 1.0, r"a_data \[M, K\] = \(4, 256\) and b_data \[N, K\] = \(4, 128\) disagree on K"),
    (_CODES, _CODES, torch.ones(3), r"a_scale_inv must hold one value .* \(4, row-wise\), got shape \(3,\)"),
    (_CODES, _CODES, torch.ones(2, 2), r"a_scale_inv must hold .* \(4, row-wise\), got shape \(2, 2\)"),
])
def test_per_tensor_reference_names_the_bad_operand(a, b, sa, match):
    with pytest.raises(ValueError, match=match):
        R.per_tensor_fp8_gemm_reference(a, sa, b, 1.0)


def test_rowwise_scales_as_vector_column_or_row_equal_the_exact_product():
    """Row-wise scales given as [rows], [rows, 1] or [1, rows] are the same scales; with power-of-two scales
    and K <= 1024 the reference is exactly the float64 product of the dequantized operands."""
    g = torch.Generator().manual_seed(1)
    rows_a = [cast_current_scaling(torch.randn(1, 256, generator=g) * 10 ** i, pow2_scales=True) for i in range(-2, 3)]
    rows_b = [cast_current_scaling(torch.randn(1, 256, generator=g) * 3 ** i, "e5m2", pow2_scales=True)
              for i in range(-3, 4)]
    a, sa = torch.cat([r.data for r in rows_a]), torch.stack([r.scale_inv for r in rows_a])  # [5, 256], [5]
    b, sb = torch.cat([r.data for r in rows_b]), torch.stack([r.scale_inv for r in rows_b])  # [7, 256], [7]
    exact = (decode(a, "e4m3").double() * sa.double()[:, None]) @ (decode(b, "e5m2").double() * sb.double()[:, None]).T
    for shape_a, shape_b in (((5,), (7,)), ((5, 1), (1, 7)), ((1, 5), (7, 1))):
        ref = R.per_tensor_fp8_gemm_reference(a, sa.reshape(shape_a), b, sb.reshape(shape_b), "e4m3", "e5m2",
                                              out_dtype=torch.float64)
        assert torch.equal(ref, exact)
    with pytest.raises(ValueError, match=r"b_scale_inv must hold .* \(7, row-wise\), got shape \(7, 2\)"):
        R.per_tensor_fp8_gemm_reference(a, sa, b, torch.ones(7, 2))
    with pytest.raises(ValueError, match=r"scale_inv must hold .* \(5, row-wise\), got shape \(4,\)"):
        R.dequantize_per_tensor_f64(a, torch.ones(4))


_A, _B = torch.rand(4, 256, dtype=torch.float64), torch.rand(8, 256, dtype=torch.float64)


@pytest.mark.parametrize("a, K, kw, match", [
    (_A, 128, {}, r"must both have K = 128 columns, got \(4, 256\) and \(8, 256\)"),
    (_A[0], 256, {}, r"must both have K = 256 columns, got \(256,\) and \(8, 256\)"),
    (_A, 256, {"block_k": 96}, r"K = 256 is not a multiple of block_k = 96"),
    (_A, 256, {"block_k": 0}, r"block_k must be a positive int or None, got 0"),
    (_A, 256, {"block_k": -128}, r"block_k must be a positive int or None, got -128"),
    (_A, 256, {"block_k": 128, "inner_unit_roundoff": -1e-3}, r"inner_unit_roundoff must be in \[0, 1\), got -0.001"),
    (_A, 256, {"block_k": 128, "inner_unit_roundoff": 2.0**-6}, r"no error bound: n \* u = 128 \* 0.015625 >= 1"),
    (_A, 256, {"inner_unit_roundoff": 2.0**-8}, r"no error bound: n \* u = 258 \* 0.00390625 >= 1"),
])
def test_gemm_error_bound_refuses_arguments_it_has_no_bound_for(a, K, kw, match):
    """A wrong K, a block_k that does not tile K (or is not a block length at all), a negative unit roundoff
    (it would make the bound negative) and n * u >= 1 (gamma is undefined) each raise a ValueError."""
    with pytest.raises(ValueError, match=match):
        R.gemm_error_bound(a, _B, K, **kw)


@pytest.mark.parametrize("scales", [(1.2345e-38, 2.0**100), (1.37 * 2.0**-100, 1.91 * 2.0**-40)])
def test_a_scale_product_below_fp32_normals_stays_within_the_bound(scales):
    """sa * sb below 2**-126: formed first (the kernels' order, and the emulation's), it errs by 2**-150 times the
    sum it scales, which the bound's underflow terms cover; ``(acc * sa) * sb`` would multiply acc * sa's
    underflow error by sb (1e4x the bound at the first pair)."""
    from tutorial_lib.matmul.emulation import blockwise_emulated, scaled_emulated
    from tutorial_lib.quant.blockwise import quantize_fp8_blockwise

    dequantize_blockwise_f64, gemm_error_bound = R.dequantize_blockwise_f64, R.gemm_error_bound
    s_a, s_b = scales
    g = torch.Generator().manual_seed(9)
    a, sa = quantize_fp8_blockwise(torch.randn(4, 256, generator=g), (1, 128))
    b, sb = quantize_fp8_blockwise(torch.randn(128, 256, generator=g), (128, 128))
    a, b = torch.zeros_like(a), torch.zeros_like(b)  # one E4M3 subnormal 2**-9 per row and block: each block sum
    a[:, ::128], b[:, ::128] = 1, 1  # is 2**-18, so acc * sa alone would fall deep below fp32's normals
    sa, sb = torch.full_like(sa, s_a), torch.full_like(sb, s_b)
    A, B = dequantize_blockwise_f64(a, sa, (1, 128)), dequantize_blockwise_f64(b, sb, (128, 128))
    err = (blockwise_emulated(a, sa, b, sb, 128, torch.float32).double() - A @ B.T).abs()
    assert (err <= gemm_error_bound(A.abs(), B.abs(), 256, block_k=128)).all()

    codes_a = torch.randint(0, 126, (4, 256), dtype=torch.uint8, generator=g)  # finite E4M3 codes, both signs
    codes_b = torch.randint(128, 254, (256, 8), dtype=torch.uint8, generator=g)
    codes_a[0], codes_b[:, 0] = 0x7E, 0x7E  # 448s: a sum of 256 * 448**2 under a subnormal scale product
    ta, tb = torch.tensor(s_a), torch.tensor(s_b)
    Ad = codes_a.view(torch.float8_e4m3fn).double() * s_a
    Bd = codes_b.view(torch.float8_e4m3fn).double() * s_b
    err = (scaled_emulated(codes_a, "e4m3", codes_b, "e4m3", ta, tb, torch.float32).double() - Ad @ Bd).abs()
    assert (err <= gemm_error_bound(Ad.abs(), Bd.abs().T, 256)).all()
