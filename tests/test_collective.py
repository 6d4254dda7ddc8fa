"""The collective backend on CPU ranks over gloo: one payload all-to-all per direction, calls
that disagree across ranks raise a clear error (no gloo abort, no garbage), faults (timeout,
lost peer) are reported with the stage and the timeout that applied, and the NaN rule."""
from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from epcomm import Buffer, errors
from epcomm.backends.collective import CollectiveBackend
from epcomm.testing.launch import run_local_ranks
from epcomm.testing.reference import reference_combine, reference_dispatch
from epcomm.testing.verify import Case, assert_equal, check_round_trip

SEED = int(os.environ.get("EPCOMM_TEST_SEED", time.time_ns() % 1_000_000))
M, H, K = 8, 64, 4


def _count_all_to_alls(calls: list) -> None:
    """Record in `calls` the shape of every `all_to_all_single` the collective backend makes
    in this process (not the reference's)."""
    real = dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        if sys._getframe(1).f_globals["__name__"] == "epcomm.backends.collective":
            calls.append(tuple(input.shape))
        return real(output, input, *args, **kwargs)
    dist.all_to_all_single = counting


def _payload_calls(calls: list) -> list:
    """The all-to-alls of records (the header exchanges move [R, header words] int64)."""
    return [shape for shape in calls if shape[1:] != (len(errors.CALL_FIELDS) + 1,)]


def run_one_all_to_all_per_direction(seed: int) -> int:
    buffer = Buffer(dist.group.WORLD, M, H, K, backend="collective")
    calls: list = []
    _count_all_to_alls(calls)
    checked = 0
    for expand, sync in ((False, True), (True, False)):
        case = Case(num_experts=4 * buffer.num_ranks, do_expand=expand, do_cpu_sync=sync,
                    expert_alignment=4 if expand else 1, num_bias=1, routing="skewed",
                    check_cached=False, seed=seed + checked)
        calls.clear()
        check_round_trip(buffer, case)  # bitwise against the reference (its own collectives
        # are gathers, not all_to_all_single)
        payload = _payload_calls(calls)
        # a dispatch and a combine: one payload all-to-all each, and each a header exchange
        assert len(payload) == 2, calls
        assert len(calls) - len(payload) == 2, calls
        checked += 1
    # With the counts on the host (gloo), a sync-free dispatch moves exact splits: 2 tokens,
    # both to rank 0 only, send a header row per rank and 2 records, not R blocks of M + 1 rows.
    x = torch.ones(2, H, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1, -1, -1], [1, -1, -1, -1]])
    calls.clear()
    recv_x, _, _, handle, _ = buffer.dispatch(x, idx, num_experts=4 * buffer.num_ranks,
                                              do_cpu_sync=False)
    assert _payload_calls(calls)[0][0] == buffer.num_ranks + 2, calls
    assert recv_x.shape[0] == buffer.num_ranks * M  # the sync-free shapes stay the capacity
    rows = buffer.num_ranks * 2 if buffer.rank == 0 else 0
    assert int(handle.psum_num_recv_tokens_per_scaleup_rank[-1]) == rows
    assert torch.equal(recv_x[:rows], torch.ones(rows, H, dtype=torch.bfloat16))
    return checked + 1


# Each case: what rank 1 passes differently, and the field the error must name.
MISMATCHES = [
    ("num_experts", dict(num_experts=16), "num_experts"),
    ("M", dict(num_max_tokens_per_rank=4), "num_max_tokens_per_rank"),
    ("layout", dict(do_expand=True), "do_expand"),
    ("sync", dict(do_cpu_sync=False), "do_cpu_sync"),
    ("dtype", dict(fp8=True), "row bytes"),
    ("weights", dict(weights=False), "topk_weights given"),
]


