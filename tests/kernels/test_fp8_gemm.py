"""Triton FP8 blockwise GEMM vs THE float64 reference, within the derived error bound (not a tolerance).

On a CPU machine the kernel runs in Triton's interpreter (FP8 codes decoded exactly, fp32 dot:
the bound uses fp32's unit roundoff inside each 128-block); with CUDA the same tests run the
compiled kernel (FP8 tensor cores: the bound uses ``FP8_TENSOR_CORE_UNIT_ROUNDOFF`` inside a block),
and the GPU-only tests pin every tuning config and compare with torch's blockwise ``scaled_mm``.
"""

from __future__ import annotations

import pytest
import torch
import tutorial_kernels  # noqa: F401  (first: on CPU it sets TRITON_INTERPRET=1 before triton is imported)

# isort: split
from tutorial_kernels.fp8_gemm import blockwise_fp8_gemm, default_config, tuning_configs

from tutorial_lib.matmul.reference import (
    FP8_TENSOR_CORE_UNIT_ROUNDOFF,
    FP32_UNIT_ROUNDOFF,
    blockwise_fp8_gemm_reference,
    dequantize_blockwise_f64,
    gemm_error_bound,
)
from tutorial_lib.quant.blockwise import quantize_fp8_blockwise

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INNER_U = FP8_TENSOR_CORE_UNIT_ROUNDOFF if DEV == "cuda" else FP32_UNIT_ROUNDOFF
gpu = pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
# On a GPU the shape tests pin one config (every distinct shape would otherwise autotune, i.e. compile
# and time every config); the autotuner and every config get their own tests below.
# The pinned config is warp-specialized (two consumers of 64 rows each), so ragged M exercises its row split.
CFG = None if DEV == "cpu" else {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "USE_TMA": True, "PERSISTENT": True,
                                  "OCCUPANCY": 1, "WS": True, "num_warps": 4, "num_stages": 3}


def _operands(M, N, K, seed, outliers=False, b_block=(128, 128)):
    """Quantized activations [M, K] (1x128 blocks) and weight [N, K] (128x128 tiles, or ``b_block``) on DEV."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * 0.05
    if outliers:  # rows over 40 binades, outlier channels, one huge weight tile, a zero block
        x = x * torch.exp2(torch.randint(-20, 20, (M, 1), generator=g).float())
        x[:, 5::131] *= 1e3
        w[:128, 128:256] *= 1e4
        x[0, :128] = 0.0
    a, sa = quantize_fp8_blockwise(x.to(DEV), (1, 128))
    b, sb = quantize_fp8_blockwise(w.to(DEV), b_block)
    return a, sa, b, sb


def _check(out, a, sa, b, sb, inner_u=INNER_U) -> float:
    """Assert |out - ref| <= bound elementwise; return max |err| / bound (for the failure message and prints).
    ``b``'s scale block follows from the shape of ``sb``: [N/128, K/128] tiles or [N, K/128] 1x128 blocks."""
    b_block = (1, 128) if sb.shape[0] == b.shape[0] else (128, 128)  # N rows of scales, or N/128
    ref = blockwise_fp8_gemm_reference(a, sa, b, sb, out_dtype=torch.float64, b_block=b_block)
    bound = gemm_error_bound(dequantize_blockwise_f64(a, sa, (1, 128)).abs(),
                             dequantize_blockwise_f64(b, sb, b_block).abs(), a.shape[1], block_k=128,
                             inner_unit_roundoff=inner_u, out_dtype=out.dtype, reference=ref)
    err = (out.double() - ref).abs()
    ratio = float((err / bound).max())
    assert out.shape == ref.shape and bool((err <= bound).all()), f"max |err| / bound = {ratio:.3g}"
    return ratio


