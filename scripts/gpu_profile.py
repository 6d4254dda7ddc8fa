"""Where a call's time goes at EP=1 on the GPU: host functions and device kernels.

    PYTHONPATH=src python3 scripts/gpu_profile.py [--tokens 128 4096] [--iters 20] [--out DIR]
        [--backends symmetric collective]

One process, a one-rank NCCL group. For each backend (symmetric, collective), token count,
layout and sync mode (hidden 7168, top-8, 256 experts, bf16): after warm-up, `--iters`
dispatches and combines run back to back under `cProfile` (the host's Python functions, by own
time) and then under `torch.profiler` (CUDA kernels and runtime calls: count and total time
per name). Per case a short summary line is printed (host us per call of dispatch and combine,
GPU kernel us per call, launches per call, host waits per call); the full tables go to
DIR/profile.txt.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from epcomm import Buffer
from epcomm.bench_paths import example
from epcomm.testing.launch import run_local_ranks

H, K, E = 7168, 8, 256
_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
          "cudaMemcpy")


def _profile_case(buffer, x, idx, w, expand: bool, sync: bool, iters: int) -> tuple[str, str]:
    def dispatch():
        return buffer.dispatch(x, idx, w, num_experts=E, do_expand=expand, do_cpu_sync=sync)

    out = dispatch()
    for _ in range(3):
        out = dispatch()
        buffer.combine(out[0], out[3], topk_weights=out[2])
    torch.cuda.synchronize()
    host = {}
    for name, fn in (("dispatch", dispatch),
                     ("combine", lambda: buffer.combine(out[0], out[3], topk_weights=out[2]))):
        begin = time.perf_counter()
        for _ in range(iters):
            fn()
        host[name] = (time.perf_counter() - begin) * 1e6 / iters
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        o = dispatch()
        buffer.combine(o[0], o[3], topk_weights=o[2])
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        for _ in range(iters):
            o = dispatch()
            buffer.combine(o[0], o[3], topk_weights=o[2])
        torch.cuda.synchronize()
    events = tp.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA) / iters
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                        "cuLaunchKernelEx")) / iters
    waits = sum(e.count for e in events if e.key.startswith(_WAITS)) / iters
    table = events.table(sort_by="self_cpu_time_total", row_limit=25)
    kernels = events.table(sort_by="self_cuda_time_total", row_limit=15)
    summary = (f"disp host {host['dispatch']:.1f} us, comb host {host['combine']:.1f} us, "
               f"GPU kernels {kernel_us:.1f} us/pair, launches {launches:.1f}/pair, "
               f"host waits {waits:.1f}/pair")
    return summary, "\n".join([summary, text.getvalue(), table, kernels])


def run(tokens_list: list[int], iters: int, backends: list[str]) -> list[tuple[str, str]]:
    results = []
    for backend in backends:
        for tokens in tokens_list:
            x, idx, w = example(tokens, H, K, E, torch.device("cuda"), 0)
            buffer = Buffer(dist.group.WORLD, tokens, H, K, backend=backend)
            for expand in (False, True):
                for sync in (False, True):
                    label = (f"{backend} {tokens} {'expand' if expand else 'compact'} "
                             f"{'sync' if sync else 'sync-free'}")
                    summary, full = _profile_case(buffer, x, idx, w, expand, sync, iters)
                    results.append((f"{label}: {summary}", f"==== {label}\n{full}"))
            buffer.destroy()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--backends", nargs="+", default=["symmetric", "collective"],
                        choices=["symmetric", "collective"])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = parser.parse_args()
    [results] = run_local_ranks(run, 1, args.tokens, args.iters, args.backends, pg_backend="nccl",
                                deadline_s=600)
    with open(os.path.join(args.out, "profile.txt"), "w") as f:
        f.write("\n\n".join(full for _, full in results))
    print("\n".join(line for line, _ in results))


if __name__ == "__main__":
    main()
