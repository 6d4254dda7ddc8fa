"""Pack and unpack kernels of the collective backend on a GPU.

The collective backend moves records with one `all_to_all_single` per direction (its module
docstring has the wire format: per destination block a header row of int64 words, then one
record per token; a dispatch record `[payload | src + 1 | K ids + 1 | K weights]`, a combine
record `[bf16 row | K weights]`). On a GPU these kernels build the send buffer and read the
receive buffer in a few launches where the torch path needs one operation per field (about 180
per dispatch, each a launch of 20-25 us of host time).

Dispatch (every kernel but `header_kernel` on the same P programs; a program's tokens or rows
are one contiguous chunk, `program_chunk`):
1. `count_kernel`: tokens per destination of each program's chunk; ids outside [-1, E) flag.
   For a synchronizing call also the slots per expert, which travel in the count exchange
   (the host then knows every size of the call after that one read); `header_kernel` builds
   the rows of that exchange.
2. `pack_kernel`: each token's position per destination (earlier programs' counts, then token
   order: deterministic), the records and, by program 0, every block's header (the call's
   sequence number advanced on the device). Also the handle's `dst_buffer_slot_idx`.
3. the all-to-all (the caller).
4. `unpack_kernel`: the received blocks' counts (from their headers, or exact from the count
   exchange), the header check, then per compact row its metadata, local ids, weights and
   (compact) payload; each program's pairs per local expert.
5. `expert_prefix_kernel`: per local expert, the exclusive prefix of those counts over the
   programs (in place) and its total.
6. `expand_kernel`: every expert's aligned start, then each pair's expand row (start + earlier
   programs' pairs + the program's earlier pairs in (row, slot) order), the expand payload and
   weights, and the gaps.

A rank's own block does not travel: every buffer holds the other ranks' blocks in rank order,
and a receiving one this rank's own block first, which the pack kernels write there directly
(`_block_starts`). Its payload is not copied at all where the caller's rows can be read
instead: the dispatch's unpack and expand read their own rows from the dispatch's x, and the
compact combine's reduce reads them from the combine's x; only the expand combine's sums go
through the own block.

Combine: `combine_pack_kernel` (each received row, or in the expand layout the fp32 sum of its
expand rows rounded once, back into the record it came in; headers), the all-to-all,
`combine_reduce_kernel` (per token: biases, then the row of each rank in the order of the
token's last slot per rank, summed in fp32, rounded once; header check).

Big buffers (send and receive rows, payload rows) are passed as int64 addresses; the kernels
know nothing of process groups.
"""
from __future__ import annotations

import inspect

import triton
import triton.language as tl

from .combine import half_ptrs
from .common import (bf16_to_f32, columns, copy_rows, f32_to_bf16, flag_mask, i32_ptr,
                     max_along, program_chunk, running_total, sum_along, total, word_ptrs)
from .dispatch import _destinations, _expand_field, tile_positions
from .. import errors
from .sync import (CALL_MISMATCH, EXPAND_OVERFLOW, INVALID_EXPERT_ID, MISMATCH_PEER_SHIFT,
                   OUT_OF_STEP, RECEIVE_OVERFLOW)

def _kernel(pointers: str):
    """`triton.jit` of a kernel whose integer parameters (every runtime parameter not named in
    `pointers`) are all `do_not_specialize`: a kept compiled kernel is launched with any
    value (`kernels.launcher`)."""
    def jit(fn):
        ints = [name for name, param in inspect.signature(fn).parameters.items()
                if name not in pointers.split() and "constexpr" not in str(param.annotation)]
        return triton.jit(do_not_specialize=ints)(fn)
    return jit


# The header row: int64 words, NUM_FIELDS call fields (the sequence number first), then the
# block's record count.
NUM_FIELDS = tl.constexpr(len(errors.CALL_FIELDS))
BLOCK_F = 1 << len(errors.CALL_FIELDS).bit_length()  # the header's words as one block (host)


@triton.jit
def _i64_ptr(addr):
    return addr.to(tl.pointer_type(tl.int64))


@triton.jit
def _block_starts(counts, rr, num_ranks, max_tokens, exact, rank, own):
    """First row (the header) of each rank's block in a buffer: exact blocks (count + 1 rows
    each) or padded ones (max_tokens + 1 rows each), this rank's own block first, then the
    others in rank order. The own block never travels: `own` 1 for a receiving buffer, which
    holds it (row 0), 0 for a sending one, which does not (its start is then meaningless).

    Example (R = 3, rank 1, exact, counts [2, 5, 1]): receiving [6, 0, 9], sending [0, 0, 3]
    (the own block's 0 unused)."""
    sizes = tl.where(rr < num_ranks, tl.where(exact != 0, counts + 1, max_tokens + 1), 0)
    sizes = tl.where(rr == rank, sizes * own, sizes)
    key = tl.where(rr == rank, -1, rr)
    return sum_along(tl.where(key[None, :] < key[:, None], sizes[None, :], 0), 1).to(tl.int64)