# --------------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("M, N, K, seed", [
    (70, 256, 384, 11),  # ragged M: the last row tile is masked
    (1, 128, 128, 12),   # one row, one k-block
    (33, 384, 256, 13),  # three weight tiles along N
    (128, 128, 512, 14),
])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)], ids=["b_tiles", "b_rows"])
def test_matches_reference_within_bound(M, N, K, seed, out_dtype, b_block):
    """b_tiles: fprop / dgrad (a weight's 128x128 tiles); b_rows: wgrad (b activation-like, 1x128 blocks)."""
    a, sa, b, sb = _operands(M, N, K, seed + (out_dtype == torch.float32) * 100, b_block=b_block)
    out = blockwise_fp8_gemm(a, sa, b, sb, out_dtype=out_dtype, config=CFG, b_block=b_block)
    assert out.dtype == out_dtype
    print(f"{M}x{N}x{K} {out_dtype} {b_block}: max |err| / bound = {_check(out, a, sa, b, sb):.3g}")


@pytest.mark.parametrize("seed", [21, 22])
def test_outlier_heavy_inputs_within_bound(seed):
    a, sa, b, sb = _operands(96, 256, 512, seed, outliers=True)
    assert float(sa.max() / sa[sa > 0].min()) > 2.0**30  # the scales really span many binades
    out = blockwise_fp8_gemm(a, sa, b, sb, out_dtype=torch.float32, config=CFG)
    print(f"outliers: max |err| / bound = {_check(out, a, sa, b, sb):.3g}")


def test_fp16_output_within_bound():
    a, sa, b, sb = _operands(40, 128, 256, 31)
    _check(blockwise_fp8_gemm(a, sa, b, sb, out_dtype=torch.float16, config=CFG), a, sa, b, sb)


