"""The Python a sync-free dispatch and combine run on the host, measured on a CPU machine.

    PYTHONPATH=src python3 scripts/cpu_host_glue.py [--repeats 7]

A proxy for the GPU machine's host time, for work on the host path without a GPU: a one-rank
symmetric buffer on CPU tensors (Triton interpreter) whose compiled-kernel path is forced on
and whose launches do nothing, so calls take the same Python as on the GPU (plans, untyped
arguments). Missing here: the CUDA stream checks, CUDA allocations and the C launch. Prints the
median microseconds per call (the least of `--repeats` medians), and the pieces to subtract
to get the Python alone: the CPU-only expert-id check that validation runs on CPU tensors, and
the call's four output allocations. On the GPU machine's host the same Python took 2.5-3x as
long in sessions 7 and 8 (docs/perf-notes.md).
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from host_timing import sync_free_calls  # noqa: E402

T, H, K, E, TOKENS = 256, 512, 8, 256, 16  # shapes do not matter to the Python; small is quick


def _median_us(fn, calls: int = 300) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(calls):
        begin = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - begin)
    return sorted(samples)[calls // 2] * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from epcomm.buffer import Buffer
    from epcomm.kernels.launcher import Launcher

    # Every variant counts as kept and every launch does nothing.
    Launcher.fast = property(lambda self: True, lambda self, value: None)
    Launcher.kept = lambda self, variant: variant is not None
    Launcher.__call__ = lambda self, variant, stream, *args, typed=True: None
    Launcher.launch_untyped = lambda self, variant, stream, args: None

    buffer = Buffer(dist.group.WORLD, T, H, K, backend="symmetric", device="cpu")
    x = torch.randn(TOKENS, H).bfloat16()
    idx = torch.randint(0, E, (TOKENS, K))
    weights = torch.rand(TOKENS, K)
    dispatch, combine = sync_free_calls(buffer, x, idx, weights, E)

    def expert_id_check():
        return bool(((idx < -1) | (idx >= E)).any())

    dispatch()
    plan = next(iter(buffer._prepared.values()))  # the call's plan: its output allocations

    def allocations():
        return [new() for new in plan._empties]

    print("| piece | us per call |\n|---|---|")
    for name, fn in (("Buffer.dispatch (sync-free, compact)", dispatch),
                     ("Buffer.combine", combine),
                     ("  of which the CPU-only expert-id check (dispatch)", expert_id_check),
                     (f"  of which {len(plan._empties)} output allocations (dispatch)", allocations)):
        print(f"| {name} | {min(_median_us(fn) for _ in range(args.repeats)):.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
