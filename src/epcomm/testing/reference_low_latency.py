"""Independent reference for the low-latency dispatch and combine (docs/semantics.md,
"Low-latency mode").

Written with plain `torch.distributed` all-gathers of every rank's tokens, routing and expert
outputs, and loops over experts, ranks, tokens and slots; it shares no code with
`epcomm.low_latency`. CPU tensors and a gloo group.

Terms: `R` ranks, `E` experts, `E_l = E // R`, `M` tokens per rank at most, `T` tokens here,
`K` top-k slots, `H` hidden, `S = H / 128`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .reference import quiet_nan

__all__ = ["ReferenceLowLatency", "reference_fp8_cast", "reference_logfmt",
           "reference_low_latency_dispatch", "reference_low_latency_combine"]

Tensor = torch.Tensor


def reference_fp8_cast(row: Tensor, round_scale: bool) -> tuple[Tensor, Tensor]:
    """One token `row` [H] bf16 -> (fp8 [H] float8_e4m3fn, scales [S] float32), block by
    block: scale = max(amax, 1e-4) / 448 in fp32, or the least power of two >= it."""
    parts, scales = [], []
    for start in range(0, row.shape[0], 128):
        block = row[start:start + 128].float()
        amax = torch.clamp(block.abs().max(), min=1e-4)
        scale = amax / torch.tensor(448.0)
        if round_scale:
            scale = torch.tensor(2.0 ** math.ceil(math.log2(float(scale))), dtype=torch.float32)
        parts.append((block / scale).to(torch.float8_e4m3fn))
        scales.append(scale.reshape(1))
    return torch.cat(parts), torch.cat(scales)


def _ue8m0(scales: Tensor) -> Tensor:
    """Power-of-two scales [S] -> int32 words [ceil(S / 4)], 4 exponent bytes each
    (little-endian, 0 past S)."""
    exponents = [int(round(math.log2(float(s)))) + 127 for s in scales]
    exponents += [0] * (-len(exponents) % 4)
    words = [int.from_bytes(bytes(exponents[i:i + 4]), "little", signed=True)
             for i in range(0, len(exponents), 4)]
    return torch.tensor(words, dtype=torch.int32)


def _gather(tensor: Tensor, group) -> list[Tensor]:
    """Every rank's `tensor` (same shape and dtype on all), moved as bytes."""
    raw = tensor.contiguous().view(torch.uint8).reshape(-1)
    parts = [torch.empty_like(raw) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, raw, group=group)
    return [p.view(tensor.dtype).view(tensor.shape) for p in parts]


@dataclass
class ReferenceLowLatency:
    """The rows this rank's local experts receive, and what every rank routed.

    - recv_count: [E_l] int32.
    - rows[e]: [recv_count[e], H] bf16 or fp8; scales[e]: [recv_count[e], S] float32, or
      [recv_count[e], ceil(S / 4)] int32 with UE8M0 (None without FP8).
    - src_info[e]: [recv_count[e]] int32 source token indices.
    - layout_range: [E_l, R] int64, `(begin << 32) | count`.
    - sources[d][e]: list of (source rank, token) of rank d's local expert e, in row order.
    - topk: every rank's [M, K] int64 routing, -1 past its tokens.
    """
    recv_count: Tensor
    rows: list
    scales: Optional[list]
    src_info: list
    layout_range: Tensor
    sources: list
    topk: list


def _routes(topk: list, num_tokens: list, num_experts: int, masked: tuple) -> list:
    """sources[d][e] for every rank d: (s, t) pairs with expert d * E_l + e in a valid slot
    of token t of rank s, s and d unmasked, ordered by s, then t."""
    num_ranks = len(topk)
    num_local = num_experts // num_ranks
    sources = [[[] for _ in range(num_local)] for _ in range(num_ranks)]
    for d in range(num_ranks):
        for e in range(num_local):
            expert = d * num_local + e
            for s in range(num_ranks):
                if s in masked or d in masked:
                    continue
                for t in range(num_tokens[s]):
                    if expert in topk[s][t].tolist():
                        sources[d][e].append((s, t))
    return sources