def _integer_operands(M, N, K, seed, b_block):
    """Integer FP8 values in [-4, 4] with arbitrary fp32 scales (not powers of two) on DEV."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-4, 5, (M, K), generator=g).float().to(torch.float8_e4m3fn).view(torch.uint8)
    b = torch.randint(-4, 5, (N, K), generator=g).float().to(torch.float8_e4m3fn).view(torch.uint8)
    sa = torch.exp(torch.randn(M, K // 128, generator=g))
    sb = torch.exp(torch.randn(N // b_block[0], K // 128, generator=g))  # per tile, or per row of b (wgrad)
    return tuple(t.to(DEV) for t in (a, sa, b, sb))


@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)], ids=["b_tiles", "b_rows"])
def test_exact_block_sums_leave_only_the_fp32_promotion_error(b_block):
    """Integer FP8 values in [-4, 4]: every partial sum of a block is an integer below 2**11, exact in
    any accumulator keeping 13 fraction bits (tensor cores) or 24 (fp32). So the inner unit
    roundoff is 0 and the bound is the fp32 promotion alone -- ~(K/128 + 1) * 2**-24 relative, tight
    enough to catch a wrong scale index, a dropped block or a misplaced tile on both backends."""
    a, sa, b, sb = _integer_operands(80, 256, 512, 41, b_block)
    out = blockwise_fp8_gemm(a, sa, b, sb, out_dtype=torch.float32, config=CFG, b_block=b_block)
    ratio = _check(out, a, sa, b, sb, inner_u=0.0)
    print(f"exact block sums: max |err| / bound = {ratio:.3g}")


@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)], ids=["b_tiles", "b_rows"])
def test_scale_products_below_fp32_normals_stay_within_bound(b_block):
    """Tiny (fp32-normal) scales whose product sa * sb is an fp32 subnormal (~2**-140): the kernel rounds that
    product to a multiple of 2**-149 before multiplying a block sum of up to 128 * 448**2, an absolute error
    the bound's underflow term must cover (relative to the tiny outputs it is ~2**-10, far above fp32's)."""
    g = torch.Generator().manual_seed(45)
    M, N, K = 24, 128, 256
    a = torch.randint(0, 256, (M, K), generator=g, dtype=torch.uint8)
    b = torch.randint(0, 256, (N, K), generator=g, dtype=torch.uint8)
    a[(a & 0x7F) == 0x7F], b[(b & 0x7F) == 0x7F] = 0, 0  # no NaN codes
    sa = 1.3 * 2.0**-100 * (1 + torch.rand(M, K // 128, generator=g))
    sb = 1.7 * 2.0**-40 * (1 + torch.rand(N // b_block[0], K // 128, generator=g))
    a, sa, b, sb = (t.to(DEV) for t in (a, sa, b, sb))
    out = blockwise_fp8_gemm(a, sa, b, sb, out_dtype=torch.float32, config=CFG, b_block=b_block)
    print(f"subnormal scale products: max |err| / bound = {_check(out, a, sa, b, sb):.3g}")


def test_nan_block_poisons_only_its_rows():
    x = torch.randn(20, 256)
    x[3, 200] = float("nan")  # quantizes to a NaN scale and NaN codes in block (3, 1)
    a, sa = quantize_fp8_blockwise(x.to(DEV), (1, 128))
    b, sb = quantize_fp8_blockwise(torch.randn(128, 256).to(DEV), (128, 128))
    out = blockwise_fp8_gemm(a, sa, b, sb, out_dtype=torch.float32, config=CFG)
    assert out[3].isnan().all()
    keep = torch.arange(20, device=DEV) != 3
    _check(out[keep], a[keep], sa[keep], b, sb)


def test_out_argument_and_empty_m():
    a, sa, b, sb = _operands(16, 128, 128, 51)
    out = torch.full((16, 128), 7.0, dtype=torch.bfloat16, device=DEV)
    assert blockwise_fp8_gemm(a, sa, b, sb, out=out, config=CFG) is out
    _check(out, a, sa, b, sb)
    empty = blockwise_fp8_gemm(a[:0], sa[:0], b, sb)
    assert empty.shape == (0, 128) and empty.dtype == torch.bfloat16


@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)], ids=["b_tiles", "b_rows"])
def test_scale_strides_are_honoured(b_block):
    """Column-major scales (torch's scaled_mm convention; what wgrad's Triton path passes) give the same result
    as row-major ones."""
    a, sa, b, sb = _operands(40, 256, 384, 61, b_block=b_block)
    row = blockwise_fp8_gemm(a, sa, b, sb, out_dtype=torch.float32, config=CFG, b_block=b_block)
    col = blockwise_fp8_gemm(a, sa.t().contiguous().t(), b, sb.t().contiguous().t(), out_dtype=torch.float32,
                             config=CFG, b_block=b_block)
    assert sa.t().contiguous().t().stride() == (1, 40)
    assert torch.equal(row, col)


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU test_every_config_within_bound covers every variant")
@pytest.mark.parametrize("variant", [{"BLOCK_N": 256}, {"PERSISTENT": True, "OCCUPANCY": 2}],
                         ids=["block_n_256", "persistent"])
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)], ids=["b_tiles", "b_rows"])
def test_kernel_variants_in_the_interpreter(variant, b_block):
    a, sa, b, sb = _operands(70, 512, 384, 91, outliers=True, b_block=b_block)
    _check(blockwise_fp8_gemm(a, sa, b, sb, out_dtype=torch.float32, config={**default_config(), **variant},
                              b_block=b_block), a, sa, b, sb)


# --------------------------------------------------------------------------- argument errors


def _shifted(t, offset):
    """A contiguous copy of ``t`` that starts ``offset`` bytes into its allocation (which is 16-byte aligned)."""
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    out = buf[offset:].view(t.shape)
    out.copy_(t)
    return out


def _good(M=8, N=128, K=256):
    a = torch.zeros(M, K, dtype=torch.uint8, device=DEV)
    b = torch.zeros(N, K, dtype=torch.uint8, device=DEV)
    return a, torch.ones(M, K // 128, device=DEV), b, torch.ones(N // 128, K // 128, device=DEV)


@pytest.mark.parametrize("break_it, match", [
    (lambda a, sa, b, sb: (a[:, :200].contiguous(), torch.ones(8, 1, device=DEV), b[:, :200].contiguous(),
                           torch.ones(1, 1, device=DEV)), "K = 200 is not a multiple of 128"),
    (lambda a, sa, b, sb: (a, sa, b[:100].contiguous(), sb), "N = 100 is not a multiple of 128"),
    (lambda a, sa, b, sb: (a, sa, b[:, :128].contiguous(), sb), "disagree on K"),
    (lambda a, sa, b, sb: (a.view(torch.float8_e4m3fn), sa, b, sb), "a_data must be a 2-d uint8"),
    (lambda a, sa, b, sb: (a, sa, b.to(torch.int8), sb), "b_data must be a 2-d uint8"),
    (lambda a, sa, b, sb: (a, sa.half(), b, sb), "a_scale_inv must be float32"),
    (lambda a, sa, b, sb: (a, sa, b, sb.double()), "b_scale_inv must be float32"),
    (lambda a, sa, b, sb: (a, sa[:, :1], b, sb), r"a_scale_inv must have shape \(8, 2\)"),
    (lambda a, sa, b, sb: (a, sa, b, sb.t()), r"b_scale_inv must have shape \(1, 2\)"),
    (lambda a, sa, b, sb: (torch.zeros(256, 8, dtype=torch.uint8, device=DEV).t(), sa, b, sb), "row-major"),
    (lambda a, sa, b, sb: (_shifted(a, 8), sa, b, sb), "a_data must start at a 16-byte-aligned address"),
    (lambda a, sa, b, sb: (a, sa, _shifted(b, 1), sb), "b_data must start at a 16-byte-aligned address"),
])
def test_bad_operands_raise_naming_the_rule(break_it, match):
    with pytest.raises(ValueError, match=match):
        blockwise_fp8_gemm(*break_it(*_good()))


def test_bad_b_block_and_its_scale_shape_raise_naming_the_rule():
    a, sa, b, sb = _good()
    with pytest.raises(ValueError, match=r"b_scale_inv must have shape \(128, 2\) \(one scale per 1x128 block of b\)"):
        blockwise_fp8_gemm(a, sa, b, sb, b_block=(1, 128))  # 128x128 tile scales given for 1x128 blocks
    with pytest.raises(ValueError, match=r"b_block must be one of"):
        blockwise_fp8_gemm(a, sa, b, sb, b_block=(32, 128))
    with pytest.raises(ValueError, match="output tiles must tile N"):
        blockwise_fp8_gemm(a, sa, b[:64].contiguous(), torch.ones(64, 2, device=DEV), b_block=(1, 128))


def test_bias_is_checked_and_added_to_the_fp32_result_before_rounding():
    """The kernel's epilogue bias: fp32 result + bias, one rounding (the blockwise GEMM tests of
    ``tests/matmul/test_scaled_mm.py`` check its exact value on integer operands, both pairings)."""
    a, sa, b, sb = _operands(16, 128, 128, 52)
    bias = torch.randn(128, device=DEV).to(torch.bfloat16) * 8
    acc = blockwise_fp8_gemm(a, sa, b, sb, out_dtype=torch.float32, config=CFG)
    out = blockwise_fp8_gemm(a, sa, b, sb, bias=bias, config=CFG)
    assert torch.equal(out, (acc + bias.float()).to(torch.bfloat16))
    for bad, match in ((torch.zeros(127, device=DEV, dtype=torch.bfloat16), "1-d tensor of the N = 128"),
                       (torch.zeros(128, device=DEV), "contiguous torch.bfloat16 tensor"),
                       (torch.zeros(256, device=DEV, dtype=torch.bfloat16)[::2], "contiguous torch.bfloat16")):
        with pytest.raises(ValueError, match=match):
            blockwise_fp8_gemm(a, sa, b, sb, bias=bad)


def test_bad_out_and_out_dtype_raise():
    args = _good()
    with pytest.raises(ValueError, match="out_dtype must be one of"):
        blockwise_fp8_gemm(*args, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        blockwise_fp8_gemm(*args, out=torch.empty(8, 128, device=DEV))  # fp32 out for a bf16 result
    with pytest.raises(ValueError, match="config BLOCK_N = 256 does not divide N = 128"):
        blockwise_fp8_gemm(*args, config={**default_config(), "BLOCK_N": 256})


# --------------------------------------------------------------------------- compiled code


_AOT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import tutorial_kernels.fp8_gemm as k

sig = {"a_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "b_ptr": "*fp8e4nv", "sb_ptr": "*fp32", "c_ptr": "*bf16",
       "bias_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "s_am": "i32", "s_ak": "i32", "s_bn": "i32",
       "s_bk": "i32"}
out = {}
for tma in (False, True):
    consts = {"BLOCK_M": 128, "BLOCK_N": 128, "GROUP_M": 8, "USE_TMA": tma, "PERSISTENT": False, "OCCUPANCY": 1,
              "INTERPRETED": False, "OUT_BF16": True, "WS": False, "B_ROWS": False, "HAS_BIAS": False, "K_BLOCKS": 0}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if sig[n].startswith("*") or n in "NK"}
    src = ASTSource(fn=k._blockwise_fp8_gemm_kernel, signature={**sig, **{c: "constexpr" for c in consts}},
                    constexprs=consts, attrs=attrs)
    out["tma" if tma else "pointers"] = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                                       options={"num_warps": 8, "num_stages": 4}).asm["ptx"]
consts = {**consts, "BLOCK_N": 256, "PERSISTENT": True, "WS": True, "HAS_BIAS": True}  # warp-specialized, bias
src = ASTSource(fn=k._blockwise_fp8_gemm_kernel, signature={**sig, **{c: "constexpr" for c in consts}},
                constexprs=consts, attrs=attrs)
out["ws"] = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2}).asm["ptx"]
consts = {**consts, "B_ROWS": True, "HAS_BIAS": False}  # the same, with wgrad's per-row scales of b
src = ASTSource(fn=k._blockwise_fp8_gemm_kernel, signature={**sig, **{c: "constexpr" for c in consts}},
                constexprs=consts, attrs=attrs)
out["ws_rows"] = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4, "num_stages": 2}).asm["ptx"]
print(json.dumps(out))
"""


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU the tests above run the compiled kernel itself")
def test_compiled_kernel_uses_fp8_tensor_cores(compile_ptx):
    """CPU CI never compiles the kernel; compile it for sm_90 and check the dot is an FP8 wgmma
    (E4M3 x E4M3 -> fp32, 4 instructions of k = 32 per 128-block) and the TMA variant uses TMA; the
    warp-specialized 128 x 256 config (compiled with the epilogue's bias) runs 3 warpgroups (a TMA producer, two
    consumers that each issue the 2 x 4 wgmmas of their 64 rows, with registers moved to them by setmaxnreg)."""
    ptx = compile_ptx(_AOT, timeout=300)
    for name in ("tma", "pointers"):
        assert ptx[name].count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") == 4, name
    assert "cp.async.bulk.tensor" in ptx["tma"] and "cp.async.bulk.tensor" not in ptx["pointers"]
    ws = ptx["ws"]
    assert ".reqntid 384" in ws and "setmaxnreg.inc" in ws and "cp.async.bulk.tensor" in ws
    assert ws.count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") == 2 * 2 * 4
    rows = ptx["ws_rows"]  # B's scales per row (wgrad): the same warp-specialized FP8 schedule
    assert ".reqntid 384" in rows and "setmaxnreg.inc" in rows
    assert rows.count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3") == 2 * 2 * 4


