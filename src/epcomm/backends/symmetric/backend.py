"""`SymmetricBackend`: the symmetric heap, the kernels' compile-time shapes, and the host side of
each call (the general path, with tensors; prepared calls per call shape, see `plans`)."""
from __future__ import annotations

import functools
import itertools
from typing import Hashable, Optional

import torch
import torch.distributed as dist

from ... import errors
from ...handle import EPHandle
from ...kernels import INTERPRET
from ...kernels import combine as combine_kernels
from ...kernels import dispatch as dispatch_kernels
from ...kernels.dispatch import RecordLayout, payload_words
from ...kernels.launcher import Address, KernelShape, Launcher, Stage, next_power_of_2
from ...kernels.sync import timeout_units
from ...layout import expand_capacity
from ..base import (Backend, BufferConfig, CombineRequest, DispatchRequest, DispatchResult,
                    HostCounts, caller_tensors, exact_result, remember)
from ..blocks import BlockLayout, TensorBlock
from .heap import SymmetricHeap, all_gather_objects, heap_layout, heap_reachable
from .heap import payload_words as hidden_payload_words
from .plans import CombinePlan, DispatchPlan, OutputSpec, Scratch
from .warmup import warm_up

_NO_CAPACITY = 2**31 - 1  # a row bound nothing reaches (exact-size outputs)
# Tiles of the GPU kernels: 16 rows x 512 words (32 KB of loads in flight per program; 7168
# bf16 is exactly 7 steps), 16 rows x 1024 bf16 in combine (16 warps for the fp32 sums).
# Measured (scripts/gpu_tune.py, H200, EP=1 4096 x 7168): compact combine 77.1 us at
# 16 x 1024 x 16 warps, 89.8 at 16 x 512, 92.4 at 8 x 1024; dispatch 101 us at 16 x 512 x 8,
# 112 at 8 x 512. 118 registers for combine at 16 x 1024 (scripts/compile_sm90.py), under the
# 128 that 16 warps allow.
_GPU_TILE = dict(rows=16, block_w=512, num_warps=8, combine_rows=16, block_h=1024,
                 combine_warps=16)
# Decode sizes (at most 4 tokens per program, so a send part's tokens fit one tile): 4 rows x
# 2048 words, the same 32 KB per step in 2 steps along 7168 bf16 instead of 7. Measured
# (scripts/gpu_tune.py --tokens 128, H200, EP=1, 32 programs; compact / expand dispatch us):
# 16 x 512: 23.6 / 44.4; 4 x 2048 x 8 warps: 19.5 / 29.0; 4 x 1024 x 4: 19.7 / 28.6; 8 x 1024:
# 21.5 / 36.2. The combine: 4 rows x 1024, so that an expand send loads all K slots' rows of
# a step at once (`kernels.combine.slots_in_flight`; at 16 x 1024 two at a time, K / 2 round
# trips per step). Measured (scripts/gpu_symmetric.py --ranks --tokens 128, H100, EP=1; compact
# / expand combine us): 10.0 / 12.8 on every SM; on 32 programs, where each program gets one
# item of 7 steps, 13.3 / 21.1 against 12.8 / 21.3 at 16 x 1024.
_GPU_DECODE_TILE = dict(_GPU_TILE, rows=4, block_w=2048, combine_rows=4)
# The default grid is every SM, at every size. At 128 tokens (EP=1, hidden 7168, top-8, 256
# experts) the kernels' fixed steps no longer grow with the programs (the dispatch's one-block
# paths count everything in every program; the combine's work items split the hidden
# dimension), while the expand layout's 14.7 MB of rows, written by the dispatch and read by
# the combine, take an SM's share of bandwidth per program: see docs/perf-notes.md
# (Decode-size batches) for the times on 32, 64 and 132 programs.
_CPU_TILE = dict(rows=4, block_w=64, num_warps=1, combine_rows=4, block_h=64, combine_warps=1)


def gpu_tile(tokens_per_rank: int, programs: int) -> dict:
    """The GPU tile of a buffer for `tokens_per_rank` tokens on `programs` programs."""
    return _GPU_DECODE_TILE if tokens_per_rank <= _GPU_DECODE_TILE["rows"] * programs \
        else _GPU_TILE


def _local_reason(config: BufferConfig) -> str:
    """This rank's objection to the symmetric backend, "" if none."""
    if config.hidden % 4:
        return f"hidden={config.hidden} is not a multiple of 4 (records move 4-byte words)"
    if config.device.type == "cpu" and not INTERPRET:
        return "CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing triton)"
    if config.device.type == "cuda" and INTERPRET:
        return "TRITON_INTERPRET=1 is set, so Triton cannot run CUDA kernels"
    return ""


