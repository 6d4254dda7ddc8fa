"""`python -m epcomm bench`: check and time dispatch / combine against a plain all-to-all.

For each case (configuration x layout x dispatch dtype x sync mode) every rank

1. checks one dispatch + combine through `Buffer` against the independent reference
   (`epcomm.testing.reference`) with the checker the tests use (`epcomm.testing.verify`: bitwise, sync-free
   outputs by the handle's device counts and the contract's "past the prefix" conventions);
2. times dispatch and combine separately: warm-up, barrier, N back-to-back calls, synchronize;
   wall-clock per call (and the host time spent inside the calls).

Baselines from the same run, with the same routing and per-rank byte counts:
- `all_to_all_single` as a user would write dispatch: an all-to-all of the row counts, read on
  the host, then an exact-split all-to-all of the payload bytes; and the reverse payload
  all-to-all of the bf16 rows for combine (the counts are known by then);
- on CUDA, a device `copy_` of the received bytes (GB/s counts read + write).

Figures: the latency of a case is the median over ranks of each rank's mean per call; the
bandwidth is "logical" (DeepEP's convention): bytes received per rank (compact rows, one per
(source token, this rank) pair, own tokens included, times the row bytes incl. FP8 scales;
combine: the same rows in bf16) divided by that rank's time, averaged over ranks.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .fp8 import num_scales

__all__ = ["BenchConfig", "CONFIGS", "add_arguments", "run", "main"]


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class BenchConfig:
    """One model shape. `tokens_gpu` / `tokens_cpu`: tokens per rank (T = M) by device."""

    name: str
    hidden: int
    num_topk: int
    num_experts: int
    tokens_gpu: int
    tokens_cpu: int
    expand_alignment: int


CONFIGS: dict[str, BenchConfig] = {
    "small": BenchConfig("small", hidden=256, num_topk=4, num_experts=16, tokens_gpu=64,
                         tokens_cpu=64, expand_alignment=1),
    "dsv3": BenchConfig("dsv3", hidden=7168, num_topk=8, num_experts=256, tokens_gpu=4096,
                        tokens_cpu=128, expand_alignment=128),
    # DeepSeek-V3 decoding: 128 tokens per rank (anchors.md: DeepEP's low-latency figures).
    "decode": BenchConfig("decode", hidden=7168, num_topk=8, num_experts=256, tokens_gpu=128,
                          tokens_cpu=16, expand_alignment=1),
}
LAYOUTS = ("compact", "expand")
# Default timing by device: warm-up calls, then an adaptive count of timed calls
# (min, max, seconds aimed at per measurement), unless --iters fixes it.
WARMUP = {"cuda": 3, "cpu": 2}
ADAPTIVE = {"cuda": (3, 50, 2.0), "cpu": (3, 30, 1.5)}
DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class Case:
    config: str
    layout: str
    dtype: str
    sync: bool

    @property
    def label(self) -> str:
        return f"{self.config}/{self.layout}/{self.dtype}/{'sync' if self.sync else 'sync-free'}"


@dataclass
class Options:
    """Everything a rank needs (picklable: it travels to spawned ranks)."""

    ranks: int
    pg_backend: str
    device: str                       # "cuda" or "cpu"
    backend: str                      # the --backend choice
    configs: list[str]
    layouts: list[str]
    dtypes: list[str]
    sync_modes: list[bool]
    tokens: Optional[int]
    iters: Optional[int]
    warmup: Optional[int]
    check: bool
    seed: int
    timeout_s: float
    deadline_s: float = 3600.0
    progress: bool = True

    @property
    def buffer_backend(self) -> str:
        """What `Buffer(backend=...)` gets. "auto" on CPU means "collective": the symmetric
        backend runs on CPU only in the Triton interpreter (a correctness vehicle, about a
        second per call even on the small config); ask for it with --backend symmetric."""
        if self.backend == "auto" and self.device == "cpu":
            return "collective"
        return self.backend

    def tokens_for(self, cfg: BenchConfig) -> int:
        if self.tokens is not None:
            return self.tokens
        return cfg.tokens_gpu if self.device == "cuda" else cfg.tokens_cpu

    def timing(self) -> tuple[Optional[int], int, tuple[int, int, float]]:
        """(iters or None for adaptive, warm-up calls, adaptive (min, max, budget_s))."""
        warmup = self.warmup if self.warmup is not None else WARMUP[self.device]
        return self.iters, warmup, ADAPTIVE[self.device]

    def cases(self) -> list[Case]:
        return [Case(c, layout, dtype, sync) for c in self.configs for layout in self.layouts
                for dtype in self.dtypes for sync in self.sync_modes]


# ----------------------------------------------------------------------------- helpers


def _row_bytes(hidden: int, dtype: str) -> int:
    """Bytes of one dispatched row: bf16, or FP8 plus its fp32 per-128-channel scales."""
    if dtype == "bf16":
        return 2 * hidden
    return hidden + 4 * num_scales(hidden)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_calls(fn: Callable[[], Any], iters: Optional[int], warmup: int, device: torch.device,
                group, adaptive: tuple[int, int, float],
                coll_device: torch.device) -> dict:
    """Time `fn` on this rank: warm-up, synchronize, barrier, back-to-back calls, synchronize.

    Returns {"s": wall seconds per call, "host_s": host seconds spent inside each call (the
    time for the call to return; on CPU the same as the wall time, on CUDA the launch and
    host-side work, including any host wait the call makes), "iters": calls timed}.
    With `iters=None` the count adapts: `adaptive = (min, max, budget_s)`; the slowest rank's
    last warm-up call (all-reduced, so every rank makes the same number of calls) sets
    `iters = clamp(budget_s / t, min, max)`.
    """
    last = 0.0
    for _ in range(max(warmup, 1 if iters is None else 0)):
        t0 = time.perf_counter()
        fn()
        _synchronize(device)
        last = time.perf_counter() - t0
    if iters is None:
        lo, hi, budget = adaptive
        slowest = torch.tensor([last], dtype=torch.float64, device=coll_device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        iters = int(max(lo, min(hi, budget // max(float(slowest.item()), 1e-9))))
    _synchronize(device)
    dist.barrier(group=group)
    _synchronize(device)
    host = 0.0
    start = time.perf_counter()
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        host += time.perf_counter() - t0
    _synchronize(device)
    wall = time.perf_counter() - start
    return {"s": wall / iters, "host_s": host / iters, "iters": iters}


# ----------------------------------------------------------------------------- the check


def _expert_outputs(vcase, ref, handle, device: torch.device):
    """Expert outputs for the combine check (and then its timing): the reference's dispatched
    rows in bf16 with the reference's weights (so combine is checked even when dispatch
    differs), `handle.num_output_rows` rows; the rows combine must ignore
    (`verify.ignored_rows`) hold garbage (1024 and weight 7). Returns (y, weights)."""
    from .fp8 import per_token_cast_back
    from .testing.verify import ignored_rows

    y_ref = ref.recv_x if not vcase.fp8 else per_token_cast_back(*ref.recv_x)
    w_ref = ref.recv_topk_weights
    rows, n = handle.num_output_rows, min(handle.num_output_rows, y_ref.shape[0])
    y = torch.full((rows, y_ref.shape[1]), 1024.0, dtype=torch.bfloat16, device=device)
    w = torch.full((rows,) + tuple(w_ref.shape[1:]), 7.0, dtype=torch.float32, device=device)
    y[:n], w[:n] = y_ref[:n].to(device), w_ref[:n].to(device)
    ignored = ignored_rows(vcase, ref, rows).to(device)
    y[ignored], w[ignored] = 1024.0, 7.0
    return y, w


def _failure(exc: BaseException, what: str) -> str:
    """A mismatch line: the checker's message (it names the field), or what else was raised."""
    if isinstance(exc, AssertionError):
        return str(exc) or f"{what} check failed"
    return f"{what} check raised {type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------- one rank


