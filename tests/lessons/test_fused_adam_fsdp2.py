"""FusedAdam under FSDP2 / DTensor on 2 ranks (gloo on CPU, NCCL with 2 GPUs), via the launcher.

All experiments run in ONE launch (a module fixture: starting 2 ranks costs seconds on a CPU):
``run_sequence`` calls the lesson's rank functions in turn, and each test asserts on its part of
the per-rank results (typed: see the dataclasses of ``tutorial_lib.lessons.fused_adam_fsdp2``).

Tolerance for FusedAdam vs torch.optim.AdamW on the same FSDP2 model: both see identical
gradients at step 1; afterwards the parameters differ by the kernels' ulp-level differences
(~1e-7 relative per step, see test_adam_kernels.py), fed back through the next gradients. Over 6
steps with lr 1e-2 we allow 1e-6 * (1 + max|param|) absolute: more than 10x the measured ~3e-8.
"""

from __future__ import annotations

import pytest
import torch

from tutorial_lib.dist.launcher import launch, run_sequence
from tutorial_lib.harness.bench import paired_ratio
from tutorial_lib.lessons import fused_adam_fsdp2 as F

pytestmark = pytest.mark.distributed
DEVICE = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
STEPS = 6
DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory) -> list[dict]:
    """Per rank: ``{"fsdp": FusedVsTorch, "quantized": QuantizedStep, "dcp": {dtype: DcpRoundtrip},
    "overhead": DTensorOverhead}``. The tiny ``dtensor_overhead`` is there for its DTensor == plain
    check (FusedAdam's host fast and general paths), not for its times."""
    ckpt = tmp_path_factory.mktemp("fused-adam-dcp")
    calls = [
        (F.fsdp2_fused_vs_torch, {"steps": STEPS}),
        (F.quantized_dtensor_step, {}),
        *[(F.fsdp2_dcp_roundtrip, {"checkpoint_dir": str(ckpt / dtype), "dtype": dtype}) for dtype in DTYPES],
        (F.dtensor_overhead, {"n_params": 6, "numel": 8, "steps": 1, "optimizers": ("fused",)}),
    ]
    results = launch(run_sequence, world_size=2, device=DEVICE, args=(calls,), timeout=600)
    return [{"fsdp": fsdp, "quantized": quantized, "dcp": {r.dtype: r for r in dcp}, "overhead": overhead}
            for fsdp, quantized, *dcp, overhead in results]


def test_fsdp2_fused_adam_equals_torch_adamw_with_uneven_and_empty_shards(per_rank):
    out: list[F.FusedVsTorch] = [r["fsdp"] for r in per_rank]
    assert [r.local_shapes[-2:] for r in out] == [[(1, 7), (1,)], [(0, 7), (0,)]]  # rank 1: empty shards
    for r in out:
        tol = 1e-6 * (1 + r.max_abs_param)
        assert max(r.max_abs_diff_per_step) <= tol, r.max_abs_diff_per_step
        assert r.state_is_dtensor_like_param
        assert r.steps == r.ref_steps == [float(STEPS)] * 6  # empty shards count steps too
        for ref_loss, fused_loss in r.losses:
            assert abs(ref_loss - fused_loss) <= 1e-5 * abs(ref_loss)


def test_quantized_local_shards_fused_fp8_and_requantize_share_scales_across_ranks(per_rank):
    out: list[F.QuantizedStep] = [r["quantized"] for r in per_rank]
    assert [r.local_rows for r in out] == [5, 4]  # 9 rows over 2 ranks: uneven
    for r in out:
        assert r.routes == ["fp8_fused", "requantize"]
        assert r.steps == 3 and 1.0 < r.max_abs_master < 10.0  # randn weights, a few small steps
        # 4 fp32 ulps of max |master| per step; a master seeded from the FP8 bytes would be ~1e-2 off
        assert r.max_master_err <= r.steps * 4 * torch.finfo(torch.float32).eps * r.max_abs_master
        assert r.fp8_bytes_equal_quantize_of_master
        assert r.state_is_dtensor and r.hp_init_consumed
    assert out[0].scale_inv_per_step == out[1].scale_inv_per_step  # amax all-reduced: one scale


def test_dcp_save_load_continues_bit_exactly(per_rank):
    """fp32 params, and bf16 params with fp32 masters (which must survive DCP as fp32 DTensors)."""
    for by_dtype in (x["dcp"] for x in per_rank):
        assert sorted(by_dtype) == sorted(DTYPES)
        for dtype, res in by_dtype.items():
            assert res.params_bitwise_equal, dtype
            assert res.losses == res.resumed_losses, dtype
            assert res.step == 5, dtype
        assert by_dtype["bfloat16"].masters_fp32_dtensor and "master_param" in by_dtype["bfloat16"].state_keys
        assert "master_param" not in by_dtype["float32"].state_keys


def test_dtensor_params_step_exactly_like_their_local_tensors(per_rank):
    """FusedAdam on DTensor params == on the same local tensors as plain params, bit for bit, over
    steps with all grads (the host fast path: maps over the parameter list), a None grad (the
    general path; that parameter is skipped), new grad tensors, and new parameter storage (a new
    local shard object, as FSDP2 installs one; p.data = ... for the plain parameters)."""
    for r in (x["overhead"] for x in per_rank):
        assert r.fused_dtensor_equals_plain
        assert r.fused_steps_first_last == [3.0, 4.0]
        fused = r.optimizers["fused"]
        assert fused.error is None and fused.latency is not None and fused.new_grads_host is not None


def test_paired_ratio_compares_round_by_round():
    # the host slows down 4x during the run; the DTensor variant is never slower than plain in its round
    plain, dtensor = [1.0, 2.0, 4.2], [1.0, 2.1, 4.0]
    assert paired_ratio(dtensor, plain) == 1.0
    assert dtensor[1] / plain[1] == 1.05  # what a ratio of the two medians would have said
    times = F.PairedTimes(plain_ms=plain, dtensor_ms=dtensor)
    assert times.ratio == 1.0 and times.round_ratios == [1.0, 1.05, 0.952]
    assert (times.plain_median_ms, times.dtensor_median_ms) == (2.0, 2.1)
