"""Where a kernel's GPU time goes, phase by phase (GPU machine, EP=1).

    PYTHONPATH=src python3 scripts/gpu_phases.py [--kernel dispatch] [--tokens 4096]
        [--hidden 7168] [--expand]
    PYTHONPATH=src python3 scripts/gpu_phases.py --check-marks      (no GPU needed)

Kernels (`--kernel`): `dispatch` and `combine`, the symmetric backend's two kernels (the
combine traced after a sync-free dispatch of the same layout); `ll-send`,
`ll-local`, `ll-recv`, `ll-combine-send`, `ll-reduce`, five kernels of V1's low-latency mode
(FP8 dispatch, M = max(tokens, 128)). At EP=1 only the local dispatch (`ll_dispatch_local`, the
dispatch of a one-rank group) and the reduce of those run (a combine received right away sends
nothing); the other three run only with two or more ranks, which this script does not trace,
and stop it with a message saying so. Phase boundaries are explicit marks in the kernel's module
(`src/epcomm/kernels/dispatch.py`, `combine.py`, `low_latency.py`): comment lines of the
form

    # phase-mark: <name>

(nothing else on the line; `<name>` one of the kernel's `TARGETS` marks, each exactly once, in
that order; a module's other kernels have their own). A traced copy of the module is compiled
for this run only, each of the kernel's mark lines replaced by a time stamp at its indentation:
every program records %globaltimer after a CTA barrier into a trace tensor. The kernel is
patched in before the buffer is built; after warm-up, one call is traced and the table gives,
per mark, the earliest / median / latest program's time since the earliest program started,
and the median time each program spent in the phase that the mark ends. The product kernels
have no tracing: the marks are comments and cost them nothing. A missing, repeated, misordered
or unknown mark stops the script with a message naming it; `--check-marks` only patches every
kernel's module (and compiles it as Python) and lists the marks.
"""
from __future__ import annotations

import importlib.util
import inspect
import linecache
import re
import statistics
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epcomm.testing.launch import run_local_ranks
from gpu_tune import example_data, shape_parser


@dataclass(frozen=True)
class Target:
    """A traceable kernel: `kernel` of `epcomm.kernels.<module>`, its marks in the order the
    kernel reaches them."""

    module: str
    kernel: str
    marks: tuple[str, ...]


TARGETS = {
    "dispatch": Target("dispatch", "dispatch_kernel", (
        "send-start",              # the program's chunk of tokens is known
        "send-all-counted",        # one-block path: every token's destinations counted
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
        "receive-layout",          # one-block path: every expert's pairs, its first rows
        "receive-rows-placed",     # one-block path: rows, metadata and expand rows written
        "receive-done",            # payload copied to expand rows, output tails cleared
    )),
    "combine": Target("combine", "combine_kernel", (
        "combine-start",           # the call number taken
        "combine-peers-freed",     # every source has reduced the previous call's records
        "combine-rows-returned",   # this program's rows written into the sources' staging
        "combine-ready",           # every peer's rows of this call arrived, stamps checked
        "combine-reduced",         # this program's tokens summed and written
        "combine-done",            # every peer's free counter raised
    )),
    "ll-send": Target("low_latency", "ll_dispatch_send", (
        "ll-send-start",           # bases; the token's ids, the routing table or the row part
        "ll-send-freed",           # every destination has freed the slot's previous use
        "ll-send-slots",           # the token's experts, first slots and ranks
        "ll-send-records",         # routing program: records, positions, row counts written
        "ll-send-payload",         # this part of the row cast and stored at each destination
        "ll-send-arrived",         # the arrival counted at every destination
    )),
    "ll-local": Target("low_latency", "ll_dispatch_local", (
        "ll-local-start",          # the program's role: a token part, or a count of experts
        "ll-local-table",          # the routing table loaded, dead ids -1
        "ll-local-slots",          # token part: ids, row part, first slots and positions
        "ll-local-cast",           # token part: the part cast to FP8
        "ll-local-stored",         # token part: stored into each of its expert rows
        "ll-local-done",           # every program: its part or its experts' counts written
    )),
    "ll-recv": Target("low_latency", "ll_dispatch_recv", (
        "ll-recv-start",           # the program's source, token slot and part
        "ll-recv-arrived",         # every source's arrivals of this call counted
        "ll-recv-counts",          # counts, record and row part loaded; counts' prefix
        "ll-recv-copied",          # this part copied into each of the token's expert rows
        "ll-recv-done",            # counted done (the last program frees the slot)
    )),
    "ll-combine-send": Target("low_latency", "ll_combine_send", (
        "ll-combine-send-start",   # the program's expert, source and part
        "ll-combine-send-freed",   # the source has freed the slot's previous use
        "ll-combine-send-copied",  # this part of the (expert, source) rows in the source's heap
        "ll-combine-send-arrived",  # the arrival counted at the source
    )),
    "ll-reduce": Target("low_latency", "ll_combine_reduce", (
        "ll-reduce-start",         # the program's token slot and part
        "ll-reduce-arrived",       # every owner's rows of this call arrived
        "ll-reduce-summed",        # this part of the token's output written
        "ll-reduce-done",          # counted done (the last program frees the slot)
    )),
}
MARK = re.compile(r"^(?P<indent>[ \t]*)# phase-mark: (?P<name>\S+)[ \t]*$")
SLOTS = 16  # trace slots per program, at least the marks of any kernel
assert all(len(target.marks) <= SLOTS for target in TARGETS.values())
TRACE_PROGRAMS = 1 << 16  # programs a trace has room for (the low-latency grids are large)

