"""Routing layout as single-program Triton kernels (one launch each, no host sync).

`route` is the sender side (`epcomm.layout.compute_send_layout` plus the symmetric backend's
staging records), `expert_layout` the receiver side (`compute_expert_layout`,
`last_slot_per_rank`, the metadata rows and the per-rank prefix). Results are bitwise those of
the torch functions of `epcomm.layout`. Prefix sums over tokens / rows are ordered: one program
walks the blocks in order and carries the running totals, so they are deterministic. Token and
row counts are run-time arguments (never constexpr): one compiled variant serves every size.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import INTERPRET
from .common import _add, running_total, total
from .sync import _signal_body, _wait_body


@triton.jit
def _row_total(x):
    """Sum of each row of a 2-D block."""
    return tl.reduce(x, 1, _add)


@triton.jit
def _slot_rank(idx_ptr, t64, tmask, j, num_experts, experts_per_rank, K: tl.constexpr):
    """(expert id as int64, valid, destination rank or -1) of slot j of tokens t64."""
    e = tl.load(idx_ptr + t64 * K + j, mask=tmask, other=-1).to(tl.int64)
    ok = (e >= 0) & (e < num_experts)
    return e, ok, tl.where(ok, e // experts_per_rank, -1)


@triton.jit(do_not_specialize=["num_tokens", "num_experts", "num_ranks", "stride_tokens",
                               "error_bit", "rank", "flag_offset", "timeout", "wait_error_bit"])
def route_kernel(idx_ptr, num_tokens, num_experts, num_ranks, stride_tokens, pos_out,
                 counts_out, ids_out, stage_out, last_out, error_ptr, error_bit,
                 bases_ptr, rank, flag_offset, epoch_ptr, timeout, wait_error_bit,
                 K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr,
                 WAIT: tl.constexpr, USE_TIMER: tl.constexpr):
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < num_ranks
    experts_per_rank = num_experts // num_ranks
    carry = tl.full([BLOCK_R], 0, tl.int64)
    bad = tl.full([BLOCK_T], 0, tl.int32)
    for start in range(0, num_tokens, BLOCK_T):
        tt = start + tl.arange(0, BLOCK_T)
        tmask = tt < num_tokens
        t64 = tt.to(tl.int64)
        sent = tl.full([BLOCK_T, BLOCK_R], 0, tl.int32)
        for j in tl.static_range(K):
            e, ok, r = _slot_rank(idx_ptr, t64, tmask, j, num_experts, experts_per_rank, K)
            bad = bad | ((e < -1) | (e >= num_experts)).to(tl.int32)
            sent = sent | (r[:, None] == rr[None, :]).to(tl.int32)
        pos = tl.where(sent > 0, carry[None, :] + running_total(sent) - 1, -1)
        tl.store(pos_out + t64[:, None] * num_ranks + rr[None, :], pos,
                 mask=tmask[:, None] & rmask[None, :])
        carry += total(sent)
        for j in tl.static_range(K):
            e, ok, r = _slot_rank(idx_ptr, t64, tmask, j, num_experts, experts_per_rank, K)
            later = tl.full([BLOCK_T], 0, tl.int32)
            for j2 in tl.static_range(j + 1, K):
                e2, ok2, r2 = _slot_rank(idx_ptr, t64, tmask, j2, num_experts,
                                         experts_per_rank, K)
                later = later | (ok2 & (r2 == r)).to(tl.int32)
            picked = _row_total(tl.where(rr[None, :] == r[:, None], pos, 0))
            stage = tl.where(ok, r * stride_tokens + picked, -1)
            tl.store(ids_out + t64 * K + j, tl.where(ok, e, -1).to(tl.int32), mask=tmask)
            tl.store(stage_out + t64 * K + j, stage, mask=tmask)
            tl.store(last_out + t64 * K + j, tl.where(ok & (later == 0), stage, -1), mask=tmask)
    tl.store(counts_out + rr, carry, mask=rmask)
    if total(bad) > 0:
        tl.atomic_or(error_ptr, error_bit)
    if WAIT:  # then the stage's first wait (bump the epoch, lag 1), as `sync.wait` does it
        _wait_body(bases_ptr, rank, flag_offset, num_ranks, epoch_ptr, 1, counts_out, error_ptr,
                   timeout, wait_error_bit, True, False, USE_TIMER, BLOCK_R)


_ROUTE_BLOCK_T = 256  # few serial steps on the GPU; [256, R] tiles


def route(topk_idx, num_experts: int, num_ranks: int, stride_tokens: int, send_pos,
          send_counts, expert_ids, slot_stage, last_stage, error, error_bit: int,
          wait_args: Optional[tuple] = None) -> None:
    """The sender side of a dispatch in one launch (one program, token blocks in order).

    For topk_idx [T, K] (int32/int64; ids outside [0, E) are no slot, ids outside [-1, E) also
    OR `error_bit` into `error[0]`), writes
      send_pos [T, R] int64 and send_counts [R] int64 (`compute_send_layout`),
      expert_ids [T, K] int32 (the id of a valid slot, else -1),
      slot_stage [T, K] int64 (record `r * stride_tokens + send_pos[t, r]` of the slot's rank r,
      -1 for an invalid slot) and last_stage [T, K] int64 (slot_stage where the slot is the
      last of its rank in the token, else -1).

    wait_args: (bases, rank, flag_offset, epoch, timeout_s, error_bit): afterwards, in the same
    launch, `sync.wait(bases, rank, flag_offset, epoch, error, timeout_s, lag=1, bump=True,
    error_bit=error_bit)` (the routing needs no flag, so it goes first).

    Example: E=4, R=2, stride 8, topk_idx = [[0, 3], [1, -1], [2, 3]]:
        send_pos = [[0, 0], [1, -1], [-1, 1]], send_counts = [2, 2],
        expert_ids = [[0, 3], [1, -1], [2, 3]], slot_stage = [[0, 8], [1, -1], [9, 9]],
        last_stage = [[0, 8], [1, -1], [-1, 9]].
    """
    num_tokens, num_topk = topk_idx.shape
    bases, rank, flag_offset, epoch, timeout_s, wait_bit = wait_args or (
        send_counts, 0, 0, send_counts, 0.0, 0)
    route_kernel[(1,)](topk_idx, num_tokens, num_experts, num_ranks, stride_tokens, send_pos,
                       send_counts, expert_ids, slot_stage, last_stage, error, error_bit,
                       bases, rank, flag_offset, epoch, _timeout(timeout_s), wait_bit,
                       K=num_topk, BLOCK_T=_ROUTE_BLOCK_T,
                       BLOCK_R=triton.next_power_of_2(num_ranks), WAIT=wait_args is not None,
                       USE_TIMER=not INTERPRET)


def _timeout(timeout_s: float) -> int:
    """`sync.wait`'s bound: spins under the interpreter, nanoseconds on the GPU."""
    return int(timeout_s * 2e4) if INTERPRET else int(timeout_s * 1e9)


