"""Argument checks of `Buffer`'s public calls: each violated precondition raises `TypeError` (a
wrong type) or `ValueError` (a wrong value), naming the argument and the expected value, before
any communication starts. Also the call key under which a backend keeps a prepared sync-free
dispatch (`call_key`)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .backends.base import BufferConfig
from .events import EventOverlap, as_event_overlap, check_flag
from .fp8 import num_scales
from .handle import EPHandle
from .layout import expand_capacity

# Row counts and their prefix sums are int32 on the device.
_MAX_ROWS = 2**31 - 1


def check_int(name: str, value, minimum: int = 0) -> int:
    """`value` as an int >= `minimum` (any integral number but a bool)."""
    if type(value) is not int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_timeout(name: str, value) -> float:
    """`value` (seconds) as a positive finite float (any real number but a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} "
                        f"{value!r}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number of seconds, got {value!r}")
    return value


def check_tensor(name: str, tensor, dtypes: Sequence[torch.dtype], ndim: int,
                 device: torch.device, *, shape: Optional[tuple] = None,
                 device_of: str = "the buffer's device") -> None:
    """`tensor` is a tensor of one of `dtypes`, `ndim`-D (with `shape`: of that shape, None
    entries any size), on `device` (`device_of` says whose device that is)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, "
                        f"got {tensor.dtype}")
    if shape is None and tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if shape is not None and (tensor.dim() != len(shape) or any(
            want is not None and got != want for got, want in zip(tensor.shape, shape))):
        want = tuple("*" if size is None else size for size in shape)
        raise ValueError(f"{name} must have shape {want}, got {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} must be on {device} ({device_of}), got {tensor.device}")


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Expert ids in [-1, E) (reads the values: only where a call reads the host anyway)."""
    if bool(((topk_idx < -1) | (topk_idx >= num_experts)).any()):
        raise ValueError(f"topk_idx holds expert ids outside [-1, {num_experts})")


def check_handle(config: BufferConfig, handle, num_tokens: Optional[int] = None) -> None:
    """`handle` is one the buffer of `config` made (for `num_tokens` tokens, if given)."""
    if not isinstance(handle, EPHandle):
        raise TypeError(f"handle must be an EPHandle, got {type(handle).__name__}")
    if handle.buffer_id != config.buffer_id:
        raise ValueError("handle was made by another Buffer; use the buffer that dispatched it")
    if num_tokens is not None and handle.num_tokens != num_tokens:
        raise ValueError(f"handle was made for {handle.num_tokens} tokens, "
                         f"this call has {num_tokens}")


def check_stream_options(previous_event, async_with_compute_stream,
                         allocate_on_comm_stream) -> tuple[Optional[EventOverlap], bool, bool]:
    """(previous_event as an `EventOverlap` or None, async_with_compute_stream,
    allocate_on_comm_stream) checked."""
    previous_event = as_event_overlap("previous_event", previous_event)
    async_with_compute_stream = check_flag("async_with_compute_stream",
                                           async_with_compute_stream)
    allocate_on_comm_stream = check_flag("allocate_on_comm_stream", allocate_on_comm_stream)
    if previous_event is not None and not allocate_on_comm_stream:
        raise ValueError("previous_event requires allocate_on_comm_stream=True")
    return previous_event, async_with_compute_stream, allocate_on_comm_stream


def check_num_sms(num_sms, backend_num_sms: Optional[int]) -> int:
    """`num_sms` (0: the buffer's) checked against the programs of the backend's kernels
    (`backend_num_sms`, None for a backend without kernels of its own, which ignores it)."""
    num_sms = check_int("num_sms", num_sms)
    if num_sms and backend_num_sms is not None and num_sms != backend_num_sms:
        raise ValueError(f"num_sms={num_sms}: this buffer's kernels run with exactly "
                         f"{backend_num_sms} programs (fixed when the buffer was made, the "
                         f"same on every rank); pass 0 or {backend_num_sms}")
    return num_sms


