"""The narrow interface between the public `Buffer` and a communication backend.

`Buffer` validates arguments, picks streams and wraps results; a backend only moves data. It
is built from a `BufferConfig` and a process group, gets already-checked requests and returns
outputs allocated through `OutputAllocator`, so the caller decides which stream's allocator
pool owns them. A backend may keep a `PreparedDispatch` per sync-free call shape (one cache,
in the backend): a later call of that shape then skips validation and the request.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Hashable, Optional, Protocol, Sequence

import torch

from ..handle import EPHandle


@dataclass(frozen=True)
class BufferConfig:
    """What a `Buffer` was made with, as its backend sees it.

    device: where tensors live; rank, num_ranks: this rank and the group size;
    num_max_tokens_per_rank: M; hidden: H; num_topk: K; timeout_s: how long a peer may be
    waited for; num_sms: the programs of the symmetric backend's kernels (None: its default);
    buffer_id: stamped on every handle, so a handle is only used with the buffer that made it.
    """

    device: torch.device
    rank: int
    num_ranks: int
    num_max_tokens_per_rank: int
    hidden: int
    num_topk: int
    timeout_s: float
    num_sms: Optional[int]
    buffer_id: int


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

    def empty_all(self, shapes: Sequence[tuple], makers: Sequence) -> list[torch.Tensor]:
        """One tensor per `(shape, dtype)` of `shapes`; `makers`: for each, a call with no
        arguments that makes it on the current stream (`partial(torch.empty, *shape, ...)`:
        no argument parsing per call), used when the allocation stream is the current one."""
        if self.stream is not self.current:
            return [self.empty(shape, dtype) for shape, dtype in shapes]
        tensors = [make() for make in makers]
        if self.allocated is not None:
            self.allocated += tensors
        return tensors

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
    key: the call shape of a dispatch without a handle (`checks.call_key`), under which the
        backend may keep a `PreparedDispatch`; None for other calls.
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
    key: Optional[Hashable] = None


@dataclass
class DispatchResult:
    """recv_rows: one received tensor per request row tensor; other fields as `Buffer.dispatch`
    (the handle complete: every field set by the backend)."""

    recv_rows: list[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    handle: EPHandle
    flags_checked: bool = False  # the call read the error flag back and raised what it held


class HostCounts:
    """Where a synchronizing dispatch's last kernel leaves its counts for the host: int32
    [2 + E_l] in pinned host memory, which the device writes (unified addressing), so reading
    them costs one wait and no copy: [received rows, error flag, aligned per-expert counts]
    (the symmetric backend's `dispatch_kernels.receive_phase` and the collective one's
    `expand_kernel`, each with `counts_host`)."""

    def __init__(self, num_local: int, device: torch.device) -> None:
        if device.type == "cuda":
            with torch.cuda.device(device):  # pinned (and mapped) for this device's context
                self.words = torch.zeros(2 + num_local, dtype=torch.int32, pin_memory=True)
            self.done = torch.cuda.Event()
        else:
            self.words, self.done = torch.zeros(2 + num_local, dtype=torch.int32), None

    def read(self, stream: Optional["torch.cuda.Stream"]) -> tuple[int, list[int], int]:
        """(received rows, aligned per-expert counts, error flag), once the launch queued on
        `stream` (None: the current stream) is done."""
        if self.done is not None:
            self.done.record(stream)
            self.done.synchronize()
        words = self.words.tolist()
        return words[0], words[2:], words[1]


def exact_result(result: DispatchResult, num_rows: int, per_expert: list[int]) -> DispatchResult:
    """A synchronizing dispatch's results from those of the same call made as a sync-free one
    (capacity-sized outputs, a handle of the capacity) and the counts it read (`HostCounts`):
    the outputs cut to their valid prefix (views: nothing is copied, and the views keep the
    capacity allocations alive), the handle given the exact sizes (its `recv_src_metadata`
    then reads the valid prefix), `do_cpu_sync` and `num_recv_tokens_per_expert_list`. The
    error flag must have been raised already."""
    handle = result.handle
    rows = sum(per_expert) if handle.do_expand else num_rows
    handle.do_cpu_sync = True
    handle.num_recv_tokens = num_rows
    handle.num_expanded_tokens = rows if handle.do_expand else 0
    handle.num_recv_tokens_per_expert_list = per_expert
    idx, weights = result.recv_topk_idx, result.recv_topk_weights
    return DispatchResult([row[:rows] for row in result.recv_rows],
                          None if idx is None else idx[:num_rows],
                          None if weights is None else weights[:rows], handle,
                          flags_checked=True)


def caller_tensors(rows: Sequence[torch.Tensor], topk_idx: torch.Tensor,
                   weights: Optional[torch.Tensor]) -> tuple:
    """A dispatch's caller tensors in a prepared call's slot order (`PreparedDispatch`)."""
    return (*rows, topk_idx) if weights is None else (*rows, topk_idx, weights)


def empty_makers(shapes: Sequence[tuple], device: torch.device) -> list:
    """For each `(shape, dtype)`, a call with no arguments that makes an uninitialised tensor
    of it on `device` (`OutputAllocator.empty_all`): the size as separate ints, because
    Python's argument parsing of `torch.empty(shape_tuple, ...)` costs 0.4 us more per call."""
    return [partial(torch.empty, *shape, dtype=dtype, device=device) for shape, dtype in shapes]


