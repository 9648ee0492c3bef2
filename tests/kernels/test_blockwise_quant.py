"""Triton FP8 blockwise quantize (1x128 blocks, 128x128 tiles) vs the torch reference: identical bytes and
scale bits.

Runs the interpreter on CPU and the compiled kernel on a GPU (``DEV``); the reference is always
``quantize_fp8_blockwise(..., backend="torch")``.
"""

from __future__ import annotations

import pytest
import torch
from tutorial_kernels.blockwise_quant import quantize_1x128, quantize_1x128_with_transpose, quantize_128x128

import tutorial_lib.quant.blockwise as blockwise
from tutorial_lib.quant.blockwise import (
    dequantize_fp8_blockwise,
    quantize_fp8_1x128_with_transpose,
    quantize_fp8_blockwise,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E4M3_GRID = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448


def _reference(x, pow2=False):
    return quantize_fp8_blockwise(x, (1, 128), pow2_scales=pow2, backend="torch")


def _assert_identical(got, ref):
    (data, s), (ref_data, ref_s) = got, ref
    assert data.dtype == torch.uint8 and s.dtype == torch.float32
    assert data.shape == ref_data.shape and s.shape == ref_s.shape
    assert data.is_contiguous() and s.is_contiguous()
    bad = (s.view(torch.int32) != ref_s.view(torch.int32)).nonzero()
    assert bad.numel() == 0, f"{len(bad)} scales differ, first at block {bad[0].tolist()}: {s[tuple(bad[0])]} vs " \
                             f"{ref_s[tuple(bad[0])]}"
    bad = (data != ref_data).nonzero()
    assert bad.numel() == 0, f"{len(bad)} bytes differ, first at {bad[0].tolist()}"


def _awkward(rows, cols, dtype, seed):
    """Rows spanning the dtype's range (for fp32/bf16 ~200 binades), outliers, scattered zeros and minus zeros,
    an all-zero and an all-minus-zero block, a subnormal-amax block, a block whose amax / 448 underflows fp32
    (fp32 only; zeros in the narrower types), NaN and +-inf blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    lo, hi = (-6, 3) if dtype == torch.float16 else (-30, 30)
    x = x * torch.logspace(lo, hi, rows, dtype=torch.float64).unsqueeze(1)
    x.view(-1)[7::301] *= 3000
    x.view(-1)[11::5] = 0.0  # zeros and minus zeros among non-zero values: each keeps its sign's code
    x.view(-1)[13::7] = -0.0
    x[1, 128:256] = 0
    x[2, 0:128] = -0.0
    x[3, 256:384] = torch.randn(128, generator=g, dtype=torch.float64) * 1e-39  # subnormal in fp32 and bf16
    x[4, 0:128] = torch.randint(-3, 4, (128,), generator=g) * 2.0**-149  # fp32: amax / 448 underflows to 0
    x[5, 130], x[6, 300], x[7, 20] = float("nan"), float("inf"), -float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bytes_and_scales_match_reference(dtype, pow2, layout):
    base = _awkward(37, 512, dtype, seed=40 + pow2)  # 37 rows: a partial program
    if layout == "transposed":  # x.t() of a contiguous tensor, as fp8_linear quantizes x for wgrad
        x = base.t().contiguous().to(DEV).t()
        assert x.stride() == (1, 37)
    elif layout == "sliced":  # every other row, 384 of 512 columns: no stride is 1 x the width
        x = torch.cat([base, base.flip(0)]).to(DEV)[::2, 128:]
    else:
        x = base.to(DEV)
    _assert_identical(quantize_1x128(x, pow2_scales=pow2), _reference(x, pow2))


def _tiles(dtype, seed):
    """3 x 2 tiles of 128x128 spanning the dtype's range, with an all-zero tile, a subnormal-amax tile,
    a tile whose amax / 448 underflows fp32 (fp32 only), a NaN tile and an inf tile."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-6, 3) if dtype == torch.float16 else (-30, 30)
    mags = torch.logspace(lo, hi, 6, dtype=torch.float64)[torch.randperm(6, generator=g)].view(3, 2)
    x = torch.randn(384, 256, generator=g, dtype=torch.float64) * mags.repeat_interleave(128, 0).repeat_interleave(
        128, 1)
    x.view(-1)[11::997] *= 3000
    x[0:128, 128:256] = 0
    x[128:256, 0:128] = torch.randn(128, 128, generator=g, dtype=torch.float64) * 1e-39
    x[128:256, 128:256] = torch.randint(-3, 4, (128, 128), generator=g) * 2.0**-149
    x[300, 7], x[260, 200] = float("nan"), -float("inf")
    return x.to(dtype)


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_128x128_tiles_match_reference(dtype, pow2, layout):
    base = _tiles(dtype, seed=50 + pow2)
    x = base.to(DEV) if layout == "contiguous" else base.t().contiguous().to(DEV).t()
    ref = quantize_fp8_blockwise(x, (128, 128), pow2_scales=pow2, backend="torch")
    got = quantize_128x128(x, pow2_scales=pow2)
    _assert_identical(got, ref)
    assert torch.isnan(got[1][2, 0]) and torch.isnan(got[1][2, 1]) and got[1][0, 1] == 1.0
    _assert_identical(quantize_fp8_blockwise(x.reshape(3, 128, 256) if layout == "contiguous" else x, (128, 128),
                                             pow2_scales=pow2, backend="triton"),
                      (ref[0].reshape(3, 128, 256), ref[1].reshape(3, 1, 2)) if layout == "contiguous" else ref)


@pytest.mark.parametrize("pow2", [False, True])
def test_ties_and_subnormals_round_as_torch(pow2):
    """Every E4M3 magnitude, every midpoint (ties to even) and its fp32 neighbours, in blocks anchored
    by 448 (scale_inv 1 for both rules, so x / scale_inv is the value itself)."""
    mids = (E4M3_GRID[1:] + E4M3_GRID[:-1]) / 2
    up, down = mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(0.0))
    vals = torch.cat([E4M3_GRID, mids, -mids, up, down, -up, torch.tensor([2.0**-10, 3 * 2.0**-11, 500.0])])
    n = -(-vals.numel() // 127)
    x = torch.zeros(n, 128)
    x[:, 0] = 448.0
    body = torch.zeros(n * 127)
    body[: vals.numel()] = vals.clamp(max=448.0)
    x[:, 1:] = body.view(n, 127)
    x = x.to(DEV)
    data, s = quantize_1x128(x, pow2_scales=pow2)
    assert (s == 1).all()
    _assert_identical((data, s), _reference(x, pow2))


def test_division_not_reciprocal_multiply():
    """Values where ``e4m3(x / s)`` and ``e4m3(x * (1 / s))`` differ (the quotient lands one fp32 ulp
    either side of an E4M3 tie): the kernel must divide, as the reference does."""
    amax = torch.tensor(448.0 * 1.1)
    s = amax / torch.tensor(448.0)
    targets = (E4M3_GRID[1:] + E4M3_GRID[:-1]) / 2 * s  # x whose quotient is near a midpoint
    cand = torch.stack([targets.nextafter(targets * 2 ** k) for k in (-1, 1)] + [targets]).flatten()
    for _ in range(3):
        cand = torch.cat([cand, cand.nextafter(cand * 2), cand.nextafter(cand / 2)]).unique()
    cand = cand[(cand > 0) & (cand < amax)]

    def e4m3(v):
        return v.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)

    differ = cand[e4m3(cand / s) != e4m3(cand * (1 / s))]
    assert differ.numel() >= 8, "the search found too few values where division and reciprocal differ"
    n = -(-differ.numel() // 127)
    x = torch.zeros(n, 128)
    x[:, 0] = amax
    body = torch.full((n * 127,), float(differ[0]))
    body[: differ.numel()] = differ
    x[:, 1:] = body.view(n, 127)
    x = x.to(DEV)
    _assert_identical(quantize_1x128(x), _reference(x))


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_near_float32_max_match_reference_and_decode_finite(dtype, pow2):
    """[256, 128] topped by fp32's (bf16's) largest value and 1.9375 * 2**127, the 1x128 amaxes sweeping the top
    binade's upper eighth: 1x128 (x and x.T's blocks), 128x128 and the one-read pair equal the reference bit
    for bit, pow2 scale_inv stop at 2**119 (448 * 2**120 is inf), and every block decodes finite."""
    g = torch.Generator().manual_seed(60)
    x = torch.rand(256, 128, generator=g, dtype=torch.float64) - 0.5
    x[:, 0] = (1 - torch.arange(256, dtype=torch.float64) % 128 / 1024) * (1 - 2 * (torch.arange(256) % 2))
    tops = torch.tensor([torch.finfo(dtype).max, 1.9375 * 2.0**127], dtype=torch.float64)
    x = (x * tops.repeat_interleave(128).unsqueeze(1)).to(dtype).to(DEV)
    cases = [(quantize_1x128(x, pow2_scales=pow2), _reference(x, pow2), (1, 128)),
             (quantize_1x128(x.t(), pow2_scales=pow2), _reference(x.t(), pow2), (1, 128)),
             (quantize_128x128(x, pow2_scales=pow2),
              quantize_fp8_blockwise(x, (128, 128), pow2_scales=pow2, backend="torch"), (128, 128))]
    rows, cols = quantize_1x128_with_transpose(x, pow2_scales=pow2)
    cases += [(rows, cases[0][1], (1, 128)), (cols, cases[1][1], (1, 128))]
    for got, ref, block in cases:
        _assert_identical(got, ref)
        assert torch.isfinite(dequantize_fp8_blockwise(*got, block=block)).all()
        assert not pow2 or got[1].max().item() == 2.0**119


def test_routing_and_shapes():
    x = _awkward(8, 384, torch.bfloat16, seed=41).reshape(2, 4, 384).to(DEV)
    for pow2 in (False, True):  # N-D input through the public function: flattened, then reshaped back
        got = quantize_fp8_blockwise(x, (1, 128), pow2_scales=pow2, backend="triton")
        assert got[0].shape == (2, 4, 384) and got[1].shape == (2, 4, 3)
        _assert_identical(got, _reference(x, pow2))
    v = x[0, 0]  # 1-D
    _assert_identical(quantize_fp8_blockwise(v, backend="triton"), _reference(v))
    d, s = quantize_1x128(torch.empty(0, 256, device=DEV))
    assert d.shape == (0, 256) and s.shape == (0, 2)


def test_auto_backend_uses_the_kernels_exactly_on_cuda(monkeypatch):
    calls = []

    def spy(kernel):
        def run(x, **kw):
            calls.append((kernel.__name__, tuple(x.shape)))
            return kernel(x, **kw)
        return run

    monkeypatch.setattr(blockwise, "quantize_1x128", spy(quantize_1x128))
    monkeypatch.setattr(blockwise, "quantize_128x128", spy(quantize_128x128))
    x = torch.randn(4, 256, device=DEV)
    quantize_fp8_blockwise(x)  # auto, 1x128
    quantize_fp8_blockwise(torch.randn(2, 128, 256, device=DEV), (128, 128))  # auto, 128x128 tiles, 3-D
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):  # fp64: refused (it would round twice)
        quantize_fp8_blockwise(x.double())
    assert calls == ([("quantize_1x128", (4, 256)), ("quantize_128x128", (256, 256))] if DEV == "cuda" else [])
    blockwise.BlockwiseFP8Quantizer((1, 128)).quantize(x)
    blockwise.BlockwiseFP8Quantizer((128, 128)).quantize(torch.randn(128, 384, device=DEV))
    assert len(calls) == (4 if DEV == "cuda" else 0)