# --------------------------------------------------------------------------- GPU only


_ALL_CONFIGS = [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                for c in tuning_configs(all_variants=True)]


def _cfg_id(c) -> str:
    if c is None:
        return "autotuned"
    return (f"{c['BLOCK_M']}x{c['BLOCK_N']}w{c['num_warps']}s{c['num_stages']}{'tma' * c['USE_TMA']}"
            f"{'P' + str(c['OCCUPANCY']) if c['PERSISTENT'] else ''}g{c['GROUP_M']}{'ws' * c['WS']}")


@gpu
@pytest.mark.parametrize("cfg", _ALL_CONFIGS, ids=_cfg_id)
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)], ids=["b_tiles", "b_rows"])
def test_every_config_within_bound(cfg, b_block):
    # M = 304: ragged for every BLOCK_M; M, N, K/128 multiples of 16 and bf16 out: the same compiled
    # specialization as the benchmark's shapes (Triton specializes integer arguments on % 16)
    a, sa, b, sb = _operands(304, 512, 2048, 71, outliers=True, b_block=b_block)
    _check(blockwise_fp8_gemm(a, sa, b, sb, config=cfg, b_block=b_block), a, sa, b, sb)


@gpu
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)], ids=["b_tiles", "b_rows"])
def test_autotuned_within_bound(b_block):
    a, sa, b, sb = _operands(304, 512, 2048, 72, b_block=b_block)
    _check(blockwise_fp8_gemm(a, sa, b, sb, b_block=b_block), a, sa, b, sb)


