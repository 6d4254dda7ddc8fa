"""The fast intranode backend: fused Triton kernels store straight into peers' memory.

Every rank owns one symmetric heap (`epcomm.symm_heap`), mapped by all ranks:

    [dispatch counters: ready[R] | free[R] | count[R]] [combine counters: the same] (int64)
    [dispatch staging: R blocks x S records (`kernels.dispatch.RecordLayout`)]
    [combine staging:  R blocks x S records (`kernels.combine.CombineLayout`)]

S = the buffer's `num_max_tokens_per_rank`. Block s of a staging region is written only by rank
s, so no two ranks ever write the same bytes. Counters only grow (each of the P programs of a
kernel adds 1 per call), so nothing is ever reset and CUDA graphs can replay calls.

One call is one launch (the kernels' docstrings have the steps), two for a synchronizing dispatch:
- dispatch: `dispatch_kernel`, its send part (route, wait for the peers to free the previous
  call's records, push, raise ready) then its receive part (wait for ready, copy out into the
  layout, free); a synchronizing dispatch stops the first launch after counting, sizes its
  outputs on the host and runs the receive part in a second launch.
- combine: one launch, `combine_kernel` (return rows, reduced per token in the expand layout,
  then reduce what came back).
The host side of a sync-free dispatch is cached per call shape (`_SyncFreePlan`): a call
allocates its outputs and fills the plan's argument template with their addresses.
A wait that runs past the buffer's timeout sets the stage's timeout bit of `errors` in the device
error flag and gives up; a synchronizing call raises `EPTimeoutError` naming the rank and stage,
a sync-free one leaves it for `Buffer.check_errors()`. After a timeout the ranks' counters
disagree: the buffer cannot be used again.

Results are bitwise those of the collective backend (docs/semantics.md).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial, reduce
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .. import errors
from ..handle import EPHandle
from ..kernels import INTERPRET
from ..kernels import combine as combine_kernels
from ..kernels import dispatch as dispatch_kernels
from ..kernels.dispatch import RecordLayout, payload_words
from ..kernels.launcher import (Address, ArgTemplate, KernelShape, Launcher, Stage,
                                next_power_of_2)
from ..kernels.sync import timeout_units
from ..layout import align_up, expand_capacity
from ..symm_heap import SymmetricHeap, all_gather_objects, heap_reachable
from .base import Backend, CombineRequest, DispatchRequest, DispatchResult, remember

FP8_BLOCK = 128
_NO_CAPACITY = 2**31 - 1  # a row bound nothing reaches (exact-size outputs, counting pass)
# Tiles of the GPU kernels: 16 rows x 512 words (32 KB of loads in flight per program; 7168
# bf16 is exactly 7 steps), 16 rows x 1024 bf16 in combine (16 warps for the fp32 sums).
# Measured (scripts/gpu_tune.py, H200, EP=1 4096 x 7168, session 4): compact combine 77.1 us at
# 16 x 1024 x 16 warps, 89.8 at 16 x 512, 92.4 at 8 x 1024; dispatch 101 us at 16 x 512 x 8,
# 112 at 8 x 512. 118 registers for combine at 16 x 1024 (scripts/compile_sm90.py), under the
# 128 that 16 warps allow.
_GPU_TILE = dict(rows=16, block_w=512, num_warps=8, combine_rows=16, block_h=1024,
                 combine_warps=16)
_CPU_TILE = dict(rows=4, block_w=64, num_warps=1, combine_rows=4, block_h=64, combine_warps=1)


def _local_reason(buffer) -> str:
    """This rank's objection to the symmetric backend, "" if none."""
    if buffer.hidden % 4:
        return f"hidden={buffer.hidden} is not a multiple of 4 (records move 4-byte words)"
    if buffer.device.type == "cpu" and not INTERPRET:
        return "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing triton)"
    if buffer.device.type == "cuda" and INTERPRET:
        return "TRITON_INTERPRET=1 is set, so Triton cannot run CUDA kernels"
    return ""


def _support(buffer) -> tuple[bool, str]:
    return heap_reachable(buffer.group, buffer.device, _local_reason(buffer))


def symmetric_supported(buffer) -> bool:
    """Whether every rank of `buffer.group` can map every other's memory and run the kernels;
    the same answer on all ranks (collective)."""
    return _support(buffer)[0]