def test_bad_input_gets_a_clear_error():
    with pytest.raises(ValueError, match=r"last dim 192 .* multiple of the 128-element"):
        quantize_1x128(torch.randn(4, 192, device=DEV))
    with pytest.raises(ValueError, match="2-D"):
        quantize_1x128(torch.randn(2, 4, 128, device=DEV))
    with pytest.raises(ValueError, match="2-D"):
        quantize_1x128(torch.randn(128, device=DEV))
    with pytest.raises(TypeError, match="takes"):
        quantize_1x128(torch.ones(4, 128, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="power of two"):
        quantize_1x128(torch.randn(4, 128, device=DEV), rows=3)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):  # every backend refuses fp64
        quantize_fp8_blockwise(torch.randn(128, 128, dtype=torch.float64), (128, 128), backend="triton")
    with pytest.raises(ValueError, match=r"rows 64 .* 128x128 tile"):
        quantize_128x128(torch.randn(64, 128, device=DEV))
    with pytest.raises(ValueError, match=r"last dim 64 .* multiple"):
        quantize_128x128(torch.randn(128, 64, device=DEV))
    with pytest.raises(ValueError, match="backend must be one of"):
        quantize_fp8_blockwise(torch.randn(4, 128), backend="cuda")
    with pytest.raises(ValueError, match="last dim 100"):  # the reference's own shape check comes first
        quantize_fp8_blockwise(torch.randn(4, 100, device=DEV), backend="triton")


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_with_transpose_equals_two_quantizes(dtype, pow2, layout):
    """x's 1x128 blocks AND x.T's from one read: each bit-identical to the reference of x and of x.t()."""
    x = _awkward(256, 384, dtype, seed=7).to(DEV)
    if layout == "transposed":  # a column-major view, as a caller might hand over dy.t()
        x = _awkward(384, 512, dtype, seed=8).to(DEV).t()
    rows, cols = quantize_1x128_with_transpose(x, pow2_scales=pow2)
    _assert_identical(rows, _reference(x, pow2))
    _assert_identical(cols, _reference(x.t(), pow2))
    assert cols[0].shape == (x.shape[1], x.shape[0]) and cols[1].shape == (x.shape[1], x.shape[0] // 128)


def test_with_transpose_routing_and_errors(monkeypatch):
    x = _awkward(128, 384, torch.bfloat16, seed=9).to(DEV)
    ref = quantize_fp8_1x128_with_transpose(x, backend="torch")
    for got in (quantize_fp8_1x128_with_transpose(x, backend="triton"), quantize_fp8_1x128_with_transpose(x),
                quantize_fp8_1x128_with_transpose(x, backend="triton", one_read=True)):
        _assert_identical(got[0], ref[0])
        _assert_identical(got[1], ref[1])
    calls = []
    monkeypatch.setattr(blockwise, "quantize_1x128_with_transpose",
                        lambda t, **kw: calls.append(tuple(t.shape)) or quantize_1x128_with_transpose(t, **kw))
    quantize_fp8_1x128_with_transpose(x)  # default: two 1x128 quantizes
    quantize_fp8_1x128_with_transpose(x, one_read=True)  # auto: the one-read kernel on CUDA only
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):  # fp64: refused, as by quantize_fp8_blockwise
        quantize_fp8_1x128_with_transpose(x.double(), one_read=True)
    assert calls == ([(128, 384)] if DEV == "cuda" else [])
    with pytest.raises(ValueError, match=r"rows 192 .* not a multiple of 128: x.T's 1x128 blocks"):
        quantize_1x128_with_transpose(torch.randn(192, 128, device=DEV))
    with pytest.raises(ValueError, match=r"last dim 64 .* multiple"):
        quantize_1x128_with_transpose(torch.randn(128, 64, device=DEV))
    with pytest.raises(ValueError, match="both dims multiples of 128"):
        quantize_fp8_1x128_with_transpose(torch.randn(100, 128))
    with pytest.raises(ValueError, match="both dims multiples of 128"):
        quantize_fp8_1x128_with_transpose(torch.randn(2, 128, 128))
    with pytest.raises(ValueError, match="Triton blockwise kernels quantize"):  # the one-read kernel's own check
        quantize_fp8_1x128_with_transpose(torch.randn(128, 128, dtype=torch.float64), backend="triton", one_read=True)
    (d, s), (dt, st) = quantize_1x128_with_transpose(torch.empty(0, 256, device=DEV))
    assert d.shape == (0, 256) and s.shape == (0, 2) and dt.shape == (256, 0) and st.shape == (256, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled kernel)")
