"""Combine: push expert outputs back to their source ranks, then reduce them there.

Combine staging region of every heap: `[R, S]` records, block r written only by rank r, record
`r * S + pos` holding the row rank r returns for the `pos`-th token this rank sent it. A record is
the bf16 row (H values) then, at word `weight_offset`, K fp32 weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .common import bf16_to_f32, copy_words, f32_to_bf16, i16_ptr, i32_ptr, record_addr


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


def _block_h(hidden: int) -> int:
    return min(triton.next_power_of_2(hidden), 2048)


@triton.jit(do_not_specialize=["region_offset", "rank", "num_ranks", "stride_tokens",
                               "record_words", "weight_offset", "has_w"])
def push_kernel(bases_ptr, region_offset, rank, num_ranks, stride_tokens, psum_ptr, stage_ptr,
                meta_ptr, x_ptr, weights_ptr, has_w, record_words, weight_offset,
                H: tl.constexpr, K: tl.constexpr, EXPAND: tl.constexpr, BLOCK_K: tl.constexpr,
                BLOCK_H: tl.constexpr):
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    num_rows = tl.load(psum_ptr + num_ranks - 1)
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        row64 = tl.cast(row, tl.int64)
        slot = tl.load(stage_ptr + row64)
        source = slot // stride_tokens
        addr = record_addr(bases_ptr, source, region_offset,
                           rank * stride_tokens + slot - source * stride_tokens, record_words)
        meta = meta_ptr + row64 * (K + 2) + 2
        if EXPAND:
            # Sum the token's expert rows in slot order in fp32, one bf16 rounding.
            for start in range(0, H, BLOCK_H):
                offs = start + tl.arange(0, BLOCK_H)
                hmask = offs < H
                acc = tl.full([BLOCK_H], 0.0, tl.float32)
                for j in tl.static_range(K):
                    src = tl.load(meta + j).to(tl.int64)
                    value = tl.load(x_ptr + tl.maximum(src, 0) * H + offs, mask=hmask & (offs * 0 + src >= 0))
                    acc = tl.where(src >= 0, acc + bf16_to_f32(value), acc)
                tl.store(i16_ptr(addr) + offs, f32_to_bf16(acc), mask=hmask)
        else:
            copy_words(x_ptr + row64 * H, i16_ptr(addr), H, BLOCK_H)
        if has_w != 0:
            if EXPAND:
                targets = tl.load(meta + kk, mask=kmask, other=-1).to(tl.int64)
                weights = tl.load(weights_ptr + tl.maximum(targets, 0),
                                  mask=kmask & (targets >= 0), other=0)
            else:
                weights = tl.load(weights_ptr + row64 * K + kk, mask=kmask)
            tl.store(i32_ptr(addr) + weight_offset + kk, weights, mask=kmask)


def push(bases, region_offset: int, rank: int, stride_tokens: int, psum_per_rank, stage_rows,
         metadata, x, weights: Optional[torch.Tensor], layout: CombineLayout, expand: bool,
         num_programs: int) -> None:
    """For each compact row n < psum_per_rank[-1], received from rank s = stage_rows[n] //
    stride_tokens as its p-th token (p = stage_rows[n] % stride_tokens), write record
    `rank * stride_tokens + p` of s's combine region: the row `x[n]` (compact) or the fp32 sum,
    rounded once to bf16, of the rows `x[metadata[n, 2 + j]]` over slots j with an expand row
    (expand); then the weights: `weights[n, :]` (compact) or `weights[metadata[n, 2 + j]]`, 0 for
    slots without a row (expand).

    Example (expand, K 2, rank 0 of 1, stride 4): psum = [1], stage_rows = [2],
    metadata = [[2, 1, 1, 0]], x = bf16 [[1], [256]], weights = [0.5, 0.25]:
        record 2 = [bf16(256 + 1) = 256 | 0.25 0.5].
    """
    num_topk = metadata.shape[1] - 2
    hidden = x.shape[1]
    push_kernel[(max(1, num_programs),)](
        bases, region_offset, rank, bases.numel(), stride_tokens, psum_per_rank, stage_rows,
        metadata, x.view(torch.int16), stage_rows if weights is None else weights.view(torch.int32),
        int(weights is not None), layout.words, layout.weight_offset, H=hidden, K=num_topk,
        EXPAND=expand, BLOCK_K=triton.next_power_of_2(num_topk), BLOCK_H=_block_h(hidden))


@triton.jit(do_not_specialize=["region_offset", "rank", "num_tokens", "num_biases", "has_w",
                               "record_words", "weight_offset"])
def reduce_kernel(bases_ptr, region_offset, rank, num_tokens, last_ptr, slot_ptr, bias0_ptr,
                  bias1_ptr, num_biases, out_ptr, w_out, has_w, record_words, weight_offset,
                  H: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    base = tl.load(bases_ptr + rank) + region_offset
    for t in range(tl.program_id(0), num_tokens, tl.num_programs(0)):
        t64 = tl.cast(t, tl.int64)
        for start in range(0, H, BLOCK_H):
            offs = start + tl.arange(0, BLOCK_H)
            hmask = offs < H
            acc = tl.full([BLOCK_H], 0.0, tl.float32)
            if num_biases > 0:
                acc = acc + bf16_to_f32(tl.load(bias0_ptr + t64 * H + offs, mask=hmask))
            if num_biases > 1:
                acc = acc + bf16_to_f32(tl.load(bias1_ptr + t64 * H + offs, mask=hmask))
            for j in tl.static_range(K):
                slot = tl.load(last_ptr + t64 * K + j)
                rec = i16_ptr(base + tl.maximum(slot, 0) * record_words * 4)
                value = tl.load(rec + offs, mask=hmask & (offs * 0 + slot >= 0))
                acc = tl.where(slot >= 0, acc + bf16_to_f32(value), acc)
            tl.store(out_ptr + t64 * H + offs, f32_to_bf16(acc), mask=hmask)
        if has_w != 0:
            slots = tl.load(slot_ptr + t64 * K + kk, mask=kmask, other=-1)
            rec = i32_ptr(base + tl.maximum(slots, 0) * record_words * 4)
            weights = tl.load(rec + weight_offset + kk, mask=kmask & (slots >= 0), other=0)
            tl.store(w_out + t64 * K + kk, weights, mask=kmask)


def reduce(bases, region_offset: int, rank: int, last_slots, slots, biases: Sequence[torch.Tensor],
           out, weights_out: Optional[torch.Tensor], layout: CombineLayout,
           num_programs: int) -> None:
    """combined[t] = bf16(0.0 + bias0[t] + bias1[t] + rows of records last_slots[t, j] for
    j = 0..K-1 where last_slots[t, j] >= 0), summed in fp32 in that order; weights_out[t, j] =
    weight j of record slots[t, j], 0 where slots[t, j] < 0. Records are this rank's.

    Example (K 2): records 0 = [1 | 0.5 0.5], 5 = [2 | 0.25 0.75], last_slots = [[5, 0]],
    slots = [[5, 0]], bias = [[4]]: out = [[7]], weights_out = [[0.25, 0.5]].
    """
    num_tokens, num_topk = last_slots.shape
    hidden = out.shape[1]
    bias0 = biases[0] if biases else out
    bias1 = biases[1] if len(biases) > 1 else bias0
    reduce_kernel[(max(1, min(num_programs, num_tokens)),)](
        bases, region_offset, rank, num_tokens, last_slots, slots, bias0.view(torch.int16),
        bias1.view(torch.int16), len(biases), out.view(torch.int16),
        bases.view(torch.int32) if weights_out is None else weights_out.view(torch.int32),
        int(weights_out is not None), layout.words, layout.weight_offset, H=hidden, K=num_topk,
        BLOCK_K=triton.next_power_of_2(num_topk), BLOCK_H=_block_h(hidden))
