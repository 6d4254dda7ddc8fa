"""Faults and mismatched ranks, on local gloo ranks: each gives a clear error within a stated
bound, never a hang, a crash or a silently wrong result; the buffer is usable afterwards where
every rank completed the call, broken (every later call raises `EPBrokenError` naming the first
failure) after a timeout, a lost peer or ranks out of step (docs/semantics.md, Faults).

The symmetric backend's kernels run under the Triton interpreter with tiny shapes; its waits
are wall-clock, so short `timeout_s` values bound each case. Every data result is compared
bitwise with the independent reference. `symmetric_faults` also runs on the GPU machine
(`scripts/gpu_faults.py`: several processes sharing a GPU), where sync-free calls report
through `check_errors()` instead of raising at once; so does `symmetric_peer_exits` (a peer
process that exits mid-protocol). The collective backend's peer exits: tests/test_collective.py.
"""
import math
import time

import pytest
import torch
import torch.distributed as dist

from epcomm import errors
from epcomm.testing.launch import run_local_ranks
from epcomm.testing.reference import reference_combine, reference_dispatch
from epcomm.testing.verify import assert_equal

H, K, M = 16, 2, 4
TIMEOUT_S = 0.5
PATIENT_S = 60.0  # cases that expect no timeout
MARGIN_S = 5.0  # the interpreter's launch and a loaded 2-core machine
COMPILE_S = 25.0  # a kernel variant compiled on the GPU machine while 4 processes share it


def _buffer(backend, device="cpu", **kwargs):
    from epcomm import Buffer
    return Buffer(dist.group.WORLD, kwargs.pop("max_tokens", M), kwargs.pop("hidden", H),
                  kwargs.pop("num_topk", K), backend=backend, device=device, **kwargs)


def _data(seed, num_tokens, num_experts, num_topk=K, hidden=H, device="cpu"):
    """Random bf16 rows, ids in [-1, E) and weights, drawn afresh per rank and seed."""
    gen = torch.Generator().manual_seed(100 * seed + dist.get_rank())
    x = torch.randn(num_tokens, hidden, generator=gen).bfloat16()
    idx = torch.randint(-1, num_experts, (num_tokens, num_topk), generator=gen)
    return [t.to(device) for t in (x, idx, torch.rand(num_tokens, num_topk, generator=gen))]


def _cpu(*tensors):
    return [None if t is None else t.cpu() for t in tensors]


def _round_trip(buffer, seed, num_experts, x=None, idx=None, weights=None, do_expand=False,
                expert_alignment=1, y_of=lambda recv_x: (recv_x.float() * 2).bfloat16()):
    """A synchronizing dispatch (of `x`, `idx`, `weights`, or random data) and a combine of
    `y_of(recv_x)` through `buffer`, bitwise against the reference (run on the host)."""
    group = dist.group.WORLD
    if x is None:
        x, idx, weights = _data(seed, [M, 3][dist.get_rank() % 2], num_experts,
                                device=buffer.device)
    recv_x, _, recv_w, handle, _ = buffer.dispatch(x, idx, weights, num_experts=num_experts,
                                                   do_expand=do_expand,
                                                   expert_alignment=expert_alignment,
                                                   do_zero_padding=True)
    ref = reference_dispatch(*_cpu(x, idx, weights), num_experts, M, group, expert_alignment,
                             do_expand)
    assert_equal("recv_x", recv_x[:ref.recv_x.shape[0]].cpu(), ref.recv_x)
    y = y_of(recv_x)
    combined, combined_w, _ = buffer.combine(y, handle, topk_weights=recv_w)
    want, want_w = reference_combine(y.cpu(), ref, idx.cpu(), num_experts, group,
                                     topk_weights=_cpu(recv_w)[0])
    assert_equal("combined_x", combined.cpu(), want)
    assert_equal("combined_topk_weights", combined_w.cpu(), want_w)
    return combined, combined_w


def _within(bound_s, fn, error, match, buffer=None):
    """`fn()` (then `buffer.check_errors()`, if given: a sync-free GPU call reports there)
    raises `error` matching `match` within `bound_s` seconds; returns its text."""
    start = time.monotonic()
    with pytest.raises(error, match=match) as info:
        fn()
        if buffer is not None:
            buffer.check_errors()
    spent = time.monotonic() - start
    assert spent < bound_s, f"{error.__name__} after {spent:.1f} s, bound {bound_s} s"
    return str(info.value)


