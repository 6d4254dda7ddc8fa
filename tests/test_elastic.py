"""`epcomm.ElasticBuffer`, DeepEP V2's interface: the surface (every constructor, dispatch and
combine argument, the attributes and hints), type errors, sizing by bytes alone, one buffer for
any top-k, `do_cpu_sync=None`, cached dispatch (the handle's M, no host read, the same handle),
reassignable handle fields, the received-count statistics, TMA-aligned column-major scales,
the single-reduction combine, and `EventOverlap`. Results bitwise against
`epcomm.testing.reference` (through `epcomm.testing.verify`), on local CPU ranks (collective
backend, and the symmetric backend under the Triton interpreter); the same on a GPU when there
is one.
"""
from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
import torch.distributed as dist

import epcomm
from epcomm import ElasticBuffer, EPHandle, EventHandle, EventOverlap
from epcomm.fp8 import per_token_cast_to_fp8
from epcomm.testing.launch import capture_graph, run_seeded
from epcomm.testing.reference import reference_combine, reference_dispatch
from epcomm.testing.verify import (Case, assert_equal, assert_tma_aligned_col_major,
                                   bitwise_equal, check_combine,
                                   check_dispatch_outputs, ignored_rows, make_routing,
                                   run_cases, specified_rows)

SEED = int(os.environ.get("EPCOMM_TEST_SEED", time.time_ns() % 1_000_000))


def _run(fn, world_size: int, *args, **kwargs):
    return run_seeded(fn, world_size, SEED, *args, **kwargs)
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="CUDA tests need a GPU (none on this machine)")
M, H, K = 8, 64, 3


def _expect_error(kind, call, *fragments: str) -> None:
    """`call()` raises `kind` whose message names every fragment."""
    try:
        call()
    except kind as exc:
        for fragment in fragments:
            assert fragment in str(exc), f"{exc!r} does not name {fragment!r}"
        return
    raise AssertionError(f"no {kind.__name__} raised; expected one naming {fragments}")


