"""`epcomm.legacy.Buffer`'s low-latency mode (DeepEP V1's `low_latency_dispatch` /
`low_latency_combine`) on local gloo ranks, bitwise against
`epcomm.testing.reference_low_latency`.

One spawn per configuration runs every behaviour (spawning dominates the time): random routing
with -1 ids, skew and an empty rank; bf16, FP8, power-of-two and UE8M0 dispatch; the slot
order of the combine's sum; the hook path against the plain one, with two micro-batches in
flight; `out=`; `zero_copy`; the stats tensors; a stale handle; bad arguments; ranks whose
calls disagree (the collective transport on gloo raises on every rank); on peer memory
a peer that never calls (a timeout error); the mask API with the last rank masked (and idle).
CPU: the collective transport on 1 and 3 ranks, the symmetric one under the Triton interpreter
on 1 and 2 (small shapes: the interpreter is slow). GPU (skipped without CUDA): 1, 2, 4 and 8
processes sharing the GPU on peer memory, 2 on the collective transport, and a CUDA-graph
replay against eager. The reference itself is checked on a hand-computed example.
"""
import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from epcomm.errors import EPMismatchError, EPTimeoutError
from epcomm.legacy import Buffer, LowLatencyHandle
from epcomm.testing.launch import capture_graph, run_seeded
from epcomm.testing.reference_low_latency import (reference_low_latency_combine,
                                                  reference_low_latency_dispatch)
from epcomm.testing.verify import assert_equal, assert_filled

SEED = int(os.environ.get("EPCOMM_TEST_SEED", time.time_ns() % 1_000_000))
M, H, K = 4, 256, 3
MODES = {"bf16": dict(use_fp8=False), "fp8": dict(use_fp8=True),
         "fp8-pow2": dict(use_fp8=True, round_scale=True),
         "ue8m0": dict(use_fp8=True, round_scale=True, use_ue8m0=True)}