STAMP = '''
from .sync import _globaltimer


@triton.jit
def _stamp(i):
    tl.debug_barrier()
    at = tl.full([], TRACE_ADDR, tl.int64) + (tl.program_id(0) * TRACE_SLOTS + i) * 8
    tl.store(at.to(tl.pointer_type(tl.int64)), _globaltimer())
'''


class MarkError(ValueError):
    """A kernel module's phase marks do not match its kernels' in `TARGETS`."""


def find_marks(source: str, target: Target) -> dict[str, int]:
    """Each `# phase-mark: <name>` line of `source` (the text of `target`'s module): name ->
    line index. Raises `MarkError` naming a mark that is not one of the module's kernels', is
    repeated, or is one of `target`'s and missing or out of order."""
    known = {name for other in TARGETS.values() if other.module == target.module
             for name in other.marks}
    found: dict[str, int] = {}
    for at, line in enumerate(source.splitlines()):
        if not line.lstrip().startswith("# phase-mark"):
            continue
        match = MARK.match(line)
        if match is None:
            raise MarkError(f"line {at + 1} starts like a phase mark but is not "
                            f"'# phase-mark: <name>' alone on its line: {line.strip()!r}")
        name = match["name"]
        if name not in known:
            raise MarkError(f"unknown phase mark {name!r} at line {at + 1}: add it to a "
                            f"kernel's marks in scripts/gpu_phases.py TARGETS or remove it")
        if name in found:
            raise MarkError(f"phase mark {name!r} appears twice (lines {found[name] + 1} and "
                            f"{at + 1})")
        found[name] = at
    missing = [name for name in target.marks if name not in found]
    if missing:
        raise MarkError(f"phase mark(s) missing from {target.kernel}: "
                        f"{', '.join(repr(name) for name in missing)} (expected lines "
                        f"'# phase-mark: <name>' in src/epcomm/kernels/{target.module}.py)")
    for earlier, later in zip(target.marks, target.marks[1:]):
        if found[later] < found[earlier]:
            raise MarkError(f"phase mark {later!r} (line {found[later] + 1}) comes before "
                            f"{earlier!r} (line {found[earlier] + 1}): TARGETS in "
                            f"scripts/gpu_phases.py lists them in the order the kernel runs them")
    return {name: found[name] for name in target.marks}


def traced_source(source: str, target: Target, trace_addr: int) -> str:
    """`source` (the text of `target`'s module) with each of `target`'s mark lines replaced by
    `_stamp(i)` (i: the mark's index in its marks), plus `_stamp` and its constants."""
    marks = find_marks(source, target)
    lines = source.splitlines()
    for i, name in enumerate(target.marks):
        at = marks[name]
        lines[at] = f"{MARK.match(lines[at])['indent']}_stamp({i})"
    return "\n".join(lines) + "\n" + STAMP + f"\nTRACE_ADDR = tl.constexpr({trace_addr})\n" \
        f"TRACE_SLOTS = tl.constexpr({SLOTS})\n"


def _module_source(target: Target) -> tuple[str, object]:
    module = importlib.import_module(f"epcomm.kernels.{target.module}")
    return inspect.getsource(module), module


def traced_module(target: Target, trace: torch.Tensor):
    """`target`'s module with `_stamp(i)` at each of its kernel's marks, loaded as a sibling
    module."""
    source, product = _module_source(target)
    source = traced_source(source, target, trace.data_ptr())
    name = f"epcomm.kernels._traced_{target.module}"
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = product.__file__.replace(f"{target.module}.py",
                                               f"_traced_{target.module}.py")
    sys.modules[name] = module
    # Triton reads a jit function's source through inspect: give it the traced text.
    linecache.cache[module.__file__] = (len(source), None, source.splitlines(True),
                                        module.__file__)
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def check_marks() -> str:
    """Patch each kernel's module as a traced run would (no GPU, nothing launched) and compile
    the result as Python; a line per mark found."""
    lines = []
    for key, target in TARGETS.items():
        source, module = _module_source(target)
        marks = find_marks(source, target)
        compile(traced_source(source, target, 0), module.__file__, "exec")
        lines += [f"{key}: {len(marks)} phase marks of {target.kernel} found in "
                  f"{module.__file__}, traced source compiles:"]
        lines += [f"  {i:2d} {name} (line {marks[name] + 1})"
                  for i, name in enumerate(target.marks)]
    return "\n".join(lines)