def _inputs(buffer, experts: int, seed: int, routing: str = "balanced", tokens: int = M,
            topk: int = K, hidden: int = H):
    """(x [T, hidden] bf16, topk_idx [T, topk] int64, weights [T, topk] fp32), T = tokens - rank."""
    gen = torch.Generator().manual_seed(1000 * seed + buffer.rank_idx)
    num_tokens = max(0, tokens - buffer.rank_idx)
    idx = make_routing(routing, num_tokens, topk, experts, buffer.num_ranks, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    weights = torch.rand(num_tokens, topk, generator=gen)
    dev = buffer.device
    return x.to(dev), idx.to(dev), weights.to(dev)


# ------------------------------------------------------------------ surface, sizing, errors


def run_surface(seed: int) -> int:
    group, rank = dist.group.WORLD, dist.get_rank()
    R = dist.get_world_size()
    hint = ElasticBuffer.get_buffer_size_hint(group, M, H, num_topk=K, use_fp8_dispatch=True,
                                              allow_hybrid_mode=False,
                                              allow_multiple_reduction=False)
    assert hint % (2 << 20) == 0 and hint >= epcomm.Buffer.get_buffer_size_hint(R, M, H, K)
    assert ElasticBuffer.get_buffer_size_hint(group, M, H) >= hint  # num_topk=0: any top-k
    # Every constructor argument, by name.
    buffer = ElasticBuffer(group, num_bytes=hint, num_cpu_bytes=0, num_max_tokens_per_rank=M,
                           hidden=H, num_topk=K, use_fp8_dispatch=True, deterministic=True,
                           allow_hybrid_mode=False, allow_multiple_reduction=True,
                           prefer_overlap_with_compute=False, sl_idx=0, num_allocated_qps=4,
                           num_cpu_timeout_secs=30, num_gpu_timeout_secs=30,
                           explicitly_destroy=True, backend="collective", device="cpu")
    assert (buffer.group, buffer.rank_idx, buffer.num_ranks, buffer.num_bytes) == \
        (group, rank, R, hint)
    assert (buffer.num_max_tokens_per_rank, buffer.hidden, buffer.num_topk) == (M, H, K)
    assert (buffer.num_scaleout_ranks, buffer.num_scaleup_ranks) == (1, R)
    assert (buffer.scaleout_rank_idx, buffer.scaleup_rank_idx) == (0, rank)
    assert (buffer.num_rdma_ranks, buffer.num_nvlink_ranks) == (1, R)
    assert buffer.get_logical_domain_size() == (1, R) == buffer.get_physical_domain_size()
    assert epcomm.get_logical_domain_size(group) == epcomm.get_physical_domain_size(group)
    assert (buffer.allow_hybrid_mode, buffer.allow_multiple_reduction,
            buffer.prefer_overlap_with_compute, buffer.deterministic, buffer.sl_idx,
            buffer.num_allocated_qps, buffer.explicitly_destroy) == \
        (False, True, False, True, 0, 4, True)
    assert buffer.backend == "collective" and buffer.get_comm_stream() is None
    num_sms = buffer.get_theoretical_num_sms(4 * R, K)
    assert num_sms == buffer.num_sms == 1  # one program on CPU
    assert buffer.get_theoretical_num_qps(num_sms) == 1
    hybrid = ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K,
                           backend="collective", device="cpu")
    assert hybrid.num_allocated_qps == 129 and hybrid.get_theoretical_num_qps(5) == 81
    assert epcomm.topk_idx_t is torch.int64
    buffer.barrier(use_comm_stream=True, with_cpu_sync=True, sequential=False)
    buffer.barrier()
    captured = buffer.capture()
    if torch.cuda.is_available():  # DeepEP's type: a bare EventHandle
        assert type(captured) is EventHandle
    else:
        assert type(captured) is EventOverlap and captured.event is None

    # Every dispatch and combine argument, by name (CPU: the events are empty, num_sms is 1).
    x, idx, w = _inputs(buffer, 4 * R, seed)
    stats = torch.zeros(4, dtype=torch.int32)
    recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
        x=x, topk_idx=idx, topk_weights=w, cumulative_local_expert_recv_stats=stats,
        num_experts=4 * R, num_max_tokens_per_rank=M, expert_alignment=2, num_sms=num_sms,
        num_qps=buffer.get_theoretical_num_qps(num_sms), previous_event=buffer.capture(),
        previous_event_before_epilogue=buffer.capture(), async_with_compute_stream=True,
        allocate_on_comm_stream=True, handle=None, do_handle_copy=False, do_cpu_sync=True,
        do_expand=False, do_zero_padding=True, use_tma_aligned_col_major_sf=True)
    event.current_stream_wait()
    assert isinstance(handle, EPHandle) and handle.topk_idx is idx  # do_handle_copy=False
    assert handle.num_sms == num_sms and handle.token_metadata_at_forward is None
    assert handle.channel_linked_list is None
    assert_equal("stats after one dispatch", stats, handle.num_unaligned_recv_tokens_per_expert)
    combined, combined_w, event = buffer.combine(
        x=recv_x, handle=handle, topk_weights=recv_w, bias=(x, x), num_sms=0, num_qps=1,
        previous_event=buffer.capture(), previous_event_before_epilogue=buffer.capture(),
        async_with_compute_stream=False, allocate_on_comm_stream=True)
    assert combined.shape == x.shape and combined_w.shape == w.shape

    # Sizing by bytes alone: each engine takes the largest M that fits; the buffer's own M
    # is 0 (from the hint of another M: the derived M is at least that).
    by_bytes = ElasticBuffer(group, num_bytes=hint, backend="collective", device="cpu")
    assert by_bytes.num_max_tokens_per_rank == 0 and by_bytes.num_bytes == hint
    derived = by_bytes.get_num_max_tokens_per_rank(H, K)
    assert derived >= M and epcomm.Buffer.get_buffer_size_hint(R, derived, H, K) <= hint < \
        epcomm.Buffer.get_buffer_size_hint(R, derived + 1, H, K)
    _, _, _, handle, _ = by_bytes.dispatch(x, idx, w, num_experts=4 * R, do_cpu_sync=False)
    assert handle.num_max_tokens_per_rank == derived and handle.num_recv_tokens == R * derived
    small = ElasticBuffer(group, num_bytes=256, backend="collective", device="cpu")
    _expect_error(ValueError, lambda: small.dispatch(x, idx, num_experts=4 * R), "num_bytes",
                  "get_buffer_size_hint")
    _expect_error(ValueError, lambda: ElasticBuffer(group, num_bytes=1 << 10,
                                                    num_max_tokens_per_rank=M, hidden=H,
                                                    num_topk=K, device="cpu"), "num_bytes")

    # num_topk=0: one buffer serves any top-k (an engine per top-k), results bitwise.
    any_k = ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, backend="collective",
                          device="cpu")
    for topk in (1, K, 6):
        case = Case(num_experts=4 * R, seed=seed + topk)
        xk, idxk, wk = _inputs(any_k, 4 * R, seed + topk, topk=topk)
        outputs = any_k.dispatch(xk, idxk, wk, num_experts=4 * R)
        ref = reference_dispatch(xk, idxk, wk, 4 * R, M, group)
        _check_dispatch(topk, case, outputs, ref)
    assert len(any_k._engines) == 3

    # Destroy: only with explicitly_destroy; the buffer is unusable afterwards.
    _expect_error(RuntimeError, any_k.destroy, "explicitly_destroy")
    buffer.destroy()
    _expect_error(RuntimeError, lambda: buffer.dispatch(x, idx, num_experts=4 * R), "destroyed")
    _expect_error(RuntimeError, lambda: buffer.combine(recv_x, handle), "destroyed")
    return run_type_errors(seed)


def _check_dispatch(topk: int, case: Case, outputs, ref) -> None:
    """`verify.check_dispatch_outputs` for a dispatch of `topk` slots (the engine's shape)."""
    view = type("View", (), dict(num_ranks=dist.get_world_size(), num_topk=topk))()
    check_dispatch_outputs(view, case, outputs, ref)


