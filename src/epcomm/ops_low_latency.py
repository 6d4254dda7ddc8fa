"""The low-latency (decode) pair as registered `torch.library` custom ops, for `torch.compile`.

    from epcomm.ops_low_latency import low_latency_dispatch, low_latency_combine

`low_latency_dispatch(buffer, x, topk_idx, M, E, use_fp8=..., ...)` and
`low_latency_combine(buffer, x, topk_idx, topk_weights, handle, use_logfmt=...)` are
`epcomm.legacy.Buffer.low_latency_dispatch` / `low_latency_combine` (V1 `Buffer` made with
`low_latency_mode=True`) as ops that compile without graph breaks (`fullgraph=True`): every
output shape follows from M, H, E, K and R, so the fake implementations need no data. Differences
from the eager methods, all because an op's outputs must be its own:

- `recv_x` (and its scales) and `recv_count` are new tensors of the call, not the buffer's
  alternating slots; the dispatch writes them directly (no copy). The handle's bookkeeping
  still lives in the slot, so the two-call rule holds for handles: a combine whose dispatch's
  slot was reused by a later dispatch raises.
- The combine returns a new [T, H] tensor (no `out=`, no `zero_copy`).
- No receive hooks, events or stats tensors (the op runs on the current stream, receiving
  before it returns); no autograd (decode).

The ops (namespace `epcomm`):
- `low_latency_dispatch(x, topk_idx, buffer_id, num_max_dispatch_tokens_per_rank, num_experts,
  use_fp8, round_scale, use_ue8m0) -> (recv_x, recv_x_scales?, recv_count, key)`;
- `low_latency_combine(x, topk_idx, topk_weights, key, buffer_id, use_logfmt) -> combined_x`.
The buffer crosses as its `buffer_id` and the handle as a *key*, an int64 [1] tensor on the
buffer's device whose memory keeps the `LowLatencyHandle` alive (`epcomm.ops.key_of`).
"""
from __future__ import annotations

import torch

from .buffer import live_buffer
from .legacy import Buffer
from .low_latency import LowLatencyHandle, LowLatencyShape
from .ops import _LIB, define, handle_of, key_of

define(
    "low_latency_dispatch(Tensor x, Tensor topk_idx, int buffer_id, "
    "int num_max_dispatch_tokens_per_rank, int num_experts, bool use_fp8, bool round_scale, "
    "bool use_ue8m0) -> (Tensor recv_x, Tensor? recv_x_scales, Tensor recv_count, Tensor key)")
define(
    "low_latency_combine(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor key, "
    "int buffer_id, bool use_logfmt) -> Tensor")


@torch.library.impl(_LIB, "low_latency_dispatch", "CompositeExplicitAutograd")
def _dispatch(x, topk_idx, buffer_id, num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
              round_scale, use_ue8m0):
    buffer = live_buffer(buffer_id, Buffer)
    transport, shape = buffer._low_latency_call(x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                num_experts, None, None, use_fp8, round_scale,
                                                use_ue8m0)
    recv_x, recv_count, handle, _ = transport.dispatch(
        shape, x.contiguous(), topk_idx.contiguous(), masked=tuple(sorted(buffer._masked)),
        round_scale=round_scale, cumulative_stats=None, wait_stats=None,
        return_recv_hook=False, fresh_outputs=True)
    recv_x, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
    return recv_x, scales, recv_count, key_of(handle, x.device)


@torch.library.register_fake("epcomm::low_latency_dispatch")
def _dispatch_fake(x, topk_idx, buffer_id, num_max_dispatch_tokens_per_rank, num_experts,
                   use_fp8, round_scale, use_ue8m0):
    buffer = live_buffer(buffer_id, Buffer)
    shape = LowLatencyShape(num_ranks=buffer.group_size, rank=buffer.rank,
                            max_tokens=num_max_dispatch_tokens_per_rank, hidden=x.shape[1],
                            num_experts=num_experts, num_topk=topk_idx.shape[1],
                            use_fp8=use_fp8, use_ue8m0=use_ue8m0)
    num_local, rows, columns = shape.num_local, shape.rows, shape.scale_columns
    recv_x = x.new_empty((num_local, rows, x.shape[1]),
                         dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
    scales = None
    if use_fp8:  # column-major in the last two dims, as the eager call returns them
        scales = torch.empty_strided((num_local, rows, columns), (columns * rows, 1, rows),
                                     dtype=torch.int32 if use_ue8m0 else torch.float32,
                                     device=x.device)
    return (recv_x, scales, x.new_empty(num_local, dtype=torch.int32),
            torch.empty(1, dtype=torch.int64, device=x.device))


def resolve(key: torch.Tensor) -> LowLatencyHandle:
    """The `LowLatencyHandle` that `key` (from `low_latency_dispatch`) names."""
    handle = handle_of(key)
    if not isinstance(handle, LowLatencyHandle):
        raise ValueError("handle: not the key of a low-latency dispatch")
    return handle


@torch.library.impl(_LIB, "low_latency_combine", "CompositeExplicitAutograd")
def _combine(x, topk_idx, topk_weights, key, buffer_id, use_logfmt):
    handle = resolve(key)
    out = torch.empty((topk_idx.shape[0], handle[3]), dtype=torch.bfloat16, device=x.device)
    buffer = live_buffer(buffer_id, Buffer)
    return buffer.low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt=use_logfmt,
                                      out=out)[0]


@torch.library.register_fake("epcomm::low_latency_combine")
def _combine_fake(x, topk_idx, topk_weights, key, buffer_id, use_logfmt):
    return x.new_empty((topk_idx.shape[0], x.shape[2]))


def low_latency_dispatch(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor,
                         num_max_dispatch_tokens_per_rank: int, num_experts: int, *,
                         use_fp8: bool = True, round_scale: bool = False,
                         use_ue8m0: bool = False):
    """`buffer.low_latency_dispatch(x, topk_idx, M, E, use_fp8=..., round_scale=...,
    use_ue8m0=...)` as an op: shapes and meaning as there (`recv_x` a pair for FP8), its
    outputs new tensors of the call.

    Returns `(recv_x, recv_count, handle)`; `handle` is a key (int64 [1], on the device) for
    `low_latency_combine`, keeping the dispatch's handle alive as long as it is."""
    recv_x, scales, recv_count, key = torch.ops.epcomm.low_latency_dispatch(
        x, topk_idx, buffer.buffer_id, num_max_dispatch_tokens_per_rank, num_experts,
        use_fp8, round_scale, use_ue8m0)
    return (recv_x if scales is None else (recv_x, scales)), recv_count, key


def low_latency_combine(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor,
                        topk_weights: torch.Tensor, handle: torch.Tensor, *,
                        use_logfmt: bool = False) -> torch.Tensor:
    """`buffer.low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt=...)` as an
    op (`handle`: the key `low_latency_dispatch` returned). Returns `combined_x` [T, H] bf16,
    a new tensor."""
    return torch.ops.epcomm.low_latency_combine(x, topk_idx, topk_weights, handle,
                                                buffer.buffer_id, use_logfmt)


