"""Lesson 09's module (``tutorial_lib.lessons.fp8_matmuls``) and notebook keep to the lesson contract.

Most of it runs without launching ranks: every rank function returns a documented, picklable, module-level
dataclass; the helpers the notebook relies on (``default_shapes``, ``count_dequantizes``, ``bit_exact``) do
what it says; the notebook uses public library names only and its exercises come with self-checks. One
small 2-rank CPU launch (``train_compare_fp8``, hybrid, tiny) checks what the notebook asserts at world size
2: bit-exact against the single-process twin, no dequantize of an FP8 weight, ``steps x 2 blocks x 2
linears x 3 GEMMs`` FP8 GEMMs. (Both recipes and ``step_breakdown`` run in
``tests/matmul/test_fp8_linear.py``.) Another small launch runs section 6's sequence -- ``train_compare_fp8``,
then the timed ``step_breakdown`` and ``fsdp2_step_benchmark`` in the same processes -- and checks that the
timed steps run without the deterministic algorithms ``train_compare_fp8`` switches on (on CUDA ranks).
"""

import dataclasses
import inspect
import pickle
import re
from pathlib import Path

import nbformat
import pytest
import torch

from tutorial_lib.dist.launcher import launch, run_sequence
from tutorial_lib.lessons import fp8_matmuls as lesson
from tutorial_lib.lessons import fp8_step_benchmark
from tutorial_lib.quant.blockwise import BlockwiseFP8Quantizer
from tutorial_lib.quant.float8 import CurrentScaling

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "09_fp8_matmuls.ipynb"
RANK_FUNCTIONS = ["train_compare_fp8", "step_breakdown"]
RESULT_TYPES = [obj for _, obj in inspect.getmembers(lesson, inspect.isclass)
                if dataclasses.is_dataclass(obj) and obj.__module__ == lesson.__name__]


# ----------------------------------------------------------------------------- result types


def _phases(label: str, **ms) -> lesson.StepPhases:
    fields = ("quantize_ms", "transpose_ms", "fprop_ms", "dgrad_ms", "wgrad_ms", "all_gather_ms", "reduce_scatter_ms")
    return lesson.StepPhases(label=label, step_ms=3.0, time_source="cpu", **{f: ms.get(f, 0.0) for f in fields})


def _train_result(**changes) -> lesson.Fp8TrainCompareResult:
    base = dict(rank=0, world_size=2, recipe="hybrid", weight_format="fp8", dim=32, hidden=64, tokens=16, steps=2,
                losses=[1.0, 0.5], ref_losses=[1.0, 0.5], dequant_losses=[1.0, 0.6],
                params=[lesson.ShardCompare(name="blocks.0.fc1.weight", quantized=True, equal=True, max_abs_diff=0.0)],
                masters_equal=True, masters_max_abs_diff=0.0,
                gemms=[lesson.GemmCount(scaling="tensorwise", backend="emulated", calls=24)], fallbacks=0,
                weight_dequantizes=0)
    return lesson.Fp8TrainCompareResult(**{**base, **changes})


def test_results_pickle_as_module_level_types():
    res = _train_result()
    assert pickle.loads(pickle.dumps(res)) == res
    steps = lesson.StepBreakdownResult(rank=1, world_size=2, recipe="blockwise", params=10, dim=256,
                                       hidden=256, tokens=128,
                                       fp8_gemms=_phases("FP8 GEMMs (blockwise)", fprop_ms=1.0),
                                       dequantize_on_use=_phases("dequantize-on-use", all_gather_ms=0.5))
    assert pickle.loads(pickle.dumps(steps)) == steps


def test_bit_exact_needs_losses_shards_and_masters():
    """The notebook asserts ``bit_exact`` at 1-2 ranks: it must fail on any one difference."""
    assert _train_result().bit_exact
    assert not _train_result(losses=[1.0, 0.5000001]).bit_exact
    assert not _train_result(masters_equal=False).bit_exact
    bad = lesson.ShardCompare(name="blocks.0.fc1.weight", quantized=True, equal=False, max_abs_diff=1e-3)
    assert not _train_result(params=[bad]).bit_exact