def run_type_errors(seed: int) -> int:
    """Every argument of the constructor, the hints, dispatch, combine, barrier and the events
    checked for its type and value: TypeError / ValueError naming it, not an assert; the
    buffer works afterwards."""
    group, R = dist.group.WORLD, dist.get_world_size()
    E = 4 * R
    buffer = ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K,
                           num_allocated_qps=8, backend="collective", device="cpu")
    other = ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K,
                          backend="collective", device="cpu")
    x, idx, w = _inputs(buffer, E, seed)
    _, _, _, handle, _ = buffer.dispatch(x, idx, w, num_experts=E)
    _, _, _, foreign, _ = other.dispatch(x, idx, w, num_experts=E)
    y = torch.zeros(handle.num_recv_tokens, H, dtype=torch.bfloat16)
    d, c = buffer.dispatch, buffer.combine

    def make(**kwargs):
        base = dict(num_max_tokens_per_rank=M, hidden=H, num_topk=K, device="cpu")
        return lambda: ElasticBuffer(group, **{**base, **kwargs})

    checks = [
        (TypeError, lambda: ElasticBuffer("group", num_bytes=1 << 21), ("group",)),
        (TypeError, make(num_bytes="1"), ("num_bytes",)),
        (ValueError, make(num_bytes=0), ("num_bytes",)),
        (TypeError, make(num_cpu_bytes=1.0), ("num_cpu_bytes",)),
        (ValueError, lambda: ElasticBuffer(group, num_cpu_bytes=1 << 21, device="cpu"),
         ("num_cpu_bytes",)),
        (TypeError, make(num_max_tokens_per_rank="8"), ("num_max_tokens_per_rank",)),
        (TypeError, make(hidden=64.0), ("hidden",)),
        (TypeError, make(num_topk=None), ("num_topk",)),
        (ValueError, make(num_topk=-1), ("num_topk",)),
        (ValueError, lambda: ElasticBuffer(group, device="cpu"), ("num_bytes",)),
        (TypeError, make(use_fp8_dispatch="yes"), ("use_fp8_dispatch",)),
        (TypeError, make(deterministic=None), ("deterministic",)),
        (TypeError, make(allow_hybrid_mode=2), ("allow_hybrid_mode",)),
        (TypeError, make(allow_multiple_reduction=[]), ("allow_multiple_reduction",)),
        (TypeError, make(prefer_overlap_with_compute=0.0), ("prefer_overlap_with_compute",)),
        (TypeError, make(sl_idx="3"), ("sl_idx",)),
        (TypeError, make(num_allocated_qps=True), ("num_allocated_qps",)),
        (TypeError, make(num_cpu_timeout_secs="300"), ("num_cpu_timeout_secs",)),
        (ValueError, make(num_gpu_timeout_secs=0), ("num_gpu_timeout_secs",)),
        (TypeError, make(explicitly_destroy=None), ("explicitly_destroy",)),
        (ValueError, make(backend="nccl"), ("backend",)),
        (TypeError, make(device=0.5), ("device",)),
        (TypeError, lambda: ElasticBuffer.get_buffer_size_hint(None, M, H), ("group",)),
        (TypeError, lambda: ElasticBuffer.get_buffer_size_hint(group, "8", H),
         ("num_max_tokens_per_rank",)),
        (ValueError, lambda: ElasticBuffer.get_buffer_size_hint(group, M, 0), ("hidden",)),
        (TypeError, lambda: ElasticBuffer.get_buffer_size_hint(group, M, H, num_topk=1.5),
         ("num_topk",)),
        (TypeError, lambda: ElasticBuffer.get_buffer_size_hint(group, M, H,
                                                               use_fp8_dispatch=None),
         ("use_fp8_dispatch",)),
        (TypeError, lambda: buffer.get_theoretical_num_sms(None, K), ("num_experts",)),
        (TypeError, lambda: buffer.get_theoretical_num_sms(E, K, rdma_gbs="fast"),
         ("rdma_gbs",)),
        (ValueError, lambda: buffer.get_theoretical_num_sms(E, K, num_scaleout_topk=2),
         ("num_scaleout_topk",)),
        (TypeError, lambda: buffer.get_theoretical_num_qps(1.0), ("num_sms",)),
        (TypeError, lambda: buffer.barrier(use_comm_stream=None), ("use_comm_stream",)),
        (TypeError, lambda: buffer.barrier(with_cpu_sync="no"), ("with_cpu_sync",)),
        (TypeError, lambda: buffer.barrier(sequential=2), ("sequential",)),
        # dispatch
        (TypeError, lambda: d(x.tolist(), idx, num_experts=E), ("x",)),
        (TypeError, lambda: d(x.float(), idx, num_experts=E), ("x", "bfloat16")),
        (ValueError, lambda: d(x[0], idx, num_experts=E), ("x", "2-D")),
        (TypeError, lambda: d(x, idx.tolist(), num_experts=E), ("topk_idx",)),
        (TypeError, lambda: d(x, idx.float(), num_experts=E), ("topk_idx", "dtype")),
        (ValueError, lambda: d(x, None, num_experts=E), ("topk_idx",)),
        (TypeError, lambda: d(x, idx, w.tolist(), num_experts=E), ("topk_weights",)),
        (TypeError, lambda: d(x, idx, cumulative_local_expert_recv_stats=[0] * 4,
                              num_experts=E), ("cumulative_local_expert_recv_stats",)),
        (TypeError, lambda: d(x, idx, cumulative_local_expert_recv_stats=torch.zeros(4),
                              num_experts=E), ("cumulative_local_expert_recv_stats", "int32")),
        (ValueError, lambda: d(x, idx, cumulative_local_expert_recv_stats=torch.zeros(
            5, dtype=torch.int32), num_experts=E), ("cumulative_local_expert_recv_stats",
                                                    "shape")),
        (TypeError, lambda: d(x, idx, num_experts=float(E)), ("num_experts",)),
        (ValueError, lambda: d(x, idx), ("num_experts",)),
        (TypeError, lambda: d(x, idx, num_experts=E, num_max_tokens_per_rank="8"),
         ("num_max_tokens_per_rank",)),
        (ValueError, lambda: d(x, idx, num_experts=E, num_max_tokens_per_rank=M + 1),
         ("num_max_tokens_per_rank",)),
        (TypeError, lambda: d(x, idx, num_experts=E, expert_alignment=1.0),
         ("expert_alignment",)),
        (ValueError, lambda: d(x, idx, num_experts=E, expert_alignment=0),
         ("expert_alignment",)),
        (TypeError, lambda: d(x, idx, num_experts=E, num_sms=None), ("num_sms",)),
        (TypeError, lambda: d(x, idx, num_experts=E, num_qps="1"), ("num_qps",)),
        (TypeError, lambda: d(x, idx, num_experts=E, num_qps=0.0), ("num_qps",)),
        (ValueError, lambda: d(x, idx, num_experts=E, num_qps=9), ("num_qps",
                                                                   "num_allocated_qps")),
        (TypeError, lambda: d(x, idx, num_experts=E, previous_event="event",
                              allocate_on_comm_stream=True), ("previous_event",)),
        (ValueError, lambda: d(x, idx, num_experts=E, previous_event=buffer.capture()),
         ("previous_event", "allocate_on_comm_stream")),
        (TypeError, lambda: d(x, idx, num_experts=E, previous_event_before_epilogue=1),
         ("previous_event_before_epilogue",)),
        (TypeError, lambda: d(x, idx, num_experts=E, async_with_compute_stream=None),
         ("async_with_compute_stream",)),
        (TypeError, lambda: d(x, idx, num_experts=E, allocate_on_comm_stream="no"),
         ("allocate_on_comm_stream",)),
        (TypeError, lambda: d(x, idx, num_experts=E, handle="handle"), ("handle", "EPHandle")),
        (ValueError, lambda: d(x, handle=foreign), ("handle", "another")),
        (ValueError, lambda: d(x, idx, handle=handle), ("topk_idx", "handle")),
        (ValueError, lambda: d(x, handle=handle, do_cpu_sync=True), ("do_cpu_sync", "handle")),
        (ValueError, lambda: d(x, handle=handle, expert_alignment=2), ("expert_alignment",)),
        (TypeError, lambda: d(x, idx, num_experts=E, do_handle_copy=None), ("do_handle_copy",)),
        (TypeError, lambda: d(x, idx, num_experts=E, do_cpu_sync="False"), ("do_cpu_sync",)),
        (TypeError, lambda: d(x, idx, num_experts=E, do_cpu_sync=0.0), ("do_cpu_sync",)),
        (TypeError, lambda: d(x, idx, num_experts=E, do_cpu_sync=[]), ("do_cpu_sync",)),
        (TypeError, lambda: d(x, idx, num_experts=E, do_expand="yes"), ("do_expand",)),
        (TypeError, lambda: d(x, idx, num_experts=E, do_zero_padding=None),
         ("do_zero_padding",)),
        (TypeError, lambda: d(x, idx, num_experts=E, use_tma_aligned_col_major_sf="col"),
         ("use_tma_aligned_col_major_sf",)),
        # combine
        (TypeError, lambda: c(y.tolist(), handle), ("x",)),
        (TypeError, lambda: c(y, None), ("handle", "EPHandle")),
        (ValueError, lambda: c(y, foreign), ("handle", "another")),
        (TypeError, lambda: c(y, handle, topk_weights=[1.0]), ("topk_weights",)),
        (TypeError, lambda: c(y, handle, bias="bias"), ("bias",)),
        (TypeError, lambda: c(y, handle, num_sms="0"), ("num_sms",)),
        (ValueError, lambda: c(y, handle, num_qps=9), ("num_qps",)),
        (TypeError, lambda: c(y, handle, previous_event=object(), allocate_on_comm_stream=True),
         ("previous_event",)),
        (TypeError, lambda: c(y, handle, previous_event_before_epilogue="e"),
         ("previous_event_before_epilogue",)),
        (TypeError, lambda: c(y, handle, async_with_compute_stream="yes"),
         ("async_with_compute_stream",)),
        (TypeError, lambda: c(y, handle, allocate_on_comm_stream=None),
         ("allocate_on_comm_stream",)),
        # events and the handle
        (TypeError, lambda: EventOverlap().current_stream_wait(release_handle="yes"),
         ("release_handle",)),
        (TypeError, lambda: EventOverlap().register_hook_after_wait(None), ("hook_after_wait",)),
        (TypeError, lambda: handle.deterministic_sort(None, False, y, None, None, None, None),
         ("do_cpu_sync",)),
        (TypeError, lambda: handle.deterministic_sort(True, False, "x", None, None, None, None),
         ("recv_x",)),
    ]
    for kind, call, fragments in checks:
        _expect_error(kind, call, *fragments)
    # The buffer still works, bitwise.
    run_cases(buffer, [Case(num_experts=E, seed=seed), Case(num_experts=E, do_cpu_sync=False,
                                                            do_expand=True, seed=seed + 1)], seed)
    return len(checks)