def _calls(key: str, tokens, hidden, topk, experts, expand, num_sms, device):
    """(label, warm-up call, traced call, buffer) of `key`'s kernel, whose traced copy is
    already patched in."""
    x, idx, w = example_data(tokens, hidden, topk, experts, device)
    if key in ("dispatch", "combine"):
        from epcomm import Buffer
        buffer = Buffer(dist.group.WORLD, tokens, hidden, topk, backend="symmetric",
                        num_sms=num_sms)

        def dispatch():
            return buffer.dispatch(x, idx, w, num_experts=experts, do_cpu_sync=False,
                                   do_expand=expand)

        def both():
            out = dispatch()
            buffer.combine(out[0], out[3], topk_weights=out[2])

        label = (f"{key} {'expand' if expand else 'compact'}, {buffer.num_sms} programs; "
                 f"event time of the traced dispatch{' + combine' if key == 'combine' else ''}")
        return label, both, dispatch if key == "dispatch" else both, buffer
    from epcomm.bench_paths import low_latency_pair
    buffer, M, dispatch, combine = low_latency_pair(x, idx, w, experts,
                                                    explicitly_destroy=True)

    def pair():
        dispatch()
        combine()

    label = (f"low-latency {TARGETS[key].kernel} (FP8 dispatch, M = {M}); event time of the "
             f"traced dispatch + combine")
    return label, pair, pair, buffer


def phases(key: str, tokens, hidden, topk, experts, expand, num_sms):
    """Five traced calls of `key`'s kernel after a warm-up call each: (label, [(the trace of
    each program that ran, [programs, marks] ns), event us)])."""
    target = TARGETS[key]
    device = torch.device("cuda", torch.cuda.current_device())
    trace = torch.zeros(TRACE_PROGRAMS * SLOTS, dtype=torch.int64, device=device)
    module = importlib.import_module(f"epcomm.kernels.{target.module}")
    traced = getattr(traced_module(target, trace), target.kernel)
    setattr(module, target.kernel, traced)
    if target.module == "low_latency":  # (the host module imported the kernels by name)
        from epcomm import low_latency
        setattr(low_latency, target.kernel, traced)
    label, warm, call, buffer = _calls(key, tokens, hidden, topk, experts, expand, num_sms,
                                       device)
    results = []
    for _ in range(5):
        warm()
        torch.cuda.synchronize()
        trace.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        rows = trace.view(TRACE_PROGRAMS, SLOTS)[:, :len(target.marks)]
        if not bool((rows[:, 0] != 0).any()):
            raise RuntimeError(f"{target.kernel} did not run: at EP=1 the low-latency dispatch "
                               "is ll_dispatch_local alone and a combine received right away "
                               "ll_combine_reduce alone")
        results.append((rows[rows[:, 0] != 0].tolist(), start.elapsed_time(end) * 1e3))
    buffer.destroy()
    return label, results


def main():
    parser = shape_parser()
    parser.add_argument("--kernel", choices=sorted(TARGETS), default="dispatch")
    parser.add_argument("--expand", action="store_true",
                        help="dispatch, combine: the expand layout")
    parser.add_argument("--num-sms", type=int, default=None,
                        help="dispatch, combine: programs (default: the backend's)")
    parser.add_argument("--check-marks", action="store_true",
                        help="only check that every kernel's module has its phase marks")
    args = parser.parse_args()
    try:
        print(check_marks())
    except MarkError as error:
        sys.exit(f"gpu_phases.py: {error}")
    if args.check_marks:
        return
    label, results = run_local_ranks(phases, 1, args.kernel, args.tokens, args.hidden,
                                     args.topk, args.experts, args.expand, args.num_sms,
                                     timeout_s=600)[0]
    trace, elapsed = results[len(results) // 2]
    trace = torch.tensor(trace)
    zero = trace[:, 0].min()
    since = (trace - zero).double() / 1e3  # us
    print(f"\nEP=1 {label}, {args.tokens} x {args.hidden} bf16, top-{args.topk}, "
          f"{trace.shape[0]} programs traced; {elapsed:.1f} us (runs: "
          f"{', '.join(f'{e:.1f}' for _, e in results)})")
    print("| mark | earliest us | median us | latest us | median phase us |\n"
          "|---|---:|---:|---:|---:|")
    for i, mark in enumerate(TARGETS[args.kernel].marks):
        # (programs that do not pass a mark, such as ll_dispatch_local's counting ones or
        # the dispatch's on the path it does not take, have no time there and are left out of
        # its row; a phase runs from the latest mark the program passed before)
        passed = trace[:, i] != 0
        if not bool(passed.any()):
            continue
        column = since[passed, i].tolist()
        earlier = torch.where(trace[:, :i] != 0, since[:, :i], float("-inf"))
        phase = (since[passed, i] - earlier[passed].max(1).values).tolist() if i else column
        print(f"| {mark} | {min(column):.1f} | {statistics.median(column):.1f} | "
              f"{max(column):.1f} | {statistics.median(phase):.1f} |")


if __name__ == "__main__":
    main()