def _support(group: dist.ProcessGroup, config: BufferConfig) -> tuple[bool, str]:
    return heap_reachable(group, config.device, _local_reason(config))


def symmetric_supported(group: dist.ProcessGroup, config: BufferConfig) -> bool:
    """Whether every rank of `group` can map every other's memory and run the kernels; the
    same answer on all ranks (collective)."""
    return _support(group, config)[0]


def _block(width: int) -> int:
    """A copy step for rows of `width` elements: a power of two (tl.arange needs one), >= 16."""
    return max(16, next_power_of_2(width))


def _vector_words(words: list[int], widest: int) -> int:
    """The widest power of two <= `widest` that divides every width in `words`."""
    vec = widest
    while any(w % vec for w in words):
        vec //= 2
    return vec


class SymmetricBackend(Backend):
    name = "symmetric"
    explicit_streams = True
    # Every kernel variant is compiled at warm-up for 16-byte aligned pointers (another would
    # be compiled and loaded while kernels may be in flight), and rows move as words.
    input_alignment = 16

    def __init__(self, group: dist.ProcessGroup, config: BufferConfig) -> None:
        super().__init__(config)
        ok, why = _support(group, config)
        if not ok:
            raise RuntimeError(f"the symmetric backend cannot run here: {why}")
        self.hidden, self.num_topk = config.hidden, config.num_topk
        self.timeout = timeout_units(config.timeout_s)
        programs = self._programs(config.num_sms)
        if len(set(all_gather_objects(programs, group))) != 1:
            raise ValueError("num_sms must be the same on every rank of the group")
        self._num_sms = programs

        R, S, H, K = self.num_ranks, config.num_max_tokens_per_rank, self.hidden, self.num_topk
        self.max_rows = R * S  # compact rows a dispatch can receive
        bf16_words, fp8_words = hidden_payload_words(H)
        self.combine_layout = combine_kernels.CombineLayout(H, K)
        flags, dispatch_region, combine_region, nbytes = heap_layout(R, S, H, K)
        self.heap = SymmetricHeap(group, nbytes, self.device)
        self.heap_bytes = nbytes
        tile = gpu_tile(S, programs) if self.device.type == "cuda" else _CPU_TILE
        self.shape = KernelShape(R, K, _vector_words([*bf16_words, *fp8_words], 4),
                                 min(tile["block_w"], _block(H // 2)), tile["rows"], programs,
                                 tile["num_warps"], self.heap.scope)
        self.combine_shape = KernelShape(R, K, _vector_words([H], 8),
                                         min(tile["block_h"], _block(H)), tile["combine_rows"],
                                         programs, tile["combine_warps"], self.heap.scope)
        self.dispatch_stage = Stage(self.heap.bases, self.rank, 0, dispatch_region, S)
        self.combine_stage = Stage(self.heap.bases, self.rank, flags, combine_region, S)

        dev, i32 = self.device, torch.int32
        self.flags = torch.zeros((), dtype=i32, device=dev)
        self.sync = torch.zeros(8, dtype=torch.int64, device=dev)
        self.counts_scratch = torch.zeros(programs * self.shape.block_r, dtype=i32, device=dev)
        self.pos_scratch = torch.zeros(S * R, dtype=i32, device=dev)
        self.hist = Scratch(dev)  # the receive part's, grown for the most local experts seen
        self._layouts: dict = {}  # payload words -> (RecordLayout, its dispatch Launcher)
        self.combine_launcher = combine_kernels.launcher(self.combine_shape)
        self._block_layouts: dict = {}  # see `_block_layout`
        # The prepared calls: sync-free call shape (`DispatchRequest.key`) -> DispatchPlan;
        # combine call shape -> CombinePlan.
        self._prepared: dict = {}
        self._combine_plans: dict = {}
        if self.device.type == "cuda":
            warm_up(self)

    @property
    def num_sms(self) -> int:
        return self._num_sms

    def _programs(self, num_sms: Optional[int]) -> int:
        """P, the programs of every kernel: `num_sms` if given, else the SM count. Every
        program of a launch must be resident at once (grid barriers), so at most the SM count;
        1 under the interpreter, which runs programs one after another."""
        if INTERPRET or self.device.type != "cuda":
            return 1
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return max(1, min(int(sms if num_sms is None else num_sms), sms))

    def receive_scratch(self, num_local: int, stream=None) -> torch.Tensor:
        """The receive part's scratch for `num_local` experts (grown on `stream`, the one the
        kernel runs on, when too small)."""
        return self.hist.at_least(dispatch_kernels.hist_scratch_words(
            self._num_sms, self.shape.rows, self.max_rows, num_local, self.num_topk), stream)

    def error_flags(self) -> torch.Tensor:
        return self.flags

    def destroy(self) -> None:
        self.heap.destroy()

    def _raise_flags(self, stage: str, flags: int) -> None:
        """Raise (and clear) what the error flag held when it was read back (`flags`, with the
        peer that `kernels.sync.stamped_words` recorded, if any): `errors.flags_error`'s
        exception."""
        if flags:
            self.flags.bitwise_and_(~flags)
            raise errors.flags_error(flags, f"rank {self.rank}: {stage}", self.config.timeout_s)

    # -- dispatch --------------------------------------------------------------------------
    def _record_layout(self, rows) -> tuple[RecordLayout, Launcher]:
        """The record layout of these payload rows, and the dispatch kernel's launcher for it."""
        words = payload_words(rows)
        entry = self._layouts.get(words)
        if entry is None:
            layout = RecordLayout(self.num_topk, words)
            entry = self._layouts[words] = layout, dispatch_kernels.launcher(
                self.shape, layout, self.max_rows)
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
                     ("dst_buffer_slot_idx", (num_tokens, K), i32)]
            if num_rows is not None:
                parts.append(("recv_src_metadata", (num_rows, K + 2), i32))
            if idx_copy_dtype is not None:
                parts.append(("topk_idx", (num_tokens, K), idx_copy_dtype))
            layout = BlockLayout(parts)
            remember(self._block_layouts, key, layout)
        return layout

    def prepared_dispatch(self, key: Hashable) -> Optional[DispatchPlan]:
        return self._prepared.get(key)

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        if request.key is not None:
            plan = self._prepared.get(request.key)
            if plan is None:
                plan = self._prepare(request)
                if plan is not None:
                    remember(self._prepared, request.key, plan)
            if plan is not None:
                addresses = [tensor.data_ptr() for tensor in
                             caller_tensors(request.rows, request.topk_idx, request.topk_weights)]
                if plan.takes(addresses):
                    return plan.run(addresses, request.topk_idx, request.alloc, request.stream)
        R = self.num_ranks
        E = request.num_experts
        num_local = E // R
        sync, alloc, cached, stream = request.do_cpu_sync, request.alloc, request.cached, \
            request.stream
        expand = request.do_expand
        layout, launcher = self._record_layout(request.rows)
        topk_idx, weights, rows = request.topk_idx, request.topk_weights, request.rows
        num_tokens = topk_idx.shape[0]
        if cached is not None and sync:
            num_rows, num_expanded = cached.num_recv_tokens, cached.num_expanded_tokens
        else:
            num_rows, num_expanded = self._capacity(request)
        copy = request.copy_topk_idx
        block_layout = self._block_layout(num_tokens, num_local, num_rows,
                                          topk_idx.dtype if copy else None)
        block = TensorBlock(alloc.empty((block_layout.words,), torch.int32), block_layout,
                            None if copy else {"topk_idx": topk_idx})
        variant = dispatch_kernels.variant(topk_idx, weights, rows,
                                           torch.int32 if expand else topk_idx.dtype)
        hist = self.receive_scratch(num_local, stream)
        send = dispatch_kernels.send_phase(
            self.counts_scratch, self.pos_scratch, topk_idx, E, weights, rows, layout,
            block.arg("dst_buffer_slot_idx"), block.arg("topk_idx") if copy else None)
        recv_rows, recv_weights, local_idx = self._output_spec(request).allocate(
            alloc, num_rows, num_expanded)
        counts = self.host_counts(num_local) if sync and cached is None else None
        launcher(variant, stream, self._receive_arguments(
            request, layout, block, send, hist, num_rows, num_expanded, recv_rows, recv_weights,
            local_idx, counts))
        if cached is not None:
            return DispatchResult(recv_rows, local_idx, recv_weights, cached)
        handle = EPHandle(block, None, **self._handle_fields(request), num_recv_tokens=num_rows,
                          num_expanded_tokens=num_expanded, backend_state=block,
                          storage=block.storage())
        result = DispatchResult(recv_rows, local_idx, recv_weights, handle)
        return self._exact(result, stream, counts) if sync else result

    def _exact(self, result: DispatchResult, stream, host: HostCounts) -> DispatchResult:
        """A synchronizing dispatch's results, from those of the call made as a sync-free one:
        one wait for its launch, then the counts and the error flag it left in `host`, the
        outputs cut to their valid prefix (views of the capacity-sized outputs: nothing is
        copied) and the handle given the exact sizes and `num_recv_tokens_per_expert_list`."""
        num_rows, per_expert, flags = host.read(stream)
        self._raise_flags("dispatch", flags)
        return exact_result(result, num_rows, per_expert)

    def _capacity(self, request: DispatchRequest) -> tuple[int, int]:
        """(compact rows, expand rows) of a sync-free dispatch's outputs (contract section 2)."""
        R, M = self.num_ranks, request.num_max_tokens_per_rank
        num_expanded = expand_capacity(R, M, self.num_topk, request.num_experts // R,
                                       request.expert_alignment) if request.do_expand else 0
        return R * M, num_expanded

    def _output_spec(self, request: DispatchRequest) -> OutputSpec:
        return OutputSpec(tuple((tuple(row.shape[1:]), row.dtype) for row in request.rows),
                          request.topk_weights is not None, request.topk_idx.dtype,
                          self.num_topk, request.do_expand)

    def _receive_parts(self, request: DispatchRequest, block: TensorBlock) -> dict:
        """The receive phase's arguments common to both passes of a dispatch."""
        return dict(max_tokens=request.num_max_tokens_per_rank,
                    num_local=request.num_experts // self.num_ranks,
                    alignment=request.expert_alignment, expand=request.do_expand,
                    rank_psum=block.arg("psum_num_recv_tokens_per_scaleup_rank"),
                    expert_counts=block.arg("num_unaligned_recv_tokens_per_expert"),
                    expert_psum=block.arg("psum_num_recv_tokens_per_expert"))

    def _receive_arguments(self, request: DispatchRequest, layout: RecordLayout,
                           block: TensorBlock, send: dict, hist, num_rows: int,
                           num_expanded: int, recv_rows, recv_weights, local_idx,
                           counts: Optional[HostCounts]) -> dict:
        """The arguments of the launch that sends and fills the outputs (`counts`: where a
        synchronizing call's kernel leaves its counts)."""
        expand = request.do_expand
        receive = dispatch_kernels.receive_phase(
            hist, layout, capacity=num_expanded if expand else _NO_CAPACITY,
            out_rows=num_rows, zero_padding=request.do_zero_padding,
            tail=not request.do_cpu_sync, idx_out=local_idx, weights_out=recv_weights,
            metadata=block.arg("recv_src_metadata"), rows_out=recv_rows,
            counts_host=None if counts is None else counts.words,
            **self._receive_parts(request, block))
        return dispatch_kernels.arguments(self.dispatch_stage, layout, self.sync, self.flags,
                                          self.timeout, send, receive)

    def _handle_fields(self, request: DispatchRequest) -> dict:
        """The `EPHandle` fields of a dispatch but its tensors and its row counts."""
        return dict(num_experts=request.num_experts, expert_alignment=request.expert_alignment,
                    num_max_tokens_per_rank=request.num_max_tokens_per_rank,
                    do_expand=request.do_expand, do_cpu_sync=request.do_cpu_sync,
                    buffer_id=self.config.buffer_id, num_tokens=request.topk_idx.shape[0],
                    hidden=self.hidden, num_sms=self._num_sms)

    def _prepare(self, request: DispatchRequest) -> Optional[DispatchPlan]:
        """The prepared call of this call's shape: the launch's arguments built by the same
        code as every other launch's, with an `Address` stand-in for each tensor, in the plan's
        slot order (`DispatchPlan`; with `do_cpu_sync` it ends in `_exact`). None if the kernel
        variant is not kept (under the interpreter, or after the compiled launcher rejected a
        launch)."""
        rows, topk_idx, weights = request.rows, request.topk_idx, request.topk_weights
        layout, launcher = self._record_layout(rows)
        variant = dispatch_kernels.variant(topk_idx, weights, rows, torch.int32
                                           if request.do_expand else topk_idx.dtype)
        if not launcher.kept(variant):
            return None
        num_rows, num_expanded = self._capacity(request)
        copy = request.copy_topk_idx
        num_local = request.num_experts // self.num_ranks
        block_layout = self._block_layout(topk_idx.shape[0], num_local, num_rows,
                                          topk_idx.dtype if copy else None)
        shapes = self._output_spec(request).shapes(num_rows, num_expanded)
        slots = itertools.count()

        def stand_in(shape=()) -> Address:
            return Address(next(slots), tuple(shape))

        row_slots = [stand_in(row.shape) for row in rows]
        idx_slot = stand_in(topk_idx.shape)
        weights_slot = None if weights is None else stand_in(weights.shape)
        block = TensorBlock(stand_in((block_layout.words,)), block_layout,
                            None if copy else {"topk_idx": idx_slot})
        recv_rows = [stand_in(shape) for shape, _ in shapes.rows]
        recv_weights = None if shapes.weights is None else stand_in(shapes.weights[0])
        local_idx = None if shapes.idx is None else stand_in(shapes.idx[0])
        hist = stand_in(self.receive_scratch(num_local, request.stream).shape)
        send = dispatch_kernels.send_phase(
            self.counts_scratch, self.pos_scratch, idx_slot, request.num_experts, weights_slot,
            row_slots, layout, block.arg("dst_buffer_slot_idx"),
            block.arg("topk_idx") if copy else None)
        counts = self.host_counts(num_local) if request.do_cpu_sync else None
        fields = self._receive_arguments(request, layout, block, send, hist, num_rows,
                                         num_expanded, recv_rows, recv_weights, local_idx,
                                         counts)
        exact = None if counts is None else functools.partial(self._exact, host=counts)
        return DispatchPlan(launcher, variant, block_layout, shapes, copy,
                            dict(self._handle_fields(request), num_recv_tokens=num_rows,
                                 num_expanded_tokens=num_expanded),
                            launcher.template(fields, base=block.address.slot), self.device,
                            self.hist, exact)

    # -- combine ---------------------------------------------------------------------------
    def combine(self, request: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        handle = request.handle
        block: TensorBlock = handle.backend_state
        x, weights, biases = request.x, request.topk_weights, request.biases
        variant = combine_kernels.variant(x, weights, biases)
        if self.combine_launcher.kept(variant):
            key = (block.layout, handle.do_expand, weights is None, len(biases), variant)
            plan = self._combine_plans.get(key)
            if plan is None:
                plan = self._prepare_combine(block, handle, x, weights, biases, variant)
                remember(self._combine_plans, key, plan)
            result = plan.run(block, x, weights, biases, request.alloc, request.stream)
        else:
            outputs = [request.alloc.empty(shape, dtype)
                       for shape, dtype in self._combine_outputs(handle, weights)]
            result = outputs[0], outputs[1] if len(outputs) > 1 else None
            self.combine_launcher(variant, request.stream, self._combine_arguments(
                block, block["recv_src_metadata"], handle, x, weights, biases, *result))
        return result

    def _combine_outputs(self, handle: EPHandle, weights) -> list[tuple]:
        """(shape, dtype) of the combined rows and, with weights, the combined weights."""
        outputs = [((handle.num_tokens, self.hidden), torch.bfloat16)]
        if weights is not None:
            outputs.append(((handle.num_tokens, self.num_topk), torch.float32))
        return outputs

    def _combine_arguments(self, block: TensorBlock, metadata, handle: EPHandle, x, weights,
                           biases, out, weights_out) -> dict:
        return combine_kernels.arguments(
            self.combine_stage, self.combine_layout, self.sync,
            block.arg("psum_num_recv_tokens_per_scaleup_rank"), metadata, x, weights,
            handle.do_expand, block.arg("dst_buffer_slot_idx"), biases, out, weights_out,
            self.flags, self.timeout)

    def _prepare_combine(self, block: TensorBlock, handle: EPHandle, x: torch.Tensor,
                         weights: Optional[torch.Tensor], biases, variant) -> CombinePlan:
        """The prepared combine of this call's shape (slot order: `plans.CombinePlan`)."""
        slots = itertools.count()

        def stand_in(shape) -> Address:
            return Address(next(slots), tuple(shape))

        base = TensorBlock(stand_in((block.layout.words,)), block.layout)
        metadata = stand_in(block["recv_src_metadata"].shape)
        x_slot = stand_in(x.shape)
        weights_slot = None if weights is None else stand_in(weights.shape)
        bias_slots = [stand_in(bias.shape) for bias in biases]
        outputs = self._combine_outputs(handle, weights)
        out_slots = [stand_in(shape) for shape, _ in outputs]
        fields = self._combine_arguments(base, metadata, handle, x_slot, weights_slot,
                                         bias_slots, out_slots[0],
                                         out_slots[1] if len(out_slots) > 1 else None)
        return CombinePlan(self.combine_launcher, variant, outputs,
                           self.combine_launcher.template(fields, base=0), self.device)
