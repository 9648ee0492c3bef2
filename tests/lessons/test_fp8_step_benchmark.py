"""``tutorial_lib.lessons.fp8_step_benchmark``: the rank function of ``benchmarks/bench_fp8_fsdp2_step.py``.

Times are not checked (performance lives in benchmarks); what is checked is what the timing rests on and
can be derived: every variant is the same model (parameter count from the shapes), the ranks agree, each
variant's profile shows the phases its layers must run (FP8 casts, transposes and the three FP8 GEMMs in
the FP8 variants, none in bf16; all-gathers, reduce-scatters and an optimizer step in all), one step
changes the stored weight bytes, and a step with ``lr=0`` changes none of them (requantizing an unchanged
fp32 master gives the initial FP8 codes back, byte for byte). The timed benchmark script itself runs in
``tests/harness/test_benchmarks.py``.
"""

import dataclasses
import pickle

import pytest
import torch

from tutorial_lib.dist.launcher import RankFailed, launch, run_sequence
from tutorial_lib.lessons import fp8_step_benchmark as lesson

FP8_PHASES = ("quantize_ms", "transpose_ms", "fprop_ms", "dgrad_ms", "wgrad_ms")
DIM, HIDDEN, BLOCKS, TOKENS = 256, 256, 1, 128  # 256 = 128 x 2 ranks: whole 128x128 tiles per shard


def _phases(**ms) -> lesson.TrainStepPhases:
    fields = [f.name for f in dataclasses.fields(lesson.TrainStepPhases) if f.name != "time_source"]
    return lesson.TrainStepPhases(time_source="cpu", **{f: ms.get(f, 0.0) for f in fields})


def test_results_pickle_and_name_their_variants():
    v = lesson.StepVariant(name="bf16", label="bf16", weight_format="bf16", optimizer="FusedAdam", params=10,
                           step_ms=2.0, tflops=1.0, peak_memory_bytes=[], weight_changed_fraction=1.0,
                           phases=_phases(optimizer_ms=1.0))
    r = lesson.Fsdp2StepBenchmarkResult(rank=0, world_size=2, dim=16, hidden=32, n_blocks=1, tokens=16, reps=1,
                                        variants=[v], skipped={"torchao_tensorwise": "torchao not installed"})
    assert pickle.loads(pickle.dumps(r)) == r
    assert r.variant("bf16") is v
    with pytest.raises(KeyError, match="torchao not installed"):
        r.variant("hybrid")


def test_pow2_variants_scale_weights_and_layers_by_powers_of_two():
    """The *_pow2 variants: the layers' recipe AND the weights' quantizers use power-of-two scales (TE's
    Float8BlockScaling does both); the other variants neither."""
    for name, layer in lesson.FP8_VARIANTS.items():
        q = lesson._weight_recipe(layer)("blocks.0.fc1.weight", torch.nn.Parameter(torch.ones(256, 256)))
        assert q.pow2_scales is layer.pow2_scales is name.endswith("_pow2"), (name, q)
        assert layer.kind == "hybrid" or q.block == (128, 128), (name, q)


@pytest.mark.distributed
def test_every_variant_is_the_same_model_and_profiles_its_phases():
    calls = [(lesson.fsdp2_step_benchmark, dict(dim=DIM, hidden=HIDDEN, n_blocks=BLOCKS, tokens=TOKENS, reps=1,
                                                profile_steps=1, variants=("bf16", "hybrid", "blockwise",
                                                                           "blockwise_triton", "hybrid_pow2",
                                                                           "blockwise_pow2"))),
             (lesson.fsdp2_step_benchmark, dict(dim=DIM, hidden=HIDDEN, n_blocks=BLOCKS, tokens=TOKENS, reps=1,
                                                profile_steps=1, variants=("bf16", "hybrid", "blockwise"), lr=0.0))]
    ranks = launch(run_sequence, world_size=2, device="cpu", args=(calls,), timeout=600, echo=False)
    params = BLOCKS * (2 * DIM + HIDDEN * DIM + HIDDEN + DIM * HIDDEN + DIM) + 2 * DIM  # norm, fc1, fc2; norm_out
    names = {0: ["bf16", "hybrid", "blockwise", "blockwise_triton", "hybrid_pow2", "blockwise_pow2"],
             1: ["bf16", "hybrid", "blockwise"]}
    for trained, frozen in ranks:
        for i, r in enumerate((trained, frozen)):
            assert isinstance(r, lesson.Fsdp2StepBenchmarkResult) and r.world_size == 2
            assert (r.dim, r.hidden, r.n_blocks, r.tokens) == (DIM, HIDDEN, BLOCKS, TOKENS)
            assert [v.name for v in r.variants] == names[i] and r.skipped == {}
        assert [v.weight_format for v in trained.variants] == ["bf16", "fp8", "fp8_128x128", "fp8_128x128", "fp8",
                                                               "fp8_128x128"]
        assert "Triton kernel" in trained.variant("blockwise_triton").label
        assert [v.name for v in trained.variants if "power-of-two" in v.label] == ["hybrid_pow2", "blockwise_pow2"]
        for v in trained.variants:
            assert v.params == params, (v.name, v.params)
            assert v.step_ms > 0 and v.tflops == pytest.approx(6 * params * TOKENS * 2 / (v.step_ms * 1e-3) / 1e12)
            p = v.phases
            assert p.time_source == "cpu" and v.peak_memory_bytes == []
            assert p.optimizer_ms > 0 and p.all_gather_ms > 0 and p.reduce_scatter_ms > 0, (v.name, p)
            fp8 = [getattr(p, f) for f in FP8_PHASES]
            assert all(ms > 0 for ms in fp8) if v.name != "bf16" else fp8 == [0.0] * 5, (v.name, p)
            assert v.weight_changed_fraction > 0, v.name  # one step moved the stored bytes (FP8: the codes)
        for v in frozen.variants:  # lr=0: the masters stay, so the requantized codes equal the initial ones
            assert v.weight_changed_fraction == 0.0, v.name
    r0, r1 = (trained for trained, _ in ranks)
    # max over ranks of each rank's median: the same number on both ranks
    assert [(v.name, v.params, v.step_ms) for v in r0.variants] == [(v.name, v.params, v.step_ms) for v in r1.variants]


@pytest.mark.distributed
@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(variants=("bf16", "fp16")), "unknown variants"),
    (dict(dim=128, variants=("bf16", "blockwise")), "multiples of 256"),
    (dict(dim=24, variants=("bf16", "hybrid")), "multiples of 16"),
])
def test_bad_input_is_refused_naming_the_constraint(kwargs, message):
    kw = dict(dim=DIM, hidden=HIDDEN, n_blocks=1, tokens=TOKENS, reps=1) | kwargs
    with pytest.raises(RankFailed, match=message):
        launch(lesson.fsdp2_step_benchmark, world_size=2, device="cpu", kwargs=kw, timeout=120, echo=False)
