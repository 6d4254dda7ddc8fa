"""Tune the symmetric backend's tiles, and see where host time goes (GPU machine, EP=1).

    PYTHONPATH=src python3 scripts/gpu_tune.py [--tokens 4096] [--hidden 7168] [--host]
                                               [--no-tiles] [--current]

1. For each candidate tile of `backends.symmetric` (rows per tile, copy-step width, warps of the
   dispatch and of the combine kernels) a one-rank symmetric buffer runs sync-free compact and
   expand round trips; the torch profiler gives each kernel's mean GPU time. One table; the
   constants in `backends/symmetric.py` cite the winner. `--current`: only the backend's tile
   (an A/B of two trees: run it once with each tree's `src` on PYTHONPATH).
2. With `--host`: the median host time of pieces of a call with the GPU idle before each (a
   torch.empty, a stream switch, an empty Triton launch with as many arguments as ours, a whole
   dispatch and combine); each call as a multiple of the empty launch, the two timed one after
   the other in every round (`host_timing.paired_multiple`); then where the host time of a
   dispatch and of a combine goes (inclusive time of the layers and torch calls it makes, by
   wrapping them), a cProfile of each, the dispatch with its pieces taken away, and whether
   every launch after warm-up skipped Triton's generic launch path.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import time

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from epcomm.launch import run_local_ranks
from host_timing import median_host_us, paired_multiple, sync_free_calls

CANDIDATES = [  # dispatch rows, block_w, warps | combine rows, block_h, warps
    (16, 512, 8, 16, 512, 16),
    (16, 512, 8, 8, 1024, 16),
    (16, 512, 8, 16, 1024, 16),
    (8, 512, 8, 8, 1024, 8),
    (32, 512, 16, 16, 512, 8),
    (16, 1024, 16, 8, 2048, 16),
    (8, 256, 4, 4, 1024, 4),
]


def example_data(tokens, hidden, topk, experts, device):
    """x, topk_idx (distinct experts per token) and weights of a fixed seed on `device`."""
    gen = torch.Generator(device="cpu").manual_seed(5)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16().to(device)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    weights = torch.rand(tokens, topk, generator=gen).to(device)
    return x, idx.to(device), weights


def _kernel_times(buffer, x, idx, w, experts, expand, iters=10):
    from torch.profiler import ProfilerActivity, profile

    def step():
        out = buffer.dispatch(x, idx, w, num_experts=experts, do_cpu_sync=False,
                              do_expand=expand)
        buffer.combine(out[0], out[3], topk_weights=out[2])

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if event.key.endswith("_kernel"):
            times[event.key] = event.device_time_total / event.count
    return times


def tiles(tokens, hidden, topk, experts, current_only=False):
    from epcomm.backends import symmetric
    from epcomm.buffer import Buffer
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, w = example_data(tokens, hidden, topk, experts, device)
    names = ("dispatch_kernel", "combine_kernel")
    rows = []
    candidates = [tuple(symmetric._GPU_TILE[k] for k in (
        "rows", "block_w", "num_warps", "combine_rows", "block_h", "combine_warps"))] \
        if current_only else CANDIDATES
    for rows_d, block_w, warps_d, rows_c, block_h, warps_c in candidates:
        symmetric._GPU_TILE = dict(rows=rows_d, block_w=block_w, num_warps=warps_d,
                                   combine_rows=rows_c, block_h=block_h, combine_warps=warps_c)
        buffer = Buffer(dist.group.WORLD, tokens, hidden, topk, backend="symmetric")
        for expand in (False, True):
            times = _kernel_times(buffer, x, idx, w, experts, expand)
            rows.append(((rows_d, block_w, warps_d, rows_c, block_h, warps_c), expand,
                         [times.get(n, float("nan")) for n in names], _registers(buffer)))
        buffer.destroy()
    return rows


def _launchers(buffer):
    """Every `Launcher` of the buffer's symmetric backend."""
    for shape in (buffer._impl.shape, buffer._impl.combine_shape):
        yield from shape.launchers.values()


def _registers(buffer) -> str:
    """Registers per thread and spill bytes of each compiled variant ("kernel regs/spills")."""
    return ", ".join(sorted({f"{launcher.fn.__name__} {kernel.n_regs}/{kernel.n_spills}"
                             for launcher in _launchers(buffer)
                             for kernel in launcher.compiled.values()}))


@triton.jit
def empty_kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8,
                 b9, c0, c1, c2, c3, c4, c5, K: tl.constexpr, R: tl.constexpr):
    pass


