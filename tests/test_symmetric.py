"""The symmetric backend against the collective backend, bitwise, on local gloo ranks.

Each rank builds both backends over the same group and feeds them the same data; every output
and handle field must be bitwise equal (`epcomm.testing.verify.assert_same_dispatch`; rows the
contract leaves unspecified are skipped: the sync-free compact tail and the expand alignment
gaps without `do_zero_padding`). On the CPU the kernels run under the Triton interpreter
(`epcomm.kernels` selects it when CUDA is missing).
"""
import itertools

import pytest
import torch
import torch.distributed as dist

from epcomm import errors
from epcomm.testing.launch import run_local_ranks
from epcomm.testing.verify import assert_equal, assert_same_dispatch

pytest.importorskip("triton")

H, K, M = 32, 3, 8


def _data(rank, num_tokens, num_experts, fp8, skew, seed, idx_dtype=torch.int64, hidden=H):
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(num_tokens, hidden, generator=gen)
    if fp8:
        x = (x.to(torch.float8_e4m3fn),
             torch.rand(num_tokens, (hidden + 127) // 128, generator=gen))
    else:
        x = x.to(torch.bfloat16)
    idx = torch.randint(-1, num_experts, (num_tokens, K), generator=gen)
    if skew:  # most slots on rank 0's experts, some repeated ids
        idx = torch.where(torch.rand(num_tokens, K, generator=gen) < 0.8, idx % 2, idx)
    weights = torch.rand(num_tokens, K, generator=gen)
    return x, idx.to(idx_dtype), weights


def _rows(x):
    return list(x) if isinstance(x, tuple) else [x]


def _roundtrip(buffers, x, idx, weights, num_experts, opts, biases, what):
    """Dispatch + combine through every buffer; compare each with the first (collective)."""
    results = []
    for buffer in buffers:
        out = buffer.dispatch(x, idx, weights, num_experts=num_experts, **opts)
        recv_x, _, recv_w, handle, _ = out
        y = _rows(recv_x)[0].to(torch.bfloat16) * 3  # expert output, valid rows equal
        combined = buffer.combine(y, handle, topk_weights=recv_w, bias=biases)
        results.append((out, combined))
    (want, want_c), (got, got_c) = results
    assert_same_dispatch(what, got, want, opts.get("do_zero_padding", False))
    assert_equal(f"{what} combined_x", got_c[0], want_c[0], check_dtype=True)
    assert_equal(f"{what} combined_topk_weights", got_c[1], want_c[1], check_dtype=True)
    return got, want


def _buffer_pair(hidden=H):
    """A collective and a symmetric buffer over the world group: the reference, the tested."""
    from epcomm.buffer import Buffer
    return [Buffer(dist.group.WORLD, M, hidden, K, backend=name, timeout_s=30)
            for name in ("collective", "symmetric")]


def _matrix(num_ranks, half):
    """Half of every layout x sync mode x alignment x dtype x weights (32 cases): `half` 0 the
    16 whose weights alternate with the other four, 1 the other 16 (each: every layout x sync
    mode x alignment x dtype once)."""
    from epcomm.buffer import Buffer
    rank = dist.get_rank()
    num_experts = 4 * num_ranks
    buffers = _buffer_pair()
    # One program per launch under the interpreter (it runs programs one after another).
    assert buffers[1].backend == "symmetric" and buffers[1].num_sms == 1
    assert buffers[1]._backend.heap_bytes == Buffer.get_buffer_size_hint(num_ranks, M, H, K)
    uneven = [M, 0, 5][rank % 3]  # uneven T, one rank with none
    seed = count = 0
    for expand, sync, align, fp8, with_w in itertools.product(
            (False, True), (True, False), (1, 4), (False, True), (True, False)):
        seed += 1
        if (with_w == ((expand + sync + (align == 4) + fp8) % 2 == 0)) != (half == 0):
            continue
        count += 1
        skew = seed % 3 == 0
        x, idx, weights = _data(rank, uneven, num_experts, fp8, skew, seed)
        biases = [None, torch.randn(uneven, H).bfloat16(),
                  (torch.randn(uneven, H).bfloat16(), torch.randn(uneven, H).bfloat16())][seed % 3]
        opts = dict(do_expand=expand, do_cpu_sync=sync, expert_alignment=align,
                    do_zero_padding=seed % 2 == 0)
        _roundtrip(buffers, x, idx, weights if with_w else None, num_experts, opts, biases,
                   f"rank {rank} case {seed} {opts} fp8={fp8} w={with_w} skew={skew}")
    return count


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_matches_collective(num_ranks):
    """The matrix, one half on 2 ranks and the other on 3 (the interpreter is slow, and 3 ranks
    on a 2-core machine slower still): every layout, sync mode, alignment and dtype on both,
    every case once."""
    counts = run_local_ranks(_matrix, num_ranks, num_ranks, num_ranks - 2)
    assert counts == [16] * num_ranks


def _odd_hidden(num_ranks):
    """Row widths that are not powers of two (hidden 40: 20 bf16 words, 10 FP8 words, one
    scale): copy steps are rounded up to powers of two and masked."""
    rank, hidden, num_experts = dist.get_rank(), 40, 4 * num_ranks
    buffers = _buffer_pair(hidden)
    for seed, (expand, fp8) in enumerate(itertools.product((False, True), (False, True))):
        x, idx, weights = _data(rank, M - rank, num_experts, fp8, False, 70 + seed,
                                hidden=hidden)
        opts = dict(do_expand=expand, do_cpu_sync=seed % 2 == 0, expert_alignment=2)
        _roundtrip(buffers, x, idx, weights, num_experts, opts, None,
                   f"rank {rank} hidden {hidden} {opts} fp8={fp8}")
    return True


def test_hidden_not_a_power_of_two():
    assert run_local_ranks(_odd_hidden, 2, 2) == [True, True]


def _memory_forms(num_ranks):
    from epcomm import Buffer
    from epcomm.testing.verify import memory_form_cases, run_cases
    buffer = Buffer(dist.group.WORLD, M, H, K, backend="symmetric", device="cpu")
    return run_cases(buffer, memory_form_cases(2 * num_ranks, 11, quick=True), 11)


def test_inputs_not_contiguous_or_not_aligned():
    """Strided inputs and inputs one element off a 16-byte boundary (which `Buffer` copies for
    this backend: bf16 rows at an odd element cannot be read as 4-byte words), bitwise against
    the reference, under the interpreter."""
    assert run_local_ranks(_memory_forms, 2, 2) == [6, 6]


def _mismatched_max_tokens(num_ranks):
    """Rank 0 says num_max_tokens_per_rank=M, rank 1 says 2 (a contract violation): the calls'
    stamps differ, so each rank ignores the other's rows (none is written past rank 1's R * 2
    output rows) and, as a CPU call reads the host, raises `EPMismatchError`. Every rank
    completed the call: the buffer stays usable."""
    rank = dist.get_rank()
    buffers = _buffer_pair()
    symm = buffers[1]
    max_tokens = M if rank == 0 else 2
    x, _, weights = _data(rank, max_tokens, 4 * num_ranks, False, False, 80)
    idx = torch.full((max_tokens, K), 4, dtype=torch.int64)  # every token to rank 1
    with pytest.raises(errors.EPMismatchError, match="num_max_tokens_per_rank"):
        symm.dispatch(x, idx, weights, num_experts=4 * num_ranks,
                      num_max_tokens_per_rank=max_tokens, do_cpu_sync=False)
    symm.check_errors()  # (raised and cleared)
    x, idx, weights = _data(rank, M - 1, 4 * num_ranks, False, False, 81)
    _roundtrip(buffers, x, idx, weights, 4 * num_ranks, dict(do_cpu_sync=False), None,
               f"rank {rank} after the mismatch")
    return True


def test_mismatched_max_tokens_is_flagged_not_mixed():
    assert run_local_ranks(_mismatched_max_tokens, 2, 2) == [True, True]


def _interleaved(num_ranks):
    rank = dist.get_rank()
    num_experts = 2 * num_ranks
    buffers = _buffer_pair()
    from epcomm.backends.symmetric import symmetric_supported
    assert symmetric_supported(buffers[1].group, buffers[1].config)  # collective: all ask
    # Dispatches whose outputs must survive later calls through the same buffer.
    kept = []
    for step in range(6):
        x, idx, weights = _data(rank, [3, M, 1][(rank + step) % 3], num_experts, step % 2 == 1,
                                step % 3 == 0, 50 + step, torch.int32 if step == 2 else torch.int64)
        opts = dict(do_expand=step % 2 == 0, do_cpu_sync=step % 3 != 1, expert_alignment=2)
        got, want = _roundtrip(buffers, x, idx, weights, num_experts, opts, None, f"step {step}")
        kept.append((got, [t.clone() for t in _rows(got[0])], want))
        # Cached dispatch: new data, same routing, no count exchange.
        x2 = _data(rank, idx.shape[0], num_experts, step % 2 == 1, False, 90 + step)[0]
        outs = [b.dispatch(x2, handle=out[3]) for b, out in zip(buffers, (want, got))]
        assert_same_dispatch(f"cached step {step}", outs[1], outs[0])
        assert outs[1][3] is got[3]
    for step, (got, copies, want) in enumerate(kept):
        for index, (now, then) in enumerate(zip(_rows(got[0]), copies)):
            assert_equal(f"step {step}: recv_x[{index}] after later calls (must not change)",
                         now, then, check_dtype=True)
    # A combine of an older handle after newer dispatches.
    (got, _, want) = kept[1]
    results = [b.combine(_rows(out[0])[0].bfloat16(), out[3])[0] for b, out in
               zip(buffers, (want, got))]
    assert_equal("late combine", results[1], results[0], check_dtype=True)
    return True


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_interleaved_calls_and_cached_dispatch(num_ranks):
    assert all(run_local_ranks(_interleaved, num_ranks, num_ranks))


def _timeout(modes):
    """Per `do_cpu_sync` mode in `modes`, a buffer of its own (made on both ranks) through which
    rank 0 dispatches and rank 1 never does: rank 0's timeout message for each mode."""
    from epcomm.buffer import Buffer
    rank = dist.get_rank()
    # (0.05 s: about 1000 spins of the interpreter's wait loop, ~0.5 s here)
    buffers = [Buffer(dist.group.WORLD, M, H, K, backend="symmetric", timeout_s=0.05)
               for _ in modes]
    messages = []
    for sync, buffer in zip(modes, buffers):
        raised = None
        if rank == 0:  # rank 1 never dispatches
            x, idx, _ = _data(rank, 4, 4, False, False, 7)
            try:
                buffer.dispatch(x, idx, num_experts=4, do_cpu_sync=sync)
                buffer.check_errors()
            except errors.EPTimeoutError as exc:
                raised = str(exc)
        messages.append(raised)
    dist.barrier()
    return messages


def test_timeout_raises_instead_of_hanging():
    """A synchronizing and a sync-free dispatch (one process group for both)."""
    modes = [True, False]
    for sync, message in zip(modes, run_local_ranks(_timeout, 2, modes)[0]):
        assert message is not None and "rank 0" in message, (sync, message)
        if sync:
            assert "dispatch" in message, message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (sync-debug mode and "
                    "CUDA-graph capture); scripts/gpu_symmetric.py runs them on the GPU machine")
def test_cuda_sync_free_and_graph():
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    subprocess.run([sys.executable, str(root / "scripts" / "gpu_symmetric.py"), "--ranks", "2",
                    "--tokens", "128", "--hidden", "512", "--no-bench"], check=True, env=env)


def _record_launches():
    """A one-rank CPU symmetric buffer whose launches are recorded instead of run, and whose
    allocations come from a pool that hands a later run the same tensors: (buffer, pool,
    launches, state). `state["kept"]`: whether kernels count as kept (then calls are
    prepared); `state["next"] = 0` restarts the pool; `state["checked"]`: dispatches whose
    arguments were checked (a prepared call skips the checks). A launch is recorded as (kernel,
    variant, "typed" or "filled" (from a prepared call's template), arguments with tensors as
    addresses)."""
    import epcomm.buffer as buffer_module
    from epcomm.backends.base import OutputAllocator
    from epcomm.buffer import Buffer
    from epcomm.kernels.launcher import Launcher

    pool, launches = [], []
    state = {"next": 0, "kept": False, "checked": 0}

    def empty(alloc, shape, dtype):
        index, state["next"] = state["next"], state["next"] + 1
        if index == len(pool):
            # (2s: a synchronizing dispatch reads 2 rows and 2 pairs per expert from its block)
            pool.append(torch.full(shape, 2, dtype=dtype))
        tensor = pool[index]
        assert tensor.shape == torch.Size(shape) and tensor.dtype == dtype, (index, shape, dtype)
        if alloc.allocated is not None:
            alloc.allocated.append(tensor)
        return tensor

    def record(launcher, variant, stream, fields):
        launches.append((launcher.fn.__name__, variant, "typed",
                         [a.data_ptr() if isinstance(a, torch.Tensor) else a
                          for a in launcher.bind(fields)]))

    def record_filled(launcher, variant, stream, args):
        launches.append((launcher.fn.__name__, variant, "filled",
                         list(args[:len(args) - len(launcher.tail)])))

    check_dispatch = buffer_module.check_dispatch

    def counted_check(*args, **kwargs):
        state["checked"] += 1
        return check_dispatch(*args, **kwargs)

    OutputAllocator.empty = empty
    OutputAllocator.empty_all = lambda alloc, shapes, makers: [empty(alloc, *s) for s in shapes]
    Launcher.__call__ = record
    Launcher.launch_filled = record_filled
    Launcher.kept = lambda launcher, variant: state["kept"] and variant is not None
    buffer_module.check_dispatch = counted_check
    buffer = Buffer(dist.group.WORLD, M, H, K, backend="symmetric", device="cpu")
    return buffer, pool, launches, state


def _launch_addresses(case_list):
    """Every kernel launch of two dispatches, a cached dispatch and a combine per case, with
    kernels not kept (typed launches) and kept (prepared calls where the call allows one), over
    the same tensors (the pool hands both runs the same ones, launches are recorded instead of
    run): per run (case, kept, launches, dispatches checked)."""
    buffer, pool, launches, state = _record_launches()
    results = []
    for case, (fp8, expand, sync, with_weights, biases, copy) in enumerate(case_list):
        x, idx, weights = _data(0, M - 1, 8, fp8, False, case)
        weights = weights if with_weights else None
        bias = tuple(torch.randn(M - 1, H).bfloat16() for _ in range(biases))
        inputs = {}
        pool.clear()
        for kept in (False, True):
            state["kept"], state["next"], state["checked"] = kept, 0, 0
            launches.clear()
            for _ in range(2):  # a sync-free call shape's second call takes the prepared call
                _, _, _, handle, _ = buffer.dispatch(x, idx, weights, num_experts=8,
                                                     do_cpu_sync=sync, do_expand=expand,
                                                     do_handle_copy=copy)
            buffer.dispatch(x, handle=handle)
            rows = handle.num_output_rows
            if not inputs:  # the combine's caller tensors, the same for both runs
                inputs = dict(x=torch.randn(rows, H).bfloat16(),
                              weights=torch.rand((rows,) if expand else (rows, K))
                              if with_weights else None)
            buffer.combine(inputs["x"], handle, topk_weights=inputs["weights"], bias=bias)
            results.append((case, kept, list(launches), state["checked"]))
    return results


def test_prepared_calls_pass_the_typed_addresses():
    """What a prepared call's filled template launches (a kept compiled kernel on the GPU): the
    same arguments as the typed launch of the same call, pointer for pointer (a tensor and its
    address, a handle part and its offset into the block), for both layouts, bf16 and FP8,
    with and without weights and the handle's topk_idx copy, synchronizing (one launch, then
    a host read) and sync-free (the first call of a call shape
    prepares it, the second takes the prepared call without checks), cached dispatch (typed)
    and combine with biases (prepared when kept)."""
    cases = [(False, False, False, True, 0, True), (False, True, False, True, 2, True),
             (True, False, True, False, 1, True), (True, True, True, True, 0, True),
             (False, False, True, True, 2, True), (True, False, False, False, 1, False),
             (True, True, False, True, 0, False)]
    results = run_local_ranks(_launch_addresses, 1, cases)[0]
    for (case, kept, prepared, checked), (_, _, typed, typed_checked) in \
            zip(results[1::2], results[0::2]):
        assert kept and typed_checked == 3 and checked == 2, (case, checked)
        # one launch per dispatch, synchronizing or not; every dispatch prepared (the first
        # call of the shape prepares it) but the cached one, which is typed; the combine
        # prepared
        want = ["filled"] * 2 + ["typed", "filled"]
        assert [launch[2] for launch in prepared] == want, (case, prepared)
        assert len(typed) == len(want), (case, len(typed))
        assert all(launch[2] == "typed" for launch in typed)
        for got, want in zip(prepared, typed):
            assert got[:2] == want[:2], (case, got[:2], want[:2])
            assert got[3] == want[3], (case, got[0], [
                (i, a, b) for i, (a, b) in enumerate(zip(got[3], want[3])) if a != b])


def _scratch_address_per_call():
    """Sync-free dispatches (kernels kept, launches recorded) with 8, 8, 64, 8, 8 experts: the
    third grows the receive scratch. Per call: the number of experts, the scratch address its
    launch got, and whether its arguments were checked (not a prepared call)."""
    from epcomm.kernels.dispatch import dispatch_kernel
    buffer, pool, launches, state = _record_launches()
    state["kept"] = True
    results = []
    for experts in (8, 8, 64, 8, 8):
        x, idx, weights = _data(0, M - 1, experts, False, False, 0)
        pool.clear()
        launches.clear()
        state["next"], state["checked"] = 0, 0
        buffer.dispatch(x, idx, weights, num_experts=experts, do_cpu_sync=False)
        (kernel, _, kind, args), = launches
        assert kernel == dispatch_kernel.__name__ and kind == "filled"
        results.append((experts, args[dispatch_kernel.arg_names.index("hist_ptr")],
                        bool(state["checked"])))
    return results


def test_prepared_dispatch_follows_a_replaced_scratch():
    """A prepared call reads the receive scratch's current address per call: when a call with
    more local experts replaces the scratch (the old one is freed), the prepared call of the
    first shape launches with the new address."""
    results = run_local_ranks(_scratch_address_per_call, 1)[0]
    experts, scratch, checked = zip(*results)
    assert experts == (8, 8, 64, 8, 8) and checked == (True, False, True, False, False)
    assert scratch[0] == scratch[1] != scratch[2] == scratch[3] == scratch[4], scratch


def _routes_per_memory_form():
    """Sync-free dispatches of one call shape (kernels kept, launches recorded) whose x or
    topk_idx is in another memory form each call: per call, the tensor and its form, each
    launch's kind, whether the launch got the caller's own x and topk_idx addresses (not
    copies), and whether the call's arguments were checked (not the buffer's prepared call)."""
    from epcomm.testing.verify import in_memory_form
    buffer, pool, launches, state = _record_launches()
    state["kept"] = True
    x, idx, weights = _data(0, M - 1, 8, False, False, 0)
    results = []
    for which, form in (("x", "plain"), ("x", "strided"), ("x", "offset"),
                        ("idx", "strided"), ("idx", "offset"), ("x", "plain")):
        call_x = in_memory_form(x, form) if which == "x" else x
        call_idx = in_memory_form(idx, form) if which == "idx" else idx
        pool.clear()
        launches.clear()
        state["next"], state["checked"] = 0, 0
        buffer.dispatch(call_x, call_idx, weights, num_experts=8, do_cpu_sync=False)
        results.append((which, form, [launch[2] for launch in launches],
                        call_x.data_ptr() in launches[0][3],
                        call_idx.data_ptr() in launches[0][3], bool(state["checked"])))
    return results


def test_prepared_dispatch_leaves_for_other_memory_forms():
    """A call of a prepared call shape whose tensors are not contiguous or not 16-byte aligned
    leaves the buffer's prepared call: such tensors are copied (every kernel variant is
    compiled at warm-up for aligned pointers, and rows move as 4-byte words), then the
    backend's prepared call of the shape runs on the copies; the next plain call takes the
    prepared call again, unchecked."""
    results = run_local_ranks(_routes_per_memory_form, 1)[0]
    assert results == [("x", "plain", ["filled"], True, True, True),
                       ("x", "strided", ["filled"], False, True, True),
                       ("x", "offset", ["filled"], False, True, True),
                       ("idx", "strided", ["filled"], True, False, True),
                       ("idx", "offset", ["filled"], True, False, True),
                       ("x", "plain", ["filled"], True, True, False)], results


def test_remember_example():
    from epcomm.backends.base import remember
    cache = {"a": 1, "b": 2}
    assert remember(cache, "c", 3, limit=2) == 1 and cache == {"b": 2, "c": 3}
    assert remember(cache, "b", 4, limit=2) is None and cache == {"b": 4, "c": 3}


def _prepared_beyond_the_limit():
    """Sync-free dispatches (kernels kept, launches recorded) of 7, 6, 5, 7, 7 tokens with the
    per-call-shape caches limited to 2 entries. Per call: the tokens, whether its arguments
    were checked (not a prepared call), and its launches' kinds."""
    from epcomm.backends import base
    base.CACHE_LIMIT = 2
    buffer, pool, launches, state = _record_launches()
    state["kept"] = True
    results = []
    for tokens in (7, 6, 5, 7, 7):
        x, idx, weights = _data(0, tokens, 8, False, False, 0)
        pool.clear()
        launches.clear()
        state["next"], state["checked"] = 0, 0
        buffer.dispatch(x, idx, weights, num_experts=8, do_cpu_sync=False)
        results.append((tokens, bool(state["checked"]), [launch[2] for launch in launches]))
    return results


def test_prepared_calls_beyond_the_cache_limit():
    """A loop whose token count changes every call keeps at most `CACHE_LIMIT` prepared calls:
    the oldest is dropped, and a call of its shape later prepares it again (checked once
    more), then takes it."""
    results = run_local_ranks(_prepared_beyond_the_limit, 1)[0]
    assert results == [(7, True, ["filled"]), (6, True, ["filled"]), (5, True, ["filled"]),
                       (7, True, ["filled"]), (7, False, ["filled"])], results


def test_gpu_tile_by_tokens_per_program():
    """A buffer of at most 4 tokens per program gets the decode tile (a send part's tokens in
    one tile, few wide steps); larger ones the large tile."""
    from epcomm.backends.symmetric import backend
    assert backend.gpu_tile(128, 32)["rows"] == 4 and backend.gpu_tile(128, 32)["block_w"] == 2048
    assert backend.gpu_tile(528, 132) is backend._GPU_DECODE_TILE
    assert backend.gpu_tile(529, 132) is backend._GPU_TILE
    assert backend.gpu_tile(4096, 132)["rows"] == 16
