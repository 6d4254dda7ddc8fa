"""Host time of a sync-free dispatch and combine, and an A/B of two source trees (GPU machine).

    PYTHONPATH=src python3 scripts/host_time.py [--tokens 4096 128] [--iters 40]
    python3 scripts/host_time.py TREE_A TREE_B [TREE_C ...] [--rounds 3] [--iters 40]
                                 [--tokens 4096 128] [--logs DIR]

Without trees: one process on the current GPU (a one-rank gloo group, so EP=1) makes a
symmetric `Buffer` per token count (4096 and 128 by default; hidden 7168, top-8, 256 experts,
bf16) and times the host side of `buffer.dispatch(..., do_cpu_sync=False)` (compact layout) and
of `buffer.combine` of its output: back to back (the host never waits for the GPU, as in a
loop) and with the GPU idle before each call (`torch.cuda.synchronize()` first). Each figure is
timed in pairs against a yardstick, an empty Triton launch of 26 arguments (`empty_launch`):
every round times the yardstick, then the call, right after each other, so both see the same
host speed. The host of the GPU machine is noisy (its speed drifts within a process and
differs between processes by up to 2x), so the multiple (the median over rounds of call time /
yardstick time) is what compares across processes; the microseconds are medians too. One
table, a row per (tokens, call, GPU state).

With two or more trees (directories holding `src/epcomm`, such as a copy of another revision
made beforehand: `mkdir old && git archive REV src | tar -x -C old`): each round runs this
script once per tree, in alternating subprocesses with `PYTHONPATH=TREE/src` (the measurement
code is this file's, the library the tree's: it uses only the public `Buffer` API), prints a
row of multiples per process, then per tree the median multiple and microseconds over its
processes, last a short table of the median multiples with each tree's ratio to the first.
`--logs DIR` keeps each process's output.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch
import triton
import triton.language as tl

HIDDEN, TOPK, EXPERTS = 7168, 8, 256
CALLS = ("dispatch", "combine")
MODES = ("back to back", "idle")  # the GPU's state before each timed call
YARDSTICK_GRID = 132  # the programs of the empty launch (its host cost does not depend on it)


class Figure(NamedTuple):
    """A call's host time, timed in pairs with the yardstick: medians over the rounds."""
    call_us: float
    yardstick_us: float
    multiple: float  # the median of the per-round ratios, not call_us / yardstick_us


Key = tuple[int, str, str]  # (tokens, call, mode)


# -- timing -------------------------------------------------------------------------------------

def paired(call: Callable[[], object], yardstick: Callable[[], object], iters: int = 40,
           idle: bool = True, sync: Optional[Callable[[], object]] = None,
           clock: Callable[[], float] = time.perf_counter, warmup: int = 1) -> Figure:
    """`call`'s host time against `yardstick`'s over `iters` rounds, each timing the yardstick
    and then the call. `idle`: `sync()` (default `torch.cuda.synchronize`) before each timed
    call, so that the figure is the host's cost alone; otherwise calls follow each other with
    the GPU still busy. One `sync()` at the end either way."""
    sync = torch.cuda.synchronize if sync is None else sync
    for _ in range(warmup):
        yardstick()
        call()
    calls, yardsticks, ratios = [], [], []
    for _ in range(iters):
        seconds = []
        for fn in (yardstick, call):
            if idle:
                sync()
            begin = clock()
            fn()
            seconds.append(clock() - begin)
        yardsticks.append(seconds[0])
        calls.append(seconds[1])
        ratios.append(seconds[1] / seconds[0])
    sync()
    return Figure(statistics.median(calls) * 1e6, statistics.median(yardsticks) * 1e6,
                  statistics.median(ratios))


