"""Check and benchmark the symmetric backend on the GPU machine.

    PYTHONPATH=src python3 scripts/gpu_symmetric.py [--ranks 2 4 8] [--tokens 4096] [--no-bench]
                                                    [--shared N]

1. For each rank count: that many processes share the GPU(s) (gloo bootstrap, CUDA IPC heap).
   Both layouts, bf16 and FP8, hidden 7168, top-8, 256 experts, up to `--tokens` tokens per
   rank: symmetric vs collective (gloo, staged through the host) bitwise; the sync-free calls
   run under `torch.cuda.set_sync_debug_mode("error")`; then dispatch + combine are captured in
   a CUDA graph and replayed on new data, compared with the collective backend.
2. Benchmark at EP=1: dispatch / combine of 4096 x 7168 bf16, top-8, against a torch copy of the
   same rows measured in the same run: back-to-back call time, the kernels' own time (torch
   profiler), host time per call, kernel launches per call.
3. `--shared N`: N processes sharing the GPU each replay their CUDA graph of sync-free dispatch
   + combine back to back, all at once; us per replay against N x the EP=1 replay.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist

os.environ.setdefault("EP_AVOID_RECORD_STREAM", "1")  # graph capture must not record_stream

from epcomm.testing.launch import run_local_ranks  # noqa: E402
from host_time import median_host_us  # noqa: E402


def _rows(x):
    return list(x) if isinstance(x, tuple) else [x]


def _bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.int16) \
        if t.dtype.itemsize == 2 else t


def _same(got, want, what):
    if want is None:
        assert got is None, what
        return
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: shape/dtype"
    assert torch.equal(_bits(got), _bits(want)), f"{what}: differs"


def _data(rank, tokens, hidden, topk, experts, fp8, seed, device):
    gen = torch.Generator(device="cpu").manual_seed(seed * 100 + rank)
    x = torch.randn(tokens, hidden, generator=gen)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]) \
        if tokens else torch.empty(0, topk, dtype=torch.long)
    idx[torch.rand(tokens, topk, generator=gen) < 0.05] = -1
    weights = torch.rand(tokens, topk, generator=gen)
    if fp8:
        x = (x.to(torch.float8_e4m3fn), torch.rand(tokens, (hidden + 127) // 128, generator=gen))
    else:
        x = x.to(torch.bfloat16)
    move = lambda t: t.to(device)  # noqa: E731
    return (tuple(map(move, x)) if fp8 else move(x)), move(idx), move(weights)


HANDLE_FIELDS = ("recv_src_metadata", "psum_num_recv_tokens_per_scaleup_rank",
                 "psum_num_recv_tokens_per_expert", "num_unaligned_recv_tokens_per_expert")


def _valid_rows(handle):
    """Indices of the dispatch output rows that carry a token (on the handle's device)."""
    if handle.do_expand:
        rows = handle.recv_src_metadata[:, 2:].flatten().long()
        return rows[rows >= 0].sort().values
    num_rows = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
    return torch.arange(num_rows, device=handle.recv_src_metadata.device)


def _host(tensor):
    return None if tensor is None else tensor.cpu()


def _on_host(dispatched):
    """What `_compare` checks of a dispatch's outputs, copied to the host: the handle's
    tensors, the received ids and weights, and only the payload rows that carry a token (8
    processes with capacity-sized expand outputs of 4096 tokens each would not fit twice)."""
    recv_x, recv_idx, recv_weights, handle = dispatched[:4]
    keep = _valid_rows(handle)
    return dict(rows=[row.index_select(0, keep).cpu() for row in _rows(recv_x)],
                recv_topk_idx=_host(recv_idx), recv_topk_weights=_host(recv_weights),
                **{name: getattr(handle, name).cpu() for name in HANDLE_FIELDS})


def _compare(got, want, what):
    (gd, gc), (wd, wc) = got, want
    for name in (*HANDLE_FIELDS, "recv_topk_idx", "recv_topk_weights"):
        _same(gd[name], wd[name], f"{what} {name}")
    for i, (g, w) in enumerate(zip(gd["rows"], wd["rows"])):
        _same(g, w, f"{what} recv_x[{i}]")
    _same(gc[0], wc[0], f"{what} combined_x")
    _same(gc[1], wc[1], f"{what} combined_weights")


@contextlib.contextmanager
def _sync_debug(on):
    """With `on`, any device-to-host synchronization in the block raises."""
    torch.cuda.synchronize()
    if on:
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _roundtrip(buffer, x, idx, weights, experts, opts, bias, debug):
    """Dispatch, then combine 3 x the received rows; the results on the host. The GPU outputs
    are dropped on return, so each process peaks at one call's capacity-sized tensors."""
    with _sync_debug(debug):
        out = buffer.dispatch(x, idx, weights, num_experts=experts, **opts)
    dispatched = _on_host(out)
    y = _rows(out[0])[0].to(torch.bfloat16).mul_(3)  # (in place for bf16: copied already)
    with _sync_debug(debug):
        combined = buffer.combine(y, out[3], topk_weights=out[2], bias=bias)
    return dispatched, [_host(t) for t in combined[:2]]


def check_ranks(tokens, hidden, topk, experts):
    """One rank of the correctness check; returns seconds spent."""
    from epcomm import Buffer
    start = time.time()
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    coll = Buffer(group, tokens, hidden, topk, backend="collective", timeout_s=120)
    symm = Buffer(group, tokens, hidden, topk, backend="symmetric", timeout_s=120)
    # Every rank's heap on this one GPU: the kernels' signals at GPU scope (`kernels.sync`).
    one_gpu = torch.cuda.device_count() == 1 or dist.get_world_size() == 1
    assert symm._backend.heap.scope == ("gpu" if one_gpu else "sys"), symm._backend.heap.scope
    num_tokens = tokens if rank == 0 else tokens * (rank % 3 + 1) // 4
    seed = 0
    for expand in (False, True):
        for fp8 in (False, True):
            for sync in (True, False):
                seed += 1
                x, idx, w = _data(rank, num_tokens, hidden, topk, experts, fp8, seed, device)
                bias = torch.randn(num_tokens, hidden, device=device).bfloat16()
                opts = dict(do_expand=expand, do_cpu_sync=sync, expert_alignment=4 if expand else 1)
                want = _roundtrip(coll, x, idx, w, experts, opts, bias, False)
                got = _roundtrip(symm, x, idx, w, experts, opts, bias, not sync)
                _compare(got, want, f"rank {rank} expand={expand} fp8={fp8} sync={sync}")
    # CUDA graph: capture a sync-free dispatch + combine, replay on new data (the references
    # first, so the collective backend's outputs are gone before the graph's are made). (No
    # eager call through `symm` after a capture: its next call would query events recorded
    # during capture, which CUDA rejects.)
    for expand in (False, True):
        opts = dict(do_expand=expand, do_cpu_sync=False, expert_alignment=4 if expand else 1)
        x, idx, w = _data(rank, num_tokens, hidden, topk, experts, False, 50, device)
        replays = [_data(rank, num_tokens, hidden, topk, experts, False, 60 + replay, device)
                   for replay in range(2)]
        wants = [_roundtrip(coll, *data, experts, opts, None, False) for data in replays]
        graph = torch.cuda.CUDAGraph()
        dist.barrier()
        with torch.cuda.graph(graph):
            captured = symm.dispatch(x, idx, w, num_experts=experts, **opts)
            y = _rows(captured[0])[0] * 3
            captured_c = symm.combine(y, captured[3], topk_weights=captured[2])
        for replay, ((x2, idx2, w2), want) in enumerate(zip(replays, wants)):
            x.copy_(x2)
            idx.copy_(idx2)
            w.copy_(w2)
            graph.replay()
            torch.cuda.synchronize()
            got = _on_host(captured), [_host(t) for t in captured_c[:2]]
            _compare(got, want, f"rank {rank} graph expand={expand} #{replay}")
        del graph, captured, captured_c, y
    symm.check_errors()
    return time.time() - start


def _cuda_time(fn, iters):
    """(GPU seconds per call over back-to-back calls, median host seconds per call with the GPU
    idle before each call: the host cost alone, not time spent waiting for the GPU)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e-3, median_host_us(fn, iters, warmup=0) * 1e-6


def _kernels(fn, iters=5):
    """(kernels launched per call, their GPU seconds per call) of `fn`, from the torch profiler:
    the kernels' own time, which back-to-back timing hides when the host is slower. Memory
    copies and fills are left out (the calls make none)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0
               and not any(word in e.key.lower() for word in ("memcpy", "memset"))]
    seconds = sum(e.device_time_total for e in kernels) / iters * 1e-6
    if seconds <= 0:
        raise RuntimeError(f"the profiler saw no kernel time: {prof.key_averages()}")
    return sum(e.count for e in kernels) // iters, seconds


