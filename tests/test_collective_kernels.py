"""The collective backend's kernel path (`backends.collective_kernels`, Triton; the
interpreter on CPU) on local gloo ranks: dispatch, cached dispatch and combine, compact and
expand, synchronizing and sync-free, bitwise against the reference; prepared sync-free
dispatches; an invalid expert id raised from a synchronizing dispatch's one host read."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("triton")

from epcomm.kernels import INTERPRET  # noqa: E402  (before any kernel: picks the interpreter)
from epcomm.kernels.collective import _block_starts  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from epcomm import Buffer  # noqa: E402
from epcomm.backends.collective import CollectiveBackend  # noqa: E402
from epcomm.testing.launch import run_local_ranks  # noqa: E402
from epcomm.testing.verify import Case, check_round_trip  # noqa: E402

SEED = int(os.environ.get("EPCOMM_TEST_SEED", time.time_ns() % 1_000_000))


def run_kernel_path(seed: int, host_transport: bool) -> int:
    """Every layout and sync mode (`host_transport` False: as over NCCL, where a synchronizing
    dispatch of this size moves padded blocks and reads its counts once)."""
    buffer = Buffer(dist.group.WORLD, 8, 64, 4, backend="collective")
    buffer._backend = CollectiveBackend(dist.group.WORLD, buffer.config, kernels=True)
    buffer._backend._host_transport = host_transport
    checked = 0
    for expand in (False, True):
        for sync in (True, False):
            case = Case(num_experts=4 * buffer.num_ranks, do_expand=expand, do_cpu_sync=sync,
                        expert_alignment=4 if expand else 1, num_bias=1, routing="skewed",
                        check_cached=True, seed=seed + checked)
            check_round_trip(buffer, case)
            checked += 1
    return checked


@pytest.mark.parametrize("num_ranks,host_transport", [(1, True), (3, True), (2, False)])
def test_kernel_path(num_ranks: int, host_transport: bool) -> None:
    assert run_local_ranks(run_kernel_path, num_ranks, SEED, host_transport) == [4] * num_ranks


def run_prepared_calls(seed: int, padded: bool) -> tuple[int, int, int]:
    """Dispatches of one call shape after the first, sync-free and synchronizing, and the
    combines of those over padded blocks are prepared calls (`collective_kernels.DispatchPlan`,
    `SyncDispatchPlan` and `CombinePlan`: templates filled with the call's addresses and
    sizes). A synchronizing dispatch takes padded blocks where `padded_sync` says so (here
    `padded`: every one, else none). Run here under the interpreter: each filled launch has its
    int addresses mapped back to the tensors they belong to (the interpreter takes tensors for
    pointer parameters), the parts of a handle block to views of it."""
    from epcomm import buffer as buffer_module
    from epcomm.backends import collective_kernels
    from epcomm.backends.base import OutputAllocator
    from epcomm.kernels.launcher import Launcher

    buffer = Buffer(dist.group.WORLD, 8, 64, 4, backend="collective")
    backend = CollectiveBackend(dist.group.WORLD, buffer.config, kernels=True)
    backend._host_transport = False  # as over NCCL: no header exchange on the host
    buffer._backend = backend
    live: dict[int, object] = {}
    runs, syncs, combines = [], [], []

    def remember(*tensors):
        live.update((t.data_ptr(), t) for t in tensors if isinstance(t, torch.Tensor))

    def call_key(rows, topk_idx, topk_weights, *arguments):
        remember(*rows, topk_idx, topk_weights)
        return real_call_key(rows, topk_idx, topk_weights, *arguments)

    def empty_all(self, shapes, makers):
        tensors = real_empty_all(self, shapes, makers)
        remember(*tensors)
        return tensors

    def empty(self, shape, dtype):
        tensor = real_empty(self, shape, dtype)
        remember(tensor)
        return tensor

    def exchange_headers(self, *args):
        received, table = real_exchange(self, *args)
        remember(received)
        return received, table

    def launch_filled(self, variant, stream, args):
        path = backend._kernels
        remember(backend._flags, backend._seq, path.no_weights, *backend._headers.values(),
                 *[host.words for host in backend._host_counts.values()],
                 *([path.experts] if path.experts.numel() else []))  # (empty: address 0)
        ints = self.fn.kwargs["do_not_specialize"]
        values = [live[value] if name not in ints else value
                  for name, value in zip(self.params, args)]
        self.fn[self.grid](*values, **self.constants)

    def run(self, *args):
        runs.append(self.call.expand)
        return real_run(self, *args)

    def issue(self, values, tensors, stream):
        Block(tensors[self.names.index("block")], self.layout)  # (its parts, before launches)
        return real_issue(self, values, tensors, stream)

    def run_sync(self, *args):
        syncs.append(self.call.expand)
        return real_run_sync(self, *args)

    class Block(collective_kernels.TensorBlock):
        def __init__(self, block, layout, extra=None):
            super().__init__(block, layout, extra)
            if isinstance(block, torch.Tensor):
                # (by address: an empty view reports 0; a part of no words shares its address
                # with the next part, whose view is kept)
                live.update((self.address_of(name), self[name]) for name in layout.parts)

    def combine_callers(*args):
        tensors = real_callers(*args)
        remember(*tensors.values())
        return tensors

    def run_combine(self, addresses, alloc, x, weights):
        combines.append(len(self.shapes))
        remember(x, weights)  # (an empty one's address may be another empty tensor's)
        return real_run_combine(self, addresses, alloc, x, weights)

    real_call_key, real_empty_all = buffer_module.call_key, OutputAllocator.empty_all
    real_empty, real_exchange = OutputAllocator.empty, CollectiveBackend._exchange_headers
    real_run = collective_kernels.DispatchPlan.run
    real_issue = collective_kernels.DispatchPlan.issue
    real_run_sync = collective_kernels.SyncDispatchPlan.run
    real_callers = collective_kernels._combine_callers
    real_run_combine = collective_kernels.CombinePlan.run
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(buffer_module, "call_key", call_key)
        patch.setattr(OutputAllocator, "empty_all", empty_all)
        patch.setattr(OutputAllocator, "empty", empty)
        patch.setattr(CollectiveBackend, "_exchange_headers", exchange_headers)
        patch.setattr(collective_kernels.SyncDispatchPlan, "run", run_sync)
        patch.setattr(Launcher, "kept", lambda self, variant: True)
        patch.setattr(Launcher, "launch_filled", launch_filled)
        patch.setattr(collective_kernels, "INTERPRET", False)
        patch.setattr(collective_kernels.DispatchPlan, "run", run)
        patch.setattr(collective_kernels.DispatchPlan, "issue", issue)
        patch.setattr(collective_kernels, "_combine_callers", combine_callers)
        patch.setattr(collective_kernels, "TensorBlock", Block)
        patch.setattr(collective_kernels.CombinePlan, "run", run_combine)
        if not padded:
            patch.setattr(collective_kernels, "PADDED_SYNC_BYTES", -1)
        for sync in (False, True) if padded else (True,):  # (sync-free: the same either way)
            for expand in (False, True):
                for repeat in range(2):
                    case = Case(num_experts=4 * buffer.num_ranks, do_expand=expand,
                                do_cpu_sync=sync, expert_alignment=4 if expand else 1,
                                num_bias=2 * repeat, routing="skewed",
                                seed=seed + 20 * sync + 10 * expand + repeat)
                    check_round_trip(buffer, case)
    path = backend._kernels
    assert path.plans and bool(path.combine_plans) == padded
    buffer.destroy()  # drops the prepared calls (and on a GPU the graphs they keep)
    assert backend._kernels is None and not path.plans and not path.combine_plans
    return len(runs), len(syncs), len(combines)


@pytest.mark.parametrize("padded", [True, False])
def test_prepared_calls_bitwise(padded: bool) -> None:
    # every dispatch runs a plan, and every combine after a dispatch over padded blocks (`kept`
    # is patched: nothing to compile first), the first dispatch of each shape made by the
    # backend, the later ones taken straight from the buffer; two ranks: exact blocks of
    # different sizes (the synchronizing calls alone), or the synchronizing calls' exact views
    # of padded ones
    counts = (8, 0, 8) if padded else (0, 4, 0)
    assert run_local_ranks(run_prepared_calls, 2, SEED, padded) == [counts] * 2


def run_invalid_id_synchronizing(seed: int, host_transport: bool) -> str:
    """A synchronizing dispatch with an expert id of E on rank 0, as on a GPU (no host check of
    the ids): rank 0's error flag reaches its one host read (carried by the count exchange, or
    over padded blocks, as over NCCL here with `host_transport` False, left with the counts),
    every rank completes the call, rank 0 raises `EPInputError` from that read, and the next
    calls are correct."""
    from epcomm import checks
    from epcomm.errors import EPInputError

    buffer = Buffer(dist.group.WORLD, 8, 64, 4, backend="collective")
    buffer._backend = CollectiveBackend(dist.group.WORLD, buffer.config, kernels=True)
    buffer._backend._host_transport = host_transport
    E = 4 * buffer.num_ranks
    gen = torch.Generator().manual_seed(seed + buffer.rank)
    idx = torch.rand(6, E, generator=gen).topk(4, dim=1).indices
    if buffer.rank == 0:
        idx[0, 0] = E
    x = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    outcome = "returned"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checks, "check_expert_ids", lambda topk_idx, num_experts: None)
        try:
            buffer.dispatch(x, idx, num_experts=E, do_cpu_sync=True)
        except EPInputError as exc:
            assert "outside" in str(exc), exc
            outcome = "raised"
    for sync in (True, False):
        check_round_trip(buffer, Case(num_experts=E, do_cpu_sync=sync, seed=seed + sync))
    return outcome


@pytest.mark.parametrize("host_transport", [True, False])
def test_invalid_id_raises_from_the_one_host_read(host_transport: bool) -> None:
    assert run_local_ranks(run_invalid_id_synchronizing, 2, SEED, host_transport) == \
        ["raised", "returned"]


def test_header_kernel_example() -> None:
    """`kernels.collective.header_kernel`'s docstring example, under the interpreter."""
    from epcomm.kernels import collective as kernels
    from epcomm.kernels.launcher import Launcher

    fields = torch.arange(10, 10 + kernels.NUM_FIELDS.value - 1, dtype=torch.int64)
    seq, flags = torch.tensor(4, dtype=torch.int64), torch.tensor(0, dtype=torch.int32)
    experts = torch.tensor([2, 1], dtype=torch.int64)
    words = kernels.NUM_FIELDS.value + 1 + 1 + 1 + 2
    rows = torch.full((1, words), -7, dtype=torch.int64)
    launcher = Launcher(kernels.header_kernel, 1, dict(BLOCK_P=2, BLOCK_R=1, BLOCK_E=2,
                                                       BLOCK_F=16, num_warps=1))
    launcher(None, None, dict(
        counts_ptr=torch.tensor([[2], [1]], dtype=torch.int32), num_programs=2, num_ranks=1,
        flags_ptr=flags, experts_ptr=experts, num_local=2, fields_ptr=fields, seq_ptr=seq,
        rows_ptr=rows, row_words=words, extra=1))
    assert rows.tolist() == [[5, *fields.tolist(), 3, 0, 3, 2, 1]]
    assert experts.tolist() == [0, 0] and seq.item() == 5


