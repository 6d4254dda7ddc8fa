"""Where the dispatch kernel's GPU time goes, phase by phase (GPU machine, EP=1).

    PYTHONPATH=src python3 scripts/gpu_phases.py [--tokens 4096] [--hidden 7168] [--expand]
    PYTHONPATH=src python3 scripts/gpu_phases.py --check-marks      (no GPU needed)

Phase boundaries are explicit marks in `src/epcomm/kernels/dispatch.py`: comment lines of the
form

    # phase-mark: <name>

(nothing else on the line; `<name>` is one of `MARKS`, each exactly once, in `MARKS`' order).
A traced copy of the module is compiled for this run only, each mark line replaced by a time
stamp at its indentation: every program records %globaltimer after a CTA barrier into a trace
tensor. The backend launches the traced kernel (patched in before the buffer is built); after
warm-up, one sync-free dispatch is traced and the table gives, per mark, the earliest / median
/ latest program's time since the earliest program started, and the median time each program
spent in the phase that the mark ends. The product kernel has no tracing: the marks are
comments and cost it nothing. A missing, repeated, misordered or unknown mark stops the script
with a message naming it; `--check-marks` only patches the source (and compiles it as Python)
and lists the marks.
"""
from __future__ import annotations

import importlib.util
import inspect
import linecache
import re
import statistics
import sys

import torch
import torch.distributed as dist

from epcomm.testing.launch import run_local_ranks
from gpu_tune import example_data, shape_parser

# The dispatch kernel's marks in the order the kernel reaches them.
MARKS = [
    "send-start",              # the program's chunk of tokens is known
    "send-counted",            # its tokens per destination counted
    "send-grid-barrier",       # every program has counted
    "send-peers-freed",        # every destination has copied out the previous call's records
    "send-records-pushed",     # this program's records are in the peers' staging regions
    "receive-ready",           # every source's records of this call have arrived
    "receive-rows-copied",     # compact rows, ids, weights, metadata written
    "receive-grid-barrier",    # every program has copied its rows
    "receive-expert-totals",   # per-expert pair counts and prefixes over groups
    "receive-grid-barrier-2",  # every program has its experts' totals
    "receive-first-rows",      # every expert's first row (and expand-layout gaps)
    "receive-expand-rows",     # expand row of every pair
    "receive-done",            # payload copied to expand rows, output tails cleared
]
MARK = re.compile(r"^(?P<indent>[ \t]*)# phase-mark: (?P<name>\S+)[ \t]*$")
SLOTS = 16  # trace slots per program, at least len(MARKS)
assert len(MARKS) <= SLOTS

STAMP = '''
from .sync import _globaltimer


@triton.jit
def _stamp(i):
    tl.debug_barrier()
    at = tl.full([], TRACE_ADDR, tl.int64) + (tl.program_id(0) * TRACE_SLOTS + i) * 8
    tl.store(at.to(tl.pointer_type(tl.int64)), _globaltimer())
'''


class MarkError(ValueError):
    """The kernel source's phase marks do not match `MARKS`."""


def find_marks(source: str) -> dict[str, int]:
    """Each `# phase-mark: <name>` line of `source`: name -> line index. Raises `MarkError`
    naming a mark that is missing, repeated, out of `MARKS`' order or not in `MARKS`."""
    found: dict[str, int] = {}
    for at, line in enumerate(source.splitlines()):
        if not line.lstrip().startswith("# phase-mark"):
            continue
        match = MARK.match(line)
        if match is None:
            raise MarkError(f"line {at + 1} starts like a phase mark but is not "
                            f"'# phase-mark: <name>' alone on its line: {line.strip()!r}")
        name = match["name"]
        if name not in MARKS:
            raise MarkError(f"unknown phase mark {name!r} at line {at + 1}: add it to "
                            f"scripts/gpu_phases.py MARKS or remove it")
        if name in found:
            raise MarkError(f"phase mark {name!r} appears twice (lines {found[name] + 1} and "
                            f"{at + 1})")
        found[name] = at
    missing = [name for name in MARKS if name not in found]
    if missing:
        raise MarkError(f"phase mark(s) missing from the dispatch kernel source: "
                        f"{', '.join(repr(name) for name in missing)} (expected lines "
                        f"'# phase-mark: <name>' in src/epcomm/kernels/dispatch.py)")
    for earlier, later in zip(MARKS, MARKS[1:]):
        if found[later] < found[earlier]:
            raise MarkError(f"phase mark {later!r} (line {found[later] + 1}) comes before "
                            f"{earlier!r} (line {found[earlier] + 1}): MARKS in "
                            f"scripts/gpu_phases.py lists them in the order the kernel runs them")
    return found


