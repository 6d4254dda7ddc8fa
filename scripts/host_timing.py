"""Host time of a call, shared by the timing scripts (gpu_symmetric, gpu_tune, gpu_host_costs,
cpu_host_glue)."""
from __future__ import annotations

import statistics
import time

import torch


def median_host_us(fn, iters: int = 20, warmup: int = 1, idle: bool = True) -> float:
    """Median microseconds for `fn()` to return, after `warmup` untimed calls. `idle`: the GPU
    is synchronized before each call, so the figure is the host cost alone, not time spent
    waiting for queued work; otherwise calls follow each other as in a loop."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if idle:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - begin)
    torch.cuda.synchronize()
    return sorted(samples)[iters // 2] * 1e6


def paired_multiple(fn, yardstick, iters: int = 40, idle: bool = True, sync=None) -> float:
    """Median over `iters` rounds of `fn`'s host time divided by `yardstick`'s, the two timed
    one right after the other in each round so that both see the same host speed (on the GPU
    machine it drifts within a process: in session 9 the yardstick ran at 25-49 us within one
    hour, and processes whose one yardstick figure came out slow gave multiples below 1).
    `idle`: `sync()` (default `torch.cuda.synchronize`) before each timed call."""
    sync = torch.cuda.synchronize if sync is None else sync
    fn()
    yardstick()
    ratios = []
    for _ in range(iters):
        seconds = []
        for call in (yardstick, fn):
            if idle:
                sync()
            begin = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - begin)
        ratios.append(seconds[1] / seconds[0])
    sync()
    return statistics.median(ratios)


def sync_free_calls(buffer, x, topk_idx, topk_weights, num_experts: int, **options):
    """(dispatch, combine): callables for timing one sync-free dispatch (with `options`) and
    the combine of the latest dispatch through `buffer`."""
    state = {}

    def dispatch():
        state["out"] = buffer.dispatch(x, topk_idx, topk_weights, num_experts=num_experts,
                                       do_cpu_sync=False, **options)

    def combine():
        out = state["out"]
        buffer.combine(out[0], out[3], topk_weights=out[2])

    return dispatch, combine