@triton.jit
def _starts_kernel(counts_ptr, out_ptr, own):
    """`_block_starts` of the docstring example's counts into out_ptr."""
    rr = tl.arange(0, 4)
    counts = tl.load(counts_ptr + rr, mask=rr < 3, other=0)
    tl.store(out_ptr + rr, _block_starts(counts, rr, 3, 7, 1, 1, own), mask=rr < 3)


def test_block_starts_example() -> None:
    """`kernels.collective._block_starts`' docstring example (R = 3, rank 1, exact blocks of
    counts [2, 5, 1]), under the interpreter: the receiving side holds the own block first."""
    if not INTERPRET:
        pytest.skip("runs its kernel on CPU tensors under the Triton interpreter")
    counts = torch.tensor([2, 5, 1], dtype=torch.int32)
    starts = [torch.full((3,), -1, dtype=torch.int64) for _ in range(2)]
    for own, out in zip((1, 0), starts):
        _starts_kernel[(1,)](counts, out, own)
    assert starts[0].tolist() == [6, 0, 9] and starts[1].tolist() == [0, 0, 3]


def test_padded_sync_example() -> None:
    """`collective_kernels.padded_sync`'s docstring example."""
    from epcomm.backends.collective_kernels import padded_sync
    assert padded_sync(1, 4096, 8, 14_400) and padded_sync(8, 128, 8, 14_400)
    assert not padded_sync(8, 4096, 8, 14_400)
