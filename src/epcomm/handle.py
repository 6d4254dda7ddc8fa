"""`EPHandle`: the routing and layout of one dispatch, reused by combine and cached dispatch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

_UNSET = object()


def _tensor_field(name: str, rows: bool = False) -> property:
    """A tensor field of the handle: it reads the dispatch's tensor `name` (from `tensors`)
    until the caller assigns another value, which it then reads instead. What combine and
    cached dispatch use is always the dispatch's own tensor (`handle.tensors[name]`). With
    `rows`, a view of its first `num_recv_tokens` rows where the tensor has more (a
    synchronizing dispatch's exact sizes over a capacity-sized allocation), made when read."""

    def get(handle: "EPHandle"):
        value = handle.__dict__.get(name, _UNSET)
        if value is not _UNSET:
            return value
        value = handle.tensors[name]
        if rows and value.shape[0] != handle.num_recv_tokens:
            return value[:handle.num_recv_tokens]
        return value

    def put(handle: "EPHandle", value) -> None:
        handle.__dict__[name] = value

    return property(get, put, doc=f"The handle's `{name}` tensor (assignable).")


@dataclass(eq=False)
class EPHandle:
    """Everything a dispatch learned about its routing (field names and meaning as DeepEP's).

    R ranks, E_l = num_experts // R local experts, K top-k slots, T this rank's tokens,
    rows = compact output rows (`num_recv_tokens`), M = `num_max_tokens_per_rank`.

    Tensor fields (device tensors, int32 unless said otherwise):

    psum_num_recv_tokens_per_scaleup_rank: [R], inclusive prefix sum of the compact rows
        received from each source rank; `[-1]` is the number of valid compact rows.
    psum_num_recv_tokens_per_expert: [E_l]. Compact layout: inclusive prefix sum of the
        aligned per-expert counts. Expand layout: `start_i + count_i`, `start_i` aligned.
    num_unaligned_recv_tokens_per_expert: [E_l], the real per-expert counts (both layouts).
    recv_src_metadata: [rows, K + 2]. Column 0: `src_rank * M + src_token_index`; column 1: the
        last top-k slot of that token mapping to this rank; columns 2..: the expand-layout row
        of each slot, -1 where the slot is not local. Rows past the valid prefix are all -1.
    topk_idx: [T, K] int64 or int32, the routing of this rank's tokens (a copy unless the
        dispatch had `do_handle_copy=False`; then the caller's tensor).
    dst_buffer_slot_idx: [T, K], for each slot of this rank's tokens the record of the
        destination rank that received the token (`dst_rank * S + position`, position = the
        token's index among the tokens this rank sent there, S = the per-source stride of the
        backend's receive buffer: the buffer's M on the symmetric backend, the dispatch's M on
        the collective one); -1 for `-1` slots. The same tensor for a handle and every cached
        dispatch of it.

    Host fields:

    num_recv_tokens_per_expert_list: aligned per-expert counts as a list of E_l ints, only
        after a dispatch with `do_cpu_sync=True` (else None).
    num_experts, expert_alignment, num_max_tokens_per_rank (M), do_expand, do_cpu_sync: what
        the dispatch was made with.
    num_sms: the SMs (kernel programs) the dispatch used; combine and cached dispatch with
        `num_sms=0` use it (0 on the collective backend, which runs no kernels of its own).
    num_recv_tokens: compact output rows (the capacity `R * M` after a sync-free dispatch).
    num_expanded_tokens: expand output rows (exact, or the capacity), 0 in compact mode.
    token_metadata_at_forward, channel_linked_list: None (DeepEP's multi-node hybrid-mode
        state; epcomm has one level of ranks).
    cached_recv_src_metadata_before_sort: set by `deterministic_sort`.

    Every field is a plain attribute that callers may reassign (for example
    `handle.recv_src_metadata = handle.recv_src_metadata[:n]`). Reassigning a tensor field
    changes what it reads, not the routing: combine and cached dispatch keep using the
    dispatch's own tensors (`tensors`, a mapping from their names, whose entries a backend may
    make on first access as views of one allocation). The host fields describe the dispatch
    and are read by combine and cached dispatch: leave them as they are.
    """

    tensors: Mapping[str, torch.Tensor] = field(repr=False)
    num_recv_tokens_per_expert_list: Optional[list[int]]
    num_experts: int
    expert_alignment: int
    num_max_tokens_per_rank: int
    do_expand: bool
    do_cpu_sync: bool
    num_recv_tokens: int
    num_expanded_tokens: int
    # Implementation details: which buffer made the handle, the shape it was made for, and the
    # backend's own layout state (send positions, host split sizes, ...).
    buffer_id: int = field(default=-1, repr=False)
    num_tokens: int = field(default=0, repr=False)
    hidden: int = field(default=0, repr=False)
    backend_state: Any = field(default=None, repr=False)
    # The allocations (at most two) that hold the handle's device tensors, where a backend
    # keeps them in its own (the symmetric backend): the compiled ops pass views of them
    # through the graph, so that CUDA-graph trees count them among the graph's tensors.
    storage: tuple = field(default=(), repr=False)
    num_sms: int = 0
    token_metadata_at_forward: Optional[torch.Tensor] = field(default=None, repr=False)
    channel_linked_list: Optional[torch.Tensor] = field(default=None, repr=False)
    cached_recv_src_metadata_before_sort: Optional[torch.Tensor] = field(default=None,
                                                                         repr=False)

    psum_num_recv_tokens_per_scaleup_rank = _tensor_field("psum_num_recv_tokens_per_scaleup_rank")
    psum_num_recv_tokens_per_expert = _tensor_field("psum_num_recv_tokens_per_expert")
    num_unaligned_recv_tokens_per_expert = _tensor_field("num_unaligned_recv_tokens_per_expert")
    recv_src_metadata = _tensor_field("recv_src_metadata", rows=True)
    topk_idx = _tensor_field("topk_idx")
    dst_buffer_slot_idx = _tensor_field("dst_buffer_slot_idx")

    @property
    def num_output_rows(self) -> int:
        """Rows of the dispatch output (and of the combine input) for this handle."""
        return self.num_expanded_tokens if self.do_expand else self.num_recv_tokens

    def deterministic_sort(self, do_cpu_sync: bool, is_cached_dispatch: bool,
                           recv_x: torch.Tensor, recv_sf: Optional[torch.Tensor],
                           recv_topk_idx: Optional[torch.Tensor],
                           recv_topk_weights: Optional[torch.Tensor],
                           channel_linked_list: Optional[torch.Tensor] = None) -> None:
        """DeepEP's deterministic epilogue: put a dispatch's outputs into source order.

        epcomm's dispatch outputs are in that order already (compact rows by source rank, then
        source token: ascending `recv_src_metadata[:, 0]`; expand rows by local expert, then
        compact row, then slot; docs/semantics.md), on every backend and in every mode, so the
        sort is the identity and nothing is moved. The arguments are those of DeepEP (recv_x
        [rows, H], recv_sf its FP8 scales or None, recv_topk_idx [rows, K] or None,
        recv_topk_weights [rows, K] / [rows] or None, channel_linked_list None) and are only
        checked for their types. A non-cached call records `recv_src_metadata` as
        `cached_recv_src_metadata_before_sort`, as DeepEP does.
        """
        for name, value in (("do_cpu_sync", do_cpu_sync),
                            ("is_cached_dispatch", is_cached_dispatch)):
            if not isinstance(value, (bool, int)):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        for name, value in (("recv_x", recv_x), ("recv_sf", recv_sf),
                            ("recv_topk_idx", recv_topk_idx),
                            ("recv_topk_weights", recv_topk_weights),
                            ("channel_linked_list", channel_linked_list)):
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, "
                                f"got {type(value).__name__}")
        if not is_cached_dispatch:
            self.cached_recv_src_metadata_before_sort = self.recv_src_metadata
