"""Dispatch and combine through `Buffer`, bitwise against `epcomm.testing.reference`, on local ranks.

Each test spawns its ranks once (gloo; on CUDA the ranks share the GPUs) and runs many cases
inside. Data is drawn afresh each run (the base seed comes from the clock and is printed on
failure).
"""
from __future__ import annotations

import itertools
import os
import time

import pytest
import torch
import torch.distributed as dist

from epcomm import Buffer, EPHandle, EPTimeoutError
from epcomm import autograd as ep_autograd
from epcomm.testing.launch import run_local_ranks
from epcomm.testing.reference import reference_combine, reference_dispatch
from epcomm.testing.verify import (Case, assert_equal, check_round_trip, memory_form_cases, run_cases,
                           run_matrix_cases)

BASE_SEED = int(os.environ.get("EPCOMM_TEST_SEED", time.time_ns() % 1_000_000))
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="CUDA tests need a GPU (none on this machine)")
# "device:backend". The symmetric backend's CPU (Triton interpreter) runs are in
# tests/test_symmetric.py: the interpreter is too slow for this whole matrix.
DEVICES = ["cpu:collective",
           pytest.param("cuda:collective", marks=_NO_CUDA),
           pytest.param("cuda:symmetric", marks=_NO_CUDA)]


def _buffer(target: str, max_tokens: int, hidden: int, num_topk: int, **kwargs) -> Buffer:
    device, backend = target.split(":")
    return Buffer(dist.group.WORLD, max_tokens, hidden, num_topk, device=device,
                  backend=backend, **kwargs)


def run_matrix(target: str, max_tokens: int, hidden: int, num_topk: int,
               experts_per_rank: int, seed: int) -> int:
    buffer = _buffer(target, max_tokens, hidden, num_topk)
    count = run_matrix_cases(buffer, experts_per_rank, seed)
    buffer.destroy()
    return count


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
def test_matrix(num_ranks: int, device: str) -> None:
    counts = run_local_ranks(run_matrix, num_ranks, device, 7, 160, 4, 3, BASE_SEED)
    assert counts == [64] * num_ranks


def run_memory_forms(target: str, seed: int) -> int:
    buffer = _buffer(target, 7, 160, 4)
    return run_cases(buffer, memory_form_cases(2 * buffer.num_ranks, seed), seed)


@pytest.mark.parametrize("device", DEVICES)
def test_inputs_not_contiguous_or_not_aligned(device: str) -> None:
    """Every tensor of a call strided or one element off a 16-byte boundary (`memory_form_cases`:
    after a plain call of the same shape, which a sync-free call prepares), bitwise."""
    assert run_local_ranks(run_memory_forms, 2, device, BASE_SEED) == [24, 24]


def run_narrow_fp8_rows(seed: int) -> int:
    """FP8 rows of at most 128 values have one scale column; with no tokens on a rank, torch
    makes that [0, 1] scales tensor "contiguous" with stride 0, which a byte view rejects."""
    buffer = _buffer("cpu:collective", 6, 64, 2)
    for i, expand in enumerate((False, True)):
        check_round_trip(buffer, Case(tokens="empty_last", num_experts=4, fp8=True,
                                      do_expand=expand, seed=seed + i))
    return 2


def test_fp8_rows_of_one_scale_with_an_empty_rank() -> None:
    assert run_local_ranks(run_narrow_fp8_rows, 2, BASE_SEED) == [2, 2]


def run_stream_options(target: str, avoid_record_stream: str, seed: int) -> int:
    """Every combination of the stream options, bitwise; on CPU they are no-ops."""
    os.environ["EP_AVOID_RECORD_STREAM"] = avoid_record_stream  # read when a Buffer is made
    buffer = _buffer(target, 7, 96, 4)
    assert buffer.avoid_record_stream == (avoid_record_stream == "1")
    count = 0
    for i, (use_async, on_comm, use_event) in enumerate(itertools.product((False, True), repeat=3)):
        if use_event and not on_comm:
            continue
        for sync in (True, False):
            case = Case(num_experts=2 * buffer.num_ranks, do_cpu_sync=sync, do_expand=i % 2 == 1,
                        async_with_compute_stream=use_async, allocate_on_comm_stream=on_comm,
                        use_previous_event=use_event, num_bias=1, seed=seed + 10 * i + sync)
            check_round_trip(buffer, case)
            count += 1
    buffer.destroy()
    return count