def _payload_words(hidden: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """int32 words of a bf16 row, and of an FP8 row and its scales."""
    return (hidden // 2,), (hidden // 4, (hidden + FP8_BLOCK - 1) // FP8_BLOCK)


def heap_layout(num_ranks: int, stride_tokens: int, hidden: int,
                num_topk: int) -> tuple[int, int, int, int]:
    """Byte offsets of one rank's heap: (combine counters, dispatch staging, combine staging,
    total bytes). The dispatch counters are at 0; records fit bf16 and FP8 rows alike."""
    R, S = num_ranks, stride_tokens
    record_words = max(RecordLayout(num_topk, words).words for words in _payload_words(hidden))
    flags = 3 * R * 8
    dispatch_region = (2 * flags + 255) // 256 * 256
    combine_region = dispatch_region + R * S * record_words * 4
    total = combine_region + R * S * combine_kernels.CombineLayout(hidden, num_topk).words * 4
    return flags, dispatch_region, combine_region, total


def _block(width: int) -> int:
    """A copy step for rows of `width` elements: a power of two (tl.arange needs one), >= 16."""
    return max(16, next_power_of_2(width))


def _vector_words(words: list[int], widest: int) -> int:
    """The widest power of two <= `widest` that divides every width in `words`."""
    vec = widest
    while any(w % vec for w in words):
        vec //= 2
    return vec


def _words(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """int32 words of a tensor of `shape` and 4- or 8-byte `dtype`."""
    return math.prod(shape) * dtype.itemsize // 4


class BlockLayout:
    """Where named tensors lie in one int32 allocation: each starts on a 16-byte boundary.
    parts: name -> (word offset, shape, dtype) for (name, shape, dtype) in `parts` order."""

    def __init__(self, parts: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        self.parts: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        words = 0
        for name, shape, dtype in parts:
            self.parts[name] = (words, shape, dtype)
            words += (_words(shape, dtype) + 3) // 4 * 4
        self.words = words


class TensorBlock(Mapping):
    """The tensors of a `BlockLayout` in one allocation `block` (int32), each a view made on
    first access (a view costs about a microsecond of host time per call, and most are never
    read on the host), plus `extra` tensors allocated on their own. `arg` gives a kernel
    argument: the view, or for a kept kernel (untyped arguments) the bare address."""

    def __init__(self, block: torch.Tensor, layout: BlockLayout,
                 extra: Optional[dict[str, torch.Tensor]] = None) -> None:
        self.block, self.layout = block, layout
        self.address = block.data_ptr()
        self.extra = {} if extra is None else extra
        self._views: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        view = self.extra.get(name)
        if view is None:
            view = self._views.get(name)
        if view is None:
            offset, shape, dtype = self.layout.parts[name]
            view = self._views[name] = \
                self.block[offset:offset + _words(shape, dtype)].view(dtype).view(shape)
        return view

    def __iter__(self):
        return iter({**self.layout.parts, **self.extra})

    def __len__(self) -> int:
        return len({**self.layout.parts, **self.extra})

    def arg(self, name: str, typed: bool):
        if typed or name in self.extra:
            return self[name]
        return self.address + 4 * self.layout.parts[name][0]


class _SyncFreePlan:
    """A sync-free dispatch of one call shape whose launch is kept, made by the first such call:
    everything but its tensors. The caller's tensors and the outputs are address slots of the
    launch's `ArgTemplate`, in this order: the payload rows, topk_idx, weights (if any), then
    the handle's block, the received rows, the received weights (if any), the local ids
    (compact). `Buffer` keeps the plan for later calls with the same validated arguments
    (`DispatchResult.prepared`). `stale`: the backend replaced a scratch tensor whose address
    the arguments hold, or dropped the plan from its cache (it would not hear of the next
    replacement); the plan is never run again."""

    def __init__(self, launcher: Launcher, variant: tuple, block_layout: "BlockLayout",
                 outputs: "_OutputShapes", copy: bool, handle_fields: dict,
                 template: ArgTemplate, device: torch.device) -> None:
        self.launcher, self.variant, self.block_layout = launcher, variant, block_layout
        self.copy, self.handle_fields, self.template = copy, handle_fields, template
        # (shape, dtype) of each output in slot order, and where the optional ones are in it.
        self.allocations = [((block_layout.words,), torch.int32), *outputs.rows]
        self.rows_end = len(self.allocations)
        self.weights_at = self.idx_at = None
        if outputs.weights is not None:
            self.weights_at = len(self.allocations)
            self.allocations.append(outputs.weights)
        if outputs.idx is not None:
            self.idx_at = len(self.allocations)
            self.allocations.append(outputs.idx)
        # Each allocation as one bound call, with its size as separate ints: Python's argument
        # parsing of `torch.empty(shape_tuple, ...)` costs 0.4 us more per call (CPU harness).
        self._empties = [partial(torch.empty, *shape, dtype=dtype, device=device)
                         for shape, dtype in self.allocations]
        self.stale = False

    def takes(self, addresses: Optional[list[int]]) -> bool:
        """Whether a call whose contiguous caller tensors have `addresses` (in slot order; None:
        a tensor is not contiguous) can run this plan: each address 16-byte aligned, the kernel
        still kept (the compiled launcher never rejected a launch) and the plan not stale."""
        return (addresses is not None and not self.stale
                and not reduce(operator.or_, addresses) % 16 and self.launcher.kept(self.variant))

    def addresses(self, rows, topk_idx: torch.Tensor,
                  weights: Optional[torch.Tensor]) -> Optional[list[int]]:
        """The addresses of a request's tensors (contiguous: `Backend.input_alignment`) in slot
        order, or None when this call cannot take the plan (`takes`)."""
        callers = (*rows, topk_idx) if weights is None else (*rows, topk_idx, weights)
        addresses = [tensor.data_ptr() for tensor in callers]
        return addresses if self.takes(addresses) else None

    def run(self, addresses: list[int], topk_idx: torch.Tensor, empty, stream) -> DispatchResult:
        """Allocate the outputs with `empty(shape, dtype)` (None: `torch.empty` on the device,
        from the current stream's pool), launch on `stream` with the caller tensors' `addresses`
        (`takes`), and return the outputs and the handle."""
        outputs = [new() for new in self._empties] if empty is None else \
            [empty(shape, dtype) for shape, dtype in self.allocations]
        self.launcher.launch_untyped(self.variant, stream, self.template.fill(
            addresses + [tensor.data_ptr() for tensor in outputs]))
        tensors = TensorBlock(outputs[0], self.block_layout,
                              None if self.copy else {"topk_idx": topk_idx})
        handle = EPHandle(tensors, None, **self.handle_fields, backend_state=tensors)
        return DispatchResult(outputs[1:self.rows_end],
                              None if self.idx_at is None else outputs[self.idx_at],
                              None if self.weights_at is None else outputs[self.weights_at],
                              handle, prepared=self)


@dataclass(frozen=True)
class _OutputShapes:
    """(shape, dtype) of each output of a dispatch: the received payload tensors, the received
    weights (None without weights), the local ids (None in the expand layout)."""

    rows: tuple
    weights: Optional[tuple]
    idx: Optional[tuple]


class SymmetricBackend(Backend):
    name = "symmetric"
    explicit_streams = True
    # Every kernel variant is compiled at warm-up for 16-byte aligned pointers (another would
    # be compiled and loaded while kernels may be in flight: gpu-facts), and rows move as words.
    input_alignment = 16

    def __init__(self, buffer) -> None:
        self.group = buffer.group
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        self.device = buffer.device
        ok, why = _support(buffer)
        if not ok:
            raise RuntimeError(f"the symmetric backend cannot run here: {why}")
        self.stride_tokens = buffer.num_max_tokens_per_rank
        self.hidden, self.num_topk = buffer.hidden, buffer.num_topk
        self.timeout_s = buffer.timeout_s
        self.timeout = timeout_units(buffer.timeout_s, INTERPRET)
        programs = self._programs(getattr(buffer, "num_sms", None))
        if len(set(all_gather_objects(programs, self.group))) != 1:
            raise ValueError("num_sms must be the same on every rank of the group")
        self.num_sms = programs

        R, S, H, K = self.num_ranks, self.stride_tokens, self.hidden, self.num_topk
        bf16_words, fp8_words = _payload_words(H)
        self.combine_layout = combine_kernels.CombineLayout(H, K)
        tile = _GPU_TILE if self.device.type == "cuda" else _CPU_TILE
        use_timer = not INTERPRET
        self.shape = KernelShape(R, K, _vector_words([*bf16_words, *fp8_words], 4),
                                 min(tile["block_w"], _block(H // 2)), tile["rows"], programs,
                                 tile["num_warps"], use_timer)
        self.combine_shape = KernelShape(R, K, _vector_words([H], 8),
                                         min(tile["block_h"], _block(H)), tile["combine_rows"],
                                         programs, tile["combine_warps"], use_timer)

        flags, dispatch_region, combine_region, nbytes = heap_layout(R, S, H, K)
        self.heap = SymmetricHeap(self.group, nbytes, self.device)
        self.heap_bytes = nbytes
        self.dispatch_stage = Stage(self.heap.bases, self.rank, 0, dispatch_region, S)
        self.combine_stage = Stage(self.heap.bases, self.rank, flags, combine_region, S)

        dev, i32 = self.device, torch.int32
        self._flags = torch.zeros((), dtype=i32, device=dev)
        self._sync = torch.zeros(8, dtype=torch.int64, device=dev)
        self._counts_scratch = torch.zeros(programs * self.shape.block_r, dtype=i32, device=dev)
        self._pos_scratch = torch.zeros(S * R, dtype=i32, device=dev)
        self._hist_scratch = torch.zeros(0, dtype=i32, device=dev)
        self._layouts: dict = {}  # payload words -> (RecordLayout, its dispatch Launcher)
        self._combine_launcher = combine_kernels.launcher(self.combine_shape)
        self._block_layouts: dict = {}  # see `_block_layout`
        self._plans: dict = {}  # sync-free call shape -> _SyncFreePlan
        self._scratch_addresses = tuple(tensor.data_ptr() for tensor in self._scratch(True))
        if self.device.type == "cuda":
            self._warm_up()

    def _programs(self, num_sms: Optional[int]) -> int:
        """P, the programs of every kernel: `num_sms` if given, else one per 16 tokens up to the
        SM count (each program then moves at least 16 rows per kernel). Every program of a launch
        must be resident at once (grid barriers), so at most the SM count; 1 under the
        interpreter, which runs programs one after another."""
        if INTERPRET or self.device.type != "cuda":
            return 1
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if num_sms is None:
            num_sms = -(-self.stride_tokens // 16)
        return max(1, min(int(num_sms), sms))

    def _hist(self, num_local: int, stream=None) -> torch.Tensor:
        """The receive part's scratch for `num_local` experts, grown (zeroed on `stream`,
        the one the kernel runs on) when too small."""
        need = dispatch_kernels.hist_scratch_words(
            self.num_sms, self.shape.rows, self.num_ranks * self.stride_tokens, num_local,
            self.num_topk)
        if self._hist_scratch.numel() < need:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self._hist_scratch = torch.zeros(need, dtype=torch.int32, device=self.device)
            for plan in self._plans.values():  # their arguments hold the old scratch's address
                plan.stale = True
            self._plans.clear()
        return self._hist_scratch

    def _warm_up(self) -> None:
        """Compile and load every kernel variant now, before any waiting kernel of this process
        can be in flight (gpu-facts: a module load while one of our kernels spins can hang).
        The launches run a one-rank exchange with no tokens on a scratch "heap" and sync tensor
        of their own: the counters they raise are the ones they wait for."""
        R, K, H = self.num_ranks, self.num_topk, self.hidden
        dev, i32 = self.device, torch.int32
        scratch = torch.zeros(6, dtype=torch.int64, device=dev)  # counters of one rank
        bases = torch.tensor([scratch.data_ptr()], dtype=torch.int64, device=dev)
        # The real region offsets and stride (never dereferenced with no tokens): Triton types an
        # int argument i32 or i64 by its value, so they select the variants the calls will use.
        dispatch = Stage(bases, 0, 0, self.dispatch_stage.region_offset, self.stride_tokens)
        combine = Stage(bases, 0, 3 * 8, self.combine_stage.region_offset, self.stride_tokens)
        sync = torch.zeros(8, dtype=torch.int64, device=dev)
        error = torch.zeros((), dtype=i32, device=dev)
        rows = [torch.empty(0, H, dtype=torch.bfloat16, device=dev)]
        layout = RecordLayout(K, payload_words(rows))
        info = [torch.zeros(max(R, 64), dtype=i32, device=dev) for _ in range(3)]
        meta = torch.empty(0, K + 2, dtype=i32, device=dev)
        # Variants (topk_idx dtype, idx_out dtype): the counting pass and the expand layout
        # pass int32 metadata as idx_out, the compact layout topk_idx's dtype.
        for idx_dtype in (torch.int32, torch.int64):
            idx = torch.empty(0, K, dtype=idx_dtype, device=dev)
            slots = torch.empty(0, K, dtype=i32, device=dev)
            send = dispatch_kernels.send_phase(self._counts_scratch, self._pos_scratch, idx, 1,
                                               None, rows, layout, slots)
            for full, do_send in ((False, True), (True, False), (True, True)):
                variant = dispatch_kernels.variant(idx, None, rows, idx_dtype if full else i32)
                dispatch_kernels.run(
                    self.shape, dispatch, layout, sync, error, self.timeout, send,
                    dispatch_kernels.receive_phase(
                        self._hist(1), layout, full=full, max_tokens=1,
                        num_local=1, alignment=1, capacity=0, out_rows=0, expand=False,
                        zero_padding=False, tail=False, idx_out=idx if full else None,
                        weights_out=None, metadata=meta, rank_psum=info[0],
                        expert_counts=info[1], expert_psum=info[2], rows_out=rows),
                    do_send=do_send, variant=variant)
            combine_kernels.combine(self.combine_shape, combine, self.combine_layout, sync,
                                    info[0], meta, rows[0], None, False, slots, (), rows[0],
                                    None, error, self.timeout,
                                    variant=combine_kernels.variant(rows[0], None, ()))
        torch.cuda.synchronize(dev)
        if error.item():
            raise RuntimeError("the symmetric backend's warm-up counters did not arrive")

    def error_flags(self) -> torch.Tensor:
        return self._flags

    def destroy(self) -> None:
        self.heap.destroy()

    def _raise_on_timeout(self, stage: str) -> None:
        flags = int(self._flags.item())
        if flags & errors.WAIT_TIMEOUT:
            self._flags.bitwise_and_(~errors.WAIT_TIMEOUT)
            raise errors.EPTimeoutError(
                f"rank {self.rank}: {stage}: a peer did not arrive within {self.timeout_s} s")

    # -- dispatch --------------------------------------------------------------------------
    def _record_layout(self, rows) -> tuple[RecordLayout, Launcher]:
        """The record layout of these payload rows, and the dispatch kernel's launcher for it."""
        words = payload_words(rows)
        entry = self._layouts.get(words)
        if entry is None:
            layout = RecordLayout(self.num_topk, words)
            entry = self._layouts[words] = layout, dispatch_kernels.launcher(self.shape, layout)
        return entry

    def _block_layout(self, num_tokens: int, num_local: int, num_rows: Optional[int],
                      idx_copy_dtype: Optional[torch.dtype]) -> BlockLayout:
        """The layout of a dispatch's handle tensors, cached per call shape: the kernels'
        int32 outputs kept by the handle (and the copy of topk_idx) in one allocation."""
        key = (num_tokens, num_local, num_rows, idx_copy_dtype)
        layout = self._block_layouts.get(key)
        if layout is None:
            R, K, i32 = self.num_ranks, self.num_topk, torch.int32
            parts = [("psum_num_recv_tokens_per_scaleup_rank", (R,), i32),
                     ("num_unaligned_recv_tokens_per_expert", (num_local,), i32),
                     ("psum_num_recv_tokens_per_expert", (num_local,), i32),
                     ("slots", (num_tokens, K), i32)]
            if num_rows is not None:
                parts.append(("recv_src_metadata", (num_rows, K + 2), i32))
            if idx_copy_dtype is not None:
                parts.append(("topk_idx", (num_tokens, K), idx_copy_dtype))
            layout = BlockLayout(parts)
            remember(self._block_layouts, key, layout)
        return layout

    def _scratch(self, typed: bool) -> tuple:
        """(sync, error flag, counts, positions) kernel arguments: the tensors, or their
        addresses for untyped launches."""
        if not typed:
            return self._scratch_addresses
        return self._sync, self._flags, self._counts_scratch, self._pos_scratch

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        if not request.do_cpu_sync and request.cached is None:
            result = self._dispatch_planned(request)
            if result is not None:
                return result
        R, K = self.num_ranks, self.num_topk
        E, align = request.num_experts, request.expert_alignment
        num_local = E // R
        sync, alloc, cached, stream = request.do_cpu_sync, request.alloc, request.cached, \
            request.stream
        expand = request.do_expand
        layout, launcher = self._record_layout(request.rows)
        topk_idx, weights, rows = request.topk_idx, request.topk_weights, request.rows
        num_tokens = topk_idx.shape[0]
        if cached is not None and sync:
            num_rows, num_expanded = cached.num_recv_tokens, cached.num_expanded_tokens
        elif sync:
            num_rows = num_expanded = None  # counted on the device first
        else:
            num_rows, num_expanded = self._capacity(request)
        copy = request.copy_topk_idx
        block_layout = self._block_layout(num_tokens, num_local, num_rows,
                                          topk_idx.dtype if copy else None)
        block = TensorBlock(alloc.empty((block_layout.words,), torch.int32), block_layout,
                            None if copy else {"topk_idx": topk_idx})
        # Untyped arguments (addresses, no views) when every launch of this call is kept.
        idx_out_dtype = torch.int32 if expand else topk_idx.dtype
        variant = dispatch_kernels.variant(topk_idx, weights, rows, idx_out_dtype)
        count_variant = None
        typed = not launcher.kept(variant)
        if num_rows is None:
            count_variant = dispatch_kernels.variant(topk_idx, weights, rows, torch.int32)
            typed = typed or not launcher.kept(count_variant)
        sync_t, error, counts, positions = self._scratch(typed)
        hist = self._hist(num_local, stream)
        if not typed:
            hist = hist.data_ptr()
        send = dispatch_kernels.send_phase(
            counts, positions, topk_idx, E, weights, rows, layout, block.arg("slots", typed),
            block.arg("topk_idx", typed) if copy else None, typed=typed)
        counts_list = None
        if num_rows is None:
            # Send and count in one launch, size the outputs on the host, then receive.
            launcher(count_variant, stream, *dispatch_kernels.arguments(
                self.dispatch_stage, layout, sync_t, error, self.timeout, send,
                dispatch_kernels.receive_phase(
                    hist, layout, full=False, capacity=0, out_rows=_NO_CAPACITY,
                    zero_padding=False, tail=False, idx_out=None, weights_out=None,
                    metadata=block.arg("slots", typed), rows_out=[],
                    **self._receive_parts(request, block, typed)), typed=typed), typed=typed)
            num_rows = block["psum_num_recv_tokens_per_scaleup_rank"][-1].item()  # the host sync
            self._raise_on_timeout("dispatch")
            counts_list = [align_up(c, align) for c in
                           block["num_unaligned_recv_tokens_per_expert"].tolist()]
            num_expanded = sum(counts_list) if expand else 0
            block.extra["recv_src_metadata"] = alloc.empty((num_rows, K + 2), torch.int32)
            sent = True
        else:
            sent = False
        recv_rows, recv_weights, local_idx = self._outputs(request, num_rows, num_expanded)
        launcher(variant, stream, *self._receive_arguments(
            request, layout, block, send, hist, num_rows, num_expanded, recv_rows, recv_weights,
            local_idx, do_send=not sent, typed=typed), typed=typed)
        if cached is not None:
            return DispatchResult(recv_rows, local_idx, recv_weights, cached)
        return self._result(request, block, recv_rows, recv_weights, local_idx, counts_list,
                            num_rows, num_expanded)

    def _capacity(self, request: DispatchRequest) -> tuple[int, int]:
        """(compact rows, expand rows) of a sync-free dispatch's outputs (contract section 2)."""
        R, M = self.num_ranks, request.num_max_tokens_per_rank
        num_expanded = expand_capacity(R, M, self.num_topk, request.num_experts // R,
                                       request.expert_alignment) if request.do_expand else 0
        return R * M, num_expanded

    def _output_shapes(self, request: DispatchRequest, num_rows: int,
                       num_expanded: int) -> _OutputShapes:
        K, expand = self.num_topk, request.do_expand
        out_rows = num_expanded if expand else num_rows
        return _OutputShapes(
            tuple(((out_rows, *row.shape[1:]), row.dtype) for row in request.rows),
            None if request.topk_weights is None else
            ((out_rows,) if expand else (out_rows, K), torch.float32),
            None if expand else ((num_rows, K), request.topk_idx.dtype))

    def _outputs(self, request: DispatchRequest, num_rows: int, num_expanded: int) -> tuple:
        """(received payload rows, received weights or None, local ids or None (expand))."""
        alloc, shapes = request.alloc, self._output_shapes(request, num_rows, num_expanded)
        recv_rows = [alloc.empty(shape, dtype) for shape, dtype in shapes.rows]
        recv_weights = None if shapes.weights is None else alloc.empty(*shapes.weights)
        local_idx = None if shapes.idx is None else alloc.empty(*shapes.idx)
        return recv_rows, recv_weights, local_idx

    def _receive_parts(self, request: DispatchRequest, block: "TensorBlock", typed: bool) -> dict:
        """The receive phase's arguments common to both passes of a dispatch."""
        return dict(max_tokens=request.num_max_tokens_per_rank,
                    num_local=request.num_experts // self.num_ranks,
                    alignment=request.expert_alignment, expand=request.do_expand,
                    rank_psum=block.arg("psum_num_recv_tokens_per_scaleup_rank", typed),
                    expert_counts=block.arg("num_unaligned_recv_tokens_per_expert", typed),
                    expert_psum=block.arg("psum_num_recv_tokens_per_expert", typed),
                    typed=typed)

    def _receive_arguments(self, request: DispatchRequest, layout: RecordLayout,
                           block: "TensorBlock", send: tuple, hist, num_rows: int,
                           num_expanded: int, recv_rows, recv_weights, local_idx, *,
                           do_send: bool, typed: bool) -> tuple:
        """The arguments of the launch that fills the outputs (after sending, or sending too)."""
        expand = request.do_expand
        receive = dispatch_kernels.receive_phase(
            hist, layout, full=True, capacity=num_expanded if expand else _NO_CAPACITY,
            out_rows=num_rows, zero_padding=request.do_zero_padding,
            tail=not request.do_cpu_sync, idx_out=local_idx, weights_out=recv_weights,
            metadata=block.arg("recv_src_metadata", typed), rows_out=recv_rows,
            **self._receive_parts(request, block, typed))
        sync, error = self._scratch(typed)[:2]
        return dispatch_kernels.arguments(self.dispatch_stage, layout, sync, error, self.timeout,
                                          send, receive, do_send=do_send, typed=typed)

    @staticmethod
    def _handle_fields(request: DispatchRequest, num_rows: int, num_expanded: int) -> dict:
        """The `EPHandle` fields of a dispatch but its tensors and host counts."""
        return dict(num_experts=request.num_experts, expert_alignment=request.expert_alignment,
                    num_max_tokens_per_rank=request.num_max_tokens_per_rank,
                    do_expand=request.do_expand, do_cpu_sync=request.do_cpu_sync,
                    num_recv_tokens=num_rows, num_expanded_tokens=num_expanded)

    def _result(self, request: DispatchRequest, block: "TensorBlock", recv_rows, recv_weights,
                local_idx, counts_list: Optional[list[int]], num_rows: int,
                num_expanded: int) -> DispatchResult:
        handle = EPHandle(block, counts_list, **self._handle_fields(request, num_rows,
                                                                     num_expanded),
                          backend_state=block)
        return DispatchResult(recv_rows, local_idx, recv_weights, handle)

    def _dispatch_planned(self, request: DispatchRequest) -> Optional[DispatchResult]:
        """A sync-free dispatch through the `_SyncFreePlan` of its call shape (made by the
        first such call), or None when it cannot take one (no kept kernel: under the
        interpreter, before warm-up, or after the compiled launcher rejected a launch)."""
        rows, topk_idx, weights = request.rows, request.topk_idx, request.topk_weights
        key = (topk_idx.shape[0], topk_idx.dtype, weights is None, len(rows), rows[0].dtype,
               request.num_experts, request.num_max_tokens_per_rank, request.expert_alignment,
               request.do_expand, request.do_zero_padding, request.copy_topk_idx)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plan(request)
            if plan is None:
                return None
            dropped = remember(self._plans, key, plan)
            if dropped is not None:
                dropped.stale = True  # a `Buffer` may still keep it: only plans here are updated
        inputs = plan.addresses(rows, topk_idx, weights)
        if inputs is None:
            return None
        return plan.run(inputs, topk_idx, request.alloc.empty, request.stream)

    def _plan(self, request: DispatchRequest) -> Optional[_SyncFreePlan]:
        """The plan of this sync-free call's shape, None if its kernel variant is not kept."""
        rows, topk_idx, weights = request.rows, request.topk_idx, request.topk_weights
        layout, launcher = self._record_layout(rows)
        variant = dispatch_kernels.variant(topk_idx, weights, rows, torch.int32
                                           if request.do_expand else topk_idx.dtype)
        if not launcher.kept(variant):
            return None
        num_rows, num_expanded = self._capacity(request)
        copy = request.copy_topk_idx
        block_layout = self._block_layout(topk_idx.shape[0], request.num_experts //
                                          self.num_ranks, num_rows,
                                          topk_idx.dtype if copy else None)
        shapes = self._output_shapes(request, num_rows, num_expanded)
        # The launch's arguments, built by the same code as every other launch's, with an
        # `Address` for each tensor, in the plan's slot order.
        slots = itertools.count()

        def stand_in(shape) -> Address:
            return Address(next(slots), tuple(shape))

        row_slots = [stand_in(row.shape) for row in rows]
        idx_slot = stand_in(topk_idx.shape)
        weights_slot = None if weights is None else stand_in(weights.shape)
        block = TensorBlock(stand_in((block_layout.words,)), block_layout,
                            None if copy else {"topk_idx": idx_slot})
        recv_rows = [stand_in(shape) for shape, _ in shapes.rows]
        recv_weights = None if shapes.weights is None else stand_in(shapes.weights[0])
        local_idx = None if shapes.idx is None else stand_in(shapes.idx[0])
        counts, positions = self._scratch(False)[2:]
        send = dispatch_kernels.send_phase(
            counts, positions, idx_slot, request.num_experts, weights_slot, row_slots, layout,
            block.arg("slots", False), block.arg("topk_idx", False) if copy else None,
            typed=False)
        hist = self._hist(request.num_experts // self.num_ranks, request.stream)
        args = self._receive_arguments(
            request, layout, block, send, hist.data_ptr(), num_rows, num_expanded, recv_rows,
            recv_weights, local_idx, do_send=True, typed=False) + launcher.tail
        return _SyncFreePlan(launcher, variant, block_layout, shapes, copy,
                             self._handle_fields(request, num_rows, num_expanded),
                             ArgTemplate(args, base=block.address.slot), self.device)

    # -- combine ---------------------------------------------------------------------------
    def combine(self, request: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        handle = request.handle
        block: TensorBlock = handle.backend_state
        num_tokens = handle.num_tokens
        combined_x = request.alloc.empty((num_tokens, self.hidden), torch.bfloat16)
        combined_weights = None
        if request.topk_weights is not None:
            combined_weights = request.alloc.empty((num_tokens, self.num_topk), torch.float32)
        variant = combine_kernels.variant(request.x, request.topk_weights, request.biases)
        typed = not self._combine_launcher.kept(variant)
        sync, error = self._scratch(typed)[:2]
        combine_kernels.combine(
            self.combine_shape, self.combine_stage, self.combine_layout, sync,
            block.arg("psum_num_recv_tokens_per_scaleup_rank", typed),
            block.arg("recv_src_metadata", typed), request.x, request.topk_weights,
            handle.do_expand, block.arg("slots", typed), request.biases, combined_x,
            combined_weights, error, self.timeout, stream=request.stream, typed=typed,
            variant=variant, kernel=self._combine_launcher)
        if handle.do_cpu_sync:
            self._raise_on_timeout("combine")
        return combined_x, combined_weights
