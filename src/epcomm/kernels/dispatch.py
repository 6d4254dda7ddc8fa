"""Dispatch in one kernel (`dispatch_kernel`): its send part on every source rank, then its
receive part on every destination (a synchronizing dispatch runs the receive part again, in a
second launch, after the host has sized the outputs).

Heap memory they use (byte offsets passed in; see `epcomm.backends.symmetric`):
- the dispatch counters `[ready R | free R | count R]` (int64, `kernels.sync`): ready[s] and
  count[s] are written by source s, free[d] by destination d; count[s] holds the count ORed
  with source s's stamp of the call (`sync.stamp`);
- the staging region: `[R, S]` records (S = the buffer's max tokens per rank); block s is
  written only by source s, record `s * S + p` holds the p-th token that s sends here. A record is
  int32 words (`RecordLayout`): source token index, K global expert ids (-1 for no slot), K
  weights (fp32 bits), then the payload rows (bf16 x, or FP8 rows and their scales) as raw words.

Send part (P programs, the tokens split into P contiguous chunks):
1. count the chunk's tokens per destination (a token goes once to every rank that one of its
   valid slots maps to); ids outside [-1, E) set `errors.INVALID_EXPERT_ID`;
2. grid barrier, then each chunk's first position per rank is the sum of the earlier chunks'
   counts: positions follow token order, deterministic by construction;
3. wait until every destination has released what this rank pushed the call before (free);
4. write every record, loading each payload row once and storing it to each destination
   (this rank's own records get their headers only: its receive part copies their payload
   from the source rows);
5. program 0 stores the counts, each with the call's stamp, into the destinations' count slots;
   every program adds 1 to each destination's ready counter (release), so a receiver waits for
   `call * P`.

Receive part (the same P programs, the received rows split into P chunks):
1. wait until every source's ready counter reaches `call * P`, read the counts: a source whose
   counter went past this call or whose stamp differs counts as empty (flagged,
   `sync.stamped_words`);
2. per compact row (source-major, then position): local ids, weights, source metadata and, in the
   compact layout, the payload; per group of a few rows, its pairs per local expert (atomics
   into the group's counts) and each pair's rank among the group's earlier pairs of its
   expert, by comparing the group's pairs all with all (into a scratch);
3. grid barrier; each program turns the group counts of its share of the experts into
   exclusive prefixes over the groups, and totals; grid barrier; every expert's aligned start;
4. expand row of every pair = its expert's start + the expert's pairs in earlier groups + its
   rank in the group ((row, slot) order, deterministic; no row depends on another); in the
   expand layout the payload and weights go to those rows; sync-free tails and alignment gaps
   get -1 / 0 (payload 0 with zero padding);
5. every program adds 1 to each source's free counter (release: its reads are done).

One-block paths (`one_block`: decode sizes, where every token's destinations, and every
received row's ids, fit one block of a program): the send part's steps 1-2 count all the tokens
in every program instead of meeting at a grid barrier, and the receive part's steps 2-4 become
one pass: every program counts every expert's pairs, and those in the rows before its own, with
histograms over the received ids, so it knows its pairs' expand rows without the group counts
and the two grid barriers. The same rows and order either way; and since no program waits for
another of its launch, the interpreter runs them on several programs too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from . import INTERPRET
from .common import (columns, copy_rows, exclusive_rows, flag_mask, i32_ptr, max_along,
                     program_chunk, running_total, sum_along, total, word_ptrs)
from .launcher import KernelShape, Launcher, Stage, aligned, next_power_of_2
from .sync import (DISPATCH_TIMEOUT, EXPAND_OVERFLOW, INVALID_EXPERT_ID, RECEIVE_OVERFLOW,
                   add_counters, await_counters, call_signature, grid_barrier, own_counters,
                   peer_counters, stamp, stamped_words)

_ALIGN_WORDS = 4  # 16 bytes: payload fields and records start on vector boundaries

# Slots of the backend's local int64 sync tensor: grid-barrier counters of each kernel. The
# dispatch send barrier's counter (slot 0) is also the dispatch call number (counter // P).
SYNC_RECEIVE = tl.constexpr(1)


def _align(n: int) -> int:
    return (n + _ALIGN_WORDS - 1) // _ALIGN_WORDS * _ALIGN_WORDS


@dataclass(frozen=True)
class RecordLayout:
    """Word layout of a dispatch record: `[token | K ids | K weights | payload 0 | payload 1]`.

    payload_words: int32 words of each payload row (one or two fields); offsets: the word
    where each payload field starts; words: the record's size.
    """

    num_topk: int
    payload_words: tuple[int, ...]
    offsets: tuple[int, ...] = field(init=False)
    words: int = field(init=False)

    def __post_init__(self) -> None:
        offsets, at = [], _align(1 + 2 * self.num_topk)
        for words in self.payload_words:
            offsets.append(at)
            at += _align(words)
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "words", at)


def payload_words(rows: Sequence[torch.Tensor]) -> tuple[int, ...]:
    return tuple(row.shape[1] * row.element_size() // 4 for row in rows)


def _fields(rows: Sequence, layout: RecordLayout, names: tuple[str, ...]) -> dict:
    """The payload fields of a phase: for payload 0 and 1, the rows as int32 words, their
    words per row and their word offset in a record, under `names` (six: pointer, words and
    offset of each); a missing payload 1 has 0 words."""
    words = [row.view(torch.int32) for row in rows]
    sizes, offsets = layout.payload_words, layout.offsets
    first = (words[0], sizes[0], offsets[0])
    second = (words[1], sizes[1], offsets[1]) if len(words) > 1 else (words[0], 0, 0)
    return dict(zip(names, first + second))


@triton.jit
def _destinations(idx_ptr, tt, tmask, num_experts, num_ranks, rr, K: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """For tokens tt: (global ids [T, BK] (-1 for no slot), destination rank of each slot (-1),
    sent [T, BR] (1 where the token goes to rank rr), some id outside [-1, E))."""
    kk = tl.arange(0, BLOCK_K)
    mask = tmask[:, None] & (kk < K)[None, :]
    ids = tl.load(idx_ptr + tt.to(tl.int64)[:, None] * K + kk[None, :], mask=mask,
                  other=-1).to(tl.int64)
    valid = (ids >= 0) & (ids < num_experts)
    bad = total(total(((ids < -1) | (ids >= num_experts)).to(tl.int32)))
    dest = tl.where(valid, ids // (num_experts // num_ranks), -1)
    hit = (dest[:, :, None] == rr[None, None, :]).to(tl.int32)
    return tl.where(valid, ids, -1), dest, max_along(hit, 1), bad


@triton.jit
def _copy_ids(idx_ptr, idx_copy, tt, tmask, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """idx_copy rows tt = idx_ptr rows tt, as they are."""
    kk = tl.arange(0, BLOCK_K)
    at = tt.to(tl.int64)[:, None] * K + kk[None, :]
    mask = tmask[:, None] & (kk < K)[None, :]
    tl.store(idx_copy + at, tl.load(idx_ptr + at, mask=mask), mask=mask)


@triton.jit
def tile_positions(idx_ptr, tt, tmask, num_experts, num_ranks, rr, running, pos_ptr, slot_ptr,
                   stride, K: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """Places tokens tt (one tile, in token order) among the rows sent to each rank. running
    [BR]: rows that earlier tokens sent to each rank. Stores each token's row per rank to
    pos[t, r] (-1: not sent) and each slot's `dest * stride + row` to slot[t, k] (-1: no
    slot). Returns (global ids (`_destinations`), sent [T, BR], positions [T, BR], running
    after the tile)."""
    kk = tl.arange(0, BLOCK_K)
    t64 = tt.to(tl.int64)
    ids, dest, sent, _ = _destinations(idx_ptr, tt, tmask, num_experts, num_ranks, rr, K,
                                       BLOCK_K)
    positions = tl.where(sent > 0, running[None, :] + exclusive_rows(sent, ROWS), -1)
    tl.store(pos_ptr + t64[:, None] * num_ranks + rr[None, :], positions,
             mask=tmask[:, None] & (rr < num_ranks)[None, :])
    picked = sum_along(tl.where(dest[:, :, None] == rr[None, None, :], positions[:, None, :],
                                0), 2)
    tl.store(slot_ptr + t64[:, None] * K + kk[None, :],
             tl.where(dest >= 0, dest * stride + picked, -1).to(tl.int32),
             mask=tmask[:, None] & (kk < K)[None, :])
    return ids, sent, positions, running + total(sent)


@triton.jit
def _record_rows(bases_ptr, peer, region_offset, slots, record_words):
    """int64 addresses of records `slots` of the region at `region_offset` of `peer`'s heap."""
    return tl.load(bases_ptr + peer) + region_offset + slots.to(tl.int64) * record_words * 4