def test_surface_sizing_and_type_errors():
    """Every constructor, dispatch and combine argument by name; attributes, hints and domain
    sizes; sizing by bytes alone; one buffer for top-k 1, 3 and 6; destroy; then every
    argument with a wrong type or value (a TypeError or ValueError naming it)."""
    counts = _run(run_surface, 2, SEED)
    assert counts[0] == counts[1] > 80


# ------------------------------------------------------------------ calls against the reference


def run_calls(device: str, backend: str, seed: int, quick: bool = False) -> int:
    """Dispatch and combine through `ElasticBuffer`, bitwise against the reference (`quick`:
    fewer calls, for the Triton interpreter)."""
    group, R = dist.group.WORLD, dist.get_world_size()
    E = 4 * R
    buffer = ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K,
                           backend=backend, device=device, explicitly_destroy=True)
    assert buffer.backend == backend
    count = 0

    # verify's round trips (dispatch, cached dispatch, combine): every layout and sync mode,
    # FP8, weights, biases, zero padding, stream options.
    modes = [(False, True, False, 1), (True, False, True, 4), (True, True, True, 4),
             (False, False, True, 2), (True, True, False, 2), (False, False, False, 4)]
    cases = [Case(num_experts=E, do_expand=expand, do_cpu_sync=sync, fp8=fp8,
                  expert_alignment=align, num_bias=(i % 3), do_zero_padding=i % 2 == 0,
                  routing=("balanced", "masked", "same_rank", "skewed")[i % 4],
                  async_with_compute_stream=i % 3 == 1, allocate_on_comm_stream=i % 3 == 2,
                  seed=seed + i)
             for i, (expand, sync, fp8, align) in enumerate(modes[:2] if quick else modes)]
    count += run_cases(buffer, cases, seed)

    # do_cpu_sync=None: a synchronizing dispatch without a handle; with one, the handle's
    # sizes and no sync.
    x, idx, w = _inputs(buffer, E, seed + 50, routing="masked")
    case = Case(num_experts=E, routing="masked", seed=seed)
    ref = reference_dispatch(x.cpu(), idx.cpu(), w.cpu(), E, M, _ref_group(buffer))
    for sync in (None, False):
        outputs = buffer.dispatch(x, idx, w, num_experts=E, do_cpu_sync=sync)
        assert outputs[3].do_cpu_sync == (sync is None)
        _check_dispatch(K, Case(**{**case.__dict__, "do_cpu_sync": sync is None}),
                        outputs, ref)
        cached = buffer.dispatch(x, topk_weights=w, handle=outputs[3], do_cpu_sync=None)
        assert cached[3] is outputs[3]
        _check_dispatch(K, Case(**{**case.__dict__, "do_cpu_sync": sync is None}), cached, ref)
        count += 1

    # Cached dispatch takes num_max_tokens_per_rank from its handle (here smaller than the
    # buffer's), never reads the host, and returns the handle itself (the same
    # dst_buffer_slot_idx).
    small_m = M // 2
    xs, idxs, ws = _inputs(buffer, E, seed + 60, tokens=small_m)
    for sync, expand in ((True, True), (False, False)) if quick else \
            ((True, False), (True, True), (False, False), (False, True)):
        first = buffer.dispatch(xs, idxs, ws, num_experts=E, num_max_tokens_per_rank=small_m,
                                do_cpu_sync=sync, do_expand=expand, expert_alignment=2)
        handle = first[3]
        assert handle.num_max_tokens_per_rank == small_m
        slots = handle.dst_buffer_slot_idx
        assert slots.dtype == torch.int32 and slots.shape == idxs.shape
        with _no_host_reads(buffer):
            cached = buffer.dispatch(xs, topk_weights=ws, handle=handle)
        assert cached[3] is handle and cached[3].dst_buffer_slot_idx is slots
        want_case = Case(num_experts=E, do_expand=expand, do_cpu_sync=sync, expert_alignment=2,
                         seed=seed)
        refe = reference_dispatch(xs.cpu(), idxs.cpu(), ws.cpu(), E, small_m,
                                  _ref_group(buffer), 2, expand)
        _check_dispatch(K, want_case, first, refe)
        _check_dispatch(K, want_case, cached, refe)
        _expect_error(ValueError, lambda: buffer.dispatch(xs, handle=handle,
                                                          num_max_tokens_per_rank=M),
                      "num_max_tokens_per_rank", "handle")
        count += 1

    # The handle: a plain object whose fields callers may reassign (DeepEP's test slices
    # recv_src_metadata); combine and cached dispatch keep using the dispatch's own tensors.
    x, idx, w = _inputs(buffer, E, seed + 50, routing="masked")
    ref = reference_dispatch(x.cpu(), idx.cpu(), w.cpu(), E, M, _ref_group(buffer))
    if not quick:
        count += _reassigned_handle(buffer, x, idx, w, seed)
    count += _stats_and_scales(buffer, x, idx, w, ref)
    buffer.destroy()
    return count