def profile_calls(tokens, hidden, topk, experts):
    """Where host and GPU time of one EP=1 dispatch + combine go (torch profiler tables)."""
    from torch.profiler import ProfilerActivity, profile
    from epcomm import Buffer
    device = torch.device("cuda", torch.cuda.current_device())
    buffer = Buffer(dist.group.WORLD, tokens, hidden, topk, backend="symmetric")
    x, idx, w = _data(0, tokens, hidden, topk, experts, False, 7, device)
    for _ in range(3):
        out = buffer.dispatch(x, idx, w, num_experts=experts, do_cpu_sync=False)
        buffer.combine(out[0], out[3], topk_weights=out[2])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            out = buffer.dispatch(x, idx, w, num_experts=experts, do_cpu_sync=False)
            buffer.combine(out[0], out[3], topk_weights=out[2])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8))
    import cProfile
    import pstats
    for sync in (False, True):
        profiler = cProfile.Profile()
        for _ in range(10):
            torch.cuda.synchronize()
            profiler.enable()
            out = buffer.dispatch(x, idx, w, num_experts=experts, do_cpu_sync=sync)
            profiler.disable()
        torch.cuda.synchronize()
        print(f"host profile of 10 dispatches, do_cpu_sync={sync}")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14 if sync else 8)