@triton.jit
def _rows_of(n, psum, counts, starts, rr):
    """(inside, row, source) of compact rows n (source-major over the blocks whose counts and
    inclusive prefix are given): whether n is a received row, its buffer row and its block's
    rank."""
    block = sum_along((psum[None, :] <= n[:, None]).to(tl.int32), 1)
    pick = rr[None, :] == block[:, None]
    first = sum_along(tl.where(pick, (psum - counts)[None, :], 0), 1)
    start = sum_along(tl.where(pick, starts[None, :], 0), 1)
    return n < total(counts), start + 1 + (n - first), block


@triton.jit
def _check_headers(buf_addr, record_words, starts, rmask, fields_ptr, seq_ptr, flags_ptr,
                   rr, BLOCK_F: tl.constexpr):
    """Compare each block's header (fields only) with this call's (`seq_ptr`'s value, then
    `fields_ptr`): OUT_OF_STEP for the sequence number, CALL_MISMATCH for another field, and
    the first peer that differs (when none is recorded yet) into the flags."""
    ff = tl.arange(0, BLOCK_F)
    fmask = ff < NUM_FIELDS
    got = tl.load(_i64_ptr(buf_addr + starts * record_words * 4)[:, None] + ff[None, :],
                  mask=rmask[:, None] & fmask[None, :], other=0)
    fields = tl.load(fields_ptr + ff - 1, mask=(ff >= 1) & fmask, other=0)
    want = tl.where(ff == 0, tl.load(seq_ptr), fields)
    differs = (got != want[None, :]) & rmask[:, None] & fmask[None, :]
    seq_bad = total(total((differs & (ff == 0)[None, :]).to(tl.int32)))
    other_bad = total(total((differs & (ff > 0)[None, :]).to(tl.int32)))
    peer_bad = max_along(differs.to(tl.int32), 1)
    first_peer = -max_along(tl.where(peer_bad > 0, -rr, -(1 << 20)), 0)
    bits = tl.where(seq_bad > 0, OUT_OF_STEP, 0) | tl.where(other_bad > 0, CALL_MISMATCH, 0)
    if bits != 0:
        old = tl.load(flags_ptr)
        if (old >> MISMATCH_PEER_SHIFT) == 0:
            bits = bits | ((first_peer + 1) << MISMATCH_PEER_SHIFT)
        tl.atomic_or(flags_ptr, bits)


@triton.jit
def _write_headers(bases, record_words, starts, counts, rmask, fields_ptr, seq_ptr, bump,
                   BLOCK_F: tl.constexpr):
    """Each block's header row (block r in the buffer at address bases[r]): the call's
    sequence number (advanced first when `bump`), its fields, the block's count. Program 0
    only."""
    ff = tl.arange(0, BLOCK_F)
    seq = tl.load(seq_ptr) + bump
    if bump != 0:
        tl.store(seq_ptr, seq)
    fields = tl.load(fields_ptr + ff - 1, mask=(ff >= 1) & (ff < NUM_FIELDS), other=0)
    row = tl.where(ff == 0, seq, fields)[None, :] + counts.to(tl.int64)[:, None] * 0
    row = tl.where(ff[None, :] == NUM_FIELDS, counts.to(tl.int64)[:, None], row)
    tl.store(_i64_ptr(bases + starts * record_words * 4)[:, None] + ff[None, :], row,
             mask=rmask[:, None] & (ff <= NUM_FIELDS)[None, :])


@triton.jit
def _zero_masked(addr, rows, mask, num_words, VEC: tl.constexpr, BLOCK_W: tl.constexpr):
    """Rows `rows` (int64) of the int32-word rows at address `addr` = 0 where `mask`."""
    dst = word_ptrs(addr + rows * num_words * 4, VEC)
    num_words = tl.multiple_of(num_words, VEC)
    for start in range(0, num_words, BLOCK_W):
        offs = start + tl.arange(0, BLOCK_W)
        tl.store(dst[:, None] + offs[None, :], tl.full([BLOCK_W], 0, tl.int32)[None, :],
                 mask=mask[:, None] & columns(offs, num_words, VEC)[None, :])


@_kernel("idx_ptr counts_ptr flags_ptr experts_ptr")
def count_kernel(idx_ptr, num_tokens, num_experts, num_ranks, counts_ptr, flags_ptr,
                 experts_ptr, per_expert, K: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_R: tl.constexpr, ROWS: tl.constexpr):
    """counts[p, r]: tokens of program p's chunk that go to rank r ([P, BLOCK_R] int32). With
    `per_expert`: also adds each valid slot to experts[e] ([E] int64, zeroed by the caller;
    integer atomics, so the sums do not depend on their order)."""
    pid = tl.program_id(0)
    rr = tl.arange(0, BLOCK_R)
    begin, end = program_chunk(num_tokens)
    sent_here = tl.full([BLOCK_R], 0, tl.int32)
    bad = tl.full([], 0, tl.int32)
    for t0 in range(begin, end, ROWS):
        tt = t0 + tl.arange(0, ROWS)
        ids, _, sent, bad_ids = _destinations(idx_ptr, tt, tt < end, num_experts, num_ranks,
                                              rr, K, BLOCK_K)
        sent_here += total(sent)
        bad += bad_ids
        if per_expert != 0:
            tl.atomic_add(experts_ptr + ids, tl.full(ids.shape, 1, tl.int64), mask=ids >= 0,
                          sem="relaxed", scope="gpu")
    tl.store(counts_ptr + pid * BLOCK_R + rr, sent_here)
    if bad > 0:
        tl.atomic_or(flags_ptr, INVALID_EXPERT_ID)


