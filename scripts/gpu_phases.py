"""Where the dispatch kernel's GPU time goes, phase by phase (GPU machine, EP=1).

    PYTHONPATH=src python3 scripts/gpu_phases.py [--tokens 4096] [--hidden 7168] [--expand]

A traced copy of `kernels/dispatch.py` is compiled for this run only: at each phase boundary
(`MARKS`, found by the text of the line they precede or follow) every program records
%globaltimer after a CTA barrier into a trace tensor. The backend launches the traced kernel
(patched in before the buffer is built); after warm-up, one sync-free dispatch is traced and
the table gives, per mark, the earliest / median / latest program's time since the earliest
program started, and the median time each program spent in the phase that the mark ends.
The product kernel has no tracing: this costs it nothing.
"""
from __future__ import annotations

import importlib.util
import inspect
import linecache
import statistics
import sys

import torch
import torch.distributed as dist

from epcomm.launch import run_local_ranks
from gpu_tune import example_data, shape_parser

# (mark, anchor text, "before" or "after" the first line containing it, searched in order).
MARKS = [
    ("send start", "begin, end = program_chunk(num_tokens)", "after"),
    ("send: counted", "tl.store(counts_scratch + pid * BLOCK_R + rr, sent_here)", "before"),
    ("send: grid barrier", "# 2. This chunk's first position", "before"),
    ("send: peers freed", "# 4. Per tile of tokens", "before"),
    ("send: records pushed", "# 5. Counts, then", "before"),
    ("receive: ready", "begin, end = program_chunk(num_rows)", "after"),
    ("receive: rows copied", "grid_barrier(sync_ptr + barrier_slot", "before"),
    ("receive: grid barrier", "# 3. Each program owns", "before"),
    ("receive: expert totals", "grid_barrier(sync_ptr + barrier_slot", "before"),
    ("receive: grid barrier 2", "# Then, BLOCK_E experts at a time", "before"),
    ("receive: first rows", "# 4. Expand row of every pair", "before"),
    ("receive: expand rows", "if overflow > 0:", "before"),
    ("receive: payload/tails", "# 5. This program is done", "before"),
]
SLOTS = 16

STAMP = '''
@triton.jit
def _stamp(i):
    tl.debug_barrier()
    at = tl.full([], TRACE_ADDR, tl.int64) + (tl.program_id(0) * TRACE_SLOTS + i) * 8
    tl.store(at.to(tl.pointer_type(tl.int64)), _globaltimer())
'''


def traced_module(trace: torch.Tensor):
    """`epcomm.kernels.dispatch` with `_stamp(i)` at every mark, loaded as a sibling module."""
    from epcomm.kernels import dispatch
    lines = inspect.getsource(dispatch).splitlines()
    at = 0
    for i, (_, anchor, where) in enumerate(MARKS):
        while anchor not in lines[at]:
            at += 1
        indent = lines[at][:len(lines[at]) - len(lines[at].lstrip())]
        lines.insert(at + (where == "after"), f"{indent}_stamp({i})")
        at += 2
    source = "\n".join(lines).replace(
        "from .sync import (", "from .sync import _globaltimer\nfrom .sync import (", 1)
    source += STAMP + f"\nTRACE_ADDR = tl.constexpr({trace.data_ptr()})\n" \
        f"TRACE_SLOTS = tl.constexpr({SLOTS})\n"
    name = "epcomm.kernels._traced_dispatch"
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = dispatch.__file__.replace("dispatch.py", "_traced_dispatch.py")
    sys.modules[name] = module
    # Triton reads a jit function's source through inspect: give it the traced text.
    linecache.cache[module.__file__] = (len(source), None, source.splitlines(True),
                                        module.__file__)
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def phases(tokens, hidden, topk, experts, expand):
    from epcomm.buffer import Buffer
    from epcomm.kernels import dispatch

    device = torch.device("cuda", torch.cuda.current_device())
    programs = torch.cuda.get_device_properties(device).multi_processor_count
    trace = torch.zeros(programs * SLOTS, dtype=torch.int64, device=device)
    dispatch.dispatch_kernel = traced_module(trace).dispatch_kernel
    x, idx, w = example_data(tokens, hidden, topk, experts, device)
    buffer = Buffer(dist.group.WORLD, tokens, hidden, topk, backend="symmetric")
    results = []
    for _ in range(5):
        out = buffer.dispatch(x, idx, w, num_experts=experts, do_cpu_sync=False,
                              do_expand=expand)
        buffer.combine(out[0], out[3], topk_weights=out[2])
        torch.cuda.synchronize()
        trace.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        buffer.dispatch(x, idx, w, num_experts=experts, do_cpu_sync=False, do_expand=expand)
        end.record()
        torch.cuda.synchronize()
        results.append((trace.view(programs, SLOTS)[:, :len(MARKS)].tolist(),
                        start.elapsed_time(end) * 1e3))
    buffer.destroy()
    return programs, results


def main():
    parser = shape_parser()
    parser.add_argument("--expand", action="store_true")
    args = parser.parse_args()
    programs, results = run_local_ranks(phases, 1, args.tokens, args.hidden, args.topk,
                                        args.experts, args.expand, timeout_s=600)[0]
    trace, elapsed = results[len(results) // 2]
    trace = torch.tensor(trace)
    zero = trace[:, 0].min()
    since = (trace - zero).double() / 1e3  # us
    print(f"\nEP=1 dispatch {'expand' if args.expand else 'compact'}, {args.tokens} x "
          f"{args.hidden} bf16, top-{args.topk}, {programs} programs; event time of the traced "
          f"call {elapsed:.1f} us (runs: {', '.join(f'{e:.1f}' for _, e in results)})")
    print("| mark | earliest us | median us | latest us | median phase us |\n|---|---:|---:|---:|---:|")
    for i, (mark, _, _) in enumerate(MARKS):
        column = since[:, i].tolist()
        phase = (since[:, i] - since[:, i - 1]).tolist() if i else column
        print(f"| {mark} | {min(column):.1f} | {statistics.median(column):.1f} | "
              f"{max(column):.1f} | {statistics.median(phase):.1f} |")


if __name__ == "__main__":
    main()
