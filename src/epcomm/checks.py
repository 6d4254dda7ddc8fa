"""Argument checks of `Buffer`'s public calls: each violated precondition raises, naming the
argument and the expected value, before any communication starts. Also the call key under
which a backend keeps a prepared sync-free dispatch (`call_key`)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .backends.base import BufferConfig
from .fp8 import num_scales
from .handle import EPHandle


def check_tensor(name: str, tensor, dtypes: Sequence[torch.dtype], ndim: int,
                 device: torch.device) -> None:
    """`tensor` is a tensor of one of `dtypes`, `ndim`-D, on `device`."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, "
                        f"got {tensor.dtype}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} must be on {device} (the buffer's device), got {tensor.device}")


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


def check_stream_options(previous_event, allocate_on_comm_stream: bool) -> None:
    if previous_event is not None and not allocate_on_comm_stream:
        raise ValueError("previous_event requires allocate_on_comm_stream=True")


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
    else:
        check_tensor("x", x, (torch.bfloat16,), 2, dev)
        rows = [x]
    if rows[0].shape[1] != config.hidden:
        raise ValueError(f"x must have hidden size {config.hidden}, got {rows[0].shape[1]}")
    return rows


def check_dispatch(config: BufferConfig, x, topk_idx, topk_weights, num_experts,
                   max_tokens: int, expert_alignment, do_cpu_sync, handle, previous_event,
                   allocate_on_comm_stream):
    """A dispatch's arguments checked: (payload rows, topk_idx (the handle's for a cached
    dispatch), topk_weights)."""
    dev = config.device
    rows = dispatch_rows(config, x)
    num_tokens = rows[0].shape[0]
    if num_tokens > max_tokens:
        raise ValueError(f"x has {num_tokens} tokens, more than "
                         f"num_max_tokens_per_rank={max_tokens}")
    if not (isinstance(expert_alignment, int) and expert_alignment >= 1):
        raise ValueError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
    check_stream_options(previous_event, allocate_on_comm_stream)
    if handle is not None:
        check_handle(config, handle, num_tokens)
        if num_experts is not None and num_experts != handle.num_experts:
            raise ValueError(f"num_experts={num_experts} differs from the handle's "
                             f"{handle.num_experts}")
        if max_tokens != handle.num_max_tokens_per_rank:
            raise ValueError(f"num_max_tokens_per_rank={max_tokens} differs from the handle's "
                             f"{handle.num_max_tokens_per_rank}")
        topk_idx = handle.topk_idx
    else:
        if not (isinstance(num_experts, int) and num_experts > 0):
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        if num_experts % config.num_ranks != 0:
            raise ValueError(f"num_experts={num_experts} must be divisible by the group size "
                             f"{config.num_ranks}")
        if topk_idx is None:
            raise ValueError("topk_idx is required unless a handle is given")
        check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), 2, dev)
        if topk_idx.shape != (num_tokens, config.num_topk):
            raise ValueError(f"topk_idx must have shape {(num_tokens, config.num_topk)}, "
                             f"got {tuple(topk_idx.shape)}")
        if dev.type == "cpu" or do_cpu_sync:
            check_expert_ids(topk_idx, num_experts)
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, (torch.float32,), 2, dev)
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_weights must have shape {tuple(topk_idx.shape)}, "
                             f"got {tuple(topk_weights.shape)}")
    return rows, topk_idx, topk_weights


def check_combine(config: BufferConfig, x, handle, topk_weights, bias, previous_event,
                  allocate_on_comm_stream) -> tuple:
    """A combine's arguments checked: the biases as a tuple of 0 to 2 tensors."""
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
    biases = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
    if len(biases) > 2:
        raise ValueError(f"bias takes at most 2 tensors, got {len(biases)}")
    for index, tensor in enumerate(biases):
        check_tensor(f"bias[{index}]", tensor, (torch.bfloat16,), 2, dev)
        if tensor.shape != (handle.num_tokens, hidden):
            raise ValueError(f"bias[{index}] must have shape "
                             f"{(handle.num_tokens, hidden)}, got {tuple(tensor.shape)}")
    check_stream_options(previous_event, allocate_on_comm_stream)
    return biases


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
