"""Receive-tensor lifetime (contract sections 4 and 5), bitwise against `epcomm.testing.reference`.

Every process run covers `deterministic` off and on, outputs allocated on the compute stream and
on the comm stream (`allocate_on_comm_stream`), and five routings (uneven token counts, balanced,
masked, highly skewed with empty receivers, two selected experts on one destination rank). Each
case is a sync-free compact dispatch (`do_cpu_sync=False`, `async_with_compute_stream=True`):

- saved-prefix backward: the valid prefix of `recv_x` is saved by `ctx.save_for_backward`
  (`y = prefix @ W`), every other reference is dropped, three more dispatches with other data go
  through the same buffer, then backward: the weight gradient must equal bitwise the one computed
  from the reference dispatch;
- delayed cross-stream reader (CUDA only): a reader stream waits on a CUDA event recorded after
  the first `current_stream_wait()`, sleeps on the GPU, then copies the prefix into a tensor
  allocated beforehand. The test calls `prefix.record_stream(reader)`, drops every other
  reference, and allocates and fills four tensors of the receive capacity on the allocation
  stream. Those writes must complete while an event recorded just before the copy is still
  pending (else every rank retries together with a longer delay, at most 3 attempts; a missed
  window never counts). The copy must equal the reference bitwise. `--negative-control` leaves
  out the `record_stream`: the copy must then read the pressure pattern (detections are counted);
  `--schedule-control` makes rank 0 miss the first window of every case: all ranks must retry
  together and pass;
- bitwise equality of payload, local expert ids, weights, source metadata and counts with the
  reference (`epcomm.testing.verify.check_dispatch_outputs`), and the storage a prefix view
  retains (`capacity * H * 2` bytes) versus its logical size (`valid rows * H * 2`).

Runs alone (both policies, one process group per policy, a table at the end):

    PYTHONPATH=src python tests/test_recv_lifetime.py --num-processes 2 --num-tokens 64 --hidden 512
    ... [--negative-control | --schedule-control] [--policies 0,1] [--device cpu|cuda]

and under pytest. On machines without CUDA the reader parts skip with a visible reason and the
saved-prefix cases run on CPU ranks. Data is drawn afresh each run (the base seed comes from the
clock unless EPCOMM_TEST_SEED is set, and is printed on failure).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

try:
    import epcomm  # noqa: F401
except ImportError:  # run from a checkout without PYTHONPATH=src
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src"))

from epcomm import Buffer  # noqa: E402
from epcomm.testing.launch import run_local_ranks  # noqa: E402
from epcomm.testing.reference import reference_dispatch  # noqa: E402
from epcomm.testing.verify import (Case, assert_equal, bitwise_equal,  # noqa: E402
                                   check_dispatch_outputs, make_inputs)

try:
    import pytest
except ImportError:  # standalone runs do not need pytest
    pytest = None

BASE_SEED = int(os.environ.get("EPCOMM_TEST_SEED", time.time_ns() % 1_000_000))
NUM_TOPK = 4
EXPERTS_PER_RANK = 4          # same_rank routing needs >= 2
GRAD_COLUMNS = 8              # W is [H, GRAD_COLUMNS]
LATER_DISPATCHES = 3
PRESSURE_TENSORS = 4
MAX_ATTEMPTS = 3
FIRST_DELAY_MS = 50.0
DELAY_GROWTH = 4.0
FILL_BITS = 0x7F7F            # bf16 3.39e38: never drawn by randn, so a copy of it is corruption
NO_CUDA_REASON = "delayed cross-stream reader needs CUDA (none on this machine)"

# (label, make_routing routing, Case.tokens)
ROUTING_CASES = (
    ("uneven", "balanced", "uneven"),          # T = M - rank
    ("balanced", "balanced", "full"),
    ("masked", "masked", "full"),
    ("skewed", "skewed", "full"),              # only rank 0 receives; the others get 0 rows
    ("same_rank", "same_rank", "full"),        # slots 0 and 1 on one destination rank
)
MODES = ("normal", "negative", "schedule")


def _int16_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(torch.int16).cpu()


class _SavedPrefixMatmul(torch.autograd.Function):
    """`y = prefix @ W` that saves the prefix itself (not a copy) for backward."""

    @staticmethod
    def forward(ctx, prefix, weight, info: dict):
        ctx.save_for_backward(prefix)
        ctx.info = info
        return prefix.float() @ weight

    @staticmethod
    def backward(ctx, grad_y):
        (prefix,) = ctx.saved_tensors
        ctx.info["saved_storage_bytes"] = prefix.untyped_storage().nbytes()
        ctx.info["saved_logical_bytes"] = prefix.numel() * prefix.element_size()
        return None, prefix.float().t() @ grad_y, None


# ----------------------------------------------------------------------------- helpers


def _new_stats() -> dict:
    return dict(cases=0, saved_prefix=0, reader_cases=0, windows=0, retries=0, uncovered=0,
                attempts=0, detections=0, detectable=0, undetected=0, reused_in_window=0,
                forced_first_miss=0, first_attempt_flags=[], detected_cases=[], logical_bytes=0, storage_bytes=0,
                backend=None, device=None, reader=None)


def _reference(buffer: Buffer, case: Case, x, idx, w):
    return reference_dispatch(x.cpu(), idx.cpu(), w.cpu(), case.num_experts,
                              buffer.num_max_tokens_per_rank, buffer.group, 1, False)


def _dispatch(buffer: Buffer, case: Case, x, idx, w):
    """Sync-free compact dispatch; the current stream waits on the event (its hooks run)."""
    recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
        x, idx, w, num_experts=case.num_experts, do_cpu_sync=False, **case.stream_kwargs())
    event.current_stream_wait()
    return recv_x, recv_idx, recv_w, handle, event


def _check_outputs(buffer: Buffer, case: Case, outputs, ref, stats: Optional[dict]) -> None:
    """Every output and handle field equals the reference bitwise (`check_dispatch_outputs`:
    the valid prefix, the tail marked invalid, the counts); a prefix view retains the whole
    capacity allocation while its logical size is `n * H * 2` bytes."""
    recv_x = outputs[0]
    cap, hidden = buffer.num_ranks * buffer.num_max_tokens_per_rank, buffer.hidden
    n = int(ref.src_token.numel())
    assert tuple(recv_x.shape) == (cap, hidden), f"recv_x shape {tuple(recv_x.shape)} != {(cap, hidden)}"
    check_dispatch_outputs(buffer, case, outputs, ref)

    prefix = recv_x[:n]
    logical = prefix.numel() * prefix.element_size()
    storage = prefix.untyped_storage().nbytes()
    assert logical == n * hidden * 2, f"prefix logical bytes {logical} != {n} * {hidden} * 2"
    assert storage == cap * hidden * 2, \
        f"prefix retains {storage} bytes of storage, want capacity {cap} * {hidden} * 2"
    assert prefix.untyped_storage().data_ptr() == recv_x.untyped_storage().data_ptr(), \
        "the prefix must be a view of recv_x"
    released = prefix.clone()
    assert released.untyped_storage().nbytes() == n * hidden * 2, \
        "a cloned prefix must hold only the valid rows"
    if stats is not None:
        stats["logical_bytes"] += logical
        stats["storage_bytes"] += storage


def _later_case(case: Case, index: int, j: int) -> Case:
    """Other data (and another routing) for the j-th dispatch after case number `index`."""
    _, routing, tokens = ROUTING_CASES[(index + j + 1) % len(ROUTING_CASES)]
    return Case(**{**case.__dict__, "routing": routing, "tokens": tokens,
                   "seed": case.seed + 7919 * (j + 1)})


# ----------------------------------------------------------------------------- saved prefix


def check_saved_prefix(buffer: Buffer, case: Case, index: int, stats: dict) -> None:
    dev = buffer.device
    x, idx, w, gen = make_inputs(buffer, case)
    ref = _reference(buffer, case, x, idx, w)
    n = int(ref.src_token.numel())
    weight = torch.randn(buffer.hidden, GRAD_COLUMNS, generator=gen).to(dev).requires_grad_()
    grad_y = torch.randn(n, GRAD_COLUMNS, generator=gen).to(dev)

    outputs = _dispatch(buffer, case, x, idx, w)
    _check_outputs(buffer, case, outputs, ref, stats)
    info: dict = {}
    y = _SavedPrefixMatmul.apply(outputs[0][:n], weight, info)
    del outputs  # only the autograd graph keeps the prefix (and so the capacity block) alive

    # Three more dispatches with other data through the same buffer; their outputs are checked
    # and dropped, so the allocator recycles their blocks (and any block wrongly released).
    for j in range(LATER_DISPATCHES):
        other = _later_case(case, index, j)
        x2, idx2, w2, _ = make_inputs(buffer, other)
        ref2 = _reference(buffer, other, x2, idx2, w2)
        later = _dispatch(buffer, other, x2, idx2, w2)
        n2 = int(ref2.src_token.numel())
        assert_equal(f"later dispatch {j} recv_x prefix", later[0][:n2], ref2.recv_x)
        del later

    y.backward(grad_y)
    ref_weight = weight.detach().clone().requires_grad_()
    ref_info: dict = {}
    y_ref = _SavedPrefixMatmul.apply(ref.recv_x.to(dev), ref_weight, ref_info)
    y_ref.backward(grad_y)
    assert_equal("forward y from the saved prefix", y.detach(), y_ref.detach())
    assert_equal("weight gradient from the saved prefix (after 3 later dispatches)",
                 weight.grad, ref_weight.grad)
    cap = buffer.num_ranks * buffer.num_max_tokens_per_rank
    assert info["saved_storage_bytes"] == cap * buffer.hidden * 2, \
        f"saved prefix retains {info['saved_storage_bytes']} bytes, want {cap * buffer.hidden * 2}"
    assert info["saved_logical_bytes"] == n * buffer.hidden * 2, \
        f"saved prefix holds {info['saved_logical_bytes']} logical bytes, want {n * buffer.hidden * 2}"
    stats["saved_prefix"] += 1


# ----------------------------------------------------------------------------- delayed reader


def _cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of `torch.cuda._sleep`, measured once."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return max(cycles / max(start.elapsed_time(end), 1e-3), 5e5)


def _warm_up_reader_kernels(dev: torch.device, cap: int, hidden: int) -> None:
    """Load every kernel the window uses (fill, copy) before any sleep is in flight: a lazy
    module load can wait for the running sleep kernel, which would close every window."""
    scratch = torch.empty((cap, hidden), dtype=torch.bfloat16, device=dev)
    scratch.view(torch.int16).fill_(FILL_BITS)
    torch.empty_like(scratch).copy_(scratch)
    torch.empty((1, hidden), dtype=torch.bfloat16, device=dev).copy_(scratch[:1])
    torch.cuda.synchronize(dev)


def _release_library_references(buffer: Buffer) -> None:
    """With EP_AVOID_RECORD_STREAM=1 the buffer holds the outputs until their comm event has
    completed, and drops them at its next call; the caller has synchronized that event, so drop
    them now, as the next dispatch would."""
    drain = getattr(buffer, "release_completed", None) or getattr(buffer, "_drain_pending", None)
    if drain is not None:
        drain()


def _overlaps(ptrs: list[int], size: int, start: int, length: int) -> bool:
    return length > 0 and any(p < start + length and start < p + size for p in ptrs)


def check_delayed_reader(buffer: Buffer, case: Case, stats: dict, mode: str,
                         reader: "torch.cuda.Stream", cycles_per_ms: float, verbose: bool,
                         name: str) -> None:
    dev, group, rank = buffer.device, buffer.group, buffer.rank
    cap, hidden = buffer.num_ranks * buffer.num_max_tokens_per_rank, buffer.hidden
    capacity_bytes = cap * hidden * 2
    x, idx, w, _ = make_inputs(buffer, case)
    ref = _reference(buffer, case, x, idx, w)
    n = int(ref.src_token.numel())
    compute, comm = torch.cuda.current_stream(dev), buffer.get_comm_stream()
    alloc_stream = comm if case.allocate_on_comm_stream else compute
    delay_ms = FIRST_DELAY_MS
    stats["reader_cases"] += 1

    for attempt in range(1, MAX_ATTEMPTS + 1):
        stats["attempts"] += 1
        # Cache room for the receive tensor and the pressure on the allocation stream, so that no
        # cudaMalloc (which may serialize streams) happens inside the window.
        with torch.cuda.stream(alloc_stream):
            reserve = [torch.empty((cap, hidden), dtype=torch.bfloat16, device=dev)
                       for _ in range(PRESSURE_TENSORS + 1)]
        del reserve
        torch.cuda.synchronize(dev)
        recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
            x, idx, w, num_experts=case.num_experts, do_cpu_sync=False, **case.stream_kwargs())
        event.current_stream_wait()          # runs any hook (e.g. a deterministic epilogue)
        ready = torch.cuda.Event()
        ready.record(compute)                # readiness for other streams, after the hook
        prefix = recv_x[:n]
        assert prefix.untyped_storage().nbytes() == capacity_bytes, \
            f"prefix retains {prefix.untyped_storage().nbytes()} bytes, want {capacity_bytes}"
        block = prefix.untyped_storage().data_ptr()
        prefix_start = block + prefix.storage_offset() * prefix.element_size()
        with torch.cuda.stream(reader):
            dst = torch.empty((n, hidden), dtype=torch.bfloat16, device=dev)  # before the reader runs
        reader.wait_event(ready)
        with torch.cuda.stream(reader):
            torch.cuda._sleep(int(delay_ms * cycles_per_ms))
            before_copy = torch.cuda.Event()
            before_copy.record(reader)
            dst.copy_(prefix)
        if mode != "negative":
            prefix.record_stream(reader)
        # Every use the library knows about (comm stream, current stream) completes; none of
        # them depends on the reader. Then drop every reference to the receive tensors.
        event.synchronize()
        del recv_x, recv_idx, recv_w, handle, event, prefix
        _release_library_references(buffer)
        comm.synchronize()
        compute.synchronize()
        forced = mode == "schedule" and attempt == 1 and rank == 0
        if forced:
            reader.synchronize()             # rank 0 lets the reader finish: window missed
        with torch.cuda.stream(alloc_stream):
            pressure = [torch.empty((cap, hidden), dtype=torch.bfloat16, device=dev)
                        for _ in range(PRESSURE_TENSORS)]
            for tensor in pressure:
                tensor.view(torch.int16).fill_(FILL_BITS)
        alloc_stream.synchronize()
        window = not before_copy.query()     # the copy had not started when the writes were done
        ptrs = [t.data_ptr() for t in pressure]
        reused_block = _overlaps(ptrs, capacity_bytes, block, capacity_bytes)
        reused_prefix = _overlaps(ptrs, capacity_bytes, prefix_start, n * hidden * 2)
        reader.synchronize()
        got = _int16_bits(dst)
        corrupt = not bitwise_equal(dst, ref.recv_x)  # (a negative control counts it)
        pattern_rows = int((got == FILL_BITS).all(dim=1).sum()) if n else 0
        del pressure, dst

        flags = [None] * dist.get_world_size(group)
        dist.all_gather_object(flags, bool(window), group=group)
        agreed = all(flags)
        if attempt == 1:
            stats["first_attempt_flags"].append(flags)
            stats["forced_first_miss"] += int(forced and not window)
        if verbose:
            print(f"[rank {rank}] {name} attempt {attempt} delay {delay_ms:.0f} ms: window "
                  f"{'ok' if window else 'missed'} (all ranks: {flags}), n={n}, block reused "
                  f"{reused_block}, prefix overwritten {reused_prefix}, copy "
                  f"{'CORRUPT' if corrupt else 'ok'} ({pattern_rows}/{n} pressure rows)", flush=True)

        if mode != "negative":
            # With record_stream(reader) the copy is right whether or not the window was hit.
            assert not corrupt, (f"attempt {attempt}: the reader's copy differs from the reference "
                                 f"({pattern_rows}/{n} rows hold the pressure pattern; block "
                                 f"reused by the pressure: {reused_block}, window {window})")
            if window:
                assert not reused_block, (f"attempt {attempt}: the allocator handed out the "
                                          f"receive block while the reader was still pending")
        if agreed:
            stats["windows"] += 1
            stats["reused_in_window"] += int(reused_block)
            if mode == "negative" and n > 0:
                stats["detectable"] += int(reused_prefix)
                stats["detections"] += int(corrupt)
                if corrupt:
                    stats["detected_cases"].append(stats["reader_cases"])
                stats["undetected"] += int(reused_prefix and not corrupt)
            return
        stats["retries"] += 1
        delay_ms *= DELAY_GROWTH
    stats["uncovered"] += 1


# ----------------------------------------------------------------------------- one process


def run_lifetime(device: str, policy: str, num_tokens: int, hidden: int, mode: str, seed: int,
                 verbose: bool = False) -> dict:
    """One rank: every (deterministic, allocation stream, routing) case; returns counters."""
    assert mode in MODES, mode
    os.environ["EP_AVOID_RECORD_STREAM"] = policy  # read when a Buffer is constructed
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    stats = _new_stats()
    stats["device"] = str(dev)
    reader = torch.cuda.Stream(device=dev) if cuda else None
    cycles_per_ms = _cycles_per_ms() if cuda else 0.0
    if cuda:
        _warm_up_reader_kernels(dev, dist.get_world_size() * num_tokens, hidden)
    stats["reader"] = "run" if cuda else "skipped (no CUDA)"
    rank = dist.get_rank()
    for det in (False, True):
        buffer = Buffer(dist.group.WORLD, num_tokens, hidden, NUM_TOPK, deterministic=det,
                        device=dev)
        assert buffer.avoid_record_stream == (policy == "1"), "EP_AVOID_RECORD_STREAM not applied"
        stats["backend"] = buffer.backend
        num_experts = EXPERTS_PER_RANK * buffer.num_ranks
        for on_comm in (False, True):
            for i, (label, routing, tokens) in enumerate(ROUTING_CASES):
                case = Case(routing=routing, tokens=tokens, num_experts=num_experts,
                            do_cpu_sync=False, async_with_compute_stream=True,
                            allocate_on_comm_stream=on_comm,
                            seed=seed + 100 * det + 10 * on_comm + i)
                name = (f"seed {seed} rank {rank} policy {policy} {buffer.backend} "
                        f"deterministic={det} alloc={'comm' if on_comm else 'compute'} {label}")
                stats["cases"] += 1
                try:
                    check_saved_prefix(buffer, case, i, stats)
                    if cuda:
                        check_delayed_reader(buffer, case, stats, mode, reader, cycles_per_ms,
                                             verbose, name)
                except AssertionError as exc:
                    raise AssertionError(f"{name}: {exc}") from None
        buffer.destroy()
    return stats


# ----------------------------------------------------------------------------- evaluation


def evaluate(mode: str, per_rank: list[dict]) -> tuple[dict, list[str]]:
    """A table row and the list of problems (empty: the run passes)."""
    first = per_rank[0]
    cases = first["cases"]
    problems = []
    row = dict(backend=first["backend"], device=first["device"], cases=cases,
               saved_prefix=f"{min(s['saved_prefix'] for s in per_rank)}/{cases}")
    if any(s["saved_prefix"] != cases for s in per_rank):
        problems.append("saved-prefix cases incomplete")
    logical = sum(s["logical_bytes"] for s in per_rank)
    storage = sum(s["storage_bytes"] for s in per_rank)
    row["bytes"] = f"{logical / max(storage, 1):.1%}"
    if first["reader"] != "run":
        row.update(windows=first["reader"], retries="-", detections="-", reused="-")
        return row, problems
    row["windows"] = f"{first['windows']}/{first['reader_cases']}"
    row["retries"] = str(first["retries"])
    reused = sum(s["reused_in_window"] for s in per_rank)
    row["reused"] = str(reused)
    if any(s["uncovered"] for s in per_rank):
        problems.append(f"{first['uncovered']} case(s) never got a valid window in "
                        f"{MAX_ATTEMPTS} attempts (not counted as coverage)")
    if len({(s["windows"], s["retries"], s["attempts"]) for s in per_rank}) != 1:
        problems.append("ranks disagree on windows/retries (they must retry together)")
    if mode == "negative":
        detections = sum(s["detections"] for s in per_rank)
        detectable = sum(s["detectable"] for s in per_rank)
        undetected = sum(s["undetected"] for s in per_rank)
        cases_hit = len(set().union(*(s["detected_cases"] for s in per_rank)))
        row["detections"] = (f"{detections} rank-cases in {cases_hit}/{first['reader_cases']} "
                             f"cases (prefix overwritten: {detectable})")
        if detections == 0:
            problems.append("negative control detected no corruption: the test cannot fail")
        if undetected:
            problems.append(f"{undetected} rank-case(s) had the prefix overwritten in a valid "
                            f"window and still copied the right bits (inconsistent)")
    else:
        row["detections"] = "0 (want 0)"
        if reused:
            problems.append("a pressure tensor reused the receive block inside a window")
    if mode == "schedule":
        forced = first["forced_first_miss"]
        row["retries"] += f" (forced {forced})"
        if forced != first["reader_cases"]:
            problems.append(f"rank 0 missed {forced} of {first['reader_cases']} first windows")
        if first["retries"] < first["reader_cases"]:
            problems.append("a forced miss did not make every rank retry")
        for flags in first["first_attempt_flags"]:
            if flags[0]:
                problems.append(f"first-attempt window flags {flags}: rank 0 was not forced")
                break
    return row, problems


def format_table(title: str, rows: list[dict]) -> str:
    columns = ("policy", "mode", "status", "backend", "device", "cases", "saved_prefix",
               "windows", "retries", "detections", "reused", "bytes", "seconds")
    headers = ("policy", "mode", "status", "backend", "device", "cases", "saved-prefix",
               "valid windows", "retries", "detections", "block reused", "valid/retained bytes", "s")
    cells = [[str(r.get(c, "-")) for c in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = [title, "  ".join(h.ljust(wd) for h, wd in zip(headers, widths))]
    lines += ["  ".join(c.ljust(wd) for c, wd in zip(cell, widths)) for cell in cells]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- pytest

if pytest is not None:
    _CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA_REASON)
    DEVICES = ["cpu", pytest.param("cuda", marks=_CUDA_ONLY)]

    # The sizes on CUDA; small ones on CPU ranks, where the symmetric backend (if
    # chosen) runs in the Triton interpreter at about 2 s per dispatch with M=64, H=512.
    SIZES = {"cuda": (64, 512), "cpu": (8, 64)}

    def _run(device: str, policy: str, mode: str) -> None:
        num_tokens, hidden = SIZES[device]
        per_rank = run_local_ranks(run_lifetime, 2, device, policy, num_tokens, hidden, mode,
                                   BASE_SEED)
        row, problems = evaluate(mode, per_rank)
        status = "FAIL" if problems else "PASS"
        print(format_table(f"seed {BASE_SEED}", [{"policy": policy, "mode": mode, "status": status,
                                                   **row}]))
        assert not problems, f"seed {BASE_SEED}: " + "; ".join(problems)

    @pytest.mark.parametrize("policy", ["0", "1"])
    @pytest.mark.parametrize("device", DEVICES)
    def test_recv_lifetime(device: str, policy: str) -> None:
        """Saved-prefix backward and bitwise outputs (CPU and CUDA); delayed reader (CUDA)."""
        _run(device, policy, "normal")

    @_CUDA_ONLY
    @pytest.mark.parametrize("policy", ["0", "1"])
    def test_negative_control_detects_missing_record_stream(policy: str) -> None:
        _run("cuda", policy, "negative")

    @_CUDA_ONLY
    @pytest.mark.parametrize("policy", ["0", "1"])
    def test_schedule_control_retries_together(policy: str) -> None:
        _run("cuda", policy, "schedule")


# ----------------------------------------------------------------------------- standalone


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--num-tokens", type=int, default=64, help="M, num_max_tokens_per_rank")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--policies", default="0,1", help="EP_AVOID_RECORD_STREAM values, one "
                        "process group each (default 0,1)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--seed", type=int, default=BASE_SEED)
    parser.add_argument("--verbose", action="store_true", help="one line per reader attempt")
    control = parser.add_mutually_exclusive_group()
    control.add_argument("--negative-control", action="store_true",
                         help="leave out the reader's record_stream: corruption must be detected")
    control.add_argument("--schedule-control", action="store_true",
                         help="rank 0 misses the first window of every case: all ranks retry")
    args = parser.parse_args(argv)
    mode = "negative" if args.negative_control else "schedule" if args.schedule_control else "normal"
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    if device == "cpu":
        print(f"SKIP delayed cross-stream reader: {NO_CUDA_REASON}; running the saved-prefix "
              f"cases on CPU ranks", flush=True)
        if mode != "normal":
            print(f"SKIP --{mode}-control: it exercises the delayed reader, which needs CUDA",
                  flush=True)
    rows, failures = [], []
    for policy in [p.strip() for p in args.policies.split(",") if p.strip()]:
        assert policy in ("0", "1"), f"policy must be 0 or 1, got {policy!r}"
        start = time.monotonic()
        row = {"policy": policy, "mode": mode}
        try:
            per_rank = run_local_ranks(run_lifetime, args.num_processes, device, policy,
                                       args.num_tokens, args.hidden, mode, args.seed, args.verbose)
            evaluated, problems = evaluate(mode, per_rank)
            row.update(evaluated)
            row["status"] = "FAIL" if problems else \
                "SKIP" if mode != "normal" and evaluated["windows"].startswith("skipped") else "PASS"
            failures += [f"policy {policy}: {p}" for p in problems]
        except Exception as exc:  # a rank's assertion: report it, keep the other policy going
            row["status"] = "FAIL"
            failures.append(f"policy {policy}: {exc}")
        row["seconds"] = f"{time.monotonic() - start:.1f}"
        rows.append(row)
    for failure in failures:
        print(f"FAILURE {failure}", file=sys.stderr, flush=True)
    title = (f"=== recv-lifetime: {args.num_processes} processes, M={args.num_tokens}, "
             f"H={args.hidden}, K={NUM_TOPK}, E={EXPERTS_PER_RANK}*R, device={device}, "
             f"mode={mode}, seed={args.seed} ===")
    print(format_table(title, rows), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
