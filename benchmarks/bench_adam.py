"""Benchmark: FusedAdam / the Triton AdamW kernels vs torch.optim.AdamW (fused, foreach), one GPU.

Every case updates the same parameters with the same grads; the ceiling is a device-to-device copy
measured in the same run. Minimum traffic per parameter (``adam_bytes_per_element``)::

    case                                              read            write               B/param
    fp32 AdamW, 805M params in 108 tensors            p g m v (16)    p m v (12)           28
    fp32 AdamW, 2,000 small tensors, 98M params       p g m v (16)    p m v (12)           28
    bf16 param + fp32 master, 805M                    M g m v (14)    M m v + p (14)       28
    fp32 master + bf16 grad -> FP8 + amax, 805M       M g m v (14)    M m v + fp8 (13)     27

Goals on one H200: case 1 >= 95% of copy and >= 1.15x torch fused; case 2 >= 70% of
copy; FP8 case >= 90% of copy. "ours" is FusedAdam.step() (tables cached, per-step host work
included) at the best (block, num_warps) of a small sweep; every config's time is in the JSON.
The 2,000-tensor case is host-bound (a step's host work can outlast its kernels), so its alternating
rounds time each step from an idle GPU (``latency_ms``: host work in full, ``"timing": "latency"`` in the
JSON); the others time kernels (``bench_ms``).
Each FusedAdam case also records ``kernel_only_ms`` (the launches with the step's host work taken
out), ``back_to_back_ms`` (GPU time per step over 50 steps issued back to back) and
``host_ms_per_step`` (the host's wall time per step): which of host and kernel bounds the step.
The FP8 case times the kernel launch alone; the whole ``FusedAdam.step`` on Float8Tensor parameters with
delayed scaling (scales gathered, the launch, amax history and next scales) is recorded beside it
(``fused_adam_step_incl_amax_history_ms``, FusedAdam's default config), at every config of the kernel's sweep
(``fused_adam_step_sweep_ms``, next to the launch alone in ``sweep_ms``: a whole step and its kernel at the same
config differ by the step's own work, not by the launch configuration), and where its time goes:
``fused_adam_step_split`` holds the GPU time per step issued back to back, the host's time per step, the time from
an idle GPU (``latency_ms``) and, on a GPU, the device time per kernel of a profiled step
(``device_time_by_kernel``).

Run on a GPU (results into benchmarks/results/)::

    python benchmarks/bench_adam.py
    python benchmarks/bench_adam.py --quick        # tiny sizes, CPU ok (interpreter), temp dir

The FSDP2 (DTensor vs plain parameters) case needs 2 GPUs: ``benchmarks/bench_adam_fsdp2.py``.
"""

from __future__ import annotations

import gc

import torch
import tutorial_kernels.adam as k  # first: sets TRITON_INTERPRET=1 on a CPU-only machine
import tutorial_kernels.adam_tables as kt
from torch.profiler import ProfilerActivity, profile

from tutorial_lib.harness.bench import (
    alternating_case,
    benchmark_args,
    case,
    copy_bandwidth_GBps,
    latency_ms,
    split_sizes,
    time_back_to_back,
    write_results,
)
from tutorial_lib.harness.bench import bench_ms as _bench_ms
from tutorial_lib.harness.kernel_ranges import device_time_by_kernel
from tutorial_lib.harness.profiling import quiet_profiler
from tutorial_lib.optim.adamw_reference import adam_bytes_per_element, adam_step_scalars_tensor
from tutorial_lib.optim.fused_adam import FusedAdam
from tutorial_lib.quant.float8 import DelayedScaling
from tutorial_lib.quant.per_tensor import quantize_per_tensor

CONFIGS = [(1024, 4), (2048, 4), (2048, 8), (4096, 8)]  # (BLOCK, num_warps) swept for our kernels
SMALL_CONFIGS = [(1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)]  # the 2,000-tensor case
HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
REPS = {"warmup": 3, "rep": 20, "rounds": 9}  # CPU wall-clock repetitions (CUDA: do_bench), alternating rounds


def bench_ms(fn) -> float:
    return _bench_ms(fn, warmup=REPS["warmup"], rep=REPS["rep"])


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _params(sizes, device, dtype=torch.float32, grad_dtype=None, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    params = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, generator=g, device=device).to(dtype))
        p.grad = torch.randn(n, generator=g, device=device).to(grad_dtype or dtype)
        params.append(p)
    return params