@gpu
@pytest.mark.parametrize("cfg", [None, *_ALL_CONFIGS], ids=_cfg_id)
@pytest.mark.parametrize("b_block", [(128, 128), (1, 128)], ids=["b_tiles", "b_rows"])
def test_every_config_exact_on_integer_blocks(cfg, b_block):
    """The exact integer-block test (bound = the fp32 promotion alone) for every config and the autotuner's
    choice: the Gaussian tests' bound (tensor cores' unit roundoff inside a block) is loose enough to miss a
    dropped k-block or a scale read from a neighbouring tile; this one is not. Shapes as the benchmark's."""
    a, sa, b, sb = _integer_operands(304, 512, 2048, 73, b_block)
    out = blockwise_fp8_gemm(a, sa, b, sb, out_dtype=torch.float32, config=cfg, b_block=b_block)
    _check(out, a, sa, b, sb, inner_u=0.0)


def _torch_blockwise(a, sa, b, sb, out_dtype=torch.float32):
    """torch's blockwise scaled_mm on our buffers: scale_a [M, K/128] column-major, mat_b = b.T [K, N],
    scale_b = sb.T [K/128, N/128] (strides (1, K/128)); scales are dequantization multipliers."""
    from torch.nn.functional import ScalingType, scaled_mm

    return scaled_mm(a.view(torch.float8_e4m3fn), b.view(torch.float8_e4m3fn).t(), sa.t().contiguous().t(),
                     ScalingType.BlockWise1x128, sb.t(), ScalingType.BlockWise128x128, output_dtype=out_dtype)


@gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_torch_blockwise_scaled_mm_agrees(out_dtype):
    """torch's blockwise scaled_mm takes DEQUANTIZATION multipliers (our scale_inv): with them it meets
    the reference's bound, with their reciprocals it is far off; ours and torch's agree within the sum
    of both bounds (they differ only in accumulation order)."""
    pytest.importorskip("torch.nn.functional", reason="needs torch.nn.functional.scaled_mm")
    from torch.nn import functional

    if not hasattr(functional, "scaled_mm"):
        pytest.skip("this torch has no torch.nn.functional.scaled_mm")
    a, sa, b, sb = _operands(256, 384, 1024, 81, outliers=True)
    try:
        theirs = _torch_blockwise(a, sa, b, sb, out_dtype)
    except (RuntimeError, ValueError) as exc:
        if out_dtype == torch.float32:
            pytest.skip(f"torch blockwise scaled_mm has no fp32 output here: {exc}")
        raise
    r_theirs = _check(theirs, a, sa, b, sb)
    ours = blockwise_fp8_gemm(a, sa, b, sb, out_dtype=out_dtype, config=CFG)
    r_ours = _check(ours, a, sa, b, sb)
    ref = blockwise_fp8_gemm_reference(a, sa, b, sb, out_dtype=torch.float64)
    bound = gemm_error_bound(dequantize_blockwise_f64(a, sa, (1, 128)).abs(),
                             dequantize_blockwise_f64(b, sb, (128, 128)).abs(), 1024, block_k=128,
                             inner_unit_roundoff=INNER_U, out_dtype=out_dtype, reference=ref)
    assert bool(((ours.double() - theirs.double()).abs() <= 2 * bound).all())
    wrong = _torch_blockwise(a, 1 / sa, b, 1 / sb, out_dtype)
    assert float((wrong.double() - ref).abs().max()) > 1e3 * float(bound.max())
    print(f"torch blockwise {out_dtype}: max |err| / bound: torch {r_theirs:.3g}, ours {r_ours:.3g}")
