"""FusedAdam's fused current scaling: per-tensor FP8 parameters with ``CurrentScaling`` quantizers get
their bytes from the Adam pass's amaxes, one all-reduce per bucket and ONE multi-tensor cast launch.

The results equal, byte for byte, the unfused route (``fuse_requantize=False``: the kernel writes the
masters, then every parameter is requantized by ``local.copy_(master)``), over several steps with
skipped grads, empty and odd-sized tensors, NaN updates, both FP8 formats and power-of-two scales;
and the host work of a step no longer grows with the number of parameters (counted, not timed).
Distributed cases (one all-reduce for 100 parameters; uneven FSDP2 shards whose short shard is a
view): tests/optim/test_amax_reduce.py and tests/dist/test_amax_reduce_uneven.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tutorial_lib.optim.fused_adam import FusedAdam
from tutorial_lib.optim.fused_adam_plan import fused_current_scaling
from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = ((4, 64), (3, 5), (0, 64), (1, 1), (17, 33))
HP = dict(lr=1e-2, weight_decay=0.1, master_weights=True)


def _params(factory, seed: int, shapes=SHAPES) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(factory().quantize(torch.randn(s, generator=g).mul(1 + i).to(DEV, torch.bfloat16)))
            for i, s in enumerate(shapes)]


def _bits(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(torch.int32) if buf.dtype == torch.float32 else buf.view(torch.uint8)


@pytest.mark.parametrize("fmt,pow2", [("e4m3", False), ("e5m2", True)])
def test_fused_equals_copy_route_with_skipped_empty_and_nan(fmt, pow2):
    factory = lambda: CurrentScaling(fmt, pow2_scales=pow2)  # noqa: E731
    fused_p, ref_p = _params(factory, 0), _params(factory, 0)
    before = [{k: v.clone() for k, v in p.raw_buffers().items()} for p in fused_p]
    fused, ref = FusedAdam(fused_p, **HP), FusedAdam(ref_p, **HP, fuse_requantize=False)
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        for i, (p, q) in enumerate(zip(fused_p, ref_p)):
            if step == 1 and i == 1:  # no grad this step: bytes, scale and master untouched
                p.grad = q.grad = None
                continue
            p.grad = torch.randn(p.shape, generator=gen).to(DEV, torch.bfloat16)
            if step == 3 and i == 4:
                p.grad[2, 7] = float("nan")  # the master turns NaN: NaN scale, every byte NaN
            q.grad = p.grad.clone()
        fused.step()
        ref.step()
    assert [b.fused_format for b in fused._plans[0].buckets] == ["fp8_current"]
    assert [b.fused_format for b in ref._plans[0].buckets] == [None]
    assert fused.routes() == ref.routes() == [["requantize"] * len(SHAPES)]
    for i, (p, q) in enumerate(zip(fused_p, ref_p)):
        assert torch.equal(_bits(fused.state[p]["master_param"]), _bits(ref.state[q]["master_param"])), i
        for name, buf in p.raw_buffers().items():
            assert torch.equal(_bits(buf), _bits(q.raw_buffers()[name])), (i, name)
        if p.numel() > 1:  # the bytes moved (a power-of-two scale may stay where it was)
            assert not torch.equal(p.raw_buffers()["data"], before[i]["data"]), (i, "never changed: vacuous")
    assert torch.isnan(fused_p[4].raw_buffers()["scale_inv"]).all()


def test_partial_view_parameters_rescale_their_whole_root_like_copy():
    """A parameter that is a partial view of a larger FP8 tensor shares the root's scale: the fused route
    must rescale the whole root as ``copy_`` does -- its amax over the root's values with the view's part
    replaced, and the root's other elements requantized with that scale. Two roots: in one the view holds
    the largest values, in the other the rows outside it do (the root's amax, not the view's, sets the
    scale). lr 0.5 moves root 0's amax by ~10%, so codes of its other elements must change with the scale
    (a change well below an E4M3 step, 2**-3, rounds most of them back to the same codes). (FSDP2's short
    last shard is such a view, but its other rows are zero padding, which hides all of this.)"""

    def make():
        g = torch.Generator().manual_seed(3)
        rows = [torch.tensor([1.0] * 2 + [4.0] * 3 + [1.0] * 3), torch.tensor([4.0] * 2 + [1.0] * 3 + [4.0] * 3)]
        roots = [CurrentScaling("e4m3").quantize((torch.randn(8, 64, generator=g) * r[:, None]).to(DEV, torch.bfloat16))
                 for r in rows]
        return roots, [torch.nn.Parameter(r[2:5]) for r in roots]

    (roots_a, pa), (roots_b, pb) = make(), make()
    assert all(p._view_root is not None for p in pa)
    hp = {**HP, "lr": 0.5}
    fused, ref = FusedAdam(pa, **hp), FusedAdam(pb, **hp, fuse_requantize=False)
    outside = [0, 1, 5, 6, 7]  # rows of root 0 outside the view
    codes_before = roots_a[0].raw_buffers()["data"][outside].clone()
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        for p, q in zip(pa, pb):
            p.grad = torch.randn(p.shape, generator=gen).to(DEV, torch.bfloat16)
            q.grad = p.grad.clone()
        fused.step()
        ref.step()
    assert [b.fused_format for b in fused._plans[0].buckets] == ["fp8_current"]
    for i, (a, b) in enumerate(zip(roots_a, roots_b)):
        for name, buf in a.raw_buffers().items():
            assert torch.equal(_bits(buf), _bits(b.raw_buffers()[name])), (i, name)
    changed = (roots_b[0].raw_buffers()["data"][outside] != codes_before).sum().item()
    assert changed > 0, "copy_ requantized no code outside the view: the case is vacuous"


def _ops_per_step(n_params: int, **kw) -> int:
    """aten ops dispatched by one step (after the first, which builds state and tables)."""
    params = _params(lambda: CurrentScaling("e4m3"), 2, shapes=[(8, 16)] * n_params)
    opt = FusedAdam(params, **HP, **kw)
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(DEV, torch.bfloat16)
    opt.step()

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        opt.step()
    return Count.n


def test_host_work_of_a_step_does_not_grow_with_the_parameter_count():
    fused = [_ops_per_step(n) for n in (4, 16)]
    unfused = [_ops_per_step(n, fuse_requantize=False) for n in (4, 16)]
    assert fused[0] == fused[1], f"fused route: {fused} aten ops for 4 / 16 parameters"
    # unfused: at least one more dispatched op per parameter -- its copy_, which runs the amax and the cast
    # inside the format's own dispatch (not seen by the counter), each a kernel launch or more on a GPU
    assert unfused[1] - unfused[0] >= 12, f"unfused route: {unfused} aten ops for 4 / 16 parameters"


def test_which_tensors_are_fused():
    """Exact CurrentScaling quantizers on whole per-tensor buffers; others keep their routes."""

    class MyScaling(CurrentScaling):
        pass

    x = torch.randn(8, 16).to(DEV)
    assert fused_current_scaling(CurrentScaling("e5m2", pow2_scales=True).quantize(x)) == ("e5m2", True, 1e-12, None)
    assert fused_current_scaling(MyScaling().quantize(x)) is None  # a subclass may change the rule
    assert fused_current_scaling(DelayedScaling().quantize(x)) is None  # delayed: the fp8_fused route
    assert fused_current_scaling(x) is None
    params = _params(lambda: CurrentScaling("e4m3"), 0)
    off = FusedAdam(params, **HP, batch_amax_reduce=False)  # per-parameter all-reduces: not fused
    for p in params:
        p.grad = torch.zeros_like(p.dequantize())
    off.step()
    assert [b.fused_format for b in off._plans[0].buckets] == [None]


def test_a_quantizer_that_lost_its_group_is_refused():
    """A pickled quantizer drops its process group; scaling per shard instead would be silently wrong."""
    p = torch.nn.Parameter(CurrentScaling("e4m3").quantize(torch.randn(4, 16).to(DEV)))
    q = CurrentScaling("e4m3")
    q.__setstate__({**q.__getstate__(), "group_dropped": True})  # what unpickling a grouped quantizer leaves
    p.quantizer = q
    opt = FusedAdam([p], **HP)
    p.grad = torch.randn(4, 16).to(DEV)
    with pytest.raises(RuntimeError, match="set_group"):
        opt.step()
