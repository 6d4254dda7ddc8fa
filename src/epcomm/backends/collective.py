"""Portable backend over `torch.distributed.all_to_all_single` (gloo on CPU, NCCL on GPU).

Every token row travels as one byte record `[payload | src_token + 1 | expert ids | weights]`,
so one all-to-all moves everything and FP8 needs no dtype support from the collective. The
payload comes first so that its columns stay 8-byte aligned for word-wise gathers.

- `do_cpu_sync=True`: per-rank counts are exchanged and read on the host, then an exact-split
  all-to-all moves only real rows.
- `do_cpu_sync=False`: every destination gets a block of `M` rows (the first 4 bytes of an
  empty row are 0); the receiver counts its rows and compacts them on the device. No value is
  read back to the host, so with NCCL the call is sync-free. gloo cannot move CUDA tensors,
  so on a gloo group CUDA data is staged through host memory (correct, but not sync-free).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .. import errors
from ..handle import EPHandle
from ..layout import (SendLayout, compute_expert_layout, compute_send_layout, expand_capacity,
                      last_slot_per_rank)
from .base import Backend, BufferConfig, CombineRequest, DispatchRequest, DispatchResult

def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """View a 2-D [T, n] tensor as [T, n * itemsize] uint8 (copying only if not contiguous)."""
    tensor = tensor.contiguous()
    if tensor.stride(-1) != 1:
        # A contiguous tensor whose last dimension has size 1 may carry any stride there
        # (FP8 scales of rows up to 128 wide: [T, 1]); a dtype view needs stride 1.
        tensor = tensor.flatten().view(tensor.shape)
    return tensor.view(torch.uint8)


def _gather_records(records: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`records[index]` moved as 8-byte words (a byte-wise gather is far slower on CPU)."""
    return records.view(torch.int64).index_select(0, index).view(torch.uint8)


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


