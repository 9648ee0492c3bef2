"""Gradient accumulation in train_model: ``micro_batches=k`` of ``b`` sequences per rank is one step over the
same ``W * k * b`` windows (all W ranks together; the data order hands them out per micro-batch) as
``micro_batches=1`` of ``k * b`` sequences -- same mean loss, same averaged gradient -- up to rounding.
Two CPU ranks, bf16 compute (FSDP2's MixedPrecisionPolicy), fp32 reduce.

What may differ, and the tolerances (measured in brackets: k = 2 and k = 4, 4 steps, torch 2.13 CPU):

* step 0 runs on identical parameters: per-token losses are the same numbers, only the order of the means
  differs (mean of k micro-batch means vs one mean): a few fp32 ulps of ~5.7 (ulp 4.8e-7) -> 1e-5 [0, 1 ulp].
* later steps: each rank's gradient is summed from k bf16 GEMM groups instead of one (bf16: 8 significant
  bits), then Adam normalises it; the runs drift by rounding only -> losses 1e-3 [1.0e-4], every parameter
  tensor within 5e-3 relative L2 [9.7e-4].
* a run on OTHER windows (data_seed=1) must fail both by a wide margin [0.11 and 0.11]: the tolerances
  separate "same arithmetic, other rounding" from "other data" (a loop that drops or misplaces a
  micro-batch, or skips the gradient sync, reads other data or other gradients).
"""



from final_params import final_params, max_rel_l2  # tests/train/final_params.py

from tutorial_lib.dist.launcher import launch
from tutorial_lib.lessons.end_to_end_training import train_runs
from tutorial_lib.train.data import TextData
from tutorial_lib.train.loop import TrainConfig, build_model_and_optimizer, train_mesh, train_step

STEPS = 4


def test_micro_batches_equal_one_batch_over_the_same_windows(tmp_path):
    common = dict(fmt="bf16", size="tiny", steps=STEPS, lr=2e-3, warmup=2, eval_every=STEPS, eval_windows=16,
                  log_every=STEPS, ckpt_every=STEPS, device="cpu", progress=False)
    cfgs = [TrainConfig(batch_size=8, micro_batches=1, out=str(tmp_path / "one"), **common),
            TrainConfig(batch_size=2, micro_batches=4, out=str(tmp_path / "micro"), **common),
            TrainConfig(batch_size=8, micro_batches=1, data_seed=1, out=str(tmp_path / "other"), **common)]
    one, micro, other = launch(train_runs, world_size=2, device="cpu", args=(cfgs,), timeout=600)[0].results
    p_one, p_micro, p_other = (final_params(c.out, STEPS, tmp_path) for c in cfgs)

    assert len(one.losses) == len(micro.losses) == STEPS
    assert abs(one.losses[0] - micro.losses[0]) <= 1e-5, (one.losses[0], micro.losses[0])
    assert max(abs(a - b) for a, b in zip(one.losses, micro.losses)) <= 1e-3, (one.losses, micro.losses)
    assert abs(one.final_val_loss - micro.final_val_loss) <= 1e-3
    assert max_rel_l2(p_one, p_micro) <= 5e-3

    assert max(abs(a - b) for a, b in zip(one.losses, other.losses)) > 1e-2, (one.losses, other.losses)
    assert max_rel_l2(p_one, p_other) > 5e-2


class _RecordingOptimizer:
    """Stands in for the optimizer in ``train_step``: keeps the reduced gradient shards ``step()`` would use."""

    def __init__(self, opt):
        self.param_groups, self.params, self.grads = opt.param_groups, [p for g in opt.param_groups
                                                                          for p in g["params"]], None

    def step(self):
        self.grads = [p.grad.to_local().double().clone() for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def _step0_gradients(cfgs):
    """Each config's reduced gradient shards at step 0 (identical parameters), through ``train_step``."""
    out = []
    for cfg in cfgs:
        mesh, dev = train_mesh(cfg)
        model, opt, _ = build_model_and_optimizer(cfg, mesh, dev)
        rec = _RecordingOptimizer(opt)
        train_step(model, rec, TextData.load(cfg.model_config().seq_len), cfg, 0, dev)
        out.append(rec.grads)
    return out


def test_micro_batches_average_the_gradient_at_step_0():
    """The losses and Adam's update are blind to a constant factor on the gradient (Adam normalises it), so
    the test above would pass a loop that SUMS its k micro-batch gradients. At step 0 the parameters are
    identical, so the reduced gradients themselves must agree: k bf16 GEMM groups instead of one, fp32
    accumulation -> a few bf16 roundings (2**-8) apart, relative L2 <= 2e-2 [measured, worst tensor per rank:
    7.3e-3 and 1.9e-3]; a sum would be 4x (relative difference 3.0), other windows 0.89 and 3.7 [measured]."""
    common = dict(fmt="bf16", size="tiny", steps=STEPS, lr=2e-3, warmup=2, device="cpu", progress=False)
    cfgs = [TrainConfig(batch_size=8, micro_batches=1, **common), TrainConfig(batch_size=2, micro_batches=4, **common)]
    for one, micro in launch(_step0_gradients, world_size=2, device="cpu", args=(cfgs,), timeout=600):
        assert len(one) == len(micro) > 0
        rel = max(float((a - b).norm() / a.norm()) for a, b in zip(one, micro) if a.numel() and a.norm() > 0)
        assert rel <= 2e-2, rel
