"""DCP pitfalls with quantized tensors, in one process: each reproduced on a broken variant, then fixed.

Every pitfall has a *contract* test parametrised over ``broken`` and ``fixed``: the broken variant
is marked ``xfail(strict=True)``, so the suite fails if the pitfall ever stops reproducing, and the
same assertions must pass on the fix. The other tests pin down what users see (exact messages).

The broken variants are built HERE by subclassing (the real classes are never edited):
``_PlainNewEmptyFloat8`` (async staging), ``_PickledExtraStateLinear`` (size-varying extra state).
Distributed round trips (FSDP2, resharding, export) are in ``test_checkpoint_dist.py``.
"""

import contextlib
import os
import pickle
import shutil
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from tutorial_lib.dist.checkpoint import (
    CheckpointDir,
    CheckpointExistsError,
    NonFiniteCheckpointError,
    RequantizeOnLoadError,
    checkpoint_dir,
    default_safe_globals_only,
    load_checkpoint,
    mismatched_keys,
    nonfinite_keys,
    save_checkpoint,
    uninitialized_memory_as_nan,
)
from tutorial_lib.dist.extra_state import (
    QuantizerExtraStateMixin,
    QuantizerStates,
    decode_quantizer_state,
    encode_quantizer_state,
)
from tutorial_lib.dist.training_state import init_optimizer_state, optimizer_step_count
from tutorial_lib.quant.float8 import CurrentScaling, DelayedScaling, Float8Tensor
from tutorial_lib.quant.registry import FORMAT_NAMES, make_quantizer
from tutorial_lib.quant.serialization import register_safe_globals

aten = torch.ops.aten
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def broken(value, raises=AssertionError):
    """The pitfall: this variant MUST fail the contract (strict xfail)."""
    return pytest.param(value, id="broken", marks=pytest.mark.xfail(strict=True, raises=raises,
                                                                    reason="broken variant reproduces the pitfall"))


def fixed(value):
    return pytest.param(value, id="fixed")


# ----------------------------------------------------------------------------- broken variants (test-only)


class _PlainNewEmptyFloat8(Float8Tensor):
    """BROKEN on purpose: ``new_empty`` returns a plain tensor, as a subclass without that handler would."""


@_PlainNewEmptyFloat8.implements(aten.new_empty.default)
def _plain_new_empty(func, args, kwargs):
    t, size = args[0], args[1]
    return torch.empty(size, dtype=kwargs.get("dtype") or t.dtype, device=kwargs.get("device") or t.device)