def traced_source(source: str, trace_addr: int) -> str:
    """`source` (the text of `epcomm.kernels.dispatch`) with each mark line replaced by
    `_stamp(i)` (i: the mark's index in `MARKS`), plus `_stamp` and its constants."""
    marks = find_marks(source)
    lines = source.splitlines()
    for i, name in enumerate(MARKS):
        at = marks[name]
        lines[at] = f"{MARK.match(lines[at])['indent']}_stamp({i})"
    return "\n".join(lines) + "\n" + STAMP + f"\nTRACE_ADDR = tl.constexpr({trace_addr})\n" \
        f"TRACE_SLOTS = tl.constexpr({SLOTS})\n"


def _dispatch_source() -> tuple[str, object]:
    from epcomm.kernels import dispatch
    return inspect.getsource(dispatch), dispatch


def traced_module(trace: torch.Tensor):
    """`epcomm.kernels.dispatch` with `_stamp(i)` at every mark, loaded as a sibling module."""
    source, dispatch = _dispatch_source()
    source = traced_source(source, trace.data_ptr())
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


def check_marks() -> str:
    """Patch the dispatch source as a traced run would (no GPU, nothing launched) and compile
    the result as Python; a line per mark found."""
    source, dispatch = _dispatch_source()
    marks = find_marks(source)
    compile(traced_source(source, 0), dispatch.__file__, "exec")
    return "\n".join([f"{len(marks)} phase marks found in {dispatch.__file__}, traced source "
                      f"compiles:"] + [f"  {i:2d} {name} (line {marks[name] + 1})"
                                       for i, name in enumerate(MARKS)])


def phases(tokens, hidden, topk, experts, expand, num_sms):
    from epcomm import Buffer
    from epcomm.kernels import dispatch

    device = torch.device("cuda", torch.cuda.current_device())
    programs = torch.cuda.get_device_properties(device).multi_processor_count
    trace = torch.zeros(programs * SLOTS, dtype=torch.int64, device=device)
    dispatch.dispatch_kernel = traced_module(trace).dispatch_kernel
    x, idx, w = example_data(tokens, hidden, topk, experts, device)
    buffer = Buffer(dist.group.WORLD, tokens, hidden, topk, backend="symmetric", num_sms=num_sms)
    programs = buffer.num_sms  # the programs of each launch
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
        results.append((trace[:programs * SLOTS].view(programs, SLOTS)[:, :len(MARKS)].tolist(),
                        start.elapsed_time(end) * 1e3))
    buffer.destroy()
    return programs, results


def main():
    parser = shape_parser()
    parser.add_argument("--expand", action="store_true")
    parser.add_argument("--num-sms", type=int, default=None, help="programs (default: the backend's)")
    parser.add_argument("--check-marks", action="store_true",
                        help="only check that the dispatch source has every phase mark")
    args = parser.parse_args()
    try:
        print(check_marks())
    except MarkError as error:
        sys.exit(f"gpu_phases.py: {error}")
    if args.check_marks:
        return
    programs, results = run_local_ranks(phases, 1, args.tokens, args.hidden, args.topk,
                                        args.experts, args.expand, args.num_sms,
                                        timeout_s=600)[0]
    trace, elapsed = results[len(results) // 2]
    trace = torch.tensor(trace)
    zero = trace[:, 0].min()
    since = (trace - zero).double() / 1e3  # us
    print(f"\nEP=1 dispatch {'expand' if args.expand else 'compact'}, {args.tokens} x "
          f"{args.hidden} bf16, top-{args.topk}, {programs} programs; event time of the traced "
          f"call {elapsed:.1f} us (runs: {', '.join(f'{e:.1f}' for _, e in results)})")
    print("| mark | earliest us | median us | latest us | median phase us |\n"
          "|---|---:|---:|---:|---:|")
    for i, mark in enumerate(MARKS):
        column = since[:, i].tolist()
        phase = (since[:, i] - since[:, i - 1]).tolist() if i else column
        print(f"| {mark} | {min(column):.1f} | {statistics.median(column):.1f} | "
              f"{max(column):.1f} | {statistics.median(phase):.1f} |")


if __name__ == "__main__":
    main()