class _RecordCodec:
    """Packs several 2-D [T, n_i] tensors into [T, nbytes] byte records and finds them again."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.fields = []
        offset = 0
        for tensor in tensors:
            nbytes = tensor.shape[1] * tensor.element_size()
            self.fields.append((offset, offset + nbytes, tensor.dtype))
            offset += nbytes
        self.padding = -offset % 8  # whole 8-byte words: rows are gathered as int64
        self.nbytes = offset + self.padding

    def pack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        parts = [_as_bytes(t) for t in tensors]
        if self.padding:
            parts.append(parts[0].new_zeros(parts[0].shape[0], self.padding))
        return torch.cat(parts, dim=1)

    def gather(self, records: torch.Tensor, row_index: torch.Tensor, field: int,
               out: torch.Tensor) -> torch.Tensor:
        """`out[i] = field of records[row_index[i]]`, moved in the widest aligned words."""
        start, end, _ = self.fields[field]
        word = next(w for w in _WORDS if start % w.itemsize == 0 and end % w.itemsize == 0)
        size = word.itemsize
        column = records.view(word)[:, start // size:end // size]
        torch.index_select(column, 0, row_index, out=out.view(torch.uint8).view(word))
        return out

    def column_bytes(self, records: torch.Tensor, index: int) -> torch.Tensor:
        """The strided byte columns of field `index`."""
        start, end, _ = self.fields[index]
        return records[:, start:end]

    def read(self, records: torch.Tensor, index: int) -> torch.Tensor:
        """Field `index` of every record as a new tensor of its dtype."""
        return self.column_bytes(records, index).contiguous().view(self.fields[index][2])


@dataclass
class _CollectiveState:
    """What combine and cached dispatch reuse.

    send: this rank's routing. send_splits / recv_splits: host split sizes (sync mode only).
    compact_row: [R * M] int64, the compact row of each padded receive position (src * M + i),
        `R * M` where nothing arrived (sync-free mode only).
    block_base: [R] int64 on the device, the first send row of each destination's block (sync
        mode only: a cached dispatch and combine need no copy from the host).
    """

    send: SendLayout
    send_splits: Optional[list[int]]
    recv_splits: Optional[list[int]]
    compact_row: Optional[torch.Tensor]
    block_base: Optional[torch.Tensor] = None


class CollectiveBackend(Backend):
    name = "collective"

    def __init__(self, group: dist.ProcessGroup, config: BufferConfig) -> None:
        super().__init__(config)
        self.group = group
        self.timeout = timedelta(seconds=config.timeout_s)
        device = self.device
        self._stage_on_host = device.type == "cuda" and dist.get_backend(group) == "gloo"
        self._flags = torch.zeros((), dtype=torch.int32, device=device)

    def error_flags(self) -> torch.Tensor:
        return self._flags

    # -- transport -------------------------------------------------------------------------
    def _all_to_all(self, stage: str, inp: torch.Tensor, out_rows: int,
                    in_splits: Optional[list[int]] = None,
                    out_splits: Optional[list[int]] = None) -> torch.Tensor:
        """all_to_all_single along dim 0 (equal blocks when the split lists are None)."""
        source = inp.cpu() if self._stage_on_host else inp
        out = torch.empty((out_rows, *inp.shape[1:]), dtype=inp.dtype, device=source.device)
        work = dist.all_to_all_single(out, source, out_splits, in_splits, group=self.group,
                                      async_op=True)
        if source.device.type == "cpu":  # NCCL work is waited on by the stream, not the host
            try:
                work.wait(self.timeout)
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower() and "timeout" not in str(exc).lower():
                    raise
                raise errors.EPTimeoutError(
                    f"rank {self.rank}: {stage} timed out after {self.timeout.total_seconds():.0f}s "
                    f"waiting for its peers ({exc})") from None
        else:
            work.wait()
        return out.to(self.device) if self._stage_on_host else out

    def _exchange_counts(self, send_counts: torch.Tensor) -> tuple[list[int], list[int]]:
        recv_counts = self._all_to_all("dispatch (count exchange)", send_counts, self.num_ranks)
        return send_counts.tolist(), recv_counts.tolist()

    # -- dispatch --------------------------------------------------------------------------
    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        R, me, M, E = self.num_ranks, self.rank, request.num_max_tokens_per_rank, request.num_experts
        num_local = E // R
        topk_idx = request.topk_idx
        num_tokens, num_topk = topk_idx.shape
        sync = request.do_cpu_sync
        cached = request.cached
        if cached is not None:
            state: _CollectiveState = cached.backend_state
            send = state.send
            send_splits, recv_splits = state.send_splits, state.recv_splits
        else:
            send = compute_send_layout(topk_idx, E, R)
            out_of_range = ((topk_idx < -1) | (topk_idx >= E)).any()
            self._flags.bitwise_or_(out_of_range.int() * errors.INVALID_EXPERT_ID)
            send_splits, recv_splits = self._exchange_counts(send.send_counts) if sync else (None, None)

        # One byte record per token; ids outside [0, E) travel as -1.
        expert_ids = torch.where(send.slot_rank >= 0, topk_idx.long(), -1).int()
        src_plus_one = (torch.arange(num_tokens, device=self.device, dtype=torch.int32)
                        + (me * M + 1)).view(-1, 1)
        fields = [*request.rows, src_plus_one, expert_ids]
        if request.topk_weights is not None:
            fields.append(request.topk_weights.float())
        meta = len(request.rows)  # field index of src_token + 1 (0: an empty row)
        codec = _RecordCodec(fields)
        records = codec.pack(fields)

        # Gather records into per-destination blocks: one pass, no per-destination scatter.
        if sync:
            block_base = state.block_base if cached is not None else \
                torch.tensor([0] + send_splits[:-1], device=self.device).cumsum(0)
            send_rows = sum(send_splits)
        else:
            block_base = torch.arange(R, device=self.device) * M
            send_rows = R * M
        slot_token = torch.full((send_rows + 1,), -1, dtype=torch.long, device=self.device)
        destination = torch.where(send.send_pos >= 0, block_base + send.send_pos, send_rows)
        slot_token.scatter_(0, destination.flatten(),
                            torch.arange(num_tokens, device=self.device).repeat_interleave(R))
        slot_token = slot_token[:send_rows]  # the entry past the end swallowed unsent pairs
        if num_tokens:
            send_buf = _gather_records(records, slot_token.clamp(min=0))
            if not sync:  # empty rows of a block: source index 0 marks them
                codec.column_bytes(send_buf, meta).masked_fill_((slot_token < 0)[:, None], 0)
        else:
            send_buf = records.new_zeros(send_rows, codec.nbytes)

        if sync:
            compact = self._all_to_all("dispatch", send_buf, sum(recv_splits), send_splits,
                                       recv_splits)
            # (a cached dispatch returns its handle: no counts needed)
            recv_counts = None if cached is not None else \
                torch.tensor(recv_splits, device=self.device)
            compact_row = None
        else:
            padded = self._all_to_all("dispatch", send_buf, R * M)
            present = codec.read(padded, meta).view(R, M) > 0
            recv_counts = present.long().sum(1)
            first_row = recv_counts.cumsum(0) - recv_counts
            within = torch.arange(M, device=self.device).expand(R, M)
            compact_row = torch.where(present, first_row[:, None] + within, R * M).flatten()
            padded_of_row = torch.full((R * M + 1,), R * M, dtype=torch.long, device=self.device)
            padded_of_row.scatter_(0, compact_row, torch.arange(R * M, device=self.device))
            padded_of_row = padded_of_row[: R * M]
            compact = _gather_records(padded, padded_of_row.clamp(max=R * M - 1))
            codec.column_bytes(compact, meta).masked_fill_((padded_of_row == R * M)[:, None], 0)
        return self._finish_dispatch(request, codec, compact, recv_counts, num_local,
                                     _CollectiveState(send, send_splits, recv_splits, compact_row,
                                                      block_base if sync else None))

    def _finish_dispatch(self, request: DispatchRequest, codec: _RecordCodec,
                         compact: torch.Tensor, recv_counts: Optional[torch.Tensor],
                         num_local: int,
                         state: _CollectiveState) -> DispatchResult:
        """Decode compact records into the outputs and the handle."""
        R, me, M = self.num_ranks, self.rank, request.num_max_tokens_per_rank
        sync, alloc = request.do_cpu_sync, request.alloc
        num_rows, num_topk = compact.shape[0], request.topk_idx.shape[1]
        meta = len(request.rows)
        src_token = codec.read(compact, meta).view(-1) - 1
        row_valid = src_token >= 0
        expert_ids = codec.read(compact, meta + 1).long()
        local_idx = torch.where(row_valid[:, None] & (expert_ids >= 0)
                                & (expert_ids.div(num_local, rounding_mode="floor") == me),
                                expert_ids - me * num_local, -1)
        capacity = None if sync else expand_capacity(R, M, num_topk, num_local,
                                                     request.expert_alignment)
        experts = compute_expert_layout(local_idx, num_local, request.expert_alignment, capacity)
        self._flags.bitwise_or_(experts.overflow.int() * errors.EXPAND_OVERFLOW)
        last_slot = last_slot_per_rank(torch.where(local_idx >= 0, me, -1), me)
        metadata = torch.cat([src_token.view(-1, 1).long(), last_slot.view(-1, 1),
                              experts.expand_rows], dim=1).int()

        counts_list = None
        cached = request.cached
        if cached is not None:  # its sizes: a cached dispatch reads nothing back
            counts_list, num_expanded = cached.num_recv_tokens_per_expert_list, \
                cached.num_expanded_tokens
        elif sync:
            aligned = experts.psum_aligned - experts.starts
            counts_list = aligned.tolist()
            num_expanded = sum(counts_list) if request.do_expand else 0
        else:
            num_expanded = capacity if request.do_expand else 0

        weight_index = meta + 2 if request.topk_weights is not None else None
        recv_rows, recv_topk_idx, recv_weights = [], None, None
        if request.do_expand:
            pair_of_row = torch.full((num_expanded + 1,), -1, dtype=torch.long, device=self.device)
            flat_rows = experts.expand_rows.flatten()
            pair_of_row.scatter_(0, torch.where(flat_rows >= 0, flat_rows, num_expanded),
                                 torch.arange(flat_rows.numel(), device=self.device))
            pair_of_row = pair_of_row[:num_expanded]
            source_row = pair_of_row.div(num_topk, rounding_mode="floor")
            gap = (source_row < 0)[:, None]
            for index, tensor in enumerate(request.rows):
                out = alloc.empty((num_expanded, *tensor.shape[1:]), tensor.dtype)
                codec.gather(compact, source_row.clamp(min=0), index, out)
                if request.do_zero_padding:  # on the bytes: FP8 has no masked_fill
                    out.view(torch.uint8).masked_fill_(gap, 0)
                recv_rows.append(out)
            if weight_index is not None:
                weights = codec.read(compact, weight_index).flatten()
                recv_weights = alloc.empty((num_expanded,), torch.float32).copy_(
                    torch.where(pair_of_row >= 0, weights[pair_of_row.clamp(min=0)], 0.0))
        else:
            for index, tensor in enumerate(request.rows):
                out = alloc.empty((num_rows, *tensor.shape[1:]), tensor.dtype)
                out.view(torch.uint8).copy_(codec.column_bytes(compact, index))
                if request.do_zero_padding and not sync:
                    out.view(torch.uint8).masked_fill_(~row_valid[:, None], 0)
                recv_rows.append(out)
            recv_topk_idx = alloc.empty((num_rows, num_topk), request.topk_idx.dtype)
            recv_topk_idx.copy_(local_idx)
            if weight_index is not None:
                recv_weights = alloc.empty((num_rows, num_topk), torch.float32).copy_(
                    torch.where(row_valid[:, None], codec.read(compact, weight_index), 0.0))

        if cached is not None:
            return DispatchResult(recv_rows, recv_topk_idx, recv_weights, cached)
        if request.do_expand:
            psum_expert = experts.starts + experts.counts
        else:
            psum_expert = experts.psum_aligned
        # The record of each slot's destination: its block of M rows, then the position.
        send = state.send
        destination = send.slot_rank.clamp(min=0)
        dst_slot = torch.where(send.slot_rank >= 0,
                               destination * M + send.send_pos.gather(1, destination), -1)
        handle = EPHandle(
            tensors=dict(
                psum_num_recv_tokens_per_scaleup_rank=recv_counts.cumsum(0).int(),
                psum_num_recv_tokens_per_expert=psum_expert.int(),
                num_unaligned_recv_tokens_per_expert=experts.counts.int(),
                recv_src_metadata=alloc.empty(tuple(metadata.shape), torch.int32).copy_(metadata),
                topk_idx=request.topk_idx.clone() if request.copy_topk_idx else request.topk_idx,
                dst_buffer_slot_idx=dst_slot.int()),
            num_recv_tokens_per_expert_list=counts_list,
            num_experts=request.num_experts,
            expert_alignment=request.expert_alignment,
            num_max_tokens_per_rank=M,
            do_expand=request.do_expand,
            do_cpu_sync=sync,
            num_recv_tokens=num_rows,
            num_expanded_tokens=num_expanded,
            buffer_id=self.config.buffer_id,
            num_tokens=request.topk_idx.shape[0],
            hidden=self.config.hidden,
            backend_state=state,
            num_sms=self.config.num_sms or 0,
        )
        return DispatchResult(recv_rows, recv_topk_idx, recv_weights, handle)

    # -- combine ---------------------------------------------------------------------------
    def combine(self, request: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        handle = request.handle
        state: _CollectiveState = handle.backend_state
        R, M = self.num_ranks, handle.num_max_tokens_per_rank
        num_rows = handle.num_recv_tokens
        num_tokens, num_topk = handle.tensors["topk_idx"].shape
        expand_rows = handle.tensors["recv_src_metadata"][:, 2:].long()
        x, weights = request.x, request.topk_weights

        if handle.do_expand:
            # Reduce each token's expert rows in slot order, in fp32, one bf16 rounding.
            acc = torch.zeros(num_rows, x.shape[1], dtype=torch.float32, device=self.device)
            for slot in range(num_topk):
                rows = expand_rows[:, slot]
                # acc is never -0.0 (it starts at +0.0): adding +0.0 leaves it unchanged.
                acc.add_(x[rows.clamp(min=0)].float().masked_fill_((rows < 0)[:, None], 0.0))
            reduced = acc.to(torch.bfloat16)
            if weights is not None:
                weights = torch.where(expand_rows >= 0, weights[expand_rows.clamp(min=0)], 0.0)
        else:
            reduced = x
        fields = [reduced] if weights is None else [reduced, weights.float()]
        codec = _RecordCodec(fields)
        records = codec.pack(fields)

        send = state.send
        if handle.do_cpu_sync:
            returned = self._all_to_all("combine", records, sum(state.send_splits),
                                        state.recv_splits, state.send_splits)
            if returned.shape[0] == 0:  # nothing was sent: keep one row for the masked gathers
                returned = records.new_zeros(1, codec.nbytes)
            block_base = state.block_base
        else:
            # Rows where nothing arrived carry any record: their source never reads them.
            back = _gather_records(records, state.compact_row.clamp(max=R * M - 1))
            returned = self._all_to_all("combine", back, R * M)
            block_base = torch.arange(R, device=self.device) * M

        # Sum the returned rows on the source in the order of each rank's last slot.
        acc = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=self.device)
        for bias in request.biases:
            acc = acc + bias.float()
        slot_rows = []
        for slot in range(num_topk):
            owner = send.slot_rank[:, slot].clamp(min=0)
            row = (block_base[owner] + send.send_pos.gather(1, owner[:, None]).view(-1)).clamp(min=0)
            slot_rows.append(row)
            part = codec.gather(returned, row, 0, x.new_empty(num_tokens, x.shape[1]))
            # acc starts at +0.0 and so is never -0.0: adding +0.0 leaves it bitwise unchanged.
            acc.add_(part.float().masked_fill_(~send.is_last_slot[:, slot, None], 0.0))
        combined_x = request.alloc.empty((num_tokens, x.shape[1]), torch.bfloat16)
        combined_x.copy_(acc)

        combined_weights = None
        if weights is not None:
            returned_weights = codec.read(returned, 1)
            gathered = torch.stack([returned_weights[row, slot] for slot, row in enumerate(slot_rows)],
                                   dim=1)
            combined_weights = request.alloc.empty((num_tokens, num_topk), torch.float32).copy_(
                torch.where(send.slot_rank >= 0, gathered, 0.0))
        return combined_x, combined_weights
