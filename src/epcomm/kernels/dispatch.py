"""Dispatch: push token records into peers' staging regions, then copy them out.

Staging region of every heap: `[R, S]` records (S = the buffer's max tokens per rank), block s
written only by sender s, record `s * S + pos` holding the `pos`-th token that s sends here.
A record is int32 words (see `RecordLayout`): source token index, K global expert ids (-1 for
none), K weights (fp32 bits), then the payload rows (bf16 x, or FP8 rows and their scales) as
raw words. The receiver learns each block's length from the sender's flag, so no count
exchange precedes the push.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .common import copy_words, i32_ptr, record_addr, running_total, total

_ALIGN_WORDS = 4  # 16 bytes: payload fields and records start on vector boundaries


def _align(n: int) -> int:
    return (n + _ALIGN_WORDS - 1) // _ALIGN_WORDS * _ALIGN_WORDS


@dataclass(frozen=True)
class RecordLayout:
    """Word layout of a dispatch record: `[token | K ids | K weights | payload 0 | payload 1]`.

    payload_words: int32 words of each payload row (one or two fields).
    """

    num_topk: int
    payload_words: tuple[int, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        offsets, at = [], _align(1 + 2 * self.num_topk)
        for words in self.payload_words:
            offsets.append(at)
            at += _align(words)
        return tuple(offsets)

    @property
    def words(self) -> int:
        return self.offsets[-1] + _align(self.payload_words[-1])


def payload_words(rows: Sequence[torch.Tensor]) -> tuple[int, ...]:
    return tuple(row.shape[1] * row.element_size() // 4 for row in rows)


def _fields(rows: Sequence[torch.Tensor], layout: RecordLayout):
    """(tensor, words, offset) of payload 0 and 1; a missing payload 1 has 0 words."""
    words, offsets = layout.payload_words, layout.offsets
    first = (rows[0], words[0], offsets[0])
    second = (rows[1], words[1], offsets[1]) if len(rows) > 1 else (rows[0], 0, 0)
    return first + second


def _block_words(layout: RecordLayout) -> int:
    """Words per copy step, from H alone (bf16 rows: H/2 words, FP8 rows: H/4) so that bf16 and
    FP8 dispatches share one compiled variant of each kernel."""
    hidden_half = layout.payload_words[0] * (2 if len(layout.payload_words) > 1 else 1)
    return min(triton.next_power_of_2(hidden_half), 2048)


@triton.jit(do_not_specialize=["region_offset", "rank", "num_ranks", "stride_tokens",
                               "num_tokens", "has_w", "w0", "off0", "w1", "off1", "record_words"])
def push_kernel(bases_ptr, region_offset, rank, num_ranks, stride_tokens, num_tokens,
                send_pos_ptr, ids_ptr, weights_ptr, has_w, p0_ptr, w0, off0, p1_ptr, w1, off1,
                record_words, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    for t in range(tl.program_id(0), num_tokens, tl.num_programs(0)):
        t64 = tl.cast(t, tl.int64)
        ids = tl.load(ids_ptr + t64 * K + kk, mask=kmask)
        for p in range(num_ranks):
            pos = tl.load(send_pos_ptr + t64 * num_ranks + p)
            if pos >= 0:
                rec = i32_ptr(record_addr(bases_ptr, p, region_offset,
                                          pos + rank * stride_tokens, record_words))
                tl.store(rec, t)
                tl.store(rec + 1 + kk, ids, mask=kmask)
                if has_w != 0:
                    tl.store(rec + 1 + K + kk, tl.load(weights_ptr + t64 * K + kk, mask=kmask),
                             mask=kmask)
                copy_words(p0_ptr + t64 * w0, rec + off0, w0, BLOCK_W)
                copy_words(p1_ptr + t64 * w1, rec + off1, w1, BLOCK_W)


def push(bases, region_offset: int, rank: int, stride_tokens: int, send_pos, expert_ids,
         weights: Optional[torch.Tensor], rows: Sequence[torch.Tensor], layout: RecordLayout,
         num_programs: int) -> None:
    """Write record `rank * stride_tokens + send_pos[t, p]` of rank p's staging region (at byte
    `region_offset` of its heap) for every token t and rank p with `send_pos[t, p] >= 0`.

    expert_ids: [T, K] int32 global ids, -1 for none; weights: [T, K] fp32 or None;
    rows: payload tensors [T, *] (sizes in bytes multiples of 4).

    Example: two heaps a, b (int32 [48]), rank 0, stride 2, K 2, x = bf16 [[1, 2], [3, 4]]
    (one word per row; layout header 5 words, payload at word 8, records of 12 words),
    send_pos = [[0, 0], [1, -1]], expert_ids = [[0, 3], [1, -1]], no weights:
        a[0:12] = [0 | 0 3 | . . | . . . | x[0]], a[12:24] = [1 | 1 -1 | ... | x[1]],
        b[0:12] = [0 | 0 3 | ... | x[0]]; nothing else changes.
    """
    num_tokens, num_topk = expert_ids.shape
    words = [row.view(torch.int32) for row in rows]
    push_kernel[(max(1, min(num_programs, num_tokens)),)](
        bases, region_offset, rank, bases.numel(), stride_tokens, num_tokens, send_pos,
        expert_ids, expert_ids if weights is None else weights.view(torch.int32),
        int(weights is not None), *_fields(words, layout), layout.words, K=num_topk,
        BLOCK_K=triton.next_power_of_2(num_topk), BLOCK_W=_block_words(layout))


@triton.jit
def _row_source(counts_ptr, num_ranks, row, BLOCK_R: tl.constexpr):
    """(source rank, index within its block) of compact row `row`."""
    r = tl.arange(0, BLOCK_R)
    counts = tl.load(counts_ptr + r, mask=r < num_ranks, other=0)
    source = total((running_total(counts) <= row).to(tl.int32))
    return source, row - total(tl.where(r < source, counts, 0))


@triton.jit
def _received(counts_ptr, num_ranks, BLOCK_R: tl.constexpr):
    r = tl.arange(0, BLOCK_R)
    return total(tl.load(counts_ptr + r, mask=r < num_ranks, other=0))


@triton.jit(do_not_specialize=["region_offset", "rank", "num_ranks", "stride_tokens",
                               "max_tokens", "experts_per_rank", "record_words", "has_w",
                               "copy_payload", "w0", "off0", "w1", "off1"])
def compact_kernel(bases_ptr, region_offset, rank, num_ranks, stride_tokens, max_tokens,
                   experts_per_rank, counts_ptr, record_words, idx_out, w_out, has_w, src_out,
                   stage_out, copy_payload, p0_out, w0, off0, p1_out, w1, off1,
                   K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_W: tl.constexpr):
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    num_rows = _received(counts_ptr, num_ranks, BLOCK_R)
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        source, index = _row_source(counts_ptr, num_ranks, row, BLOCK_R)
        slot = source * stride_tokens + index
        rec = i32_ptr(record_addr(bases_ptr, rank, region_offset, slot, record_words))
        row64 = tl.cast(row, tl.int64)
        ids = tl.load(rec + 1 + kk, mask=kmask, other=-1)
        here = (ids >= 0) & (ids >= rank * experts_per_rank) \
            & (ids < (rank + 1) * experts_per_rank)
        tl.store(idx_out + row64 * K + kk, tl.where(here, ids - rank * experts_per_rank, -1),
                 mask=kmask)
        if has_w != 0:
            tl.store(w_out + row64 * K + kk, tl.load(rec + 1 + K + kk, mask=kmask), mask=kmask)
        tl.store(src_out + row64, source * max_tokens + tl.load(rec))
        tl.store(stage_out + row64, slot)
        if copy_payload != 0:
            copy_words(rec + off0, p0_out + row64 * w0, w0, BLOCK_W)
            copy_words(rec + off1, p1_out + row64 * w1, w1, BLOCK_W)


def _grid(num_programs: int) -> tuple[int]:
    return (max(1, num_programs),)


def compact(bases, region_offset: int, rank: int, stride_tokens: int, max_tokens: int,
            experts_per_rank: int, counts, layout: RecordLayout, local_idx, weights_out,
            src_out, stage_out, rows_out: Optional[Sequence[torch.Tensor]],
            num_programs: int) -> None:
    """Copy the `counts[s]` records of each block s of this rank's staging region into compact
    rows (source-major, then position), writing for row n: `local_idx[n]` (ids of this rank's
    experts minus `rank * experts_per_rank`, else -1), `weights_out[n]` (if given),
    `src_out[n] = s * max_tokens + token`, `stage_out[n] = s * stride_tokens + position`, and,
    with `rows_out`, the payload rows. Rows at or past `sum(counts)` are not touched.

    Example: rank 1 of 2, experts_per_rank 2, stride 2, max_tokens 2, counts = [1, 1], records
    [0 | 0 3 | ...] at slot 0 (from rank 0) and [1 | 2 -1 | ...] at slot 2 (from rank 1):
        local_idx = [[-1, 1], [0, -1]], src_out = [0, 3], stage_out = [0, 2].
    """
    words = None if rows_out is None else [row.view(torch.int32) for row in rows_out]
    num_topk = local_idx.shape[1]
    compact_kernel[_grid(num_programs)](
        bases, region_offset, rank, bases.numel(), stride_tokens, max_tokens, experts_per_rank,
        counts, layout.words, local_idx,
        src_out if weights_out is None else weights_out.view(torch.int32), int(weights_out is not None), src_out, stage_out, int(words is not None),
        *_fields(words or [src_out.view(torch.int32).view(-1, 1)], layout), K=num_topk,
        BLOCK_R=triton.next_power_of_2(bases.numel()), BLOCK_K=triton.next_power_of_2(num_topk),
        BLOCK_W=_block_words(layout))


@triton.jit(do_not_specialize=["region_offset", "rank", "num_ranks", "record_words", "has_w",
                               "w0", "off0", "w1", "off1"])
def expand_kernel(bases_ptr, region_offset, rank, num_ranks, counts_ptr, record_words,
                  stage_ptr, meta_ptr, w_out, has_w, p0_out, w0, off0, p1_out, w1, off1,
                  K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_W: tl.constexpr):
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    num_rows = _received(counts_ptr, num_ranks, BLOCK_R)
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        row64 = tl.cast(row, tl.int64)
        rec = i32_ptr(record_addr(bases_ptr, rank, region_offset, tl.load(stage_ptr + row64),
                                  record_words))
        targets = tl.load(meta_ptr + row64 * (K + 2) + 2 + kk, mask=kmask, other=-1).to(tl.int64)
        if has_w != 0:
            tl.store(w_out + targets, tl.load(rec + 1 + K + kk, mask=kmask),
                     mask=kmask & (targets >= 0))
        for j in tl.static_range(K):
            target = tl.load(meta_ptr + row64 * (K + 2) + 2 + j).to(tl.int64)
            if target >= 0:
                copy_words(rec + off0, p0_out + target * w0, w0, BLOCK_W)
                copy_words(rec + off1, p1_out + target * w1, w1, BLOCK_W)


def expand(bases, region_offset: int, rank: int, counts, layout: RecordLayout, stage_rows,
           metadata, weights_out: Optional[torch.Tensor], rows_out: Sequence[torch.Tensor],
           num_programs: int) -> None:
    """For each compact row n < sum(counts) and slot j with `metadata[n, 2 + j] = e >= 0`, copy
    the payload of staging record `stage_rows[n]` to row e of `rows_out` and its weight j to
    `weights_out[e]`. Other output rows are not touched.

    Example: K 2, stage_rows = [2], metadata = [[0, 1, 3, 0]], record 2 = [0 | 1 0 | 0.5 0.25 |
    ... | x]: rows_out[3] = rows_out[0] = x, weights_out[3] = 0.5, weights_out[0] = 0.25.
    """
    words = [row.view(torch.int32) for row in rows_out]
    num_topk = metadata.shape[1] - 2
    expand_kernel[_grid(num_programs)](
        bases, region_offset, rank, bases.numel(), counts, layout.words, stage_rows, metadata,
        stage_rows if weights_out is None else weights_out.view(torch.int32),
        int(weights_out is not None), *_fields(words, layout), K=num_topk,
        BLOCK_R=triton.next_power_of_2(bases.numel()), BLOCK_K=triton.next_power_of_2(num_topk),
        BLOCK_W=_block_words(layout))
