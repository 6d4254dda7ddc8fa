"""The test matrix at real sizes with one process per GPU (EP8 on an 8-GPU machine).

    PYTHONPATH=src python3 scripts/gpu_multi.py [--ranks N] [--tokens 4096] [--hidden 7168]

N ranks (default: every GPU, at least 2), NCCL group, one GPU each; for the collective and the
symmetric backend, the 64 cases of `epcomm.testing.verify.matrix_cases` (routings incl.
masked, skewed and same-rank, uneven and empty token counts, both layouts, sync and
sync-free, bf16 and FP8, alignment 1 and 128, weights, biases, zero padding, cached dispatch)
at top-8 with 256 experts (`--experts`), each bitwise against the reference (plain NCCL
all_to_all_single on the GPU).
Prints one line per backend, then a table. `--cpu` runs CPU ranks over gloo instead (a smoke
test of this script; CI runs it at small sizes).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from epcomm.testing.launch import run_local_ranks


def check_backend(backend: str, tokens: int, hidden: int, topk: int, experts: int, seed: int,
                  device: str) -> dict:
    from epcomm import Buffer
    from epcomm.testing.verify import run_matrix_cases
    start = time.time()
    buffer = Buffer(dist.group.WORLD, tokens, hidden, topk, backend=backend, timeout_s=300,
                    device=device)
    cases = run_matrix_cases(buffer, experts // buffer.num_ranks, seed)
    used, sms = buffer.backend, buffer.num_sms
    buffer.destroy()
    return {"cases": cases, "backend": used, "num_sms": sms, "s": time.time() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--backends", default="collective,symmetric")
    parser.add_argument("--seed", type=int, default=int(os.environ.get(
        "EPCOMM_TEST_SEED", time.time_ns() % 1_000_000)))
    parser.add_argument("--cpu", action="store_true",
                        help="CPU ranks over gloo (a smoke test of this script, small sizes)")
    args = parser.parse_args()
    device, pg_backend = ("cpu", "gloo") if args.cpu else ("cuda", "nccl")
    if args.cpu:
        args.ranks = args.ranks or 2
    elif args.ranks < 2 or torch.cuda.device_count() < args.ranks:
        print(f"needs one GPU per rank and at least 2 ranks: {torch.cuda.device_count()} GPU(s), "
              f"--ranks {args.ranks}", file=sys.stderr)
        return 2
    where = "CPU ranks, gloo" if args.cpu else "one GPU each, NCCL"
    print(f"{args.ranks} ranks, {where}; tokens {args.tokens}, hidden {args.hidden}, "
          f"top-{args.topk}, {args.experts} experts, seed {args.seed}")
    lines = []
    for backend in args.backends.split(","):
        results = run_local_ranks(check_backend, args.ranks, backend, args.tokens, args.hidden,
                                  args.topk, args.experts, args.seed, device,
                                  pg_backend=pg_backend, timeout_s=600, deadline_s=1800)
        first = results[0]
        assert all(r["cases"] == first["cases"] for r in results), results
        print(f"{backend}: {first['cases']} cases bitwise equal to the reference on every rank "
              f"({first['s']:.0f} s)", flush=True)
        lines.append(f"| {backend} | {first['backend']} | {first['num_sms']} | {first['cases']} "
                     f"| ok | {first['s']:.0f} |")
    print("\n| asked | used | SMs | cases | check | s |\n|---|---|---|---|---|---|")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