# ----------------------------------------------------------------------------- helpers the notebook relies on


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_default_shapes_fit_every_gemm_and_shard(world_size):
    dim, hidden, tokens = lesson.default_shapes("hybrid", world_size)
    assert dim % 16 == hidden % 16 == tokens % 16 == 0  # the FP8 GEMM rule; tokens are wgrad's K
    dim, hidden, tokens = lesson.default_shapes("blockwise", world_size)
    assert dim % (128 * world_size) == hidden % (128 * world_size) == 0  # whole 128x128 tiles per rank's shard
    assert tokens % 128 == 0  # wgrad's 1x128 blocks run along the tokens
    with pytest.raises(ValueError, match="recipe must be one of"):
        lesson.default_shapes("mxfp8", world_size)


def test_weight_formats_match_the_recipes():
    assert lesson.WEIGHT_FORMATS == {"hybrid": "fp8", "blockwise": "fp8_128x128"}


def test_count_dequantizes_counts_fp8_tensors_and_restores_the_methods():
    w8 = CurrentScaling("e4m3").quantize(torch.randn(16, 32))
    wb = BlockwiseFP8Quantizer((128, 128)).quantize(torch.randn(128, 128))
    original = type(w8).dequantize
    with lesson.count_dequantizes() as count:
        w8.dequantize()
        wb.dequantize(torch.float32)
        torch.randn(3).float()  # a plain tensor: not counted
    assert count.calls == 2
    assert type(w8).dequantize is original
    w8.dequantize()
    assert count.calls == 2  # no longer counting


# ----------------------------------------------------------------------------- the notebook


def _notebook():
    return nbformat.read(NOTEBOOK, as_version=4)


def test_the_notebook_uses_public_names_only():
    code = "\n".join(c.source for c in _notebook().cells if c.cell_type == "code")
    shown = re.findall(r"getsource\(([\w.]+)\)", code)
    assert shown and not [s for s in shown if s.rsplit(".", 1)[-1].startswith("_")], shown


def test_the_notebook_runs_the_rank_functions_in_one_launch():
    code = "\n".join(c.source for c in _notebook().cells if c.cell_type == "code")
    assert code.count("launch(") == 1, "every rank function of the lesson runs in ONE launch (each costs seconds)"
    for name in RANK_FUNCTIONS:
        assert f"lesson.{name}" in code


