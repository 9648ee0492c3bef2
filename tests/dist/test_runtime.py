"""Where a lesson's ranks run: one GPU per rank when there are enough, CPU ranks otherwise.

The GPU counts are simulated (``torch.cuda`` patched) so the one-GPU rules are tested on every machine;
the launch at the end is real: CPU ranks spawned by a process whose Triton kernels are compiled must
still run theirs in the interpreter.
"""

import os

import pytest
import torch

from tutorial_lib.dist import runtime
from tutorial_lib.dist.launcher import launch
from tutorial_lib.dist.runtime import rank_placement, require_world_size


@pytest.fixture
def gpus(monkeypatch):
    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_count


def test_one_gpu_two_ranks_runs_the_ranks_on_cpu_at_quick_sizes(gpus):
    gpus(1)
    p = rank_placement("auto", world_size=2, quick=False)
    assert p.device == torch.device("cpu") and p.world_size == 2 and p.quick is True
    assert "2 > 1 visible GPU(s)" in p.reason and "single-device cells still run on the GPU" in p.reason


def test_enough_gpus_put_one_rank_on_each(gpus):
    gpus(2)
    p = rank_placement("cuda", world_size=2, quick=False)
    assert p.device.type == "cuda" and p.quick is False
    gpus(1)
    assert rank_placement("auto", world_size=1, quick=False).device.type == "cuda"


def test_cpu_lessons_keep_their_sizes(gpus):
    gpus(0)
    p = rank_placement("auto", world_size=3, quick=False)
    assert p.device == torch.device("cpu") and p.quick is False


def test_forced_choices_and_bad_values(gpus):
    gpus(1)
    assert rank_placement("cuda", world_size=1, quick=False, rank_device="cpu").device.type == "cpu"
    with pytest.raises(ValueError, match="needs one GPU per rank, but 1 GPU"):
        rank_placement("cuda", world_size=2, rank_device="cuda")
    with pytest.raises(ValueError, match="rank_device must be one of"):
        rank_placement("auto", world_size=2, rank_device="gpu")
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        rank_placement("auto", world_size=0)
    gpus(0)
    with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
        rank_placement("cuda", world_size=1)


def test_require_world_size_names_the_minimum_and_the_way_out():
    require_world_size(2, 2, "why")
    with pytest.raises(ValueError, match=r"needs world_size >= 2: sharding needs ranks\. Got world_size=1"):
        require_world_size(1, 2, "sharding needs ranks")


@pytest.mark.distributed
def test_cpu_ranks_run_triton_in_the_interpreter_whatever_the_caller_uses(monkeypatch):
    """A lesson on a GPU (kernels compiled, TRITON_INTERPRET unset or 0) launching CPU ranks: the ranks
    must decorate their kernels for the interpreter, and the caller's setting must be left as it was."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    seen = launch(os.getenv, world_size=2, device="cpu", args=("TRITON_INTERPRET",), timeout=120)
    assert seen == ["1", "1"]
    assert os.environ["TRITON_INTERPRET"] == "0"
    monkeypatch.delenv("TRITON_INTERPRET")
    launch(os.getenv, world_size=1, device="cpu", args=("TRITON_INTERPRET",), timeout=120)
    assert "TRITON_INTERPRET" not in os.environ
    assert runtime.resolve_device("cpu") == torch.device("cpu")


def test_resolve_device_names_bad_strings_and_keeps_a_device_it_is_given():
    assert runtime.resolve_device(torch.device("cpu")) == torch.device("cpu")
    # a torch.device is the caller's placement: kept as is, even one this machine lacks (no GPU here or not)
    assert runtime.resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"device must be one of \('auto', 'cpu', 'cuda'\), got 'gpu'"):
        runtime.resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
            runtime.resolve_device("cuda")


def test_cpu_work_next_to_compiled_kernels_is_refused_with_the_fix(monkeypatch):
    """Triton fixes compiled-vs-interpreted when the library is imported; CPU tensors need the interpreter."""
    monkeypatch.setattr(runtime, "triton_mode", lambda: "compiled")   # as on a GPU machine without the flag
    with pytest.raises(ValueError, match=r"needs the Triton kernels interpreted.*TRITON_INTERPRET=1"):
        runtime.require_kernels_for("cpu")
    runtime.require_kernels_for(torch.device("cuda"))                  # compiled kernels are what CUDA wants
    monkeypatch.setattr(runtime, "triton_mode", lambda: "interpreted")
    runtime.require_kernels_for("cpu")
    runtime.require_kernels_for(torch.device("cpu"))


def test_deterministic_cuda_is_strict_so_ops_take_their_deterministic_variant(monkeypatch):
    """warn_only=True lets an op that has a deterministic variant (a fused attention backward) run its
    nondeterministic one and only warn: the mode must be strict, and the cuBLAS workspace set unless the caller
    set one."""
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        runtime.deterministic_cuda()
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == runtime.CUBLAS_DETERMINISTIC_WORKSPACE
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        runtime.deterministic_cuda()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # the caller's choice is kept
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


@pytest.mark.parametrize("value, interp", [("1", True), ("true", True), ("On", True), ("YES", True), ("0", False),
                                           ("false", False), ("off", False), ("no", False), ("2", False), ("", False)])
def test_triton_interpret_is_read_the_way_triton_reads_it(monkeypatch, value, interp):
    """``TRITON_INTERPRET=false`` compiles the kernels (Triton's own parsing): reports must not say "interpreted"."""
    import triton
    from tutorial_kernels import interpreted

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert bool(triton.knobs.runtime.interpret) is interp  # what triton.jit consults when it decorates a kernel
    assert interpreted() is interp
    assert runtime.triton_mode() == ("interpreted" if interp or not torch.cuda.is_available() else "compiled")
