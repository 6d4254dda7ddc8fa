"""Combine in one kernel per rank (`combine_kernel`): its send part returns the rows this rank
received, its reduce part sums what came back to this rank.

Heap memory: the combine counters `[ready R | free R | stamp R]` (no counts: each source already
knows which records it expects; stamp[d]: rank d's stamp of the call, `kernels.sync`) and the
combine staging region `[R, S]`, block d written only by rank d: record `d * S + p` holds what
rank d returns for the p-th token this rank sent it, the bf16 row (H values) then, at word
`weight_offset`, K fp32 weights.

Send part (P programs over the compact rows' work items, `_work_items`):
1. wait until every source has reduced what this rank returned the call before (free);
2. for compact row n, received from rank s as its p-th token: record `rank * S + p` of s's
   region gets the row `x[n]` (compact) or the fp32 sum, rounded once to bf16, of the rows
   `x[metadata[n, 2 + j]]` over the slots j that have one (expand), then the weights; in the
   compact layout the rows this rank received from itself stay in x and the weights (the
   reduce part reads them there);
3. program 0 stores this call's stamp into every source's stamp slot; add 1 to every source's
   ready counter (release).

Reduce part (the same P programs over the tokens' work items): wait for every ready counter and
check the stamps (a peer out of step or whose call had weights where this one has none, or the
reverse, or one that never arrived, is flagged, and its rows are left out), then
`combined[t] = bf16(0.0 + bias0 + bias1 + the rows of the last slot of each rank, in slot
order)` in fp32 (docs/semantics.md), the weights of each slot from its rank's record (a NaN
weight as the canonical quiet NaN); add 1 to every peer's free counter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .common import (bf16_to_f32, columns, copy_row_span, exclusive_columns, f32_to_bf16,
                     flag_mask, i32_ptr, max_along, program_chunk, sum_along)
from .launcher import KernelShape, Launcher, Stage, aligned
from .sync import (COMBINE_TIMEOUT, add_counters, await_counters, bases_of, call_signature,
                   heap_bases, own_counters, peer_counters, stamp, stamped_words)

SYNC_COMBINE = tl.constexpr(3)  # slot of the backend's sync tensor: P per combine call


@triton.jit
def _work_items(num_rows, hidden, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's share of a pass over `num_rows` rows of `hidden` values, as work items:
    row tiles of ROWS, each cut into `pieces` runs of hidden steps of BLOCK_H, so that a few
    rows still spread over every program (P programs, 128 rows, ROWS 16: 8 tiles, each in as
    many pieces as make at least P items, at most one per step). Returns the items
    [begin, end) and (pieces, steps per piece); item w is tile w // pieces, hidden values
    [piece * per * BLOCK_H, (piece + 1) * per * BLOCK_H) of it with piece = w % pieces.

    Example: 128 rows, hidden 7168, ROWS 16, BLOCK_H 1024, P 32: 8 tiles of 7 steps, pieces 4
    (per 2: steps 0-1, 2-3, 4-5, 6), 32 items, one per program."""
    num_programs = tl.num_programs(0)
    steps = (hidden + BLOCK_H - 1) // BLOCK_H
    tiles = (num_rows + ROWS - 1) // ROWS
    wanted = tl.minimum(tl.maximum((num_programs + tiles - 1) // tl.maximum(tiles, 1), 1), steps)
    per = (steps + wanted - 1) // wanted
    pieces = (steps + per - 1) // per
    begin, end = program_chunk(tiles * pieces)
    return begin, end, pieces, per


@triton.jit
def _work_item(w, pieces, per, hidden, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Item `w` of `_work_items`: its rows [ROWS], its piece and the hidden values [h0, h1)."""
    piece = w % pieces
    h0 = piece * per * BLOCK_H
    return w // pieces * ROWS + tl.arange(0, ROWS), piece, h0, \
        tl.minimum(h0 + per * BLOCK_H, hidden)


@dataclass(frozen=True)
class CombineLayout:
    """Word layout of a combine record: `[bf16 row (H values) | K fp32 weights]`, 16-byte aligned."""

    hidden: int
    num_topk: int

    @property
    def weight_offset(self) -> int:
        return (self.hidden + 7) // 8 * 4

    @property
    def words(self) -> int:
        return (self.weight_offset + self.num_topk + 3) // 4 * 4


@triton.jit
def half_ptrs(addr, VEC: tl.constexpr):
    """int64 byte addresses as pointers to 16-bit values, hinted 2*VEC-byte aligned."""
    return tl.multiple_of(addr.to(tl.pointer_type(tl.int16)), 2 * VEC)


@triton.jit
def _return_rows(bases, own, rank, num_ranks, flags_offset, region_offset, stride_tokens,
                 record_words, weight_offset, sync_ptr, rank_psum_ptr, meta_ptr, x_ptr, expand,
                 weights_ptr, has_w, hidden, error_ptr, timeout, signature, K: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr,
                 VEC: tl.constexpr, BLOCK_H: tl.constexpr, IN_FLIGHT: tl.constexpr,
                 SCOPE: tl.constexpr):
    """Steps 1-3 of the send part (module docstring); returns the call number."""
    num_programs = tl.num_programs(0)
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < num_ranks
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    hidden = tl.multiple_of(hidden, VEC)
    call = tl.atomic_add(sync_ptr + SYNC_COMBINE, 1, sem="relaxed", scope="gpu") \
        // num_programs + 1
    # phase-mark: combine-start
    # (this rank's own tensors, loaded before the wait, which their latency then overlaps)
    psum = tl.load(rank_psum_ptr + rr, mask=rmask, other=2**31 - 1)  # lanes past R: no rows
    num_rows = tl.load(rank_psum_ptr + num_ranks - 1)
    await_counters(own_counters(own, flags_offset + num_ranks * 8, rr), rmask,
                   (call - 1) * num_programs, error_ptr, COMBINE_TIMEOUT, timeout, SCOPE)
    # phase-mark: combine-peers-freed
    begin, end, pieces, per = _work_items(num_rows, hidden, ROWS, BLOCK_H)
    for w in range(begin, end):
        rows, piece, h0, h1 = _work_item(w, pieces, per, hidden, ROWS, BLOCK_H)
        nmask = rows < num_rows
        n64 = rows.to(tl.int64)
        source = sum_along((psum[None, :] <= rows[:, None]).to(tl.int32), 1)
        # psum is non-decreasing: the rows before source s's block are max(psum[r < s]).
        first = max_along(tl.where(rr[None, :] < source[:, None], psum[None, :], 0), 1)
        slot = rank * stride_tokens + rows - first
        rec = bases_of(bases, rr, source) + region_offset \
            + slot.to(tl.int64) * record_words * 4
        meta = meta_ptr + n64 * (K + 2) + 2
        hmask = nmask[:, None] & kmask[None, :]
        if expand != 0:
            # The row's expert rows summed in slot order in fp32, one bf16 rounding. A slot
            # without a row reads +0.0, which never changes an accumulator that started at
            # +0.0 (so the order of docs/semantics.md is kept bit for bit); IN_FLIGHT slots'
            # loads at a time (`slots_in_flight`).
            targets = tl.load(meta[:, None] + kk[None, :], mask=hmask, other=-1)
            for start in range(h0, h1, BLOCK_H):
                offs = start + tl.arange(0, BLOCK_H)
                wmask = columns(offs, hidden, VEC)
                acc = tl.full([ROWS, BLOCK_H], 0.0, tl.float32)
                for j0 in range(0, K, IN_FLIGHT):
                    for jj in tl.static_range(IN_FLIGHT):
                        j = j0 + jj
                        valid = nmask & (tl.full([ROWS], j, tl.int32) < K)  # (K may be odd)
                        src = tl.load(meta + j, mask=valid, other=-1).to(tl.int64)
                        row = x_ptr + tl.multiple_of(tl.maximum(src, 0) * hidden, VEC)
                        value = tl.load(row[:, None] + offs[None, :],
                                        mask=(src >= 0)[:, None] & wmask[None, :], other=0)
                        acc += bf16_to_f32(value)
                dst = half_ptrs(rec, VEC)
                tl.store(dst[:, None] + offs[None, :], f32_to_bf16(acc),
                         mask=nmask[:, None] & wmask[None, :])
            weights = tl.load(weights_ptr + tl.maximum(targets, 0),
                              mask=flag_mask(hmask & (targets >= 0), has_w), other=0)
        else:
            # This rank's own rows stay in x, where its reduce part reads them.
            nmask = nmask & (source != rank)
            hmask = nmask[:, None] & kmask[None, :]
            copy_row_span(x_ptr + tl.multiple_of(n64 * hidden, VEC), half_ptrs(rec, VEC),
                          nmask, h0, h1, hidden, VEC, BLOCK_H)
            weights = tl.load(weights_ptr + n64[:, None] * K + kk[None, :],
                              mask=flag_mask(hmask, has_w), other=0)
        # The weights go with the first piece of the row.
        tl.store(i32_ptr(rec)[:, None] + weight_offset + kk[None, :], weights,
                 mask=flag_mask(hmask, has_w * (piece == 0)))
    # phase-mark: combine-rows-returned
    if tl.program_id(0) == 0:
        tl.store(peer_counters(bases, flags_offset + 2 * num_ranks * 8, rank),
                 stamp(signature, call), mask=rmask)
    add_counters(peer_counters(bases, flags_offset, rank), rmask, SCOPE)
    return call


@triton.jit
def _own_rows(slots, rank, stride_tokens, own_first, expand):
    """Where the compact layout keeps a record that this rank returns to itself: (slots that
    are such records, their rows of the combine's x, whose block from this rank starts at row
    `own_first`). Elsewhere: records of the region."""
    mine = (slots >= rank * stride_tokens) & (slots < (rank + 1) * stride_tokens) \
        & (slots * 0 + expand == 0)
    return mine, (own_first + slots - rank * stride_tokens).to(tl.int64)


@triton.jit
def _reduce_rows(bases, own, rank, num_ranks, flags_offset, region_offset, stride_tokens,
                 record_words, weight_offset, call, num_tokens, slot_ptr, bias0_ptr, bias1_ptr,
                 num_biases, out_ptr, w_out, has_w, hidden, rank_psum_ptr, x_ptr, expand,
                 weights_ptr, error_ptr, timeout, signature, K: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, ROWS: tl.constexpr,
                 VEC: tl.constexpr, BLOCK_H: tl.constexpr, SCOPE: tl.constexpr):
    """The reduce part (module docstring) of call number `call`: the one this program's send
    part computed. (Reading the call counter here instead would race with programs of this
    launch that have not added to it yet.) In the compact layout the records this rank
    returns to itself are read from x and weights_ptr, which its send part left them in."""
    num_programs = tl.num_programs(0)
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < num_ranks
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    hidden = tl.multiple_of(hidden, VEC)
    ready = own_counters(own, flags_offset, rr)
    base = own + region_offset
    own_first = tl.where(rank > 0, tl.load(rank_psum_ptr + tl.maximum(rank - 1, 0)), 0)
    await_counters(ready, rmask, call * num_programs, error_ptr, COMBINE_TIMEOUT, timeout,
                   SCOPE)
    # Peers out of step, with other arguments or not arrived are flagged, and their rows are
    # left out (not mixed in: their slots count as -1).
    counted = stamped_words(ready, own_counters(own, flags_offset + 2 * num_ranks * 8, rr),
                            rr, rmask, call, num_programs, signature, error_ptr, SCOPE) != 0
    # phase-mark: combine-ready
    begin, end, pieces, per = _work_items(num_tokens, hidden, ROWS, BLOCK_H)
    for w in range(begin, end):
        tt, piece, h0, h1 = _work_item(w, pieces, per, hidden, ROWS, BLOCK_H)
        tmask = tt < num_tokens
        t64 = tt.to(tl.int64)
        hmask = tmask[:, None] & kmask[None, :]
        slots = tl.load(slot_ptr + t64[:, None] * K + kk[None, :], mask=hmask, other=-1)
        owner = tl.where(slots >= 0, slots // stride_tokens, -1)
        ok = sum_along(tl.where(owner[:, :, None] == rr[None, None, :],
                                counted.to(tl.int32)[None, None, :], 0), 2)
        slots = tl.where(ok > 0, slots, -1)
        # A slot adds its rank's row only if no later slot of the token has the same rank
        # (the same record). The tile walks the n-th such slot of every token at once.
        later = (kk[None, None, :] > kk[None, :, None]) & (slots[:, None, :] == slots[:, :, None])
        last = (slots >= 0) & (max_along(later.to(tl.int32), 2) == 0)
        order = exclusive_columns(last.to(tl.int32), BLOCK_K)
        most = max_along(sum_along(last.to(tl.int32), 1), 0)
        for start in range(h0, h1, BLOCK_H):
            offs = start + tl.arange(0, BLOCK_H)
            wmask = columns(offs, hidden, VEC)
            mask = tmask[:, None] & wmask[None, :]
            rows = tl.multiple_of(t64 * hidden, VEC)[:, None] + offs[None, :]
            acc = tl.full([ROWS, BLOCK_H], 0.0, tl.float32)
            if num_biases > 0:
                acc = acc + bf16_to_f32(tl.load(bias0_ptr + rows, mask=mask))
            if num_biases > 1:
                acc = acc + bf16_to_f32(tl.load(bias1_ptr + rows, mask=mask))
            for n in range(0, most):
                pick = last & (order == n)
                slot = sum_along(tl.where(pick, slots, 0), 1)
                mine, row = _own_rows(slot, rank, stride_tokens, own_first, expand)
                rec = half_ptrs(tl.where(
                    mine, (x_ptr + tl.multiple_of(row * hidden, VEC)).to(tl.int64),
                    base + slot.to(tl.int64) * record_words * 4), VEC)
                # Tokens without an n-th slot read +0.0, which leaves their sums unchanged.
                value = tl.load(rec[:, None] + offs[None, :],
                                mask=(max_along(pick.to(tl.int32), 1) > 0)[:, None]
                                & wmask[None, :], other=0)
                acc += bf16_to_f32(value)
            tl.store(out_ptr + rows, f32_to_bf16(acc), mask=mask)
        if has_w * (piece == 0) != 0:  # the weights go with the first piece of the tile
            mine, row = _own_rows(slots, rank, stride_tokens, own_first, expand)
            at = tl.where(mine, (weights_ptr + row * K + kk[None, :]).to(tl.int64),
                          base + (tl.maximum(slots, 0).to(tl.int64) * record_words
                                  + weight_offset + kk[None, :]) * 4)
            weights = tl.load(i32_ptr(at), mask=hmask & (slots >= 0), other=0)
            # fp32 bits; a NaN becomes the canonical quiet NaN (docs/semantics.md, NaN).
            weights = tl.where((weights & 0x7FFFFFFF) > 0x7F800000, 0x7FC00000, weights)
            tl.store(w_out + t64[:, None] * K + kk[None, :], weights, mask=hmask)
    # phase-mark: combine-reduced
    add_counters(peer_counters(bases, flags_offset + num_ranks * 8, rank), rmask, SCOPE)
    # phase-mark: combine-done


@triton.jit(do_not_specialize=[
    "rank", "num_ranks", "flags_offset", "region_offset", "stride_tokens", "record_words",
    "weight_offset", "expand", "has_w", "num_tokens", "num_biases", "has_w_out", "hidden",
    "timeout", "signature"])
def combine_kernel(bases_ptr, rank, num_ranks, flags_offset, region_offset, stride_tokens,
                   record_words, weight_offset, sync_ptr, rank_psum_ptr, meta_ptr, x_ptr, expand,
                   weights_ptr, has_w, num_tokens, slot_ptr, bias0_ptr, bias1_ptr, num_biases,
                   out_ptr, w_out, has_w_out, hidden, error_ptr, timeout, signature,
                   K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                   ROWS: tl.constexpr, VEC: tl.constexpr, BLOCK_H: tl.constexpr,
                   IN_FLIGHT: tl.constexpr, SCOPE: tl.constexpr):
    rr = tl.arange(0, BLOCK_R)
    bases, own = heap_bases(bases_ptr, rank, rr, rr < num_ranks)
    call = _return_rows(bases, own, rank, num_ranks, flags_offset, region_offset, stride_tokens,
                        record_words, weight_offset, sync_ptr, rank_psum_ptr, meta_ptr, x_ptr,
                        expand, weights_ptr, has_w, hidden, error_ptr, timeout, signature, K,
                        BLOCK_K, BLOCK_R, ROWS, VEC, BLOCK_H, IN_FLIGHT, SCOPE)
    _reduce_rows(bases, own, rank, num_ranks, flags_offset, region_offset, stride_tokens,
                 record_words, weight_offset, call, num_tokens, slot_ptr, bias0_ptr, bias1_ptr,
                 num_biases, out_ptr, w_out, has_w_out, hidden, rank_psum_ptr, x_ptr, expand,
                 weights_ptr, error_ptr, timeout, signature, K, BLOCK_K, BLOCK_R, ROWS, VEC,
                 BLOCK_H, SCOPE)




def variant(x: torch.Tensor, weights: Optional[torch.Tensor],
            biases: Sequence[torch.Tensor]) -> Optional[tuple]:
    """The compiled variant of a combine with these caller tensors (None when one is not
    16-byte aligned: the generic path; the backend's own tensors always are)."""
    return () if aligned(x, weights, *biases) else None


# Row values an expand send loads at once per program: 32768 (64 KB of bf16). At the 16 x 1024
# tile that is 2 slots' rows, what 16 warps' 128 registers a thread hold (all 8 slots at once:
# 64 bytes of spills, Triton 3.9); the decode tile of 4 x 1024 loads all 8 slots' rows at once.
_VALUES_IN_FLIGHT = 32768


def slots_in_flight(shape: KernelShape) -> int:
    """IN_FLIGHT: the slots whose rows an expand send loads at once (one round trip to memory
    per IN_FLIGHT slots and hidden step), at most K.

    Example: K 8, 16 rows x 1024 per step: 2; 4 rows x 1024: 8."""
    return max(1, min(shape.num_topk, _VALUES_IN_FLIGHT // (shape.rows * shape.block_w)))


def launcher(shape: KernelShape) -> Launcher:
    """The `Launcher` of `combine_kernel`."""
    return shape.launcher(combine_kernel, width="BLOCK_H", IN_FLIGHT=slots_in_flight(shape))


def arguments(stage: Stage, layout: CombineLayout, sync, rank_psum, metadata, x,
              weights: Optional[torch.Tensor], expand: bool, slots,
              biases: Sequence[torch.Tensor], out, weights_out: Optional[torch.Tensor], error,
              timeout: int) -> dict:
    """Every argument of one launch of `combine_kernel` by name (its constexprs excepted).

    Returned side: rank_psum [R] int32 and metadata [rows, K + 2] int32, the dispatch
    handle's; x: bf16 [rows, H] (compact) or [expand rows, H]; weights: fp32 [rows, K]
    (compact), [expand rows] (expand) or None. Reduced side: slots [T, K] int32, the dispatch
    send's slot_out (record `d * S + p`: rank d returned it for the token this rank sent it as
    its p-th); biases: zero, one or two bf16 [T, H]; out: bf16 [T, H]; weights_out: fp32 [T, K]
    or None. Any tensor may be a `launcher.Address` stand-in (a prepared call's template)."""
    has_w, has_w_out = weights is not None, weights_out is not None
    bias0, bias1 = (*biases, out, out)[:2]  # (absent biases are never read)
    return dict(stage.fields, record_words=layout.words, weight_offset=layout.weight_offset,
                sync_ptr=sync, rank_psum_ptr=rank_psum, meta_ptr=metadata,
                x_ptr=x.view(torch.int16), expand=int(expand),
                weights_ptr=weights.view(torch.int32) if has_w else metadata, has_w=int(has_w),
                num_tokens=out.shape[0], slot_ptr=slots, bias0_ptr=bias0.view(torch.int16),
                bias1_ptr=bias1.view(torch.int16), num_biases=len(biases),
                out_ptr=out.view(torch.int16),
                w_out=weights_out.view(torch.int32) if has_w_out else slots,
                has_w_out=int(has_w_out), hidden=x.shape[1], error_ptr=error, timeout=timeout,
                signature=call_signature(int(has_w)))


def combine(shape: KernelShape, stage: Stage, layout: CombineLayout, sync, rank_psum, metadata,
            x, weights: Optional[torch.Tensor], expand: bool, slots,
            biases: Sequence[torch.Tensor], out, weights_out: Optional[torch.Tensor], error,
            timeout: int, stream=None, variant: Optional[tuple] = None,
            kernel: Optional[Launcher] = None) -> None:
    """A whole combine on this rank, one launch: return every received row to its source, then,
    once every peer's rows have arrived, `out[t] = bf16(0.0 + bias0[t] + bias1[t] +
    record(slots[t, j]) for the slots j >= 0 whose record no later slot repeats)`, summed in
    fp32 in that order, and `weights_out[t, j]` = weight j of record `slots[t, j]` (0 where
    `slots[t, j] < 0`). Tensors as in `arguments`. variant: `variant(x, weights, biases)`
    (None: the generic path). kernel: `launcher(shape)`, if the caller keeps it.

    Example (one rank, H 2, K 2, compact): rank_psum = [1], metadata = [[0, 1, 0, 2]],
    x = bf16 [[5, 6]], weights = [[0.5, 0.25]], slots = [[0, 0], [-1, -1]],
    biases = ([[1, 1], [2, 2]],): out = [[6, 7], [2, 2]], weights_out = [[0.5, 0.25], [0, 0]]
    (the row a rank returns to itself is read from x and weights: its record 0 stays
    unwritten); the ready and free counters += P.
    """
    (kernel or launcher(shape))(variant, stream, arguments(
        stage, layout, sync, rank_psum, metadata, x, weights, expand, slots, biases, out,
        weights_out, error, timeout))