@_kernel("counts_ptr flags_ptr experts_ptr fields_ptr seq_ptr rows_ptr")
def header_kernel(counts_ptr, num_programs, num_ranks, flags_ptr, experts_ptr, num_local,
                  fields_ptr, seq_ptr, rows_ptr, row_words, extra, BLOCK_P: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr):
    """The header rows of a dispatch's count exchange, by one program, after `count_kernel`
    (`num_programs` rows of counts): [R, row_words] int64, per destination d the call's
    sequence number (advanced here), its fields after it, the records for d; then with `extra`
    this rank's error flag, its records for every rank and the slots for each of d's local
    experts (`experts[d * num_local:][:num_local]`, zeroed here for the next call).

    Example (R = 1, two programs, extra, E_l = 2): counts [[2], [1]], sequence number 4,
    fields F, flag 0, experts [2, 1] -> rows [[5, *F, 3, 0, 3, 2, 1]] and experts [0, 0]."""
    pp = tl.arange(0, BLOCK_P)
    rr = tl.arange(0, BLOCK_R)
    ff = tl.arange(0, BLOCK_F)
    ee = tl.arange(0, BLOCK_E)
    rmask = rr < num_ranks
    counts = tl.load(counts_ptr + pp[:, None] * BLOCK_R + rr[None, :],
                     mask=(pp < num_programs)[:, None] & rmask[None, :], other=0)
    sends = total(counts).to(tl.int64)
    seq = tl.load(seq_ptr) + 1
    tl.store(seq_ptr, seq)
    flags = tl.load(flags_ptr).to(tl.int64)
    fields = tl.load(fields_ptr + ff - 1, mask=(ff >= 1) & (ff < NUM_FIELDS), other=0)
    head = tl.where(ff == 0, seq, tl.where(ff == NUM_FIELDS + 1, flags, fields))
    for d in range(num_ranks):
        row = rows_ptr + d * row_words
        words = tl.where(ff == NUM_FIELDS, sum_along(tl.where(rr == d, sends, 0), 0), head)
        tl.store(row + ff, words, mask=ff < NUM_FIELDS + 1 + extra)
        if extra != 0:
            tl.store(row + NUM_FIELDS + 2 + rr, sends, mask=rmask)
            for e0 in range(0, num_local, BLOCK_E):
                emask = e0 + ee < num_local
                at = experts_ptr + d * num_local + e0 + ee
                tl.store(row + NUM_FIELDS + 2 + num_ranks + e0 + ee, tl.load(at, mask=emask),
                         mask=emask)
                tl.store(at, tl.full([BLOCK_E], 0, tl.int64), mask=emask)


@triton.jit
def _pack_field(src, num_words, field, send_addr, record_words, rows, live, tmask, num_ranks,
                VEC: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_R: tl.constexpr):
    """Each token row src[i] (int32 pointers) loaded once if some `live[i, r]`, stored at word
    `field` of its record row `rows[i, r]` for every rank r where `live[i, r]`."""
    num_words = tl.multiple_of(num_words, VEC)
    tmask = tmask & (max_along(live, 1) > 0)
    for start in range(0, num_words, BLOCK_W):
        offs = start + tl.arange(0, BLOCK_W)
        wmask = columns(offs, num_words, VEC)
        value = tl.load(src[:, None] + offs[None, :], mask=tmask[:, None] & wmask[None, :])
        for d in range(num_ranks):
            row = sum_along(tl.where(tl.arange(0, BLOCK_R)[None, :] == d, rows, 0), 1)
            go = max_along(tl.where(tl.arange(0, BLOCK_R)[None, :] == d, live, 0), 1)
            dst = word_ptrs(send_addr + row * record_words * 4 + field * 4, VEC)
            tl.store(dst[:, None] + offs[None, :], value,
                     mask=(tmask & (go > 0))[:, None] & wmask[None, :])