def _step_ms(make_opt, sizes, device, split=None, **kw) -> float:
    """ms per ``opt.step()``; with a dict ``split`` (FusedAdam only) also the kernel launches alone
    (``kernel_ms``), GPU time per step issued back to back and the host's wall time per step (CUDA): step time is
    max(host, kernel) once the host falls behind the GPU."""
    params = _params(sizes, device, **kw)
    opt = make_opt(params)
    opt.step()  # state, tables, compilation
    ms = bench_ms(opt.step)
    if split is not None:
        split.update(kernel_ms=round(bench_ms(_kernels_only(opt, device)), 4))
        if torch.cuda.is_available():
            b2b = time_back_to_back(opt.step)
            split.update(back_to_back_ms=round(b2b["back_to_back_ms"], 4), host_ms=round(b2b["host_ms"], 4))
    del opt, params
    _free()
    return ms


def _kernels_only(opt: FusedAdam, device):
    """The launches of one FusedAdam step, without its per-step host work (tables and scalars reused)."""
    group, plan = opt.param_groups[0], opt._plans[0]
    hyper = adam_step_scalars_tensor(plan.steps, group["lr"], *group["betas"]).to(device)
    kw = dict(lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
              num_warps=group["num_warps"])
    launches = [(b.tables, hyper if b.index is None else hyper[:, b.index].contiguous()) for b in plan.buckets]
    return lambda: [k.launch_adamw(t, h, **kw) for t, h in launches]


def _ours(sizes, device, configs, **kw) -> tuple[float, dict]:
    sweep, splits = {}, {}
    for block, warps in configs:
        name = f"block={block},warps={warps}"
        splits[name] = {}
        sweep[name] = _step_ms(
            lambda ps, b=block, w=warps: FusedAdam(ps, **HP, block=b, num_warps=w, master_weights=True), sizes,
            device, split=splits[name], **kw)
    best = min(sweep, key=sweep.get)
    info = {"config": best, "sweep_ms": sweep, "kernel_only_ms": splits[best]["kernel_ms"]}
    if "host_ms" in splits[best]:  # CUDA: 50 steps issued back to back, and the host's time per step
        info.update(back_to_back_ms=splits[best]["back_to_back_ms"], host_ms_per_step=splits[best]["host_ms"])
    return sweep[best], info


def adamw_case(name, sizes, device, configs, copy, torch_peers=True, latency=False) -> dict:
    """The sweep picks FusedAdam's config; then FusedAdam and torch's AdamW (fused, foreach) step
    the same values in alternating rounds (``alternating_case``): medians and spreads. ``latency``:
    time each step from an idle GPU, host work included (for host-bound steps)."""
    _, info = _ours(sizes, device, configs)
    block, warps = (int(x.split("=")[1]) for x in info["config"].split(","))
    opts = {"ours": FusedAdam(_params(sizes, device), **HP, block=block, num_warps=warps, master_weights=True)}
    if torch_peers:
        opts["torch AdamW fused"] = torch.optim.AdamW(_params(sizes, device), **HP, fused=True)
        opts["torch AdamW foreach"] = torch.optim.AdamW(_params(sizes, device), **HP, foreach=True)
    n = sum(sizes)
    c = alternating_case(name, opts.pop("ours").step, {k: o.step for k, o in opts.items()},
                         nbytes=adam_bytes_per_element(4, 4) * n, copy_GBps=copy, rounds=REPS["rounds"],
                         latency=latency)
    del opts
    _free()
    c.update(info)
    if "torch AdamW fused" in c["peers"]:
        c["speedup_vs_torch_fused"] = round(c["peers"]["torch AdamW fused"] / c["ours_ms"], 3)
    return c


def bf16_master_case(name, sizes, device, configs, copy) -> dict:
    ours_ms, info = _ours(sizes, device, configs, dtype=torch.bfloat16)
    c = case(name, ours_ms, peers={}, nbytes=adam_bytes_per_element(2, 2, out_bytes=2, master=True) * sum(sizes),
             copy_GBps=copy)
    c.update(info)
    return c


