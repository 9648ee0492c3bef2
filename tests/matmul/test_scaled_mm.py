"""The scaled-GEMM contract (``tutorial_lib.matmul.scaled_mm``): every path against THE float64 reference.

References: ``tutorial_lib.matmul.reference`` (``per_tensor_fp8_gemm_reference`` for per-tensor and
row-wise scales, ``blockwise_fp8_gemm_reference`` for 1x128 x 128x128; the 1x128 x 1x128 product is
the float64 product of ``dequantize_blockwise_f64`` of both operands). They multiply the dequantized
operands in float64, where every FP8 product and every 128-element block sum is exact.

The bound (``reference.gemm_error_bound``, derived in that module's docstring). With
``P = |A| @ |B|`` (dequantized magnitudes) and ``gamma(n, u) = n u / (1 - n u)``:

* one accumulation over K, scales applied after it (per-tensor, row-wise):
  ``|acc - ref| <= gamma(K + 2, u_acc) * P`` -- K - 1 additions and 2 scale products;
* blockwise: each 128-product block summed with ``u_in``, scaled, added in fp32:
  ``|acc - ref| <= ((1 + gamma(128, u_in)) (1 + gamma(K/128 + 1, 2**-24)) - 1) * P``;
* plus the final rounding to the output dtype, ``u_out * (|ref| + e_acc)`` (2**-8 bf16, 0 fp32).

``u_acc = u_in = 2**-24`` wherever the sums are fp32: the emulation, torch's CPU ``_scaled_mm``,
the Triton kernel in the interpreter. FP8 products are exact in fp32 (3 + 3 mantissa bits, and
the smallest product 2**-25 is an fp32 normal), so on CPU all backends differ only by the order
of the fp32 additions, which this bound covers. On a GPU the FP8 tensor cores accumulate inside an
MMA with about 13 fraction bits, not fp32: there ``u = reference.FP8_TENSOR_CORE_UNIT_ROUNDOFF``
(2**-12, a model with a factor ~2 of margin), for per-tensor GEMMs over the whole K (the promotion
interval of cuBLAS is not documented, so no shorter chain is assumed), for blockwise over 128.

Independent of any accumulator: ``test_integer_operands_are_exact_on_every_path`` multiplies small
integers with power-of-two scales, whose every partial sum fits in 12 bits, so every path on every
device must return the reference EXACTLY -- a layout mistake cannot hide inside a tolerance.
"""

import pytest
import torch
import tutorial_kernels

