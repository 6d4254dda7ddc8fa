"""`scripts/gpu_host_ab.py` reads the figures it compares from `gpu_tune.py --host`'s log."""
import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "gpu_host_ab", Path(__file__).resolve().parents[1] / "scripts" / "gpu_host_ab.py")
gpu_host_ab = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_host_ab)

# The head of a real log (H200 machine, session 8), then a later table reusing two labels.
LOG = """\
| host piece | median us |
|---|---|
| torch.empty 4096 x 7168 bf16 | 5.1 |
| with torch.cuda.stream(s): pass | 17.8 |
| empty Triton launch, 26 arguments | 26.1 |
| Buffer.dispatch (compact, sync-free) | 76.1 |
| Buffer.combine | 36.7 |
| Buffer.dispatch, back to back | 53.8 |
| Buffer.combine, back to back | 29.8 |

Inclusive host us per dispatch call (10 calls, GPU idle before each):
| piece (nested by indent) | us per call | calls per call |
|---|---|---|
| Buffer.dispatch | 80.7 | 1.0 |
| Buffer.combine | 52.1 | 1.0 |
"""


def test_parse_host_table_reads_the_first_table():
    assert gpu_host_ab.parse_host_table(LOG) == {
        "yardstick": 26.1, "dispatch idle": 76.1, "combine idle": 36.7, "dispatch b2b": 53.8,
        "combine b2b": 29.8}


def test_parse_host_table_names_missing_rows():
    with pytest.raises(ValueError, match="dispatch b2b"):
        gpu_host_ab.parse_host_table(LOG.replace("| Buffer.dispatch, back to back | 53.8 |", ""))


PAIRED = """
| call / yardstick, paired | multiple |
|---|---|
| dispatch idle | 1.80 |
| dispatch back to back | 1.45 |
| combine idle | 1.30 |
| combine back to back | 1.10 |
"""


def test_paired_multiples_are_used_where_the_log_has_them():
    old = gpu_host_ab.parse_host_table(LOG)
    new = gpu_host_ab.parse_host_table(LOG + PAIRED)
    assert new == {**old, "paired dispatch idle": 1.80, "paired dispatch b2b": 1.45,
                   "paired combine idle": 1.30, "paired combine b2b": 1.10}
    assert gpu_host_ab.multiple(new, "dispatch b2b") == 1.45
    assert gpu_host_ab.multiple(old, "dispatch b2b") == 53.8 / 26.1


def test_summary_gives_both_kinds_of_multiple():
    """Per tree, the median over processes of each call's multiple, paired where the log has
    it, and as the ratio of the two medians."""
    old = gpu_host_ab.parse_host_table(LOG)
    runs = {"a": [old, {**old, "yardstick": 2 * old["yardstick"]}, old],
            "b": [gpu_host_ab.parse_host_table(LOG + PAIRED)]}
    names = ["dispatch b2b"]
    paired = gpu_host_ab._summary(runs, names, "paired", gpu_host_ab.multiple)
    ratios = gpu_host_ab._summary(runs, names, "ratios",
                                  lambda got, name: got[name] / got["yardstick"])
    ratio = 53.8 / 26.1
    assert f"| a | {ratio:.2f} ({ratio * 22.3:.1f}) |" in paired
    assert "| b | 1.45 (32.3) |" in paired and f"| b | {ratio:.2f}" in ratios


def test_paired_multiple_divides_each_round(monkeypatch):
    """`host_timing.paired_multiple` on a fake clock: the call alternates 3 and 5 units, the
    yardstick 1 and 2 (warm-up included), so the rounds give 5/2 and 3/1, median 2.75; with
    `idle` a sync before each timed call (plus one at the end), without it only the last."""
    import types
    spec = importlib.util.spec_from_file_location(
        "host_timing", Path(__file__).resolve().parents[1] / "scripts" / "host_timing.py")
    host_timing = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_timing)
    for idle, syncs in ((True, 2 * 4 + 1), (False, 1)):
        clock, calls, synced = [0.0], {"fn": 0, "yardstick": 0}, []

        def advance(name, steps):
            def call():
                clock[0] += steps[calls[name] % 2]
                calls[name] += 1
            return call

        monkeypatch.setattr(host_timing, "time",
                            types.SimpleNamespace(perf_counter=lambda: clock[0]))
        got = host_timing.paired_multiple(advance("fn", (3.0, 5.0)),
                                          advance("yardstick", (1.0, 2.0)), iters=4, idle=idle,
                                          sync=lambda: synced.append(1))
        assert got == 2.75, (idle, got)
        assert len(synced) == syncs, (idle, len(synced))
