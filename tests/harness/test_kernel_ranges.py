"""kernel_time_by_range: kernels attributed to the ranges open around their launch calls (Triton's included)."""

import dataclasses
import re

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from tutorial_lib.harness.kernel_ranges import LAUNCH_CALL, device_time_by_kernel, exact_name, kernel_time_by_range

CPU, CUDA = DeviceType.CPU, DeviceType.CUDA


@dataclasses.dataclass
class _Span:
    start: float
    end: float


@dataclasses.dataclass
class _Event:  # the FunctionEvent fields the attribution reads
    name: str
    device_type: DeviceType
    id: int
    thread: int
    time_range: _Span
    is_user_annotation: bool = False


def _ev(name, dev, id_, thread, a, b, ann=False):
    return _Event(name, dev, id_, thread, _Span(a, b), ann)


R = {"r": re.compile(r"^r$"), "other": re.compile(r"^other$")}


def test_a_triton_launch_inside_a_range_counts_there():
    events = [
        _ev("r", CPU, 1, 1, 0, 100, ann=True),  # the range (CPU-side entry)
        _ev("cuLaunchKernelEx", CPU, 7, 1, 10, 12),  # Triton's launch: correlation id 7
        _ev("_cast_kernel", CUDA, 7, 1, 300, 305.5),  # its kernel, later on the device
        _ev("r", CUDA, 1, 1, 300, 400, ann=True),  # the range's GPU-side copy: a span, not a kernel
        _ev("aten::mul", CPU, 7, 1, 500, 510),  # an operator whose id collides with the correlation id
    ]
    t = kernel_time_by_range(events, R)
    assert t.device_us == {"r": 5.5, "other": 0.0}
    assert t.kernels == {"r": 1, "other": 0}
    assert t.unlinked == 0


def test_launches_outside_every_range_nested_ranges_and_unlinked_kernels():
    events = [
        _ev("r", CPU, 1, 1, 0, 100, ann=True),
        _ev("r", CPU, 2, 1, 20, 30, ann=True),  # nested in the first: a kernel still counts once
        _ev("cudaLaunchKernel", CPU, 11, 1, 25, 26),
        _ev("k1", CUDA, 11, 1, 200, 203),
        _ev("cudaMemcpyAsync", CPU, 12, 1, 150, 151),  # after the range closed
        _ev("Memcpy DtoD", CUDA, 12, 1, 210, 260),
        _ev("k3", CUDA, 99, 1, 300, 301),  # no launch call recorded
    ]
    t = kernel_time_by_range(events, R)
    assert t.device_us["r"] == 3 and t.kernels["r"] == 1
    assert t.unlinked == 1


def test_same_thread_or_time_window():
    events = [
        _ev("r", CPU, 1, 1, 0, 100, ann=True),  # opened on the main thread (e.g. around loss.backward())
        _ev("cudaLaunchKernel", CPU, 5, 2, 40, 41),  # launched by another thread (autograd's) meanwhile
        _ev("k", CUDA, 5, 2, 60, 70),
    ]
    assert kernel_time_by_range(events, R).device_us["r"] == 0
    assert kernel_time_by_range(events, R, same_thread=False).device_us["r"] == 10


def test_launch_call_names():
    for name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemcpyAsync",
                 "cudaMemsetAsync"):
        assert LAUNCH_CALL.match(name), name
    for name in ("aten::cumsum", "custom_range", "cublas", "r"):
        assert not LAUNCH_CALL.match(name), name


def test_a_cpu_profile_has_no_device_time():
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("r"):
            x @ x
    t = kernel_time_by_range(prof.events(), R)
    assert t.device_us == {"r": 0.0, "other": 0.0} and t.unlinked == 0


class _TritonTransposeBackward(torch.autograd.Function):
    """Identity forward; backward transposes twice with the Triton kernel inside a range (autograd's thread)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        from tutorial_kernels.transpose import transpose

        g = g.contiguous()  # sum's gradient is an expanded view: its copy is not the range's business
        with record_function("other"):
            return transpose(transpose(g))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compiled Triton kernels and CUPTI")
def test_triton_kernels_on_the_gpu_are_attributed_to_their_ranges():
    from tutorial_kernels.transpose import transpose

    c = torch.randint(0, 256, (2048, 4096), dtype=torch.uint8, device="cuda")
    x = torch.randn(2048, 4096, device="cuda")
    w = torch.randn(256, 256, device="cuda", requires_grad=True)
    for _ in range(2):  # compile and load every kernel outside the profile
        transpose(transpose(c)), x * 2
        _TritonTransposeBackward.apply(w).sum().backward()
    torch.cuda.synchronize()
    ranges = {**R, "aten": re.compile(r"^aten$")}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("r"):
            transpose(transpose(c))  # Triton only: launched by no torch operator
        with record_function("aten"):
            x * 2  # one aten kernel
        _TritonTransposeBackward.apply(w).sum().backward()  # "other": two transposes on autograd's thread
        torch.cuda.synchronize()
    events = prof.events()
    t = kernel_time_by_range(events, ranges)
    transposes = sorted((e for e in events if e.device_type == CUDA and e.name == "_transpose_kernel"),
                        key=lambda e: e.time_range.start)
    assert len(transposes) == 4 and t.unlinked == 0
    span = [e.time_range.end - e.time_range.start for e in transposes]
    assert t.kernels["r"] == 2 and t.device_us["r"] == pytest.approx(span[0] + span[1])
    assert t.kernels["other"] == 2 and t.device_us["other"] == pytest.approx(span[2] + span[3])
    assert t.kernels["aten"] == 1 and t.device_us["aten"] > 0


def test_exact_name_matches_one_label_and_nothing_else():
    """Range labels hold regex characters ("fp8_linear.quantize", "FSDP::all_gather (1)"): escaped, whole."""
    p = exact_name("fp8_linear.quantize")
    assert p.match("fp8_linear.quantize")
    assert not p.match("fp8_linearXquantize") and not p.match("fp8_linear.quantize_t")
    assert not p.match("x fp8_linear.quantize")
    assert exact_name("a (1)+").match("a (1)+") and not exact_name("a (1)+").match("a 1")


def test_device_time_by_kernel_sums_every_device_activity_per_name_largest_first():
    events = [_ev("cuLaunchKernelEx", CPU, 1, 0, 0, 1), _ev("adam_kernel", CUDA, 1, 0, 10, 40),
              _ev("cudaLaunchKernel", CPU, 2, 0, 2, 3), _ev("amax", CUDA, 2, 0, 41, 45),
              _ev("cuLaunchKernelEx", CPU, 3, 0, 4, 5), _ev("adam_kernel", CUDA, 3, 0, 50, 80),
              _ev("Memcpy HtoD", CUDA, 9, 0, 81, 82),          # no launch call recorded: counted all the same
              _ev("step", CUDA, 7, 0, 0, 90, ann=True),         # a range's GPU-side copy: not device work
              _ev("aten::add", CPU, 8, 0, 0, 1)]
    assert device_time_by_kernel(events) == {"adam_kernel": (60.0, 2), "amax": (4.0, 1), "Memcpy HtoD": (1.0, 1)}
    assert device_time_by_kernel(events, steps=2) == {"adam_kernel": (30.0, 1), "amax": (2.0, 0.5),
                                                      "Memcpy HtoD": (0.5, 0.5)}
    assert list(device_time_by_kernel(events)) == ["adam_kernel", "amax", "Memcpy HtoD"]
    with pytest.raises(ValueError, match="steps must be >= 1"):
        device_time_by_kernel(events, steps=0)
    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        x @ x
    assert device_time_by_kernel(prof.events()) == {}