@triton.jit
def _push_field(src, num_words, field_offset, bases_ptr, region_offset, first_slot,
                record_words, pos_ptr, tt, tmask, rank, num_ranks, VEC: tl.constexpr,
                BLOCK_W: tl.constexpr):
    """Each row src[i] (int32 pointers) once from memory, stored into the record of every
    other rank d with pos[tt[i], d] >= 0 (record first_slot + pos of d's region), at word
    field_offset (this rank reads its own rows from the source rows: `_payload_rows`)."""
    elsewhere = tmask & (tt < 0)  # the rows some other rank gets
    for d in range(num_ranks):
        pos = tl.load(pos_ptr + tt.to(tl.int64) * num_ranks + d, mask=tmask, other=-1)
        elsewhere = elsewhere | ((pos >= 0) & (pos * 0 + d != rank))
    num_words = tl.multiple_of(num_words, VEC)
    for start in range(0, num_words, BLOCK_W):
        offs = start + tl.arange(0, BLOCK_W)
        wmask = columns(offs, num_words, VEC)
        value = tl.load(src[:, None] + offs[None, :], mask=elsewhere[:, None] & wmask[None, :])
        for d in range(num_ranks):
            pos = tl.load(pos_ptr + tt.to(tl.int64) * num_ranks + d, mask=tmask, other=-1)
            rec = _record_rows(bases_ptr, d, region_offset, first_slot + pos, record_words)
            dst = word_ptrs(rec + field_offset * 4, VEC)
            tl.store(dst[:, None] + offs[None, :], value,
                     mask=(tmask & (pos >= 0) & (pos * 0 + d != rank))[:, None]
                     & wmask[None, :])