@_kernel("idx_ptr weights_ptr counts_ptr pos_ptr slot_ptr send_counts_ptr idx_copy fields_ptr seq_ptr")
def pack_kernel(idx_ptr, weights_ptr, has_w, num_tokens, num_experts, num_ranks, rank,
                max_tokens, counts_ptr, send_addr, recv_addr, record_words, p0_addr, w0, p1_addr,
                w1, off1, meta_off, pos_ptr, slot_ptr, send_counts_ptr, idx_copy, copy_idx,
                fields_ptr, seq_ptr, bump, exact, K: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_F: tl.constexpr,
                ROWS: tl.constexpr, VEC: tl.constexpr, BLOCK_W: tl.constexpr):
    """Records of this program's tokens into the send rows, and those for this rank into its
    own block of the receive rows without their payload (see the module docstring)."""
    pid = tl.program_id(0)
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < num_ranks
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    pp = tl.arange(0, BLOCK_P)
    counts = tl.load(counts_ptr + pp[:, None] * BLOCK_R + rr[None, :],
                     mask=(pp < tl.num_programs(0))[:, None], other=0)
    running = total(tl.where((pp < pid)[:, None], counts, 0))
    sent_total = total(counts)
    starts = _block_starts(sent_total, rr, num_ranks, max_tokens, exact, rank, 0)
    if pid == 0:
        tl.store(send_counts_ptr + rr, sent_total, mask=rmask)
        _write_headers(tl.where(rr == rank, recv_addr, send_addr), record_words, starts,
                       sent_total, rmask, fields_ptr, seq_ptr, bump, BLOCK_F)
    begin, end = program_chunk(num_tokens)
    for t0 in range(begin, end, ROWS):
        tt = t0 + tl.arange(0, ROWS)
        tmask = tt < end
        t64 = tt.to(tl.int64)
        hmask = tmask[:, None] & kmask[None, :]
        ids, sent, positions, running = tile_positions(
            idx_ptr, tt, tmask, num_experts, num_ranks, rr, running, pos_ptr, slot_ptr,
            max_tokens, K, BLOCK_K, ROWS)
        if copy_idx != 0:
            at = t64[:, None] * K + kk[None, :]
            tl.store(idx_copy + at, tl.load(idx_ptr + at, mask=hmask), mask=hmask)
        rows = starts[None, :] + 1 + positions
        live = (sent > 0) & tmask[:, None]
        peers = live & (rr != rank)[None, :]  # (the own rows' payload stays in x)
        weights = tl.load(weights_ptr + t64[:, None] * K + kk[None, :],
                          mask=flag_mask(hmask, has_w), other=0.0).to(tl.int32, bitcast=True)
        src = (rank * max_tokens + tt + 1).to(tl.int32)
        for d in range(num_ranks):
            row = sum_along(tl.where(rr[None, :] == d, rows, 0), 1)
            go = tmask & (max_along(tl.where(rr[None, :] == d, live.to(tl.int32), 0), 1) > 0)
            base = tl.where(d == rank, recv_addr, send_addr)
            meta = i32_ptr(base + row * record_words * 4) + meta_off
            tl.store(meta, src, mask=go)
            tl.store(meta[:, None] + 1 + kk[None, :], (ids + 1).to(tl.int32),
                     mask=go[:, None] & kmask[None, :])
            tl.store(meta[:, None] + 1 + K + kk[None, :], weights,
                     mask=flag_mask(go[:, None] & kmask[None, :], has_w))
        _pack_field(word_ptrs(p0_addr + t64 * w0 * 4, VEC), w0, 0, send_addr, record_words,
                    rows, peers.to(tl.int32), tmask, num_ranks, VEC, BLOCK_W, BLOCK_R)
        _pack_field(word_ptrs(p1_addr + t64 * w1 * 4, VEC), w1, off1, send_addr, record_words,
                    rows, peers.to(tl.int32), tmask, num_ranks, VEC, BLOCK_W, BLOCK_R)


@triton.jit
def _received(recv_addr, record_words, rr, num_ranks, rank, max_tokens, exact, counts_ptr,
              counts_stride, flags_ptr, BLOCK_R: tl.constexpr):
    """(counts, inclusive prefix, block starts) of the received blocks: exact blocks take the
    counts from the rows of the count exchange (int64 [R, counts_stride] at `counts_ptr`, the
    header of source r in row r); padded ones read them from the headers in the buffer (more
    than max_tokens flags RECEIVE_OVERFLOW and is cut)."""
    rmask = rr < num_ranks
    if exact != 0:
        counts = tl.load(counts_ptr + rr * counts_stride + NUM_FIELDS, mask=rmask,
                         other=0).to(tl.int32)
    else:
        starts = _block_starts(rr, rr, num_ranks, max_tokens, 0, rank, 1)
        header = _i64_ptr(recv_addr + starts * record_words * 4)
        counts = tl.load(header + NUM_FIELDS, mask=rmask, other=0).to(tl.int32)
        if max_along(counts, 0) > max_tokens:
            tl.atomic_or(flags_ptr, RECEIVE_OVERFLOW)
        counts = tl.minimum(tl.maximum(counts, 0), max_tokens)
    return counts, running_total(counts), _block_starts(counts, rr, num_ranks, max_tokens, exact,
                                                         rank, 1)


