"""Check and benchmark the symmetric backend on the GPU machine.

    PYTHONPATH=src python3 scripts/gpu_symmetric.py [--ranks 2 4 8] [--tokens 4096] [--no-bench]

1. For each rank count: that many processes share the GPU(s) (gloo bootstrap, CUDA IPC heap).
   Both layouts, bf16 and FP8, hidden 7168, top-8, 256 experts, up to `--tokens` tokens per
   rank: symmetric vs collective (gloo, staged through the host) bitwise; the sync-free calls
   run under `torch.cuda.set_sync_debug_mode("error")`; then dispatch + combine are captured in
   a CUDA graph and replayed on new data, compared with the collective backend.
2. Benchmark at EP=1: dispatch / combine of 4096 x 7168 bf16, top-8, against a torch copy of the
   same rows measured in the same run; host time per call; kernel launches per call.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

os.environ.setdefault("EP_AVOID_RECORD_STREAM", "1")  # graph capture must not record_stream

from epcomm.launch import run_local_ranks  # noqa: E402


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


def _valid_rows(handle):
    if handle.do_expand:
        keep = torch.zeros(handle.num_expanded_tokens, dtype=torch.bool, device="cpu")
        rows = handle.recv_src_metadata[:, 2:].flatten().long().cpu()
        keep[rows[rows >= 0]] = True
        return keep
    return slice(0, int(handle.psum_num_recv_tokens_per_scaleup_rank[-1]))


def _compare(got, want, what):
    (gd, gc), (wd, wc) = got, want
    gh, wh = gd[3], wd[3]
    for name in ("recv_src_metadata", "psum_num_recv_tokens_per_scaleup_rank",
                 "psum_num_recv_tokens_per_expert", "num_unaligned_recv_tokens_per_expert"):
        _same(getattr(gh, name), getattr(wh, name), f"{what} {name}")
    _same(gd[1], wd[1], f"{what} recv_topk_idx")
    _same(gd[2], wd[2], f"{what} recv_topk_weights")
    keep = _valid_rows(wh)
    for i, (g, w) in enumerate(zip(_rows(gd[0]), _rows(wd[0]))):
        _same(g.cpu()[keep], w.cpu()[keep], f"{what} recv_x[{i}]")
    _same(gc[0], wc[0], f"{what} combined_x")
    _same(gc[1], wc[1], f"{what} combined_weights")


def _roundtrip(buffer, x, idx, weights, experts, opts, bias, debug):
    torch.cuda.synchronize()
    if debug:
        torch.cuda.set_sync_debug_mode("error")
    try:
        out = buffer.dispatch(x, idx, weights, num_experts=experts, **opts)
        y = _rows(out[0])[0].to(torch.bfloat16) * 3
        combined = buffer.combine(y, out[3], topk_weights=out[2], bias=bias)
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return out, combined


def check_ranks(tokens, hidden, topk, experts):
    """One rank of the correctness check; returns seconds spent."""
    from epcomm.buffer import Buffer
    start = time.time()
    rank, R = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    coll = Buffer(group, tokens, hidden, topk, backend="collective", timeout_s=120)
    symm = Buffer(group, tokens, hidden, topk, backend="symmetric", timeout_s=120)
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
    # CUDA graph: capture a sync-free dispatch + combine, replay on new data. (No eager call
    # through `symm` after a capture: Buffer._drain_pending queries events recorded during
    # capture, which CUDA rejects.)
    for expand in (False, True):
        opts = dict(do_expand=expand, do_cpu_sync=False, expert_alignment=4 if expand else 1)
        x, idx, w = _data(rank, num_tokens, hidden, topk, experts, False, 50, device)
        graph = torch.cuda.CUDAGraph()
        dist.barrier()
        with torch.cuda.graph(graph):
            captured = symm.dispatch(x, idx, w, num_experts=experts, **opts)
            y = _rows(captured[0])[0] * 3
            captured_c = symm.combine(y, captured[3], topk_weights=captured[2])
        for replay in range(2):
            x2, idx2, w2 = _data(rank, num_tokens, hidden, topk, experts, False, 60 + replay,
                                 device)
            x.copy_(x2)
            idx.copy_(idx2)
            w.copy_(w2)
            graph.replay()
            torch.cuda.synchronize()
            want = _roundtrip(coll, x2, idx2, w2, experts, opts, None, False)
            _compare((captured, captured_c), want, f"rank {rank} graph expand={expand} #{replay}")
    symm.check_errors()
    return time.time() - start


def _cuda_time(fn, iters):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = time.perf_counter()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    host = (time.perf_counter() - host) / iters
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e-3, host


def _launches(fn):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA"
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


def bench(tokens, hidden, topk, experts):
    """EP=1 figures (runs in a one-rank group)."""
    from epcomm.buffer import Buffer
    device = torch.device("cuda", torch.cuda.current_device())
    buffer = Buffer(dist.group.WORLD, tokens, hidden, topk, backend="symmetric")
    x, idx, w = _data(0, tokens, hidden, topk, experts, False, 7, device)
    nbytes = x.numel() * x.element_size()
    copy_out = torch.empty_like(x)
    rows = []
    t_copy, _ = _cuda_time(lambda: copy_out.copy_(x), 20)
    rows.append(("torch copy of x (roofline)", t_copy, nbytes, 1.0, 1, 0.0))
    for expand in (False, True):
        opts = dict(do_expand=expand, do_cpu_sync=False)
        state = {}

        def dispatch():
            state["out"] = buffer.dispatch(x, idx, w, num_experts=experts, **opts)

        def combine():
            out = state["out"]
            buffer.combine(_rows(out[0])[0], out[3], topk_weights=out[2])

        name = "expand" if expand else "compact"
        t_d, host_d = _cuda_time(dispatch, 20)
        t_c, host_c = _cuda_time(combine, 20)
        # Dispatch reads x and writes the staging region, then the copy epilogue reads it and
        # writes the output: two copies of x; combine likewise moves rows twice.
        rows.append((f"dispatch {name} (sync-free)", t_d, nbytes, 2 * t_copy / t_d,
                     _launches(dispatch), host_d))
        rows.append((f"combine {name}", t_c, nbytes, 2 * t_copy / t_c, _launches(combine),
                     host_c))
    graph = torch.cuda.CUDAGraph()
    out = buffer.dispatch(x, idx, w, num_experts=experts, do_cpu_sync=False)
    with torch.cuda.graph(graph):
        out = buffer.dispatch(x, idx, w, num_experts=experts, do_cpu_sync=False)
        buffer.combine(out[0], out[3], topk_weights=out[2])
    t_g, host_g = _cuda_time(graph.replay, 20)
    rows.append(("graph replay dispatch+combine compact", t_g, nbytes, 4 * t_copy / t_g, 1,
                 host_g))
    return rows, buffer.num_sms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--no-bench", action="store_true")
    args = parser.parse_args()
    shape = (args.tokens, args.hidden, args.topk, args.experts)
    for ranks in args.ranks:
        seconds = run_local_ranks(check_ranks, ranks, *shape, timeout_s=600)
        print(f"check: {ranks} ranks on {torch.cuda.device_count()} GPU(s): bitwise equal to the "
              f"collective backend, sync-debug clean, graph replay equal "
              f"({max(seconds):.1f} s)", flush=True)
    if args.no_bench:
        return
    rows, num_sms = run_local_ranks(bench, 1, *shape, timeout_s=600)[0]
    print(f"\nEP=1, {args.tokens} x {args.hidden} bf16, top-{args.topk}, {args.experts} experts, "
          f"num_sms={num_sms}")
    print(f"| {'what':40} | {'GPU us':>9} | {'GB/s (x bytes)':>14} | {'vs copy roofline':>16} | "
          f"{'launches':>8} | {'host us':>8} |")
    print(f"|{'-' * 42}|{'-' * 11}|{'-' * 16}|{'-' * 18}|{'-' * 10}|{'-' * 10}|")
    for name, seconds, nbytes, ratio, launches, host in rows:
        print(f"| {name:40} | {seconds * 1e6:9.1f} | {nbytes / seconds / 1e9:14.1f} | "
              f"{ratio:15.0%} | {launches:8d} | {host * 1e6:8.1f} |")


if __name__ == "__main__":
    main()
