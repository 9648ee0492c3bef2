"""Bad training inputs refused in-process with errors that name the constraint: data split options,
CLI options (an unknown size, a configuration TrainConfig refuses), and checkpoint arguments
(resume targets, save / load modes)."""

import os

import pytest
import torch

from tutorial_lib.dist.checkpoint import load_checkpoint, save_checkpoint
from tutorial_lib.train.checkpoints import checkpoint_path, resolve_resume
from tutorial_lib.train.cli import parse_args
from tutorial_lib.train.data import TextData


@pytest.mark.parametrize("kw, message", [
    ({"seq_len": 0}, "seq_len must be >= 1, got 0"),
    ({"val_fraction": 1.0}, r"val_fraction must be in \(0, 1\), got 1.0"),
    ({"val_fraction": 0.0}, r"val_fraction must be in \(0, 1\), got 0.0"),
    ({"seq_len": 10 ** 7}, "seq_len 10000000 is longer than the validation split"),
])
def test_text_data_refuses_bad_split_options(kw, message):
    with pytest.raises(ValueError, match=message):
        TextData.load(**kw)


@pytest.mark.parametrize("argv, message", [
    (["--size", "huge"], "unknown --size 'huge'; known sizes: tiny, small"),
    (["--steps", "0"], "steps must be >= 1, got 0"),  # refused by TrainConfig, reported as a usage error
    (["--micro-batches", "0"], "micro_batches must be >= 1, got 0"),
])
def test_cli_refuses_bad_options_with_a_usage_error(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--out", "runs/x", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_resume_resolves_latest_and_an_explicit_complete_checkpoint(tmp_path):
    for step in (10, 20):
        os.makedirs(checkpoint_path(tmp_path, step))
        open(os.path.join(checkpoint_path(tmp_path, step), ".metadata"), "w").close()
    assert resolve_resume("latest", tmp_path) == checkpoint_path(tmp_path, 20)
    assert resolve_resume(checkpoint_path(tmp_path, 10), tmp_path) == checkpoint_path(tmp_path, 10)


def test_save_and_load_refuse_unknown_modes_before_touching_the_path(tmp_path):
    with pytest.raises(ValueError, match="mode must be 'sync' or 'async', got 'Async'"):
        save_checkpoint({"x": torch.randn(3)}, tmp_path / "c", mode="Async")
    assert not (tmp_path / "c").exists()
    x = torch.randn(3)
    save_checkpoint({"x": x}, tmp_path / "c")
    target = {"x": torch.zeros(3)}
    with pytest.raises(ValueError, match="requantize must be 'error' or 'allow', got 'yes'"):
        load_checkpoint(target, tmp_path / "c", requantize="yes")
    assert torch.equal(load_checkpoint(target, tmp_path / "c")["x"], x)