@triton.jit
def _local_key(idx_ptr, t64, tmask, j, num_local, K: tl.constexpr):
    """Local expert id of slot j of rows t64 (int64), -1 for none."""
    v = tl.load(idx_ptr + t64 * K + j, mask=tmask, other=-1).to(tl.int64)
    return tl.where((v >= 0) & (v < num_local), v, -1), v


@triton.jit(do_not_specialize=["num_rows", "num_local", "alignment", "capacity", "expand",
                               "num_ranks", "error_bit", "rank", "flag_offset"])
def expert_layout_kernel(idx_ptr, src_ptr, num_rows, num_local, alignment, capacity, expand,
                         meta_out, counts_out, psum_out, aligned_out, rank_counts_ptr, num_ranks,
                         rank_psum_out, error_ptr, error_bit, bases_ptr, rank, flag_offset,
                         epoch_ptr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_R: tl.constexpr, SIGNAL: tl.constexpr):
    rr = tl.arange(0, BLOCK_R)
    rank_counts = tl.load(rank_counts_ptr + rr, mask=rr < num_ranks, other=0)
    tl.store(rank_psum_out + rr, running_total(rank_counts).to(tl.int32), mask=rr < num_ranks)
    # Pass 0: source and last slot of every row, -1 for the slots without a pair. Every
    # metadata word is written exactly once (no ordering between passes is needed).
    for start in range(0, num_rows, BLOCK_T):
        tt = start + tl.arange(0, BLOCK_T)
        tmask = tt < num_rows
        t64 = tt.to(tl.int64)
        meta = meta_out + t64 * (K + 2)
        last = tl.full([BLOCK_T], -1, tl.int32)
        for j in tl.static_range(K):
            key, v = _local_key(idx_ptr, t64, tmask, j, num_local, K)
            tl.store(meta + 2 + j, tl.full([BLOCK_T], -1, tl.int32), mask=tmask & (key < 0))
            last = tl.where(v >= 0, j, last)
        tl.store(meta, tl.load(src_ptr + t64, mask=tmask), mask=tmask)
        tl.store(meta + 1, last, mask=tmask)
    # Experts in chunks of BLOCK_E (a constant, so one compiled variant serves every E_l).
    psum_carry = tl.full([], 0, tl.int64)
    overflow = tl.full([BLOCK_T], 0, tl.int32)
    for e0 in range(0, num_local, BLOCK_E):
        ee = e0 + tl.arange(0, BLOCK_E)
        emask = ee < num_local
        # Pass 1: (row, slot) pairs per expert of the chunk.
        counts = tl.full([BLOCK_E], 0, tl.int64)
        for start in range(0, num_rows, BLOCK_T):
            tt = start + tl.arange(0, BLOCK_T)
            t64 = tt.to(tl.int64)
            for j in tl.static_range(K):
                key, v = _local_key(idx_ptr, t64, tt < num_rows, j, num_local, K)
                counts += total((key[:, None] == ee[None, :]).to(tl.int32))
        aligned = (counts + alignment - 1) // alignment * alignment
        psum_aligned = psum_carry + running_total(aligned)
        starts = psum_aligned - aligned
        psum_carry += total(aligned)
        tl.store(counts_out + ee, counts.to(tl.int32), mask=emask)
        tl.store(psum_out + ee, tl.where(expand != 0, starts + counts, psum_aligned).to(tl.int32),
                 mask=emask)
        tl.store(aligned_out + ee, aligned.to(tl.int32), mask=emask)
        # Pass 2: expand row of each pair of the chunk, (row, slot) order within its expert.
        carry = tl.full([BLOCK_E], 0, tl.int64)
        for start in range(0, num_rows, BLOCK_T):
            tt = start + tl.arange(0, BLOCK_T)
            tmask = tt < num_rows
            t64 = tt.to(tl.int64)
            per_row = tl.full([BLOCK_T, BLOCK_E], 0, tl.int32)
            for j in tl.static_range(K):
                key, v = _local_key(idx_ptr, t64, tmask, j, num_local, K)
                per_row += (key[:, None] == ee[None, :]).to(tl.int32)
            before = (starts + carry)[None, :] + (running_total(per_row) - per_row)
            for j in tl.static_range(K):
                key, v = _local_key(idx_ptr, t64, tmask, j, num_local, K)
                hit = key[:, None] == ee[None, :]
                row = _row_total(tl.where(hit, before, 0))
                before += hit.to(tl.int64)
                mine = (key >= e0) & (key < e0 + BLOCK_E)
                overflow = overflow | (mine & (row >= capacity)).to(tl.int32)
                tl.store(meta_out + t64 * (K + 2) + 2 + j,
                         tl.where(row < capacity, row, -1).to(tl.int32), mask=tmask & mine)
            carry += total(per_row)
    if total(overflow) > 0:
        tl.atomic_or(error_ptr, error_bit)
    if SIGNAL:  # then the stage's last signal, as `sync.signal` does it
        _signal_body(bases_ptr, flag_offset, rank, num_ranks, epoch_ptr, rank_counts_ptr, False,
                     BLOCK_R)


