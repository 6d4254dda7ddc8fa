"""A/B of the host time per call of two or more trees on the GPU machine, alternated.

    python3 scripts/gpu_host_ab.py REV_A REV_B [REV_C ...] [--rounds 3]

The GPU machine's host is noisy (session 8: the same `torch.empty` took 2.6-5.4 us in one
morning, and back-to-back runs of one tree differed by 1.7x), so a figure is only comparable to
one from the same process. Each tree (a git revision, whose `src` and `scripts` are archived,
or a directory such as `.` for the working tree) runs `scripts/gpu_tune.py --host --no-tiles`
in its own process, trees alternated `rounds` times. Printed per process: the sync-free
dispatch and combine host time (median us, GPU idle before each call, and back to back) and
each as a multiple of the same process's yardstick (an empty 26-argument Triton launch: where
the tree's `gpu_tune.py` prints it, the multiple timed in pairs, yardstick then call in every
round, else the ratio of the two medians); then the median multiple per tree, and what it comes
to at a reference yardstick (session 7's 22.3 us).

The device tool copies the working tree without its git history: there, pass directories,
made here beforehand (`mkdir ab_x && git archive REV src scripts | tar -x -C ab_x`, untracked).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

# Row labels of `gpu_tune.py --host`'s first table -> short names.
ROWS = {"empty Triton launch, 26 arguments": "yardstick",
        "Buffer.dispatch (compact, sync-free)": "dispatch idle",
        "Buffer.dispatch, back to back": "dispatch b2b",
        "Buffer.combine": "combine idle",
        "Buffer.combine, back to back": "combine b2b"}
# Row labels of its table of multiples timed in pairs (each round times the yardstick, then the
# call: robust to the host's drift within a process), from session 9 on -> "paired " + name.
PAIRED_ROWS = {"dispatch idle": "dispatch idle", "dispatch back to back": "dispatch b2b",
               "combine idle": "combine idle", "combine back to back": "combine b2b"}
REFERENCE_YARDSTICK_US = 22.3  # session 7's, the host speed the 40 us goal was judged at


def parse_host_table(text: str) -> dict[str, float]:
    """The `ROWS` figures of a `gpu_tune.py --host` log (the first two-cell row of each label:
    later tables reuse labels with more cells), and the `PAIRED_ROWS` multiples where the log
    has them (as "paired dispatch idle", ...)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 2:
            continue
        name = ROWS.get(cells[0]) or ("paired " + PAIRED_ROWS[cells[0]]
                                      if cells[0] in PAIRED_ROWS else None)
        if name is not None and name not in found:
            found[name] = float(cells[1])
    missing = set(ROWS.values()) - set(found)
    if missing:
        raise ValueError(f"no {sorted(missing)} in the host table")
    return found


def multiple(figures: dict[str, float], name: str) -> float:
    """`name`'s host time as a multiple of the yardstick: the paired figure where the log has
    one, else the call's median over the yardstick's median."""
    return figures.get("paired " + name, figures[name] / figures["yardstick"])


def _tree(spec: str, workdir: Path) -> Path:
    """A directory holding `src` and `scripts` of `spec` (a directory, or a git revision)."""
    if Path(spec, "src").is_dir():
        return Path(spec).resolve()
    tree = workdir / spec.replace("/", "_")
    tree.mkdir()
    archive = subprocess.run(["git", "archive", spec, "src", "scripts"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _run(tree: Path, log: Optional[Path]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "src"), str(tree / "scripts")]))
    run = subprocess.run([sys.executable, str(tree / "scripts" / "gpu_tune.py"), "--host",
                          "--no-tiles"], env=env, capture_output=True, text=True, timeout=300)
    if log is not None:
        log.write_text(run.stdout + run.stderr)
    if run.returncode:
        raise RuntimeError(f"{tree}: gpu_tune.py failed\n{run.stdout[-2000:]}{run.stderr[-3000:]}")
    return parse_host_table(run.stdout)


def _summary(figures: dict[str, list[dict[str, float]]], names: list[str], title: str,
             multiple_of) -> str:
    """Per tree, the median over its processes of `multiple_of(figures, name)` for each name,
    and what it comes to at the reference yardstick."""
    lines = [f"\n{title} (us at a {REFERENCE_YARDSTICK_US} us yardstick):",
             "| tree | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]
    for spec, runs in figures.items():
        medians = [statistics.median(multiple_of(r, n) for r in runs) for n in names]
        lines.append(f"| {spec} | " + " | ".join(f"{m:.2f} ({m * REFERENCE_YARDSTICK_US:.1f})"
                                                 for m in medians) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", nargs="+", help="two or more git revisions or directories")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--logs", type=Path, default=None,
                        help="write each process's gpu_tune.py output here")
    args = parser.parse_args()
    if len(args.trees) < 2:
        parser.error("give at least two trees to compare")
    figures: dict[str, list[dict[str, float]]] = {spec: [] for spec in args.trees}
    names = [name for name in ROWS.values() if name != "yardstick"]
    print("| round | tree | yardstick us | " + " | ".join(f"{n} us (x)" for n in names) + " |")
    print("|---" * (3 + len(names)) + "|")
    with tempfile.TemporaryDirectory() as workdir:
        trees = {spec: _tree(spec, Path(workdir)) for spec in args.trees}
        for round_ in range(1, args.rounds + 1):
            for spec, tree in trees.items():
                log = None if args.logs is None else \
                    args.logs / f"host_ab_{round_}_{spec.strip('./').replace('/', '_') or 'here'}.log"
                got = _run(tree, log)
                figures[spec].append(got)
                cells = " | ".join(f"{got[n]:.1f} ({multiple(got, n):.2f})" for n in names)
                print(f"| {round_} | {spec} | {got['yardstick']:.1f} | {cells} |", flush=True)
    print(_summary(figures, names, "Median multiple of the yardstick per tree (paired where "
                   "the tree's gpu_tune.py times pairs)", multiple))
    print(_summary(figures, names, "The same as the ratio of the two medians (each timed in "
                   "its own block of calls)", lambda got, name: got[name] / got["yardstick"]))


if __name__ == "__main__":
    main()