def run_stream_options_both_policies(target: str, seed: int) -> list[int]:
    """`run_stream_options` with EP_AVOID_RECORD_STREAM=0, then =1 (a buffer each)."""
    return [run_stream_options(target, policy, seed + 1000 * int(policy)) for policy in "01"]


@pytest.mark.parametrize("device", DEVICES)
def test_stream_options(device: str) -> None:
    """Both record-stream policies in one process group."""
    assert run_local_ranks(run_stream_options_both_policies, 2, device, BASE_SEED) == \
        [[12, 12]] * 2


def run_stream_order(target: str, seed: int) -> int:
    """Calls through one buffer never overlap, whichever stream is current, even when one
    rank's streams lag (rank 0 sleeps before its calls): a plain call queued behind a sleeping
    stream A, then calls on stream B; an async call queued behind the sleeping comm stream, then
    a plain call that does not wait for its event. A call that overtook an earlier one would
    meet the peer's earlier call and get its rows. Every result is checked against the
    reference. On the symmetric backend a plain call after one on the same stream skips the
    comm stream: it completes while the comm stream still sleeps."""
    buffer = _buffer(target, 8, 64, 2)
    rank, group, num_experts = buffer.rank, buffer.group, 2 * buffer.num_ranks
    gen = torch.Generator().manual_seed(seed + rank)
    sleep = 50_000_000 if rank == 0 else 0  # clock cycles: tens of milliseconds

    def draw():
        x = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(num_experts, generator=gen)[:2] for _ in range(8)])
        return x, idx, torch.randn(buffer.num_ranks * 8, 64, generator=gen).to(torch.bfloat16)

    data = [draw() for _ in range(5)]
    cuda = [(x.cuda(), idx.cuda(), y.cuda()) for x, idx, y in data]
    comm, a, b = buffer.get_comm_stream(), torch.cuda.Stream(), torch.cuda.Stream()
    kwargs = dict(num_experts=num_experts, do_cpu_sync=False)
    results = {}
    torch.cuda.synchronize()

    def round_trip(i, **extra):
        x, idx, y = cuda[i]
        recv_x, _, _, handle, event = buffer.dispatch(x, idx, **kwargs, **extra)
        event.current_stream_wait()
        results[i] = (recv_x, buffer.combine(y, handle)[0])

    with torch.cuda.stream(a):
        round_trip(0)  # the calls after it on this stream may skip the comm stream
        torch.cuda._sleep(sleep)
        round_trip(1)
    with torch.cuda.stream(b):
        round_trip(2)
        with torch.cuda.stream(comm):
            torch.cuda._sleep(sleep)
        x, idx, y = cuda[3]
        early = buffer.dispatch(x, idx, **kwargs, async_with_compute_stream=True)
        round_trip(4)
        early[4].current_stream_wait()
        results[3] = (early[0], buffer.combine(y, early[3])[0])
    torch.cuda.synchronize()
    if buffer.backend == "symmetric":
        with torch.cuda.stream(b):
            torch.cuda.synchronize()
            with torch.cuda.stream(comm):
                torch.cuda._sleep(4 * sleep)
            round_trip(2)
            b.synchronize()
            assert rank != 0 or not comm.query(), "a plain call waited for the busy comm stream"
        torch.cuda.synchronize()
    for i, (x, idx, y) in enumerate(data):
        ref = reference_dispatch(x, idx, None, num_experts, 8, group, 1, False)
        rows = ref.src_token.numel()
        want, _ = reference_combine(y[:rows], ref, idx, num_experts, group)
        assert_equal(f"recv_x of call {i}", results[i][0][:rows].cpu(), ref.recv_x)
        assert_equal(f"combined_x of call {i}", results[i][1].cpu(), want)
    buffer.destroy()
    return len(data)


