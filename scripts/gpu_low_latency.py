"""Check and time V1's low-latency mode (`epcomm.legacy.Buffer.low_latency_*`) on the GPU machine.

    PYTHONPATH=src:scripts python3 scripts/gpu_low_latency.py [--ranks 2 4 8] [--no-bench]

1. For each rank count: that many processes share the GPU (gloo bootstrap, CUDA IPC heap, the
   symmetric transport's Triton kernels). Hidden 7168, top-8, 256 experts, M = 128, random
   token counts with -1 ids, the last rank empty: bf16, FP8, power-of-two and UE8M0 dispatch
   and the weighted combine, bitwise against `epcomm.testing.reference_low_latency` (on CPU
   copies); the hook path; an eager dispatch + combine under
   `torch.cuda.set_sync_debug_mode("error")`; then dispatch + combine captured in a CUDA graph
   and replayed on new data, against the reference again.
2. Timing at EP=1 (one process, `epcomm.bench_paths.low_latency_rows`): FP8 dispatch + bf16
   combine of 1, 32, 128 and 256 tokens (M = 128, 256 for 256 tokens), hidden 7168, top-8, 256 experts:
   CUDA-graph replay of dispatch alone, combine alone and both, eager back-to-back calls, and
   the floor: a torch copy of the bytes the pair moves (read + write), timed in the same run.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

os.environ.setdefault("EP_AVOID_RECORD_STREAM", "1")

from epcomm.legacy import Buffer  # noqa: E402
from epcomm.testing.launch import capture_graph, run_local_ranks  # noqa: E402
from epcomm.testing.reference_low_latency import (reference_low_latency_combine,  # noqa: E402
                                                  reference_low_latency_dispatch)

H, K, E = 7168, 8, 256
MODES = {"bf16": dict(use_fp8=False), "fp8": dict(use_fp8=True),
         "fp8-pow2": dict(use_fp8=True, round_scale=True),
         "ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.int16) \
        if t.dtype.itemsize == 2 else t


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {got.shape} != {want.shape}"
    assert torch.equal(_bits(got), _bits(want.to(got.dtype))), f"{what}: differs"


def _inputs(seed, rank, num_ranks, max_tokens, tokens=None):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    if tokens is None:
        tokens = 0 if num_ranks > 1 and rank == num_ranks - 1 else int(
            torch.randint(1, max_tokens + 1, (1,), generator=gen))
    x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]) \
        if tokens else torch.empty(0, K, dtype=torch.long)
    idx[torch.rand(tokens, K, generator=gen) < 0.05] = -1
    weights = torch.rand(tokens, K, generator=gen)
    out = torch.randn(E // num_ranks, num_ranks * max_tokens, H, generator=gen).to(
        torch.bfloat16)
    return x, idx, weights, out


def _check_dispatch(got, ref, fp8, what):
    recv_x, count, handle = got
    _same(count, ref.recv_count, f"{what} recv_count")
    _same(handle[1], ref.layout_range, f"{what} layout_range")
    rows, scales = recv_x if fp8 else (recv_x, None)
    for e, n in enumerate(ref.recv_count.tolist()):
        _same(rows[e, :n], ref.rows[e], f"{what} recv_x[{e}]")
        _same(handle[0][e, :n], ref.src_info[e], f"{what} src_info[{e}]")
        if fp8:
            _same(scales[e, :n], ref.scales[e], f"{what} scales[{e}]")


def check_ranks(seed: int) -> bool:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    group, M = dist.group.WORLD, 128
    hint = Buffer.get_low_latency_rdma_size_hint(M, H, num_ranks, E)
    buffer = Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, backend="symmetric")
    host = _inputs(seed, rank, num_ranks, M)
    x, idx, weights, out = (t.cuda() for t in host)
    for mode, options in MODES.items():
        ref = reference_low_latency_dispatch(host[0], host[1], M, E, group, **options)
        got = buffer.low_latency_dispatch(x, idx, M, E, **options)
        _check_dispatch(got[:3], ref, options["use_fp8"], mode)
        combined = buffer.low_latency_combine(out, idx, weights, got[2])[0]
        _same(combined, reference_low_latency_combine(host[3], ref, host[2], group),
              f"{mode} combined")
        hooked = buffer.low_latency_dispatch(x, idx, M, E, return_recv_hook=True, **options)
        hooked[4]()
        _check_dispatch(hooked[:3], ref, options["use_fp8"], f"{mode} hook")
        combined, _, hook = buffer.low_latency_combine(out, idx, weights, hooked[2],
                                                       return_recv_hook=True)
        hook()
        _same(combined, reference_low_latency_combine(host[3], ref, host[2], group),
              f"{mode} hook combined")

    def step():
        got = buffer.low_latency_dispatch(x, idx, M, E, use_fp8=True)
        return got[0], got[1], got[2], buffer.low_latency_combine(out, idx, weights, got[2])[0]

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # an eager call after the first: no host sync
    step()
    torch.cuda.set_sync_debug_mode(0)
    graph, outputs = capture_graph(step)
    host = _inputs(seed + 1, rank, num_ranks, M, x.shape[0])  # the capture's shapes
    for target, new in zip((x, idx, weights, out), host):
        target.copy_(new)
    ref = reference_low_latency_dispatch(host[0], host[1], M, E, group, use_fp8=True)
    torch.cuda.synchronize()
    dist.barrier()
    graph.replay()
    _check_dispatch(outputs[:3], ref, True, "graph replay")
    _same(outputs[3], reference_low_latency_combine(host[3], ref, host[2], group),
          "graph replay combined")
    buffer.low_latency_check_errors()
    return True


def bench() -> list:
    """The EP=1 rows of `epcomm.bench_paths.low_latency_rows` at 1, 32, 128 and 256 tokens."""
    from dataclasses import asdict

    from epcomm import bench_paths
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for tokens in (1, 32, 128, 256):
        x, idx, weights = bench_paths.example(tokens, H, K, E, device, seed=tokens)
        rows += bench_paths.low_latency_rows(x, idx, weights, E, 50, goals=True)
    return [asdict(row) for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    for ranks in args.ranks:
        run_local_ranks(check_ranks, ranks, args.seed, timeout_s=600)
        print(f"{ranks} processes on the GPU: bitwise equal to the reference (4 modes, hook, "
              "graph replay)", flush=True)
    if args.no_bench:
        return
    from epcomm.bench_paths import format_paths
    print("EP=1, hidden 7168, top-8, 256 experts, FP8 dispatch + bf16 combine (us per call)")
    print(format_paths(run_local_ranks(bench, 1, timeout_s=600)[0]))


if __name__ == "__main__":
    main()