def _randn(shape, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _live(cls=Float8Tensor, seed=0):
    """A small 'model state': two FP8 weights (current scaling) and a plain bias."""
    return {
        "fc1.weight": cls.from_high_precision(_randn((16, 8), seed), scale=32.0, quantizer=CurrentScaling("e4m3")),
        "fc2.weight": cls.from_high_precision(_randn((8, 16), seed + 1), scale=16.0, quantizer=CurrentScaling("e4m3")),
        "fc2.bias": _randn((8,), seed + 2, torch.float32),
    }


def _fresh_like(live, cls=Float8Tensor):
    """Targets of a freshly built model: same classes and shapes, different bytes AND scales."""
    return {k: cls.from_high_precision(torch.zeros(v.shape, dtype=v.dtype), scale=1.0) if isinstance(v, Float8Tensor)
            else torch.zeros_like(v) for k, v in live.items()}


def _plain_targets(live):
    return {k: torch.zeros(v.shape, dtype=torch.float32) for k, v in live.items()}


def _dcp_load_as_is(state, path):
    """Plain ``dcp.load``, registering nothing: what a new job does before it knows about this pitfall."""
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def _plain_dcp_load(state, path):
    """Plain ``dcp.load`` with the safe globals registered: loads anything, checks nothing."""
    register_safe_globals()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


# ----------------------------------------------------------------------------- pitfall: async staging


@pytest.mark.parametrize("cls", [broken(_PlainNewEmptyFloat8), fixed(Float8Tensor)])
def test_contract_async_checkpoint_holds_the_live_values(cls):
    """What an eval job reading the async checkpoint into fp32 gets must be the live values."""
    live = _live(cls)
    with checkpoint_dir() as root, uninitialized_memory_as_nan():
        path = os.path.join(root, "async")
        save_checkpoint(live, path, mode="async").result()
        register_safe_globals()
        plain = _plain_targets(live)
        dcp.load(plain, checkpoint_id=path, no_dist=True)
    for key, value in live.items():
        expected = value.dequantize(torch.float32) if isinstance(value, Float8Tensor) else value
        assert torch.equal(plain[key], expected), key


def test_async_save_of_a_plain_new_empty_subclass_writes_uninitialised_memory():
    live = _live(_PlainNewEmptyFloat8)
    with checkpoint_dir() as root, uninitialized_memory_as_nan():
        save_checkpoint(live, os.path.join(root, "async"), mode="async").result()
        save_checkpoint(live, os.path.join(root, "sync"))
        register_safe_globals()
        plain = _plain_targets(live)
        dcp.load(plain, checkpoint_id=os.path.join(root, "async"), no_dist=True)  # what users do: no error
        # the staged wrapper had no storage to copy: the file holds whatever torch.empty returned (NaN here)
        assert torch.isnan(plain["fc1.weight"]).all() and torch.isnan(plain["fc2.weight"]).all()
        assert torch.equal(plain["fc2.bias"], live["fc2.bias"])  # plain tensors are staged correctly
        # the sync path never stages: correct even for the broken class
        sync = _plain_targets(live)
        dcp.load(sync, checkpoint_id=os.path.join(root, "sync"), no_dist=True)
        assert torch.equal(sync["fc1.weight"], live["fc1.weight"].dequantize(torch.float32))
        # our loader refuses the broken checkpoint deterministically (the chunk is no longer quantized) ...
        with pytest.raises(RequantizeOnLoadError, match="'fc1.weight': the checkpoint does not hold"):
            load_checkpoint(_fresh_like(live), os.path.join(root, "async"))
        # ... and names the cause when the model itself uses the broken class
        with pytest.raises(TypeError, match="_PlainNewEmptyFloat8.new_empty returned a Tensor"):
            load_checkpoint(_fresh_like(live, _PlainNewEmptyFloat8), os.path.join(root, "sync"))


def test_async_save_equals_sync_equals_live_for_the_real_subclass():
    live = _live(Float8Tensor)
    with checkpoint_dir() as root:
        save_checkpoint(live, os.path.join(root, "async"), mode="async").result()
        save_checkpoint(live, os.path.join(root, "sync"))
        loaded = {}
        for mode in ("async", "sync"):
            loaded[mode] = load_checkpoint(_fresh_like(live), os.path.join(root, mode))
            assert mismatched_keys(loaded[mode], live) == []  # bytes, scale_inv, fmt and the bias: bit-exact
        assert mismatched_keys(loaded["async"], loaded["sync"]) == []
        assert type(loaded["async"]["fc1.weight"]) is Float8Tensor
        assert loaded["async"]["fc1.weight"].scale_inv.item() == 1 / 32  # the checkpoint's scale, not the target's


@pytest.mark.parametrize("loader", [broken(_dcp_load_as_is, raises=pytest.fail.Exception), fixed(load_checkpoint)])
def test_contract_a_dequantized_checkpoint_is_not_silently_requantized(loader):
    """A checkpoint staged by the blocking stager holds bf16 values; loading it must not pass as a restore."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    register_safe_globals()
    live = _live(Float8Tensor)
    with checkpoint_dir() as root:
        path = os.path.join(root, "blocking")
        dcp.async_save(live, checkpoint_id=path, no_dist=True, async_stager=BlockingAsyncStager()).result()
        with pytest.raises(RequantizeOnLoadError):
            loader(_fresh_like(live), path)


def test_blocking_stager_dequantizes_and_the_loader_refuses_to_requantize():
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    live = _live(Float8Tensor)
    with checkpoint_dir() as root:
        path = os.path.join(root, "blocking")
        dcp.async_save(live, checkpoint_id=path, no_dist=True, async_stager=BlockingAsyncStager()).result()
        with pytest.raises(RequantizeOnLoadError, match="would REQUANTIZE"):
            load_checkpoint(_fresh_like(live), path)
        out = load_checkpoint(_fresh_like(live), path, requantize="allow")  # explicit opt-in works
        for name in ("fc1.weight", "fc2.weight"):  # the saved values, requantized with the TARGET's scale (1.0)
            want = Float8Tensor.from_high_precision(live[name].dequantize(live[name].dtype), scale=1.0)
            assert torch.equal(out[name].raw_buffers()["data"], want.raw_buffers()["data"]), name
            assert out[name].raw_buffers()["scale_inv"].item() == 1.0, name


def test_allow_refuses_a_delayed_scaling_target_and_requantizes_a_current_scaling_one():
    """Initialising a quantized model from plain high-precision weights (what "allow" is for): a current-scaling
    target takes a scale from the loaded values (within E4M3's rounding); a delayed-scaling target would cast them
    with its history's scale -- here 1.0 for weights 100x larger than E4M3's 448, every one saturated -- so it is
    refused, naming the weight."""
    plain = {"w": 4e4 * _randn((16, 32), 5, torch.float32)}  # amax ~1e5, far above E4M3's max 448
    with checkpoint_dir() as root:
        save_checkpoint(plain, root)
        delayed = {"w": DelayedScaling("e4m3").quantize(torch.zeros(16, 32))}
        with pytest.raises(RequantizeOnLoadError, match="'w': requantize='allow' into a delayed-scaling weight"):
            load_checkpoint(delayed, root, requantize="allow")
        current = load_checkpoint({"w": CurrentScaling("e4m3").quantize(torch.zeros(16, 32))}, root,
                                  requantize="allow")
        err = (current["w"].dequantize() - plain["w"]).abs()
        amax = plain["w"].abs().max()  # E4M3 at scale 448 / amax: half a ULP (2**-4 relative), or half the
        assert bool((err <= torch.clamp_min(2.0**-4 * plain["w"].abs(), 2.0**-10 * amax / 448)).all())  # subnormal step


# ----------------------------------------------------------------------------- pitfall: NaN / Inf after load


@pytest.mark.parametrize("loader", [broken(_plain_dcp_load, raises=pytest.fail.Exception), fixed(load_checkpoint)])
def test_contract_a_poisoned_checkpoint_is_refused_naming_the_keys(loader):
    live = _live(_PlainNewEmptyFloat8)
    with checkpoint_dir() as root, uninitialized_memory_as_nan():
        path = os.path.join(root, "async")
        save_checkpoint(live, path, mode="async").result()
        with pytest.raises(NonFiniteCheckpointError) as info:
            loader(_plain_targets(live), path)
    assert set(info.value.keys) == {"fc1.weight", "fc2.weight"}


def test_nan_check_names_the_keys_the_broken_async_path_poisoned():
    live = _live(_PlainNewEmptyFloat8)
    with checkpoint_dir() as root, uninitialized_memory_as_nan():
        path = os.path.join(root, "async")
        save_checkpoint(live, path, mode="async").result()
        with pytest.raises(NonFiniteCheckpointError) as info:
            load_checkpoint(_plain_targets(live), path)
    assert set(info.value.keys) == {"fc1.weight", "fc2.weight"}  # the bias is fine and not named
    assert "fc1.weight: 128 NaN, 0 Inf of 128 values" in str(info.value)


def test_nan_check_covers_nested_state_quantized_scales_and_plain_tensors():
    q = Float8Tensor.from_high_precision(_randn((4, 4), 3), scale=8.0)
    bad_scale = Float8Tensor.from_buffers({"data": q.raw_buffers()["data"].clone(),
                                           "scale_inv": torch.tensor(float("nan"))}, {"fmt": "e4m3"}, (4, 4),
                                          torch.bfloat16)
    moment = torch.ones(5)
    moment[2] = float("inf")
    state = {"model": {"a": q, "b": bad_scale}, "optim": {"state": {"0": {"exp_avg_sq": moment}}}, "step": 3}
    report = nonfinite_keys(state)
    assert set(report) == {"model.b", "optim.state.0.exp_avg_sq"}
    assert "scale_inv non-finite" in report["model.b"] and report["optim.state.0.exp_avg_sq"].startswith("0 NaN, 1 Inf")
    with checkpoint_dir() as root:
        save_checkpoint(state, os.path.join(root, "c"))
        target = {"model": {"a": q.clone(), "b": q.clone()}, "optim": {"state": {"0": {"exp_avg_sq": torch.ones(5)}}},
                  "step": 0}
        with pytest.raises(NonFiniteCheckpointError, match="2 key"):
            load_checkpoint(target, os.path.join(root, "c"))
        assert load_checkpoint(target, os.path.join(root, "c"), check_finite=False) is target  # opt-out exists


# ----------------------------------------------------------------------------- pitfall: weights_only loading


@pytest.mark.parametrize("loader", [broken(_dcp_load_as_is, raises=CheckpointException), fixed(load_checkpoint)])
def test_contract_a_fresh_process_can_load_a_quantized_checkpoint(loader):
    """'Fresh process' = torch's default safe globals only (what every new training job starts with)."""
    live = _live(Float8Tensor)
    with checkpoint_dir() as root:
        path = os.path.join(root, "c")
        save_checkpoint(live, path)
        with default_safe_globals_only():
            out = loader(_fresh_like(live), path)
    assert mismatched_keys(out, live) == []


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_a_fresh_process_loads_every_format_bit_for_bit(fmt):
    """Every registry format's tensor class (and what its chunks pickle) must be a safe global that
    ``load_checkpoint`` registers: with torch's defaults only, the load restores the bytes and scales exactly."""
    live = {"w": make_quantizer(fmt).quantize(_randn((256, 256), 3)), "b": _randn((8,), 4, torch.float32)}
    target = {"w": make_quantizer(fmt).quantize(_randn((256, 256), 5)), "b": torch.zeros(8)}
    assert mismatched_keys(target, live) == ["b", "w"]  # different bytes and scales before the load
    with checkpoint_dir() as root:
        path = os.path.join(root, "c")
        save_checkpoint(live, path)
        with default_safe_globals_only():
            out = load_checkpoint(target, path)
    assert type(out["w"]) is type(live["w"]) and mismatched_keys(out, live) == []


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_a_dequantized_checkpoint_of_every_format_is_refused_not_requantized(fmt):
    """The blocking stager saves plain values (dequantized); loading them into any quantized format raises
    instead of quietly requantizing -- the target's bytes are untouched."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    register_safe_globals()
    live = {"w": make_quantizer(fmt).quantize(_randn((256, 256), 3))}
    target = {"w": make_quantizer(fmt).quantize(_randn((256, 256), 5))}
    before = {"w": target["w"].clone()}
    with checkpoint_dir() as root:
        path = os.path.join(root, "blocking")
        dcp.async_save(live, checkpoint_id=path, no_dist=True, async_stager=BlockingAsyncStager()).result()
        with pytest.raises(RequantizeOnLoadError, match="would REQUANTIZE"):
            load_checkpoint(target, path)
    assert mismatched_keys(target, before) == []


def test_dcp_reads_chunks_weights_only_so_the_subclass_needs_safe_globals():
    live = _live(Float8Tensor)
    with checkpoint_dir() as root:
        path = os.path.join(root, "c")
        save_checkpoint(live, path)
        with default_safe_globals_only():
            with pytest.raises(CheckpointException, match="rebuild_quantized was not an allowed global"):
                dcp.load(_fresh_like(live), checkpoint_id=path, no_dist=True)
            out = load_checkpoint(_fresh_like(live), path)  # registers the safe globals itself
    assert mismatched_keys(out, live) == []


def test_checkpoint_chunks_carry_no_quantizer_and_no_extra_attributes():
    """The quantizer (and e.g. a high-precision init copy) never lands in the file: only bytes, scale, fmt."""
    live = _live(Float8Tensor)
    live["fc1.weight"]._hp_init_value = torch.randn(16, 8)  # what quantized init may leave on a shard
    with checkpoint_dir() as root:
        path = os.path.join(root, "c")
        save_checkpoint(live, path)
        files = [f for f in os.listdir(path) if f.endswith(".distcp")]
        blob = b"".join(open(os.path.join(path, f), "rb").read() for f in files)
    assert b"CurrentScaling" not in blob and b"_hp_init_value" not in blob
    assert b"Float8Tensor" in blob


def test_a_shard_view_is_saved_without_the_rest_of_its_storage():
    """A shard that is a view of a larger buffer (FSDP2's shard of its padded buffer) is written as its own
    bytes: torch.save pickles a view's WHOLE storage, which would put every rank's rows in every chunk.
    The 8-row shard of a 1024-row E4M3 tensor holds 8 * 64 bytes; the whole storage is 128x more."""
    whole = CurrentScaling("e4m3").quantize(_randn((1024, 64), 3))
    shard = whole[:8]
    assert shard.raw_buffers()["data"].untyped_storage().nbytes() == 1024 * 64  # a view: the whole storage
    with checkpoint_dir() as root:
        path = os.path.join(root, "c")
        save_checkpoint({"w": shard}, path)
        written = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp"))
        target = {"w": CurrentScaling("e4m3").quantize(_randn((8, 64), 4))}
        load_checkpoint(target, path)
    assert written < 1024 * 64 // 4, written  # the shard's 512 bytes plus pickle framing, not the 64 KiB storage
    assert torch.equal(target["w"].raw_buffers()["data"], shard.raw_buffers()["data"])
    assert torch.equal(target["w"].raw_buffers()["scale_inv"], shard.raw_buffers()["scale_inv"])


# ----------------------------------------------------------------------------- pitfall: _extra_state size


def _delayed_weight(seed: int, steps: int) -> nn.Parameter:
    q = DelayedScaling("e4m3", history_len=4)
    for i in range(steps):  # "training": each cast records an amax and moves the scale
        q.quantize(_randn((8, 8), seed + i) * (i + 1))
    w = Float8Tensor.from_high_precision(_randn((8, 8), seed), scale=q.scale, quantizer=q)  # records nothing
    return nn.Parameter(w, requires_grad=False)


class _FixedExtraStateLinear(QuantizerExtraStateMixin, nn.Module):
    """The fix: quantizer state as fixed-size tensors (tutorial_lib.dist.extra_state)."""

    def __init__(self, steps: int = 0, seed: int = 0):
        super().__init__()
        self.weight = _delayed_weight(seed, steps)


class _PickledExtraStateLinear(_FixedExtraStateLinear):
    """BROKEN on purpose: extra state = pickled quantizer state, empty before the first cast."""

    def get_extra_state(self):
        q = self.weight.quantizer
        if q.steps == 0:
            return torch.empty(0, dtype=torch.uint8)
        state = {"amax_history": q.amax_history.tolist(), "scale": float(q.scale), "steps": q.steps}
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state):
        if state.numel():
            s = pickle.loads(state.numpy().tobytes())
            q = self.weight.quantizer
            q.amax_history.copy_(torch.tensor(s["amax_history"]))
            q.scale = torch.tensor(s["scale"])
            q.steps = s["steps"]


@pytest.mark.parametrize("cls", [broken(_PickledExtraStateLinear, raises=CheckpointException),
                                 fixed(_FixedExtraStateLinear)])
def test_contract_a_fresh_model_loads_the_trained_quantizer_state(cls):
    trained = cls(steps=3)
    with checkpoint_dir() as root:
        path = os.path.join(root, "c")
        save_checkpoint(trained.state_dict(), path)
        fresh = cls(steps=0, seed=1)
        fresh.load_state_dict(load_checkpoint(fresh.state_dict(), path))
    q, fq = trained.weight.quantizer, fresh.weight.quantizer
    assert torch.equal(fq.amax_history, q.amax_history) and torch.equal(fq.scale, q.scale) and fq.steps == q.steps


def test_pickled_extra_state_breaks_loading_into_a_fresh_model():
    trained = _PickledExtraStateLinear(steps=3)
    with checkpoint_dir() as root:
        path = os.path.join(root, "c")
        save_checkpoint(trained.state_dict(), path)
        fresh = _PickledExtraStateLinear(steps=0, seed=1)
        with pytest.raises(CheckpointException, match=r"Size mismatch between saved torch.Size\(\[\d+\]\) and "
                                                      r"current: torch.Size\(\[0\]\) for _extra_state"):
            load_checkpoint(fresh.state_dict(), path)


def test_fixed_size_extra_state_loads_into_a_fresh_model_exactly():
    trained = _FixedExtraStateLinear(steps=3)
    q = trained.weight.quantizer
    with checkpoint_dir() as root:
        path = os.path.join(root, "c")
        save_checkpoint(trained.state_dict(), path)
        fresh = _FixedExtraStateLinear(steps=0, seed=1)
        assert fresh.get_extra_state()["weight"].shape == trained.get_extra_state()["weight"].shape
        sd = load_checkpoint(fresh.state_dict(), path)
        fresh.load_state_dict(sd)  # set_extra_state decodes the loaded vectors into the quantizer
    fq = fresh.weight.quantizer
    assert torch.equal(fq.amax_history, q.amax_history) and torch.equal(fq.scale, q.scale) and fq.steps == q.steps == 3
    assert mismatched_keys({"w": fresh.weight.detach()}, {"w": trained.weight.detach()}) == []
    # and the restored quantizer behaves identically from here on
    x = _randn((8, 8), 99)
    assert torch.equal(fq.quantize(x).raw_buffers()["data"], q.quantize(x).raw_buffers()["data"])


def test_quantizer_states_stateful_and_codec_errors():
    trained, fresh = _FixedExtraStateLinear(steps=2), _FixedExtraStateLinear(steps=0, seed=5)
    with checkpoint_dir() as root:
        save_checkpoint({"quantizers": QuantizerStates(trained)}, os.path.join(root, "c"))
        load_checkpoint({"quantizers": QuantizerStates(fresh)}, os.path.join(root, "c"))
    assert torch.equal(fresh.weight.quantizer.amax_history, trained.weight.quantizer.amax_history)
    assert encode_quantizer_state(CurrentScaling()).tolist() == [1.0]
    assert encode_quantizer_state(None).tolist() == [0.0]
    with pytest.raises(ValueError, match="different quantizer or history_len"):
        decode_quantizer_state(DelayedScaling(history_len=8), encode_quantizer_state(DelayedScaling(history_len=4)))

    class Odd:
        def __init__(self):
            self.table = torch.zeros(3)

    with pytest.raises(TypeError, match=r"holds tensor state \['table'\]"):
        encode_quantizer_state(Odd())


# ----------------------------------------------------------------------------- pitfall: checkpoint dir hygiene


@contextlib.contextmanager
def _naive_dir():
    """BROKEN pattern: mkdtemp, and rmtree at the end of the happy path only."""
    d = tempfile.mkdtemp(prefix="tutorial-naive-")
    yield d
    shutil.rmtree(d)


@pytest.mark.parametrize("make_dir", [broken(_naive_dir), fixed(checkpoint_dir)])
def test_contract_no_directory_is_left_after_a_failed_run(make_dir):
    seen = []
    with pytest.raises(RuntimeError, match="a step failed"), make_dir() as d:
        seen.append(d)
        save_checkpoint(_live(), os.path.join(d, "c"))
        raise RuntimeError("a step failed")
    leftover = os.path.exists(seen[0])
    shutil.rmtree(seen[0], ignore_errors=True)  # the test itself leaves nothing either way
    assert not leftover, f"{seen[0]} was left behind"


def _dcp_save_as_is(state, path):
    dcp.save(state, checkpoint_id=path, no_dist=True)


@pytest.mark.parametrize("save", [broken(_dcp_save_as_is, raises=pytest.fail.Exception), fixed(save_checkpoint)])
def test_contract_a_used_checkpoint_path_is_never_written_twice(save):
    with checkpoint_dir() as root:
        path = os.path.join(root, "c")
        save_checkpoint(_live(seed=0), path)
        with pytest.raises(CheckpointExistsError, match="already holds a checkpoint"):
            save(_live(seed=1), path)


def test_checkpoint_dir_is_unique_and_removed_on_success_and_on_failure():
    with checkpoint_dir() as a, checkpoint_dir() as b:
        assert a != b and os.path.isdir(a)
        save_checkpoint(_live(), os.path.join(a, "c"))
    assert not os.path.exists(a) and not os.path.exists(b)
    with pytest.raises(RuntimeError, match="boom"), checkpoint_dir() as c:
        save_checkpoint(_live(), os.path.join(c, "c"))
        raise RuntimeError("boom")
    assert not os.path.exists(c)


def test_checkpoint_dir_object_waits_for_async_saves_and_is_removed_when_dropped():
    d = CheckpointDir()
    d.track(save_checkpoint(_live(), os.path.join(d.path, "c"), mode="async"))
    d.cleanup()  # waits for the writer first: nothing is recreated after the removal
    assert d.removed and not os.path.exists(os.path.join(d.path, "c"))
    path = CheckpointDir().path  # never cleaned up explicitly: the finalizer runs when it is dropped
    import gc

    gc.collect()
    assert not os.path.exists(path)
    kept = CheckpointDir(keep=True)
    kept.cleanup()
    assert os.path.isdir(kept.path)
    shutil.rmtree(kept.path)


def test_loading_a_missing_checkpoint_names_the_path():
    with checkpoint_dir() as root:
        with pytest.raises(FileNotFoundError, match="no DCP checkpoint"):
            load_checkpoint(_fresh_like(_live()), os.path.join(root, "missing"))


def test_nan_check_looks_inside_dcp_statefuls():
    class Holder:  # a DCP Stateful: DCP calls state_dict() for the targets and load_state_dict() afterwards
        def __init__(self, value):
            self.x = value

        def state_dict(self):
            return {"x": self.x}

        def load_state_dict(self, sd):
            self.x.copy_(sd["x"])

    with checkpoint_dir() as root:
        save_checkpoint({"app": Holder(torch.tensor([1.0, float("nan")]))}, os.path.join(root, "c"))
        target = Holder(torch.zeros(2))
        with pytest.raises(NonFiniteCheckpointError) as info:
            load_checkpoint({"app": target}, os.path.join(root, "c"))
    assert list(info.value.keys) == ["app.x"] and torch.isnan(target.x[1])


# ----------------------------------------------------------------------------- optimizer state before a load


def test_init_optimizer_state_asks_the_optimizer_first_then_falls_back_to_torch():
    """DCP loads in place, so the state must exist first; dispatch is on the ``init_state`` method, not the class."""
    w = nn.Parameter(torch.ones(3))

    class WithInitState(torch.optim.SGD):
        calls = 0

        def init_state(self):
            WithInitState.calls += 1
            self.state[w]["momentum_buffer"] = torch.zeros(3)

    opt = WithInitState([w], lr=0.1, momentum=0.9)
    init_optimizer_state(opt)
    init_optimizer_state(opt)  # state exists now: nothing to do
    assert WithInitState.calls == 1 and torch.equal(w, torch.ones(3))

    v = nn.Parameter(torch.full((3,), 2.0))
    adamw = torch.optim.AdamW([v], lr=0.1, weight_decay=0.1)  # no init_state: torch's zero-grad, lr=0 step
    init_optimizer_state(adamw)
    assert {"step", "exp_avg", "exp_avg_sq"} <= set(adamw.state[v])
    assert torch.equal(v, torch.full((3,), 2.0)) and v.grad is None and adamw.param_groups[0]["lr"] == 0.1

    u = nn.Parameter(torch.ones(2))
    u.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="already have gradients"):
        init_optimizer_state(torch.optim.AdamW([u]))


def test_optimizer_step_count_reads_the_agreed_step_and_refuses_none_or_disagreement():
    """The data position of a resume: one count every parameter agrees on, else an error (never a guess)."""
    a, b = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(3))
    opt = torch.optim.AdamW([a, b], lr=1e-3)
    with pytest.raises(RuntimeError, match="no step count yet"):
        optimizer_step_count(opt)
    for _ in range(3):
        a.grad, b.grad = torch.randn(4), torch.randn(3)
        opt.step()
    assert optimizer_step_count(opt) == 3
    a.grad, b.grad = torch.randn(4), None  # b misses a step: the counts disagree
    opt.step()
    with pytest.raises(RuntimeError, match=r"disagree on their step count: \[3, 4\]"):
        optimizer_step_count(opt)


def test_torch_state_init_takes_a_step_that_requantizes_and_init_state_does_not():
    """torch's ``_init_optim_state`` (what ``get/set_optimizer_state_dict`` call on an empty state) steps
    with zero gradients at lr=0: a delayed-scaling FP8 weight gets new bytes, its history a new entry."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from tutorial_lib.dist.checkpoint import clean_quantized
    from tutorial_lib.dist.quantized_init import quantize_params_
    from tutorial_lib.models import BlockMLP
    from tutorial_lib.optim.fused_adam import FusedAdam
    from tutorial_lib.quant.registry import recipe

    seen = {}
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton kernels take GPU tensors only
    for how in ("torch", "init_optimizer_state"):
        with torch.device(dev):
            model = quantize_params_(BlockMLP(32, 64, 1, seed=0), recipe("fp8_delayed"), preserve_high_precision=True)
        opt = FusedAdam(model.parameters(), lr=1e-2, master_weights=True)
        w = model.blocks[0].fc1.weight
        before = (clean_quantized(w.detach()).to("cpu", copy=True), w.quantizer.amax_history.clone(), w.quantizer.steps)
        (_init_optim_state if how == "torch" else init_optimizer_state)(opt)
        seen[how] = (mismatched_keys({"w": clean_quantized(w.detach())}, {"w": before[0]}) != [],
                     not torch.equal(w.quantizer.amax_history, before[1]), w.quantizer.steps - before[2],
                     {float(st["step"]) for st in opt.state.values()})
    assert seen["torch"] == (True, True, 1, {1.0})  # bytes, history, quantizer steps and step count all move
    assert seen["init_optimizer_state"] == (False, False, 0, {0.0})


def test_chunk_safe_globals_follow_the_serialization_registry(monkeypatch):
    """chunk_safe_globals reads the quantized tensor classes from serialization's registry: one defined
    later is on it, a quantizer class declared there is not (a chunk holds none)."""
    from tutorial_lib.dist.checkpoint import chunk_safe_globals
    from tutorial_lib.quant import serialization
    from tutorial_lib.quant.tensor import QuantizedTensor

    monkeypatch.setattr(serialization, "_SAFE_GLOBALS", list(serialization._SAFE_GLOBALS))  # leave no class behind

    class _LateFloat8(Float8Tensor):
        pass

    class _LateDelayed(DelayedScaling):
        pass

    serialization.add_safe_global(_LateDelayed)
    allowed = chunk_safe_globals()
    assert _LateFloat8 in allowed and _LateDelayed in serialization._SAFE_GLOBALS
    assert not any(isinstance(o, type) and not issubclass(o, QuantizedTensor) for o in allowed)  # no quantizer
    assert set(allowed) == {*serialization.quantized_tensor_globals(), QuantizedTensor}


def test_load_checkpoint_allowlists_the_chunk_globals_and_no_quantizer():
    """A fresh process (torch's allowlist only): load_checkpoint adds rebuild_quantized and the tensor
    classes -- no quantizer class -- and a delayed-scaling model with its quantizer state loads exactly."""
    from tutorial_lib.dist.checkpoint import chunk_safe_globals
    from tutorial_lib.quant.serialization import rebuild_quantized

    trained, fresh = _delayed_weight(0, steps=3), _delayed_weight(5, steps=0)
    holder = lambda w: nn.ParameterDict({"w": w})  # noqa: E731
    with checkpoint_dir() as root:
        path = os.path.join(root, "c")
        save_checkpoint({"model": holder(trained).state_dict(), "quantizers": QuantizerStates(holder(trained))}, path)
        with default_safe_globals_only():
            target = holder(fresh)
            load_checkpoint({"model": target.state_dict(), "quantizers": QuantizerStates(target)}, path)
            allowed = torch.serialization.get_safe_globals()
    assert rebuild_quantized in allowed and Float8Tensor in allowed and set(allowed) <= set(chunk_safe_globals())
    assert not any(isinstance(o, type) and o.__name__.endswith(("Scaling", "Quantizer")) for o in allowed)
    assert mismatched_keys({"w": fresh.detach()}, {"w": trained.detach()}) == []
    assert torch.equal(fresh.quantizer.amax_history, trained.quantizer.amax_history)
    assert fresh.quantizer.steps == trained.quantizer.steps


def test_an_export_to_a_path_that_is_not_a_path_fails_with_the_reason():
    """The writing rank's error is re-raised on every rank as one RuntimeError naming it (not a crash of the
    cleanup that left the other ranks waiting for rank 0's verdict)."""
    from tutorial_lib.dist.export import export_fp32_safetensors

    with pytest.raises(RuntimeError, match="export to None failed on rank 0: TypeError"):
        export_fp32_safetensors(nn.Linear(4, 4), None)


def test_a_checkpoint_of_a_model_with_an_unused_layer_loads_every_optimizer_state(tmp_path):
    """A layer that never gets a grad (unused in forward): FusedAdam keeps step-0 state for it, so the
    checkpoint holds every trainable parameter's state, and loading (which creates every entry first, as
    ``init_optimizer_state`` does) finds them all; a resumed step matches the uninterrupted one exactly."""
    from tutorial_lib.dist.training_state import TrainingState
    from tutorial_lib.optim.fused_adam import FusedAdam

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton kernels take GPU tensors only

    def make():
        torch.manual_seed(0)
        with torch.device(dev):
            model = nn.ModuleDict({"used": nn.Linear(4, 4), "unused": nn.Linear(4, 4)})
        return model, FusedAdam(model.parameters(), lr=0.1)

    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).to(dev)

    def step(model, opt):
        model["used"](x).square().sum().backward()
        opt.step()
        opt.zero_grad()

    model, opt = make()
    step(model, opt)
    save_checkpoint({"train": TrainingState(model, opt)}, str(tmp_path / "ck"))
    model2, opt2 = make()
    load_checkpoint({"train": TrainingState(model2, opt2)}, str(tmp_path / "ck"))
    assert sorted(float(st["step"]) for st in opt2.state.values()) == [0.0, 0.0, 1.0, 1.0]
    step(model, opt)
    step(model2, opt2)
    for (name, a), b in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(a, b), name