def _routing(gen, num_tokens, num_experts, num_ranks, rank):
    """[T, K] int64 experts per token, skewed towards rank 0's experts, ~1/5 -1, and in ~1/4
    of the tokens the last slot repeating the first's expert (one row, two weights)."""
    weights = torch.ones(num_experts)
    weights[:num_experts // num_ranks] = 4.0
    rows = [torch.multinomial(weights, K, replacement=False, generator=gen)
            for _ in range(num_tokens)]
    idx = torch.stack(rows) if rows else torch.zeros((0, K), dtype=torch.int64)
    repeat = torch.rand(idx.shape[0], generator=gen) < 0.25
    idx[:, -1] = torch.where(repeat, idx[:, 0], idx[:, -1])
    drop = torch.rand(idx.shape, generator=gen) < 0.2
    return torch.where(drop, -1, idx)


def _inputs(seed, rank, num_ranks, num_experts, num_tokens=None):
    """(x, topk_idx, weights, expert outputs) of a rank; `num_tokens` None: random (0 on the
    last rank when there are several)."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    if num_tokens is None:
        num_tokens = 0 if num_ranks > 1 and rank == num_ranks - 1 else int(
            torch.randint(1, M + 1, (1,), generator=gen))
    x = (torch.randn((num_tokens, H), generator=gen) * 3).to(torch.bfloat16)
    topk_idx = _routing(gen, num_tokens, num_experts, num_ranks, rank)
    weights = torch.rand((num_tokens, K), generator=gen) * 2 - 1
    # rows of very different magnitudes: the order of the additions shows in the result
    magnitude = 2.0 ** torch.randint(0, 24, (num_experts // num_ranks, num_ranks * M, 1),
                                     generator=gen)
    expert_out = (torch.randn((num_experts // num_ranks, num_ranks * M, H), generator=gen)
                  * magnitude).to(torch.bfloat16)
    return x, topk_idx, weights, expert_out


def _check_dispatch(name, got, ref, mode):
    recv_x, recv_count, handle = got
    assert_equal(f"{name} recv_count", recv_count.cpu(), ref.recv_count, check_dtype=True)
    assert_equal(f"{name} layout_range", handle[1].cpu(), ref.layout_range, check_dtype=True)
    fp8 = MODES[mode].get("use_fp8", False)
    rows, scales = recv_x if fp8 else (recv_x, None)
    if fp8:
        assert scales.stride()[1:] == (1, scales.shape[1]), f"{name}: scales not column-major"
        scales = scales.cpu()
    rows, handle = rows.cpu(), (handle[0].cpu(),)
    for e, count in enumerate(ref.recv_count.tolist()):
        assert_equal(f"{name} recv_x[{e}]", rows[e, :count], ref.rows[e], check_dtype=True)
        assert_equal(f"{name} src_info[{e}]", handle[0][e, :count], ref.src_info[e],
                     check_dtype=True)
        if fp8:
            assert_equal(f"{name} scales[{e}]", scales[e, :count], ref.scales[e],
                         check_dtype=True)


def _hand_example(backend):
    """One rank, E = 2, M = 2, H = 128: the reference, and the transport's dispatch (on one
    rank the symmetric one's `ll_dispatch_local`, whose docstring has this example), against
    values worked out by hand."""
    group = dist.group.WORLD
    x = torch.ones((2, 128), dtype=torch.bfloat16)
    topk_idx = torch.tensor([[1, 0], [1, -1]])
    ref = reference_low_latency_dispatch(x, topk_idx, 2, 2, group, use_fp8=True)
    buffer = Buffer(group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(2, 128, 1, 2),
                    low_latency_mode=True, backend=backend, explicitly_destroy=True)
    (rows, scales), count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, 2, 2)
    for got in (ref, SimpleNamespace(recv_count=count, layout_range=handle[1],
                                     src_info=handle[0], rows=rows, scales=scales)):
        assert got.recv_count.tolist() == [1, 2]
        assert got.layout_range.tolist() == [[1], [2]]     # begin 0, counts 1 and 2
        assert got.src_info[1][:2].tolist() == [0, 1]
        assert got.rows[1][:2].float().unique().tolist() == [448.0]  # 1 / (1 / 448)
        assert got.scales[0][:1].tolist() == [[torch.tensor(1.0) / torch.tensor(448.0)]]
    buffer.destroy()
    ref = reference_low_latency_dispatch(x, topk_idx, 2, 2, group, use_fp8=True,
                                         round_scale=True, use_ue8m0=True)
    assert ref.rows[1].float().unique().tolist() == [256.0]  # scale 2^-8 >= 1 / 448
    assert ref.scales[0].tolist() == [[127 - 8]]
    out = torch.zeros((2, 4, 128), dtype=torch.bfloat16)
    out[1, 0], out[0, 0], out[1, 1] = 2.0, 4.0, 8.0
    weights = torch.tensor([[0.5, 0.25], [0.5, 100.0]])
    combined = reference_low_latency_combine(out, ref, weights, group)
    assert combined[0].float().unique().tolist() == [2.0]    # 0.5 * 2 + 0.25 * 4
    assert combined[1].float().unique().tolist() == [4.0]    # 0.5 * 8, the -1 slot skipped


def _errors(buffer, x, topk_idx, num_experts):
    def raises(exc, match, fn, *args, **kwargs):
        with pytest.raises(exc, match=match):
            fn(*args, **kwargs)

    d = buffer.low_latency_dispatch
    raises(ValueError, "num_max_dispatch_tokens_per_rank", d, x, topk_idx, 0, num_experts)
    raises(ValueError, "num_experts", d, x, topk_idx, M, 0)
    raises(TypeError, "x must have dtype", d, x.float(), topk_idx, M, num_experts)
    raises(TypeError, "topk_idx must have dtype", d, x, topk_idx.float(), M, num_experts)
    raises(ValueError, "use_ue8m0", d, x, topk_idx, M, num_experts, use_ue8m0=True)
    raises(ValueError, "async_finish", d, x, topk_idx, M, num_experts, async_finish=True,
           return_recv_hook=True)
    raises(ValueError, "cumulative_local_expert_recv_stats", d, x, topk_idx, M, num_experts,
           cumulative_local_expert_recv_stats=torch.zeros(1, dtype=torch.int32))
    raises(ValueError, "dispatch_wait_recv_cost_stats", d, x, topk_idx, M, num_experts,
           dispatch_wait_recv_cost_stats=torch.zeros(99, dtype=torch.int64))
    raises(ValueError, "more than num_max", d, torch.zeros((M + 1, H), dtype=torch.bfloat16),
           torch.zeros((M + 1, K), dtype=torch.int64), M, num_experts)
    raises(ValueError, "multiple of 128", d, torch.zeros((1, 64), dtype=torch.bfloat16),
           torch.zeros((1, K), dtype=torch.int64), M, num_experts)
    small = Buffer(dist.group.WORLD, num_rdma_bytes=128, low_latency_mode=True)
    raises(ValueError, "num_rdma_bytes", small.low_latency_dispatch, x, topk_idx, M, num_experts)
    normal = Buffer(dist.group.WORLD)
    raises(RuntimeError, "low_latency_mode=True", normal.low_latency_dispatch, x, topk_idx, M,
           num_experts)
    raises(RuntimeError, "enable_shrink", normal.low_latency_clean_mask_buffer)
    raises(TypeError, "handle", buffer.low_latency_combine, torch.zeros(1), topk_idx,
           torch.zeros(topk_idx.shape), ("not", "a", "handle"))
    raises(ValueError, "rank_to_mask", buffer.low_latency_update_mask_buffer, 99, True)
    handle = buffer.low_latency_dispatch(x, topk_idx, M, num_experts)[2]
    raises(ValueError, "use_logfmt", buffer.low_latency_combine,
           torch.zeros((num_experts // buffer.group_size, buffer.group_size * M, H),
                       dtype=torch.bfloat16, device=x.device),
           topk_idx, torch.zeros(topk_idx.shape, device=x.device), handle, use_logfmt=True,
           zero_copy=True)


def _rank_main(seed, num_experts, backend, device):
    """Every behaviour on this rank; the reference on CPU copies (gloo group)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    if num_ranks == 1 and device == "cpu":
        _hand_example(backend)
    num_local = num_experts // num_ranks
    hint = Buffer.get_low_latency_rdma_size_hint(M, H, num_ranks, num_experts)
    buffer = Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, enable_shrink=True,
                    backend=backend)
    x_ref, idx_ref, w_ref, out_ref = _inputs(seed, rank, num_ranks, num_experts)
    x, topk_idx, weights, expert_out = (t.to(device) for t in (x_ref, idx_ref, w_ref, out_ref))
    stats = torch.zeros(num_local, dtype=torch.int32, device=device)
    wait = torch.zeros(num_ranks, dtype=torch.int64, device=device)
    expected_stats = torch.zeros(num_local, dtype=torch.int32)

    # the interpreter is slow: the symmetric transport runs two of the four modes here (plain
    # FP8 runs in the hook part below)
    modes = ("bf16", "ue8m0") if backend == "symmetric" else tuple(MODES)
    for mode in modes:
        options = MODES[mode]
        ref = reference_low_latency_dispatch(x_ref, idx_ref, M, num_experts, group, **options)
        ref_combined = reference_low_latency_combine(out_ref, ref, w_ref, group)
        recv_x, count, handle, event, hook = buffer.low_latency_dispatch(
            x, topk_idx, M, num_experts, cumulative_local_expert_recv_stats=stats,
            dispatch_wait_recv_cost_stats=wait, **options)
        assert hook is None and event.event is None and isinstance(handle, LowLatencyHandle)
        assert handle[2:] == (M, H, num_experts)
        expected_stats += ref.recv_count
        _check_dispatch(mode, (recv_x, count, handle), ref, mode)
        combined, _, hook = buffer.low_latency_combine(expert_out, topk_idx, weights, handle,
                                                       combine_wait_recv_cost_stats=wait)
        assert hook is None
        assert_equal(f"{mode} combined", combined.cpu(), ref_combined, check_dtype=True)
    assert_equal("cumulative_local_expert_recv_stats", stats.cpu(), expected_stats)

    # LogFMT-10 combine: groups spanning more than 32 octaves (tiny channels round to 0),
    # +-Inf, NaN and zeros cross as reference_logfmt says
    wide = out_ref.clone()
    wide[:, :, :8] *= 2.0 ** -60
    wide[:, 0, 130], wide[:, 1, 5], wide[:, 2, 200:] = float("inf"), float("nan"), 0.0
    ref = reference_low_latency_dispatch(x_ref, idx_ref, M, num_experts, group, use_fp8=False)
    got = buffer.low_latency_dispatch(x, topk_idx, M, num_experts, use_fp8=False)
    combined, _, _ = buffer.low_latency_combine(wide.to(device), topk_idx, weights, got[2],
                                                use_logfmt=True)
    assert_equal("logfmt combined", combined.cpu(),
                 reference_low_latency_combine(wide, ref, w_ref, group, use_logfmt=True))

    # the order of the additions: slot order gives (2^24 + 1) - 2^24 = 0 in fp32
    order_idx = torch.tensor([[0, 1, 2]], device=device).expand(x.shape[0], K).contiguous()
    values = torch.zeros(num_experts)
    values[:3] = torch.tensor([2.0 ** 24, 1.0, -2.0 ** 24])
    order_out = values[rank * num_local:(rank + 1) * num_local].view(-1, 1, 1).expand(
        num_local, num_ranks * M, H).to(device=device, dtype=torch.bfloat16)
    ones = torch.ones((x.shape[0], K), device=device)
    got = buffer.low_latency_dispatch(x, order_idx, M, num_experts, use_fp8=False)
    combined, _, _ = buffer.low_latency_combine(order_out, order_idx, ones, got[2])
    assert_filled("slot-order combine", combined.cpu(), 0.0)
    if device == "cpu" or backend == "symmetric":  # recorded where waits are timed
        assert bool((wait.cpu()[[r for r in range(num_ranks) if r != rank]] > 0).all()), wait

    # the hook path, two micro-batches in flight: dispatch A, dispatch B, then receive both
    options = MODES["fp8"]
    ref = reference_low_latency_dispatch(x_ref, idx_ref, M, num_experts, group, **options)
    ref_combined = reference_low_latency_combine(out_ref, ref, w_ref, group)
    x_b = x.flip(0).contiguous()
    ref_b = reference_low_latency_dispatch(x_ref.flip(0), idx_ref, M, num_experts, group,
                                           **options)
    got_a = buffer.low_latency_dispatch(x, topk_idx, M, num_experts, return_recv_hook=True,
                                        **options)
    got_b = buffer.low_latency_dispatch(x_b, topk_idx, M, num_experts, return_recv_hook=True,
                                        **options)
    got_a[4]()
    got_b[4]()
    _check_dispatch("hook A", got_a[:3], ref, "fp8")
    _check_dispatch("hook B", got_b[:3], ref_b, "fp8")
    out = torch.empty((x.shape[0], H), dtype=torch.bfloat16, device=device)
    combined_a, _, hook_a = buffer.low_latency_combine(expert_out, topk_idx, weights, got_a[2],
                                                       return_recv_hook=True, out=out)
    zero_copy = buffer.get_next_low_latency_combine_buffer(got_b[2])
    zero_copy.copy_(expert_out)
    combined_b, _, hook_b = buffer.low_latency_combine(
        torch.empty_like(expert_out), topk_idx, weights, got_b[2], zero_copy=True,
        return_recv_hook=True)
    hook_a()
    hook_b()
    assert combined_a is out
    assert_equal("hook combine (out=)", combined_a.cpu(), ref_combined)
    assert_equal("hook combine (zero_copy)", combined_b.cpu(), ref_combined)
    # the next dispatch reuses A's buffer: A's handle is stale
    buffer.low_latency_dispatch(x, topk_idx, M, num_experts, **options)
    with pytest.raises(RuntimeError, match="reused"):
        buffer.low_latency_combine(expert_out, topk_idx, weights, got_a[2])
    # the combine's input may be written once the call returns, before its hook
    written = expert_out.clone()
    got = buffer.low_latency_dispatch(x, topk_idx, M, num_experts, use_fp8=False)
    combined, _, hook = buffer.low_latency_combine(written, topk_idx, weights, got[2],
                                                   return_recv_hook=True)
    written.fill_(7.0)
    hook()
    ref = reference_low_latency_dispatch(x_ref, idx_ref, M, num_experts, group, use_fp8=False)
    assert_equal("combine input written before the hook", combined.cpu(),
                 reference_low_latency_combine(out_ref, ref, w_ref, group))
    got = buffer.low_latency_dispatch(x, topk_idx, M, num_experts, use_fp8=False)
    buffer.get_next_low_latency_combine_buffer(got[2]).copy_(expert_out)
    combined, _, _ = buffer.low_latency_combine(torch.empty_like(expert_out), topk_idx, weights,
                                                got[2], zero_copy=True)
    assert_equal("combine (zero_copy)", combined.cpu(),
                 reference_low_latency_combine(out_ref, ref, w_ref, group))
    _errors(buffer, x, topk_idx, num_experts)
    if backend == "collective" and num_ranks > 1:
        # Ranks whose calls disagree (messages of other sizes: gloo would abort) raise on every
        # rank before anything is sent; the buffer goes on working.
        with pytest.raises(EPMismatchError, match="use_fp8"):
            buffer.low_latency_dispatch(x, topk_idx, M, num_experts, use_fp8=rank == 0)
        got = buffer.low_latency_dispatch(x, topk_idx, M, num_experts, use_fp8=False)
        with pytest.raises(EPMismatchError, match="use_logfmt"):
            buffer.low_latency_combine(expert_out, topk_idx, weights, got[2],
                                       use_logfmt=rank == 0)
        got = buffer.low_latency_dispatch(x, topk_idx, M, num_experts, use_fp8=False)
        combined, _, _ = buffer.low_latency_combine(expert_out, topk_idx, weights, got[2])
        ref = reference_low_latency_dispatch(x_ref, idx_ref, M, num_experts, group,
                                             use_fp8=False)
        assert_equal("combined after a mismatch", combined.cpu(),
                     reference_low_latency_combine(out_ref, ref, w_ref, group))
    buffer.clean_low_latency_buffer(M, H, num_experts)

    if backend == "symmetric" and num_ranks > 1:  # a peer that does not call: a timeout
        # error, not a hang
        quick = Buffer(group, num_rdma_bytes=hint, low_latency_mode=True, backend=backend,
                       low_latency_timeout_s=2.0)  # above any wait of a live peer
        got = quick.low_latency_dispatch(x, topk_idx, M, num_experts)
        quick.low_latency_combine(expert_out, topk_idx, weights, got[2])
        if rank == 0:
            with pytest.raises(EPTimeoutError, match="timeout"):
                quick.low_latency_dispatch(x, topk_idx, M, num_experts)
                quick.low_latency_check_errors()  # CUDA: the flag is read back here
        dist.barrier()

    if num_ranks > 1:  # the last rank fails: every other rank masks it, it calls nothing
        dead = num_ranks - 1
        ref = reference_low_latency_dispatch(x_ref, idx_ref, M, num_experts, group,
                                             masked=(dead,))
        ref_combined = reference_low_latency_combine(out_ref, ref, w_ref, group,
                                                     masked=(dead,))
        if rank != dead:
            buffer.low_latency_update_mask_buffer(dead, True)
            status = torch.zeros(num_ranks, dtype=torch.int32)
            buffer.low_latency_query_mask_buffer(status)
            assert status.tolist() == [int(r == dead) for r in range(num_ranks)]
            got = buffer.low_latency_dispatch(x, topk_idx, M, num_experts, use_fp8=False)
            _check_dispatch("masked", got[:3], ref, "bf16")
            combined, _, _ = buffer.low_latency_combine(expert_out, topk_idx, weights, got[2])
            assert_equal("masked combined", combined.cpu(), ref_combined)
            buffer.low_latency_clean_mask_buffer()
            buffer.low_latency_query_mask_buffer(status)
            assert status.tolist() == [0] * num_ranks
        dist.barrier()
    return True


