"""Lesson 04's measurements (tutorial_lib.lessons.view_reshape_fallbacks): what the warn-and-dequantize
view policy costs a plain caller, and what FSDP2 keeps per shard under each policy (2 CPU ranks)."""

import pytest
import torch

from tutorial_lib.dist.launcher import launch, run_sequence
from tutorial_lib.lessons.view_reshape_fallbacks import (
    FallbackViewCosts,
    FlatShardReport,
    fallback_view_costs,
    fsdp2_flat_shard_report,
)
from tutorial_lib.quant.registry import BLOCK_FORMAT_NAMES, make_quantizer
from tutorial_lib.quant.view_policy import get_view_policy


def _q(fmt, shape=(128, 256), seed=50):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02
    return make_quantizer(fmt).quantize(w).with_nominal_dtype(torch.bfloat16)


@pytest.mark.parametrize("fmt", BLOCK_FORMAT_NAMES)
def test_fallback_view_costs(fmt):
    q = _q(fmt)
    costs = fallback_view_costs(q)
    assert isinstance(costs, FallbackViewCosts) and costs.result_type == "Tensor"
    assert costs.write_reached_weight is False
    assert costs.copy_nbytes == 2 * q.numel() > costs.quantized_nbytes == q.quantized_nbytes()
    if fmt == "mxfp8":  # power-of-two scales: E4M3 x 2**k is exact in bf16
        assert costs.copy_max_rel_err == 0.0
    else:  # fp32 scales: the bf16 copy is rounded -- silently different from the weight
        assert 0 < costs.copy_max_rel_err <= 2.0**-8
    # per element: one RNE rounding of the fp32 value to bf16 (8 significant bits) errs by <= half an ulp,
    # i.e. <= 2**-8 of the element's magnitude
    exact = q.dequantize(torch.float32)
    assert ((q.dequantize().float() - exact).abs() <= 2.0**-8 * exact.abs()).all()
    # each layout's bytes: codes + one scale per block (+ NVFP4's fp32 global scale)
    per_elem = {"mxfp8": 1 + 1 / 32, "fp8_1x128": 1 + 4 / 128, "fp8_128x128": 1 + 4 / 128**2,
                "nvfp4_1x16": 0.5 + 1 / 16, "nvfp4_16x16": 0.5 + 1 / 256}[fmt]
    assert costs.quantized_nbytes == q.numel() * per_elem + (4 if fmt.startswith("nvfp4") else 0)
    assert get_view_policy() == "strict"


def test_fallback_view_costs_leaves_the_weight_unchanged():
    q = _q("fp8_1x128")
    saved = {n: b.clone() for n, b in q.raw_buffers().items()}
    costs = fallback_view_costs(q)
    assert costs.round_trip_bytes_changed > 0 and costs.round_trip_max_rel_change > 0
    assert all(torch.equal(b, saved[n]) for n, b in q.raw_buffers().items())


@pytest.mark.distributed
def test_real_fsdp2_flattening_under_each_policy():
    calls = [(fsdp2_flat_shard_report, {"fmt": fmt, "n_layers": 2, "dim": 64}) for fmt in ("mxfp8", "nvfp4_1x16")]
    results = launch(run_sequence, world_size=2, device="cpu", args=(calls,), timeout=120)
    for rank in results:
        mx, nv = rank
        assert isinstance(mx, FlatShardReport) and (mx.fmt, nv.fmt) == ("mxfp8", "nvfp4_1x16")
        assert set(mx.policies) == {"strict", "warn_dequantize", "scoped"}
        strict = mx.policies["strict"]
        assert "strict view policy" in strict.error and strict.layers == []
        shard = 32 * 64 + 32 * 2  # 32 rows of 64 E4M3 bytes + one E8M0 scale per 32 elements
        warn, scoped = mx.policies["warn_dequantize"], mx.policies["scoped"]
        assert warn.error is None and warn.allocated_delta is None  # CPU: no CUDA allocator to read
        for layer in warn.layers:
            assert (layer.flat_type, layer.quantized_bytes, layer.extra_bytes, layer.stale) == (
                "Tensor bfloat16", shard, 32 * 64 * 2, True)
        for layer in scoped.layers:
            assert (layer.flat_type, layer.quantized_bytes, layer.extra_bytes, layer.stale) == (
                "RawBytes uint8", shard, 0, False)
        assert len(warn.layers) == len(scoped.layers) == 2
        nv_warn, nv_scoped = nv.policies["warn_dequantize"].layers, nv.policies["scoped"].layers
        assert all(not layer.stale and layer.extra_bytes == 0 for layer in nv_scoped)
        assert all(layer.stale and layer.extra_bytes > 3 * layer.quantized_bytes for layer in nv_warn)  # FP4: 4x
        for report in (mx, nv):  # lazy init's reset_sharded_param reads the kept flat tensor's storage
            warn = report.policies["warn_dequantize"]
            assert "invalid python storage" in warn.forward_error
            # raised in torch's own reset_sharded_param (below our wrapper that re-enters the scoped allowance)
            raised_in = "torch/distributed/fsdp/_fully_shard/_fsdp_param.py:reset_sharded_param"
            assert warn.forward_error_raised_in == raised_in
            assert report.policies["scoped"].forward_error is None
            assert report.policies["scoped"].forward_error_raised_in is None


def _report_with_updates_that_never_land(fmt: str) -> FlatShardReport:
    """Rank function: the flat-shard report while a quantized copy_ writes nothing (a lost optimizer update)."""
    from tutorial_lib.quant.tensor import QuantizedTensor

    table, op = QuantizedTensor._dispatch_table, torch.ops.aten.copy_.default
    handler = table[op]
    table[op] = lambda func, args, kwargs: args[0]
    try:
        return fsdp2_flat_shard_report(fmt, n_layers=1, dim=64, policies=("scoped",))
    finally:
        table[op] = handler


@pytest.mark.distributed
def test_an_update_that_never_reaches_the_shard_reads_as_stale_even_through_an_alias():
    """"Follows updates" needs the parameter's bytes to have CHANGED and the flat alias to show them: an alias of
    bytes that no update reached is no evidence (it would equal itself whatever happened)."""
    for report in launch(_report_with_updates_that_never_land, world_size=2, device="cpu", args=("mxfp8",),
                         timeout=120):
        (layer,) = report.policies["scoped"].layers
        assert layer.flat_type == "RawBytes uint8" and layer.extra_bytes == 0 and layer.stale
