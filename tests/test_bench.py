"""`python -m epcomm bench` end to end: 2 local ranks, the small config, a few calls."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_bench_small_two_ranks(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "epcomm", "bench", "--ranks", "2", "--configs", "small",
           "--iters", "2", "--warmup", "1", "--json", str(out), "--timeout", "60",
           "--deadline", "120", "--paths", "--paths-tokens", "16"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "MISMATCH" not in proc.stdout, proc.stdout
    report = json.loads(out.read_text())
    rows = report["rows"]
    # 2 layouts x 2 dtypes x 2 sync modes
    assert len(rows) == 8
    assert {(r["layout"], r["dtype"], r["sync"]) for r in rows} == {
        (layout, dtype, sync) for layout in ("compact", "expand") for dtype in ("bf16", "fp8")
        for sync in (True, False)}
    assert report["machine"]["ranks"] == 2 and report["machine"]["torch"]
    assert report["backend_used"] and all(b in ("collective", "symmetric")
                                          for b in report["backend_used"])
    for row in rows:
        assert row["check"] == "ok", row
        assert row["tokens_per_rank"] == 64
        for key in ("dispatch", "combine", "a2a_dispatch", "a2a_dispatch_payload", "a2a_combine"):
            figure = row[key]
            assert figure["us"] > 0 and figure["host_us"] > 0, (key, row)
            assert figure["iters"] == 2
            assert all(t > 0 for t in figure["us_per_rank"]) and len(figure["us_per_rank"]) == 2
            assert figure["gbps"] > 0, (key, row)
        assert sum(row["recv_rows_per_rank"]) > 0
    # the printed table has one line per row
    assert len(re.findall(r"^\| small +\| ", proc.stdout, re.M)) == 2 * len(rows)  # 2 tables
    # The EP=1 paths (CPU: the collective backend over gloo) beside their baselines.
    paths = {(row["what"], row["layout"]): row for row in report["paths"]}
    for what in ("dispatch sync-free", "dispatch do_cpu_sync", "combine"):
        for layout in ("compact", "expand"):
            row = paths[(f"collective {what}", layout)]
            assert row["tokens"] == 16 and row["us"] > 0 and row["floor_us"] > 0, row
            assert row["host_us"] == row["us"], row  # (on CPU the host's time is the call's)
    assert {"copy x", "a2a x"} <= {what for what, _ in paths}
    assert paths[("copy x", "")]["host_us"] is None
    assert "| collective combine | 16 | expand |" in proc.stdout
    assert "| ratio | goal | host us |" in proc.stdout


def test_cli_help_and_import_has_no_side_effects():
    proc = subprocess.run([sys.executable, "-c", "import epcomm.__main__, epcomm.bench"],
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr
    proc = subprocess.run([sys.executable, "-m", "epcomm", "bench", "--help"], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--configs" in proc.stdout, proc.stderr


def test_bench_symmetric_backend_smoke(tmp_path):
    """The symmetric backend through the bench (on CPU: the Triton interpreter, so one case, 8
    tokens per rank)."""
    pytest.importorskip("triton")
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "epcomm", "bench", "--ranks", "2", "--configs", "small",
           "--backend", "symmetric", "--layouts", "expand", "--dtypes", "fp8", "--no-sync-free",
           "--tokens", "8", "--iters", "1", "--warmup", "0", "--json", str(out), "--timeout", "60",
           "--deadline", "120", "--no-progress"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(out.read_text())
    assert report["backend_used"] == ["symmetric"]
    [row] = report["rows"]
    assert row["check"] == "ok", row
    assert row["tokens_per_rank"] == 8 and sum(row["recv_rows_per_rank"]) > 0, row
    assert row["dispatch"]["us"] > 0 and row["combine"]["us"] > 0


def test_expert_order_example_and_random():
    """`bench_peer.expert_order`: the docstring example, then random routings against a plain
    loop (pairs by global expert, tokens ascending within one)."""
    import torch
    from epcomm.bench_peer import expert_order
    tokens, splits = expert_order(torch.tensor([[2, 0], [-1, 2]]), 4)
    assert tokens.tolist() == [0, 0, 1] and splits.tolist() == [1, 0, 2, 0]
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        idx = torch.randint(-1, 16, (37, 4), generator=gen)
        tokens, splits = expert_order(idx, 16)
        want = [(e, t) for e in range(16) for t in range(37) for k in range(4)
                if int(idx[t, k]) == e]
        assert tokens.tolist() == [t for _, t in want]
        assert splits.tolist() == [sum(1 for e, _ in want if e == x) for x in range(16)]


def test_peer_table_lists_baselines_and_why_one_did_not_run():
    """The one-process-per-GPU table (printed only when the peer baselines ran): a row per
    case, "n/a" where all_to_all_vdev_2d did not run, and its error below the table."""
    from epcomm.bench import _format_peer_table
    figure = {"us": 100.0, "gbps": 300.0}
    row = {"config": "dsv3", "layout": "compact", "dtype": "bf16", "sync": False,
           "num_sms": 24, "dispatch": figure, "combine": figure, "p2p": figure}
    no_peer = {key: value for key, value in row.items() if key != "p2p"}
    assert _format_peer_table([no_peer]) == ""  # ranks sharing a GPU, or CPU ranks
    text = _format_peer_table([dict(row, vdev2d_dispatch=figure, vdev2d_combine=figure),
                               dict(row, dtype="fp8", vdev2d_error={"0": "RuntimeError: x"})])
    lines = [line for line in text.splitlines() if line.startswith("| dsv3")]
    assert len(lines) == 2 and " 24 |" in lines[0] and "n/a" not in lines[0]
    assert lines[1].count("n/a") == 4
    assert "all_to_all_vdev_2d did not run: rank 0: RuntimeError: x" in text


def test_multi_gpu_matrix_script_runs_on_cpu_ranks():
    """`scripts/gpu_multi.py` (the matrix run, one process per GPU) has a CPU mode, so its
    plumbing is checked here before it meets a machine with several GPUs."""
    cmd = [sys.executable, str(Path(SRC).parent / "scripts" / "gpu_multi.py"), "--cpu",
           "--ranks", "2", "--tokens", "8", "--hidden", "64", "--topk", "2", "--experts", "8",
           "--backends", "collective"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "collective: 64 cases bitwise equal" in proc.stdout, proc.stdout
    assert re.search(r"^\| collective \| collective \| None \| 64 \| ok \|", proc.stdout, re.M)


def test_peer_figures_without_a_bf16_case():
    """all_to_all_vdev_2d's combine is timed after its bf16 dispatch only: an FP8-only run has
    dispatch figures and no combine figure (it must not fail)."""
    from epcomm.bench import Case, _add_peer_figures
    timing = {"s": 1e-4, "host_s": 1e-5, "iters": 3}
    bases = [{"p2p_fp8": dict(timing, bytes=10), "vdev2d_dispatch_fp8": dict(timing, pairs=4)}]
    records = [{"dispatch_bytes": 100, "combine_bytes": 200}]
    row: dict = {}
    _add_peer_figures(row, Case("dsv3", "compact", "fp8", False), bases, records)
    assert row["vdev2d_dispatch"]["us"] == 100.0 and "vdev2d_combine" not in row
    assert row["p2p"]["gbps"] > 0


def test_plot_paths_draws_or_names_the_extra(tmp_path):
    """`--plot` draws latency against tokens with matplotlib, or says which extra brings it."""
    from epcomm.bench_paths import plot_paths
    rows = [dict(what=what, tokens=tokens, layout=layout, us=us, floor_us=None, goal=None)
            for what, layout, base in (("copy x", "", 1.0), ("collective combine", "compact", 9.0))
            for tokens, us in ((16, base), (64, 3 * base))]
    target = tmp_path / "paths.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match=r"epcomm\[plot\]"):
            plot_paths(rows, str(target))
        return
    plot_paths(rows, str(target))
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_shared_rows_set_each_layout_against_n_times_its_ep1_replay(monkeypatch):
    """The shared-GPU rows take each layout's figure from the processes and N x the EP=1
    replay of the same token count as their floor (the replays themselves need a GPU:
    scripts/gpu_symmetric.py --shared N and `python -m epcomm bench` run them there)."""
    import epcomm.testing.launch as launch
    from epcomm import bench_paths
    calls = []

    def fake_ranks(fn, world_size, *args, **kwargs):
        calls.append((fn, world_size, args))
        return [{"compact": 300.0, "expand": 480.0}] * world_size

    monkeypatch.setattr(launch, "run_local_ranks", fake_ranks)
    replay = "symmetric graph replay dispatch+combine"
    ep1 = [dict(what=replay, tokens=128, layout="compact", us=30.0),
           dict(what=replay, tokens=128, layout="expand", us=50.0),
           dict(what=replay, tokens=4096, layout="compact", us=140.0),
           dict(what="symmetric combine", tokens=128, layout="compact", us=12.0)]
    rows = bench_paths.shared_rows(8, 128, 7168, 8, 256, ep1, seed=3)
    assert calls == [(bench_paths.shared_replays, 8, (128, 7168, 8, 256, 50, 3))]
    assert [(r["layout"], r["us"], r["floor_us"], r["goal"]) for r in rows] == [
        ("compact", 300.0, 240.0, "<= 8x EP=1"), ("expand", 480.0, 400.0, "<= 8x EP=1")]
    assert all(r["what"].endswith("8 processes sharing the GPU") for r in rows)


@pytest.mark.parametrize("expand", [False, True])
def test_floor_copy_writes_the_valid_bytes_into_an_output_of_the_calls_size(expand: bool):
    """The collective floor's copy: the valid rows' bytes into a fresh tensor as large as the
    call's output (an expand output keeps its alignment gaps, a sync-free one its capacity),
    so on CPU it pays the page faults of the output the call must return."""
    from types import SimpleNamespace

    import torch

    from epcomm.bench import _output_copies
    hidden = 8
    handle = SimpleNamespace(
        do_expand=expand, num_tokens=5, num_output_rows=40,
        num_unaligned_recv_tokens_per_expert=torch.tensor([3, 0, 4]),
        psum_num_recv_tokens_per_scaleup_rank=torch.tensor([2, 6]))
    made = []

    def measure(fn):
        made.append(fn())
        return {"s": [1e-6]}

    figures = _output_copies(measure, handle, hidden, "bf16", torch.device("cpu"))
    valid = 7 if expand else 6
    assert figures["dispatch_out_bytes"] == valid * 2 * hidden
    assert figures["combine_out_bytes"] == 5 * 2 * hidden
    assert [out.numel() for out in made] == [40 * 2 * hidden, 5 * 2 * hidden]
    assert figures["copy_dispatch_out"] == figures["copy_combine_out"] == {"s": [1e-6]}