def median_host_us(fn: Callable[[], object], iters: int = 20, warmup: int = 1,
                   idle: bool = True) -> float:
    """Median microseconds for `fn()` to return on its own (no yardstick), after `warmup`
    untimed calls; `idle` as in `paired`."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if idle:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - begin)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


@triton.jit
def empty_kernel(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, b0, b1, b2, b3, b4, b5, b6, b7, b8,
                 b9, c0, c1, c2, c3, c4, c5, K: tl.constexpr, R: tl.constexpr):
    pass


def empty_launch(device: torch.device) -> Callable[[], object]:
    """The yardstick: Triton's launch of an empty kernel with 14 tensor and 12 int arguments
    and 2 constants."""
    tensors = [torch.empty(16, device=device) for _ in range(14)]
    ints = list(range(1, 13))
    return lambda: empty_kernel[(YARDSTICK_GRID,)](*tensors, *ints, K=8, R=1)


def example_data(tokens: int, device: torch.device):
    """x [T, H] bf16, topk_idx [T, K] (distinct experts per token), weights [T, K] float32."""
    gen = torch.Generator(device="cpu").manual_seed(5)
    x = torch.randn(tokens, HIDDEN, generator=gen).bfloat16()
    idx = torch.rand(tokens, EXPERTS, generator=gen).argsort(dim=1)[:, :TOPK]
    weights = torch.rand(tokens, TOPK, generator=gen)
    return x.to(device), idx.to(device), weights.to(device)


def measure(token_counts: list[int], iters: int) -> None:
    """Print the table of `Figure`s of this process (see the module docstring)."""
    import torch.distributed as dist

    import epcomm

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    print(f"epcomm: {epcomm.__file__}")
    print(f"torch {torch.__version__}, triton {triton.__version__}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yardstick = empty_launch(device)
    figures: dict[Key, Figure] = {}
    try:
        for tokens in token_counts:
            buffer = epcomm.Buffer(dist.group.WORLD, tokens, HIDDEN, TOPK, backend="symmetric")
            if buffer.backend != "symmetric":
                raise RuntimeError(f"asked for the symmetric backend, got {buffer.backend}")
            print(f"{tokens} tokens: backend {buffer.backend}, num_sms {buffer.num_sms}",
                  flush=True)
            x, idx, weights = example_data(tokens, device)
            state = {}

            def dispatch():
                state["out"] = buffer.dispatch(x, idx, weights, num_experts=EXPERTS,
                                               do_cpu_sync=False, do_expand=False)

            def combine():
                out = state["out"]
                buffer.combine(out[0], out[3], topk_weights=out[2])

            for _ in range(3):
                dispatch()
                combine()
            torch.cuda.synchronize()
            for mode in MODES:  # (dispatch and combine back to back first, then idle)
                for name, call in (("dispatch", dispatch), ("combine", combine)):
                    figures[tokens, name, mode] = paired(call, yardstick, iters,
                                                         idle=mode == "idle")
            torch.cuda.synchronize()
            buffer.destroy()
    finally:
        dist.destroy_process_group()
    print(format_figures(figures, iters))


def format_figures(figures: dict[Key, Figure], iters: int) -> str:
    """The table `parse_figures` reads."""
    lines = [f"\nHost time per call, timed in pairs with the yardstick ({iters} rounds, medians):",
             "| tokens | call | GPU before each call | call us | yardstick us | multiple |",
             "|---|---|---|---|---|---|"]
    for (tokens, call, mode), figure in sorted(figures.items(), key=lambda item: _order(item[0])):
        lines.append(f"| {tokens} | {call} | {mode} | {figure.call_us:.1f} | "
                     f"{figure.yardstick_us:.1f} | {figure.multiple:.3f} |")
    return "\n".join(lines)


def _order(key: Key) -> tuple:
    """Rows by tokens (most first), then call and GPU state in `CALLS` and `MODES` order."""
    tokens, call, mode = key
    return -tokens, CALLS.index(call), MODES.index(mode)


# -- reading a process's output, and the A/B --------------------------------------------------

def parse_figures(text: str) -> dict[Key, Figure]:
    """The rows of `format_figures`' table in `text` (other lines are skipped)."""
    found: dict[Key, Figure] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 6 or not cells[0].isdigit() or cells[1] not in CALLS \
                or cells[2] not in MODES:
            continue
        key = (int(cells[0]), cells[1], cells[2])
        if key in found:
            raise ValueError(f"two rows for {key}")
        found[key] = Figure(*map(float, cells[3:]))
    if not found:
        raise ValueError("no host-time table in the output")
    return found


def imported_from(text: str) -> str:
    """The `epcomm: PATH` line of a process's output: where it imported the library from."""
    for line in text.splitlines():
        if line.startswith("epcomm: "):
            return line[len("epcomm: "):].strip()
    raise ValueError("no 'epcomm: PATH' line in the output")


def key_name(key: Key) -> str:
    tokens, call, mode = key
    return f"{tokens} {call} {'b2b' if mode == 'back to back' else mode}"


def medians(runs: list[dict[Key, Figure]]) -> dict[Key, tuple[float, float]]:
    """Per key present in every run: (median multiple, median call us) over the runs."""
    keys = [key for key in runs[0] if all(key in run for run in runs)]
    return {key: (statistics.median(run[key].multiple for run in runs),
                  statistics.median(run[key].call_us for run in runs)) for key in keys}