def fp8_case(name, sizes, device, configs, copy) -> dict:
    """fp32 master + bf16 grad -> FP8 bytes + scale_inv + amax: the kernel launch, tables prebuilt."""
    default = (kt.default_block(max(sizes)), 4)  # FusedAdam's launch config: always swept
    configs = list(dict.fromkeys([*configs, default]))
    inputs = _fp8_kernel_inputs(sizes, device)
    sweep = {}
    for block, warps in configs:
        run = _fp8_launch(inputs, block, warps)
        run()
        sweep[f"block={block},warps={warps}"] = bench_ms(run)
    best = min(sweep, key=sweep.get)
    # correctness of what was timed: bytes of the last launch == quantize(master, scale)
    assert torch.equal(inputs["outs"][0], quantize_per_tensor(inputs["masters"][0], inputs["scales"][0], "e4m3")), \
        "FP8 bytes differ"
    ours = _fp8_launch(inputs, *_config(best))
    peers = {"torch AdamW fused (fp32 grads) + per-tensor torch cast":
             _torch_fp8_peer(inputs["masters"], inputs["grads"], inputs["scales"])}
    c = alternating_case(name, ours, peers,
                         nbytes=adam_bytes_per_element(0, 2, out_bytes=1, master=True) * sum(sizes), copy_GBps=copy,
                         rounds=REPS["rounds"])
    del inputs, peers, ours, run
    _free()
    c.update({"config": best, "sweep_ms": sweep})
    # the whole step at every swept config, and where its time goes at FusedAdam's default config
    c["fused_adam_step_sweep_ms"] = {}
    for block, warps in configs:
        ms, split = _fp8_optimizer_ms(sizes, device, block, warps, split=(block, warps) == default)
        c["fused_adam_step_sweep_ms"][f"block={block},warps={warps}"] = ms
        if split is not None:
            c["fused_adam_step_incl_amax_history_ms"], c["fused_adam_step_split"] = ms, split
    return c


def _config(key: str) -> tuple[int, int]:
    """``"block=1024,warps=4"`` -> ``(1024, 4)``."""
    block, warps = (int(x.split("=")[1]) for x in key.split(","))
    return block, warps


def _fp8_kernel_inputs(sizes, device) -> dict:
    """The standalone FP8 launch's buffers: fp32 masters and moments, bf16 grads, FP8 outputs and scale_invs,
    per-tensor scales, the step scalars and the grads' addresses."""
    g = torch.Generator(device=device).manual_seed(1)
    masters = [torch.randn(n, generator=g, device=device) for n in sizes]
    grads = [torch.randn(n, generator=g, device=device).to(torch.bfloat16) for n in sizes]
    return {"masters": masters, "grads": grads,
            "ms": [torch.zeros(n, device=device) for n in sizes], "vs": [torch.zeros(n, device=device) for n in sizes],
            "outs": [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes],
            "invs": [torch.empty((), device=device) for _ in sizes],
            "scales": torch.full((len(sizes),), 100.0, device=device),
            "hyper": adam_step_scalars_tensor(torch.ones(len(sizes)), HP["lr"], *HP["betas"]).to(device),
            "addresses": torch.tensor([x.data_ptr() for x in grads], dtype=torch.int64)}


def _fp8_launch(inputs: dict, block: int, num_warps: int):
    """The FP8 AdamW kernel launch at a config, tables built once: a closure that keeps ``inputs`` referenced (the
    tables hold raw addresses, not the tensors)."""
    tables = kt.build_tables(inputs["masters"], inputs["ms"], inputs["vs"], grad_dtype=torch.bfloat16,
                             outs=inputs["outs"], out_kind="fp8", scale_invs=inputs["invs"], fp8_format="e4m3",
                             block=block)
    kt.set_grads(tables, inputs["addresses"])

    def run(t=tables, held=inputs):
        k.launch_adamw(t, held["hyper"], scales=held["scales"], num_warps=num_warps, **HP)

    return run


def _torch_fp8_peer(masters, grads, scales):
    params = [torch.nn.Parameter(m.clone()) for m in masters]
    for p, g in zip(params, grads):
        p.grad = g.float()
    opt = torch.optim.AdamW(params, **HP, fused=True)

    def step():
        opt.step()
        for p, s in zip(params, scales):
            quantize_per_tensor(p.detach(), s, "e4m3")

    return step  # the caller times it next to ours, then drops it (params and state go with it)


