"""The collective backend's device path: dispatch and combine through the kernels of
`epcomm.kernels.collective`, around the same all-to-all and wire format as its torch path.

A dispatch is five launches and the all-to-all (count, pack, all-to-all, unpack, expert
prefix, expand), a combine two and the all-to-all (pack, all-to-all, reduce); the torch path
issues 70-190 operations per call. Sync-free calls read nothing back (capturable in a CUDA
graph over NCCL); a synchronizing first call reads the count exchange and the per-expert counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ..handle import EPHandle
from ..kernels import INTERPRET
from ..kernels import collective as kernels
from ..kernels.launcher import Launcher, next_power_of_2
from ..layout import expand_capacity
from .base import CombineRequest, DispatchRequest, DispatchResult

if TYPE_CHECKING:
    from .collective import CollectiveBackend, _Record

# Tiles (registers from `ptxas -v` for sm_90a, Triton 3.9, K = 8, R = 8, no spills): dispatch
# kernels 16 rows x 512 words at 8 warps (pack 210, unpack 128, expand 125 registers);
# combine kernels 8 rows x 1024 bf16 at 16 warps (84 and 83; 16 rows spill at 8 or 16 warps).
ROWS = 16
GROUP = 4          # rows per step of the expand ranking ([4, 8, 4, 8] pair comparisons)
BLOCK_W = 512
NUM_WARPS = 8
COMBINE_ROWS = 8
BLOCK_H = 1024
COMBINE_WARPS = 16
_ROWS_PER_PROGRAM = 32  # programs: one per 32 rows of the largest side, up to 2 per SM


@dataclass
class KernelState:
    """What combine and a cached dispatch reuse. pos: [T, R] int32, each token's row among
    those sent to each rank (-1: not sent); send_counts: [R] int32 device; splits (exact
    blocks, synchronizing calls; None for padded blocks): records sent to / received from each
    rank, host lists."""

    pos: torch.Tensor
    send_counts: torch.Tensor
    send_splits: Optional[list[int]]
    recv_splits: Optional[list[int]]


def _vec(*words: int) -> int:
    """The widest vector (4, 2 or 1 int32 words) that divides every size and offset."""
    return next(v for v in (4, 2, 1) if all(w % v == 0 for w in words))


class KernelPath:
    """Launches the collective kernels for `backend` (its transport, header and flags)."""

    def __init__(self, backend: "CollectiveBackend") -> None:
        self.backend = backend
        config = backend.config
        if INTERPRET or config.device.type != "cuda":
            self.programs = 2  # the interpreter runs programs one by one
        else:
            sms = torch.cuda.get_device_properties(config.device).multi_processor_count
            rows = config.num_ranks * config.num_max_tokens_per_rank
            self.programs = max(1, min(-(-rows // _ROWS_PER_PROGRAM), 2 * sms))
        self.launchers: dict = {}

    def _launch(self, fn, variant, fields: dict, **constants) -> None:
        constants.setdefault("num_warps", NUM_WARPS)
        key = (fn.__name__, *constants.values())
        launcher = self.launchers.get(key)
        if launcher is None:
            launcher = self.launchers[key] = Launcher(fn, self.programs, constants)
        launcher(variant, None, fields)

    # -- dispatch --------------------------------------------------------------------------
    def dispatch(self, request: DispatchRequest, record: "_Record",
                 header: torch.Tensor) -> DispatchResult:
        b = self.backend
        R, me, M, E = b.num_ranks, b.rank, request.num_max_tokens_per_rank, request.num_experts
        topk_idx, weights = request.topk_idx, request.topk_weights
        T, K = topk_idx.shape
        num_local = E // R
        sync, cached, alloc = request.do_cpu_sync, request.cached, request.alloc
        device = b.device
        P = self.programs
        block_r = next_power_of_2(R)
        has_w = weights is not None
        w_in = weights if has_w else torch.empty(1, dtype=torch.float32, device=device)
        payload = [row.shape[1] * row.element_size() // 4 if row.dim() > 1 else 1
                   for row in request.rows]
        w0, w1 = payload[0], payload[1] if len(payload) > 1 else 0
        off1 = record.payload[1][0] // 4 if len(payload) > 1 else 0
        meta_off = record.meta // 4
        vec = _vec(w0, w1, off1)
        common = dict(K=K, BLOCK_K=next_power_of_2(K), BLOCK_R=block_r)
        idx_variant = (topk_idx.dtype, vec)

        counts = b._workspace.tensor("counts", (P, block_r), torch.int32)
        self._launch(kernels.count_kernel, idx_variant, dict(
            idx_ptr=topk_idx, num_tokens=T, num_experts=E, num_ranks=R, counts_ptr=counts,
            flags_ptr=b._flags), ROWS=ROWS, **common)

        exchange = b._dispatch_exchange(request)
        bump = 1
        if exchange:
            rows = b._header_rows(header, counts.sum(0, dtype=torch.int64)[:R])
            table = b._exchange_headers(exchange, rows)
            bump = 0
        if not sync:
            send_splits = recv_splits = None
        elif cached is not None:
            send_splits, recv_splits = cached.backend_state.send_splits, \
                cached.backend_state.recv_splits
        else:
            send_splits = [int(n) for n in rows[:, -1].tolist()]
            recv_splits = [int(source[-1]) for source in table]

        send_rows = sum(send_splits) + R if sync else R * (M + 1)
        send_buf = b._workspace.rows("send", send_rows, record.nbytes)
        pos = torch.empty(T, R, dtype=torch.int32, device=device)
        slot = torch.empty(T, K, dtype=torch.int32, device=device)
        send_counts = torch.empty(R, dtype=torch.int32, device=device)
        idx_copy = alloc.empty((T, K), topk_idx.dtype) if request.copy_topk_idx else topk_idx
        p0 = request.rows[0]
        p1 = request.rows[1] if len(request.rows) > 1 else p0
        self._launch(kernels.pack_kernel, idx_variant, dict(
            idx_ptr=topk_idx, weights_ptr=w_in, has_w=int(has_w), num_tokens=T, num_experts=E,
            num_ranks=R, rank=me, max_tokens=M, counts_ptr=counts, send_addr=send_buf.data_ptr(),
            record_words=record.nbytes // 4, p0_addr=p0.data_ptr(), w0=w0,
            p1_addr=p1.data_ptr(), w1=w1, off1=off1, meta_off=meta_off, pos_ptr=pos,
            slot_ptr=slot, send_counts_ptr=send_counts, idx_copy=idx_copy,
            copy_idx=int(request.copy_topk_idx), fields_ptr=header, seq_ptr=b._seq, bump=bump,
            exact=int(sync)), BLOCK_P=max(2, next_power_of_2(P)),
            BLOCK_F=kernels.BLOCK_F, ROWS=ROWS, VEC=vec,
            BLOCK_W=BLOCK_W, **common)

        recv_rows = sum(recv_splits) + R if sync else R * (M + 1)
        recv_buf = b._workspace.rows("receive", recv_rows, record.nbytes)
        b._all_to_all("dispatch", recv_buf, send_buf,
                      [n + 1 for n in recv_splits] if sync else None,
                      [n + 1 for n in send_splits] if sync else None)

        num_rows = sum(recv_splits) if sync else R * M
        exact_counts = torch.tensor(recv_splits, dtype=torch.int32, device=device) if sync \
            else send_counts  # (padded blocks: the kernels read the headers instead)
        metadata = alloc.empty((num_rows, K + 2), torch.int32)
        rank_psum = alloc.empty((R,), torch.int32)
        expert_counts = alloc.empty((num_local,), torch.int32)
        expert_psum = alloc.empty((num_local,), torch.int32)
        hist = b._workspace.tensor("hist", (P, max(num_local, 1)), torch.int32)
        expand = request.do_expand
        recv_topk_idx = recv_weights = None
        if expand:
            outputs = []
        else:
            outputs = [alloc.empty((num_rows, *row.shape[1:]), row.dtype) for row in request.rows]
            recv_topk_idx = alloc.empty((num_rows, K), topk_idx.dtype)
            if has_w:
                recv_weights = alloc.empty((num_rows, K), torch.float32)
        o0 = outputs[0] if outputs else p0
        o1 = outputs[1] if len(outputs) > 1 else o0
        layout = dict(recv_addr=recv_buf.data_ptr(), record_words=record.nbytes // 4,
                      num_ranks=R, max_tokens=M, exact=int(sync), num_rows=num_rows,
                      num_local=num_local, w0=w0, w1=w1, off1=off1, meta_off=meta_off,
                      expand=int(expand), zero_padding=int(request.do_zero_padding),
                      has_w=int(has_w), meta_out=metadata, flags_ptr=b._flags)
        block_e = next_power_of_2(max(num_local, 1))
        self._launch(kernels.unpack_kernel, idx_variant, dict(
            layout, rank=me, counts_ptr=exact_counts, rank_psum_out=rank_psum,
            p0_out=o0.data_ptr(), p1_out=o1.data_ptr(),
            idx_out=recv_topk_idx if recv_topk_idx is not None else topk_idx,
            w_out=recv_weights if recv_weights is not None else w_in, hist_ptr=hist,
            check=int(not exchange), fields_ptr=header, seq_ptr=b._seq),
            BLOCK_M=next_power_of_2(K + 2), BLOCK_E=min(block_e, 1024),
            BLOCK_F=kernels.BLOCK_F, ROWS=ROWS, VEC=vec,
            BLOCK_W=BLOCK_W, **common)
        self._launch(kernels.expert_prefix_kernel, None, dict(
            hist_ptr=hist, num_local=num_local, expert_counts_out=expert_counts),
            BLOCK_P=max(2, next_power_of_2(P)))

        counts_list = None
        if cached is not None:
            capacity = cached.num_expanded_tokens if expand else 0
            counts_list = cached.num_recv_tokens_per_expert_list
        elif sync:
            alignment = request.expert_alignment
            counts_list = [-(-n // alignment) * alignment for n in expert_counts.tolist()]
            capacity = sum(counts_list) if expand else 0
        else:
            capacity = expand_capacity(R, M, K, num_local, request.expert_alignment) \
                if expand else 0
        bound = capacity if expand else num_rows * K + request.expert_alignment * num_local
        if expand:
            outputs = [alloc.empty((capacity, *row.shape[1:]), row.dtype) for row in request.rows]
            if has_w:
                recv_weights = alloc.empty((capacity,), torch.float32)
            o0 = outputs[0]
            o1 = outputs[1] if len(outputs) > 1 else o0
        self._launch(kernels.expand_kernel, vec, dict(
            layout, rank_psum=rank_psum, alignment=request.expert_alignment, capacity=bound,
            expert_counts=expert_counts, expert_psum_out=expert_psum, p0_out=o0.data_ptr(),
            p1_out=o1.data_ptr(), w_out=recv_weights if recv_weights is not None else w_in,
            hist_ptr=hist), BLOCK_E=block_e, GROUP=GROUP, ROWS=ROWS, VEC=vec,
            BLOCK_W=BLOCK_W, K=K, BLOCK_K=next_power_of_2(K), BLOCK_R=block_r)

        if cached is not None:
            return DispatchResult(outputs, recv_topk_idx, recv_weights, cached)
        handle = EPHandle(
            tensors=dict(
                psum_num_recv_tokens_per_scaleup_rank=rank_psum,
                psum_num_recv_tokens_per_expert=expert_psum,
                num_unaligned_recv_tokens_per_expert=expert_counts,
                recv_src_metadata=metadata,
                topk_idx=idx_copy,
                dst_buffer_slot_idx=slot),
            num_recv_tokens_per_expert_list=counts_list,
            num_experts=E,
            expert_alignment=request.expert_alignment,
            num_max_tokens_per_rank=M,
            do_expand=expand,
            do_cpu_sync=sync,
            num_recv_tokens=num_rows,
            num_expanded_tokens=capacity,
            buffer_id=b.config.buffer_id,
            num_tokens=T,
            hidden=b.config.hidden,
            backend_state=KernelState(pos, send_counts, send_splits, recv_splits),
            num_sms=b.config.num_sms or 0,
        )
        return DispatchResult(outputs, recv_topk_idx, recv_weights, handle)

    # -- combine ---------------------------------------------------------------------------
    def combine(self, request: CombineRequest, record: "_Record", header: torch.Tensor,
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        b = self.backend
        handle = request.handle
        state: KernelState = handle.backend_state
        R, M, H = b.num_ranks, handle.num_max_tokens_per_rank, b.config.hidden
        topk_idx = handle.tensors["topk_idx"]
        T, K = topk_idx.shape
        sync = handle.do_cpu_sync
        x, weights = request.x, request.topk_weights
        has_w = weights is not None
        vec = 8 if H % 8 == 0 else 4 if H % 4 == 0 else 2
        common = dict(K=K, BLOCK_K=next_power_of_2(K), BLOCK_R=next_power_of_2(R),
                      BLOCK_F=kernels.BLOCK_F, ROWS=COMBINE_ROWS, VEC=vec,
                      BLOCK_H=BLOCK_H, num_warps=COMBINE_WARPS)
        if b._host_transport:
            counts = handle.tensors["psum_num_recv_tokens_per_scaleup_rank"].diff(
                prepend=torch.zeros(1, dtype=torch.int32, device=b.device))
            b._exchange_headers("combine (header exchange)",
                                b._header_rows(header, counts.long()))
            bump = 0
        else:
            bump = 1
        back_rows = sum(state.recv_splits) + R if sync else R * (M + 1)
        send_buf = b._workspace.rows("send", back_rows, record.nbytes)
        w_in = weights if has_w else torch.empty(1, dtype=torch.float32, device=b.device)
        self._launch(kernels.combine_pack_kernel, vec, dict(
            x_addr=x.data_ptr(), hidden=H, num_ranks=R, max_tokens=M, exact=int(sync),
            rank_psum=handle.tensors["psum_num_recv_tokens_per_scaleup_rank"],
            num_rows=handle.num_recv_tokens, send_addr=send_buf.data_ptr(),
            record_words=record.nbytes // 4, meta_off=record.meta // 4,
            metadata=handle.tensors["recv_src_metadata"], expand=int(handle.do_expand),
            w_ptr=w_in, has_w=int(has_w), fields_ptr=header, seq_ptr=b._seq, bump=bump),
            **common)
        returned_rows = sum(state.send_splits) + R if sync else R * (M + 1)
        returned = b._workspace.rows("receive", returned_rows, record.nbytes)
        b._all_to_all("combine", returned, send_buf,
                      [n + 1 for n in state.send_splits] if sync else None,
                      [n + 1 for n in state.recv_splits] if sync else None)
        out = request.alloc.empty((T, H), torch.bfloat16)
        w_out = request.alloc.empty((T, K), torch.float32) if has_w else None
        biases = request.biases
        bias0 = biases[0] if biases else out
        bias1 = biases[1] if len(biases) > 1 else bias0
        self._launch(kernels.combine_reduce_kernel, (topk_idx.dtype, bias0.dtype, bias1.dtype),
                     dict(recv_addr=returned.data_ptr(), record_words=record.nbytes // 4,
                          meta_off=record.meta // 4, num_ranks=R, max_tokens=M,
                          exact=int(sync), send_counts=state.send_counts, idx_ptr=topk_idx,
                          num_tokens=T, num_experts=handle.num_experts, pos_ptr=state.pos,
                          bias0=bias0, bias1=bias1, num_bias=len(biases), out_ptr=out,
                          hidden=H, has_w=int(has_w),
                          w_out=w_out if w_out is not None else w_in,
                          check=int(not b._host_transport), fields_ptr=header, seq_ptr=b._seq,
                          flags_ptr=b._flags), **common)
        return out, w_out