_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="CUDA runs need a GPU (none on this machine)")


@pytest.mark.parametrize("num_ranks,num_experts,backend,device", [
    (1, 4, "collective", "cpu"), (3, 6, "collective", "cpu"), (1, 4, "symmetric", "cpu"),
    (2, 4, "symmetric", "cpu"),
    pytest.param(1, 4, "symmetric", "cuda", marks=_NO_CUDA),
    pytest.param(2, 4, "symmetric", "cuda", marks=_NO_CUDA),
    pytest.param(4, 8, "symmetric", "cuda", marks=_NO_CUDA),
    pytest.param(8, 16, "symmetric", "cuda", marks=_NO_CUDA),
    pytest.param(2, 4, "collective", "cuda", marks=_NO_CUDA)])
def test_low_latency(num_ranks, num_experts, backend, device):
    """Collective transport on gloo ranks; the symmetric one under the Triton interpreter on
    CPU (small: the interpreter is slow), and with the ranks sharing one GPU."""
    assert run_seeded(_rank_main, num_ranks, SEED, SEED, num_experts, backend, device) == \
        [True] * num_ranks


def _graph_main(seed):
    """Dispatch + combine captured in a CUDA graph, replayed on new data, equal to eager."""
    num_experts = 8
    hint = Buffer.get_low_latency_rdma_size_hint(M, H, 1, num_experts)
    buffer = Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True)
    inputs = [t.cuda() for t in _inputs(seed, 0, 1, num_experts)]
    x, topk_idx, weights, expert_out = inputs

    def step():
        recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, M, num_experts,
                                                                  use_fp8=True)
        combined, _, _ = buffer.low_latency_combine(expert_out, topk_idx, weights, handle)
        return recv_x, count, combined

    graph, outputs = capture_graph(step)
    for target, new in zip(inputs, _inputs(seed + 1, 0, 1, num_experts, x.shape[0])):
        target.copy_(new)
    graph.replay()
    replayed = [t.clone() for t in (*outputs[0], outputs[1], outputs[2])]
    eager = step()
    for name, got, want in zip(("recv_x", "scales", "recv_count", "combined"), replayed,
                               (*eager[0], eager[1], eager[2])):
        if name in ("recv_x", "scales"):  # rows past recv_count are unspecified
            got, want = (torch.cat([t[e, :int(c)] for e, c in enumerate(eager[1].tolist())])
                         for t in (got, want))
        assert_equal(f"graph replay {name}", got.cpu(), want.cpu())
    buffer.low_latency_check_errors()
    return True


@_NO_CUDA
def test_low_latency_graph():
    assert run_seeded(_graph_main, 1, SEED, SEED) == [True]