@_kernel("counts_ptr rank_psum_out idx_out w_out meta_out hist_ptr fields_ptr seq_ptr flags_ptr")
def unpack_kernel(recv_addr, record_words, num_ranks, rank, max_tokens, num_local, exact,
                  counts_ptr, counts_stride, rank_psum_out, num_rows, p0_in, p1_in, p0_out, w0,
                  p1_out, w1, off1, meta_off,
                  expand, zero_padding, idx_out, w_out, has_w, meta_out, hist_ptr, check,
                  fields_ptr, seq_ptr, flags_ptr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_F: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr,
                  BLOCK_W: tl.constexpr):
    """Compact rows of the received blocks (see the module docstring; the own block's payload
    from the caller's rows p0_in, p1_in). The metadata's expand-row columns hold the local ids
    until `expand_kernel` replaces them; hist_ptr: [P, E_l] int32, this program's pairs per
    local expert."""
    pid = tl.program_id(0)
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < num_ranks
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    ee = tl.arange(0, BLOCK_E)
    counts, psum, starts = _received(recv_addr, record_words, rr, num_ranks, rank, max_tokens,
                                     exact, counts_ptr, counts_stride, flags_ptr, BLOCK_R)
    if pid == 0:
        tl.store(rank_psum_out + rr, psum, mask=rmask)
        if check != 0:
            _check_headers(recv_addr, record_words, starts, rmask, fields_ptr, seq_ptr,
                           flags_ptr, rr, BLOCK_F)
    hist = hist_ptr + pid * num_local
    for e0 in range(0, num_local, BLOCK_E):
        tl.store(hist + e0 + ee, tl.full([BLOCK_E], 0, tl.int32), mask=e0 + ee < num_local)
    tl.debug_barrier()
    begin, end = program_chunk(num_rows)
    mm = tl.arange(0, BLOCK_M)
    for r0 in range(begin, end, ROWS):
        n = r0 + tl.arange(0, ROWS)
        nmask = n < end
        n64 = n.to(tl.int64)
        inside, row, source = _rows_of(n, psum, counts, starts, rr)
        inside = inside & nmask
        rec = recv_addr + row * record_words * 4
        meta = i32_ptr(rec) + meta_off
        hmask = inside[:, None] & kmask[None, :]
        src = tl.load(meta, mask=inside, other=0)
        ids = tl.load(meta[:, None] + 1 + kk[None, :], mask=hmask, other=0) - 1
        first = rank * num_local
        keys = tl.where((ids >= first) & (ids < first + num_local), ids - first, -1)
        tl.atomic_add(hist + keys, 1, mask=keys >= 0, sem="relaxed", scope="gpu")
        last = max_along(tl.where(keys >= 0, kk[None, :], -1), 1)
        values = tl.where(mm[None, :] == 0, (src - 1)[:, None],
                          tl.where(mm[None, :] == 1, last[:, None], -1))
        values = tl.where((mm[None, :] >= 2) & (mm[None, :] < K + 2),
                          sum_along(tl.where(kk[None, None, :] == mm[None, :, None] - 2,
                                             keys[:, None, :], 0), 2), values)
        tl.store(meta_out + n64[:, None] * (K + 2) + mm[None, :], values,
                 mask=nmask[:, None] & (mm < K + 2)[None, :])
        if expand == 0:
            out_mask = nmask[:, None] & kmask[None, :]
            tl.store(idx_out + n64[:, None] * K + kk[None, :], keys.to(idx_out.dtype.element_ty),
                     mask=out_mask)
            weights = tl.load(meta[:, None] + 1 + K + kk[None, :], mask=flag_mask(hmask, has_w),
                              other=0)
            tl.store(w_out + n64[:, None] * K + kk[None, :], weights.to(tl.float32, bitcast=True),
                     mask=flag_mask(out_mask, has_w))
            own = source == rank
            token = src.to(tl.int64) - 1 - rank * max_tokens
            copy_rows(word_ptrs(tl.where(own, p0_in + token * w0 * 4, rec), VEC),
                      word_ptrs(p0_out + n64 * w0 * 4, VEC), inside, w0, VEC, BLOCK_W)
            copy_rows(word_ptrs(tl.where(own, p1_in + token * w1 * 4, rec + off1 * 4), VEC),
                      word_ptrs(p1_out + n64 * w1 * 4, VEC), inside, w1, VEC, BLOCK_W)
            if zero_padding != 0:
                _zero_masked(p0_out, n64, nmask & ~inside, w0, VEC, BLOCK_W)
                _zero_masked(p1_out, n64, nmask & ~inside, w1, VEC, BLOCK_W)


@_kernel("hist_ptr expert_counts_out")
def expert_prefix_kernel(hist_ptr, num_local, expert_counts_out, BLOCK_P: tl.constexpr):
    """Per local expert e (programs take every P-th): hist[:, e] becomes its exclusive prefix
    over the programs, and its total goes to expert_counts_out[e]."""
    pp = tl.arange(0, BLOCK_P)
    num_programs = tl.num_programs(0)
    pmask = pp < num_programs
    for e in range(tl.program_id(0), num_local, num_programs):
        at = hist_ptr + pp * num_local + e
        counts = tl.load(at, mask=pmask, other=0)
        tl.store(at, running_total(counts) - counts, mask=pmask)
        tl.store(expert_counts_out + e, total(counts))