@pytest.mark.parametrize("pow2", [False, True])
def test_compiled_kernel_is_identical_on_large_tensors(pow2):
    g = torch.Generator(device="cuda").manual_seed(42)
    x = (torch.randn(4096, 8192, device="cuda", generator=g) * 3).to(torch.bfloat16)
    x[::97, ::13] *= 1e4
    x[::3, ::2] = 0.0  # zeros and minus zeros in most blocks: each keeps its sign's code
    x[1::5, 1::3] = -0.0
    x[5, 1000] = float("nan")
    for v in (x, x.t(), x[:4000:3, 128:]):  # row-major, column-major (wgrad's x.t()), strided rows
        _assert_identical(quantize_1x128(v, pow2_scales=pow2), _reference(v, pow2))
    for w in (x, x.float(), x.t()):  # 128x128 tiles of a weight: bf16, fp32 master, transposed
        _assert_identical(quantize_128x128(w, pow2_scales=pow2),
                          quantize_fp8_blockwise(w, (128, 128), pow2_scales=pow2, backend="torch"))
    for v in (x, x.t()):  # x and x.T from one read (an FP8 linear layer's activation / gradient)
        rows, cols = quantize_1x128_with_transpose(v, pow2_scales=pow2)
        _assert_identical(rows, _reference(v, pow2))
        _assert_identical(cols, _reference(v.t(), pow2))


