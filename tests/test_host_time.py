"""`scripts/host_time.py`: the table a measuring process prints and the A/B reads back, the
paired yardstick maths, and the A/B's medians (CPU only: nothing here launches or times a
kernel)."""
import importlib.util
import statistics
from pathlib import Path

import pytest

pytest.importorskip("triton")  # host_time.py defines its yardstick kernel on import
_SPEC = importlib.util.spec_from_file_location(
    "host_time", Path(__file__).resolve().parents[1] / "scripts" / "host_time.py")
host_time = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(host_time)
Figure = host_time.Figure

# What one measuring process prints on the GPU machine, with a Triton warning in the middle.
LOG = """\
epcomm: /work/ab/old/src/epcomm/__init__.py
torch 2.9.0+cu128, triton 3.5.0, NVIDIA H200
4096 tokens: backend symmetric, num_sms 132
/usr/lib/python3/dist-packages/triton/runtime/jit.py:123: UserWarning: something | with | bars
128 tokens: backend symmetric, num_sms 8

Host time per call, timed in pairs with the yardstick (40 rounds, medians):
| tokens | call | GPU before each call | call us | yardstick us | multiple |
|---|---|---|---|---|---|
| 4096 | dispatch | back to back | 29.8 | 22.4 | 1.331 |
| 4096 | dispatch | idle | 34.1 | 23.0 | 1.498 |
| 4096 | combine | back to back | 24.2 | 22.1 | 1.090 |
| 4096 | combine | idle | 28.7 | 22.9 | 1.254 |
| 128 | dispatch | back to back | 27.5 | 22.0 | 1.250 |
| 128 | dispatch | idle | 31.9 | 22.6 | 1.412 |
| 128 | combine | back to back | 22.8 | 21.9 | 1.041 |
| 128 | combine | idle | 27.0 | 22.5 | 1.200 |
"""


def test_parse_figures_reads_every_row_of_a_log():
    figures = host_time.parse_figures(LOG)
    assert len(figures) == 8
    assert figures[4096, "dispatch", "back to back"] == Figure(29.8, 22.4, 1.331)
    assert figures[128, "combine", "idle"] == Figure(27.0, 22.5, 1.2)
    assert host_time.imported_from(LOG) == "/work/ab/old/src/epcomm/__init__.py"


def test_parse_figures_round_trips_format_figures():
    figures = {(4096, "combine", "idle"): Figure(28.66, 22.94, 1.2541),
               (128, "dispatch", "back to back"): Figure(27.5, 22.0, 1.25),
               (4096, "dispatch", "back to back"): Figure(29.8, 22.4, 1.331)}
    text = host_time.format_figures(figures, 40)
    got = host_time.parse_figures("noise | a | b\n" + text)
    assert got == {key: Figure(round(f.call_us, 1), round(f.yardstick_us, 1),
                               round(f.multiple, 3)) for key, f in figures.items()}
    assert list(got) == [(4096, "dispatch", "back to back"), (4096, "combine", "idle"),
                         (128, "dispatch", "back to back")]  # most tokens first, dispatch first


def test_parse_figures_rejects_a_log_without_the_table_or_with_a_row_twice():
    with pytest.raises(ValueError, match="no host-time table"):
        host_time.parse_figures(LOG.split("\nHost time")[0])
    row = "| 128 | combine | idle | 27.0 | 22.5 | 1.200 |\n"
    with pytest.raises(ValueError, match="two rows"):
        host_time.parse_figures(LOG + row)
    with pytest.raises(ValueError, match="epcomm: PATH"):
        host_time.imported_from(LOG.split("\n", 1)[1])


def _fake(steps, clock, calls):
    """A callable that advances `clock` by `steps[0]`, `steps[1]`, `steps[0]`, ... units."""
    def call():
        clock[0] += steps[len(calls) % len(steps)]
        calls.append(1)
    return call


@pytest.mark.parametrize("idle, syncs", [(True, 2 * 4 + 1), (False, 1)])
def test_paired_divides_the_call_by_the_yardstick_of_its_own_round(idle, syncs):
    """The call alternates 3 and 5 units, the yardstick 1 and 2, one warm-up call each: the
    timed rounds are (yardstick 2, call 5), (1, 3), (2, 5), (1, 3), so the multiple is the
    median of 2.5, 3, 2.5, 3 = 2.75, not median call / median yardstick (4 / 1.5); with
    `idle` a sync before each timed call, plus one at the end either way."""
    clock, synced = [0.0], []
    got = host_time.paired(_fake((3.0, 5.0), clock, []), _fake((1.0, 2.0), clock, []),
                           iters=4, idle=idle, sync=lambda: synced.append(1),
                           clock=lambda: clock[0])
    assert got == Figure(call_us=4e6, yardstick_us=1.5e6, multiple=2.75)
    assert len(synced) == syncs


def test_paired_follows_a_host_that_slows_down_mid_process():
    """The host gets 3x slower half-way: every round still gives the call's true multiple."""
    clock, rounds = [0.0], []

    def slow():
        return 3.0 if len(rounds) > 10 else 1.0

    def yardstick():
        clock[0] += 2.0 * slow()

    def call():
        clock[0] += 5.0 * slow()
        rounds.append(1)

    got = host_time.paired(call, yardstick, iters=20, idle=False, sync=lambda: None,
                           clock=lambda: clock[0])
    assert got.multiple == pytest.approx(2.5)


def _run(scale):
    return {(4096, "dispatch", "back to back"): Figure(30 * scale, 20 * scale, 1.5 * scale),
            (4096, "combine", "idle"): Figure(25 * scale, 20 * scale, 1.25 * scale)}


def test_medians_and_summary_per_tree():
    runs = {"A": [_run(1.0), _run(1.2), _run(0.9)], "B": [_run(0.8), _run(0.8)]}
    got = host_time.medians(runs["A"])
    assert got[4096, "dispatch", "back to back"] == (1.5, 30.0)
    assert got[4096, "combine", "idle"] == (statistics.median([1.25, 1.5, 1.125]), 25.0)
    text = host_time.summary({"A": "/x/old", "B": "/x/new"}, runs)
    assert "A = /x/old: medians over 3 process(es)" in text
    assert "B = /x/new: medians over 2 process(es)" in text
    assert "| figure | A | B | B/A |" in text
    assert "| 4096 dispatch b2b | 1.500 | 1.200 | 0.800 |" in text
    assert "| 4096 combine idle | 1.250 | 1.000 | 0.800 |" in text


def test_medians_keep_only_figures_every_process_has():
    partial = {(4096, "dispatch", "back to back"): Figure(30, 20, 1.5)}
    assert list(host_time.medians([_run(1.0), partial])) == [(4096, "dispatch", "back to back")]