@pytest.mark.parametrize("device", DEVICES[1:])
def test_calls_never_overlap_across_streams(device: str) -> None:
    assert run_local_ranks(run_stream_order, 2, device, BASE_SEED) == [5, 5]


def run_interleaved(target: str, seed: int) -> None:
    """Several handles alive at once through one buffer, combined out of order, with cached
    dispatches in between; every output is checked against the reference."""
    device = target.split(":")[0]
    buffer = _buffer(target, 9, 64, 3)
    group, num_experts = buffer.group, 4 * buffer.num_ranks
    gen = torch.Generator().manual_seed(seed + buffer.rank)
    live = []
    for step in range(4):
        num_tokens = int(torch.randint(0, 10, (), generator=gen))
        x = torch.randn(num_tokens, 64, generator=gen).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(num_experts, generator=gen)[:3] for _ in range(num_tokens)]) \
            if num_tokens else torch.zeros(0, 3, dtype=torch.long)
        expand, sync = step % 2 == 1, step < 2
        recv_x, _, _, handle, _ = buffer.dispatch(x.to(device), idx.to(device), num_experts=num_experts,
                                                  do_expand=expand, do_cpu_sync=sync)
        ref = reference_dispatch(x, idx, None, num_experts, 9, group, 1, expand)
        live.append((x, idx, handle, ref, expand))
    for x, idx, handle, ref, expand in reversed(live):
        cached = buffer.dispatch(x.to(device), handle=handle)[0]
        valid = ref.expand_valid if expand else torch.ones(ref.src_token.numel(), dtype=torch.bool)
        n_valid = valid.numel()
        assert_equal("cached recv_x", cached[:n_valid].cpu()[valid], ref.recv_x[valid])
        y = torch.randn(handle.num_output_rows, 64, generator=gen).to(torch.bfloat16)
        combined = buffer.combine(y.to(device), handle)[0]
        want, _ = reference_combine(y[:n_valid], ref, idx, num_experts, group)
        assert_equal("combined_x", combined, want)


@pytest.mark.parametrize("device", DEVICES)
def test_interleaved_calls(device: str) -> None:
    run_local_ranks(run_interleaved, 3, device, BASE_SEED)


def _expect_error(call, *fragments: str) -> None:
    try:
        call()
    except (ValueError, TypeError) as exc:
        message = str(exc)
        for fragment in fragments:
            assert fragment in message, f"error {message!r} does not name {fragment!r}"
        return
    raise AssertionError(f"no error raised; expected one naming {fragments}")