def _reassigned_handle(buffer, x, idx, w, seed: int) -> int:
    E = 4 * dist.get_world_size()
    outputs = buffer.dispatch(x, idx, w, num_experts=E, do_cpu_sync=False, do_expand=True,
                              expert_alignment=4)
    handle = outputs[3]
    n = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
    full = handle.recv_src_metadata
    handle.recv_src_metadata = handle.recv_src_metadata[:n]
    assert handle.recv_src_metadata.shape[0] == n and handle.tensors["recv_src_metadata"] is full
    handle.topk_idx = None
    handle.num_sms = handle.num_sms  # every field assignable
    case = Case(num_experts=E, do_expand=True, do_cpu_sync=False, expert_alignment=4,
                routing="masked", num_bias=1, seed=seed)
    ref = reference_dispatch(x.cpu(), idx.cpu(), w.cpu(), E, M, _ref_group(buffer), 4, True)
    cached = buffer.dispatch(x, topk_weights=w, handle=handle)
    # (the check reads the handle's fields: a copy of the handle without the reassignments)
    _check_dispatch(K, case, (*cached[:3], dataclasses.replace(handle)), ref)
    _combine_against_reference(buffer, case, handle, ref, idx, seed)
    handle.deterministic_sort(False, False, outputs[0], None, None, outputs[2], None)
    assert handle.cached_recv_src_metadata_before_sort is handle.recv_src_metadata
    return 1