def host(tokens, hidden, topk, experts):
    from epcomm.buffer import Buffer

    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, w = example_data(tokens, hidden, topk, experts, device)
    buffer = Buffer(dist.group.WORLD, tokens, hidden, topk, backend="symmetric")
    stream = torch.cuda.Stream()
    tensors = [torch.empty(16, device=device) for _ in range(14)]
    ints = list(range(1, 13))
    dispatch, combine = sync_free_calls(buffer, x, idx, w, experts)

    def switch():
        with torch.cuda.stream(stream):
            pass

    pieces = [
        ("torch.empty 4096 x 7168 bf16", lambda: torch.empty(tokens, hidden, dtype=torch.bfloat16,
                                                               device=device)),
        ("with torch.cuda.stream(s): pass", switch),
        ("empty Triton launch, 26 arguments", lambda: empty_kernel[(132,)](
            *tensors, *ints, K=8, R=1)),
        ("Buffer.dispatch (compact, sync-free)", dispatch),
        ("Buffer.combine", combine),
    ]
    print("| host piece | median us |\n|---|---|")
    for name, fn in pieces:
        print(f"| {name} | {median_host_us(fn):.1f} |")
    # As in a training loop: calls queued back to back, the host never waiting for the GPU.
    for name, fn in (("dispatch", dispatch), ("combine", combine)):
        print(f"| Buffer.{name}, back to back | {median_host_us(fn, idle=False):.1f} |")
    yardstick = pieces[2][1]
    print("\n| call / yardstick, paired | multiple |\n|---|---|")
    for name, fn in (("dispatch", dispatch), ("combine", combine)):
        for label, idle in (("idle", True), ("back to back", False)):
            print(f"| {name} {label} | {paired_multiple(fn, yardstick, idle=idle):.2f} |")
    for name, call in (("dispatch", dispatch), ("combine", combine)):
        print(f"\nInclusive host us per {name} call (10 calls, GPU idle before each):")
        print(_breakdown(call))
    for name, call in (("dispatch", dispatch), ("combine", combine)):
        print(f"\ncProfile of 50 {name} calls, by own time (us per call include its overhead):")
        print(_profile(call))
    print(_pieces_taken_away(buffer, dispatch, device))
    print("\nLaunchers: compiled variants kept, generic launches, why the fast path is off")
    print("| kernel | variants | generic launches | fallback |\n|---|---|---|---|")
    for launcher in _launchers(buffer):
        print(f"| {getattr(launcher.fn, '__name__', launcher.fn)} | {len(launcher.compiled)} "
              f"| {launcher.generic_launches} | {launcher.fallback} |")


def _pieces_taken_away(buffer, dispatch, device, calls: int = 200) -> str:
    """The sync-free dispatch's host time with its pieces taken away one after the other (no
    profiler to inflate small calls), back to back and with the GPU idle before each call: the
    full call, the launch stubbed (nothing runs), then also the four allocations (the same
    cached outputs every call). The differences are the launch and the allocations; the rest is
    the Python and the stream checks. Idle minus back to back says which piece pays for starting
    after the host waited (8-9 us of the whole call since session 7)."""
    from epcomm.kernels.launcher import Launcher
    if not hasattr(buffer, "_direct_empty"):  # (a tree before session 9, in an A/B)
        return "\nSync-free dispatch, pieces taken away: this tree has no Buffer._direct_empty"
    outputs = {}

    def cached_empty(shape, dtype):
        key = (tuple(shape), dtype)
        if key not in outputs:
            outputs[key] = torch.empty(shape, dtype=dtype, device=device)
        return outputs[key]

    def both():
        return [median_host_us(dispatch, calls, idle=idle) for idle in (False, True)]

    launch, empty = Launcher.launch_untyped, buffer._direct_empty
    full = both()
    try:
        Launcher.launch_untyped = lambda self, variant, stream, args: None
        no_launch = both()
        buffer._direct_empty = cached_empty
        rest = both()
    finally:
        Launcher.launch_untyped, buffer._direct_empty = launch, empty
    lines = [f"\nSync-free dispatch, pieces taken away (median us of {calls} calls):",
             "| dispatch | back to back | GPU idle before each |", "|---|---|---|"]
    for label, pair in (
            ("whole call", full), ("launch stubbed", no_launch),
            ("launch stubbed, outputs cached (Python and stream checks)", rest),
            ("= the launch", [a - b for a, b in zip(full, no_launch)]),
            ("= the four allocations", [a - b for a, b in zip(no_launch, rest)])):
        lines.append(f"| {label} | {pair[0]:.1f} | {pair[1]:.1f} |")
    return "\n".join(lines)


