"""`EPHandle`: the routing and layout of one dispatch, reused by combine and cached dispatch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch


def _tensor_field(name: str) -> property:
    return property(lambda handle: handle.tensors[name], doc=f"The handle's `{name}` tensor.")


@dataclass(eq=False)
class EPHandle:
    """Everything a dispatch learned about its routing (field names and meaning as DeepEP's).

    R ranks, E_l = num_experts // R local experts, K top-k slots, rows = compact output rows.

    psum_num_recv_tokens_per_scaleup_rank: [R] int32, inclusive prefix sum of the compact rows
        received from each source rank; `[-1]` is the number of valid compact rows.
    psum_num_recv_tokens_per_expert: [E_l] int32. Compact layout: inclusive prefix sum of the
        aligned per-expert counts. Expand layout: `start_i + count_i`, `start_i` aligned.
    num_unaligned_recv_tokens_per_expert: [E_l] int32, the real per-expert counts.
    num_recv_tokens_per_expert_list: aligned per-expert counts as a Python list, only with
        `do_cpu_sync=True` (else None).
    recv_src_metadata: [rows, K + 2] int32. Column 0: `src_rank * M + src_token_index`; column 1:
        the last top-k slot of that token mapping to this rank; columns 2..: the expand-layout row
        of each slot, -1 where the slot is not local. Rows past the valid prefix are all -1.
    topk_idx: [T, K] the routing of this rank's tokens (a copy unless `do_handle_copy=False`).
    num_recv_tokens: compact output rows (the capacity `R * M` after a sync-free dispatch).
    num_expanded_tokens: expand output rows (exact, or the capacity), 0 in compact mode.

    The five tensors are read through `tensors`, a mapping from their names (a backend may make
    them on first access, as views of one allocation).
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

    psum_num_recv_tokens_per_scaleup_rank = _tensor_field("psum_num_recv_tokens_per_scaleup_rank")
    psum_num_recv_tokens_per_expert = _tensor_field("psum_num_recv_tokens_per_expert")
    num_unaligned_recv_tokens_per_expert = _tensor_field("num_unaligned_recv_tokens_per_expert")
    recv_src_metadata = _tensor_field("recv_src_metadata")
    topk_idx = _tensor_field("topk_idx")

    @property
    def num_output_rows(self) -> int:
        """Rows of the dispatch output (and of the combine input) for this handle."""
        return self.num_expanded_tokens if self.do_expand else self.num_recv_tokens