_AOT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import tutorial_kernels.blockwise_quant as k

def ptx(unit_stride, rows, pow2):
    # as the JIT specializes a real launch: 16-divisible pointers and sizes, the unit stride a constant
    sig = {"x_ptr": "*bf16", "data_ptr": "*u8", "scale_ptr": "*fp32", "M": "i32", "K": "i32", "stride_m": "i32",
           "stride_k": "i32", "size_bucket": "i32", "col_major": "i32"}
    del sig[unit_stride]
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, v) in enumerate(sig.items())
             if v.startswith("*") or n in ("M", "K", "stride_m", "stride_k")}
    consts = {unit_stride: 1, "ROWS": rows, "POW2": pow2}
    src = ASTSource(fn=k._quantize_1x128_kernel, signature={**sig, **{c: "constexpr" for c in consts}},
                    constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]

def ptx_128x128(pow2):
    sig = {"x_ptr": "*fp32", "data_ptr": "*u8", "scale_ptr": "*fp32", "M": "i32", "K": "i32", "stride_m": "i32"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(sig))}
    consts = {"stride_k": 1, "POW2": pow2}
    src = ASTSource(fn=k._quantize_128x128_kernel, signature={**sig, **{c: "constexpr" for c in consts}},
                    constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]

def ptx_with_transpose(pow2):
    sig = {"x_ptr": "*bf16", "data_ptr": "*u8", "scale_ptr": "*fp32", "data_t_ptr": "*u8", "scale_t_ptr": "*fp32",
           "M": "i32", "K": "i32", "stride_m": "i32", "size_bucket": "i32", "col_major": "i32"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n not in ("size_bucket", "col_major")}
    consts = {"stride_k": 1, "POW2": pow2}
    src = ASTSource(fn=k._quantize_1x128_with_transpose_kernel, signature={**sig, **{c: "constexpr" for c in consts}},
                    constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]