# --------------------------------------------------------------------- host-side checks
def _bad_arguments_and_configurations():
    from epcomm import ElasticBuffer
    rank, group = dist.get_rank(), dist.group.WORLD
    # The timeout: a positive finite number of seconds, named in the error.
    for bad, error in ((math.inf, ValueError), (math.nan, ValueError), (-1.0, ValueError),
                       (0, ValueError), ("1", TypeError), (True, TypeError)):
        with pytest.raises(error, match="timeout_s"):
            _buffer("collective", timeout_s=bad)
    with pytest.raises(ValueError, match="num_max_tokens_per_rank"):
        _buffer("collective", max_tokens=True)
    # Ranks that disagree: every rank raises, naming each field and the ranks of each value.
    text = _within(30, lambda: _buffer("collective", hidden=H + 8 * rank,
                                        num_topk=K + rank), errors.EPMismatchError, "hidden")
    assert "hidden: 16 on rank(s) [0], 24 on rank(s) [1]" in text, text
    assert "num_topk: 2 on rank(s) [0], 3 on rank(s) [1]" in text, text
    assert "num_max_tokens_per_rank" not in text, text
    with pytest.raises(errors.EPMismatchError, match="max_tokens_per_rank: 4 on rank.s. .0."):
        _buffer("collective", max_tokens=M + rank)
    # ElasticBuffer makes its engines through Buffer: a first dispatch of another hidden size.
    elastic = ElasticBuffer(group, num_bytes=1 << 20)
    x, idx, weights = _data(1, M, 4, hidden=H + 8 * rank)
    with pytest.raises(errors.EPMismatchError, match="hidden"):
        elastic.dispatch(x, topk_idx=idx, topk_weights=weights, num_experts=4)

    buffer = _buffer("collective")
    x, idx, weights = _data(2, M, 4)
    with pytest.raises(TypeError, match="num_max_tokens_per_rank"):
        buffer.dispatch(x, idx, num_experts=4, num_max_tokens_per_rank=True)
    with pytest.raises(ValueError, match="expert_alignment=2147483648"):
        buffer.dispatch(x, idx, num_experts=4, expert_alignment=2**31, do_expand=True)
    # do_handle_copy=False: a cached dispatch of a topk_idx changed in place raises.
    recv_x = buffer.dispatch(x, idx, weights, num_experts=4, do_handle_copy=False)[0]
    handle = buffer.dispatch(x, idx, weights, num_experts=4, do_handle_copy=False)[3]
    assert_equal("cached dispatch", buffer.dispatch(x, handle=handle)[0], recv_x)
    idx[0, 0] = 3 - idx[0, 0].clamp(min=0)
    with pytest.raises(ValueError, match="modified in place"):
        buffer.dispatch(x, handle=handle)
    # Repeated ids past the sync-free expand capacity (rank 0 receives 2 * M * 2 pairs, room
    # for 2 * M * min(K, E_l) = 2 * M * 2): a CPU call raises at once; the buffer stays usable.
    repeated = torch.zeros(M, 3, dtype=torch.int64)
    three = _buffer("collective", num_topk=3)
    call = lambda: three.dispatch(x, repeated, num_experts=4, do_expand=True,  # noqa: E731
                                  do_cpu_sync=False)
    if rank == 0:
        with pytest.raises(errors.EPError, match="overflowed the expand capacity"):
            call()
    else:
        call()
    _round_trip(buffer, 3, 4, do_expand=True, expert_alignment=2)
    return True


def _fault_marks_broken():
    """A fault on one call (a lost peer, as a backend reports it; a transport error) breaks the
    buffer: every later call raises naming it, through an ElasticBuffer too."""
    from epcomm import ElasticBuffer
    group = dist.group.WORLD
    x, idx, weights = _data(4, M, 4)
    for fault in (errors.EPFaultError("dispatch: peer rank 1 was lost"),
                  dist.DistBackendError("Connection reset by peer")):
        buffer = _buffer("collective")

        def lost(request, fault=fault):
            raise fault
        buffer._backend.dispatch = lost
        with pytest.raises(type(fault)):
            buffer.dispatch(x, idx, weights, num_experts=4)
        first = str(fault).split(":")[-1].strip()
        for later in (lambda: buffer.dispatch(x, idx, num_experts=4, do_cpu_sync=False),
                      lambda: buffer.combine(x, None), buffer.barrier):
            with pytest.raises(errors.EPBrokenError, match=first):
                later()
        buffer.destroy()
    elastic = ElasticBuffer(group, num_max_tokens_per_rank=M, hidden=H, num_topk=K,
                            num_bytes=1 << 20)
    handle = elastic.dispatch(x, topk_idx=idx, topk_weights=weights, num_experts=4)[3]
    engine = elastic._handle_engine(handle)

    def timed_out(request):
        raise errors.EPTimeoutError("combine: a peer did not arrive within 0.5 s")
    engine._backend.combine = timed_out
    with pytest.raises(errors.EPTimeoutError):
        elastic.combine(x[:0].new_zeros(handle.num_recv_tokens, H), handle)
    with pytest.raises(errors.EPBrokenError, match="did not arrive"):
        elastic.dispatch(x, topk_idx=idx, topk_weights=weights, num_experts=4)
    return True