def _send_counts(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> list[int]:
    """Tokens this rank sends to each rank (deduplicated)."""
    dest = topk_idx.cpu() // (num_experts // num_ranks)
    return [int((dest == r).any(dim=1).sum()) for r in range(num_ranks)]


def _all_to_all_counts(send: list[int], device: torch.device, group) -> list[int]:
    send_t = torch.tensor(send, dtype=torch.int64, device=device)
    recv_t = torch.empty_like(send_t)
    dist.all_to_all_single(recv_t, send_t, group=group)
    return recv_t.tolist()


def _rank_main(opts: Options) -> dict:
    """Runs on every rank; returns this rank's raw measurements."""
    from . import bench_peer
    from .testing import verify
    from .buffer import Buffer
    from .fp8 import per_token_cast_to_fp8

    group = dist.group.WORLD
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda" \
        else torch.device("cpu")
    # gloo moves CPU tensors: the reference and the baseline run on host copies there.
    coll_device = device if opts.pg_backend == "nccl" else torch.device("cpu")

    progress, done = None, 0
    steps = len(opts.cases()) + len(opts.configs)
    if rank == 0 and opts.progress:
        try:
            from tqdm import tqdm
        except ImportError:  # a declared dependency, but keep working without it
            tqdm = None
        if tqdm is not None:
            progress = tqdm(total=steps, desc="epcomm bench", file=sys.stderr, unit="step",
                            dynamic_ncols=True)

    def step(text: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress.set_postfix_str(text)
            progress.update()
        elif rank == 0 and opts.progress:
            print(f"epcomm bench [{done}/{steps}] {text}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {"rank": rank, "cases": [], "baselines": {}, "backend": {},
                              "num_sms": {}}
    # One process per GPU over NCCL: the link baselines of `bench_peer` can run.
    peer_baselines = device.type == "cuda" and opts.pg_backend == "nccl" and num_ranks > 1 \
        and torch.cuda.device_count() >= num_ranks
    for config_name in opts.configs:
        cfg = CONFIGS[config_name]
        tokens = opts.tokens_for(cfg)
        iters, warmup, adaptive = opts.timing()

        def measure(fn, dev=device):
            return _time_calls(fn, iters, warmup, dev, group, adaptive, coll_device)
        E, K, H = cfg.num_experts, cfg.num_topk, cfg.hidden
        generator = torch.Generator().manual_seed(opts.seed * 1009 + rank)
        topk_idx = verify.make_routing("balanced", tokens, K, E, num_ranks, generator)
        topk_weights = torch.rand((tokens, K), generator=generator)
        x = torch.randn((tokens, H), generator=generator).to(torch.bfloat16)
        inputs = {"bf16": x.to(device)}
        if "fp8" in opts.dtypes:
            inputs["fp8"] = tuple(t.to(device) for t in per_token_cast_to_fp8(x))
        idx_dev, w_dev = topk_idx.to(device), topk_weights.to(device)
        buffer = Buffer(group, num_max_tokens_per_rank=tokens, hidden=H, num_topk=K,
                        use_fp8_dispatch="fp8" in opts.dtypes, backend=opts.buffer_backend,
                        device=device, timeout_s=opts.timeout_s)
        result["backend"][config_name] = buffer.backend
        result["num_sms"][config_name] = buffer.num_sms if buffer.backend == "symmetric" else None

        # -- per-rank byte counts and the baselines ------------------------------------------
        send_counts = _send_counts(topk_idx, E, num_ranks)
        recv_counts = _all_to_all_counts(send_counts, coll_device, group)
        recv_rows = sum(recv_counts)
        base: dict[str, Any] = {"send_rows": sum(send_counts), "recv_rows": recv_rows,
                                "warmup": warmup, "tokens": tokens}
        count_tensor = torch.tensor(send_counts, dtype=torch.int64, device=coll_device)
        for dtype in opts.dtypes:
            row = _row_bytes(H, dtype)
            send_buf = torch.randint(0, 255, (sum(send_counts), row), dtype=torch.uint8,
                                     generator=generator).to(coll_device)

            def a2a_dispatch(send_buf=send_buf, row=row):
                got = torch.empty_like(count_tensor)
                dist.all_to_all_single(got, count_tensor, group=group)
                splits = got.tolist()                     # the host sync a user needs
                out = torch.empty((sum(splits), row), dtype=torch.uint8, device=coll_device)
                dist.all_to_all_single(out, send_buf, splits, send_counts, group=group)
                return out

            def a2a_payload(send_buf=send_buf, row=row):
                out = torch.empty((recv_rows, row), dtype=torch.uint8, device=coll_device)
                dist.all_to_all_single(out, send_buf, recv_counts, send_counts, group=group)
                return out

            base[f"a2a_dispatch_{dtype}"] = dict(measure(a2a_dispatch, coll_device),
                                                 bytes=recv_rows * row)
            base[f"a2a_payload_{dtype}"] = dict(measure(a2a_payload, coll_device),
                                                bytes=recv_rows * row)
            del send_buf
        back_row = _row_bytes(H, "bf16")
        back_buf = torch.randint(0, 255, (recv_rows, back_row), dtype=torch.uint8,
                                 generator=generator).to(coll_device)

        def a2a_combine():
            out = torch.empty((sum(send_counts), back_row), dtype=torch.uint8, device=coll_device)
            dist.all_to_all_single(out, back_buf, send_counts, recv_counts, group=group)
            return out

        base["a2a_combine"] = dict(measure(a2a_combine, coll_device),
                                   bytes=recv_rows * back_row)
        del back_buf
        if device.type == "cuda":
            for dtype in opts.dtypes:
                nbytes = max(1, recv_rows * _row_bytes(H, dtype))
                src = torch.empty(nbytes, dtype=torch.uint8, device=device)
                dst = torch.empty_like(src)
                base[f"copy_{dtype}"] = dict(measure(lambda: dst.copy_(src)), bytes=2 * nbytes)
                del src, dst
        if peer_baselines:
            row_bytes = {"bf16": inputs["bf16"].view(torch.uint8)}
            if "fp8" in inputs:
                x_fp8, scales = inputs["fp8"]
                row_bytes["fp8"] = torch.cat([x_fp8.view(torch.uint8), scales.view(torch.uint8)],
                                             dim=1)
            for dtype in opts.dtypes:
                base[f"p2p_{dtype}"] = bench_peer.p2p_copy(
                    measure, recv_rows * _row_bytes(H, dtype), device)
            base.update(bench_peer.vdev_2d(measure, {d: row_bytes[d] for d in opts.dtypes},
                                           topk_idx, E, cfg.expand_alignment, group, device))
            del row_bytes
        result["baselines"][config_name] = base
        step(f"{config_name} baselines")

        # -- the cases -------------------------------------------------------------------------
        references: dict[tuple[str, str], Any] = {}
        for case in [c for c in opts.cases() if c.config == config_name]:
            expand = case.layout == "expand"
            align = cfg.expand_alignment if expand else 1
            xin = inputs[case.dtype]

            def dispatch(case=case, xin=xin, expand=expand, align=align):
                return buffer.dispatch(xin, idx_dev, w_dev, num_experts=E,
                                       expert_alignment=align, do_cpu_sync=case.sync,
                                       do_expand=expand)

            record: dict[str, Any] = {"case": asdict(case), "tokens": tokens, "warmup": warmup, "recv_rows": recv_rows,
                                      "dispatch_bytes": recv_rows * _row_bytes(H, case.dtype),
                                      "combine_bytes": recv_rows * back_row,
                                      "alignment": align, "mismatch": None}
            out = dispatch()
            handle = out[3]
            combine_x = None
            if opts.check:
                vcase = verify.Case(routing="balanced", tokens="full", num_experts=E,
                                    expert_alignment=align, do_expand=expand,
                                    do_cpu_sync=case.sync, fp8=case.dtype == "fp8",
                                    seed=opts.seed)
                key = (case.dtype, case.layout)
                if key not in references:
                    references[key] = verify.run_reference_dispatch(buffer, vcase, xin, idx_dev,
                                                                    w_dev)
                ref = references[key]
                bad: list[str] = []
                try:
                    verify.check_dispatch_outputs(buffer, vcase, out, ref)
                except Exception as exc:  # a shape surprise must not stop the other ranks
                    bad.append(_failure(exc, "dispatch"))
                # Combine check: collective on both sides, so every rank always calls both.
                y_buf, w_buf = _expert_outputs(vcase, ref, handle, device)
                try:
                    verify.check_combine(buffer, vcase, handle, ref, idx_dev, y_buf, w_buf)
                except AssertionError as exc:
                    bad.append(_failure(exc, "combine"))
                _synchronize(device)
                record["mismatch"] = bad
                combine_x = y_buf
                del w_buf
            if combine_x is None:  # expert outputs: any bf16 rows of the right shape
                combine_x = torch.ones((handle.num_output_rows, H), dtype=torch.bfloat16,
                                       device=device)
            del out
            record["dispatch"] = measure(dispatch)
            record["combine"] = measure(lambda: buffer.combine(combine_x, handle))
            record.update(_output_copies(measure, handle, H, case.dtype, device))
            del combine_x, handle
            result["cases"].append(record)
            step(case.label)
        references.clear()
        buffer.barrier()
        buffer.destroy()
        _synchronize(device)
        dist.barrier(group=group)  # every rank unmaps peers' memory before any owner exits
    if progress is not None:
        progress.close()
    return result


# ----------------------------------------------------------------------------- aggregation


def _figure(per_rank: list[dict], bytes_key: Optional[str] = None) -> dict:
    """Median over ranks of the per-rank time; mean over ranks of bytes / time."""
    times = [r["s"] for r in per_rank]
    hosts = [r["host_s"] for r in per_rank]
    out = {"us": statistics.median(times) * 1e6, "host_us": statistics.median(hosts) * 1e6,
           "us_per_rank": [t * 1e6 for t in times], "iters": per_rank[0]["iters"]}
    if bytes_key is not None:
        rates = [r[bytes_key] / r["s"] / 1e9 for r in per_rank if r["s"] > 0]
        out["gbps"] = sum(rates) / len(rates) if rates else 0.0
        out["bytes_per_rank"] = [r[bytes_key] for r in per_rank]
    return out


def aggregate(per_rank: list[dict], opts: Options) -> list[dict]:
    """One row per case, figures combined over ranks."""
    rows = []
    for index, case_record in enumerate(per_rank[0]["cases"]):
        records = [r["cases"][index] for r in per_rank]
        case = Case(**case_record["case"])
        bases = [r["baselines"][case.config] for r in per_rank]

        def with_bytes(key, bytes_key, records=records):
            return [dict(r[key], bytes=r[bytes_key]) for r in records]

        mismatches = {r["rank"]: r["cases"][index]["mismatch"] for r in per_rank}
        if not opts.check:
            check = "skipped"
        else:
            check = "ok" if all(not m for m in mismatches.values()) else "MISMATCH"
        row = {
            "config": case.config, "layout": case.layout, "dtype": case.dtype,
            "sync": case.sync, "backend": per_rank[0]["backend"][case.config],
            "tokens_per_rank": case_record["tokens"], "alignment": case_record["alignment"],
            "warmup": case_record["warmup"],
            "recv_rows_per_rank": [r["recv_rows"] for r in records],
            "check": check,
            "mismatch": {str(k): v for k, v in mismatches.items() if v},
            "dispatch": _figure(with_bytes("dispatch", "dispatch_bytes"), "bytes"),
            "combine": _figure(with_bytes("combine", "combine_bytes"), "bytes"),
            "a2a_dispatch": _figure([b[f"a2a_dispatch_{case.dtype}"] for b in bases], "bytes"),
            "a2a_dispatch_payload": _figure([b[f"a2a_payload_{case.dtype}"] for b in bases],
                                            "bytes"),
            "a2a_combine": _figure([b["a2a_combine"] for b in bases], "bytes"),
        }
        if f"copy_{case.dtype}" in bases[0]:
            row["copy"] = _figure([b[f"copy_{case.dtype}"] for b in bases], "bytes")
        row["num_sms"] = per_rank[0]["num_sms"][case.config]
        _add_peer_figures(row, case, bases, records)
        _add_floor_figures(row, records, opts.pg_backend == "gloo")
        rows.append(row)
    return rows


def _add_peer_figures(row: dict, case: Case, bases: list[dict], records: list[dict]) -> None:
    """The `bench_peer` baselines of this case, if they ran: the p2p copy (its own bytes) and
    all_to_all_vdev_2d (GB/s over the same logical bytes as our dispatch and combine)."""
    if f"p2p_{case.dtype}" in bases[0]:
        row["p2p"] = _figure([b[f"p2p_{case.dtype}"] for b in bases], "bytes")
    errors = {str(r): b["vdev2d_error"] for r, b in enumerate(bases) if "vdev2d_error" in b}
    if errors:
        row["vdev2d_error"] = errors
        return
    if f"vdev2d_dispatch_{case.dtype}" in bases[0]:
        row["vdev2d_dispatch"] = _figure(
            [dict(b[f"vdev2d_dispatch_{case.dtype}"], bytes=r["dispatch_bytes"])
             for b, r in zip(bases, records)], "bytes")
    if "vdev2d_combine" in bases[0]:  # (timed after the bf16 dispatch only)
        row["vdev2d_combine"] = _figure(
            [dict(b["vdev2d_combine"], bytes=r["combine_bytes"]) for b, r in zip(bases, records)],
            "bytes")


def _output_copies(measure, handle, hidden: int, dtype: str, device: torch.device) -> dict:
    """One copy of the bytes a dispatch and a combine must write to their outputs, timed: the
    valid rows (compact rows, or (row, local slot) pairs in the expand layout; the combined
    [T, H] bf16) written as one run into a fresh tensor of the output's size, as the call makes
    it (an expand output with its alignment gaps, a sync-free one at capacity). With the
    all-to-all of the same bytes, the collective backend's floor. On CPU the size matters: the
    written pages of a fresh allocation above glibc's mmap threshold (32 MiB at most) fault one
    by one, the expand output's at alignment 128 among them."""
    rows = handle.num_unaligned_recv_tokens_per_expert.sum() if handle.do_expand else \
        handle.psum_num_recv_tokens_per_scaleup_rank[-1]
    row_bytes = _row_bytes(hidden, dtype)
    figures = {"dispatch_out_bytes": int(rows) * row_bytes,
               "combine_out_bytes": handle.num_tokens * _row_bytes(hidden, "bf16")}
    sizes = {"dispatch": handle.num_output_rows * row_bytes,
             "combine": figures["combine_out_bytes"]}
    for what in ("dispatch", "combine"):
        source = torch.empty(figures[f"{what}_out_bytes"], dtype=torch.uint8, device=device)

        def copy_out(source=source, size=max(1, sizes[what])):
            out = torch.empty(size, dtype=torch.uint8, device=device)
            out[:source.shape[0]].copy_(source)
            return out
        figures[f"copy_{what}_out"] = measure(copy_out)
    return figures


def _add_floor_figures(row: dict, records: list[dict], host_exchange: bool) -> None:
    """Floors of the collective backend's case (median over ranks): dispatch = the payload
    all-to-all (with the count exchange and its host read when synchronizing, or always with
    `host_exchange`: over gloo every dispatch exchanges its headers on the host first) + the
    copy of its output bytes; combine = the reverse all-to-all + the copy of the combined
    rows."""
    if row["backend"] != "collective" or "copy_dispatch_out" not in records[0]:
        return
    a2a = row["a2a_dispatch"] if row["sync"] or host_exchange else row["a2a_dispatch_payload"]
    copies = {what: statistics.median(r[f"copy_{what}_out"]["s"] for r in records) * 1e6
              for what in ("dispatch", "combine")}
    row["floor"] = {"dispatch_us": a2a["us"] + copies["dispatch"],
                    "combine_us": row["a2a_combine"]["us"] + copies["combine"],
                    "copy_dispatch_out_us": copies["dispatch"],
                    "copy_combine_out_us": copies["combine"]}


def _format_floor_table(rows: list[dict]) -> str:
    """The collective backend beside its floor ("" if no row has one)."""
    floor_rows = [r for r in rows if "floor" in r]
    if not floor_rows:
        return ""
    header = ["case", "disp us", "disp floor us", "disp x floor", "comb us", "comb floor us",
              "comb x floor"]
    lines = [[Case(r["config"], r["layout"], r["dtype"], r["sync"]).label,
              f"{r['dispatch']['us']:.1f}", f"{r['floor']['dispatch_us']:.1f}",
              f"{r['dispatch']['us'] / r['floor']['dispatch_us']:.2f}",
              f"{r['combine']['us']:.1f}", f"{r['floor']['combine_us']:.1f}",
              f"{r['combine']['us'] / r['floor']['combine_us']:.2f}"] for r in floor_rows]
    return ("\n\nCollective backend against its floor: the all-to-all of the bytes a call sends "
            "(a2a disp with do_cpu_sync or over gloo, where every dispatch exchanges its headers "
            "first, else the payload alone; a2a comb) + one copy of the bytes it writes to its "
            "outputs (the valid rows, into a fresh tensor of the output's size), same run, median "
            "over ranks:\n\n"
            + _format_table(header, lines, 1))


def _format_table(header: list[str], lines: list[list[str]], num_text: int) -> str:
    """A Markdown table; the first `num_text` columns left-aligned, the rest right-aligned."""
    widths = [max([len(h)] + [len(line[i]) for line in lines]) for i, h in enumerate(header)]

    def fmt(cells):
        return "| " + " | ".join(c.ljust(w) if i < num_text else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    sep = "|" + "|".join(("-" * (w + 2)) if i < num_text else ("-" * (w + 1) + ":")
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([fmt(header), sep] + [fmt(line) for line in lines])


def format_tables(rows: list[dict]) -> str:
    """The main table, then the host-time table (Markdown)."""
    has_copy = any("copy" in r for r in rows)
    header = ["config", "backend", "layout", "dtype", "sync", "tok/rank", "check",
              "disp us", "disp GB/s", "comb us", "comb GB/s",
              "a2a disp us", "a2a disp GB/s", "a2a comb us", "a2a comb GB/s"]
    if has_copy:
        header += ["copy GB/s"]
    lines = []
    for r in rows:
        line = [r["config"], r["backend"], r["layout"], r["dtype"], "yes" if r["sync"] else "no",
                str(r["tokens_per_rank"]), r["check"],
                f"{r['dispatch']['us']:.1f}", f"{r['dispatch']['gbps']:.3f}",
                f"{r['combine']['us']:.1f}", f"{r['combine']['gbps']:.3f}",
                f"{r['a2a_dispatch']['us']:.1f}", f"{r['a2a_dispatch']['gbps']:.3f}",
                f"{r['a2a_combine']['us']:.1f}", f"{r['a2a_combine']['gbps']:.3f}"]
        if has_copy:
            line.append(f"{r['copy']['gbps']:.1f}" if "copy" in r else "-")
        lines.append(line)
    main = _format_table(header, lines, 7)
    host_header = ["config", "layout", "dtype", "sync", "disp host us", "comb host us",
                   "a2a disp host us", "a2a payload host us", "a2a comb host us"]
    host_lines = [[r["config"], r["layout"], r["dtype"], "yes" if r["sync"] else "no",
                   f"{r['dispatch']['host_us']:.1f}", f"{r['combine']['host_us']:.1f}",
                   f"{r['a2a_dispatch']['host_us']:.1f}",
                   f"{r['a2a_dispatch_payload']['host_us']:.1f}",
                   f"{r['a2a_combine']['host_us']:.1f}"] for r in rows]
    text = main + "\n\nHost time per call (time for the call to return):\n\n" + \
        _format_table(host_header, host_lines, 4)
    return text + _format_peer_table(rows) + _format_floor_table(rows)


def _format_peer_table(rows: list[dict]) -> str:
    """One process per GPU: ours beside the link roofline and all_to_all_vdev_2d ("" if none
    of them ran)."""
    peer_rows = [r for r in rows if "p2p" in r]
    if not peer_rows:
        return ""

    def figure(r, key, what):
        return f"{r[key][what]:.1f}" if key in r else "n/a"
    header = ["config", "layout", "dtype", "sync", "SMs", "disp us", "disp GB/s", "comb us",
              "comb GB/s", "vdev2d disp us", "vdev2d disp GB/s", "vdev2d comb us",
              "vdev2d comb GB/s", "p2p copy GB/s"]
    lines = [[r["config"], r["layout"], r["dtype"], "yes" if r["sync"] else "no",
              str(r["num_sms"] or "-"), figure(r, "dispatch", "us"),
              figure(r, "dispatch", "gbps"), figure(r, "combine", "us"),
              figure(r, "combine", "gbps"), figure(r, "vdev2d_dispatch", "us"),
              figure(r, "vdev2d_dispatch", "gbps"), figure(r, "vdev2d_combine", "us"),
              figure(r, "vdev2d_combine", "gbps"), figure(r, "p2p", "gbps")] for r in peer_rows]
    errors = sorted({f"rank {rank}: {text}" for r in peer_rows
                     for rank, text in r.get("vdev2d_error", {}).items()})
    notes = "".join(f"\nall_to_all_vdev_2d did not run: {e}" for e in errors)
    return ("\n\nOne process per GPU: logical GB/s; all_to_all_vdev_2d moves a row per (token,"
            " expert) pair, timed from its input already in expert order; p2p copy: this rank's"
            " received bytes copied to the next GPU, all ranks at once:\n\n"
            + _format_table(header, lines, 4) + notes)


# ----------------------------------------------------------------------------- entry points


def _machine_info(opts: Options) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "device": opts.device, "ranks": opts.ranks, "pg_backend": opts.pg_backend}
    if opts.device == "cuda":
        info["device_name"] = torch.cuda.get_device_name(0)
        info["num_gpus"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        info["device_name"] = name
    return info


def resolve_options(args: argparse.Namespace) -> Options:
    """Turn parsed command-line arguments into `Options` (device, ranks and process group)."""
    def split(text: str, allowed, what: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        for item in items:
            if item not in allowed:
                raise SystemExit(f"epcomm bench: unknown {what} {item!r} (choose from "
                                 f"{', '.join(allowed)})")
        return items

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = "cpu" if args.cpu or num_gpus == 0 else "cuda"
    if args.ranks is not None:
        ranks = args.ranks
    else:
        ranks = num_gpus if device == "cuda" and num_gpus >= 2 else 4
    if ranks < 1:
        raise SystemExit("epcomm bench: --ranks must be >= 1")
    pg = args.pg_backend
    if pg == "auto":
        pg = "nccl" if device == "cuda" and num_gpus >= 2 and ranks <= num_gpus else "gloo"
    for name in ("iters", "warmup", "tokens"):
        value = getattr(args, name)
        if value is not None and value < (1 if name != "warmup" else 0):
            raise SystemExit(f"epcomm bench: --{name} must be positive")
    seed = args.seed if args.seed is not None else int(time.time()) % (2 ** 31)
    sync_modes = [True, False] if args.sync_free else [True]
    return Options(ranks=ranks, pg_backend=pg, device=device, backend=args.backend,
                   configs=split(args.configs, CONFIGS, "config"),
                   layouts=split(args.layouts, LAYOUTS, "layout"),
                   dtypes=split(args.dtypes, DTYPES, "dtype"), sync_modes=sync_modes,
                   tokens=args.tokens, iters=args.iters, warmup=args.warmup,
                   check=args.check, seed=seed, timeout_s=args.timeout,
                   deadline_s=args.deadline,
                   progress=not args.no_progress)


def run(opts: Options) -> dict:
    """Run the benchmark on `opts.ranks` local ranks; return the report (rows + machine)."""
    from .testing.launch import run_local_ranks

    started = time.perf_counter()
    per_rank = run_local_ranks(_rank_main, opts.ranks, opts, pg_backend=opts.pg_backend,
                               timeout_s=opts.timeout_s, deadline_s=opts.deadline_s)
    rows = aggregate(per_rank, opts)
    machine = _machine_info(opts)
    backends = sorted({r["backend"] for r in rows})
    return {"machine": machine, "backend_requested": opts.backend,
            "backend_passed_to_buffer": opts.buffer_backend, "backend_used": backends,
            "options": asdict(opts), "seed": opts.seed, "rows": rows,
            "elapsed_s": time.perf_counter() - started}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=None,
                        help="local ranks (default: one per GPU with >= 2 GPUs over NCCL; "
                             "else 4 ranks over gloo, sharing the one GPU or on CPU)")
    parser.add_argument("--backend", default="auto", choices=["auto", "collective", "symmetric"],
                        help="Buffer backend (default auto: the Buffer's choice on GPU, "
                             "collective on CPU, where the symmetric backend runs only in the "
                             "slow Triton interpreter; the backend used is reported)")
    parser.add_argument("--configs", default="small,dsv3",
                        help=f"comma-separated configurations: {', '.join(CONFIGS)} "
                             "(default: all)")
    parser.add_argument("--layouts", default="compact,expand", help="compact,expand (default both)")
    parser.add_argument("--dtypes", default="bf16,fp8",
                        help="dispatch dtypes bf16,fp8 (default both; combine is always bf16)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per rank (= num_max_tokens_per_rank) for every config "
                             "(default: dsv3 4096 on GPU, 128 on CPU; small 64)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed calls per measurement (default: adaptive, about "
                             f"{ADAPTIVE['cuda'][2]:g} s per measurement within "
                             f"[{ADAPTIVE['cuda'][0]}, {ADAPTIVE['cuda'][1]}] calls on GPU, "
                             f"{ADAPTIVE['cpu'][2]:g} s within [{ADAPTIVE['cpu'][0]}, "
                             f"{ADAPTIVE['cpu'][1]}] on CPU)")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"untimed calls first (default: {WARMUP['cuda']} on GPU, "
                             f"{WARMUP['cpu']} on CPU)")
    parser.add_argument("--sync-free", action=argparse.BooleanOptionalAction, default=True,
                        help="also time do_cpu_sync=False (default: yes)")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the check against epcomm.testing.reference")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write every figure and the machine info as JSON")
    parser.add_argument("--seed", type=int, default=None,
                        help="routing seed (default: from the clock; printed)")
    parser.add_argument("--pg-backend", default="auto", choices=["auto", "gloo", "nccl"],
                        help="process group (default: nccl with one rank per GPU, else gloo)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU exists")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a rank may wait for a peer (default 600)")
    parser.add_argument("--deadline", type=float, default=3600.0,
                        help="seconds the whole run may take before the ranks are killed "
                             "(default 3600)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--paths", action=argparse.BooleanOptionalAction, default=None,
                        help="then every path at EP=1 in one process beside its baselines "
                             "(epcomm.bench_paths; default: on with a GPU)")
    parser.add_argument("--paths-tokens", default=None, metavar="N,N",
                        help="tokens per rank of the EP=1 paths (default 1,32,128,256,4096 "
                             "on a GPU, 32,128 on CPU)")
    parser.add_argument("--plot", default=None, metavar="FILE",
                        help="draw the EP=1 paths' latency against tokens per rank to FILE "
                             "(implies --paths; needs matplotlib: epcomm[plot])")
    parser.add_argument("--shared", type=int, default=8, metavar="N",
                        help="with the paths on one GPU: then N processes sharing it, each "
                             "replaying its graph of dispatch + combine at 128 tokens, against "
                             "N x the EP=1 replay (default 8; 0: not run)")


def main(args: argparse.Namespace) -> int:
    """Run `epcomm bench`; print the tables; return the exit status (1 on any mismatch)."""
    opts = resolve_options(args)
    print(f"epcomm bench: {opts.ranks} ranks, {opts.device}, pg {opts.pg_backend}, "
          f"backend {opts.backend} (Buffer gets {opts.buffer_backend}), configs {','.join(opts.configs)}, seed {opts.seed}",
          file=sys.stderr, flush=True)
    try:
        report = run(opts)
    except RuntimeError as exc:
        print(f"epcomm bench failed: {exc}", file=sys.stderr)
        return 2
    rows = report["rows"]
    machine = report["machine"]
    print(f"# epcomm bench: {machine['device_name']} ({machine['device']}), torch "
          f"{machine['torch']}, {opts.ranks} ranks over {opts.pg_backend}, backend "
          f"{'/'.join(report['backend_used'])} (asked {opts.backend}), seed {opts.seed}")
    print("# latency: median over ranks of the per-rank mean per call; GB/s: logical "
          "(bytes received per rank / time), mean over ranks; a2a disp = count all-to-all + "
          "host read + exact-split payload all_to_all_single")
    print()
    print(format_tables(rows))
    bad = [r for r in rows if r["check"] == "MISMATCH"]
    for r in bad:
        for rank, fields in r["mismatch"].items():
            print(f"MISMATCH {r['config']}/{r['layout']}/{r['dtype']}/"
                  f"{'sync' if r['sync'] else 'sync-free'} rank {rank}: {', '.join(fields)}")
    print(f"\n# {report['elapsed_s']:.1f} s")
    paths = args.paths if args.paths is not None else \
        (args.plot is not None or opts.device == "cuda")
    if paths:
        report["paths"] = _run_paths(args, opts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if bad else 0


def _run_paths(args: argparse.Namespace, opts: Options) -> list[dict]:
    """`epcomm.bench_paths` at the last config's shape on a GPU (a small one on CPU): prints
    its table, draws `--plot`; returns its rows."""
    from . import bench_paths
    cuda = opts.device == "cuda"
    config = CONFIGS[opts.configs[-1]] if cuda else CONFIGS["small"]
    default = "1,32,128,256,4096" if cuda else "32,128"
    tokens = [int(n) for n in (args.paths_tokens or default).split(",")]
    rows = bench_paths.run_paths(tokens, config.hidden, config.num_topk, config.num_experts,
                                 seed=opts.seed)
    if cuda and args.shared and 128 in tokens and torch.cuda.device_count() == 1:
        rows += bench_paths.shared_rows(args.shared, 128, config.hidden, config.num_topk,
                                        config.num_experts, rows, seed=opts.seed)
    print(f"\n# every path at EP=1, one process ({'NCCL' if cuda else 'gloo'}), "
          f"{config.name}: hidden {config.hidden}, top-{config.num_topk}, "
          f"{config.num_experts} experts, bf16; us per call, back to back")
    print(bench_paths.format_paths(rows))
    if args.plot:
        bench_paths.plot_paths(rows, args.plot)
        print(f"# plot: {args.plot}")
    return rows
