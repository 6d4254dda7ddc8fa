"""Soak: many mixed round trips on local ranks, each bitwise against the reference, memory
sampled at intervals (`epcomm.testing.soak`).

    PYTHONPATH=src python3 scripts/soak.py [--backend collective symmetric] [--ranks 2]
        [--round-trips 4000] [--device cpu|cuda] [--report-every 500] [--seed S]

Each round trip is a dispatch, sometimes a cached dispatch, and a combine (about 2.4 calls, so
4000 round trips are about 10,000 calls). On CPU the symmetric backend's kernels run under the
Triton interpreter (about a second per call); on the GPU machine the ranks share the GPU. Rank 0
prints each memory sample; the last lines give, per backend, the calls, the time and each
rank's memory growth after warm-up (host MB; CUDA MB allocated). Exits 1 on a failure or when
memory grew by more than --max-growth-mb.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch.distributed as dist

from epcomm import Buffer
from epcomm.testing.launch import run_local_ranks
from epcomm.testing.soak import MemorySample, soak


def _rank(backend: str, device: str, round_trips: int, seed: int, report_every: int,
          hidden: int, max_tokens: int, num_topk: int):
    buffer = Buffer(dist.group.WORLD, max_tokens, hidden, num_topk, backend=backend,
                    device=device)

    def report(sample: MemorySample) -> None:
        if buffer.rank == 0:
            print(f"  {backend:<10} {sample.round_trips:>7} round trips  {sample.seconds:8.1f} s"
                  f"  host {sample.host_mb:8.1f} MB  cuda {sample.cuda_mb:8.1f} MB", flush=True)

    result = soak(buffer, round_trips, seed, report_every, report)
    buffer.destroy()
    return result.calls, result.growth_mb(), result.samples[-1].seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", nargs="+", default=["collective", "symmetric"],
                        choices=["collective", "symmetric"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--round-trips", type=int, default=4000)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--report-every", type=int, default=500)
    parser.add_argument("--seed", type=int, default=time.time_ns() % 1_000_000)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--max-growth-mb", type=float, default=64.0)
    args = parser.parse_args()
    if args.device == "cpu" and "symmetric" in args.backend:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    print(f"soak: seed {args.seed}, {args.ranks} ranks on {args.device}, "
          f"{args.round_trips} round trips per backend", flush=True)
    rows, failed = [], False
    for backend in args.backend:
        try:
            results = run_local_ranks(_rank, args.ranks, backend, args.device, args.round_trips,
                                      args.seed, args.report_every, args.hidden,
                                      args.max_tokens, args.topk, timeout_s=300,
                                      deadline_s=24 * 3600)
        except RuntimeError as error:
            print(error)
            rows.append(f"{backend:<10} FAILED (seed {args.seed})")
            failed = True
            continue
        calls = sum(calls for calls, _, _ in results) // args.ranks
        growth = [g for _, g, _ in results]
        grew = max(max(host, cuda) for host, cuda in growth)
        failed |= grew > args.max_growth_mb
        shown = "  ".join(f"r{r}: {host:+.1f}/{cuda:+.1f}" for r, (host, cuda) in enumerate(growth))
        rows.append(f"{backend:<10} ok  {calls} calls in {results[0][2]:.0f} s; memory growth "
                    f"MB (host/cuda) {shown}" + ("  TOO MUCH" if grew > args.max_growth_mb else ""))
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