class PreparedDispatch(Protocol):
    """A backend's sync-free dispatch of one call shape, everything but its tensors prepared.

    addresses: the caller tensors' addresses in the order (*rows, topk_idx, topk_weights if
    any), from `checks.call_key`; the tensors are contiguous and of the call shape."""

    def takes(self, addresses: Sequence[int]) -> bool:
        """Whether a call with these addresses can run now (else it takes the general path)."""

    def run(self, addresses: Sequence[int], topk_idx: torch.Tensor, alloc: "OutputAllocator",
            stream: Optional["torch.cuda.Stream"]) -> DispatchResult:
        """Allocate the outputs through `alloc`, queue the call on `stream`, return them."""


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
    """What every backend provides; `config` is the buffer's.

    `explicit_streams`: the backend queues all device work of a sync-free call on the
    request's `stream` itself and allocates only through the request's allocator, so the
    caller need not make that stream current. Otherwise it is current during the call.
    `input_alignment`: request tensors are contiguous and their addresses multiples of this
    many bytes (`Buffer` copies the ones that are not, on the stream the call runs on)."""

    name = "abstract"
    explicit_streams = False
    input_alignment = 1

    def __init__(self, config: BufferConfig) -> None:
        self.config = config
        self.rank, self.num_ranks, self.device = config.rank, config.num_ranks, config.device
        self._host_counts: dict[int, HostCounts] = {}

    def host_counts(self, num_local: int) -> HostCounts:
        """Where a synchronizing dispatch with `num_local` local experts gets its counts: one per
        E_l (each such call reads them before it returns, so calls never share one in
        flight)."""
        host = self._host_counts.get(num_local)
        if host is None:
            host = self._host_counts[num_local] = HostCounts(num_local, self.device)
        return host

    @property
    def num_sms(self) -> Optional[int]:
        """The programs of the backend's kernels (None: it has none)."""
        return None

    def prepared_dispatch(self, key: Hashable) -> Optional[PreparedDispatch]:
        """The prepared call kept for the sync-free call shape `key`, or None (the call then
        goes through `dispatch`, which may prepare one for the next call)."""
        return None

    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        raise NotImplementedError

    def combine(self, request: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        raise NotImplementedError

    def error_flags(self) -> Optional[torch.Tensor]:
        """A device int32 tensor of sticky error bits (see `epcomm.errors`), or None."""
        return None

    def destroy(self) -> None:
        pass
