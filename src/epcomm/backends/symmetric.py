"""The fast intranode backend: Triton kernels store straight into peers' memory.

Every rank owns one symmetric heap (`epcomm.symm_heap`), mapped by all ranks:

    [flags: dispatch_ready[R] | dispatch_free[R] | combine_ready[R] | combine_free[R]] (int64)
    [dispatch staging: R blocks x S records (`kernels.dispatch.RecordLayout`)]
    [combine staging:  R blocks x S records (`kernels.combine.CombineLayout`)]

S = the buffer's `num_max_tokens_per_rank`. Block s of a staging region is written only by rank
s, so no two ranks ever write the same bytes.

Protocol of one call of a stage (dispatch or combine), epoch n counted on the device:
1. `wait(free, lag=1, bump)`: epoch n-1 -> n, then wait until every peer has copied out what this
   rank pushed at epoch n-1 (its `free` flag in this heap reached n-1): a rank never overwrites
   a peer's staging block before the peer has read it.
2. `push`: records go into the peers' staging blocks of this rank.
3. `signal(ready)`: release-store `n << 32 | count` into every peer's `ready[rank]`.
4. `wait(ready)`: acquire until every `ready` flag of this heap carries epoch n (their counts
   come with them, so no count exchange precedes the push).
5. Copy epilogue (dispatch: compact/expand; combine: reduce) into ordinary output tensors.
6. `signal(free)`: store n into every peer's `free[rank]`.

A wait that runs past the buffer's timeout sets the stage's timeout bit of `errors` in the device error flag and
returns; a synchronizing call raises `EPTimeoutError` naming the rank and stage at once, a
sync-free one leaves it for `Buffer.check_errors()`.

Results are bitwise those of the collective backend (docs/semantics.md); layout math runs
through the sync-free torch functions of `epcomm.layout`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .. import errors
from ..handle import EPHandle
from ..kernels import INTERPRET
from ..kernels import combine as combine_kernels
from ..kernels import dispatch as dispatch_kernels
from ..kernels.sync import signal, wait
from ..layout import (SendLayout, compute_expert_layout, compute_send_layout, expand_capacity,
                      last_slot_per_rank)
from ..symm_heap import SymmetricHeap, heap_reachable
from .base import Backend, CombineRequest, DispatchRequest, DispatchResult

FP8_BLOCK = 128
_DISPATCH, _COMBINE = 0, 1


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


@dataclass
class _SymmetricState:
    """What combine and cached dispatch reuse. T tokens, K slots, rows compact output rows.

    send: this rank's routing. expert_ids: [T, K] int32, -1 for invalid slots.
    slot_stage: [T, K] int64, combine record (owner * S + position) of each valid slot, else -1.
    last_stage: slot_stage where the slot is the last one of its rank, else -1.
    stage_rows: [rows] int32, dispatch record of each received compact row (-1 past the prefix).
    """

    send: SendLayout
    expert_ids: torch.Tensor
    slot_stage: torch.Tensor
    last_stage: torch.Tensor
    stage_rows: torch.Tensor


class SymmetricBackend(Backend):
    name = "symmetric"

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
        self.num_sms = getattr(buffer, "num_sms", None) or self._default_num_sms()

        R, S, H, K = self.num_ranks, self.stride_tokens, self.hidden, self.num_topk
        scales = (H + FP8_BLOCK - 1) // FP8_BLOCK
        record_words = max(dispatch_kernels.RecordLayout(K, (H // 2,)).words,
                           dispatch_kernels.RecordLayout(K, (H // 4, scales)).words)
        self.combine_layout = combine_kernels.CombineLayout(H, K)
        flags = 8 * R
        self.ready = {_DISPATCH: 0, _COMBINE: 2 * flags}
        self.free = {_DISPATCH: flags, _COMBINE: 3 * flags}
        self.dispatch_region = (4 * flags + 255) // 256 * 256
        self.combine_region = self.dispatch_region + R * S * record_words * 4
        nbytes = self.combine_region + R * S * self.combine_layout.words * 4
        self.heap = SymmetricHeap(self.group, nbytes, self.device)
        self.bases = self.heap.bases
        self._epochs = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._flags = torch.zeros((), dtype=torch.int32, device=self.device)
        if self.device.type == "cuda":
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile and load every kernel variant now, before any waiting kernel of this process
        can be in flight: a module load while one of our kernels spins can deadlock
        (gpu-facts). Every launch works on local scratch and does nothing else: no rows, and
        flags of a scratch "heap" that the signals below have already raised."""
        R, K, H = self.num_ranks, self.num_topk, self.hidden
        dev, i32, i64 = self.device, torch.int32, torch.int64
        scratch = torch.zeros(4 * R, dtype=i64, device=dev)
        bases = torch.full((R,), scratch.data_ptr(), dtype=i64, device=dev)
        epoch, counts = torch.zeros(1, dtype=i64, device=dev), torch.zeros(R, dtype=i64, device=dev)
        error = torch.zeros((), dtype=i32, device=dev)
        wait(bases, 0, 0, epoch, error, self.timeout_s, lag=1, bump=True)
        for slot in range(R):  # every "peer" is the scratch: raise all R flags there
            signal(bases, 0, slot, epoch)
        signal(bases, 0, 0, epoch, counts)
        wait(bases, 0, 0, epoch, error, self.timeout_s)
        wait(bases, 0, 0, epoch, error, self.timeout_s, counts=counts)

        none = torch.empty(0, dtype=i32, device=dev)
        rows = [torch.empty(0, H, dtype=torch.bfloat16, device=dev)]
        layout = dispatch_kernels.RecordLayout(K, dispatch_kernels.payload_words(rows))
        dispatch_kernels.push(bases, 0, 0, 1, torch.empty(0, R, dtype=i64, device=dev),
                              torch.empty(0, K, dtype=i32, device=dev), None, rows, layout, 1)
        metadata = torch.empty(0, K + 2, dtype=i32, device=dev)
        for idx_dtype in (i32, i64):
            dispatch_kernels.compact(bases, 0, 0, 1, 1, 1, counts, layout,
                                     torch.empty(0, K, dtype=idx_dtype, device=dev), None, none,
                                     none, rows, 1)
        dispatch_kernels.expand(bases, 0, 0, counts, layout, none, metadata, None, rows, 1)
        psum = torch.zeros(R, dtype=i32, device=dev)
        for expand in (False, True):
            combine_kernels.push(bases, 0, 0, 1, psum, none, metadata, rows[0], None,
                                 self.combine_layout, expand, 1)
        combine_kernels.reduce(bases, 0, 0, torch.empty(0, K, dtype=i64, device=dev),
                               torch.empty(0, K, dtype=i64, device=dev), (), rows[0], None,
                               self.combine_layout, 1)
        torch.cuda.synchronize(dev)
        if error.item():
            raise RuntimeError("the symmetric backend's warm-up flags did not arrive")

    def _default_num_sms(self) -> int:
        """Programs of the data-moving kernels: every SM (they are bandwidth-bound), at most one
        per staging record; 2 on the CPU (the interpreter runs programs one after another)."""
        if self.device.type != "cuda":
            return 2
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return min(sms, self.num_ranks * self.stride_tokens)

    def error_flags(self) -> torch.Tensor:
        return self._flags

    def destroy(self) -> None:
        self.heap.destroy()

    # -- the flag protocol -----------------------------------------------------------------
    def _epoch(self, stage: int) -> torch.Tensor:
        return self._epochs[stage:stage + 1]

    def _wait(self, stage: int, ready: bool, counts: Optional[torch.Tensor] = None) -> None:
        offset = self.ready[stage] if ready else self.free[stage]
        wait(self.bases, self.rank, offset, self._epoch(stage), self._flags, self.timeout_s,
             lag=0 if ready else 1, bump=not ready, counts=counts,
             error_bit=errors.DISPATCH_TIMEOUT if stage == _DISPATCH else errors.COMBINE_TIMEOUT)

    def _signal(self, stage: int, ready: bool, counts: Optional[torch.Tensor] = None) -> None:
        offset = self.ready[stage] if ready else self.free[stage]
        signal(self.bases, offset, self.rank, self._epoch(stage), counts)

    def _raise_on_timeout(self, flags: int, stage: str) -> None:
        if flags & errors.WAIT_TIMEOUT:
            self._flags.bitwise_and_(~errors.WAIT_TIMEOUT)
            raise errors.EPTimeoutError(
                f"rank {self.rank}: {stage}: a peer did not arrive within {self.timeout_s} s")

    # -- dispatch --------------------------------------------------------------------------
    def _route(self, request: DispatchRequest) -> _SymmetricState:
        R, S, E = self.num_ranks, self.stride_tokens, request.num_experts
        topk_idx = request.topk_idx
        send = compute_send_layout(topk_idx, E, R)
        out_of_range = ((topk_idx < -1) | (topk_idx >= E)).any()
        self._flags.bitwise_or_(out_of_range.int() * errors.INVALID_EXPERT_ID)
        valid = send.slot_rank >= 0
        owner = send.slot_rank.clamp(min=0)
        slot_stage = torch.where(valid, owner * S + send.send_pos.gather(1, owner), -1)
        return _SymmetricState(send=send,
                               expert_ids=torch.where(valid, topk_idx.long(), -1).int(),
                               slot_stage=slot_stage,
                               last_stage=torch.where(send.is_last_slot, slot_stage, -1),
                               stage_rows=slot_stage.new_empty(0))

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        R, me, M = self.num_ranks, self.rank, request.num_max_tokens_per_rank
        K, E = self.num_topk, request.num_experts
        num_local = E // R
        sync, alloc, cached = request.do_cpu_sync, request.alloc, request.cached
        state = self._route(request) if cached is None else cached.backend_state
        layout = dispatch_kernels.RecordLayout(K, dispatch_kernels.payload_words(request.rows))

        self._wait(_DISPATCH, ready=False)
        dispatch_kernels.push(self.bases, self.dispatch_region, me, self.stride_tokens,
                              state.send.send_pos, state.expert_ids, request.topk_weights,
                              request.rows, layout, self.num_sms)
        self._signal(_DISPATCH, ready=True, counts=state.send.send_counts)
        counts = torch.empty(R, dtype=torch.int64, device=self.device)
        self._wait(_DISPATCH, ready=True, counts=counts)

        if cached is not None:
            num_rows = cached.num_recv_tokens
        elif sync:
            host = torch.cat([counts, self._flags.view(1).long()]).tolist()
            self._raise_on_timeout(host[-1], "dispatch")
            num_rows = sum(host[:R])
        else:
            num_rows = R * M

        # Copy the staging region out: compact rows (with payload in compact mode) first.
        expand = request.do_expand
        tail = not sync  # capacity-sized outputs: rows past the prefix get -1 / 0
        idx_dtype = request.topk_idx.dtype
        local_idx = torch.empty((num_rows, K), dtype=idx_dtype, device=self.device) if expand \
            else alloc.empty((num_rows, K), idx_dtype)  # the expand layout only needs it here
        src = torch.empty(num_rows, dtype=torch.int32, device=self.device)
        stage_rows = torch.empty(num_rows, dtype=torch.int32, device=self.device)
        if tail:
            for tensor in (local_idx, src, stage_rows):
                tensor.fill_(-1)
        recv_rows, recv_weights = None, None
        if not expand:
            zero = tail and request.do_zero_padding
            recv_rows = [(alloc.zeros if zero else alloc.empty)((num_rows, *row.shape[1:]),
                                                                row.dtype)
                         for row in request.rows]
            if request.topk_weights is not None:
                recv_weights = (alloc.zeros if tail else alloc.empty)((num_rows, K), torch.float32)
        dispatch_kernels.compact(self.bases, self.dispatch_region, me, self.stride_tokens, M,
                                 num_local, counts, layout, local_idx, recv_weights, src,
                                 stage_rows, recv_rows, self.num_sms)

        if cached is None:
            align = request.expert_alignment
            capacity = None if sync else expand_capacity(R, M, K, num_local, align)
            experts = compute_expert_layout(local_idx, num_local, align, capacity)
            self._flags.bitwise_or_(experts.overflow.int() * errors.EXPAND_OVERFLOW)
            last_slot = last_slot_per_rank(torch.where(local_idx >= 0, me, -1), me)
            metadata = alloc.empty((num_rows, K + 2), torch.int32)
            metadata.copy_(torch.cat([src.view(-1, 1).long(), last_slot.view(-1, 1),
                                      experts.expand_rows], dim=1))
            counts_list = None
            if sync:
                counts_list = (experts.psum_aligned - experts.starts).tolist()
                num_expanded = sum(counts_list) if expand else 0
            else:
                num_expanded = capacity if expand else 0
        else:
            metadata, num_expanded = cached.recv_src_metadata, cached.num_expanded_tokens

        if expand:
            zero = request.do_zero_padding
            recv_rows = [(alloc.zeros if zero else alloc.empty)((num_expanded, *row.shape[1:]),
                                                                row.dtype)
                         for row in request.rows]
            if request.topk_weights is not None:
                recv_weights = alloc.zeros((num_expanded,), torch.float32)
            dispatch_kernels.expand(self.bases, self.dispatch_region, me, counts, layout,
                                    stage_rows, metadata, recv_weights, recv_rows, self.num_sms)
        self._signal(_DISPATCH, ready=False)

        if cached is not None:
            return DispatchResult(recv_rows, None if expand else local_idx, recv_weights, cached)
        state.stage_rows = stage_rows
        handle = EPHandle(
            psum_num_recv_tokens_per_scaleup_rank=counts.cumsum(0).int(),
            psum_num_recv_tokens_per_expert=(experts.starts + experts.counts if expand
                                             else experts.psum_aligned).int(),
            num_unaligned_recv_tokens_per_expert=experts.counts.int(),
            num_recv_tokens_per_expert_list=counts_list,
            recv_src_metadata=metadata,
            topk_idx=request.topk_idx,
            num_experts=E,
            expert_alignment=request.expert_alignment,
            num_max_tokens_per_rank=M,
            do_expand=expand,
            do_cpu_sync=sync,
            num_recv_tokens=num_rows,
            num_expanded_tokens=num_expanded,
            backend_state=state,
        )
        return DispatchResult(recv_rows, None if expand else local_idx, recv_weights, handle)

    # -- combine ---------------------------------------------------------------------------
    def combine(self, request: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        handle = request.handle
        state: _SymmetricState = handle.backend_state
        num_tokens = handle.topk_idx.shape[0]
        self._wait(_COMBINE, ready=False)
        combine_kernels.push(self.bases, self.combine_region, self.rank, self.stride_tokens,
                             handle.psum_num_recv_tokens_per_scaleup_rank, state.stage_rows,
                             handle.recv_src_metadata, request.x, request.topk_weights,
                             self.combine_layout, handle.do_expand, self.num_sms)
        self._signal(_COMBINE, ready=True)
        self._wait(_COMBINE, ready=True)
        combined_x = request.alloc.empty((num_tokens, self.hidden), torch.bfloat16)
        combined_weights = None
        if request.topk_weights is not None:
            combined_weights = request.alloc.empty((num_tokens, self.num_topk), torch.float32)
        combine_kernels.reduce(self.bases, self.combine_region, self.rank, state.last_stage,
                               state.slot_stage, request.biases, combined_x, combined_weights,
                               self.combine_layout, self.num_sms)
        self._signal(_COMBINE, ready=False)
        if handle.do_cpu_sync:
            self._raise_on_timeout(int(self._flags.item()), "combine")
        return combined_x, combined_weights