def reference_low_latency_dispatch(x: Tensor, topk_idx: Tensor, max_tokens: int,
                                   num_experts: int, group, *, use_fp8: bool = False,
                                   round_scale: bool = False, use_ue8m0: bool = False,
                                   masked: tuple = ()) -> ReferenceLowLatency:
    """The low-latency dispatch, literally (collective over `group`; every rank calls it).

    x: [T, H] bf16; topk_idx: [T, K] int; masked: ranks neither sent to nor received from
    (a masked rank itself need not call)."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    num_local = num_experts // num_ranks
    num_tokens, hidden = x.shape
    padded_x = torch.zeros((max_tokens, hidden), dtype=torch.bfloat16)
    padded_x[:num_tokens] = x
    padded_idx = torch.full((max_tokens, topk_idx.shape[1]), -1, dtype=torch.int64)
    padded_idx[:num_tokens] = topk_idx.long()
    # ids outside [0, E) select nothing
    padded_idx[(padded_idx < 0) | (padded_idx >= num_experts)] = -1
    counts = _gather(torch.tensor([num_tokens]), group)
    all_x = _gather(padded_x, group)
    topk = _gather(padded_idx, group)
    num_tokens_of = [int(c[0]) for c in counts]
    sources = _routes(topk, num_tokens_of, num_experts, masked)
    rows, scales, src_info = [], [] if use_fp8 else None, []
    layout = torch.zeros((num_local, num_ranks), dtype=torch.int64)
    for e in range(num_local):
        mine = sources[rank][e]
        row_list, scale_list = [], []
        for s, t in mine:
            if use_fp8:
                fp8, scale = reference_fp8_cast(all_x[s][t], round_scale)
                row_list.append(fp8)
                scale_list.append(_ue8m0(scale) if use_ue8m0 else scale)
            else:
                row_list.append(all_x[s][t])
        empty = torch.zeros((0, hidden), dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
        rows.append(torch.stack(row_list) if row_list else empty)
        if use_fp8:
            width, dtype = ((-(-hidden // 512), torch.int32) if use_ue8m0
                            else (hidden // 128, torch.float32))
            scales.append(torch.stack(scale_list) if scale_list else
                          torch.zeros((0, width), dtype=dtype))
        src_info.append(torch.tensor([t for _, t in mine], dtype=torch.int32))
        begin = 0
        for s in range(num_ranks):
            count = sum(1 for source, _ in mine if source == s)
            layout[e, s] = begin * (1 << 32) + count
            begin += count
    recv_count = torch.tensor([len(sources[rank][e]) for e in range(num_local)],
                              dtype=torch.int32)
    return ReferenceLowLatency(recv_count, rows, scales, src_info, layout, sources, topk)


def reference_logfmt(row: Tensor) -> Tensor:
    """A bf16 row ([H], H a multiple of 128) after its LogFMT-10 round trip, group by group
    with Python integers (docs/semantics.md, `use_logfmt`)."""
    values = [int(v) & 0xFFFF for v in row.contiguous().view(torch.int16).tolist()]
    out = []
    for begin in range(0, len(values), 128):
        group = values[begin:begin + 128]
        finite = [v & 0x7FFF for v in group if v & 0x7FFF < 0x7F80]
        top = max(finite, default=0)
        lo = max(min(finite, default=0), top - 4096)
        step = max(1, -(-(top - lo) // 508))
        for v in group:
            m, sign = v & 0x7FFF, v >> 15
            if m >= 0x7F80:  # +-Inf keep their bits, a NaN becomes 0x7FC0
                decoded = m if m == 0x7F80 else 0x7FC0
            else:
                below = (top - m + step // 2) // step
                decoded = 0 if below > 508 else max(0, top - below * step)
            out.append(decoded | sign << 15)
    bits = torch.tensor([v - 0x10000 if v >= 0x8000 else v for v in out], dtype=torch.int16)
    return bits.view(torch.bfloat16)


def reference_low_latency_combine(expert_out: Tensor, dispatched: ReferenceLowLatency,
                                  topk_weights: Tensor, group, masked: tuple = (),
                                  use_logfmt: bool = False) -> Tensor:
    """The low-latency combine, literally (collective over `group`).

    expert_out: [E_l, R * M, H] bf16, this rank's expert outputs in `recv_x`'s layout;
    topk_weights: [T, K] float32. Returns [T, H] bf16: for token t, `acc = 0.0` (fp32) and
    for k = 0..K-1, if slot k's expert is valid and neither rank is masked,
    `acc = acc + fp32(w[t, k] * fp32(row))`, with row the expert's row of (this rank, t)
    (after its `reference_logfmt` round trip with `use_logfmt`); a NaN is the canonical
    0x7FC0."""
    rank = dist.get_rank(group)
    num_local = expert_out.shape[0]
    outputs = _gather(expert_out.contiguous(), group)
    num_tokens, num_topk = topk_weights.shape
    combined = torch.zeros((num_tokens, expert_out.shape[2]), dtype=torch.bfloat16)
    if rank in masked:
        return combined
    for t in range(num_tokens):
        acc = torch.zeros(expert_out.shape[2], dtype=torch.float32)
        for k in range(num_topk):
            expert = int(dispatched.topk[rank][t, k])
            if expert < 0:
                continue
            owner, local = divmod(expert, num_local)
            if owner in masked:
                continue
            j = dispatched.sources[owner][local].index((rank, t))
            row = outputs[owner][local, j]
            row = reference_logfmt(row) if use_logfmt else row
            acc = acc + topk_weights[t, k] * row.float()
        combined[t] = acc.to(torch.bfloat16)
    return quiet_nan(combined)