def dispatch_rows(config: BufferConfig, x) -> list[torch.Tensor]:
    """The payload tensors of a dispatch's `x`: `[x]` (bf16 [T, H]) or `[x_fp8, scales]`."""
    dev = config.device
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError("x must be a bf16 tensor or a tuple (x_fp8, scales)")
        x_fp8, scales = x
        check_tensor("x[0] (FP8 rows)", x_fp8, (torch.float8_e4m3fn,), 2, dev)
        check_tensor("x[1] (FP8 scales)", scales, (torch.float32, torch.int32), 2, dev)
        expect = (x_fp8.shape[0], num_scales(x_fp8.shape[1]))
        if scales.shape != expect:
            raise ValueError(f"x[1] (FP8 scales) must have shape {expect}, "
                             f"got {tuple(scales.shape)}")
        rows = [x_fp8, scales]
    elif isinstance(x, torch.Tensor):
        check_tensor("x", x, (torch.bfloat16,), 2, dev)
        rows = [x]
    else:
        raise TypeError(f"x must be a bf16 torch.Tensor or a tuple (x_fp8, scales), "
                        f"got {type(x).__name__}")
    if rows[0].shape[1] != config.hidden:
        raise ValueError(f"x must have hidden size {config.hidden}, got {rows[0].shape[1]}")
    return rows


@dataclass
class DispatchArgs:
    """A dispatch's arguments checked, defaults and a cached dispatch's handle values
    resolved. rows: the payload tensors (`dispatch_rows`); topk_idx: the caller's, or the
    handle's for a cached dispatch."""

    rows: list
    topk_idx: torch.Tensor
    topk_weights: Optional[torch.Tensor]
    num_experts: int
    num_max_tokens_per_rank: int
    expert_alignment: int
    do_cpu_sync: bool
    do_expand: bool
    do_zero_padding: bool
    do_handle_copy: bool
    previous_event: Optional[EventOverlap]
    async_with_compute_stream: bool
    allocate_on_comm_stream: bool
    cumulative_local_expert_recv_stats: Optional[torch.Tensor]
    previous_event_before_epilogue: Optional[EventOverlap]
    use_tma_aligned_col_major_sf: bool


def check_stats(config: BufferConfig, stats, num_local: int) -> None:
    """`cumulative_local_expert_recv_stats`: int32 [E_l] contiguous, on the buffer's device."""
    check_tensor("cumulative_local_expert_recv_stats", stats, (torch.int32,), 1, config.device)
    if stats.shape[0] != num_local:
        raise ValueError(f"cumulative_local_expert_recv_stats must have shape ({num_local},) "
                         f"(one entry per local expert), got {tuple(stats.shape)}")
    if not stats.is_contiguous():
        raise ValueError("cumulative_local_expert_recv_stats must be contiguous (it is "
                         "updated in place)")


