"""Differentiable dispatch and combine, over the custom ops of `epcomm.ops`.

They run eagerly as they are and compile without graph breaks (`torch.compile(fullgraph=True)`).
The backward of dispatch is a combine through the same handle (each received row's gradient
flows back to its source token and is summed there); the backward of combine is a cached
dispatch of the output gradient. bf16 inputs for training; an FP8 dispatch's rows have no
gradient, but its weights' gradient flows (a combine of zero rows with the weight gradients).

Weight gradients: in the expand layout they are exact. In the compact layout every receiving
rank gets the token's full weights row, but the gradient returned for slot `j` is the one from
the rank that owns slot `j`'s expert; that is exact when each rank uses only the weights of its
local slots (`recv_topk_idx >= 0`), which is what an MoE layer does.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .buffer import Buffer
from .elastic import ElasticBuffer
from .handle import EPHandle
from .ops import Handle

# Buffer.dispatch options taken only at their defaults (stream and event control, in-place
# statistics, scale layouts): an op runs on the current stream and returns its outputs.
_DEFAULT_ONLY = {"previous_event": None, "async_with_compute_stream": False,
                 "allocate_on_comm_stream": False, "cumulative_local_expert_recv_stats": None,
                 "previous_event_before_epilogue": None, "use_tma_aligned_col_major_sf": False}


def dispatch(buffer: Union[Buffer, ElasticBuffer],
             x: Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]],
             topk_idx: Optional[torch.Tensor] = None,
             topk_weights: Optional[torch.Tensor] = None, *,
             num_experts: Optional[int] = None, num_max_tokens_per_rank: Optional[int] = None,
             expert_alignment: Optional[int] = 1, do_cpu_sync: Optional[bool] = True,
             do_expand: bool = False, do_zero_padding: bool = False,
             handle: Union[None, Handle, EPHandle] = None, num_sms: int = 0,
             do_handle_copy: bool = True, num_qps: int = 0, **options):
    """Differentiable `buffer.dispatch`; arguments as `Buffer.dispatch`. An `ElasticBuffer`
    dispatches through its `Buffer` of (H, K) (under `torch.compile`, make it with `hidden`
    and `num_topk` so that this one exists before the first call).

    `x`: [T, H] bf16, or (x_fp8 [T, H] float8_e4m3fn, scales [T, ceil(H/128)]) (no gradient
    for FP8 rows; `topk_weights` still gets one).
    With `handle` (a `Handle` from this function, or an `EPHandle`): a cached dispatch of `x`
    (and `topk_weights`) through that routing. The stream and event options of
    `Buffer.dispatch`, `cumulative_local_expert_recv_stats` and
    `use_tma_aligned_col_major_sf` are taken at their defaults only (else ValueError): the call
    runs on the current stream.

    Returns `(recv_x, recv_topk_idx, recv_topk_weights, handle)` as `Buffer.dispatch`'s first
    four (shapes there; `recv_x` is a pair for FP8), `handle` an `epcomm.ops.Handle` (with
    `handle=`, that handle). Gradients flow to `x` and `topk_weights`.
    """
    for name, value in options.items():
        if name not in _DEFAULT_ONLY:
            raise TypeError(f"dispatch() got an unexpected keyword argument {name!r}")
        if value is not _DEFAULT_ONLY[name]:
            raise ValueError(f"{name} must be {_DEFAULT_ONLY[name]} here (the differentiable "
                             f"dispatch runs on the current stream), got {value!r}")
    _check_buffer(buffer)
    del do_handle_copy, num_qps  # (the handle always holds a copy; no RDMA queue pairs)
    x, x_scales = (x[0], x[1]) if isinstance(x, (tuple, list)) else (x, None)
    if handle is not None:
        handle = _handle_of(buffer, handle)
        recv_x, recv_scales, recv_weights = torch.ops.epcomm.cached_dispatch(
            x, x_scales, topk_weights, handle.key, handle.storage, buffer_id=handle.buffer_id,
            num_rows=handle.num_rows, do_expand=handle.do_expand,
            do_zero_padding=do_zero_padding, owned_weights_only=False)
        return _recv(recv_x, recv_scales), None, recv_weights, handle
    if isinstance(buffer, ElasticBuffer):
        buffer = buffer._dispatch_engine(x, topk_idx)
    if not isinstance(num_experts, int) or isinstance(num_experts, bool):
        raise TypeError(f"num_experts must be an int, got {type(num_experts).__name__}")
    if num_max_tokens_per_rank is None:
        num_max_tokens_per_rank = buffer.num_max_tokens_per_rank
    recv_x, recv_scales, recv_topk_idx, recv_weights, key, psum_rank, psum_expert, *storage = \
        torch.ops.epcomm.dispatch(
            x, x_scales, topk_idx, topk_weights, buffer_id=buffer.buffer_id,
            num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank,
            expert_alignment=1 if expert_alignment is None else expert_alignment,
            do_cpu_sync=do_cpu_sync is not False, do_expand=do_expand,
            do_zero_padding=do_zero_padding, num_sms=num_sms)
    handle = Handle(key=key, psum_num_recv_tokens_per_scaleup_rank=psum_rank,
                    psum_num_recv_tokens_per_expert=psum_expert, buffer_id=buffer.buffer_id,
                    num_tokens=x.shape[0], num_rows=recv_x.shape[0], do_expand=do_expand,
                    storage=tuple(storage))
    return _recv(recv_x, recv_scales), recv_topk_idx, recv_weights, handle


def _recv(recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor]):
    return recv_x if recv_scales is None else (recv_x, recv_scales)


def _check_buffer(buffer) -> None:
    if not isinstance(buffer, (Buffer, ElasticBuffer)):
        raise TypeError(f"buffer must be an epcomm.Buffer or ElasticBuffer, "
                        f"got {type(buffer).__name__}")


def _handle_of(buffer: Union[Buffer, ElasticBuffer], handle) -> Handle:
    """`handle` (a `Handle`, or an `EPHandle` wrapped in one) checked to come from `buffer`."""
    if isinstance(handle, EPHandle):
        handle = Handle.wrap(handle)
    if not isinstance(handle, Handle):
        raise TypeError(f"handle must be an epcomm.ops.Handle or an EPHandle, "
                        f"got {type(handle).__name__}")
    if handle.buffer_id not in (buffer._by_id if isinstance(buffer, ElasticBuffer)
                                else (buffer.buffer_id,)):
        raise ValueError("handle was made by another Buffer; use the buffer that dispatched it")
    return handle


def combine(buffer: Union[Buffer, ElasticBuffer], x: torch.Tensor,
            handle: Union[Handle, EPHandle], topk_weights: Optional[torch.Tensor] = None,
            bias=None):
    """Differentiable `buffer.combine` through `handle` (a `Handle` from `dispatch`, or an
    `EPHandle`); `x`, `topk_weights`, `bias` as `Buffer.combine`. Returns
    `(combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None)`."""
    _check_buffer(buffer)
    handle = _handle_of(buffer, handle)
    biases = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
    if len(biases) > 2:
        raise ValueError(f"bias takes at most 2 tensors, got {len(biases)}")
    bias0, bias1 = biases + (None,) * (2 - len(biases))
    return torch.ops.epcomm.combine(x, topk_weights, bias0, bias1, handle.key, handle.storage,
                                    buffer_id=handle.buffer_id, num_tokens=handle.num_tokens)
