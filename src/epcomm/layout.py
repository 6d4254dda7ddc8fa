"""Routing and layout math as small device-side functions (no host synchronization).

Every function works on whatever device its inputs live on and never reads a value back to
the host, so the sync-free paths can call them under CUDA-graph capture. Exact semantics:
`docs/semantics.md`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def align_up(n: int, alignment: int) -> int:
    """Round the host integer `n` up to a multiple of `alignment`."""
    return (n + alignment - 1) // alignment * alignment


def expand_capacity(num_ranks: int, max_tokens: int, num_topk: int, num_local_experts: int,
                    alignment: int) -> int:
    """Rows of a sync-free expand-layout output (contract section 2)."""
    rows = num_ranks * max_tokens * min(num_topk, num_local_experts)
    return align_up(rows + (alignment - 1) * num_local_experts, alignment)


@dataclass
class SendLayout:
    """Where this rank's tokens go. T tokens, K slots, R ranks.

    slot_rank: [T, K] int64, destination rank of each slot, -1 for an invalid slot.
    is_last_slot: [T, K] bool, slot j is valid and no later slot of the token maps to its rank.
    send_pos: [T, R] int64, position of token t among the tokens sent to rank r, -1 if not sent.
    send_counts: [R] int64, tokens sent to each rank.
    """

    slot_rank: torch.Tensor
    is_last_slot: torch.Tensor
    send_pos: torch.Tensor
    send_counts: torch.Tensor


def compute_send_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> SendLayout:
    """Deduplicated per-rank routing of `topk_idx` [T, K] (ids outside [0, E) are ignored).

    Example: E=4, R=2, topk_idx=[[0, 3], [1, -1]] -> slot_rank=[[0, 1], [0, -1]],
    send_pos=[[0, 0], [1, -1]], send_counts=[2, 1], is_last_slot=[[T, T], [T, F]].
    """
    num_tokens, num_topk = topk_idx.shape
    experts_per_rank = num_experts // num_ranks
    idx = topk_idx.long()
    valid = (idx >= 0) & (idx < num_experts)
    slot_rank = torch.where(valid, idx.div(experts_per_rank, rounding_mode="floor"), -1)
    hits = torch.zeros(num_tokens, num_ranks, dtype=torch.int32, device=idx.device)
    hits.scatter_add_(1, slot_rank.clamp(min=0), valid.int())
    is_sent = hits > 0
    send_pos = torch.where(is_sent, is_sent.long().cumsum(0) - 1, -1)
    same_rank = slot_rank[:, :, None] == slot_rank[:, None, :]
    later = torch.ones(num_topk, num_topk, dtype=torch.bool, device=idx.device).triu(1)
    has_later_twin = (same_rank & later).any(2)
    return SendLayout(slot_rank=slot_rank, is_last_slot=valid & ~has_later_twin,
                      send_pos=send_pos, send_counts=is_sent.long().sum(0))


def last_slot_per_rank(slot_rank: torch.Tensor, rank: int) -> torch.Tensor:
    """[N] int64: the last slot of each row whose rank is `rank`, -1 if none."""
    slots = torch.arange(slot_rank.shape[1], device=slot_rank.device)
    return torch.where(slot_rank == rank, slots, -1).amax(1)


@dataclass
class ExpertLayout:
    """Per-local-expert layout of received rows. N rows, K slots, E_l local experts.

    counts: [E_l] int64, (row, slot) pairs per local expert.
    starts: [E_l] int64, first expand row of each expert's segment (aligned).
    psum_aligned: [E_l] int64, inclusive prefix sum of the aligned counts.
    expand_rows: [N, K] int64, expand row of each local slot, -1 otherwise (and -1 for pairs
        that would land at or past `capacity`, which only repeated expert ids can cause).
    overflow: [] bool tensor, some pair did not fit into `capacity`.
    """

    counts: torch.Tensor
    starts: torch.Tensor
    psum_aligned: torch.Tensor
    expand_rows: torch.Tensor
    overflow: torch.Tensor


def compute_expert_layout(local_idx: torch.Tensor, num_local_experts: int, alignment: int,
                          capacity: Optional[int] = None) -> ExpertLayout:
    """Place each (row, slot) with local expert id in [0, E_l) into the expand layout.

    `capacity`: the expand rows of a sync-free output (pairs past it are dropped and flagged);
    None for exact-size outputs, where every pair fits.

    Pairs of one expert are ordered by row, then slot (a stable sort keeps that order).
    Example: E_l=2, a=2, local_idx=[[1, -1], [0, 1]] -> counts=[1, 2], starts=[0, 2],
    expand_rows=[[2, -1], [0, 3]].
    """
    num_rows, num_topk = local_idx.shape
    device = local_idx.device
    if capacity is None:  # a bound that every real pair fits under
        capacity = num_rows * num_topk + alignment * num_local_experts
    key = torch.where((local_idx >= 0) & (local_idx < num_local_experts), local_idx.long(),
                      num_local_experts).flatten()
    bucket_counts = torch.zeros(num_local_experts + 1, dtype=torch.long, device=device)
    bucket_counts.scatter_add_(0, key, torch.ones_like(key))
    counts = bucket_counts[:num_local_experts]
    aligned = (counts + alignment - 1) // alignment * alignment
    psum_aligned = aligned.cumsum(0)
    starts = psum_aligned - aligned
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    bucket_first = bucket_counts.cumsum(0) - bucket_counts
    padded_starts = torch.cat([starts, starts.new_zeros(1)])
    rows_sorted = padded_starts[sorted_key] + torch.arange(key.numel(), device=device) \
        - bucket_first[sorted_key]
    fits = (sorted_key < num_local_experts) & (rows_sorted < capacity)
    overflow = ((sorted_key < num_local_experts) & ~fits).any()
    expand_flat = torch.full_like(key, -1)
    expand_flat.scatter_(0, order, torch.where(fits, rows_sorted, -1))
    return ExpertLayout(counts=counts, starts=starts, psum_aligned=psum_aligned,
                        expand_rows=expand_flat.view(num_rows, num_topk), overflow=overflow)
