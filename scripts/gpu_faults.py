"""Faults and mismatched ranks of the symmetric backend on the GPU machine.

    PYTHONPATH=src python3 scripts/gpu_faults.py [--ranks 2 4]

For each rank count, that many processes share the GPU(s) and run `symmetric_faults` of
tests/test_faults.py on CUDA tensors: a different num_experts (synchronizing) and
num_max_tokens_per_rank (sync-free, reported by check_errors) on each rank, flagged and not
mixed, then a round trip bitwise against the reference; NaN payloads (dispatch keeps the bits,
combine outputs the canonical quiet NaN); peers sleeping past a 0.5 s timeout (wall-clock on
the GPU's %globaltimer: each error within 0.5 s + 5 s), then the broken buffer; a rank out of
step; then the last rank exits after a dispatch and the others' combine times out (no crash,
no hang). Prints one line per rank count: ok or the failure, and the seconds it took.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from epcomm.testing.launch import run_local_ranks  # noqa: E402
from test_faults import symmetric_faults, symmetric_peer_exits  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    failed = False
    print(f"{'ranks':>5}  {'result':<8} seconds")
    for ranks in args.ranks:
        start = time.monotonic()
        try:
            run_local_ranks(symmetric_faults, ranks, "cuda", timeout_s=120, deadline_s=400)
            outcome = run_local_ranks(symmetric_peer_exits, ranks, "cuda", timeout_s=60,
                                      deadline_s=120)
            assert outcome == ["timeout"] * (ranks - 1) + ["left"], outcome
            result = "ok"
        except (RuntimeError, AssertionError) as error:
            result, failed = "FAILED", True
            print(error)
        print(f"{ranks:>5}  {result:<8} {time.monotonic() - start:.1f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