@_kernel("rank_psum expert_counts expert_psum_out w_out meta_out hist_ptr flags_ptr "
         "counts_host")
def expand_kernel(recv_addr, record_words, num_ranks, rank, max_tokens, exact, rank_psum,
                  num_rows, num_local, alignment, capacity, expert_counts, expert_psum_out,
                  expand, p0_in, p1_in, p0_out, w0, p1_out, w1, off1, meta_off, zero_padding,
                  w_out, has_w, meta_out, hist_ptr, flags_ptr, read_counts, counts_host,
                  K: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                  GROUP: tl.constexpr, ROWS: tl.constexpr, VEC: tl.constexpr,
                  BLOCK_W: tl.constexpr):
    """Expand rows of every pair, in the metadata; in the expand layout the payload and
    weights to those rows (the own block's payload from the caller's rows p0_in, p1_in) and
    the gaps (weights 0, payload 0 with zero padding). Rows: the same program chunks as
    `unpack_kernel`, GROUP rows at a time. With `read_counts`, program 0
    first stores [received rows, error flag, aligned rows per local expert] to counts_host
    (int32 [2 + num_local], host memory the host reads once the launch is done: a
    synchronizing dispatch over padded blocks; the flag holds what the earlier launches of the
    call raised, and this launch raises nothing where `capacity` is the expand capacity)."""
    pid = tl.program_id(0)
    rr = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    ee = tl.arange(0, BLOCK_E)
    emask = ee < num_local
    totals = tl.load(expert_counts + ee, mask=emask, other=0)
    aligned = (totals + alignment - 1) // alignment * alignment
    psum_aligned = running_total(aligned)
    starts = psum_aligned - aligned
    if pid == 0:
        tl.store(expert_psum_out + ee, tl.where(expand != 0, starts + totals, psum_aligned),
                 mask=emask)
        if read_counts != 0:
            tl.store(counts_host + 2 + ee, aligned, mask=emask)
            tl.store(counts_host, tl.load(rank_psum + num_ranks - 1))
            tl.store(counts_host + 1, tl.atomic_or(flags_ptr, 0, sem="acquire", scope="gpu"))
    rank_counts = tl.load(rank_psum + rr, mask=rr < num_ranks, other=0)
    rank_counts = rank_counts - tl.load(rank_psum + rr - 1, mask=(rr >= 1) & (rr < num_ranks),
                                        other=0)
    psum = running_total(rank_counts)
    block_starts = _block_starts(rank_counts, rr, num_ranks, max_tokens, exact, rank, 1)
    running = hist_ptr + pid * num_local
    begin, end = program_chunk(num_rows)
    gg = tl.arange(0, GROUP)
    earlier = (gg[None, None, :, None] < gg[:, None, None, None]) | \
        ((gg[None, None, :, None] == gg[:, None, None, None])
         & (kk[None, None, None, :] < kk[None, :, None, None]))
    later = (gg[None, None, :, None] > gg[:, None, None, None]) | \
        ((gg[None, None, :, None] == gg[:, None, None, None])
         & (kk[None, None, None, :] > kk[None, :, None, None]))
    overflow = tl.full([], 0, tl.int32)
    for r0 in range(begin, end, GROUP):
        n = r0 + gg
        nmask = n < end
        n64 = n.to(tl.int64)
        meta = meta_out + n64 * (K + 2)
        keys = tl.load(meta[:, None] + 2 + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                       other=-1)
        same = (keys[:, :, None, None] == keys[None, None, :, :]) & (keys >= 0)[:, :, None, None]
        rank_in = sum_along(sum_along((same & earlier).to(tl.int32), 3), 2)
        is_last = sum_along(sum_along((same & later).to(tl.int32), 3), 2) == 0
        base = tl.load(running + keys, mask=keys >= 0, other=0)
        start = sum_along(tl.where(ee[None, None, :] == keys[:, :, None], starts[None, None, :],
                                   0), 2)
        target = start + base + rank_in
        fits = (keys >= 0) & (target < capacity)
        overflow += total(total(((keys >= 0) & ~fits).to(tl.int32)))
        tl.store(meta[:, None] + 2 + kk[None, :], tl.where(fits, target, -1),
                 mask=nmask[:, None] & kmask[None, :])
        tl.store(running + keys, base + rank_in + 1, mask=(keys >= 0) & is_last)
        tl.debug_barrier()  # the next group reads the counts just stored
        if expand != 0:
            inside, row, source = _rows_of(n, psum, rank_counts, block_starts, rr)
            inside = inside & nmask
            rec = recv_addr + row * record_words * 4
            own = source == rank
            token = tl.load(meta, mask=inside & own, other=0).to(tl.int64) - rank * max_tokens
            _expand_field(word_ptrs(tl.where(own, p0_in + token * w0 * 4, rec), VEC), w0,
                          i32_ptr(p0_out), meta, inside, K, VEC, BLOCK_W)
            _expand_field(word_ptrs(tl.where(own, p1_in + token * w1 * 4, rec + off1 * 4), VEC),
                          w1, i32_ptr(p1_out), meta, inside, K, VEC, BLOCK_W)
            weights = tl.load(i32_ptr(rec)[:, None] + meta_off + 1 + K + kk[None, :],
                              mask=flag_mask(inside[:, None] & fits, has_w))
            tl.store(w_out + tl.where(fits, target, 0), weights.to(tl.float32, bitcast=True),
                     mask=flag_mask(fits & inside[:, None], has_w))
    if overflow > 0:
        tl.atomic_or(flags_ptr, EXPAND_OVERFLOW)
    if expand != 0:
        # Gaps: alignment padding of each expert's rows and the tail past the last expert.
        g_begin, g_end = program_chunk(capacity)
        for g0 in range(g_begin, g_end, ROWS):
            g = g0 + tl.arange(0, ROWS)
            gmask = g < g_end
            expert = sum_along(((psum_aligned[None, :] <= g[:, None]) & emask[None, :])
                               .to(tl.int32), 1)
            pick = ee[None, :] == expert[:, None]
            used = sum_along(tl.where(pick, (starts + totals)[None, :], 0), 1)
            gap = gmask & ((expert >= num_local) | (g >= used))
            tl.store(w_out + g, tl.full([ROWS], 0.0, tl.float32), mask=flag_mask(gap, has_w))
            if zero_padding != 0:
                _zero_masked(p0_out, g.to(tl.int64), gap, w0, VEC, BLOCK_W)
                _zero_masked(p1_out, g.to(tl.int64), gap, w1, VEC, BLOCK_W)


