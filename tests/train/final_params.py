"""Helpers of the training-loop tests that compare whole runs: the parameters a run ended with, and how far
two such sets are apart. (tests/train is on ``sys.path`` when its tests run: import as ``final_params``.)"""

import os

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tutorial_lib.train.checkpoints import checkpoint_path


def final_params(out: str, step: int, tmp_path) -> dict[str, torch.Tensor]:
    """Every floating parameter of the run's checkpoint at ``step``, merged into one file by DCP's converter
    (which reads every weight, quantized ones included, as fp32 values)."""
    path = tmp_path / (os.path.basename(out) + ".pt")
    dcp_to_torch_save(checkpoint_path(out, step), path)
    model = torch.load(path, weights_only=False)["train"]["model"]
    return {k: v.float() for k, v in model.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def max_rel_l2(a: dict, b: dict) -> float:
    """The largest relative L2 distance ``|a - b| / |a|`` over the parameters (same keys on both sides)."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / a[k].norm()) for k in a)