def test_the_notebook_has_the_lesson_structure():
    nb = _notebook()
    assert nb.cells[0].source.startswith("# 09 · ")
    assert all(c.get("id") for c in nb.cells), "every cell has an id"
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    for line in ('device = "auto"', "world_size = 2", "quick = True"):
        assert line in params.source
    sections = [c.source.splitlines()[0] for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## ")]
    assert [s.split(".")[0] for s in sections] == [f"## {i}" for i in range(1, 9)], sections
    assert sum("self-check" in c.metadata.get("tags", []) for c in nb.cells) >= 10


def test_every_exercise_has_a_prompt_and_a_self_check():
    cells = _notebook().cells
    exercises = [i for i, c in enumerate(cells) if "exercise" in c.metadata.get("tags", [])]
    assert len(exercises) >= 2
    for n, i in enumerate(exercises, start=1):
        prompt = cells[i - 1]
        assert prompt.cell_type == "markdown" and re.search(rf"Exercise {n}: .*change .*predict", prompt.source,
                                                            re.IGNORECASE), prompt.source[:120]
        assert cells[i].cell_type == "code" and "<- change me" in cells[i].source
        assert "self-check" in cells[i + 1].metadata.get("tags", []), f"exercise {n} has no self-check after it"


def test_no_dated_measurement_is_written_into_the_notebook():
    """Numbers measured on a machine come from benchmarks/results/*.json at run time, never from the text."""
    text = "\n".join(c.source for c in _notebook().cells)
    assert not re.search(r"20\d\d-\d\d-\d\d", text)
    assert not re.search(r"\d+(\.\d+)?\s*TFLOPS", text)


# ----------------------------------------------------------------------------- one small launch


@pytest.mark.distributed
def test_train_compare_fp8_is_bit_exact_at_two_ranks_on_cpu():
    results = launch(lesson.train_compare_fp8, world_size=2, device="cpu", kwargs=dict(recipe="hybrid", steps=2),
                     timeout=120, echo=False)
    assert [r.rank for r in results] == [0, 1]
    for r in results:
        assert isinstance(r, lesson.Fp8TrainCompareResult) and r.world_size == 2
        assert (r.dim, r.hidden, r.tokens) == lesson.default_shapes("hybrid", 2)
        assert r.bit_exact and r.masters_max_abs_diff == 0.0, dataclasses.asdict(r)
        assert r.weight_dequantizes == 0 and r.fallbacks == 0
        assert [(g.scaling, g.backend, g.calls) for g in r.gemms] == [("tensorwise", "emulated", 2 * 2 * 2 * 3)]
        assert r.losses != r.dequant_losses
    assert results[0].losses == results[1].losses  # the global loss, all-reduced


def _deterministic_flag_in_timed_steps(calls: list) -> dict:
    """Rank function: ``run_sequence(calls)`` with torch's deterministic-algorithms flag recorded inside
    ``train_compare_fp8`` and inside every step that ``step_breakdown`` and ``fsdp2_step_benchmark`` time or
    profile. On CUDA ranks ``world_mesh(deterministic=True)`` switches the flag on (``deterministic_cuda``);
    these are CPU ranks, where it does not, so ``train_compare_fp8``'s mesh call does it here too."""
    seen = {"train_compare_fp8": [], "step_breakdown": [], "fsdp2_step_benchmark": []}
    flag = torch.are_deterministic_algorithms_enabled
    world_mesh, count_dequantizes = lesson.world_mesh, lesson.count_dequantizes

    def cuda_like_mesh(*, deterministic=False):
        mesh = world_mesh(deterministic=deterministic)
        if deterministic:
            torch.use_deterministic_algorithms(True)  # what deterministic_cuda() does on a CUDA rank
        return mesh

    def probed(timer, name):
        def timed(step, dev, reps, *args, **kwargs):
            def step_probed():
                seen[name].append(flag())
                step()
            return timer(step_probed, dev, reps, *args, **kwargs)
        return timed

    lesson.world_mesh = cuda_like_mesh
    lesson.count_dequantizes = lambda: (seen["train_compare_fp8"].append(flag()), count_dequantizes())[1]  # per step
    for module, name in ((lesson, "step_breakdown"), (fp8_step_benchmark, "fsdp2_step_benchmark")):
        module.median_ms_all_ranks = probed(module.median_ms_all_ranks, name)
        module.profiled_range_ms = probed(module.profiled_range_ms, name)
    run_sequence(calls)
    return {**seen, "after": flag()}


@pytest.mark.distributed
def test_the_timed_steps_run_without_the_deterministic_algorithms_of_train_compare_fp8():
    """Section 6 runs ``train_compare_fp8`` (deterministic kernels, for its bit-exact check) and then the timed
    functions in the same rank processes. Deterministic algorithms would make every ``torch.empty`` in a timed
    step fill its memory with NaN: ``train_compare_fp8`` must set them back to off when it returns."""
    calls = [(lesson.train_compare_fp8, dict(recipe="hybrid", steps=1)),
             (lesson.step_breakdown, dict(recipe="hybrid", reps=1)),
             (fp8_step_benchmark.fsdp2_step_benchmark, dict(dim=32, hidden=64, n_blocks=1, tokens=16, reps=1,
                                                            profile_steps=1, variants=("bf16", "hybrid")))]
    for seen in launch(_deterministic_flag_in_timed_steps, world_size=2, device="cpu", args=(calls,), timeout=300,
                       echo=False):
        assert seen["train_compare_fp8"] == [True], seen  # the flag was on while it trained ...
        for timed in ("step_breakdown", "fsdp2_step_benchmark"):
            assert seen[timed] and not any(seen[timed]), (timed, seen)  # ... and off in every timed step
        assert seen["after"] is False
