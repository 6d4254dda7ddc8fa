"""Independent reference for expert-parallel dispatch and combine.

Written the way a user would write it with plain ``torch.distributed``: per-destination
boolean masks, an ``all_to_all_single`` of int64 row counts read on the host, then
exact-split ``all_to_all_single`` calls that move every payload as raw bytes (so gloo can
carry float8 / bf16 / any dtype, and nothing is ever converted on the way). Loops run over
ranks, experts and top-k slots only.

It implements ``docs/semantics.md`` literally and shares no code with the rest of epcomm,
so the real backends can be compared with it bitwise (``epcomm.testing.verify.assert_equal``).

Terms: ``R`` ranks in ``group``; ``E`` experts, ``E_l = E // R`` per rank (expert ``e`` lives
on rank ``e // E_l`` as local expert ``e % E_l``); ``T`` tokens on this rank (``T <= M``);
``K`` top-k slots; ``H`` hidden; ``a`` expert alignment, ``align(n) = ceil(n / a) * a``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

__all__ = ["ReferenceDispatch", "reference_dispatch", "reference_combine"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class ReferenceDispatch:
    """What the receiving rank holds after a reference dispatch (all tensors on ``x``'s device).

    ``N`` = compact rows received (one per (source rank, token) pair routed here, ordered by
    source rank then source token index); ``N_e`` = expand rows (see ``expand_valid``).

    - ``recv_x``: compact ``[N, H]`` rows, or expand ``[N_e, H]`` rows (zero in alignment gaps);
      for FP8 input a tuple ``(fp8 rows [., H] float8_e4m3fn, scale rows [., S])``, bytes as sent.
    - ``recv_topk_idx``: compact ``[N, K]`` int64, local expert id of each slot that maps to this
      rank, else -1. Expand: ``None``.
    - ``recv_topk_weights``: compact ``[N, K]`` fp32, the token's full weights row; expand
      ``[N_e]`` fp32, the weight of the (row, slot) pair stored in that row (0 in gaps).
      ``None`` when dispatch got no weights.
    - ``num_recv_tokens_per_rank``: ``[R]`` int64, compact rows received from each source rank.
    - ``num_recv_tokens_per_expert``: ``[E_l]`` int64, unaligned number of (row, slot) pairs
      per local expert.
    - ``src_token``: ``[N]`` int64, ``src_rank * M + src_token_index`` of each compact row.
    - ``last_slot``: ``[N]`` int64, the last slot ``j`` of that token that maps to this rank.
    - ``expand_rows``: ``[N, K]`` int64, expand-layout row of each slot that maps here, else -1
      (computed in compact mode too).
    - ``expand_valid``: ``[N_e]`` bool, True for rows holding a real (row, slot) pair.
      ``N_e = align(expert_starts[-1] + num_recv_tokens_per_expert[-1])``.
    - ``expert_starts``: ``[E_l]`` int64, ``start_i`` of each expert segment
      (``start_0 = 0``, ``start_i = align(start_{i-1} + count_{i-1})``).
    """

    recv_x: Union[Tensor, Tuple[Tensor, Tensor]]
    recv_topk_idx: Optional[Tensor]
    recv_topk_weights: Optional[Tensor]
    num_recv_tokens_per_rank: Tensor
    num_recv_tokens_per_expert: Tensor
    src_token: Tensor
    last_slot: Tensor
    expand_rows: Tensor
    expand_valid: Tensor
    expert_starts: Tensor


# ----------------------------------------------------------------------------- helpers


def _align(n: int, a: int) -> int:
    return math.ceil(n / a) * a


def _exchange_counts(send_counts: Sequence[int], group, device) -> list:
    """Tell every rank how many rows we send it; return how many rows each rank sends us."""
    send = torch.tensor(list(send_counts), dtype=torch.int64, device=device)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return [int(c) for c in recv.tolist()]


def _as_bytes(t: Tensor) -> Tensor:
    """``[n, ...]`` tensor of any dtype -> ``[n, row_bytes]`` uint8 view (of a contiguous copy)."""
    rows = t.contiguous().reshape(t.shape[0], math.prod(t.shape[1:]))
    if rows.stride(-1) != 1:  # "contiguous" with a size-1 or empty dim may keep any stride there
        rows = rows.clone(memory_format=torch.contiguous_format)
    return rows.view(torch.uint8)


def _from_bytes(b: Tensor, dtype: torch.dtype, row_shape: tuple) -> Tensor:
    """Inverse of ``_as_bytes``."""
    return b.view(dtype).reshape((b.shape[0],) + tuple(row_shape))


def _all_to_all_rows(send: Tensor, rows: Optional[Tensor], send_counts: Sequence[int],
                     recv_counts: Sequence[int], group) -> Tensor:
    """Exact-split all-to-all of the rows ``send[rows]`` (all rows if ``rows`` is None).

    The rows for rank 0 come first (``send_counts[0]`` of them), then rank 1's, ...
    Returns ``sum(recv_counts)`` rows of ``send``'s dtype and row shape, the rows from rank 0
    first. Rows are gathered and moved as raw bytes, so any dtype travels bit-exactly.
    """
    send_bytes = _as_bytes(send)
    if rows is not None:
        send_bytes = send_bytes[rows]
    recv_bytes = torch.empty((sum(recv_counts), send_bytes.shape[1]), dtype=torch.uint8,
                             device=send.device)
    dist.all_to_all_single(recv_bytes, send_bytes, output_split_sizes=list(recv_counts),
                           input_split_sizes=list(send_counts), group=group)
    return _from_bytes(recv_bytes, send.dtype, send.shape[1:])


def quiet_nan(t: Tensor) -> Tensor:
    """`t` (bf16 or fp32) with every NaN as its dtype's canonical quiet NaN, by bits: bf16
    0x7FC0, fp32 0x7FC00000 (docs/semantics.md, NaN; torch's own conversions give other
    NaNs on some paths)."""
    bits = {torch.bfloat16: (torch.int16, 0x7FC0), torch.float32: (torch.int32, 0x7FC00000)}
    int_dtype, nan = bits[t.dtype]
    return torch.where(torch.isnan(t), torch.tensor(nan, dtype=int_dtype).view(t.dtype), t)


def _scatter_rows(src: Tensor, src_rows: Tensor, dst_rows: Tensor, num_rows: int) -> Tensor:
    """``out = zeros(num_rows, ...)``; ``out[dst_rows] = src[src_rows]``, copied as bytes."""
    src_bytes = _as_bytes(src)
    out = torch.zeros((num_rows, src_bytes.shape[1]), dtype=torch.uint8, device=src.device)
    out[dst_rows] = src_bytes[src_rows]
    return _from_bytes(out, src.dtype, src.shape[1:])


def _slot_ranks(topk_idx: Tensor, num_experts: int, num_ranks: int, name: str) -> Tensor:
    """``[T, K]`` int64: the rank owning each slot's expert, -1 for a ``-1`` slot."""
    if topk_idx.dim() != 2 or topk_idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be a [T, K] int64 or int32 tensor, "
                        f"got {tuple(topk_idx.shape)} {topk_idx.dtype}")
    idx = topk_idx.to(torch.int64)
    bad = (idx < -1) | (idx >= num_experts)
    if bool(bad.any()):
        raise ValueError(f"{name} holds expert ids outside [-1, {num_experts}) "
                         f"(replace them with -1 to mean 'no expert')")
    return torch.where(idx >= 0, idx // (num_experts // num_ranks), -1)


def _check_experts(num_experts: int, num_ranks: int) -> None:
    if num_experts <= 0 or num_experts % num_ranks != 0:
        raise ValueError(f"num_experts must be a positive multiple of the group size "
                         f"{num_ranks}, got {num_experts}")


# ----------------------------------------------------------------------------- dispatch


def reference_dispatch(x, topk_idx: Tensor, topk_weights: Optional[Tensor], num_experts: int,
                       num_max_tokens_per_rank: int, group, expert_alignment: int = 1,
                       do_expand: bool = False) -> ReferenceDispatch:
    """Dispatch per ``docs/semantics.md``; collective over ``group``.

    ``x``: ``[T, H]`` bf16, or ``(x_fp8 [T, H] float8_e4m3fn, scales [T, S])`` (scales travel as
    opaque bytes, any dtype). ``topk_idx``: ``[T, K]`` int64/int32, ids in ``[0, E)`` or -1.
    ``topk_weights``: ``[T, K]`` fp32 or None. ``T`` may differ per rank and be 0;
    ``T <= num_max_tokens_per_rank`` (``M``, the same on every rank).
    """
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    parts = list(x) if isinstance(x, (tuple, list)) else [x]
    if len(parts) not in (1, 2) or not all(isinstance(p, Tensor) for p in parts):
        raise TypeError("x must be a tensor or a tuple (x_fp8, scales)")
    num_tokens = parts[0].shape[0]
    if parts[0].dim() != 2 or any(p.dim() != 2 or p.shape[0] != num_tokens for p in parts):
        raise ValueError("x (and its scales) must be 2-D with the same number of rows T")
    if len(parts) == 2 and parts[0].dtype != torch.float8_e4m3fn:
        raise TypeError(f"x[0] must be float8_e4m3fn, got {parts[0].dtype}")
    if tuple(topk_idx.shape[:1]) != (num_tokens,):
        raise ValueError(f"topk_idx must have T={num_tokens} rows, got {tuple(topk_idx.shape)}")
    if topk_weights is not None and (topk_weights.dtype != torch.float32
                                     or topk_weights.shape != topk_idx.shape):
        raise ValueError(f"topk_weights must be {tuple(topk_idx.shape)} float32, "
                         f"got {tuple(topk_weights.shape)} {topk_weights.dtype}")
    _check_experts(num_experts, num_ranks)
    if num_tokens > num_max_tokens_per_rank:
        raise ValueError(f"T={num_tokens} exceeds num_max_tokens_per_rank={num_max_tokens_per_rank}")
    if expert_alignment < 1:
        raise ValueError(f"expert_alignment must be >= 1, got {expert_alignment}")
    device = parts[0].device
    num_local = num_experts // num_ranks
    num_topk = topk_idx.shape[1]
    slot_rank = _slot_ranks(topk_idx, num_experts, num_ranks, "topk_idx").to(device)

    # --- sender: token t goes to rank r once if any of its slots maps to r.
    rows_for = [torch.nonzero((slot_rank == r).any(dim=1)).flatten() for r in range(num_ranks)]
    send_counts = [int(rows.numel()) for rows in rows_for]
    order = torch.cat(rows_for)  # rows for rank 0, then rank 1, ... each in token order
    recv_counts = _exchange_counts(send_counts, group, device)

    def move(t: Tensor) -> Tensor:
        return _all_to_all_rows(t, order, send_counts, recv_counts, group)

    src_token_ids = rank * num_max_tokens_per_rank + torch.arange(num_tokens, device=device)
    recv_parts = [move(p) for p in parts]
    recv_idx = move(topk_idx.to(device=device, dtype=torch.int64))  # global ids
    src_token = move(src_token_ids)
    recv_w = move(topk_weights) if topk_weights is not None else None

    # --- receiver: rows are ordered by source rank, then source token (all_to_all order).
    num_rows = src_token.shape[0]
    here = (recv_idx >= 0) & (recv_idx // num_local == rank)  # [N, K] slot maps to this rank
    recv_topk_idx = torch.where(here, recv_idx - rank * num_local, -1)
    last_slot = torch.full((num_rows,), -1, dtype=torch.int64, device=device)
    for j in range(num_topk):
        last_slot = torch.where(here[:, j], j, last_slot)

    counts, starts = [], []
    expand_rows = torch.full((num_rows, num_topk), -1, dtype=torch.int64, device=device)
    start = 0
    for i in range(num_local):
        pairs = torch.nonzero(recv_topk_idx == i)  # (row, slot) pairs, row-major order
        count = int(pairs.shape[0])
        expand_rows[pairs[:, 0], pairs[:, 1]] = start + torch.arange(count, device=device)
        counts.append(count)
        starts.append(start)
        start = _align(start + count, expert_alignment)
    num_expand = _align(starts[-1] + counts[-1], expert_alignment)

    slot_here = expand_rows >= 0
    dst_rows = expand_rows[slot_here]                 # expand row of each pair, (n, j) order
    src_rows = torch.nonzero(slot_here)[:, 0]          # its compact row
    expand_valid = torch.zeros(num_expand, dtype=torch.bool, device=device)
    expand_valid[dst_rows] = True

    if do_expand:
        out_parts = [_scatter_rows(p, src_rows, dst_rows, num_expand) for p in recv_parts]
        out_idx = None
        out_w = None
        if recv_w is not None:
            out_w = torch.zeros(num_expand, dtype=torch.float32, device=device)
            out_w[dst_rows] = recv_w[slot_here]
    else:
        out_parts, out_idx, out_w = recv_parts, recv_topk_idx, recv_w

    i64 = dict(dtype=torch.int64, device=device)
    return ReferenceDispatch(
        recv_x=tuple(out_parts) if len(out_parts) == 2 else out_parts[0],
        recv_topk_idx=out_idx,
        recv_topk_weights=out_w,
        num_recv_tokens_per_rank=torch.tensor(recv_counts, **i64),
        num_recv_tokens_per_expert=torch.tensor(counts, **i64),
        src_token=src_token,
        last_slot=last_slot,
        expand_rows=expand_rows,
        expand_valid=expand_valid,
        expert_starts=torch.tensor(starts, **i64),
    )


# ----------------------------------------------------------------------------- combine


def reference_combine(x: Tensor, dispatched: ReferenceDispatch, topk_idx: Tensor,
                      num_experts: int, group, topk_weights: Optional[Tensor] = None,
                      bias=None, single_reduction: bool = False
                      ) -> Tuple[Tensor, Optional[Tensor]]:
    """Combine per ``docs/semantics.md``; collective over ``group``.

    ``x``: bf16, the rows of ``dispatched``'s output (``[N, H]`` compact, ``[N_e, H]`` expand;
    extra trailing rows are ignored). ``dispatched``: this rank's ``reference_dispatch`` result
    (expand mode iff ``dispatched.recv_topk_idx is None``). ``topk_idx``: the ``[T, K]`` ids this
    rank dispatched with. ``topk_weights``: ``[N, K]`` (compact) or ``[N_e]`` (expand) fp32, or
    None. ``bias``: None, a ``[T, H]`` bf16 tensor, or a tuple of 1 or 2 of them.
    ``single_reduction``: expand mode only (no effect on compact, which reduces once anyway):
    the ``allow_multiple_reduction=False`` combine, which sends every slot's expand row back and
    sums ``0.0 + biases`` then the rows of slots ``j = 0..K-1`` on the source in fp32, rounding
    to bf16 once; the default is steps 1 + 2 (multiple reduction).

    Returns ``(combined_x [T, H] bf16, combined_topk_weights [T, K] fp32 or None)``.
    """
    num_ranks = dist.get_world_size(group)
    _check_experts(num_experts, num_ranks)
    d = dispatched
    expand = d.recv_topk_idx is None
    num_rows = d.src_token.shape[0]
    need = d.expand_valid.shape[0] if expand else num_rows
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] < need:
        raise ValueError(f"x must be [>= {need}, H] bfloat16, got {tuple(x.shape)} {x.dtype}")
    device, hidden = x.device, x.shape[1]
    slot_rank = _slot_ranks(topk_idx, num_experts, num_ranks, "topk_idx").to(device)
    num_tokens, num_topk = slot_rank.shape
    if d.expand_rows.shape[1] != num_topk:
        raise ValueError(f"topk_idx has K={num_topk}, dispatch used K={d.expand_rows.shape[1]}")
    if topk_weights is not None:
        want = (need,) if expand else (need, num_topk)
        if (topk_weights.dtype != torch.float32 or topk_weights.shape[0] < need
                or tuple(topk_weights.shape[1:]) != want[1:]):
            raise ValueError(f"topk_weights must be {want} float32, "
                             f"got {tuple(topk_weights.shape)} {topk_weights.dtype}")
    biases = [] if bias is None else list(bias) if isinstance(bias, (tuple, list)) else [bias]
    if len(biases) > 2 or any(b.dtype != torch.bfloat16 or tuple(b.shape) != (num_tokens, hidden)
                              for b in biases):
        raise ValueError(f"bias must be None or 1-2 tensors [{num_tokens}, {hidden}] bfloat16")

    single = expand and bool(single_reduction)
    # --- receiver, step 1: one bf16 row (and a [K] weights row) per compact row; with a
    # single reduction, one bf16 row per compact row and slot instead (slot_y[j], bytes as x).
    slot_y = []
    if single:
        w_back = torch.zeros((num_rows, num_topk), dtype=torch.float32, device=device)
        for j in range(num_topk):
            has = d.expand_rows[:, j] >= 0
            rows = d.expand_rows[has, j]
            slot_y.append(_scatter_rows(x, rows, torch.nonzero(has).flatten(), num_rows))
            if topk_weights is not None:
                w_back[has, j] = topk_weights[rows]
        y = None
    elif expand:
        acc = torch.zeros((num_rows, hidden), dtype=torch.float32, device=device)
        w_back = torch.zeros((num_rows, num_topk), dtype=torch.float32, device=device)
        for j in range(num_topk):
            has = d.expand_rows[:, j] >= 0
            rows = d.expand_rows[has, j]
            acc[has] = acc[has] + x[rows].float()
            if topk_weights is not None:
                w_back[has, j] = topk_weights[rows]
        y = acc.to(torch.bfloat16)
    else:
        y = x[:num_rows]
        w_back = topk_weights[:num_rows] if topk_weights is not None else None

    # --- send every row back to its source rank (rows are already grouped by source).
    send_counts = [int(c) for c in d.num_recv_tokens_per_rank.tolist()]
    rows_from = [torch.nonzero((slot_rank == r).any(dim=1)).flatten() for r in range(num_ranks)]
    recv_counts = [int(rows.numel()) for rows in rows_from]
    if single:
        slot_back = [_all_to_all_rows(t, None, send_counts, recv_counts, group) for t in slot_y]
    else:
        y_back = _all_to_all_rows(y, None, send_counts, recv_counts, group)
    w_from = (_all_to_all_rows(w_back, None, send_counts, recv_counts, group)
              if topk_weights is not None else None)

    # row_on[r][t] = row of y_back holding rank r's answer for token t (-1 if t not sent to r)
    row_on, offset = [], 0
    for r in range(num_ranks):
        m = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
        m[rows_from[r]] = offset + torch.arange(recv_counts[r], device=device)
        row_on.append(m)
        offset += recv_counts[r]

    # --- source, step 2: fp32 from 0, biases in order, then ranks at each token's last slot
    # (single reduction: then every valid slot's own row, in slot order).
    acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=device)
    for b in biases:
        acc = acc + b.float()
    for j in range(num_topk if single else 0):
        for r in range(num_ranks):
            tokens = torch.nonzero(slot_rank[:, j] == r).flatten()
            acc[tokens] = acc[tokens] + slot_back[j][row_on[r][tokens]].float()
    for j in range(0 if single else num_topk):
        later = slot_rank[:, j + 1:]
        for r in range(num_ranks):
            is_last = (slot_rank[:, j] == r) & ~(later == r).any(dim=1)
            tokens = torch.nonzero(is_last).flatten()
            acc[tokens] = acc[tokens] + y_back[row_on[r][tokens]].float()
    combined_x = quiet_nan(acc.to(torch.bfloat16))

    combined_w = None
    if w_from is not None:
        combined_w = torch.zeros((num_tokens, num_topk), dtype=torch.float32, device=device)
        for j in range(num_topk):
            for r in range(num_ranks):
                tokens = torch.nonzero(slot_rank[:, j] == r).flatten()
                combined_w[tokens, j] = w_from[row_on[r][tokens], j]
    return combined_x, None if combined_w is None else quiet_nan(combined_w)
