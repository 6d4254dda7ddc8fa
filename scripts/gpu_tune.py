"""Tune the symmetric backend's kernel tiles (GPU machine, EP=1).

    PYTHONPATH=src python3 scripts/gpu_tune.py [--tokens 4096] [--hidden 7168] [--current]
        [--tiles 16/512/8/16/1024/16 ...]
    PYTHONPATH=src python3 scripts/gpu_tune.py --low-latency [--tokens 128]

For each candidate tile of the symmetric backend (`_GPU_TILE`, or `_GPU_DECODE_TILE` for a
buffer of at most 4 tokens per program: rows per tile, copy-step width, warps of the dispatch
and of the combine kernels) a one-rank symmetric buffer runs sync-free compact and expand
round trips; the torch profiler gives each kernel's mean GPU time,
and each compiled kernel's registers per thread and spill bytes are listed. One table; the
constants in `backends/symmetric/backend.py` cite the winner. `--current`: only the backend's
tile (an A/B of two trees: run it once with each tree's `src` on PYTHONPATH). Host time:
`scripts/host_time.py`.

`--low-latency`: the same for V1's low-latency kernels (`epcomm.low_latency.GPU_TILES`): each
candidate gives all four kernels one channel part width and warp count (the combine's send 4
rows a step); a one-rank low-latency buffer runs FP8 dispatch + combine of `--tokens` tokens
(M = max(tokens, 128)); the table has each kernel's mean GPU time under the profiler, the
graph replay of the pair, and registers / spills, so that each kernel's tile is chosen alone.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from epcomm.low_latency import GPU_TILES
from epcomm.testing.launch import run_local_ranks

CANDIDATES = [  # dispatch rows, block_w, warps | combine rows, block_h, warps
    (16, 512, 8, 16, 512, 16),
    (16, 512, 8, 8, 1024, 16),
    (16, 512, 8, 16, 1024, 16),
    (8, 512, 8, 8, 1024, 8),
    (32, 512, 16, 16, 512, 8),
    (16, 1024, 16, 8, 2048, 16),
    (8, 256, 4, 4, 1024, 4),
    # decode sizes: few rows per program, so fewer, wider steps along the hidden dimension
    (4, 2048, 8, 4, 4096, 16),
    (4, 1024, 4, 4, 2048, 8),
    (8, 1024, 8, 4, 2048, 8),
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


def tiles(tokens, hidden, topk, experts, current_only=False, candidates=CANDIDATES):
    from epcomm import Buffer
    from epcomm.backends.symmetric import backend as symmetric
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, w = example_data(tokens, hidden, topk, experts, device)
    names = ("dispatch_kernel", "combine_kernel")
    rows = []
    keys = ("rows", "block_w", "num_warps", "combine_rows", "block_h", "combine_warps")
    if current_only:
        probe = Buffer(dist.group.WORLD, tokens, hidden, topk, backend="symmetric")
        current = symmetric.gpu_tile(tokens, probe._backend.num_sms)
        probe.destroy()
        candidates = [tuple(current[k] for k in keys)]
    tiles_before = symmetric._GPU_TILE, symmetric._GPU_DECODE_TILE
    for candidate in candidates:
        # the candidate whichever tile the buffer's size picks
        symmetric._GPU_TILE = symmetric._GPU_DECODE_TILE = dict(zip(keys, candidate))
        buffer = Buffer(dist.group.WORLD, tokens, hidden, topk, backend="symmetric")
        for expand in (False, True):
            times = _kernel_times(buffer, x, idx, w, experts, expand)
            rows.append((candidate, expand,
                         [times.get(n, float("nan")) for n in names], _registers(buffer)))
        buffer.destroy()
    symmetric._GPU_TILE, symmetric._GPU_DECODE_TILE = tiles_before
    return rows


LOW_LATENCY_CANDIDATES = [  # channels per program, warps
    (1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 8), (8192, 16)]
LOW_LATENCY_KERNELS = tuple(GPU_TILES)  # the kernels' names


def low_latency_tiles(tokens, hidden, topk, experts, current_only=False):
    """Rows of (candidate, [GPU us per kernel], graph replay us of the pair, registers)."""
    from torch.profiler import ProfilerActivity, profile

    from epcomm import low_latency as LL
    from epcomm.bench_paths import low_latency_pair, time_us
    from epcomm.testing.launch import capture_graph
    device = torch.device("cuda", torch.cuda.current_device())
    x, idx, w = example_data(tokens, hidden, topk, experts, device)
    current = LL.GPU_TILES
    candidates = [None] if current_only else LOW_LATENCY_CANDIDATES
    rows = []
    for candidate in candidates:
        LL.GPU_TILES = current if candidate is None else {
            name: LL.LowLatencyTile(*candidate, rows=4 if name == "ll_combine_send" else 1)
            for name in current}
        buffer, _, dispatch, combine = low_latency_pair(x, idx, w, experts,
                                                        explicitly_destroy=True)

        def pair():
            dispatch()
            combine()

        for _ in range(3):
            pair()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                pair()
            torch.cuda.synchronize()
        times = {e.key: e.device_time_total / e.count for e in prof.key_averages()}
        replay = time_us(capture_graph(pair)[0].replay, device, 50)
        buffer.low_latency_check_errors()
        registers = ", ".join(
            f"{name} {getattr(kernel, 'n_regs', '?')}/{getattr(kernel, 'n_spills', '?')}"
            for name in LOW_LATENCY_KERNELS
            for kernel in getattr(LL, name).device_caches[device.index][0].values())
        label = "current" if candidate is None else f"{candidate[0]}/{candidate[1]}"
        rows.append((label, [times.get(n, float("nan")) for n in LOW_LATENCY_KERNELS],
                     replay, registers))
        buffer.destroy()
    LL.GPU_TILES = current
    return rows


def _launchers(buffer):
    """Every `Launcher` of the buffer's symmetric backend."""
    for shape in (buffer._backend.shape, buffer._backend.combine_shape):
        yield from shape.launchers.values()