@triton.jit
def _send_part(bases_ptr, rank, num_ranks, flags_offset, region_offset, stride_tokens,
               record_words, sync_ptr, counts_scratch, pos_scratch, idx_ptr, num_tokens,
               num_experts, idx_copy, copy_idx, weights_ptr, has_w, p0_ptr, w0, off0, p1_ptr,
               w1, off1, slot_out, error_ptr, timeout, signature, K: tl.constexpr,
               BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr,
               VEC: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_P: tl.constexpr,
               ALL_TOKENS: tl.constexpr, SCOPE: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < num_ranks
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    begin, end = program_chunk(num_tokens)
    # phase-mark: send-start

    if ALL_TOKENS > 0:
        # 1-2 without a grid barrier: every program counts all the tokens (one block) itself.
        everything = tl.arange(0, ALL_TOKENS)
        found = _destinations(idx_ptr, everything, everything < num_tokens, num_experts,
                              num_ranks, rr, K, BLOCK_K)
        sent, bad = found[2], found[3]
        before = total(tl.where((everything < begin)[:, None], sent, 0))
        sent_total = total(sent)
        if (bad > 0) & (pid == 0):
            tl.atomic_or(error_ptr, INVALID_EXPERT_ID)
        # The call number, as `grid_barrier` counts it (the receive part reads it there).
        call = tl.atomic_add(sync_ptr + 0, 1, sem="relaxed", scope="gpu") // num_programs + 1
        if copy_idx != 0:
            for t0 in range(begin, end, ROWS):
                tt = t0 + tl.arange(0, ROWS)
                _copy_ids(idx_ptr, idx_copy, tt, tt < end, K, BLOCK_K)
        # phase-mark: send-all-counted
    else:
        # 1. Tokens of this chunk per destination.
        sent_here = tl.full([BLOCK_R], 0, tl.int32)
        bad = tl.full([], 0, tl.int32)
        for t0 in range(begin, end, ROWS):
            tt = t0 + tl.arange(0, ROWS)
            ids, dest, sent, bad_ids = _destinations(idx_ptr, tt, tt < end, num_experts,
                                                     num_ranks, rr, K, BLOCK_K)
            sent_here += total(sent)
            bad += bad_ids
            if copy_idx != 0:
                _copy_ids(idx_ptr, idx_copy, tt, tt < end, K, BLOCK_K)
        # phase-mark: send-counted
        tl.store(counts_scratch + pid * BLOCK_R + rr, sent_here)
        if bad > 0:
            tl.atomic_or(error_ptr, INVALID_EXPERT_ID)
        call = grid_barrier(sync_ptr + 0, error_ptr, DISPATCH_TIMEOUT, timeout)

        # phase-mark: send-grid-barrier
        # 2. This chunk's first position per destination, and every destination's total.
        pp = tl.arange(0, BLOCK_P)  # every program's counts in one load: one L2 round trip
        counts = tl.load(counts_scratch + pp[:, None] * BLOCK_R + rr[None, :],
                         mask=(pp < num_programs)[:, None], other=0, cache_modifier=".cg")
        before = total(tl.where((pp < pid)[:, None], counts, 0))
        sent_total = total(counts)

    # 3. Every destination has copied out what this rank pushed the call before.
    await_counters(own_counters(tl.load(bases_ptr + rank), flags_offset + num_ranks * 8, rr),
                   rmask, (call - 1) * num_programs, error_ptr, DISPATCH_TIMEOUT, timeout,
                   SCOPE)

    # phase-mark: send-peers-freed
    # 4. Per tile of tokens: positions (to the scratch, whose rows the stores below read one
    # destination at a time, and as record numbers at their rank to slot_out), then records.
    running = before
    first_slot = rank * stride_tokens
    for t0 in range(begin, end, ROWS):
        tt = t0 + tl.arange(0, ROWS)
        tmask = tt < end
        t64 = tt.to(tl.int64)
        ids, _, _, running = tile_positions(idx_ptr, tt, tmask, num_experts, num_ranks, rr,
                                            running, pos_scratch, slot_out, stride_tokens, K,
                                            BLOCK_K, ROWS)
        tl.debug_barrier()  # the tile's positions are visible to every thread
        weights = tl.load(weights_ptr + t64[:, None] * K + kk[None, :],
                          mask=flag_mask(tmask[:, None] & kmask[None, :], has_w), other=0)
        for d in range(num_ranks):
            pos = tl.load(pos_scratch + t64 * num_ranks + d, mask=tmask, other=-1)
            live = tmask & (pos >= 0)
            rec = i32_ptr(_record_rows(bases_ptr, d, region_offset, first_slot + pos,
                                       record_words))
            tl.store(rec, tt, mask=live)
            hmask = live[:, None] & kmask[None, :]
            tl.store(rec[:, None] + 1 + kk[None, :], ids.to(tl.int32), mask=hmask)
            tl.store(rec[:, None] + 1 + K + kk[None, :], weights, mask=flag_mask(hmask, has_w))
        _push_field(word_ptrs(p0_ptr + tl.multiple_of(t64 * w0, VEC), VEC), w0, off0, bases_ptr,
                    region_offset, first_slot, record_words, pos_scratch, tt, tmask, rank,
                    num_ranks, VEC, BLOCK_W)
        _push_field(word_ptrs(p1_ptr + tl.multiple_of(t64 * w1, VEC), VEC), w1, off1, bases_ptr,
                    region_offset, first_slot, record_words, pos_scratch, tt, tmask, rank,
                    num_ranks, VEC, BLOCK_W)

    # phase-mark: send-records-pushed
    # 5. Counts with this call's stamp, then this program's share of every destination's ready
    # counter.
    tl.debug_barrier()
    bases = tl.load(bases_ptr + rr, mask=rmask, other=0)
    if pid == 0:
        tl.store(peer_counters(bases, flags_offset + 2 * num_ranks * 8, rank),
                 sent_total.to(tl.int64) | stamp(signature, call), mask=rmask)
    add_counters(peer_counters(bases, flags_offset, rank), rmask, SCOPE)


@triton.jit
def _row_records(bases_ptr, rank, region_offset, stride_tokens, record_words, rows, psum,
                 counts, rr):
    """(source rank, int64 record address) of compact rows `rows`, from the per-source counts
    and their inclusive prefix `psum` (rows are source-major)."""
    source = sum_along((psum[None, :] <= rows[:, None]).to(tl.int32), 1)
    first = sum_along(tl.where(rr[None, :] == source[:, None], (psum - counts)[None, :], 0), 1)
    slots = source * stride_tokens + rows - first
    return source, _record_rows(bases_ptr, rank, region_offset, slots, record_words)


@triton.jit
def _payload_rows(rec, field_offset, x_ptr, num_words, token, own, VEC: tl.constexpr):
    """int32 pointers to the payload field at word `field_offset` of records `rec` (int64
    addresses), but for the rows this rank sent itself (`own`): row `token` of the source rows
    `x_ptr` (int32 words, `num_words` per row), which the send part does not push."""
    here = (x_ptr + tl.multiple_of(token.to(tl.int64) * num_words, VEC)).to(tl.int64)
    return word_ptrs(tl.where(own, here, rec + field_offset * 4), VEC)


@triton.jit
def _local_keys(rec, nmask, rank, num_local, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Local expert id (-1: none) of every slot of records `rec` (int64 addresses)."""
    kk = tl.arange(0, BLOCK_K)
    ids = tl.load(i32_ptr(rec)[:, None] + 1 + kk[None, :],
                  mask=nmask[:, None] & (kk < K)[None, :], other=-1)
    first = rank * num_local
    return tl.where((ids >= first) & (ids < first + num_local), ids - first, -1)


@triton.jit
def _expand_field(src, num_words, out_ptr, meta_rows, nmask, K: tl.constexpr,
                  VEC: tl.constexpr, BLOCK_W: tl.constexpr):
    """Each row src[i] once from memory, stored to out row `meta_rows[i][2 + j]` for every
    slot j that has one (>= 0)."""
    num_words = tl.multiple_of(num_words, VEC)
    for start in range(0, num_words, BLOCK_W):
        offs = start + tl.arange(0, BLOCK_W)
        wmask = columns(offs, num_words, VEC)
        value = tl.load(src[:, None] + offs[None, :], mask=nmask[:, None] & wmask[None, :])
        for j in tl.static_range(K):
            target = tl.load(meta_rows + 2 + j, mask=nmask, other=-1).to(tl.int64)
            dst = out_ptr + tl.multiple_of(target * num_words, VEC)
            tl.store(dst[:, None] + offs[None, :], value,
                     mask=(nmask & (target >= 0))[:, None] & wmask[None, :])


@triton.jit
def _zero_rows(out_ptr, begin, end, num_words, VEC: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_W: tl.constexpr):
    """out rows [begin, end) (int32 words) = 0."""
    for r0 in range(begin, end, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        dst = out_ptr + tl.multiple_of(rows.to(tl.int64) * num_words, VEC)
        for start in range(0, num_words, BLOCK_W):
            offs = start + tl.arange(0, BLOCK_W)
            tl.store(dst[:, None] + offs[None, :], tl.full([ROWS, BLOCK_W], 0, tl.int32),
                     mask=(rows < end)[:, None] & columns(offs, num_words, VEC)[None, :])


@triton.jit
def _clear_rows(begin, end, meta_out, idx_out, w_out, expand, has_w, zero_padding, p0_out, w0,
                p1_out, w1, K: tl.constexpr, BLOCK_M: tl.constexpr, VEC: tl.constexpr,
                ROWS: tl.constexpr, BLOCK_W: tl.constexpr):
    """Compact rows [begin, end) past the received prefix: metadata and (compact) ids -1,
    (compact) weights 0, payload 0 with zero padding."""
    mm = tl.arange(0, BLOCK_M)
    for r0 in range(begin, end, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        n64 = rows.to(tl.int64)
        nmask = rows < end
        tl.store(meta_out + n64[:, None] * (K + 2) + mm[None, :],
                 tl.full([ROWS, BLOCK_M], -1, tl.int32), mask=nmask[:, None] & (mm < K + 2)[None, :])
        kmask = flag_mask(nmask[:, None] & (mm < K)[None, :], expand == 0)
        tl.store(idx_out + n64[:, None] * K + mm[None, :],
                 tl.full([ROWS, BLOCK_M], -1, tl.int32).to(idx_out.dtype.element_ty), mask=kmask)
        tl.store(w_out + n64[:, None] * K + mm[None, :], tl.full([ROWS, BLOCK_M], 0, tl.int32),
                 mask=flag_mask(kmask, has_w))
    if (expand == 0) & (zero_padding != 0):
        _zero_rows(p0_out, begin, end, w0, VEC, ROWS, BLOCK_W)
        _zero_rows(p1_out, begin, end, w1, VEC, ROWS, BLOCK_W)


@triton.jit
def _take_rows(rows, nmask, bases_ptr, rank, region_offset, stride_tokens, record_words, psum,
               counts, rr, num_local, max_tokens, expand, has_w, idx_out, w_out, meta_out,
               p0_out, w0, off0, p1_out, w1, off1, x0_ptr, x1_ptr, K: tl.constexpr,
               BLOCK_K: tl.constexpr, VEC: tl.constexpr, BLOCK_W: tl.constexpr):
    """Compact rows `rows` (where nmask), but for their expand rows: the source metadata's
    first two columns, and in the compact layout the payload, ids and weights. Returns (source
    rank, record address, source token, local expert ids [ROWS, BLOCK_K], metadata rows)."""
    kk = tl.arange(0, BLOCK_K)
    n64 = rows.to(tl.int64)
    source, rec = _row_records(bases_ptr, rank, region_offset, stride_tokens, record_words,
                               rows, psum, counts, rr)
    # The header loads are issued first and used after the payload copy, which hides their
    # latency (using them first made every tile wait: 1.7 us of 90.5 on the H200); the token
    # first: this rank's own rows are copied from it.
    token = tl.load(i32_ptr(rec), mask=nmask)
    keys = _local_keys(rec, nmask, rank, num_local, K, BLOCK_K)
    hmask = nmask[:, None] & (kk < K)[None, :]
    weights = tl.load(i32_ptr(rec)[:, None] + 1 + K + kk[None, :],
                      mask=flag_mask(hmask, has_w * (1 - expand)))
    if expand == 0:
        own = source == rank
        copy_rows(_payload_rows(rec, off0, x0_ptr, w0, token, own, VEC),
                  word_ptrs(p0_out + tl.multiple_of(n64 * w0, VEC), VEC), nmask, w0, VEC,
                  BLOCK_W)
        copy_rows(_payload_rows(rec, off1, x1_ptr, w1, token, own, VEC),
                  word_ptrs(p1_out + tl.multiple_of(n64 * w1, VEC), VEC), nmask, w1, VEC,
                  BLOCK_W)
    meta = meta_out + n64 * (K + 2)
    tl.store(meta, source * max_tokens + token, mask=nmask)
    tl.store(meta + 1, max_along(tl.where(keys >= 0, kk[None, :], -1), 1), mask=nmask)
    if expand == 0:
        tl.store(idx_out + n64[:, None] * K + kk[None, :], keys.to(idx_out.dtype.element_ty),
                 mask=hmask)
        tl.store(w_out + n64[:, None] * K + kk[None, :], weights, mask=flag_mask(hmask, has_w))
    return source, rec, token, keys, meta


@triton.jit
def _expand_rows(rec, source, token, meta, nmask, rank, w_out, has_w, p0_out, w0, off0, p1_out,
                 w1, off1, x0_ptr, x1_ptr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                 VEC: tl.constexpr, BLOCK_W: tl.constexpr):
    """The expand layout's weights and payload of compact rows whose metadata rows `meta`
    hold their expand rows (records `rec`, from rank `source`'s token `token`)."""
    kk = tl.arange(0, BLOCK_K)
    hmask = nmask[:, None] & (kk < K)[None, :]
    targets = tl.load(meta[:, None] + 2 + kk[None, :], mask=hmask, other=-1)
    tl.store(w_out + targets, tl.load(i32_ptr(rec)[:, None] + 1 + K + kk[None, :], mask=hmask),
             mask=flag_mask(hmask & (targets >= 0), has_w))
    own = source == rank
    _expand_field(_payload_rows(rec, off0, x0_ptr, w0, token, own, VEC), w0, p0_out, meta,
                  nmask, K, VEC, BLOCK_W)
    _expand_field(_payload_rows(rec, off1, x1_ptr, w1, token, own, VEC), w1, p1_out, meta,
                  nmask, K, VEC, BLOCK_W)


@triton.jit
def _expert_starts(pairs, e0, carry, num_local, alignment, expand, has_w, zero_padding,
                   read_counts, counts_host, expert_psum_out, w_out, p0_out, w0, p1_out, w1,
                   VEC: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
                   BLOCK_E: tl.constexpr):
    """Experts [e0, e0 + BLOCK_E) with `pairs` pairs each, after `carry` aligned rows of the
    experts before: their aligned first rows (returned with the new carry), program 0's
    per-expert prefix (and a synchronizing call's aligned counts), and the alignment gaps of
    the experts e % P == pid (weights 0 and, with zero padding, payload 0)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    ee = tl.arange(0, BLOCK_E)
    emask = e0 + ee < num_local
    aligned = (pairs + alignment - 1) // alignment * alignment
    inclusive = carry + running_total(aligned)
    starts = inclusive - aligned
    if pid == 0:
        tl.store(expert_psum_out + e0 + ee, tl.where(expand != 0, starts + pairs, inclusive),
                 mask=emask)
        if read_counts != 0:
            tl.store(counts_host + 2 + e0 + ee, aligned, mask=emask)
    if expand != 0:
        first = e0 + (pid - e0 % num_programs + num_programs) % num_programs
        for e in range(first, tl.minimum(e0 + BLOCK_E, num_local), num_programs):
            at = ee == e - e0
            gap_begin = total(tl.where(at, starts + pairs, 0))
            gap_end = gap_begin + total(tl.where(at, aligned - pairs, 0))
            if has_w != 0:
                _zero_rows(w_out, gap_begin, gap_end, 1, 1, ROWS, 16)
            if zero_padding != 0:
                _zero_rows(p0_out, gap_begin, gap_end, w0, VEC, ROWS, BLOCK_W)
                _zero_rows(p1_out, gap_begin, gap_end, w1, VEC, ROWS, BLOCK_W)
    return starts, carry + total(aligned)


@triton.jit
def _report(read_counts, counts_host, num_rows, error_ptr):
    """A synchronizing call's received rows and error flag, by program 0 into counts_host.
    Every flag this call can raise is raised by then but the expand overflow, which its
    capacity rules out."""
    if (tl.program_id(0) == 0) & (read_counts != 0):
        tl.store(counts_host, num_rows)
        tl.store(counts_host + 1, tl.atomic_or(error_ptr, 0, sem="acquire", scope="gpu"))


@triton.jit
def _receive_part(bases_ptr, rank, num_ranks, flags_offset, region_offset, stride_tokens,
                  record_words, sync_ptr, call, hist_ptr, max_tokens, num_local, alignment,
                  capacity, out_rows, expand, zero_padding, tail, read_counts, counts_host,
                  idx_out, w_out, has_w, meta_out, rank_psum_out, expert_count_out,
                  expert_psum_out, p0_out, w0, off0, p1_out, w1, off1, x0_ptr, x1_ptr,
                  error_ptr, timeout, signature, K: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, GROUP: tl.constexpr,
                  ROWS: tl.constexpr, VEC: tl.constexpr, BLOCK_W: tl.constexpr,
                  ALL_ROWS: tl.constexpr, SCOPE: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < num_ranks
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    ee = tl.arange(0, BLOCK_E)

    # 1. Every source's records of this call have arrived; their counts. Late sources, sources
    # out of step and sources whose call had other arguments (their stamps) count as empty.
    own_base = tl.load(bases_ptr + rank)
    ready = own_counters(own_base, flags_offset, rr)
    await_counters(ready, rmask, call * num_programs, error_ptr, DISPATCH_TIMEOUT, timeout,
                   SCOPE)
    words = stamped_words(ready, own_counters(own_base, flags_offset + 2 * num_ranks * 8, rr), rr,
                          rmask, call, num_programs, signature, error_ptr, SCOPE)
    counts = (words & 0xFFFFFFFF).to(tl.int32)
    received = total(counts)
    if received > out_rows:  # only if ranks passed different num_max_tokens_per_rank
        tl.atomic_or(error_ptr, RECEIVE_OVERFLOW)  # rows past the outputs are dropped
    psum = tl.minimum(running_total(counts), out_rows)
    num_rows = tl.minimum(received, out_rows)
    if pid == 0:
        tl.store(rank_psum_out + rr, psum, mask=rmask)
    begin, end = program_chunk(num_rows)
    # phase-mark: receive-ready

    first_rows = hist_ptr + pid * num_local  # this program's row of [P, E_l]
    if ALL_ROWS == 0:
        # 2. Per compact row: ids, weights, source metadata (local expert ids in the
        # expand-row slots for now), compact payload. Per group of GROUP rows (program p's
        # i-th group is group p * groups_per_program + i, so groups follow the rows): its
        # pairs per local expert (group counts, expert-major [E_l, num_groups], zeroed first),
        # and each pair's rank among the group's earlier pairs of its expert in (row, slot)
        # order (a comparison of every two pairs of the group: small groups keep it cheap).
        chunk = (num_rows + num_programs - 1) // num_programs
        groups_per_program = (chunk + GROUP - 1) // GROUP
        num_groups = num_programs * groups_per_program
        first_group = pid * groups_per_program
        group_counts = hist_ptr + num_programs * num_local
        pair_ranks = group_counts + num_local * num_groups  # [rows, K]
        for group in range(first_group, first_group + groups_per_program):
            for e0 in range(0, num_local, BLOCK_E):
                tl.store(group_counts + (e0 + ee) * num_groups + group,
                         tl.full([BLOCK_E], 0, tl.int32), mask=e0 + ee < num_local)
        tl.debug_barrier()
        GROUPS: tl.constexpr = ROWS // GROUP  # groups per tile
        PAIRS: tl.constexpr = GROUP * BLOCK_K  # pair slots per group
        gg = tl.arange(0, GROUPS)
        qq = tl.arange(0, PAIRS)
        earlier = qq[None, :] < qq[:, None]
        for r0 in range(begin, end, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            source, rec, token, keys, meta = _take_rows(
                rows, rows < end, bases_ptr, rank, region_offset, stride_tokens, record_words,
                psum, counts, rr, num_local, max_tokens, expand, has_w, idx_out, w_out,
                meta_out, p0_out, w0, off0, p1_out, w1, off1, x0_ptr, x1_ptr, K, BLOCK_K, VEC,
                BLOCK_W)
            row_group = first_group + (rows - begin) // GROUP
            tl.atomic_add(group_counts + keys * num_groups + row_group[:, None], 1,
                          mask=keys >= 0, sem="relaxed", scope="gpu")
            grouped = tl.reshape(keys, [GROUPS, PAIRS])
            in_group = sum_along((earlier[None, :, :]
                                  & (grouped[:, None, :] == grouped[:, :, None])).to(tl.int32),
                                 2)
            pair_rows = (r0 + gg[:, None] * GROUP + qq[None, :] // BLOCK_K).to(tl.int64)
            tl.store(pair_ranks + pair_rows * K + qq[None, :] % BLOCK_K, in_group,
                     mask=grouped >= 0)
            tl.store(meta[:, None] + 2 + kk[None, :], keys,
                     mask=(rows < end)[:, None] & kmask[None, :])
        # phase-mark: receive-rows-copied
        grid_barrier(sync_ptr + SYNC_RECEIVE, error_ptr, DISPATCH_TIMEOUT, timeout)

        # phase-mark: receive-grid-barrier
        # 3. Each program owns a contiguous share of the experts: for each, the group counts
        # become exclusive prefixes over the groups (in place) and the total goes to the
        # per-expert counts. BLOCK_O experts at a time, their columns side by side in one
        # [BLOCK_O * BLOCK_T] block: one scan over the block, less each expert's start in it.
        own_begin, own_end = program_chunk(num_local)
        SCAN: tl.constexpr = BLOCK_O * BLOCK_T
        oo = tl.arange(0, BLOCK_O)
        flat = tl.arange(0, SCAN)
        for e0 in range(own_begin, own_end, BLOCK_O):
            columns_at = group_counts + (e0 + flat // BLOCK_T) * num_groups
            carry = tl.full([BLOCK_O], 0, tl.int32)
            for t0 in range(0, num_groups, BLOCK_T):
                at_group = t0 + flat % BLOCK_T
                fmask = (e0 + flat // BLOCK_T < own_end) & (at_group < num_groups)
                per_group = tl.load(columns_at + at_group, mask=fmask, other=0,
                                    cache_modifier=".cg")
                per_expert = sum_along(tl.reshape(per_group, [BLOCK_O, BLOCK_T]), 1)
                start = running_total(per_expert) - per_expert - carry  # in the scan, less carry
                tl.store(columns_at + at_group, running_total(per_group) - per_group - tl.reshape(
                    tl.broadcast_to(start[:, None], [BLOCK_O, BLOCK_T]), [SCAN]),
                    mask=fmask)
                carry += per_expert
            tl.store(expert_count_out + e0 + oo, carry, mask=e0 + oo < own_end)
        # phase-mark: receive-expert-totals
        grid_barrier(sync_ptr + SYNC_RECEIVE, error_ptr, DISPATCH_TIMEOUT, timeout)
        # phase-mark: receive-grid-barrier-2
        # Then, BLOCK_E experts at a time (so E_l never recompiles): every expert's aligned
        # first row, and the alignment gaps of the experts e % P == pid.
        carry = tl.full([], 0, tl.int32)
        for e0 in range(0, num_local, BLOCK_E):
            pairs = tl.load(expert_count_out + e0 + ee, mask=e0 + ee < num_local, other=0,
                            cache_modifier=".cg")
            starts, carry = _expert_starts(pairs, e0, carry, num_local, alignment, expand,
                                           has_w, zero_padding, read_counts, counts_host,
                                           expert_psum_out, w_out, p0_out, w0, p1_out, w1,
                                           VEC, ROWS, BLOCK_W, BLOCK_E)
            tl.store(first_rows + e0 + ee, starts, mask=e0 + ee < num_local)
        _report(read_counts, counts_host, num_rows, error_ptr)
        # phase-mark: receive-first-rows
        # 4. Expand row of every pair: its expert's first row, plus the expert's pairs in
        # earlier groups, plus its rank in the group. Tiles are independent.
        overflow = tl.full([], 0, tl.int32)
        tl.debug_barrier()
        for r0 in range(begin, end, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            n64 = rows.to(tl.int64)
            hmask = (rows < end)[:, None] & kmask[None, :]
            slots = meta_out + n64[:, None] * (K + 2) + 2 + kk[None, :]
            keys = tl.load(slots, mask=hmask, other=-1)
            valid = keys >= 0
            row_group = first_group + (rows - begin) // GROUP
            target = tl.load(first_rows + keys, mask=valid, other=0, cache_modifier=".cg") \
                + tl.load(group_counts + keys * num_groups + row_group[:, None], mask=valid,
                          other=0, cache_modifier=".cg") \
                + tl.load(pair_ranks + n64[:, None] * K + kk[None, :], mask=valid, other=0)
            fits = target < capacity
            overflow += total(total((valid & ~fits).to(tl.int32)))
            tl.store(slots, tl.where(fits, target, -1), mask=valid)
        # phase-mark: receive-expand-rows
        tl.debug_barrier()
        if expand != 0:
            for r0 in range(begin, end, ROWS):
                rows = r0 + tl.arange(0, ROWS)
                nmask = rows < end
                source, rec = _row_records(bases_ptr, rank, region_offset, stride_tokens,
                                           record_words, rows, psum, counts, rr)
                _expand_rows(rec, source, tl.load(i32_ptr(rec), mask=nmask),
                             meta_out + rows.to(tl.int64) * (K + 2), nmask, rank, w_out, has_w,
                             p0_out, w0, off0, p1_out, w1, off1, x0_ptr, x1_ptr, K, BLOCK_K,
                             VEC, BLOCK_W)
    else:
        # 2-4 without grid barriers (every received row's ids fit one block of ALL_ROWS):
        # every program counts every expert's pairs itself (and those in the rows before its
        # own), so it knows the experts' first rows and its pairs' expand rows in one pass.
        everything = tl.arange(0, ALL_ROWS)
        records = _row_records(bases_ptr, rank, region_offset, stride_tokens, record_words,
                               everything, psum, counts, rr)[1]
        ids = tl.reshape(_local_keys(records, everything < num_rows, rank, num_local, K,
                                     BLOCK_K), [ALL_ROWS * BLOCK_K])
        before_mine = tl.reshape(tl.broadcast_to((everything < begin)[:, None],
                                                 [ALL_ROWS, BLOCK_K]), [ALL_ROWS * BLOCK_K])
        carry = tl.full([], 0, tl.int32)
        for e0 in range(0, num_local, BLOCK_E):
            inside = (ids >= e0) & (ids < e0 + BLOCK_E)
            bins = tl.where(inside, ids - e0, 0)
            pairs = tl.histogram(bins, BLOCK_E, mask=inside)
            if pid == 0:
                tl.store(expert_count_out + e0 + ee, pairs, mask=e0 + ee < num_local)
            starts, carry = _expert_starts(pairs, e0, carry, num_local, alignment, expand,
                                           has_w, zero_padding, read_counts, counts_host,
                                           expert_psum_out, w_out, p0_out, w0, p1_out, w1,
                                           VEC, ROWS, BLOCK_W, BLOCK_E)
            tl.store(first_rows + e0 + ee,
                     starts + tl.histogram(bins, BLOCK_E, mask=inside & before_mine),
                     mask=e0 + ee < num_local)
        _report(read_counts, counts_host, num_rows, error_ptr)
        # phase-mark: receive-layout
        QUAD: tl.constexpr = ROWS * BLOCK_K  # pair slots per tile
        qq = tl.arange(0, QUAD)
        earlier = qq[None, :] < qq[:, None]
        overflow = tl.full([], 0, tl.int32)
        for r0 in range(begin, end, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            nmask = rows < end
            tl.debug_barrier()  # first_rows as the tile before left it
            source, rec, token, keys, meta = _take_rows(
                rows, nmask, bases_ptr, rank, region_offset, stride_tokens, record_words, psum,
                counts, rr, num_local, max_tokens, expand, has_w, idx_out, w_out, meta_out,
                p0_out, w0, off0, p1_out, w1, off1, x0_ptr, x1_ptr, K, BLOCK_K, VEC, BLOCK_W)
            # Expand row: the expert's first row for this program, plus its pairs in earlier
            # tiles (added to first_rows below), plus its rank among the tile's pairs.
            flat = tl.reshape(keys, [QUAD])
            in_tile = sum_along((earlier & (flat[None, :] == flat[:, None])).to(tl.int32), 1)
            valid = keys >= 0
            target = tl.load(first_rows + keys, mask=valid, other=0, cache_modifier=".cg") \
                + tl.reshape(in_tile, [ROWS, BLOCK_K])
            fits = target < capacity
            overflow += total(total((valid & ~fits).to(tl.int32)))
            tl.store(meta[:, None] + 2 + kk[None, :], tl.where(valid & fits, target, -1),
                     mask=nmask[:, None] & kmask[None, :])
            tl.debug_barrier()  # every thread has read first_rows and written the metadata
            tl.atomic_add(first_rows + keys, 1, mask=valid, sem="relaxed", scope="gpu")
            if expand != 0:
                _expand_rows(rec, source, token, meta, nmask, rank, w_out, has_w, p0_out, w0,
                             off0, p1_out, w1, off1, x0_ptr, x1_ptr, K, BLOCK_K, VEC, BLOCK_W)
        # phase-mark: receive-rows-placed
    if overflow > 0:
        tl.atomic_or(error_ptr, EXPAND_OVERFLOW)
    if tail != 0:  # capacity-sized outputs: everything past the valid prefix
        share = (out_rows - num_rows + num_programs - 1) // num_programs
        tail_begin = num_rows + pid * share
        _clear_rows(tail_begin, tl.minimum(tail_begin + share, out_rows), meta_out, idx_out,
                    w_out, expand, has_w, zero_padding, p0_out, w0, p1_out, w1, K, BLOCK_M,
                    VEC, ROWS, BLOCK_W)
        if expand != 0:
            share = (capacity - carry + num_programs - 1) // num_programs
            tail_begin = carry + pid * share
            tail_end = tl.minimum(tail_begin + share, capacity)
            if has_w != 0:
                _zero_rows(w_out, tail_begin, tail_end, 1, 1, ROWS, 16)
            if zero_padding != 0:
                _zero_rows(p0_out, tail_begin, tail_end, w0, VEC, ROWS, BLOCK_W)
                _zero_rows(p1_out, tail_begin, tail_end, w1, VEC, ROWS, BLOCK_W)
    # phase-mark: receive-done
    # 5. This program is done with the staging region.
    add_counters(peer_counters(tl.load(bases_ptr + rr, mask=rmask, other=0),
                               flags_offset + num_ranks * 8, rank), rmask, SCOPE)


@triton.jit(do_not_specialize=[
    "rank", "num_ranks", "flags_offset", "region_offset", "stride_tokens", "record_words",
    "timeout", "signature", "do_send", "do_receive", "num_tokens", "num_experts", "copy_idx",
    "has_w", "w0", "off0", "w1", "off1", "max_tokens", "num_local", "alignment", "capacity",
    "out_rows", "expand", "zero_padding", "tail", "read_counts", "has_w_out", "v0", "o0", "v1",
    "o1"])
def dispatch_kernel(bases_ptr, rank, num_ranks, flags_offset, region_offset, stride_tokens,
                    record_words, sync_ptr, error_ptr, timeout, signature, do_send, do_receive,
                    counts_scratch, pos_scratch, idx_ptr, num_tokens, num_experts, idx_copy,
                    copy_idx, weights_ptr, has_w, p0_ptr, w0, off0, p1_ptr, w1, off1, slot_out,
                    hist_ptr, max_tokens, num_local, alignment, capacity, out_rows, expand,
                    zero_padding, tail, read_counts, counts_host, idx_out, w_out, has_w_out,
                    meta_out, rank_psum_out, expert_count_out, expert_psum_out, q0_out, v0, o0,
                    q1_out, v1, o1, K: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr, GROUP: tl.constexpr,
                    ROWS: tl.constexpr, VEC: tl.constexpr, BLOCK_W: tl.constexpr,
                    BLOCK_P: tl.constexpr, ALL_TOKENS: tl.constexpr, ALL_ROWS: tl.constexpr,
                    SCOPE: tl.constexpr):
    """The send part, the receive part or both (`do_send`, `do_receive`), in one launch."""
    if do_send != 0:
        _send_part(bases_ptr, rank, num_ranks, flags_offset, region_offset, stride_tokens,
                   record_words, sync_ptr, counts_scratch, pos_scratch, idx_ptr,
                   num_tokens, num_experts, idx_copy, copy_idx, weights_ptr, has_w,
                   p0_ptr, w0, off0, p1_ptr, w1, off1, slot_out, error_ptr, timeout, signature,
                   K, BLOCK_K, BLOCK_R, ROWS, VEC, BLOCK_W, BLOCK_P, ALL_TOKENS, SCOPE)
    # The send part's counter (slot 0) gains P per call, 1 from each program's send part: this
    # program's has added, here in this launch or in an earlier launch of this stream, so
    # the counter is past (call - 1) * P and at most call * P. (Returning the send part's
    # number instead, merged from two branches, cost the copies their 16-byte accesses in
    # Triton 3.9: scripts/compile_sm90.py.)
    num_programs = tl.num_programs(0)
    call = (tl.load(sync_ptr + 0, volatile=True) + num_programs - 1) // num_programs
    if do_receive != 0:
        _receive_part(bases_ptr, rank, num_ranks, flags_offset, region_offset, stride_tokens,
                      record_words, sync_ptr, call, hist_ptr, max_tokens, num_local, alignment,
                      capacity, out_rows, expand, zero_padding, tail, read_counts,
                      counts_host, idx_out, w_out, has_w_out, meta_out, rank_psum_out,
                      expert_count_out, expert_psum_out, q0_out, v0, o0, q1_out, v1, o1, p0_ptr,
                      p1_ptr, error_ptr, timeout, signature, K, BLOCK_K, BLOCK_M, BLOCK_R, BLOCK_E,
                      BLOCK_T, BLOCK_O, GROUP, ROWS, VEC, BLOCK_W, ALL_ROWS, SCOPE)


def variant(topk_idx: torch.Tensor, weights: Optional[torch.Tensor],
            rows: Sequence[torch.Tensor], idx_out_dtype: torch.dtype) -> Optional[tuple]:
    """The compiled variant of a launch with these caller tensors: the dtypes of topk_idx and
    of the receive part's idx_out (int32 when there is none), or None when a caller pointer is
    not 16-byte aligned (the generic path; the backend's own tensors always are)."""
    if not aligned(topk_idx, weights, *rows):
        return None
    return topk_idx.dtype, idx_out_dtype


def one_block(shape: KernelShape, max_rows: int) -> tuple[int, int]:
    """(ALL_TOKENS, ALL_ROWS) of `dispatch_kernel` for a buffer receiving up to `max_rows` rows
    (R * S): the blocks that hold every token's destinations ([S, K, R]) and every received
    row's ids ([R * S, K]) when they fit `_ONE_BLOCK` elements (and the receive tile at most 64
    pairs), else 0, the grid-barrier paths.

    Example (GPU): R 1, S 128, K 8, 4-row tiles: (128, 128); S 4096: (0, 0)."""
    block_k = next_power_of_2(shape.num_topk)
    all_tokens = next_power_of_2(max_rows // shape.num_ranks)
    all_rows = next_power_of_2(max_rows)
    return (all_tokens if all_tokens * block_k * shape.block_r <= _ONE_BLOCK else 0,
            all_rows if all_rows * block_k <= _ONE_BLOCK and shape.rows * block_k <= 64 else 0)


def launcher(shape: KernelShape, layout: RecordLayout, max_rows: int) -> Launcher:
    """The `Launcher` of `dispatch_kernel` for records of `layout`, receiving up to `max_rows`
    rows (R * S): the one-block paths where they fit (`one_block`); on the grid-barrier path an
    expert's prefix over the groups takes one step when they fit `_BLOCK_T`, in a block no
    wider than the groups there can be, with as many experts side by side as fill `_BLOCK_T`."""
    block_t = min(_BLOCK_T, next_power_of_2(num_groups(shape.programs, shape.rows, max_rows)))
    all_tokens, all_rows = one_block(shape, max_rows)
    return shape.launcher(dispatch_kernel, BLOCK_M=next_power_of_2(layout.num_topk + 2),
                          BLOCK_E=_BLOCK_E, BLOCK_T=block_t, BLOCK_O=_BLOCK_T // block_t,
                          GROUP=rank_group(shape.rows), ALL_TOKENS=all_tokens,
                          ALL_ROWS=all_rows)


def send_phase(counts_scratch, pos_scratch, topk_idx, num_experts: int,
               weights: Optional[torch.Tensor], rows: Sequence[torch.Tensor],
               layout: RecordLayout, slot_out, idx_copy=None) -> dict:
    """The source side of a dispatch, as `dispatch_kernel`'s arguments by name.

    topk_idx: [T, K] int32/int64 global expert ids; weights: [T, K] fp32 or None; rows: the
    payload tensors [T, *]; slot_out: [T, K] int32, receives `d * S + p` for a slot whose rank d
    gets the token as its p-th, -1 for an invalid slot; idx_copy (like topk_idx, or None)
    receives a copy of topk_idx. counts_scratch: int32 [P * next_pow2(R)], pos_scratch: int32
    [>= T * R]. Any tensor may be a `launcher.Address` stand-in (a prepared call's template).

    Example (one rank, E 4, S 4, K 2, x = bf16 [[1, 2], [3, 4]] (one word per row; records of
    12 words: header 5, payload at word 8), topk_idx = [[0, 3], [-1, -1]], no weights): record
    0 of the heap = [0 | 0 3 | . . | . . . | .] (the payload of a rank's own rows stays in x,
    where its receive part reads it), slot_out = [[0, 0], [-1, -1]], the ready counter += P,
    count slot = 1.
    """
    has_w = weights is not None
    return dict(counts_scratch=counts_scratch, pos_scratch=pos_scratch, idx_ptr=topk_idx,
                num_tokens=topk_idx.shape[0], num_experts=num_experts,
                idx_copy=topk_idx if idx_copy is None else idx_copy,
                copy_idx=int(idx_copy is not None),
                weights_ptr=weights.view(torch.int32) if has_w else counts_scratch,
                has_w=int(has_w), slot_out=slot_out,
                **_fields(rows, layout, ("p0_ptr", "w0", "off0", "p1_ptr", "w1", "off1")))


# Experts per step of the receive-side scan (E_l <= 256 takes one step on the GPU) and at most
# this many groups per step of an expert's prefix over the groups (DeepSeek-V3 at EP=1: 132
# programs x 63 groups of 4 rows, 5 steps; 8192 in 2 steps measured 94.5 us instead of 88.8 for
# the compact dispatch on the H200: 255 registers; a buffer with fewer groups scans a block
# of just its groups, and as many of its E_l / P experts side by side as fill _BLOCK_T: at 128
# tokens a 2048-wide scan per expert took 33 of the kernel's 58 us, and 8 experts scanned one
# after another 3.3 us of 21). Small under the interpreter, whose scans cost about 80 us per
# element.
_BLOCK_E = 16 if INTERPRET else 256
_BLOCK_T = 16 if INTERPRET else 2048
# Elements of the one-block paths' largest block (`one_block`): on the GPU the destinations of
# 128 tokens at top-8 to 8 ranks, or the ids of 1024 received rows; under the interpreter small
# enough that the CPU tests run both paths (2 ranks of 8 tokens at top-3 one block, 3 ranks the
# grid barriers).
_ONE_BLOCK = 64 if INTERPRET else 8192
# Rows per rank group: the group's K * rows pairs are compared all with all, so the cost per
# row grows with the group (the interpreter runs two groups per tile, as the GPU does four).
_RANK_ROWS = 2 if INTERPRET else 4


def rank_group(rows: int) -> int:
    """Rows per rank group of the receive part (it divides the tile's `rows`)."""
    return min(rows, _RANK_ROWS)


def hist_scratch_words(programs: int, rows: int, max_rows: int, num_local: int,
                       num_topk: int) -> int:
    """int32 words of the receive part's scratch for P `programs`, tiles of `rows` rows, up to
    `max_rows` received rows and `num_local` experts: a first-row row per program, the group
    counts of every expert, then a rank per (row, slot) pair."""
    return num_local * (programs + num_groups(programs, rows, max_rows)) + max_rows * num_topk


def num_groups(programs: int, rows: int, max_rows: int) -> int:
    """Rank groups of the receive part for P `programs`, tiles of `rows` rows and up to
    `max_rows` received rows (each program's share of the rows, rounded up to whole groups)."""
    chunk = -(-max_rows // programs)  # rows per program, rounded up
    return programs * -(-chunk // rank_group(rows))


def receive_phase(hist_scratch, layout, *, max_tokens: int,
                  num_local: int, alignment: int, capacity: int, out_rows: int, expand: bool,
                  zero_padding: bool, tail: bool, idx_out, weights_out, metadata, rank_psum,
                  expert_counts, expert_psum, rows_out, counts_host=None) -> dict:
    """The destination side of a dispatch, as `dispatch_kernel`'s arguments by name.

    Outputs (see docs/semantics.md): rank_psum [R], expert_counts [E_l], expert_psum [E_l]
    (int32); metadata [out_rows, K + 2] int32, idx_out [out_rows, K] (compact),
    weights_out (compact [out_rows, K], expand [capacity] fp32, or None) and rows_out (the
    payload tensors: out_rows (compact) or capacity (expand) rows). `capacity`: expand rows that
    exist (pairs past it are dropped and flagged). `tail`: rows past the received prefix get
    -1 / 0 (sync-free outputs). Rows past `out_rows` (only possible when ranks passed different
    num_max_tokens_per_rank) are dropped and flag `errors.RECEIVE_OVERFLOW`. hist_scratch: int32
    [hist_scratch_words(P, ROWS, rows, E_l, K)] for the rows received. counts_host: None, or
    int32 [2 + E_l] in pinned host memory (a synchronizing call's counts, read there without a
    copy): gets the received rows, the error flag (every flag of the call but the expand
    overflow, which its capacity rules out) and the aligned per-expert counts. Tensors may be
    `Address` stand-ins as in `send_phase`.

    Example (one rank, E_l 4, alignment 2, compact, after the `send_phase` example):
    rank_psum = [1], expert_counts = [1, 0, 0, 1], expert_psum = [2, 2, 2, 4],
    idx_out = [[0, 3]], metadata = [[0, 1, 0, 2]], rows_out = [x[0]]; with counts_host, it
    gets [1, 0, 2, 0, 0, 2].
    """
    payload = rows_out if rows_out else [metadata]
    return dict(hist_ptr=hist_scratch, max_tokens=max_tokens, num_local=num_local,
                alignment=alignment, capacity=capacity, out_rows=out_rows, expand=int(expand),
                zero_padding=int(zero_padding), tail=int(tail),
                read_counts=int(counts_host is not None),
                counts_host=metadata if counts_host is None else counts_host,
                idx_out=metadata if idx_out is None else idx_out,
                w_out=metadata if weights_out is None else weights_out.view(torch.int32),
                has_w_out=int(weights_out is not None), meta_out=metadata,
                rank_psum_out=rank_psum, expert_count_out=expert_counts,
                expert_psum_out=expert_psum,
                **_fields(payload, layout if rows_out else RecordLayout(layout.num_topk, (0,)),
                          ("q0_out", "v0", "o0", "q1_out", "v1", "o1")))


def arguments(stage: Stage, layout: RecordLayout, sync, error, timeout: int, send: dict,
              receive: dict, *, do_send: bool = True, do_receive: bool = True) -> dict:
    """Every argument of one launch of `dispatch_kernel` by name (its constexprs excepted).
    The stamps' signature covers what every rank's call must agree on: num_experts,
    num_max_tokens_per_rank, the record layout (bf16 or FP8 rows) and whether weights travel."""
    signature = call_signature(send["num_experts"], receive["max_tokens"], layout.words,
                               *layout.payload_words, send["has_w"])
    return dict(stage.fields, record_words=layout.words, sync_ptr=sync, error_ptr=error,
                timeout=timeout, signature=signature, do_send=int(do_send),
                do_receive=int(do_receive), **send, **receive)


def run(shape: KernelShape, stage: Stage, layout: RecordLayout, sync, error, timeout: int,
        send: dict, receive: dict, *, do_send: bool = True, do_receive: bool = True,
        stream=None, variant: Optional[tuple] = None, kernel: Optional[Launcher] = None) -> None:
    """One launch of `dispatch_kernel` on `shape.programs` programs: the send part, then the
    receive part, or one of them (a part that does not run still needs its arguments, of the
    dtypes the warmed-up variant has: pass the same `send` again for a receive-only launch).
    sync: the int64 sync tensor; error: the int32 error flag; timeout: `sync.timeout_units`;
    variant: `variant(...)` of the launch's tensors (None: the generic path); kernel:
    `launcher(shape, layout, R * S)`, if the caller keeps it."""
    kernel = kernel or launcher(shape, layout, shape.num_ranks * stage.stride_tokens)
    kernel(variant, stream, arguments(stage, layout, sync, error, timeout, send, receive,
                                      do_send=do_send, do_receive=do_receive))
