"""Lesson 06's module and notebook keep to the lesson contract, checked without launching ranks.

The rank functions themselves run in tests/dist/test_fsdp2.py and tests/dist/test_quantized_init.py
(they drive the FSDP2 hooks and the quantized init); here: every rank function returns a documented,
picklable dataclass, and the lesson uses only public library names.
"""

import dataclasses
import inspect
import pickle
import re
from pathlib import Path

import nbformat

from tutorial_lib.lessons import fsdp2_quantized_init as lesson

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "06_fsdp2_quantized_init.ipynb"
RANK_FUNCTIONS = ["allgather_demo", "init_memory_demo", "pitfall_demo", "train_compare", "allgather_benchmark"]
RESULT_TYPES = [obj for _, obj in inspect.getmembers(lesson, inspect.isclass)
                if dataclasses.is_dataclass(obj) and obj.__module__ == lesson.__name__]


def test_results_pickle_as_module_level_types():
    check = lesson.UnshardCheck(buffers_equal=True, values_equal=False, max_abs_err=1.0, max_abs=2.0)
    case = lesson.ScaleCase(share_scales=False, scale_inv=0.5, unshard=check, verify="ok")
    res = lesson.PitfallResult(rank=1, per_shard_scales=case, shared_scales=case, post_all_gather_copy="x",
                               post_all_gather_alias="ok")
    assert pickle.loads(pickle.dumps(res)) == res
    variant = lesson.InitVariant(label="bf16, meta init", peak=1, resident=2)
    mem = lesson.InitMemoryResult(rank=0, params=3, bf16_built_whole=variant, bf16_meta_init=variant,
                                  quantized_meta_init=variant, quantized_meta_init_hp_kept=variant)
    assert pickle.loads(pickle.dumps(mem)).variants == (variant,) * 4


def test_the_notebook_uses_public_names_only():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    shown = re.findall(r"getsource\(([\w.]+)\)", code)
    assert shown and not [s for s in shown if s.rsplit(".", 1)[-1].startswith("_")], shown


def test_resident_bytes_count_storages_so_a_short_shard_counts_its_padded_rows():
    import torch
    import torch.nn as nn

    from tutorial_lib.quant.float8 import CurrentScaling

    model = nn.Module()
    padded = torch.zeros(19, 24)  # FSDP2's ceil(37 / 2) rows; the short rank's 18-row shard is a view into it
    model.plain = nn.Parameter(padded[:18])
    q = CurrentScaling("e4m3").quantize(torch.randn(19, 24))
    model.fp8 = nn.Parameter(q[:18], requires_grad=False)  # a narrowed Float8Tensor: a view of its 19-row codes
    assert lesson._resident_bytes(model) == 19 * 24 * 4 + (19 * 24 + 4)  # fp32 rows + FP8 codes + scale_inv