class _Timers:
    """Inclusive host time of chosen callables, summed while they are wrapped."""

    def __init__(self) -> None:
        self.seconds = collections.defaultdict(float)
        self.calls = collections.Counter()
        self._undo = []

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - begin
                self.calls[label] += 1

        setattr(owner, name, timed)
        self._undo.append((owner, name, original))

    def restore(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def _profile(call, iters: int = 50, top: int = 25) -> str:
    profile = cProfile.Profile()
    for _ in range(iters):
        torch.cuda.synchronize()
        profile.enable()
        call()
        profile.disable()
    torch.cuda.synchronize()
    rows = sorted(pstats.Stats(profile).stats.items(), key=lambda item: -item[1][2])[:top]
    lines = ["| function | calls per call | own us per call | inclusive us per call |",
             "|---|---|---|---|"]
    for (file, line, function), (_, calls, own, inclusive, _) in rows:
        where = f"{os.path.basename(file)}:{line}({function})" if line else function
        lines.append(f"| {where} | {calls / iters:.1f} | {own / iters * 1e6:.1f} | "
                     f"{inclusive / iters * 1e6:.1f} |")
    return "\n".join(lines)


def _breakdown(call, iters: int = 10) -> str:
    from epcomm.backends.base import OutputAllocator
    from epcomm.backends.symmetric import SymmetricBackend
    from epcomm.buffer import Buffer
    from epcomm.kernels.launcher import Launcher
    timers = _Timers()
    for owner, name, label in [
            (Buffer, "dispatch", "Buffer.dispatch"), (Buffer, "combine", "Buffer.combine"),
            (Buffer, "_validate_dispatch", "  validation"), (Buffer, "_launch", "  _launch"),
            (SymmetricBackend, "dispatch", "    backend dispatch"),
            (SymmetricBackend, "combine", "    backend combine"),
            (Launcher, "__call__", "      kernel launch"),
            (OutputAllocator, "empty", "      output allocation"),
            (torch, "empty", "        torch.empty"),
            (torch.Tensor, "record_stream", "    record_stream"),
            (torch.cuda.Stream, "wait_event", "    wait_event"),
            (torch.cuda.Event, "record", "    event record"),
            (Buffer, "_current_stream", "    _current_stream"),
            (torch.cuda, "set_stream", "    set_stream")]:
        timers.wrap(owner, name, label)
    try:
        for _ in range(iters):
            torch.cuda.synchronize()
            call()
        torch.cuda.synchronize()
    finally:
        timers.restore()
    lines = ["| piece (nested by indent) | us per call | calls per call |", "|---|---|---|"]
    for label, seconds in timers.seconds.items():
        lines.append(f"| {label} | {seconds / iters * 1e6:.1f} | "
                     f"{timers.calls[label] / iters:.1f} |")
    return "\n".join(lines)


def shape_parser() -> argparse.ArgumentParser:
    """A parser with the EP=1 shape options (DeepSeek-V3 defaults)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    return parser


def main():
    parser = shape_parser()
    parser.add_argument("--host", action="store_true")
    parser.add_argument("--no-tiles", action="store_true")
    parser.add_argument("--current", action="store_true",
                        help="time only the backend's current tile")
    args = parser.parse_args()
    shape = (args.tokens, args.hidden, args.topk, args.experts)
    if args.host:
        run_local_ranks(host, 1, *shape, timeout_s=600)
    if args.no_tiles:
        return
    rows = run_local_ranks(tiles, 1, *shape, args.current, timeout_s=600)[0]
    print(f"\nEP=1 {args.tokens} x {args.hidden} bf16, top-{args.topk}: mean GPU us per kernel")
    print("| dispatch rows/width/warps | combine rows/width/warps | layout | dispatch | "
          "combine | registers/spill bytes |\n|---|---|---|---|---|---|")
    for tile, expand, times, registers in rows:
        print(f"| {tile[0]}/{tile[1]}/{tile[2]} | {tile[3]}/{tile[4]}/{tile[5]} | "
              f"{'expand' if expand else 'compact'} | "
              + " | ".join(f"{t:.1f}" for t in times) + f" | {registers} |")


if __name__ == "__main__":
    main()