def summary(trees: dict[str, str], runs: dict[str, list[dict[Key, Figure]]]) -> str:
    """Per tree (label -> path) the median multiple and us of each figure over its processes,
    then a table of the multiples with each tree's ratio to the first tree."""
    per_tree = {label: medians(runs[label]) for label in trees}
    lines = []
    for label, path in trees.items():
        lines.append(f"\n{label} = {path}: medians over {len(runs[label])} process(es)")
        for key, (multiple, call_us) in per_tree[label].items():
            lines.append(f"  {key_name(key):<22} {multiple:6.3f} x yardstick  {call_us:7.1f} us")
    labels = list(trees)
    first = labels[0]
    keys = [key for key in per_tree[first] if all(key in per_tree[label] for label in labels)]
    lines += ["\nMedian multiple of the yardstick:",
              "| figure | " + " | ".join(labels) + " | "
              + " | ".join(f"{label}/{first}" for label in labels[1:]) + " |",
              "|---" * (2 * len(labels)) + "|"]
    for key in keys:
        multiples = [per_tree[label][key][0] for label in labels]
        lines.append(f"| {key_name(key)} | " + " | ".join(f"{m:.3f}" for m in multiples) + " | "
                     + " | ".join(f"{m / multiples[0]:.3f}" for m in multiples[1:]) + " |")
    return "\n".join(lines)


def check_tree(path: str) -> Path:
    tree = Path(path).resolve()
    if not (tree / "src" / "epcomm" / "__init__.py").is_file():
        raise SystemExit(f"host_time.py: {path} holds no src/epcomm/__init__.py")
    return tree


def run_tree(tree: Path, token_counts: list[int], iters: int, timeout_s: float) -> str:
    """This script's measurement in a new process against `tree`'s library; its output."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    command = [sys.executable, str(Path(__file__).resolve()), "--iters", str(iters),
               "--tokens", *map(str, token_counts)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    text = run.stdout + run.stderr
    if run.returncode:
        raise RuntimeError(f"{tree}: the measurement failed (exit {run.returncode})\n"
                           f"{run.stdout[-2000:]}{run.stderr[-4000:]}")
    source = Path(imported_from(text)).resolve()
    if (tree / "src") not in source.parents:
        raise RuntimeError(f"{tree}: the process imported epcomm from {source}, not from the "
                           f"tree (is another copy installed ahead of PYTHONPATH?)")
    return text


def ab(paths: list[str], rounds: int, token_counts: list[int], iters: int,
       logs: Optional[Path], timeout_s: float) -> None:
    trees = {chr(ord("A") + i): str(check_tree(path)) for i, path in enumerate(paths)}
    runs: dict[str, list[dict[Key, Figure]]] = {label: [] for label in trees}
    for label, path in trees.items():
        print(f"{label} = {path}")
    header = None
    for round_ in range(1, rounds + 1):
        for label, path in trees.items():
            text = run_tree(Path(path), token_counts, iters, timeout_s)
            if logs is not None:
                logs.mkdir(parents=True, exist_ok=True)
                (logs / f"host_time_{round_}_{label}.log").write_text(text)
            figures = parse_figures(text)
            runs[label].append(figures)
            if header is None:
                header = list(figures)
                print("\nMultiple of the yardstick per process (yardstick: median us of the "
                      "first figure's rounds):")
                print("| round | tree | yardstick us | " + " | ".join(map(key_name, header))
                      + " |\n" + "|---" * (3 + len(header)) + "|")
            print(f"| {round_} | {label} | {figures[header[0]].yardstick_us:.1f} | "
                  + " | ".join(f"{figures[key].multiple:.3f}" if key in figures else "-"
                               for key in header) + " |", flush=True)
    print(summary(trees, runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*",
                        help="two or more directories holding src/epcomm to compare; none: "
                             "measure the epcomm on the path, in this process")
    parser.add_argument("--rounds", type=int, default=3, help="processes per tree (A/B)")
    parser.add_argument("--iters", type=int, default=40, help="timed pairs per figure")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 128])
    parser.add_argument("--logs", type=Path, default=None,
                        help="A/B: write each process's output into this folder")
    parser.add_argument("--timeout", type=float, default=600,
                        help="A/B: seconds one process may take")
    args = parser.parse_args()
    if len(args.trees) == 1:
        parser.error("give two or more trees to compare, or none")
    if args.trees:
        ab(args.trees, args.rounds, args.tokens, args.iters, args.logs, args.timeout)
    else:
        measure(args.tokens, args.iters)


if __name__ == "__main__":
    main()