def run_mismatches(seed: int) -> list:
    from epcomm.fp8 import per_token_cast_to_fp8
    buffer = Buffer(dist.group.WORLD, M, H, K, backend="collective", use_fp8_dispatch=True)
    rank = buffer.rank
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(4, H, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, 8, (4, K), generator=gen)
    w = torch.rand(4, K, generator=gen)
    seen = []
    for name, change, field in MISMATCHES:
        args = dict(num_experts=8, num_max_tokens_per_rank=M, do_expand=False, do_cpu_sync=True,
                    fp8=False, weights=True)
        if rank == 1:
            args.update(change)
        payload = per_token_cast_to_fp8(x) if args.pop("fp8") else x
        weights = w if args.pop("weights") else None
        start = time.monotonic()
        with pytest.raises(errors.EPMismatchError) as info:
            buffer.dispatch(payload, idx, weights, **args)
        assert time.monotonic() - start < 5, name
        text = str(info.value)
        assert field in text and "rank 0" in text and "rank 1" in text, (name, text)
        seen.append(name)
    # The ranks stay in step: a cached dispatch of FP8 rows on one rank and BF16 on the other
    # (rows of other sizes: gloo would abort), a combine whose peer passed weights while this
    # rank did not, then a correct round trip.
    out = buffer.dispatch(x, idx, w, num_experts=8)
    with pytest.raises(errors.EPMismatchError, match="row bytes"):
        buffer.dispatch(per_token_cast_to_fp8(x) if rank == 1 else x, handle=out[3])
    with pytest.raises(errors.EPMismatchError, match="topk_weights given"):
        buffer.combine(out[0], out[3], topk_weights=out[2] if rank == 0 else None)
    check_round_trip(buffer, Case(num_experts=8, seed=seed))
    return seen


def run_device_header_check(seed: int) -> str:
    """The sync-free check that runs on the device (over NCCL): a peer's block header that
    differs sets CALL_MISMATCH / OUT_OF_STEP and names the peer in the flag."""
    buffer = Buffer(dist.group.WORLD, M, H, K, backend="collective")
    backend: CollectiveBackend = buffer._backend
    gen = torch.Generator().manual_seed(seed + buffer.rank)
    x = torch.randn(4, H, generator=gen).to(torch.bfloat16)
    out = buffer.dispatch(x, torch.randint(0, 8, (4, K), generator=gen), num_experts=8,
                          do_cpu_sync=False)
    state = out[3].backend_state
    header = backend._header(0, False, 8, M, False, 2 * H, False)
    rows = backend._header_rows(header, state.received.counts)
    buf = torch.zeros(state.received.rows + 1, 128, dtype=torch.uint8)
    buf.view(torch.int64)[:, :rows.shape[1]].index_copy_(0, state.received.start, rows)
    backend._check_headers(buf, state.received, rows[0])
    assert int(backend.error_flags()) == 0
    buf.view(torch.int64)[state.received.start[0], 3] += 1      # num_experts of rank 0
    backend._check_headers(buf, state.received, rows[0])
    flags = int(backend.error_flags())
    assert flags & errors.CALL_MISMATCH and not flags & errors.OUT_OF_STEP
    backend.error_flags().zero_()
    buf.view(torch.int64)[state.received.start[0], 0] += 1      # its call number
    backend._check_headers(buf, state.received, rows[0])
    return errors.describe_flags(int(backend.error_flags()))


def run_timeout(seed: int, timeout_s: float, late_s: float) -> str:
    buffer = Buffer(dist.group.WORLD, M, H, K, backend="collective", timeout_s=timeout_s)
    x = torch.randn(2, H).to(torch.bfloat16)
    idx = torch.tensor([[0, 1, 4, 5], [2, 3, 6, 7]])
    buffer.dispatch(x, idx, num_experts=8)  # connected and in step
    if buffer.rank == 1:
        time.sleep(late_s)
    start = time.monotonic()
    try:
        buffer.dispatch(x, idx, num_experts=8)
    except errors.EPFaultError as exc:
        elapsed = time.monotonic() - start
        if buffer.rank == 1:  # its peer gave up: a lost peer or a timeout, never an abort
            return "fault"
        assert f"{timeout_s:g} s" in str(exc) and "dispatch" in str(exc), str(exc)
        assert timeout_s * 0.9 < elapsed < timeout_s + 3, elapsed
        with pytest.raises(errors.EPBrokenError, match="timed out"):
            buffer.dispatch(x, idx, num_experts=8)
        return "timeout"
    return "ok"


def test_timeout_fires_at_timeout_s_and_then_the_buffer_is_broken() -> None:
    # the group's timeout (30 s) is longer than the buffer's: the buffer's applies
    assert run_local_ranks(run_timeout, 2, SEED, 0.5, 1.2, timeout_s=30) == ["timeout", "fault"]