def run_bad_input(target: str, seed: int) -> int:
    """Every precondition of contract section 6 raises on every rank, naming the argument, and
    the buffer then serves a valid call correctly."""
    M, H, K = 6, 128, 2
    device = target.split(":")[0]
    buffer = _buffer(target, M, H, K)
    other = _buffer(target, M, H, K)
    E = 2 * buffer.num_ranks
    x = torch.randn(4, H).to(torch.bfloat16).to(device)
    idx = torch.tensor([[0, 1], [1, -1], [-1, -1], [E - 1, 0]], device=device)
    w = torch.rand(4, K, device=device)
    _, _, _, handle, _ = buffer.dispatch(x, idx, w, num_experts=E)
    _, _, _, foreign, _ = other.dispatch(x, idx, w, num_experts=E)
    rows = handle.num_recv_tokens
    y = torch.zeros(rows, H, dtype=torch.bfloat16, device=device)
    fp8 = torch.zeros(4, H, device=device).to(torch.float8_e4m3fn)
    d, c = buffer.dispatch, buffer.combine
    checks = [
        (lambda: d(x.float(), idx, num_experts=E), ("x", "bfloat16")),
        (lambda: d(x[0], idx, num_experts=E), ("x", "2-D")),
        (lambda: d(x[:, :64], idx, num_experts=E), ("x", "hidden")),
        (lambda: d(x.to("meta"), idx, num_experts=E), ("x", "device")),
        (lambda: d(torch.zeros(M + 1, H, dtype=torch.bfloat16, device=device),
                   torch.zeros(M + 1, K, dtype=torch.long, device=device), num_experts=E),
         ("num_max_tokens_per_rank",)),
        (lambda: d(x, idx, num_experts=E + 1) if buffer.num_ranks > 1 else d(x, idx, num_experts=0),
         ("num_experts",)),
        (lambda: d(x, idx), ("num_experts",)),
        (lambda: d(x, None, num_experts=E), ("topk_idx",)),
        (lambda: d(x, idx.float(), num_experts=E), ("topk_idx", "dtype")),
        (lambda: d(x, idx[:, :1], num_experts=E), ("topk_idx", "shape")),
        (lambda: d(x, idx.clone().fill_(E), num_experts=E), ("topk_idx", "outside")),
        (lambda: d(x, idx.clone().fill_(-2), num_experts=E), ("topk_idx", "outside")),
        (lambda: d(x, idx, w.double(), num_experts=E), ("topk_weights", "dtype")),
        (lambda: d(x, idx, w[:, :1], num_experts=E), ("topk_weights", "shape")),
        (lambda: d((fp8, torch.zeros(4, 2, device=device)), idx, num_experts=E), ("scales", "shape")),
        (lambda: d((x, torch.zeros(4, 1, device=device)), idx, num_experts=E), ("x[0]", "float8")),
        (lambda: d(x, idx, num_experts=E, expert_alignment=0), ("expert_alignment",)),
        (lambda: d(x, idx, num_experts=E, num_max_tokens_per_rank=M + 1), ("num_max_tokens_per_rank",)),
        (lambda: d(x, idx, num_experts=E, previous_event=buffer.capture()), ("previous_event",)),
        (lambda: d(x, handle=foreign), ("handle", "another Buffer")),
        (lambda: d(x[:3], handle=handle), ("handle", "tokens")),
        (lambda: d(x, handle="handle"), ("handle", "EPHandle")),
        (lambda: c(y.float(), handle), ("x", "bfloat16")),
        (lambda: c(y[:-1] if rows else torch.zeros(1, H, dtype=torch.bfloat16, device=device), handle),
         ("x", "shape")),
        (lambda: c(y, foreign), ("handle", "another Buffer")),
        (lambda: c(y, None), ("handle", "EPHandle")),
        (lambda: c(y, handle, topk_weights=torch.zeros(rows, K + 1, device=device)), ("topk_weights",)),
        (lambda: c(y, handle, bias=x[:, :64]), ("bias[0]", "shape")),
        (lambda: c(y, handle, bias=(x, x, x)), ("bias", "at most 2")),
        (lambda: c(y, handle, previous_event=buffer.capture()), ("previous_event",)),
    ]
    for call, fragments in checks:
        _expect_error(call, *fragments)
    # The buffer still works, bitwise.
    for case in (Case(num_experts=E, seed=seed), Case(num_experts=E, do_cpu_sync=False, do_expand=True,
                                                     expert_alignment=4, seed=seed + 1)):
        check_round_trip(buffer, case)
    return len(checks)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_bad_input_raises_then_buffer_works(num_ranks: int, device: str) -> None:
    assert run_local_ranks(run_bad_input, num_ranks, device, BASE_SEED) == [30] * num_ranks


def run_missing_peer(target: str) -> str:
    device = target.split(":")[0]
    buffer = _buffer(target, 4, 32, 2, timeout_s=1.0)
    if buffer.rank == 1:
        time.sleep(4)  # never joins the dispatch (alive well past rank 0's timeout)
        return "absent"
    x = torch.zeros(4, 32, dtype=torch.bfloat16, device=device)
    idx = torch.tensor([[0, 3]] * 4, device=device)
    start = time.monotonic()
    try:
        buffer.dispatch(x, idx, num_experts=4)
    except EPTimeoutError as exc:
        assert "rank 0" in str(exc) and "dispatch" in str(exc), str(exc)
        return f"timeout after {time.monotonic() - start:.1f}s"
    raise AssertionError("dispatch returned although a peer never arrived")


