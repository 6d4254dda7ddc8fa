"""The narrow interface between the public `Buffer` and a communication backend.

`Buffer` validates arguments, picks streams and wraps results; a backend only moves data. It
gets already-checked requests and returns outputs allocated through `OutputAllocator`, so the
caller decides which stream's allocator pool owns them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..handle import EPHandle


# Entries a per-call-shape cache keeps (plans, layouts): a loop whose token count changes every
# call makes one entry per count, a few KB each; the oldest go first.
CACHE_LIMIT = 1024


def remember(cache: dict, key, value, limit: Optional[int] = None):
    """`cache[key] = value`, first dropping the oldest entry when `cache` holds `limit`
    entries (default `CACHE_LIMIT`): returns the dropped value, or None.

    Example: with `cache = {"a": 1, "b": 2}`, `remember(cache, "c", 3, limit=2)` returns 1 and
    leaves `{"b": 2, "c": 3}`; `remember(cache, "b", 4, limit=2)` then returns None."""
    limit = CACHE_LIMIT if limit is None else limit
    dropped = None
    if key not in cache and len(cache) >= limit:
        dropped = cache.pop(next(iter(cache)))
    cache[key] = value
    return dropped


class OutputAllocator:
    """Allocates output tensors from a chosen CUDA stream's pool (or plainly on CPU), and
    remembers them in `allocated` (unless `remember` is False: an allocator kept for many
    calls). `current` is the stream that is current while the backend runs (the communication
    stream); allocating for another one switches to it and back with `torch.cuda.set_stream` (a
    `with torch.cuda.stream(...)` block costs ~16 us of host time)."""

    def __init__(self, device: torch.device, stream: Optional["torch.cuda.Stream"] = None,
                 current: Optional["torch.cuda.Stream"] = None, remember: bool = True) -> None:
        self.device = device
        self.stream = stream
        self.current = current
        self.allocated: Optional[list[torch.Tensor]] = [] if remember else None

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        # (`torch.empty(*shape)`: parsing a size tuple costs 0.4 us more per call, CPU harness)
        if self.stream is self.current:  # the same object (Stream.__eq__ costs 1.8 us)
            tensor = torch.empty(*shape, dtype=dtype, device=self.device)
        else:
            torch.cuda.set_stream(self.stream)
            try:
                tensor = torch.empty(*shape, dtype=dtype, device=self.device)
            finally:
                torch.cuda.set_stream(self.current)
        if self.allocated is not None:
            self.allocated.append(tensor)
        return tensor

    def zeros(self, shape, dtype: torch.dtype) -> torch.Tensor:
        # Zero-filling is queued on the current (communication) stream, not the allocation one.
        return self.empty(shape, dtype).zero_()


@dataclass
class DispatchRequest:
    """A validated dispatch. T tokens, K slots, H hidden.

    rows: payload tensors with T rows, moved as bytes: `[x]` (bf16 [T, H]) or
        `[x_fp8 [T, H], scales [T, ceil(H/128)]]`.
    topk_idx: [T, K] int64 or int32; topk_weights: [T, K] fp32 or None.
    cached: a handle whose routing and layout are reused (no count exchange), or None.
    copy_topk_idx: the new handle must hold a copy of `topk_idx` (made on the comm stream).
    """

    rows: Sequence[torch.Tensor]
    topk_idx: torch.Tensor
    topk_weights: Optional[torch.Tensor]
    num_experts: int
    num_max_tokens_per_rank: int
    expert_alignment: int
    do_cpu_sync: bool
    do_expand: bool
    do_zero_padding: bool
    cached: Optional[EPHandle]
    alloc: OutputAllocator
    copy_topk_idx: bool = False  # the handle keeps a copy of topk_idx, not the caller's tensor
    stream: Optional["torch.cuda.Stream"] = None  # where the device work goes (see Backend)


@dataclass
class DispatchResult:
    """recv_rows: one received tensor per request row tensor; other fields as `Buffer.dispatch`.

    prepared: the backend's prepared call of this sync-free call shape, or None. `Buffer` keeps
    it for later calls with the same validated arguments and then skips the request:
    `prepared.takes(addresses)`, the addresses of the contiguous caller tensors in the order
    (*rows, topk_idx, topk_weights if any) (False: this call cannot take it), then
    `prepared.run(addresses, topk_idx, empty, stream)` -> a `DispatchResult`, where
    `empty(shape, dtype)` allocates (`OutputAllocator.empty`; None: `torch.empty` on the
    current stream); `prepared.stale`: never run it again (make a new one).
    """

    recv_rows: list[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    handle: EPHandle
    prepared: Optional[Any] = None


@dataclass
class CombineRequest:
    """A validated combine: `x` [rows, H] bf16 shaped like the dispatch output of `handle`."""

    x: torch.Tensor
    handle: EPHandle
    topk_weights: Optional[torch.Tensor]
    biases: tuple[torch.Tensor, ...]
    alloc: OutputAllocator
    stream: Optional["torch.cuda.Stream"] = None  # where the device work goes (see Backend)


class Backend:
    """What every backend provides. `rank`, `num_ranks` and `device` are set by the subclass.

    `explicit_streams`: the backend queues all device work of a sync-free call on the
    request's `stream` itself and allocates only through the request's allocator, so the
    caller need not make that stream current. Otherwise it is current during the call.
    `input_alignment`: request tensors are contiguous and their addresses multiples of this
    many bytes (`Buffer` copies the ones that are not, on the stream the call runs on)."""

    name = "abstract"
    explicit_streams = False
    input_alignment = 1
    rank: int
    num_ranks: int
    device: torch.device

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        raise NotImplementedError

    def combine(self, request: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        raise NotImplementedError

    def error_flags(self) -> Optional[torch.Tensor]:
        """A device int32 tensor of sticky error bits (see `epcomm.errors`), or None."""
        return None

    def destroy(self) -> None:
        pass