json.dump({"row_major": ptx("stride_k", 32, False), "row_major_pow2": ptx("stride_k", 32, True),
           "col_major": ptx("stride_m", 64, True), "tile_128x128": ptx_128x128(False),
           "tile_128x128_pow2": ptx_128x128(True), "with_transpose": ptx_with_transpose(False),
           "with_transpose_pow2": ptx_with_transpose(True)}, sys.stdout)
"""


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU the tests above run the compiled kernel itself")
def test_kernel_compiles_for_sm90_with_vector_access_and_exact_division(compile_ptx):
    """CPU CI never compiles a kernel: compile the compiled-mode code (TRITON_INTERPRET=0) to PTX for an
    H100/H200 and check what bit-identity and bandwidth rest on."""
    ptx = compile_ptx(_AOT, timeout=240)
    for name, code in ptx.items():
        assert "ld.global.v4" in code and "st.global.v4" in code, f"{name}: accesses are not vectorized"
        assert "cvt.rn.satfinite.e4m3x2.f32" in code, f"{name}: no hardware satfinite E4M3 conversion"
        assert ".ftz" not in code, f"{name}: flushes subnormals (tiny blocks would differ from torch)"
        assert "div.rn.f32" in code, f"{name}: the scale is not a correctly rounded division"
    for name in ("with_transpose", "with_transpose_pow2"):  # (with min.NaN/max.NaN in a kernel, Triton 3.6
        # garbles transposed byte stores: kernels/fp8_round.py's docstring)
        assert "min.NaN" not in ptx[name] and "max.NaN" not in ptx[name], f"{name}: holds min.NaN/max.NaN"
    # non-pow2 codes: the correctly rounded quotient from three FMAs per element (tutorial_kernels.scale_div;
    # its per-element division is only the branch for tiles holding a tiny scale); pow2 codes multiply by the
    # exact reciprocal and divide per block scale only. Elements per thread: 32 (row_major: 32 rows x 128 / 128
    # threads), 64 (a 128x128 tile over 256 threads; col_major: 64 rows), 128 (with_transpose: rows and columns).
    for name, per_thread in (("row_major", 32), ("tile_128x128", 64), ("with_transpose", 128)):
        assert ptx[name].count("fma.rn.f32") >= 3 * per_thread > ptx[name + "_pow2"].count("fma.rn.f32"), name
        assert ptx[name + "_pow2"].count("div.rn.f32") < per_thread, f"{name}_pow2 divides per element"
    assert ptx["col_major"].count("div.rn.f32") < 64, "col_major (pow2): divides per element"