_EXPERT_BLOCK_E, _EXPERT_BLOCK_T = 32, 64


def expert_layout(local_idx, src, num_local: int, alignment: int, capacity, expand: bool,
                  metadata, counts, psum, aligned, rank_counts, rank_psum, error,
                  error_bit: int, signal_args: Optional[tuple] = None) -> None:
    """The receiver side of a dispatch in one launch (one program, row blocks in order).

    For local_idx [N, K] (int32/int64, local expert ids, anything outside [0, E_l) is no pair)
    and src [N] int32, writes
      metadata [N, K + 2] int32: [src[n], last slot j with local_idx[n, j] >= 0 (-1 if none),
          expand row of each pair (`compute_expert_layout(...).expand_rows`, -1 for none and
          for a pair at or past `capacity` (None: no bound), which ORs `error_bit` into error)],
      counts [E_l] int32 (pairs per expert), aligned [E_l] int32 (counts rounded up to
      `alignment`), psum [E_l] int32 (expand: starts + counts; compact: inclusive prefix of
      aligned), rank_psum [R] int32 (inclusive prefix of rank_counts [R] int64).

    signal_args: (bases, rank, flag_offset, epoch): afterwards, in the same launch,
    `sync.signal(bases, flag_offset, rank, epoch)` (no counts).

    Example: E_l=2, alignment 2, expand, local_idx = [[1, -1], [0, 1]], src = [5, 7],
    rank_counts = [1, 1]:
        metadata = [[5, 0, 2, -1], [7, 1, 0, 3]], counts = [1, 2], aligned = [2, 2],
        psum = [1, 4], rank_psum = [1, 2].
    """
    num_rows, num_topk = local_idx.shape
    if capacity is None:  # a bound every pair fits under (compute_expert_layout's default)
        capacity = num_rows * num_topk + alignment * num_local
    num_ranks = rank_counts.numel()
    bases, rank, flag_offset, epoch = signal_args or (rank_counts, 0, 0, rank_counts)
    expert_layout_kernel[(1,)](
        local_idx, src, num_rows, num_local, alignment, capacity, int(expand), metadata, counts,
        psum, aligned, rank_counts, num_ranks, rank_psum, error, error_bit, bases, rank,
        flag_offset, epoch, K=num_topk, BLOCK_T=_EXPERT_BLOCK_T, BLOCK_E=_EXPERT_BLOCK_E,
        BLOCK_R=triton.next_power_of_2(num_ranks), SIGNAL=signal_args is not None)


def route_outputs(num_tokens: int, num_topk: int, num_ranks: int, device):
    """Empty (send_pos, send_counts, expert_ids, slot_stage, last_stage) for `route`."""
    i32, i64 = torch.int32, torch.int64
    return (torch.empty(num_tokens, num_ranks, dtype=i64, device=device),
            torch.empty(num_ranks, dtype=i64, device=device),
            torch.empty(num_tokens, num_topk, dtype=i32, device=device),
            torch.empty(num_tokens, num_topk, dtype=i64, device=device),
            torch.empty(num_tokens, num_topk, dtype=i64, device=device))
