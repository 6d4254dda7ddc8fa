"""Host time of a call, shared by the GPU scripts (gpu_symmetric, gpu_tune, gpu_host_costs)."""
from __future__ import annotations

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