def test_missing_peer_times_out() -> None:
    results = run_local_ranks(run_missing_peer, 2, "cpu:collective", timeout_s=3.0)
    assert results[0].startswith("timeout") and results[1] == "absent", results


def run_autograd(target: str, do_expand: bool, do_cpu_sync: bool, seed: int) -> int:
    """Gradients of dispatch -> expert -> combine equal the reference's adjoint data movement:
    grad x = combine(dispatch(grad out)) and the weight gradients of the owners' slots."""
    M, H, K = 8, 64, 3
    device = target.split(":")[0]
    buffer = _buffer(target, M, H, K)
    group, E = buffer.group, 3 * buffer.num_ranks
    gen = torch.Generator().manual_seed(seed + buffer.rank)
    T = M - buffer.rank
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    idx[0, 1] = -1
    w = torch.rand(T, K, generator=gen)
    grad_out = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    grad_w = torch.randn(T, K, generator=gen)

    x_dev = x.to(device).requires_grad_()
    w_dev = w.to(device).requires_grad_()
    recv_x, recv_idx, recv_w, handle = ep_autograd.dispatch(
        buffer, x_dev, idx.to(device), w_dev, num_experts=E, do_expand=do_expand,
        do_cpu_sync=do_cpu_sync)
    out, out_w = ep_autograd.combine(buffer, recv_x, handle, topk_weights=recv_w)
    (out.float() * grad_out.to(device).float()).sum().backward(retain_graph=True)
    (out_w * grad_w.to(device)).sum().backward()

    # Forward: each rank's rows come back unchanged, so out = sum over receiving ranks of x.
    ref = reference_dispatch(x, idx, w, E, M, group, 1, do_expand)
    want_out, want_w = reference_combine(ref.recv_x, ref, idx, E, group, topk_weights=ref.recv_topk_weights)
    assert_equal("forward combined_x", out.detach(), want_out)
    assert_equal("forward combined_topk_weights", out_w.detach(), want_w)
    # Backward: grad x = combine of the dispatched output gradient (same data movement).
    ref_g = reference_dispatch(grad_out, idx, grad_w, E, M, group, 1, do_expand)
    recv_gw = ref_g.recv_topk_weights
    if not do_expand:  # only the slots this rank owns produced a combined weight
        recv_gw = torch.where(ref_g.recv_topk_idx >= 0, recv_gw, 0.0)
    want_gx, want_gw = reference_combine(ref_g.recv_x, ref_g, idx, E, group, topk_weights=recv_gw)
    assert_equal("x.grad", x_dev.grad, want_gx)
    assert_equal("topk_weights.grad", w_dev.grad, want_gw)
    buffer.destroy()
    return 1


def run_autograd_modes(target: str, seed: int) -> int:
    """`run_autograd` for both layouts and both sync modes (one process group)."""
    count = 0
    for do_expand, do_cpu_sync in ((False, True), (True, True), (False, False), (True, False)):
        try:
            count += run_autograd(target, do_expand, do_cpu_sync, seed + count)
        except AssertionError as exc:
            raise AssertionError(f"do_expand={do_expand} do_cpu_sync={do_cpu_sync}: {exc}") \
                from None
    return count


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_matches_reference(device: str) -> None:
    assert run_local_ranks(run_autograd_modes, 2, device, BASE_SEED) == [4, 4]


def test_handle_has_deepep_fields() -> None:
    """DeepEP's handle fields: dataclass fields, or properties for the tensors (read through
    the handle's `tensors` mapping)."""
    fields = set(EPHandle.__dataclass_fields__) | {
        name for name, value in vars(EPHandle).items() if isinstance(value, property)}
    for name in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                 "num_unaligned_recv_tokens_per_expert", "num_recv_tokens_per_expert_list",
                 "recv_src_metadata", "topk_idx", "num_experts", "expert_alignment",
                 "num_max_tokens_per_rank", "do_expand", "num_recv_tokens", "num_expanded_tokens"):
        assert name in fields, name