def check_dispatch(config: BufferConfig, backend_num_sms: Optional[int], x, topk_idx,
                   topk_weights, num_experts, num_max_tokens_per_rank, expert_alignment,
                   do_cpu_sync, do_expand, do_zero_padding, handle, previous_event,
                   async_with_compute_stream, allocate_on_comm_stream, do_handle_copy,
                   stats, num_sms, num_qps, previous_event_before_epilogue,
                   use_tma_aligned_col_major_sf) -> DispatchArgs:
    """Every argument of `Buffer.dispatch` checked (the buffer's M: `config`)."""
    dev = config.device
    rows = dispatch_rows(config, x)
    num_tokens = rows[0].shape[0]
    previous_event, async_with_compute_stream, allocate_on_comm_stream = check_stream_options(
        previous_event, async_with_compute_stream, allocate_on_comm_stream)
    previous_event_before_epilogue = as_event_overlap("previous_event_before_epilogue",
                                                      previous_event_before_epilogue)
    do_expand = check_flag("do_expand", do_expand)
    do_zero_padding = check_flag("do_zero_padding", do_zero_padding)
    do_handle_copy = check_flag("do_handle_copy", do_handle_copy)
    use_tma_aligned_col_major_sf = check_flag("use_tma_aligned_col_major_sf",
                                              use_tma_aligned_col_major_sf)
    check_num_sms(num_sms, backend_num_sms)
    check_int("num_qps", num_qps)
    if do_cpu_sync is not None:
        do_cpu_sync = check_flag("do_cpu_sync", do_cpu_sync)
    if expert_alignment is not None:
        expert_alignment = check_int("expert_alignment", expert_alignment, 1)
    if num_experts is not None:
        num_experts = check_int("num_experts", num_experts, 1)
    if num_max_tokens_per_rank is not None:
        num_max_tokens_per_rank = check_int("num_max_tokens_per_rank", num_max_tokens_per_rank, 1)
        if num_max_tokens_per_rank > config.num_max_tokens_per_rank:
            raise ValueError(f"num_max_tokens_per_rank must be in "
                             f"[1, {config.num_max_tokens_per_rank}] (the buffer's), "
                             f"got {num_max_tokens_per_rank}")

    if handle is not None:
        # Cached dispatch: the handle's routing, layout and sizes; never a count exchange.
        check_handle(config, handle, num_tokens)
        if num_experts is not None and num_experts != handle.num_experts:
            raise ValueError(f"num_experts={num_experts} differs from the handle's "
                             f"{handle.num_experts}")
        if num_max_tokens_per_rank is not None and \
                num_max_tokens_per_rank != handle.num_max_tokens_per_rank:
            raise ValueError(f"num_max_tokens_per_rank={num_max_tokens_per_rank} differs from "
                             f"the handle's {handle.num_max_tokens_per_rank} (a cached "
                             f"dispatch takes it from its handle)")
        num_experts, max_tokens = handle.num_experts, handle.num_max_tokens_per_rank
        expert_alignment = handle.expert_alignment
        do_cpu_sync, do_expand = handle.do_cpu_sync, handle.do_expand
        topk_idx = handle.tensors["topk_idx"]
    else:
        max_tokens = config.num_max_tokens_per_rank if num_max_tokens_per_rank is None \
            else num_max_tokens_per_rank
        if num_tokens > max_tokens:
            raise ValueError(f"x has {num_tokens} tokens, more than "
                             f"num_max_tokens_per_rank={max_tokens}")
        if num_experts is None:
            raise ValueError("num_experts is required unless a handle is given")
        if num_experts % config.num_ranks != 0:
            raise ValueError(f"num_experts={num_experts} must be divisible by the group size "
                             f"{config.num_ranks}")
        expert_alignment = 1 if expert_alignment is None else expert_alignment
        most_rows = expand_capacity(config.num_ranks, max_tokens, config.num_topk,
                                    num_experts // config.num_ranks, expert_alignment)
        if most_rows > _MAX_ROWS:
            raise ValueError(f"expert_alignment={expert_alignment} is too large: the aligned "
                             f"expert rows of this call may reach {most_rows}, past the int32 "
                             f"counts ({_MAX_ROWS})")
        do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
        if topk_idx is None:
            raise ValueError("topk_idx is required unless a handle is given")
        check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), 2, dev)
        if topk_idx.shape != (num_tokens, config.num_topk):
            raise ValueError(f"topk_idx must have shape {(num_tokens, config.num_topk)}, "
                             f"got {tuple(topk_idx.shape)}")
        if dev.type == "cpu":  # (on a GPU the kernels flag them; see docs/semantics.md)
            check_expert_ids(topk_idx, num_experts)
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, (torch.float32,), 2, dev)
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_weights must have shape {tuple(topk_idx.shape)}, "
                             f"got {tuple(topk_weights.shape)}")
    if stats is not None:
        check_stats(config, stats, num_experts // config.num_ranks)
    return DispatchArgs(rows, topk_idx, topk_weights, num_experts, max_tokens, expert_alignment,
                        do_cpu_sync, do_expand, do_zero_padding, do_handle_copy, previous_event,
                        async_with_compute_stream, allocate_on_comm_stream, stats,
                        previous_event_before_epilogue, use_tma_aligned_col_major_sf)


def check_combine(config: BufferConfig, x, handle, topk_weights, bias) -> tuple:
    """A combine's tensors and handle checked: the biases as a tuple of 0 to 2 tensors."""
    check_handle(config, handle)
    dev, hidden = config.device, config.hidden
    rows = handle.num_output_rows
    check_tensor("x", x, (torch.bfloat16,), 2, dev)
    if x.shape != (rows, hidden):
        raise ValueError(f"x must have shape {(rows, hidden)} (the dispatch output of "
                         f"handle), got {tuple(x.shape)}")
    if topk_weights is not None:
        expect = (rows,) if handle.do_expand else (rows, config.num_topk)
        check_tensor("topk_weights", topk_weights, (torch.float32,), len(expect), dev)
        if topk_weights.shape != expect:
            raise ValueError(f"topk_weights must have shape {expect}, "
                             f"got {tuple(topk_weights.shape)}")
    if bias is None:
        biases = ()
    elif isinstance(bias, torch.Tensor):
        biases = (bias,)
    elif isinstance(bias, (tuple, list)):
        biases = tuple(bias)
    else:
        raise TypeError(f"bias must be None, a torch.Tensor or a tuple of them, "
                        f"got {type(bias).__name__}")
    if len(biases) > 2:
        raise ValueError(f"bias takes at most 2 tensors, got {len(biases)}")
    for index, tensor in enumerate(biases):
        check_tensor(f"bias[{index}]", tensor, (torch.bfloat16,), 2, dev)
        if tensor.shape != (handle.num_tokens, hidden):
            raise ValueError(f"bias[{index}] must have shape "
                             f"{(handle.num_tokens, hidden)}, got {tuple(tensor.shape)}")
    return biases


def check_combine_options(backend_num_sms: Optional[int], previous_event,
                          async_with_compute_stream, allocate_on_comm_stream, num_sms, num_qps,
                          previous_event_before_epilogue) -> tuple:
    """A combine's other arguments checked: (previous_event, async_with_compute_stream,
    allocate_on_comm_stream, previous_event_before_epilogue), the events as `EventOverlap` or
    None. (`Buffer.combine` calls it only when an argument is not its default.)"""
    previous_event, async_with_compute_stream, allocate_on_comm_stream = check_stream_options(
        previous_event, async_with_compute_stream, allocate_on_comm_stream)
    check_num_sms(num_sms, backend_num_sms)
    check_int("num_qps", num_qps)
    previous_event_before_epilogue = as_event_overlap("previous_event_before_epilogue",
                                                      previous_event_before_epilogue)
    return (previous_event, async_with_compute_stream, allocate_on_comm_stream,
            previous_event_before_epilogue)


def tensor_signature(tensor) -> Optional[tuple]:
    """What a prepared call's key records of an optional extra tensor argument: None, or its
    type, dtype, shape, device and contiguity (checked once per key)."""
    if tensor is None:
        return None
    if type(tensor) is not torch.Tensor:
        return (type(tensor),)
    return tensor.dtype, tensor.shape, tensor.device, tensor.is_contiguous()


def call_key(rows, topk_idx, topk_weights,
             *arguments) -> tuple[Optional[tuple], Optional[list[int]]]:
    """What checks and a backend's prepared call depend on in a sync-free dispatch without a
    handle: the dtypes, shapes and devices of the payload `rows` (x, or x_fp8 and its scales),
    topk_idx and topk_weights, and the other `arguments` with their types; with the tensors'
    addresses in that order (a prepared call's caller slots), taken in the same pass. The key
    is None unless every tensor is a plain `torch.Tensor`; the addresses are None unless every
    tensor is also contiguous (the general path copies it first)."""
    tensors = (*rows, topk_idx) if topk_weights is None else (*rows, topk_idx, topk_weights)
    key, addresses, contiguous = [], [], True
    for tensor in tensors:
        if type(tensor) is not torch.Tensor:
            return None, None
        key += (tensor.dtype, tensor.shape, tensor.device)
        addresses.append(tensor.data_ptr())
        contiguous = contiguous and tensor.is_contiguous()
    return (len(rows), *key, *arguments, *map(type, arguments)), \
        addresses if contiguous else None