from tutorial_lib.matmul import reference as R
from tutorial_lib.matmul import scaled_mm as scaled_mm_module
from tutorial_lib.matmul.scaled_mm import (
    GEMM_CALLS,
    FP8LayoutError,
    blockwise_mm,
    blockwise_tensor_cores,
    emulated_mm,
    fp8_mm,
    fp8_mm_rowwise,
    fp8_tensor_cores,
    quantize_rowwise,
    resolve_backend,
)
from tutorial_lib.quant.blockwise import BlockwiseFP8Quantizer, FP8Blockwise1x128Tensor, FP8BlockwiseTensor
from tutorial_lib.quant.fallback import FALLBACKS, reset_counters, strict_dispatch
from tutorial_lib.quant.float8 import CurrentScaling, Float8Tensor
from tutorial_lib.quant.registry import make_quantizer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PAIRS = [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")]


def _backends(scaling: str, device: str) -> list[str]:
    """Every backend that can run ``scaling`` on ``device`` here."""
    if scaling == "tensorwise":  # torch's CPU _scaled_mm too: per-tensor scales only
        return ["emulated", "torch"] if device == "cpu" or fp8_tensor_cores(device) else ["emulated"]
    if scaling == "rowwise":
        return ["emulated", "torch"] if device != "cpu" and fp8_tensor_cores(device) else ["emulated"]
    out = ["emulated"]
    if tutorial_kernels.interpreted() if device == "cpu" else fp8_tensor_cores(device):  # both blockwise pairings
        out.append("triton")
    if device != "cpu" and blockwise_tensor_cores(device):
        out.append("torch")
    return out


def _cases(scaling: str) -> list[tuple[str, str]]:
    return [(d, b) for d in DEVICES for b in _backends(scaling, d)]


def _inner_u(device: str, backend: str) -> float:
    """Unit roundoff of the accumulator: fp32 on CPU and in the emulation, the FP8 tensor-core model on GPU."""
    hardware = device != "cpu" and backend in ("torch", "triton")
    return R.FP8_TENSOR_CORE_UNIT_ROUNDOFF if hardware else R.FP32_UNIT_ROUNDOFF


def _spread(shape, seed: int, device: str) -> torch.Tensor:
    """Gaussians times 2**[-6, 6]: 13 binades, so the casts exercise subnormals as well as the top of the range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 7, shape, generator=g).float())
    return x.to(device)


def _abs_f64(data: torch.Tensor, scale_inv: torch.Tensor, fmt: str) -> torch.Tensor:
    """|dequantized values| in float64, per-tensor or row-wise scale (magnitudes for the bound only)."""
    return R.dequantize_per_tensor_f64(data, scale_inv, fmt).abs()


def _assert_within(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    err = (out.double() - ref).abs()
    worst = float((err - bound).max())
    assert worst <= 0, f"error exceeds the derived bound by {worst:.3g} (max err {float(err.max()):.3g})"


# ----------------------------------------------------------------------------- numerics vs the reference


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmts", PAIRS, ids=lambda p: "x".join(p))
@pytest.mark.parametrize("device,backend", _cases("tensorwise"))
def test_per_tensor_paths_match_the_reference(device, backend, fmts, out_dtype):
    m, k, n = 24, 256, 48
    a = CurrentScaling(fmts[0]).quantize(_spread((m, k), 1, device))
    w = CurrentScaling(fmts[1]).quantize(_spread((n, k), 2, device))
    fast = [False, True] if device != "cpu" and backend == "torch" else [False]
    for use_fast_accum in fast:
        out = fp8_mm(a, w.t(), out_dtype=out_dtype, backend=backend, use_fast_accum=use_fast_accum)
        assert out.shape == (m, n) and out.dtype == out_dtype
        ab, wb = a.raw_buffers(), w.raw_buffers()
        ref = R.per_tensor_fp8_gemm_reference(ab["data"], ab["scale_inv"], wb["data"], wb["scale_inv"], *fmts,
                                              out_dtype=torch.float64)
        bound = R.gemm_error_bound(_abs_f64(ab["data"], ab["scale_inv"], fmts[0]),
                                   _abs_f64(wb["data"], wb["scale_inv"], fmts[1]), k,
                                   inner_unit_roundoff=_inner_u(device, backend), out_dtype=out_dtype, reference=ref)
        _assert_within(out, ref, bound)


@pytest.mark.parametrize("fmts", PAIRS[:2], ids=lambda p: "x".join(p))
@pytest.mark.parametrize("device,backend", _cases("rowwise"))
def test_rowwise_paths_match_the_reference(device, backend, fmts):
    m, k, n = 32, 128, 64
    x, w = _spread((m, k), 3, device), _spread((n, k), 4, device)
    x[3] *= 1e3  # an outlier row: row-wise scales keep the other rows' resolution
    a, b = quantize_rowwise(x, fmts[0]), quantize_rowwise(w, fmts[1])
    assert a.scale_inv.shape == (m, 1) and b.scale_inv.shape == (n, 1)
    out = fp8_mm_rowwise(a.data, a.scale_inv, b.data.t(), b.scale_inv.t(), a_fmt=fmts[0], b_fmt=fmts[1],
                         out_dtype=torch.float32, backend=backend)
    ref = R.per_tensor_fp8_gemm_reference(a.data, a.scale_inv, b.data, b.scale_inv, *fmts, out_dtype=torch.float64)
    bound = R.gemm_error_bound(_abs_f64(a.data, a.scale_inv, fmts[0]), _abs_f64(b.data, b.scale_inv, fmts[1]), k,
                               inner_unit_roundoff=_inner_u(device, backend))
    _assert_within(out, ref, bound)


@pytest.mark.parametrize("m", [32, 20])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device,backend", _cases("1x128x128x128"))
def test_blockwise_paths_match_the_reference(device, backend, out_dtype, m):
    k, n = 384, 256  # K/128 = 3: the cuBLAS path pads the weight's K-blocks to a multiple of 4
    x, w = _spread((m, k), 5, device), _spread((n, k), 6, device)
    a = BlockwiseFP8Quantizer((1, 128)).quantize(x)
    b = BlockwiseFP8Quantizer((128, 128)).quantize(w)
    out = blockwise_mm(a, b, out_dtype=out_dtype, backend=backend)
    ab, bb = a.raw_buffers(), b.raw_buffers()
    ref = R.blockwise_fp8_gemm_reference(ab["data"], ab["scale_inv"], bb["data"], bb["scale_inv"],
                                         out_dtype=torch.float64)
    bound = R.gemm_error_bound(R.dequantize_blockwise_f64(ab["data"], ab["scale_inv"], (1, 128)).abs(),
                               R.dequantize_blockwise_f64(bb["data"], bb["scale_inv"], (128, 128)).abs(), k,
                               block_k=128, inner_unit_roundoff=_inner_u(device, backend), out_dtype=out_dtype,
                               reference=ref)
    _assert_within(out, ref, bound)


@pytest.mark.parametrize("device,backend", _cases("1x128x1x128"))
def test_blockwise_1x128_by_1x128_matches_the_reference(device, backend):
    """The weight-gradient pairing: both operands have 1x128 blocks (dy.T and x.T, blocks along tokens).
    N = 80 where the backend takes it; the Triton kernel's output tiles need N % 128 == 0."""
    m, k, n = 48, 256, 256 if backend == "triton" else 80
    a = BlockwiseFP8Quantizer((1, 128)).quantize(_spread((m, k), 7, device))
    b = BlockwiseFP8Quantizer((1, 128)).quantize(_spread((n, k), 8, device))
    out = blockwise_mm(a, b, out_dtype=torch.float32, backend=backend)
    ab, bb = a.raw_buffers(), b.raw_buffers()
    a64 = R.dequantize_blockwise_f64(ab["data"], ab["scale_inv"], (1, 128))
    b64 = R.dequantize_blockwise_f64(bb["data"], bb["scale_inv"], (1, 128))
    ref = a64 @ b64.T  # per block exact in float64 (see reference's docstring); the 2 blocks' sum rounds at 2**-53
    bound = R.gemm_error_bound(a64.abs(), b64.abs(), k, block_k=128, inner_unit_roundoff=_inner_u(device, backend))
    _assert_within(out, ref, bound)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4_1x16", "nvfp4_16x16", "fp8_1x128"])
@pytest.mark.parametrize("device", DEVICES)
def test_other_formats_run_as_a_labelled_emulation(device, fmt):
    """MXFP8 / NVFP4 have no tensor cores on Hopper: ``emulated_mm`` dequantizes both operands to fp32 and
    accumulates in fp32, so it is within ``gemm_error_bound`` (fp32, one chain over K) of the float64 product
    of the same dequantized operands, and the call is counted as an emulation."""
    m, k, n = 16, 128, 32
    a = make_quantizer(fmt).quantize(_spread((m, k), 9, device))
    w = make_quantizer(fmt).quantize(_spread((n, k), 10, device))
    before = sum(v for (_, be), v in GEMM_CALLS.items() if be == "emulated")
    out = emulated_mm(a, w)
    assert sum(v for (_, be), v in GEMM_CALLS.items() if be == "emulated") == before + 1
    a64, w64 = a.dequantize(torch.float32).double(), w.dequantize(torch.float32).double()
    ref = a64 @ w64.T
    _assert_within(out, ref, R.gemm_error_bound(a64.abs(), w64.abs(), k))


def _int_f8(shape, fmt, scale_inv: float, seed: int, device: str) -> Float8Tensor:
    """Integers in [-4, 4] times a power of two: exact in E4M3 and E5M2."""
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(-4, 5, shape, generator=g).float()
    return Float8Tensor.from_high_precision(ints.to(device) * scale_inv, scale=1 / scale_inv, fmt=fmt)


def _int_blockwise(shape, block, seed: int, device: str):
    """Integer codes in [-4, 4] with power-of-two block scales: every block's partial sum is an exact integer."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(-4, 5, shape, generator=g).float().to(torch.float8_e4m3fn).view(torch.uint8)
    rows = shape[0] // block[0]
    scale = torch.exp2(torch.randint(-3, 4, (rows, shape[1] // 128), generator=g).float())
    cls = BlockwiseFP8Quantizer(block).tensor_class
    return cls.from_buffers({"data": data.to(device), "scale_inv": scale.to(device)}, {}, shape, torch.float32)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "1x128x128x128", "1x128x1x128"])
@pytest.mark.parametrize("device", DEVICES)
def test_integer_operands_are_exact_on_every_path(device, scaling):
    """|products| <= 16 and K = 256: every partial sum is an integer below 2**12, exact in any accumulator of
    13+ bits and in fp32; power-of-two scales multiply exactly. So every path must equal the reference."""
    m, k, n = 32, 256, 128
    for backend in _backends(scaling, device):
        if scaling == "tensorwise":
            a, w = _int_f8((m, k), "e5m2", 2.0**-3, 11, device), _int_f8((n, k), "e4m3", 2.0**2, 12, device)
            out = fp8_mm(a, w.t(), out_dtype=torch.float32, backend=backend)
            ab, wb = a.raw_buffers(), w.raw_buffers()
            ref = R.per_tensor_fp8_gemm_reference(ab["data"], ab["scale_inv"], wb["data"], wb["scale_inv"], "e5m2",
                                                  out_dtype=torch.float64)
        elif scaling == "rowwise":
            a, w = _int_f8((m, k), "e4m3", 1.0, 13, device), _int_f8((n, k), "e4m3", 1.0, 14, device)
            sa = torch.exp2(torch.arange(m, dtype=torch.float32) % 5 - 2).reshape(m, 1).to(device)
            sb = torch.exp2(torch.arange(n, dtype=torch.float32) % 3 - 1).reshape(1, n).to(device)
            ad, wd = a.raw_buffers()["data"], w.raw_buffers()["data"]
            out = fp8_mm_rowwise(ad, sa, wd.t(), sb, out_dtype=torch.float32, backend=backend)
            ref = R.per_tensor_fp8_gemm_reference(ad, sa, wd, sb, out_dtype=torch.float64)
        else:
            a = _int_blockwise((m, k), (1, 128), 15, device)
            w = _int_blockwise((n, k), (128, 128) if scaling == "1x128x128x128" else (1, 128), 16, device)
            out = blockwise_mm(a, w, out_dtype=torch.float32, backend=backend)
            ab, wb = a.raw_buffers(), w.raw_buffers()
            ref = (R.dequantize_blockwise_f64(ab["data"], ab["scale_inv"], (1, 128))
                   @ R.dequantize_blockwise_f64(wb["data"], wb["scale_inv"], w.block).T)
        assert torch.equal(out.double(), ref), f"{scaling} on {device} via {backend} is not exact"


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("scaling", ["tensorwise", "1x128x128x128", "1x128x1x128"])
@pytest.mark.parametrize("device", DEVICES)
def test_bias_is_added_before_the_one_rounding_on_every_path(device, scaling, out_dtype):
    """The bias joins the fp32 result in the GEMM's epilogue, then ONE rounding to ``out_dtype``. Integer
    operands make the fp32 result exact (see above) and quarter-valued biases keep result + bias exact in
    fp32, so every path must equal the float64 sum rounded once. Results reach the thousands and bf16 keeps 8
    significant bits, so in bf16 rounding the product first and adding the bias after (a second rounding) gives
    other values -- checked below, so this test tells the two apart."""
    m, k, n = 32, 256, 128
    g = torch.Generator().manual_seed(17)
    bias = (torch.randint(-32, 33, (n,), generator=g).float() / 4).to(out_dtype).to(device)
    for backend in _backends(scaling, device):
        if scaling == "tensorwise":
            a, w = _int_f8((m, k), "e4m3", 2.0, 11, device), _int_f8((n, k), "e4m3", 2.0, 12, device)
            out = fp8_mm(a, w.t(), out_dtype=out_dtype, backend=backend, bias=bias)
            ab, wb = a.raw_buffers(), w.raw_buffers()
            ref = R.per_tensor_fp8_gemm_reference(ab["data"], ab["scale_inv"], wb["data"], wb["scale_inv"],
                                                  out_dtype=torch.float64)
        else:
            a = _int_blockwise((m, k), (1, 128), 15, device)
            w = _int_blockwise((n, k), (128, 128) if scaling == "1x128x128x128" else (1, 128), 16, device)
            out = blockwise_mm(a, w, out_dtype=out_dtype, backend=backend, bias=bias)
            ab, wb = a.raw_buffers(), w.raw_buffers()
            ref = (R.dequantize_blockwise_f64(ab["data"], ab["scale_inv"], (1, 128))
                   @ R.dequantize_blockwise_f64(wb["data"], wb["scale_inv"], w.block).T)
        once = (ref + bias.double()).to(out_dtype)
        assert out.dtype == out_dtype and torch.equal(out, once), f"{scaling} {out_dtype} via {backend}"
        if out_dtype == torch.bfloat16:
            twice = (ref.to(out_dtype) + bias).to(out_dtype)
            assert not torch.equal(twice, once), "the operands do not tell one rounding from two"


# ----------------------------------------------------------------------------- backends, labels, no dequantize


def test_auto_picks_the_emulation_on_cpu_and_counts_every_call():
    assert resolve_backend("tensorwise", "auto", "cpu") == "emulated"
    assert resolve_backend("1x128x128x128", "auto", "cpu") == "emulated"
    a = CurrentScaling().quantize(_spread((16, 32), 1, "cpu"))
    before = GEMM_CALLS["tensorwise", "emulated"]
    fp8_mm(a, a.t(), out_dtype=torch.float32)
    assert GEMM_CALLS["tensorwise", "emulated"] == before + 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_the_tensor_cores_on_gpus_that_have_them():
    want = "torch" if fp8_tensor_cores("cuda") else "emulated"
    assert resolve_backend("tensorwise", "auto", "cuda") == want


@pytest.mark.parametrize("fp8_cores,blockwise_cores,want", [(True, True, "torch"), (True, False, "triton"),
                                                             (False, False, "emulated")],
                         ids=["hopper", "fp8_cores_only", "no_fp8_cores"])
def test_auto_for_blockwise_prefers_torch_then_triton_then_emulation(monkeypatch, fp8_cores, blockwise_cores, want):
    """Both blockwise pairings (the forward's 1x128 x 128x128 and wgrad's 1x128 x 1x128) resolve alike: torch's
    blockwise GEMM where it exists (measured faster than ours), else our Triton kernel on FP8 tensor cores."""
    monkeypatch.setattr(scaled_mm_module, "fp8_tensor_cores", lambda device: fp8_cores)
    monkeypatch.setattr(scaled_mm_module, "blockwise_tensor_cores", lambda device: blockwise_cores)
    for scaling in ("1x128x128x128", "1x128x1x128"):
        assert resolve_backend(scaling, "auto", "cpu") == want, scaling
    assert resolve_backend("tensorwise", "auto", "cpu") == ("torch" if fp8_cores else "emulated")


@pytest.mark.parametrize("cuda_build, capability, want", [
    ("13.0", (9, 0), True), ("12.9", (9, 0), True),
    ("12.8", (9, 0), False),  # torch refuses 1x128 / 128x128 scaling before cuBLASLt 12.9 (NotImplementedError)
    (None, (9, 0), False),    # a CPU or ROCm build
    ("13.0", (10, 0), False), ("13.0", (8, 9), False),
])
def test_torch_blockwise_needs_sm90_and_a_cuda_12_9_build(monkeypatch, cuda_build, capability, want):
    """On an H100 with a torch built for CUDA 12.8, "auto" must pick the Triton kernel, not a torch call that raises."""
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(scaled_mm_module, "fp8_tensor_cores", lambda device: True)
    assert blockwise_tensor_cores("cuda:0") is want
    assert resolve_backend("1x128x128x128", "auto", "cuda:0") == ("torch" if want else "triton")
    if not want:
        with pytest.raises(ValueError, match=rf"a torch built with CUDA >= 12.9 \(this one: {cuda_build}\)"):
            resolve_backend("1x128x128x128", "torch", "cuda:0")


def test_the_gemm_never_dequantizes_its_operands(monkeypatch):
    """Strict dispatch (any fallback raises) and dequantize() itself refused: the GEMM reads codes and scales."""
    def refuse(self, dtype=None):
        raise AssertionError("dequantize() called")
    a = CurrentScaling().quantize(_spread((16, 128), 1, "cpu"))
    xb = BlockwiseFP8Quantizer((1, 128)).quantize(_spread((16, 128), 2, "cpu"))
    wb = BlockwiseFP8Quantizer((128, 128)).quantize(_spread((128, 128), 3, "cpu"))
    monkeypatch.setattr(Float8Tensor, "dequantize", refuse)
    monkeypatch.setattr(FP8BlockwiseTensor, "dequantize", refuse)
    reset_counters()
    with strict_dispatch():
        fp8_mm(a, a.t(), out_dtype=torch.float32)
        blockwise_mm(xb, wb, out_dtype=torch.float32)
    assert not FALLBACKS


# ----------------------------------------------------------------------------- the rules, with clear errors


def _f8(shape, fmt="e4m3", seed=0):
    return CurrentScaling(fmt).quantize(_spread(shape, seed, "cpu"))


def _codes(t):
    return t.raw_buffers()["data"]


def _shifted(t, offset, device="cpu"):
    """A contiguous copy of ``t`` starting ``offset`` bytes into its (16-byte aligned) allocation."""
    out = torch.empty(t.numel() + offset, dtype=t.dtype, device=device)[offset:].view(t.shape)
    return out.copy_(t)


def _wider(t, extra, device="cpu"):
    """``t`` as a view into a tensor ``extra`` columns wider: row stride K + extra."""
    out = torch.empty(t.shape[0], t.shape[1] + extra, dtype=t.dtype, device=device)[:, :t.shape[1]]
    return out.copy_(t)


A, W = _f8((32, 64)), _f8((48, 64))
BAD_CALLS = {
    "B row-major": (lambda: fp8_mm(A, W.t().contiguous(), out_dtype=torch.float32), "B column-major"),
    "A column-major": (lambda: fp8_mm(A.t().contiguous().t(), W.t(), out_dtype=torch.float32), "A row-major"),
    "K not x16": (lambda: fp8_mm(_f8((32, 40)), _f8((48, 40)).t(), out_dtype=torch.float32), "multiples of 16"),
    "N not x16": (lambda: fp8_mm(A, _f8((40, 64)).t(), out_dtype=torch.float32), "multiples of 16"),
    "E5M2 x E5M2": (lambda: fp8_mm(_f8((32, 64), "e5m2"), _f8((48, 64), "e5m2").t(), out_dtype=torch.float32),
                    "no E5M2 x E5M2"),
    "out fp64": (lambda: fp8_mm(A, W.t(), out_dtype=torch.float64), "output dtype"),
    "out fp8": (lambda: fp8_mm(A, W.t(), out_dtype=torch.float8_e4m3fn), "output dtype"),
    "shapes": (lambda: fp8_mm(A, W, out_dtype=torch.float32), "shapes"),
    "3-D": (lambda: fp8_mm(_f8((2, 16, 64)), W.t(), out_dtype=torch.float32), "2-D operands"),
    "row scale [N, 1]": (lambda: fp8_mm_rowwise(A.raw_buffers()["data"], torch.ones(32, 1),
                                                W.raw_buffers()["data"].t(), torch.ones(48, 1),
                                                out_dtype=torch.float32), "row-wise scales"),
    "row scale bf16": (lambda: fp8_mm_rowwise(A.raw_buffers()["data"], torch.ones(32, 1, dtype=torch.bfloat16),
                                              W.raw_buffers()["data"].t(), torch.ones(1, 48),
                                              out_dtype=torch.float32), "row-wise scales"),
    "blockwise w transposed": (lambda: blockwise_mm(
        BlockwiseFP8Quantizer((1, 128)).quantize(torch.randn(16, 128)),
        FP8Blockwise1x128Tensor.from_buffers({"data": torch.zeros(128, 128, dtype=torch.uint8).t(),
                                              "scale_inv": torch.ones(128, 1)}, {}, (128, 128), torch.float32)),
        "row-major blockwise operands"),
    "blockwise N not x16": (lambda: blockwise_mm(BlockwiseFP8Quantizer((1, 128)).quantize(torch.randn(16, 128)),
                                                 BlockwiseFP8Quantizer((1, 128)).quantize(torch.randn(40, 128))),
                            "multiples of 16"),
    "blockwise M not x4": (lambda: blockwise_mm(BlockwiseFP8Quantizer((1, 128)).quantize(torch.randn(33, 128)),
                                                BlockwiseFP8Quantizer((128, 128)).quantize(torch.randn(128, 128))),
                           "M multiple of 4"),
    "blockwise fast accum": (lambda: blockwise_mm(BlockwiseFP8Quantizer((1, 128)).quantize(torch.randn(32, 128)),
                                                  BlockwiseFP8Quantizer((128, 128)).quantize(torch.randn(128, 128)),
                                                  use_fast_accum=True), "no fast accumulation"),
    "bias not [N]": (lambda: fp8_mm(A, W.t(), out_dtype=torch.float32, bias=torch.zeros(47)), "bias \\[N\\]"),
    "bias 2-D": (lambda: fp8_mm(A, W.t(), out_dtype=torch.float32, bias=torch.zeros(1, 48)), "bias \\[N\\]"),
    "bias dtype": (lambda: fp8_mm(A, W.t(), out_dtype=torch.bfloat16, bias=torch.zeros(48)),
                   "bias in the output dtype"),
    "bias strided": (lambda: fp8_mm(A, W.t(), out_dtype=torch.float32, bias=torch.zeros(96)[::2]), "contiguous"),
    "blockwise bias dtype": (lambda: blockwise_mm(BlockwiseFP8Quantizer((1, 128)).quantize(torch.randn(32, 128)),
                                                  BlockwiseFP8Quantizer((128, 128)).quantize(torch.randn(128, 128)),
                                                  out_dtype=torch.bfloat16, bias=torch.zeros(128)),
                             "bias in the output dtype"),
    "codes not uint8": (lambda: scaled_mm_module.check_fp8_gemm(A.raw_buffers()["data"].view(torch.int8),
                                                                W.raw_buffers()["data"].t(), "e4m3", "e4m3",
                                                                torch.float32), "FP8 codes"),
    "unknown format": (lambda: scaled_mm_module.check_fp8_gemm(A.raw_buffers()["data"], W.raw_buffers()["data"].t(),
                                                               "e3m4", "e4m3", torch.float32), "FP8 formats"),
    "blockwise codes 3-D": (lambda: scaled_mm_module.check_blockwise_codes(
        torch.zeros(2, 16, 128, dtype=torch.uint8), torch.ones(2, 16, 1), torch.zeros(128, 128, dtype=torch.uint8),
        torch.ones(1, 1), torch.float32), "2-D operands"),
    "blockwise codes K": (lambda: scaled_mm_module.check_blockwise_codes(
        torch.zeros(16, 128, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(128, 256, dtype=torch.uint8),
        torch.ones(1, 2), torch.float32), "shapes"),
    "blockwise codes K tail": (lambda: scaled_mm_module.check_blockwise_codes(  # the emulation dropped the tail
        torch.zeros(16, 200, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(128, 200, dtype=torch.uint8),
        torch.ones(1, 2), torch.float32), "K multiple of 128"),
    "blockwise codes a scales": (lambda: scaled_mm_module.check_blockwise_codes(
        torch.zeros(16, 256, dtype=torch.uint8), torch.ones(16, 5), torch.zeros(128, 256, dtype=torch.uint8),
        torch.ones(1, 2), torch.float32), "fp32 scales, one per block"),
    "blockwise codes w scales": (lambda: scaled_mm_module.check_blockwise_codes(  # 1x128 scales, 128x128 said
        torch.zeros(16, 256, dtype=torch.uint8), torch.ones(16, 2), torch.zeros(128, 256, dtype=torch.uint8),
        torch.ones(128, 2), torch.float32), "fp32 scales, one per block"),
    "blockwise codes scale dtype": (lambda: scaled_mm_module.check_blockwise_codes(
        torch.zeros(16, 256, dtype=torch.uint8), torch.ones(16, 2, dtype=torch.float64),
        torch.zeros(128, 256, dtype=torch.uint8), torch.ones(1, 2), torch.float32), "fp32 scales, one per block"),
    "blockwise codes out fp64": (lambda: scaled_mm_module.check_blockwise_codes(
        torch.zeros(16, 128, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(128, 128, dtype=torch.uint8),
        torch.ones(1, 1), torch.float64), "output dtype"),
    "A misaligned": (lambda: scaled_mm_module.check_fp8_gemm(_shifted(_codes(A), 8), _codes(W).t(), "e4m3", "e4m3",
                                                             torch.float32), "16-byte aligned operands"),
    "B misaligned": (lambda: scaled_mm_module.check_fp8_gemm(_codes(A), _shifted(_codes(W), 1).t(), "e4m3", "e4m3",
                                                             torch.float32), "16-byte aligned operands"),
    "lda not x16": (lambda: scaled_mm_module.check_fp8_gemm(_wider(_codes(A), 8), _codes(W).t(), "e4m3", "e4m3",
                                                            torch.float32), "leading dimension a multiple of 16"),
    "ldb not x16": (lambda: scaled_mm_module.check_fp8_gemm(_codes(A), _wider(_codes(W), 4).t(), "e4m3", "e4m3",
                                                            torch.float32), "leading dimension a multiple of 16"),
    "blockwise codes misaligned": (lambda: scaled_mm_module.check_blockwise_codes(
        _shifted(torch.zeros(16, 128, dtype=torch.uint8), 4), torch.ones(16, 1),
        torch.zeros(128, 128, dtype=torch.uint8), torch.ones(1, 1), torch.float32), "16-byte aligned operands"),
    "emulated K": (lambda: emulated_mm(A, _f8((48, 32))), "shapes"),
    "emulated out fp64": (lambda: emulated_mm(A, W, out_dtype=torch.float64), "output dtype"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_a_broken_rule_is_named_with_its_fix(case):
    call, rule = BAD_CALLS[case]
    with pytest.raises(FP8LayoutError, match=rule) as info:
        call()
    assert "Fix:" in str(info.value)


@pytest.mark.parametrize("device,backend", _cases("tensorwise"))
def test_aligned_views_are_accepted_and_equal_the_contiguous_product(device, backend):
    """The alignment rule refuses only what cuBLASLt / TMA cannot read: a view 16 bytes in, or with rows
    K + 16 apart, passes the rules and gives the contiguous operands' product (integer codes: exact in any
    accumulation order, so bit for bit on the tensor cores too)."""
    g = torch.Generator().manual_seed(5)
    a, w = (torch.randint(-4, 5, shape, generator=g).float().to(torch.float8_e4m3fn).view(torch.uint8)
            for shape in ((32, 64), (48, 64)))
    one = torch.ones((), device=device)

    def product(a2, w2):
        a2, w2 = a2.to(device), w2.to(device)  # no copy where they are there already (the views stay views)
        scaled_mm_module.check_fp8_gemm(a2, w2.t(), "e4m3", "e4m3", torch.float32)
        return scaled_mm_module.fp8_mm_codes(a2, "e4m3", one, w2.t(), "e4m3", one, out_dtype=torch.float32,
                                             backend=backend)

    want = product(a, w)
    for a2, w2 in ((_shifted(a, 16, device), _shifted(w, 32, device)), (_wider(a, 16, device), _wider(w, 48, device))):
        assert a2.device.type == device and a2.data_ptr() % 16 == 0
        assert torch.equal(product(a2, w2), want)


def test_m_is_free_for_per_tensor_scales():
    """Only K and N must be multiples of 16 (what cuBLASLt checks); any number of rows works."""
    for m in (1, 7, 17):
        assert fp8_mm(_f8((m, 64)), W.t(), out_dtype=torch.float32).shape == (m, 48)


def test_wrong_operand_types_and_backends_are_refused():
    xb = BlockwiseFP8Quantizer((1, 128)).quantize(torch.randn(16, 128))
    with pytest.raises(TypeError, match="Float8Tensor"):
        fp8_mm(xb, A.t(), out_dtype=torch.float32)
    with pytest.raises(TypeError, match="FP8Blockwise1x128Tensor"):
        blockwise_mm(A, xb)
    with pytest.raises(ValueError, match="blockwise GEMM only, not tensorwise"):
        fp8_mm(A, W.t(), out_dtype=torch.float32, backend="triton")
    with pytest.raises(ValueError, match="N = 16 is not a multiple of 128"):  # the Triton kernel's tile rule
        blockwise_mm(xb, xb, backend="triton")
    with pytest.raises(ValueError, match="sm_90"):
        blockwise_mm(xb, BlockwiseFP8Quantizer((128, 128)).quantize(torch.randn(128, 128)), backend="torch")
    with pytest.raises(ValueError, match="per-tensor scales only"):
        fp8_mm_rowwise(A.raw_buffers()["data"], torch.ones(32, 1), W.raw_buffers()["data"].t(), torch.ones(1, 48),
                       out_dtype=torch.float32, backend="torch")
    with pytest.raises(ValueError, match="backend must be one of"):
        fp8_mm(A, W.t(), out_dtype=torch.float32, backend="cublas")


def test_a_cpu_run_of_torch_scaled_mm_proves_nothing_about_gpu_layouts():
    """torch's CPU kernel multiplies a row-major B and E5M2 x E5M2 -- both of which CUDA refuses -- which is
    why the rules are checked before any backend is called (and why the emulation enforces them too)."""
    a8 = A.raw_buffers()["data"].view(torch.float8_e4m3fn)
    b_row_major = W.raw_buffers()["data"].t().contiguous().view(torch.float8_e4m3fn)
    one = torch.ones(())
    torch._scaled_mm(a8, b_row_major, one, one, out_dtype=torch.float32)  # no complaint on CPU
    torch._scaled_mm(a8.float().to(torch.float8_e5m2), b_row_major.float().to(torch.float8_e5m2), one, one,
                     out_dtype=torch.float32)
    for backend in ("emulated", "torch"):
        with pytest.raises(FP8LayoutError, match="B column-major"):
            fp8_mm(A, W.t().contiguous(), out_dtype=torch.float32, backend=backend)