def _stats_and_scales(buffer, x, idx, w, ref) -> int:
    R = dist.get_world_size()
    E, count = 4 * R, 0
    # cumulative_local_expert_recv_stats: the received (token, slot) pairs per local expert,
    # added in place on the device (dispatches of both layouts, sync-free, cached).
    stats = torch.full((E // R,), 7, dtype=torch.int32, device=buffer.device)
    want = stats.clone()
    for expand, sync in ((False, True), (True, False), (False, False)):
        out = buffer.dispatch(x, idx, w, cumulative_local_expert_recv_stats=stats,
                              num_experts=E, do_cpu_sync=sync, do_expand=expand)
        buffer.dispatch(x, handle=out[3], cumulative_local_expert_recv_stats=stats)
        want += 2 * ref.num_recv_tokens_per_expert.to(torch.int32).to(buffer.device)
    assert_equal("cumulative_local_expert_recv_stats", stats, want, check_dtype=True)
    count += 1

    # use_tma_aligned_col_major_sf: the received FP8 scales column-major, 16-byte aligned
    # columns, the same values.
    x8 = per_token_cast_to_fp8(x)
    ref8 = reference_dispatch(tuple(t.cpu() for t in x8), idx.cpu(), w.cpu(), E, M,
                              _ref_group(buffer), 1, True)
    for sync in (True, False):
        plain = buffer.dispatch(x8, idx, w, num_experts=E, do_cpu_sync=sync, do_expand=True)
        tma = buffer.dispatch(x8, idx, w, num_experts=E, do_cpu_sync=sync, do_expand=True,
                              use_tma_aligned_col_major_sf=True)
        scales = tma[0][1]
        rows = scales.shape[0]
        assert scales.shape == plain[0][1].shape and scales.stride() == (1, -(-rows // 4) * 4)
        assert_tma_aligned_col_major("column-major scales", scales)
        keep = specified_rows(plain[3], zero_padding=False)  # (gaps and tail: unspecified)
        assert_equal("column-major scales", scales[keep], plain[0][1][keep], check_dtype=True)
        _check_dispatch(K, Case(num_experts=E, do_expand=True, do_cpu_sync=sync, fp8=True),
                        tma, ref8)
        count += 1
    return count


def _ref_group(buffer):
    return dist.group.WORLD


class _no_host_reads:
    """Within the block, reading a tensor's values on the host (`item`, `tolist`, `bool`,
    `int`, `float`) or checking the buffer's device error flags raises; not over a gloo
    group's collective backend, whose cached dispatch checks its header on the host (the
    transport runs there; docs/semantics.md)."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__")

    def __init__(self, buffer) -> None:
        self.engines = list(buffer._engines.values())
        self.host_transport = any(getattr(engine._backend, "_host_transport", False)
                                  for engine in self.engines)

    def __enter__(self):
        if self.host_transport:
            return
        def refuse(*args, **kwargs):
            raise AssertionError("a cached dispatch read the host")
        self.saved = {name: getattr(torch.Tensor, name) for name in self.NAMES}
        for name in self.NAMES:
            setattr(torch.Tensor, name, refuse)
        for engine in self.engines:
            engine.check_errors = refuse

    def __exit__(self, *exc) -> None:
        if self.host_transport:
            return
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)
        for engine in self.engines:
            del engine.check_errors


def _combine_against_reference(buffer, case: Case, handle, ref, topk_idx, seed: int) -> None:
    """`verify.check_combine` of random expert outputs (NaN in the ignored rows)."""
    gen = torch.Generator().manual_seed(seed)
    rows = handle.num_output_rows
    scale = torch.exp2(torch.randint(-20, 21, (rows, 1), generator=gen).float())
    y = (torch.randn(rows, H, generator=gen) * scale).to(torch.bfloat16)
    y[ignored_rows(case, ref, rows)] = float("nan")
    yw = torch.rand((rows,) if case.do_expand else (rows, K), generator=gen)
    biases = tuple(torch.randn(topk_idx.shape[0], H, generator=gen).to(torch.bfloat16)
                   for _ in range(case.num_bias))
    check_combine(buffer, case, handle, ref, topk_idx, y, yw, biases)


def test_calls_match_reference_collective():
    """Round trips of every layout and sync mode, `do_cpu_sync=None`, cached dispatch (the
    handle's M, no host read, the same handle), reassigned handle fields, the statistics
    tensor and column-major scales, bitwise, on the collective backend."""
    assert _run(run_calls, 2, "cpu", "collective", SEED) == [16, 16]


@_NO_CUDA
@pytest.mark.parametrize("backend", ["collective", "symmetric"])
def test_calls_match_reference_cuda(backend: str):
    assert _run(run_calls, 2, "cuda", backend, SEED) == [16, 16]


# ------------------------------------------------------------------ single reduction


def run_single_reduction(device: str, backend: str, seed: int, quick: bool = False) -> int:
    """`allow_multiple_reduction=False`: an expand-layout combine sums every slot's row on the
    source in slot order in fp32 and rounds once. Checked against
    `reference_combine(..., single_reduction=True)` everywhere, and (1) also against the
    default reference where no token has two slots on one rank (then both modes are one
    reduction), (2) with two slots on one rank, where it differs from the multiple-reduction
    result; the compact layout and the weights are unchanged."""
    group, R = dist.group.WORLD, dist.get_world_size()
    E = 4 * R
    kwargs = dict(num_max_tokens_per_rank=M, hidden=H, num_topk=K, backend=backend,
                  device=device)
    single = ElasticBuffer(group, allow_multiple_reduction=False, **kwargs)
    multi = ElasticBuffer(group, allow_multiple_reduction=True, **kwargs)
    differ = 0
    steps = (("balanced", True, 1), ("same_rank", True, 2), ("same_rank", False, 4),
             ("masked", False, 1))
    for step, (routing, sync, align) in enumerate(steps[2:3] if quick else steps):
        x, idx, w = _inputs(single, E, seed + step, routing=routing)
        if routing == "balanced":  # at most one slot per rank: valid slots on distinct ranks
            gen = torch.Generator().manual_seed(seed + step)
            used = min(R, K)
            ranks = torch.stack([torch.randperm(R, generator=gen)[:used]
                                 for _ in range(idx.shape[0])]).view(-1, used)
            idx = torch.full_like(idx.cpu(), -1)
            idx[:, :used] = ranks * 4 + torch.randint(0, 4, ranks.shape, generator=gen)
            idx = idx.to(device)
        if routing == "same_rank":  # slots 0 and 1 on one rank, slot 2 on the next one
            first = idx[:, 0]
            idx[:, 2] = (first // 4 + 1) % R * 4 + first % 4
        case = Case(num_experts=E, do_expand=True, do_cpu_sync=sync, expert_alignment=align,
                    routing=routing, num_bias=step % 3, seed=seed + step)
        ref = reference_dispatch(x.cpu(), idx.cpu(), w.cpu(), E, M, group, align, True)
        results = []
        gen = torch.Generator().manual_seed(seed + step)
        for buffer in (single, multi):
            out = buffer.dispatch(x, idx, w, num_experts=E, do_cpu_sync=sync, do_expand=True,
                                  expert_alignment=align)
            handle = out[3]
            rows = handle.num_output_rows
            if not results:  # (magnitudes within a few binades: the two modes round apart)
                scale = torch.exp2(torch.randint(-3, 4, (rows, 1), generator=gen).float())
                y = (torch.randn(rows, H, generator=gen) * scale).to(torch.bfloat16)
                y[ignored_rows(case, ref, rows)] = float("nan")
                yw = torch.rand(rows, generator=gen)
                biases = tuple(torch.randn(idx.shape[0], H, generator=gen).to(torch.bfloat16)
                               for _ in range(case.num_bias))
            combined, combined_w, _ = buffer.combine(y.to(device), handle, yw.to(device),
                                                     tuple(b.to(device) for b in biases) or None)
            results.append((combined.cpu(), combined_w.cpu()))
        (got, got_w), (got_multi, got_multi_w) = results
        want, want_w = reference_combine(y[:ref.expand_valid.shape[0]], ref, idx.cpu(), E, group,
                                         topk_weights=yw[:ref.expand_valid.shape[0]],
                                         bias=biases or None)
        assert_equal("combined_topk_weights (single reduction)", got_w, want_w)
        assert_equal("combined_x (multiple reduction)", got_multi, want)
        expected, expected_w = reference_combine(
            y[:ref.expand_valid.shape[0]], ref, idx.cpu(), E, group,
            topk_weights=yw[:ref.expand_valid.shape[0]], bias=biases or None,
            single_reduction=True)
        assert_equal("combined_topk_weights (reference, single reduction)", expected_w, want_w)
        assert_equal(f"combined_x (single reduction) {routing}", got, expected,
                     check_dtype=True)
        if routing == "balanced":
            assert_equal("single reduction = reference without same-rank slots", got, want)
        else:
            differ += int(not bitwise_equal(got, got_multi))
    # Compact layout: one reduction in both modes.
    x, idx, w = _inputs(single, E, seed + 9, routing="same_rank")
    outputs = [b.dispatch(x, idx, w, num_experts=E) for b in (single, multi)]
    y = outputs[0][0] * 3
    assert_equal("compact combine, both modes", single.combine(y, outputs[0][3])[0],
                 multi.combine(y, outputs[1][3])[0], check_dtype=True)
    total = torch.tensor([differ])
    dist.all_reduce(total)
    assert int(total) > 0, "with two slots on one rank the two modes should differ somewhere"
    return 1 if quick else 4


def test_single_reduction_combine():
    assert _run(run_single_reduction, 2, "cpu", "collective", SEED) == [4, 4]


def run_symmetric_quick(seed: int) -> list[int]:
    return [run_calls("cpu", "symmetric", seed, quick=True),
            run_single_reduction("cpu", "symmetric", seed + 100, quick=True)]


def test_symmetric_backend_interpreter():
    """`run_calls` and `run_single_reduction` on the symmetric backend, a few calls each (the
    Triton interpreter is slow)."""
    pytest.importorskip("triton")
    assert _run(run_symmetric_quick, 2, SEED) == [[9, 1], [9, 1]]


@_NO_CUDA
@pytest.mark.parametrize("backend", ["collective", "symmetric"])
def test_single_reduction_combine_cuda(backend: str):
    assert _run(run_single_reduction, 2, "cuda", backend, SEED) == [4, 4]


# ------------------------------------------------------------------ events


def test_event_overlap_semantics():
    """DeepEP's `EventOverlap`: one hook per event, run once after the first wait;
    `current_stream_wait(release_handle=True)` and `with event(release_handle=True):` drop the
    event and the held references; `.event` is None on CPU."""
    calls = []
    event = EventOverlap(extra_tensors=(torch.zeros(1),))
    event.register_hook_after_wait(lambda: calls.append("hook"))
    assert event.hook_after_wait is not None
    _expect_error(RuntimeError, lambda: event.register_hook_after_wait(print), "already")
    event.current_stream_wait()
    event.current_stream_wait()
    assert calls == ["hook"] and event.hook_after_wait is None
    event.current_stream_wait(release_handle=True)
    assert event.event is None and event.extra_tensors is None
    second = EventOverlap(extra_tensors=(torch.zeros(1),))
    second.register_hook_after_wait(lambda: calls.append("with"))
    with second(release_handle=True):
        calls.append("body")
    assert calls == ["hook", "body", "with"] and second.extra_tensors is None
    assert issubclass(EventHandle, torch.cuda.Event)
    if not torch.cuda.is_available():
        assert ElasticBuffer.capture().event is None


def test_capture_type(monkeypatch):
    """`ElasticBuffer.capture()` returns what DeepEP's does: a bare `EventHandle` recorded on
    the current stream (CUDA simulated here: `is_available` and the event class patched, as a
    CPU-only torch cannot make a CUDA event), which `previous_event` takes; without CUDA an
    empty `EventOverlap`. `Buffer.capture()` (DeepEP's legacy one) stays an `EventOverlap`."""
    import epcomm.elastic as elastic_module
    from epcomm.events import as_event_overlap

    assert type(ElasticBuffer.capture()) is (EventHandle if torch.cuda.is_available()
                                              else EventOverlap)
    recorded = []

    class FakeHandle:
        def record(self, stream=None):
            recorded.append(stream)

    monkeypatch.setattr(elastic_module.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(elastic_module, "EventHandle", FakeHandle)
    event = ElasticBuffer.capture()
    assert type(event) is FakeHandle and recorded == [None]  # the current stream
    assert ElasticBuffer.capture() is not event and len(recorded) == 2  # a fresh one per call
    monkeypatch.undo()
    with pytest.raises(TypeError, match="previous_event"):
        as_event_overlap("previous_event", "not an event")
    assert as_event_overlap("previous_event", None) is None


@_NO_CUDA
def test_event_handle_cuda():
    """On CUDA, `ElasticBuffer.capture()` is a bare `EventHandle` (DeepEP's event handle, with
    `current_stream_wait()`); `previous_event` takes it (as an `EventOverlap`), and
    `EventOverlap.event` is one too."""
    event = ElasticBuffer.capture()
    assert type(event) is EventHandle
    event.current_stream_wait()
    wrapped = epcomm.events.as_event_overlap("previous_event", event)
    assert type(wrapped) is EventOverlap and wrapped.event is event
    wrapped.current_stream_wait()
    torch.cuda.synchronize()


# ------------------------------------------------------------------ CUDA: sync-free, graphs


def run_cuda_sync_free(backend: str, seed: int) -> int:
    """One rank over NCCL: sync-free dispatches with every optional argument (statistics,
    column-major FP8 scales, both events, num_sms, num_qps) and cached dispatches of both kinds
    of handle make no host sync (the second sync-free call of a shape takes the prepared call);
    then dispatch + combine captured in a CUDA graph and replayed with new data; bitwise
    against the reference."""
    group = dist.group.WORLD
    M_, H_, K_, E = 32, 256, 4, 8
    buffer = ElasticBuffer(group, num_max_tokens_per_rank=M_, hidden=H_, num_topk=K_,
                           allow_multiple_reduction=False, backend=backend)
    num_sms = buffer.get_theoretical_num_sms(E, K_)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M_, H_, generator=gen).to(torch.bfloat16).cuda()
    idx = make_routing("same_rank", M_, K_, E, 1, gen).cuda()
    w = torch.rand(M_, K_, generator=gen).cuda()
    x8 = per_token_cast_to_fp8(x)
    stats = torch.zeros(E, dtype=torch.int32, device="cuda")
    sync_handle = buffer.dispatch(x, idx, w, num_experts=E, do_expand=True)[3]
    ref = reference_dispatch(x8, idx, w, E, M_, group, 4, True)
    results = []
    for attempt in range(3):  # the first call of the shape prepares it
        if attempt:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = buffer.dispatch(
                x8, idx, w, cumulative_local_expert_recv_stats=stats, num_experts=E,
                expert_alignment=4, num_sms=num_sms, num_qps=1,
                previous_event=buffer.capture(), previous_event_before_epilogue=buffer.capture(),
                async_with_compute_stream=True, allocate_on_comm_stream=True, do_cpu_sync=False,
                do_expand=True, use_tma_aligned_col_major_sf=True)
            out[4].current_stream_wait()
            cached = buffer.dispatch(x8, topk_weights=w, handle=out[3], num_sms=num_sms,
                                     use_tma_aligned_col_major_sf=True)
            cached_sync = buffer.dispatch(x, topk_weights=w, handle=sync_handle)
            combined = buffer.combine(out[0][0].float().to(torch.bfloat16), out[3],
                                      topk_weights=out[2], num_sms=num_sms,
                                      previous_event_before_epilogue=buffer.capture())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append((out, cached, cached_sync, combined))
    torch.cuda.synchronize()
    for out, cached, cached_sync, combined in results:
        case = Case(num_experts=E, do_expand=True, do_cpu_sync=False, expert_alignment=4,
                    fp8=True)
        _check_dispatch(K_, case, out[:4], ref)
        assert_tma_aligned_col_major("scales", out[0][1])
        _check_dispatch(K_, case, cached[:4], ref)
        assert_tma_aligned_col_major("cached scales", cached[0][1])
        assert cached_sync[3] is sync_handle and \
            cached_sync[0].shape[0] == sync_handle.num_expanded_tokens
    assert_equal("stats", stats, 3 * ref.num_recv_tokens_per_expert.to(torch.int32))

    # A CUDA graph of dispatch + combine (sync-free, single reduction), replayed.
    static = [x.clone(), idx.clone(), w.clone()]

    def step():
        recv_x, _, recv_w, handle, _ = buffer.dispatch(*static, num_experts=E, do_cpu_sync=False,
                                                       do_expand=True, expert_alignment=4)
        combined, combined_w, _ = buffer.combine((recv_x.float() * 2).to(torch.bfloat16),
                                                 handle, topk_weights=recv_w)
        return recv_x, combined, combined_w

    graph, (recv_x, combined, combined_w) = capture_graph(step)
    replays = 0
    for routing in ("balanced", "same_rank"):
        new_x = torch.randn(M_, H_, generator=gen).to(torch.bfloat16).cuda()
        new_idx = make_routing(routing, M_, K_, E, 1, gen).cuda()
        new_w = torch.rand(M_, K_, generator=gen).cuda()
        for target, value in zip(static, (new_x, new_idx, new_w)):
            target.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_dispatch(new_x, new_idx, new_w, E, M_, group, 4, True)
        n_e = ref.expand_valid.numel()
        y = (recv_x[:n_e].float() * 2).to(torch.bfloat16)
        expected, _ = reference_combine(y, ref, new_idx, E, group, single_reduction=True)
        assert_equal(f"replay {routing}: combined_x", combined, expected)
        _, want_w = reference_combine(y, ref, new_idx, E, group,
                                      topk_weights=ref.recv_topk_weights)
        assert_equal(f"replay {routing}: combined_topk_weights", combined_w, want_w)
        replays += 1
    return replays


@_NO_CUDA
@pytest.mark.parametrize("backend", ["collective", "symmetric"])
def test_cuda_sync_free_and_graph(backend: str):
    assert _run(run_cuda_sync_free, 1, backend, SEED, pg_backend="nccl") == [2]
