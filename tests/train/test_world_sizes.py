"""The training loop's real setup at 2 ranks against 1 rank, in every weight format: FSDP2 per block with
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, quantized weights all-gathered as such, fp32
masters in FusedAdam. Two ranks of ``b`` sequences see the same global batch as one rank of ``2 b`` (the data
order hands out the windows by rank), so the runs may differ by rounding only:

* FP8 linears (fp8, fp8_delayed) scale each rank's activations by that rank's own amax, one rank by the
  whole batch's: E4M3 roundings of other values, from step 0 on. Losses of a 4-step tiny run differed by
  at most 5.7e-4 (fp8; 1.2e-4 bf16, 2.3e-4 NVFP4), every parameter by at most 2.0e-2 relative L2 (fp8;
  1.0e-3 bf16, 1.2e-2 NVFP4) -- torch 2.13, CPU.
* A run on OTHER windows (data_seed=1) moved the losses by >= 0.0998 and the parameters by >= 0.11: the
  tolerances (2e-3 on losses, 5e-2 on parameters) separate "other rounding" from "other data" (a rank that
  reads the wrong windows, or a gradient that is not its ranks' combination). A gradient off by a constant
  factor (a sum where a mean belongs) would pass: Adam's ``m_hat / sqrt(v_hat)`` cancels it, up to ``eps``.
"""


import pytest
from final_params import final_params, max_rel_l2  # tests/train/final_params.py

from tutorial_lib.dist.launcher import launch
from tutorial_lib.lessons.end_to_end_training import train_runs, unshardable_reason
from tutorial_lib.train.loop import TrainConfig
from tutorial_lib.train.transformer import FORMATS

STEPS, LOSS_TOL, PARAM_TOL = 4, 2e-3, 5e-2


@pytest.mark.parametrize("fmt", [f for f in FORMATS if not unshardable_reason(f, "tiny", 2)])
def test_two_ranks_train_like_one_rank_over_the_same_global_batch(tmp_path, fmt):
    common = dict(fmt=fmt, size="tiny", steps=STEPS, lr=2e-3, warmup=2, eval_every=STEPS, eval_windows=16,
                  log_every=STEPS, ckpt_every=STEPS, device="cpu", progress=False)
    one_cfg = TrainConfig(batch_size=8, out=str(tmp_path / "one"), **common)
    two_cfg, other_cfg = (TrainConfig(batch_size=4, out=str(tmp_path / "two"), **common),
                          TrainConfig(batch_size=4, data_seed=1, out=str(tmp_path / "other"), **common))
    (one,) = launch(train_runs, world_size=1, device="cpu", args=([one_cfg],), timeout=600)[0].results
    two, other = launch(train_runs, world_size=2, device="cpu", args=([two_cfg, other_cfg],), timeout=600)[0].results
    p_one, p_two, p_other = (final_params(c.out, STEPS, tmp_path) for c in (one_cfg, two_cfg, other_cfg))
    assert len(p_one) == len(p_two) >= 10

    assert len(one.losses) == len(two.losses) == STEPS
    assert max(abs(a - b) for a, b in zip(one.losses, two.losses)) <= LOSS_TOL, (one.losses, two.losses)
    assert abs(one.final_val_loss - two.final_val_loss) <= LOSS_TOL
    assert max_rel_l2(p_one, p_two) <= PARAM_TOL
    assert max(abs(a - b) for a, b in zip(one.losses, other.losses)) > 10 * LOSS_TOL, "other data, same losses?"
    assert max_rel_l2(p_one, p_other) > PARAM_TOL