def _host_side():
    _bad_arguments_and_configurations()
    return _fault_marks_broken()


def test_bad_arguments_mismatched_configurations_and_a_fault_breaks_the_buffer():
    """Both on the collective backend (its own faults: tests of that backend)."""
    assert run_local_ranks(_host_side, 2, timeout_s=60, deadline_s=120) == [True, True]


# --------------------------------------------------------------------- symmetric backend
def _warm_up(device):
    """On the GPU, one synchronizing and one sync-free round trip on a buffer with a long
    timeout first, so that no rank is still compiling kernels when a peer's 0.5 s wait starts
    (several processes share the GPU and compile on their first calls)."""
    if device == "cpu":
        return
    buffer = _buffer("symmetric", device, timeout_s=PATIENT_S)
    _round_trip(buffer, 11, 4)
    x, idx, weights = _data(12, M, 4, device=device)
    recv_x, _, _, handle, _ = buffer.dispatch(x, idx, weights, num_experts=4,
                                              num_max_tokens_per_rank=M, do_cpu_sync=False)
    buffer.combine(recv_x, handle)
    buffer.check_errors()
    buffer.destroy()
    dist.barrier()


def symmetric_faults(device):
    """The symmetric backend's faults on `device` ("cpu": the interpreter; "cuda"), any number
    of ranks: rank 0 is the early one, the others the late ones."""
    rank = dist.get_rank()
    late = rank > 0
    # Mismatches and NaN on a buffer with a long timeout: on the GPU a rank whose arguments
    # differ may compile another kernel variant on its call while its peers wait.
    buffer = _buffer("symmetric", device, timeout_s=PATIENT_S)
    # (the bound of a mismatched call: on the GPU it may compile its kernel variant first)
    mismatch_s = MARGIN_S if device == "cpu" else MARGIN_S + COMPILE_S
    # Different num_experts at dispatch: flagged on every rank (a call that reads the host
    # raises at once), not mixed; every rank completed the call, so the buffer stays usable.
    # The message names the first peer that differs.
    x, idx, weights = _data(5, M, 4, device=device)
    first_other = f"other arguments.*first seen from rank {0 if late else 1}"
    _within(mismatch_s, lambda: buffer.dispatch(x, idx, weights, num_experts=4 * (1 + rank)),
            errors.EPMismatchError, first_other)
    # ... likewise a different num_max_tokens_per_rank in a sync-free dispatch.
    _within(mismatch_s, lambda: buffer.dispatch(x[:1], idx[:1], weights[:1], num_experts=4,
                                                num_max_tokens_per_rank=M - rank,
                                                do_cpu_sync=False),
            errors.EPMismatchError, first_other, buffer)
    _round_trip(buffer, 6, 4)

    # A combine whose ranks disagree (weights from rank 0 only): flagged on every rank; where
    # the outputs come back before the flag is read (a combine on the GPU), each rank's sum
    # leaves out the rows of the ranks that differ from it (rank 0 keeps only its own rows,
    # every other rank those of every rank but 0).
    x, idx, weights = _data(9, M, 4, device=device)
    recv_x, _, recv_w, handle, _ = buffer.dispatch(x, idx, weights, num_experts=4)
    y = (recv_x.float() * 3).bfloat16()
    got = []
    _within(mismatch_s, lambda: got.append(buffer.combine(
        y, handle, topk_weights=recv_w if rank == 0 else None)[0]),
        errors.EPMismatchError, first_other, buffer)
    group = dist.group.WORLD
    ref = reference_dispatch(*_cpu(x, idx, weights), 4, M, group)
    rows = ref.src_token.shape[0]
    # (row n of y goes back to rank src_token[n] // M, which keeps it if it agrees with us)
    kept = ((ref.src_token // M == 0) == (rank == 0)).view(-1, 1)
    y_own = torch.where(kept, y[:rows].cpu(), torch.zeros((), dtype=torch.bfloat16))
    want = reference_combine(y_own, ref, idx.cpu(), 4, group)[0]
    if got:
        assert_equal("combine with a mismatched peer", got[0].cpu(), want)

    # NaN: dispatch moves the bits (0xFFFF, a signalling 0x7F81); a NaN combine output is the
    # canonical quiet NaN, as the reference's.
    x, idx, weights = _data(7, M, 4, device=device)
    x.view(torch.int16)[0, :2] = torch.tensor([-1, 0x7F81], dtype=torch.int16)
    weights.view(torch.int32)[:, 0] = -1  # 0xFFFFFFFF
    idx[0] = torch.tensor([0, 3])
    combined, combined_w = _round_trip(buffer, 7, 4, x, idx, weights, y_of=lambda y: y)
    assert combined.view(torch.int16)[0, :2].tolist() == [0x7FC0, 0x7FC0]
    assert combined_w.view(torch.int32)[0, 0] == 0x7FC00000

    buffer.destroy()
    _warm_up(device)
    buffer = _buffer("symmetric", device, timeout_s=TIMEOUT_S)
    dist.barrier()  # (a new buffer returns on each rank once it has mapped its peers)

    # Peers that sleep past the timeout, then arrive: rank 0 times out (wall-clock: the error
    # names the rank, the stage and the timeout) and its buffer is broken; the late ranks get
    # rank 0's rows (it had sent them), then time out on their next call, which rank 0 never
    # makes.
    x, idx, weights = _data(8, M, 4, device=device)
    if late:
        time.sleep(TIMEOUT_S + 1.0)
        buffer.dispatch(x, idx, weights, num_experts=4)
    else:
        text = _within(TIMEOUT_S + MARGIN_S,
                       lambda: buffer.dispatch(x, idx, weights, num_experts=4),
                       errors.EPTimeoutError, "dispatch")
        assert "rank 0" in text and f"timeout_s={TIMEOUT_S}" in text, text
    text = _within(TIMEOUT_S + MARGIN_S if late else 1,
                   lambda: buffer.dispatch(x, idx, weights, num_experts=4),
                   errors.EPTimeoutError if late else errors.EPBrokenError, f"rank {rank}")
    assert late or ("did not arrive" in text and "destroy" in text), text
    _within(1, lambda: buffer.combine(x, None), errors.EPBrokenError, f"rank {rank}")
    buffer.destroy()

    # Out of step: a rank that never learns of its timeout (a sync-free GPU call nobody
    # checks) goes on to its next call while its peers are still before their first; they
    # find its ready counter past their call and ignore its rows instead of mixing them.
    buffer = _buffer("symmetric", device, timeout_s=TIMEOUT_S)
    if late:
        dist.barrier()  # (rank 0 has made both calls)
        _within(MARGIN_S, lambda: buffer.dispatch(x, idx, weights, num_experts=4,
                                                  do_cpu_sync=False),
                errors.EPFaultError, "out of step.*first seen from rank 0", buffer)
    else:
        for _ in range(2):
            _within(TIMEOUT_S + MARGIN_S, lambda: buffer.dispatch(
                x, idx, weights, num_experts=4, do_cpu_sync=False), errors.EPTimeoutError,
                "did not arrive", buffer)
            buffer._fault = None  # as a rank that has not read its error flag
        dist.barrier()
    buffer.destroy()
    dist.barrier()
    return True


def test_symmetric_mismatch_nan_timeout_and_out_of_step():
    pytest.importorskip("triton")
    assert run_local_ranks(symmetric_faults, 2, "cpu", timeout_s=60,
                           deadline_s=180) == [True, True]


def symmetric_peer_exits(device):
    """The last rank makes a dispatch, then its process exits; every other rank's combine of
    that dispatch (its peer never returns the rows) raises EPTimeoutError naming the combine
    within the timeout and a margin, and the buffer is broken afterwards. (Peer memory cannot
    tell a dead peer from a slow one: a timeout is the error.)"""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    _warm_up(device)
    buffer = _buffer("symmetric", device, timeout_s=TIMEOUT_S)
    dist.barrier()
    num_experts = 2 * num_ranks
    x, idx, weights = _data(10, M, num_experts, device=device)
    recv_x, _, _, handle, _ = buffer.dispatch(x, idx, weights, num_experts=num_experts)
    if rank == num_ranks - 1:
        return "left"  # the process group is destroyed, the process exits
    text = _within(TIMEOUT_S + MARGIN_S, lambda: buffer.combine(recv_x, handle),
                   errors.EPTimeoutError, "combine", buffer)
    assert f"rank {rank}" in text, text
    _within(1, lambda: buffer.dispatch(x, idx, weights, num_experts=num_experts),
            errors.EPBrokenError, "combine")
    return "timeout"


def test_symmetric_peer_exits():
    pytest.importorskip("triton")
    assert run_local_ranks(symmetric_peer_exits, 2, "cpu", timeout_s=60,
                           deadline_s=120) == ["timeout", "left"]