def test_timeout_s_longer_than_the_groups_applies() -> None:
    # the group's timeout (0.5 s) is shorter than the buffer's (3 s): a peer 1 s late is in time
    assert run_local_ranks(run_timeout, 2, SEED, 3.0, 1.0, timeout_s=0.5) == ["ok", "ok"]


def run_peer_exits(stage: str) -> str:
    buffer = Buffer(dist.group.WORLD, M, H, K, backend="collective", timeout_s=20)
    x = torch.randn(2, H).to(torch.bfloat16)
    idx = torch.tensor([[0, 1, 4, 5], [2, 3, 6, 7]])
    out = buffer.dispatch(x, idx, num_experts=8)
    if buffer.rank == 1:
        return "left"  # the process group is destroyed, the process exits
    time.sleep(0.7)
    start = time.monotonic()
    with pytest.raises(errors.EPPeerLostError) as info:
        if stage == "combine":
            buffer.combine(out[0], out[3])
        else:
            buffer.dispatch(x, idx, num_experts=8)
    assert time.monotonic() - start < 10
    text = str(info.value)
    assert stage in text and "rank 1" in text, text
    return text


@pytest.mark.parametrize("stage", ["dispatch (count exchange)", "combine"])
def test_lost_peer_names_the_stage(stage: str) -> None:
    result = run_local_ranks(run_peer_exits, 2, stage, timeout_s=30)
    assert result[1] == "left", result


def run_nan_rule(seed: int) -> int:
    buffer = Buffer(dist.group.WORLD, M, H, K, backend="collective")
    group, rank = buffer.group, buffer.rank
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(M, H, generator=gen).to(torch.bfloat16)
    bits = x.view(torch.int16)
    bits[0, :4] = torch.tensor([0x7FC1, -1, 0x7F81, -0x0040], dtype=torch.int16)  # NaN payloads
    idx = torch.randint(0, 8, (M, K), generator=gen)
    idx[:, 1] = (idx[:, 0] + 4) % 8  # every token goes to both ranks
    w = torch.rand(M, K, generator=gen)
    checked = 0
    for expand in (False, True):
        for sync in (True, False):
            recv_x, _, recv_w, handle, _ = buffer.dispatch(x, idx, w, num_experts=8,
                                                           do_expand=expand, do_cpu_sync=sync)
            ref = reference_dispatch(x, idx, w, 8, M, group, 1, expand)
            rows = ref.recv_x.shape[0]
            assert_equal("recv_x moves NaN payloads unchanged", recv_x[:rows], ref.recv_x)
            y, y_w = recv_x.clone(), recv_w.clone()
            y[:rows].view(torch.int16)[:, 4] = -0x0001                 # 0xFFFF, another NaN
            y_w.view(torch.int32)[:rows][0] = -1                       # 0xFFFFFFFF
            combined, combined_w, _ = buffer.combine(y, handle, topk_weights=y_w)
            want, want_w = reference_combine(y[:rows], ref, idx, 8, group,
                                             topk_weights=y_w[:rows])
            nan = want.isnan()
            assert nan.any()
            assert (combined.view(torch.int16)[nan] == 0x7FC0).all(), "NaN not canonical"
            assert_equal("combined_x (NaN canonical)", combined, want)
            assert_equal("combined_topk_weights (NaN canonical)", combined_w, want_w)
            checked += 1
    return checked


def run_calls(seed: int) -> list:
    """Every check of calls that do not fault, on one pair of ranks (one start-up)."""
    return [run_one_all_to_all_per_direction(seed), run_mismatches(seed), run_nan_rule(seed),
            run_device_header_check(seed)]


def test_calls() -> None:
    """One payload all-to-all per direction (bitwise against the reference), of exact splits
    over gloo, sync-free calls too; each argument that differs across ranks raises
    EPMismatchError naming it, and the ranks stay in step; NaN payloads move unchanged and a
    NaN sum is canonical; the device-side header check."""
    names = [name for name, _, _ in MISMATCHES]
    for checked, mismatches, nan_cases, text in run_local_ranks(run_calls, 2, SEED,
                                                                timeout_s=30):
        assert (checked, mismatches, nan_cases) == (3, names, 4)
        assert "out of step" in text and "first seen from rank 0" in text, text