def _pair_graph(buffer, x, idx, w, experts, expand):
    """A CUDA graph of sync-free dispatch + combine of (x, idx, w) in layout `expand`, and the
    dispatch outputs it writes (kept alive with it)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = buffer.dispatch(x, idx, w, num_experts=experts, do_cpu_sync=False, do_expand=expand)
        buffer.combine(_rows(out[0])[0], out[3], topk_weights=out[2])
    return graph, out


def bench(tokens, hidden, topk, experts, num_sms=None):
    """EP=1 figures (runs in a one-rank group)."""
    from epcomm import Buffer
    device = torch.device("cuda", torch.cuda.current_device())
    buffer = Buffer(dist.group.WORLD, tokens, hidden, topk, backend="symmetric", num_sms=num_sms)
    x, idx, w = _data(0, tokens, hidden, topk, experts, False, 7, device)
    nbytes = x.numel() * x.element_size()
    copy_out = torch.empty_like(x)
    rows = []
    copy = lambda: copy_out.copy_(x)  # noqa: E731
    # A device-to-device memcpy, GPU-bound back to back (a 5 us launch for a 30 us copy).
    t_copy = _cuda_time(copy, 20)[0]
    rows.append(("torch copy of x (roofline)", t_copy, t_copy, nbytes, 1.0, 1, 0.0))
    # Bytes each path must move at EP=1, in units of x's bytes, read + written
    # (docs/perf-notes.md; a rank reads its own rows from the caller's tensors, not through
    # staging): dispatch: read x, then write the output (compact, 2) or one output row per
    # (token, expert) pair (expand, 1 + pairs); combine: read x and write the output (compact,
    # 2), or one read per pair plus staging write, read and the output (expand, 3 + pairs).
    pairs = int((idx >= 0).sum()) / tokens
    for expand in (False, True):
        opts = dict(do_expand=expand, do_cpu_sync=False)
        state = {}
        moved = {(False, "dispatch"): 2, (True, "dispatch"): 1 + pairs, (False, "combine"): 2,
                 (True, "combine"): 3 + pairs}

        def dispatch():
            state["out"] = buffer.dispatch(x, idx, w, num_experts=experts, **opts)

        def combine():
            out = state["out"]
            buffer.combine(_rows(out[0])[0], out[3], topk_weights=out[2])

        def dispatch_sync():
            buffer.dispatch(x, idx, w, num_experts=experts, do_expand=expand, do_cpu_sync=True)

        name = "expand" if expand else "compact"
        for what, fn in ((f"dispatch {name} (sync-free)", dispatch), (f"combine {name}", combine),
                         (f"dispatch {name} (do_cpu_sync)", dispatch_sync)):
            t_call, host = _cuda_time(fn, 20)
            launches, t_kernel = _kernels(fn)
            units = moved[expand, what.split()[0]]
            rows.append((what, t_call, t_kernel, nbytes, units / 2 * t_copy / t_kernel, launches,
                         host))
    for expand in (False, True):
        buffer.dispatch(x, idx, w, num_experts=experts, do_cpu_sync=False, do_expand=expand)
        graph, out = _pair_graph(buffer, x, idx, w, experts, expand)
        # Replays back to back are GPU-bound (about 11 us of host time each): their time is the
        # kernels' time.
        t_g, host_g = _cuda_time(graph.replay, 20)
        units = moved[expand, "dispatch"] + moved[expand, "combine"]
        rows.append((f"graph replay dispatch+combine {'expand' if expand else 'compact'}", t_g,
                     t_g, nbytes, units / 2 * t_copy / t_g, 1, host_g))
    return rows, buffer.num_sms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--num-sms", type=int, default=None, help="programs (default: the backend's)")
    parser.add_argument("--profile", action="store_true", help="profiler tables of EP=1 calls")
    parser.add_argument("--shared", type=int, default=None, metavar="N",
                        help="then time N processes sharing the GPU, each replaying its graph of "
                             "dispatch + combine, against N x the EP=1 replay")
    args = parser.parse_args()
    shape = (args.tokens, args.hidden, args.topk, args.experts)
    for ranks in args.ranks:
        seconds = run_local_ranks(check_ranks, ranks, *shape, timeout_s=600)
        print(f"check: {ranks} ranks on {torch.cuda.device_count()} GPU(s): bitwise equal to the "
              f"collective backend, sync-debug clean, graph replay equal "
              f"({max(seconds):.1f} s)", flush=True)
    if args.profile:
        run_local_ranks(profile_calls, 1, *shape, timeout_s=600)
    if args.no_bench:
        return
    rows, num_sms = run_local_ranks(bench, 1, *shape, args.num_sms, timeout_s=600)[0]
    from epcomm import Buffer
    heap = Buffer.get_buffer_size_hint(1, args.tokens, args.hidden, args.topk)
    dsv3 = Buffer.get_buffer_size_hint(8, 4096, 7168, 8)
    print(f"\nEP=1, {args.tokens} x {args.hidden} bf16, top-{args.topk}, {args.experts} experts, "
          f"num_sms={num_sms}, heap {heap / 2**20:.0f} MiB per rank "
          f"(DeepSeek-V3 EP8, 4096 tokens: {dsv3 / 2**20:.1f} MiB per rank)")
    print("(call us: back-to-back calls, host-bound when the host is slower than the GPU; "
          "kernel us: the kernels' own time, which GB/s and the roofline share use)")
    print(f"| {'what':40} | {'call us':>8} | {'kernel us':>9} | {'GB/s (x bytes)':>14} | "
          f"{'of copy roofline':>16} | {'launches':>8} | {'host us':>8} |")
    print(f"|{'-' * 42}|{'-' * 10}|{'-' * 11}|{'-' * 16}|{'-' * 18}|{'-' * 10}|{'-' * 10}|")
    for name, t_call, t_kernel, nbytes, ratio, launches, host in rows:
        print(f"| {name:40} | {t_call * 1e6:8.1f} | {t_kernel * 1e6:9.1f} | "
              f"{nbytes / t_kernel / 1e9:14.1f} | {ratio:15.0%} | {launches:8d} | "
              f"{host * 1e6:8.1f} |")
    if args.shared:
        from epcomm.bench_paths import shared_replays
        shared = run_local_ranks(shared_replays, args.shared, *shape, timeout_s=600)[0]
        print(f"\n{args.shared} processes sharing the GPU, graph replay of dispatch + combine, "
              f"us per replay (median over the processes) against {args.shared} x EP=1:")
        print("| layout | shared | EP=1 | ratio to the bound |\n|---|---:|---:|---:|")
        for layout, us in shared.items():
            single = next(r[1] for r in rows if r[0] == f"graph replay dispatch+combine {layout}") \
                * 1e6
            print(f"| {layout} | {us:.1f} | {single:.1f} | {us / (args.shared * single):.2f} |")


if __name__ == "__main__":
    main()