def _fp8_optimizer(sizes, device, block=None, num_warps=4) -> FusedAdam:
    """FusedAdam with fp32 masters over bf16-quantized Float8Tensor parameters (DelayedScaling, 16-step amax
    history) with bf16 grads, at a launch config (default: FusedAdam's)."""
    g = torch.Generator(device=device).manual_seed(2)
    params = []
    for n in sizes:
        q = DelayedScaling("e4m3", history_len=16)
        p = torch.nn.Parameter(q.quantize(torch.randn(n, generator=g, device=device).to(torch.bfloat16)))
        p.grad = torch.randn(n, generator=g, device=device).to(torch.bfloat16)
        params.append(p)
    return FusedAdam(params, **HP, master_weights=True, block=block, num_warps=num_warps)


def _fp8_optimizer_ms(sizes, device, block=None, num_warps=4, split=False) -> tuple[float, dict | None]:
    """The whole FusedAdam.step() of :func:`_fp8_optimizer` (kernel + per-param amax history): its time, and with
    ``split`` where that time goes (:func:`_step_split`)."""
    opt = _fp8_optimizer(sizes, device, block, num_warps)
    opt.step()
    ms = bench_ms(opt.step)
    where = _step_split(opt.step, device) if split else None
    del opt
    _free()
    return ms, where


def _step_split(step, device, profiled_steps: int = 5, top: int = 8) -> dict:
    """Where one optimizer step's time goes: GPU ms per step issued back to back and the host's ms per step
    (on the CPU both are the wall clock), ms from an idle GPU (host work in full), and the device ms and
    launches per step of the ``top`` kernels (memcpy/memset included) of a profiled loop (none on the CPU)."""
    cuda = device.type == "cuda"
    b2b = time_back_to_back(step, 50 if cuda else profiled_steps, device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with quiet_profiler(), profile(activities=activities) as prof:
        for _ in range(profiled_steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    kernels = device_time_by_kernel(prof.events(), steps=profiled_steps)
    return {"back_to_back_ms": round(b2b["back_to_back_ms"], 4), "host_ms": round(b2b["host_ms"], 4),
            "latency_ms": round(latency_ms(step, device=device), 4),
            "device_ms_total": round(sum(us for us, _ in kernels.values()) / 1e3, 4),
            "kernels": {name: [round(us / 1e3, 4), n] for name, (us, n) in list(kernels.items())[:top]}}



def main(argv=None) -> None:
    args, device, out = benchmark_args(__doc__, argv, temp_prefix="bench-adam-")
    if args.quick:
        big, small = split_sizes(60_000, 6), split_sizes(40_000, 20)
        # one config per case keeps the interpreted run short; FusedAdam's default (which fp8_case adds anyway)
        configs, small_configs = [(kt.default_block(max(big)), 4)], [(4096, 4)]
        REPS.update(warmup=1, rep=3, rounds=2)
    else:
        big, small = split_sizes(805_000_000, 108), split_sizes(98_000_000, 2000)
        configs, small_configs = CONFIGS, SMALL_CONFIGS
    copy = copy_bandwidth_GBps(device)
    print(f"FusedAdam vs torch AdamW on {device}; copy {copy:.0f} GB/s", flush=True)
    runs = [
        lambda: adamw_case(f"AdamW fp32, {sum(big):,} params in {len(big)} tensors", big, device, configs, copy),
        lambda: adamw_case(f"AdamW fp32, {len(small):,} small tensors, {sum(small):,} params", small, device,
                           small_configs, copy, latency=True),
        lambda: bf16_master_case(f"AdamW bf16 params + fp32 master, {sum(big):,} params", big, device, configs, copy),
        lambda: fp8_case(f"fp32 master + bf16 grad -> FP8 + amax, {sum(big):,} params", big, device, configs, copy),
    ]
    cases = []
    for run in runs:  # each case is printed as soon as it is measured
        c = run()
        cases.append(c)
        peers = ", ".join(f"{k} {v:.3f} ms" for k, v in c["peers"].items())
        print(f"{c['name']}: ours {c['ours_ms']:.3f} ms ({c['config']}), {c['fraction_of_copy']:.0%} of copy"
              + (f"; {peers}" if peers else "")
              + (f"; kernels alone {c['kernel_only_ms']:.3f} ms, back to back {c['back_to_back_ms']:.3f} ms/step, "
                 f"host {c['host_ms_per_step']:.3f} ms/step" if "host_ms_per_step" in c else ""), flush=True)
    path = write_results(out, "adam", cases, copy, extra={"quick": args.quick})
    print(f"copy {copy:.0f} GB/s; wrote {path}")


if __name__ == "__main__":
    main()