def _registers(buffer) -> str:
    """Registers per thread and spill bytes of each compiled variant ("kernel regs/spills")."""
    return ", ".join(sorted({f"{launcher.fn.__name__} {kernel.n_regs}/{kernel.n_spills}"
                             for launcher in _launchers(buffer)
                             for kernel in launcher.compiled.values()}))


def shape_parser() -> argparse.ArgumentParser:
    """A parser with the EP=1 shape options (DeepSeek-V3 defaults)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    return parser


def _tile(text: str) -> tuple:
    values = tuple(int(v) for v in text.split("/"))
    if len(values) != 6:
        raise argparse.ArgumentTypeError(f"a tile is six numbers R/W/WARPS/R/W/WARPS: {text!r}")
    return values


def main():
    parser = shape_parser()
    parser.add_argument("--current", action="store_true",
                        help="time only the backend's current tile")
    parser.add_argument("--low-latency", action="store_true",
                        help="tune V1's low-latency kernels instead")
    parser.add_argument("--tiles", nargs="+", type=_tile, default=CANDIDATES,
                        help="the candidates to time, each R/W/WARPS/R/W/WARPS (dispatch rows, "
                        "words per step, warps, then combine rows, bf16 per step, warps)")
    args = parser.parse_args()
    shape = (args.tokens, args.hidden, args.topk, args.experts)
    if args.low_latency:
        rows = run_local_ranks(low_latency_tiles, 1, *shape, args.current, timeout_s=600)[0]
        print(f"\nEP=1 low-latency, {args.tokens} x {args.hidden}, top-{args.topk}, FP8 "
              "dispatch: mean GPU us per kernel, graph replay us of dispatch + combine")
        print("| channels/warps | " + " | ".join(LOW_LATENCY_KERNELS)
              + " | pair replay | registers/spills |\n" + "|---" * 7 + "|")
        for label, times, replay, registers in rows:
            print(f"| {label} | " + " | ".join(f"{t:.1f}" for t in times)
                  + f" | {replay:.1f} | {registers} |")
        return
    rows = run_local_ranks(tiles, 1, *shape, args.current, args.tiles, timeout_s=600)[0]
    print(f"\nEP=1 {args.tokens} x {args.hidden} bf16, top-{args.topk}: mean GPU us per kernel")
    print("| dispatch rows/width/warps | combine rows/width/warps | layout | dispatch | "
          "combine | registers/spill bytes |\n|---|---|---|---|---|---|")
    for tile, expand, times, registers in rows:
        print(f"| {tile[0]}/{tile[1]}/{tile[2]} | {tile[3]}/{tile[4]}/{tile[5]} | "
              f"{'expand' if expand else 'compact'} | "
              + " | ".join(f"{t:.1f}" for t in times) + f" | {registers} |")


if __name__ == "__main__":
    main()
