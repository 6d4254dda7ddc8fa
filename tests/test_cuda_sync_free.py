"""Sync-free dispatch on CUDA: no host synchronization (nor in a cached dispatch or a combine
of a synchronizing dispatch's handle), and capture in a CUDA graph.

One rank over NCCL (NCCL refuses two ranks on one GPU), so the collective backend runs fully
on the device. Each replay gets new data and is checked bitwise against the reference.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from epcomm import Buffer
from epcomm.testing.launch import capture_graph, run_local_ranks
from epcomm.testing.reference import reference_combine, reference_dispatch
from epcomm.testing.verify import (Case, assert_equal, assert_filled, check_round_trip, make_inputs,
                                   make_routing)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA tests need a GPU (none on this machine)")
SEED = int(os.environ.get("EPCOMM_TEST_SEED", time.time_ns() % 1_000_000))
BACKENDS = ["collective", "symmetric"]


def run_sync_debug(backend: str, seed: int) -> int:
    buffer = Buffer(dist.group.WORLD, 64, 256, 4, backend=backend)
    count = 0
    for expand in (False, True):
        case = Case(num_experts=8, do_cpu_sync=False, do_expand=expand, expert_alignment=8,
                    num_bias=2, do_zero_padding=True, check_cached=True, seed=seed + count)
        check_round_trip(buffer, case)  # warm-up: kernels compiled, allocator primed
        # The same calls again with every device-to-host synchronization turned into an error.
        x, idx, w, _ = make_inputs(buffer, case)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            recv_x, _, recv_w, handle, _ = buffer.dispatch(x, idx, w, num_experts=8, do_cpu_sync=False,
                                                           do_expand=expand, expert_alignment=8)
            buffer.dispatch(x, topk_weights=w, handle=handle)
            buffer.combine(recv_x, handle, topk_weights=recv_w)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        # A synchronizing dispatch reads the host once; a cached dispatch with its handle and
        # the combine of it read nothing.
        recv_x, _, recv_w, handle, _ = buffer.dispatch(x, idx, w, num_experts=8, do_cpu_sync=True,
                                                       do_expand=expand, expert_alignment=8)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            buffer.dispatch(x, topk_weights=w, handle=handle)
            buffer.combine(recv_x, handle, topk_weights=recv_w)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        count += 1
    return count


@pytest.mark.parametrize("backend", BACKENDS)
def test_sync_free_makes_no_host_sync(backend: str) -> None:
    assert run_local_ranks(run_sync_debug, 1, backend, SEED, pg_backend="nccl") == [2]


def run_graph(backend: str, seed: int) -> int:
    os.environ["EP_AVOID_RECORD_STREAM"] = "1"
    M, H, K, E = 32, 128, 4, 8
    buffer = Buffer(dist.group.WORLD, M, H, K, backend=backend)
    group = buffer.group
    static_x = torch.zeros(M, H, dtype=torch.bfloat16, device="cuda")
    static_idx = torch.full((M, K), -1, dtype=torch.long, device="cuda")
    static_w = torch.zeros(M, K, device="cuda")

    def step():
        recv_x, _, recv_w, handle, _ = buffer.dispatch(static_x, static_idx, static_w, num_experts=E,
                                                       do_cpu_sync=False, do_expand=True,
                                                       expert_alignment=4)
        expert_out = (recv_x.float() * 2).to(torch.bfloat16)
        combined, combined_w, _ = buffer.combine(expert_out, handle, topk_weights=recv_w)
        return recv_x, handle, combined, combined_w

    graph, (recv_x, handle, combined, combined_w) = capture_graph(step)

    gen = torch.Generator().manual_seed(seed)
    replays = 0
    for routing in ("balanced", "masked", "skewed", "same_rank"):
        x = torch.randn(M, H, generator=gen).to(torch.bfloat16)
        idx = make_routing(routing, M, K, E, 1, gen)
        w = torch.rand(M, K, generator=gen)
        static_x.copy_(x); static_idx.copy_(idx); static_w.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_dispatch(x.cuda(), idx.cuda(), w.cuda(), E, M, group, 4, True)
        n_e = ref.expand_valid.numel()
        valid = ref.expand_valid
        assert_equal(f"replay {routing}: recv_x", recv_x[:n_e][valid], ref.recv_x[valid])
        want, want_w = reference_combine((recv_x[:n_e].float() * 2).to(torch.bfloat16), ref, idx.cuda(), E,
                                         group, topk_weights=ref.recv_topk_weights)
        assert_equal(f"replay {routing}: combined_x", combined, want)
        assert_equal(f"replay {routing}: combined_topk_weights", combined_w, want_w)
        assert_equal(f"replay {routing}: psum per expert", handle.psum_num_recv_tokens_per_expert,
                     ref.expert_starts + ref.num_recv_tokens_per_expert)
        replays += 1
    # Eager calls through the same buffer after the capture, on another stream than the one
    # captured (no call may wait on an event recorded during the capture), then a replay.
    eager_x, _, eager_combined, eager_w = step()
    graph.replay()
    torch.cuda.synchronize()
    assert_equal("eager after capture: recv_x", eager_x[:n_e][valid], ref.recv_x[valid])
    assert_equal("eager after capture: combined_x", eager_combined, want)
    assert_equal("eager after capture: combined_topk_weights", eager_w, want_w)
    assert_equal("replay after eager calls: combined_x", combined, want)
    return replays


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_capture_and_replay(backend: str) -> None:
    assert run_local_ranks(run_graph, 1, backend, SEED, pg_backend="nccl") == [4]


def run_prepared_shapes(backend: str, seed: int) -> int:
    """Round trips on one buffer whose call shapes come back after others (the second call of
    a shape takes the buffer's prepared call; on the symmetric backend 64 experts replace the
    receive scratch the 8-expert plan points at; the collective backend's prepared calls
    replay CUDA graphs of their own, on whichever stream the call runs, and its synchronizing
    ones, over padded blocks at this size, too: a combine of their handle gets exact-size rows
    that change per call), with stream options that leave the direct path, each checked
    bitwise against the reference. Then, with the collective backend's graphs at their limit,
    a new call shape runs its prepared calls without one."""
    buffer = Buffer(dist.group.WORLD, 64, 256, 4, backend=backend)
    sync, expand_sync = dict(do_cpu_sync=True), dict(do_cpu_sync=True, do_expand=True)
    calls = [(8, {}), (8, {}), (8, sync), (8, sync), (8, dict(async_with_compute_stream=True)),
             (64, {}), (8, sync), (8, {}), (64, expand_sync),
             (8, dict(allocate_on_comm_stream=True, use_previous_event=True)),
             (64, expand_sync), (64, expand_sync), (8, {}), (64, dict(do_expand=True)), (64, {})]
    for count, (experts, options) in enumerate(calls):
        check_round_trip(buffer, Case(num_experts=experts, seed=seed + count,
                                      **{"do_cpu_sync": False, **options}))
    if backend == "collective":
        from epcomm.backends.graphed import GRAPH_MEMORY
        path = buffer._backend._kernels
        graphed = [plan.graph is not None for plan in (*path.plans.values(),
                                                        *path.combine_plans.values())]
        assert all(graphed) and 0 < path.graph_bytes <= GRAPH_MEMORY, graphed
        assert any(plan.host is not None and plan.graph is not None
                   for plan in path.plans.values())  # (a synchronizing call's graph)
        path.graph_bytes = GRAPH_MEMORY
        for count in range(3):
            check_round_trip(buffer, Case(num_experts=16, do_cpu_sync=False,
                                          seed=seed + 100 + count))
        assert path.graph_bytes == GRAPH_MEMORY and \
            all(plan.graph is None for plan in path.plans.values() if plan.call.num_experts == 16)
    return len(calls)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prepared_dispatch_across_call_shapes(backend: str) -> None:
    assert run_local_ranks(run_prepared_shapes, 1, backend, SEED, pg_backend="nccl") == [15]


def run_empty_first(backend: str, seed: int) -> int:
    """Calls without tokens first (empty tensors: an address of 0, which a kernel's first
    compile types int32), then calls with tokens, whose addresses need int64 (their second
    call of a shape prepared): every round trip bitwise against the reference."""
    buffer = Buffer(dist.group.WORLD, 16, 256, 4, backend=backend)
    cases = [Case(tokens="empty_last", do_cpu_sync=sync, do_expand=expand)
             for expand in (False, True) for sync in (False, True)]
    cases += [Case(tokens="full", do_cpu_sync=sync, do_expand=expand)
              for _ in range(2) for expand in (False, True) for sync in (False, True)]
    for count, case in enumerate(cases):
        check_round_trip(buffer, replace(case, seed=seed + count))
    return len(cases)


@pytest.mark.parametrize("backend", BACKENDS)
def test_calls_with_tokens_after_empty_ones(backend: str) -> None:
    assert run_local_ranks(run_empty_first, 1, backend, SEED, pg_backend="nccl") == [12]


def run_invalid_ids(backend: str, seed: int) -> str:
    """A sync-free GPU dispatch treats ids outside [-1, E) as -1 without reading back, and the
    next check reports them."""
    from epcomm import EPError
    buffer = Buffer(dist.group.WORLD, 16, 64, 2, backend=backend)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 64, generator=gen).to(torch.bfloat16).cuda()
    idx = make_routing("balanced", 16, 2, 4, 1, gen)
    bad = idx.clone()
    bad[::3, 1] = 4 + 1000
    bad[1, 0] = -7
    recv_x, recv_idx, _, handle, _ = buffer.dispatch(x, bad.cuda(), num_experts=4, do_cpu_sync=False)
    sanitized = torch.where((bad >= 0) & (bad < 4), bad, -1)
    ref = reference_dispatch(x, sanitized.cuda(), None, 4, 16, buffer.group)
    n = ref.src_token.numel()
    assert_equal("recv_x with invalid ids", recv_x[:n], ref.recv_x)
    assert_equal("recv_topk_idx with invalid ids", recv_idx[:n], ref.recv_topk_idx)
    try:
        buffer.check_errors()
    except EPError as exc:
        assert "expert id" in str(exc), str(exc)
    else:
        raise AssertionError("check_errors() did not report the invalid expert ids")
    buffer.check_errors()  # the flag was cleared
    return "ok"


@pytest.mark.parametrize("backend", BACKENDS)
def test_invalid_ids_flagged_not_read_back(backend: str) -> None:
    assert run_local_ranks(run_invalid_ids, 1, backend, SEED, pg_backend="nccl") == ["ok"]


def run_early_drop(backend: str, seed: int) -> int:
    """Inputs and outputs of a call with `async_with_compute_stream=False` may be dropped as soon
    as it returns, while the comm stream has not yet run it: each call's results equal those of
    the same call with every tensor kept alive, and blocks of dropped outputs refilled at once
    keep the refill (the current stream waits for the comm stream before it runs the fill; the
    library calls no `record_stream` on those outputs)."""
    buffer = Buffer(dist.group.WORLD, 256, 512, 4, backend=backend)
    comm = buffer.get_comm_stream()

    def busy_comm_stream() -> None:
        with torch.cuda.stream(comm):
            torch.cuda._sleep(50_000_000)  # about 25 ms: the call below is queued behind it

    def overwrite_freed(*like: torch.Tensor) -> None:
        for tensor in like:  # the freed blocks, refilled on the current stream
            torch.empty_like(tensor).fill_(7)

    checked = 0
    for expand in (False, True):
        case = Case(num_experts=8, do_cpu_sync=False, do_expand=expand, do_zero_padding=True,
                    seed=seed + checked)
        x, idx, w, _ = make_inputs(buffer, case)
        kwargs = dict(num_experts=8, do_cpu_sync=False, do_expand=expand, do_zero_padding=True)
        want_x, want_idx, want_w, want_handle, _ = buffer.dispatch(x, idx, w, **kwargs)
        want_out, want_out_w, _ = buffer.combine(want_x, want_handle, topk_weights=want_w)
        torch.cuda.synchronize()

        inputs = [x.clone(), idx.clone(), w.clone()]
        busy_comm_stream()
        recv_x, recv_idx, recv_w, handle, _ = buffer.dispatch(*inputs, **kwargs)
        del inputs
        overwrite_freed(x, idx, w)
        torch.cuda.synchronize()
        for name, got, want in (("recv_x", recv_x, want_x), ("recv_topk_idx", recv_idx, want_idx),
                                ("recv_topk_weights", recv_w, want_w)):
            # (no recv_topk_idx in the expand layout: both None)
            assert_equal(f"{name} after its inputs were dropped", got, want)

        combine_inputs = [recv_x.clone(), recv_w.clone()]
        busy_comm_stream()
        out, out_w, _ = buffer.combine(combine_inputs[0], handle, topk_weights=combine_inputs[1])
        del combine_inputs
        overwrite_freed(recv_x, recv_w)
        torch.cuda.synchronize()
        assert_equal("combined_x after its inputs were dropped", out, want_out)
        assert_equal("combined weights after its inputs were dropped", out_w, want_out_w)

        busy_comm_stream()
        dropped = [t for t in buffer.dispatch(x, idx, w, **kwargs)[:3] if t is not None]
        like = [(t.shape, t.dtype) for t in dropped]
        del dropped
        refills = [torch.full(shape, 7, dtype=dtype, device=x.device) for shape, dtype in like]
        torch.cuda.synchronize()
        for index, refill in enumerate(refills):
            # the comm stream must not write a dropped output's block after the current stream
            # refilled it
            assert_filled(f"refill {index} of a dropped output's block", refill, 7)
        checked += 1
    return checked


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_dropped_after_a_call_stay_safe(backend: str) -> None:
    assert run_local_ranks(run_early_drop, 1, backend, SEED, pg_backend="nccl") == [2]