@_kernel("rank_psum metadata w_ptr fields_ptr seq_ptr")
def combine_pack_kernel(x_addr, hidden, num_ranks, rank, max_tokens, exact, rank_psum,
                        num_rows, send_addr, recv_addr, record_words, meta_off, metadata,
                        expand, w_ptr, has_w, fields_ptr, seq_ptr, bump, K: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
                        ROWS: tl.constexpr, VEC: tl.constexpr, BLOCK_H: tl.constexpr):
    """Each received compact row back into the record it came in (x: bf16 rows; in the expand
    layout the fp32 sum of the row's expand rows in slot order, rounded once), its weights
    (expand: each slot's expand row's weight, 0 for none); program 0 writes the headers. The
    own block goes straight to its place in the receive rows (`recv_addr`), and in the compact
    layout without its rows, which `combine_reduce_kernel` reads from x."""
    pid = tl.program_id(0)
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < num_ranks
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    counts = tl.load(rank_psum + rr, mask=rmask, other=0)
    counts = counts - tl.load(rank_psum + rr - 1, mask=(rr >= 1) & rmask, other=0)
    psum = running_total(counts)
    starts = _block_starts(counts, rr, num_ranks, max_tokens, exact, rank, 0)
    if pid == 0:
        _write_headers(tl.where(rr == rank, recv_addr, send_addr), record_words, starts, counts,
                       rmask, fields_ptr, seq_ptr, bump, BLOCK_F)
    begin, end = program_chunk(num_rows)
    for r0 in range(begin, end, ROWS):
        n = r0 + tl.arange(0, ROWS)
        n64 = n.to(tl.int64)
        inside, row, source = _rows_of(n, psum, counts, starts, rr)
        inside = inside & (n < end)
        rec = tl.where(source == rank, recv_addr, send_addr) + row * record_words * 4
        hmask = inside[:, None] & kmask[None, :]
        if expand != 0:
            slot_rows = tl.load(metadata + n64[:, None] * (K + 2) + 2 + kk[None, :], mask=hmask,
                                other=-1).to(tl.int64)
            for h0 in range(0, hidden, BLOCK_H):
                hh = h0 + tl.arange(0, BLOCK_H)
                hmask_h = columns(hh, hidden, VEC)
                acc = tl.full([ROWS, BLOCK_H], 0.0, tl.float32)
                for k in tl.static_range(K):
                    slot = sum_along(tl.where(kk[None, :] == k, slot_rows, 0), 1)
                    part = tl.load(half_ptrs(x_addr + slot * hidden * 2, VEC)[:, None] + hh[None, :],
                                   mask=(inside & (slot >= 0))[:, None] & hmask_h[None, :],
                                   other=0)
                    acc += bf16_to_f32(part)
                tl.store(half_ptrs(rec, VEC)[:, None] + hh[None, :], f32_to_bf16(acc),
                         mask=inside[:, None] & hmask_h[None, :])
            weights = tl.load(w_ptr + tl.maximum(slot_rows, 0), mask=flag_mask(hmask, has_w)
                              & (slot_rows >= 0), other=0.0)
        else:
            copy_rows(word_ptrs(x_addr + n64 * hidden * 2, VEC // 2), word_ptrs(rec, VEC // 2),
                      inside & (source != rank), hidden // 2, VEC // 2, BLOCK_H // 2)
            weights = tl.load(w_ptr + n64[:, None] * K + kk[None, :],
                              mask=flag_mask(hmask, has_w), other=0.0)
        tl.store(i32_ptr(rec)[:, None] + meta_off + kk[None, :],
                 weights.to(tl.int32, bitcast=True), mask=flag_mask(hmask, has_w))


@_kernel("send_counts rank_psum idx_ptr pos_ptr bias0 bias1 out_ptr w_out fields_ptr seq_ptr "
         "flags_ptr")
def combine_reduce_kernel(recv_addr, record_words, meta_off, num_ranks, rank, max_tokens, exact,
                          send_counts, x_addr, rank_psum, expand, idx_ptr, num_tokens,
                          num_experts, pos_ptr, bias0, bias1, num_bias, out_ptr, hidden, has_w,
                          w_out, check, fields_ptr, seq_ptr, flags_ptr, K: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
                          ROWS: tl.constexpr, VEC: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = bf16(0.0 + biases + the returned row of each rank in the order of the token's
    last slot per rank), fp32 sums, NaN canonical; w_out[t, k]: the weight returned for slot
    k (0 for an invalid slot). In the compact layout this rank's own row is read from x (the
    combine's input: row rank_psum[rank - 1] + pos), where `combine_pack_kernel` left it."""
    pid = tl.program_id(0)
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < num_ranks
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    counts = tl.load(send_counts + rr, mask=rmask, other=0)
    starts = _block_starts(counts, rr, num_ranks, max_tokens, exact, rank, 1)
    own_first = tl.load(rank_psum + rank - 1, mask=rank > 0, other=0).to(tl.int64)
    if pid == 0:
        if check != 0:
            _check_headers(recv_addr, record_words, starts, rmask, fields_ptr, seq_ptr,
                           flags_ptr, rr, BLOCK_F)
    begin, end = program_chunk(num_tokens)
    for t0 in range(begin, end, ROWS):
        tt = t0 + tl.arange(0, ROWS)
        tmask = tt < end
        t64 = tt.to(tl.int64)
        _, dest, _, _ = _destinations(idx_ptr, tt, tmask, num_experts, num_ranks, rr, K,
                                      BLOCK_K)
        twin = (dest[:, :, None] == dest[:, None, :]) & \
            (kk[None, None, :] > kk[None, :, None]) & kmask[None, None, :]
        is_last = (dest >= 0) & (max_along(twin.to(tl.int32), 2) == 0)
        pos = sum_along(tl.where(dest[:, :, None] == rr[None, None, :],
                                 tl.load(pos_ptr + t64[:, None, None] * num_ranks
                                         + rr[None, None, :],
                                         mask=tmask[:, None, None] & rmask[None, None, :],
                                         other=0), 0), 2)
        first = sum_along(tl.where(dest[:, :, None] == rr[None, None, :],
                                   starts[None, None, :], 0), 2)
        rows = first + 1 + pos
        recs = recv_addr + rows * record_words * 4
        row_at = tl.multiple_of(t64 * hidden, VEC)  # (each output row's first element)
        direct = (dest == rank) & (expand == 0)
        parts = tl.where(direct, x_addr + (own_first + pos) * hidden * 2, recs)
        for h0 in range(0, hidden, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            hmask = tmask[:, None] & columns(hh, hidden, VEC)[None, :]
            acc = tl.full([ROWS, BLOCK_H], 0.0, tl.float32)
            if num_bias > 0:
                acc += tl.load(bias0 + row_at[:, None] + hh[None, :], mask=hmask,
                               other=0.0).to(tl.float32)
            if num_bias > 1:
                acc += tl.load(bias1 + row_at[:, None] + hh[None, :], mask=hmask,
                               other=0.0).to(tl.float32)
            for k in tl.static_range(K):
                live = max_along(tl.where(kk[None, :] == k, is_last.to(tl.int32), 0), 1) > 0
                rec = sum_along(tl.where(kk[None, :] == k, parts, 0), 1)
                part = tl.load(half_ptrs(rec, VEC)[:, None] + hh[None, :],
                               mask=(tmask & live)[:, None] & hmask, other=0)
                acc += bf16_to_f32(part)
            tl.store(out_ptr + row_at[:, None] + hh[None, :],
                     f32_to_bf16(acc).to(tl.bfloat16, bitcast=True), mask=hmask)
        if has_w != 0:
            hmask = tmask[:, None] & kmask[None, :]
            got = tl.load(i32_ptr(recs) + meta_off + kk[None, :], mask=hmask & (dest >= 0),
                          other=0)
            got = tl.where((got & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, got)
            tl.store(w_out + t64[:, None] * K + kk[None, :], got.to(tl.float32, bitcast=True),
                     mask=hmask)
