"""Triton NVFP4 dequantize vs the torch reference ``dequantize_nvfp4``: identical values (NaN where the
reference has NaN) for 1x16 blocks and 16x16 tiles, fp32 and bf16 output, every E2M1 code, every E4M3
scale byte, N-D input; clear errors for bad input. The interpreter runs on the CPU, the compiled
kernel on a GPU."""

from __future__ import annotations

import math

import pytest
import torch
import tutorial_kernels.nvfp4_dequantize as dequantize_module
from tutorial_kernels.grid_limits import CUDA_MAX_GRID
from tutorial_kernels.nvfp4_dequantize import nvfp4_dequantize

import tutorial_lib.quant.nvfp4 as nvfp4
from tutorial_lib.quant.nvfp4 import NVFP4Quantizer, dequantize_nvfp4, quantize_nvfp4

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, except that any NaN equals any NaN."""
    a, b = a.float(), b.float()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def _weights(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-2]).unsqueeze(1)
    x[0, :16] = 0  # an all-zero block
    x[1, 5] = float("nan")  # a NaN block
    return x


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_match_reference(block, dtype):
    x = _weights((48, 96), seed=1)
    # a finite global amax (as an all-reduced one would be): the NaN stays in its block
    data, scale, gsi = quantize_nvfp4(x, block, global_amax=x.nan_to_num().abs().amax())
    data, scale = data.to(DEV), scale.to(DEV)
    got = nvfp4_dequantize(data, scale, gsi.to(DEV), block, dtype=dtype)
    ref = dequantize_nvfp4(data, scale, gsi.to(DEV), block, dtype=dtype)
    assert got.dtype == dtype and got.shape == (48, 96)
    assert _same(got, ref)
    nan_rows = slice(0, 16) if block == (16, 16) else slice(1, 2)
    assert torch.isnan(got[nan_rows, :16]).all() and not torch.isnan(got[16:, 16:]).any()
    if block == (1, 16):
        assert (got[0, :16] == 0).all()


@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_every_code_and_every_scale_byte(block):
    """All 16 E2M1 codes in every byte position against all 256 E4M3 scale bytes (NaN, subnormals,
    448), with a global scale that makes some products subnormal in fp32 and in bf16."""
    rows = 256 if block == (1, 16) else 256 * 16
    codes = torch.arange(16, dtype=torch.uint8).repeat(rows, 1)  # 16 elements per row: one block
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).repeat(1, 2)  # K = 32: two blocks per row
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    scale = scale.repeat_interleave(1 if block == (1, 16) else 1).unsqueeze(1).repeat(1, 2)
    gsi = torch.tensor(2.0 ** -120)
    for dtype in (torch.float32, torch.bfloat16):
        got = nvfp4_dequantize(packed.to(DEV), scale.to(DEV), gsi.to(DEV), block, dtype=dtype)
        ref = dequantize_nvfp4(packed.to(DEV), scale.to(DEV), gsi.to(DEV), block, dtype=dtype)
        assert _same(got, ref), dtype


def test_nd_input_and_empty():
    x = _weights((2, 32, 64), seed=2)
    for block in ((1, 16), (16, 16)):
        data, scale, gsi = quantize_nvfp4(x, block)
        got = nvfp4_dequantize(data.to(DEV), scale.to(DEV), gsi.to(DEV), block, dtype=torch.bfloat16)
        assert _same(got, dequantize_nvfp4(data, scale, gsi, block, dtype=torch.bfloat16).to(DEV))
    out = nvfp4_dequantize(torch.empty(0, 8, dtype=torch.uint8, device=DEV), torch.empty(0, 1, dtype=torch.uint8,
                           device=DEV), torch.ones((), device=DEV))
    assert out.shape == (0, 16)


def test_several_row_and_column_tiles():
    """Ragged tiles in both directions (the interpreter takes up to 1024 rows a program): 2 x 3 programs."""
    x = _weights((1040, 160), seed=3)
    for block in ((1, 16), (16, 16)):
        data, scale, gsi = (t.to(DEV) for t in quantize_nvfp4(x, block))
        got = nvfp4_dequantize(data, scale, gsi, block, dtype=torch.bfloat16)
        assert _same(got, dequantize_nvfp4(data, scale, gsi, block, dtype=torch.bfloat16))


@pytest.mark.parametrize("shape", [(2048 * 2048 // 2,), (1, 65_536 * 32 + 8), (2, 65_536 * 32 + 8)])
def test_long_rows_launch_within_cuda_grid_limits(launch_recorder, shape):
    """One program per ROWS rows x 32 bytes, and the program count on grid axis 0: a flattened 2048x2048
    weight (1x16 blocks, one row of 2 MiB codes) is 65,536 column tiles, past the 65,535 CUDA allows on
    axis 1 (the launch would fail on a GPU, never in the interpreter)."""
    recorder = launch_recorder(dequantize_module, "_nvfp4_dequantize_kernel")
    data = torch.empty(shape, dtype=torch.uint8, device=DEV)
    scale = torch.empty((*shape[:-1], shape[-1] // 8), dtype=torch.uint8, device=DEV)
    assert nvfp4_dequantize(data, scale, torch.ones((), device=DEV)).shape == (*shape[:-1], 2 * shape[-1])
    (grid,) = recorder.grids
    assert all(n <= cap for n, cap in zip(grid, CUDA_MAX_GRID, strict=False)), grid
    m = math.prod(shape[:-1])
    r = 16 if DEV == "cuda" else max(16, 1 << (min(m, 1024) - 1).bit_length())  # the wrapper's rows per program
    assert math.prod(grid) == -(-m // r) * -(-shape[-1] // 32)  # the same number of programs


def test_bad_input_gets_a_clear_error():
    d, s, g = (t.to(DEV) for t in quantize_nvfp4(torch.randn(32, 64), (16, 16)))
    with pytest.raises(ValueError, match="does not match"):
        nvfp4_dequantize(d, s, g, (1, 16))
    with pytest.raises(ValueError, match=r"\(1, 16\) or \(16, 16\)"):
        nvfp4_dequantize(d, s, g, (1, 32))
    with pytest.raises(TypeError, match="produces"):
        nvfp4_dequantize(d, s, g, (16, 16), dtype=torch.float16)
    with pytest.raises(TypeError, match="global_scale_inv"):
        nvfp4_dequantize(d, s, g.double(), (16, 16))
    with pytest.raises(ValueError, match="contiguous"):
        nvfp4_dequantize(d.t().contiguous().t(), s, g, (16, 16))
    with pytest.raises(ValueError, match="16x16 blocks need at least 2 dims"):  # not an IndexError
        nvfp4_dequantize(d.reshape(-1), s.reshape(-1), g, (16, 16))
    with pytest.raises(ValueError, match="rows a multiple of 16"):
        nvfp4_dequantize(d[:8], s[:1], g, (16, 16))


def test_tensor_dequantize_uses_the_kernel_exactly_on_cuda(monkeypatch):
    calls = []

    def spy(*args, **kw):
        calls.append(kw.get("dtype"))
        return nvfp4_dequantize(*args, **kw)

    monkeypatch.setattr(nvfp4, "nvfp4_dequantize", spy)
    w = NVFP4Quantizer(block=(16, 16)).quantize(torch.randn(32, 64).to(DEV))
    ref = dequantize_nvfp4(*(w.raw_buffers()[k] for k in ("data", "scale_e4m3", "global_scale_inv")), (16, 16),
                           dtype=torch.bfloat16)
    assert _same(w.dequantize(torch.bfloat16), ref)
    w.dequantize(torch.float16)  # not a kernel dtype: the reference
    assert calls == ([torch.bfloat16] if DEV == "cuda" else [])


_AOT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import tutorial_kernels.nvfp4_dequantize as k

def ptx(out, tile_rows):
    sig = {"data_ptr": "*u8", "scale_ptr": "*u8", "gsi_ptr": "*fp32", "out_ptr": out, "M": "i32", "KB": "i32"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(sig))}
    consts = {"TILE_ROWS": tile_rows, "ROWS": 16, "OUT_BF16": out == "*bf16"}
    src = ASTSource(fn=k._nvfp4_dequantize_kernel, signature={**sig, **{c: "constexpr" for c in consts}},
                    constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]

json.dump({"bf16_1x16": ptx("*bf16", 1), "fp32_16x16": ptx("*fp32", 16)}, sys.stdout)
"""


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU the tests above run the compiled kernel itself")
def test_kernel_compiles_for_sm90(compile_ptx):
    """CPU CI never compiles a kernel: compile it (TRITON_INTERPRET=0) to PTX for an H100/H200."""
    ptx = compile_ptx(_AOT, timeout=240)
    assert ".ftz" not in ptx["fp32_16x16"], "flushes subnormals (tiny products would differ from torch)"
    assert "cvt.rn.bf16" in ptx["bf16_1x16"], "bf16 output is not rounded to nearest even"


def test_rows_must_be_a_positive_power_of_two():
    """rows = 0 passes a bare ``rows & (rows - 1)`` test; a compiled launch would divide by it."""
    data = torch.randint(0, 256, (2, 8), dtype=torch.uint8, device=DEV)
    scale = torch.randint(0x30, 0x40, (2, 1), dtype=torch.uint8, device=DEV)
    for rows in (0, 3, -4):
        with pytest.raises(ValueError, match=f"rows must be a power of two, got {rows}"):
            nvfp4_dequantize(data, scale, torch.tensor(0.5, device=DEV), rows=rows)
