"""The public `Buffer`: validates arguments, controls streams and picks a backend."""
from __future__ import annotations

import contextlib
import itertools
import math
import os
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from . import errors
from .backends import make_backend
from .backends.base import CombineRequest, DispatchRequest, OutputAllocator, remember
from .events import EventOverlap
from .handle import EPHandle

DispatchInput = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]

_buffer_ids = itertools.count()
_comm_streams: dict[int, "torch.cuda.Stream"] = {}

FP8_BLOCK = 128


def _check_tensor(name: str, tensor, dtypes: Sequence[torch.dtype], ndim: int,
                  device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, "
                        f"got {tensor.dtype}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} must be on {device} (the buffer's device), got {tensor.device}")


def _check_expert_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    """Expert ids in [-1, E) (reads the values: only where a call reads the host anyway)."""
    if bool(((topk_idx < -1) | (topk_idx >= num_experts)).any()):
        raise ValueError(f"topk_idx holds expert ids outside [-1, {num_experts})")


def _taken_as_is(tensor: torch.Tensor, alignment: int) -> bool:
    """Whether a backend takes `tensor` without a copy: contiguous, its address a multiple of
    `alignment` bytes (`Backend.input_alignment`)."""
    return tensor.is_contiguous() and not tensor.data_ptr() % alignment


def _as_input(tensor: Optional[torch.Tensor], alignment: int) -> Optional[torch.Tensor]:
    """`tensor` as a backend takes it (a new copy unless `_taken_as_is`: fresh allocations are
    aligned)."""
    if tensor is None or _taken_as_is(tensor, alignment):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _call_shape(rows, topk_idx, topk_weights, *arguments) -> tuple[Optional[tuple], list[int]]:
    """What validation and a backend's prepared call depend on in a sync-free dispatch without
    a handle: the dtypes, shapes and devices of the payload `rows` (x, or x_fp8 and its scales),
    topk_idx and topk_weights, and the other `arguments` with their types; with the tensors'
    addresses in that order (a prepared call's caller slots), taken in the same pass. The shape
    is None unless every tensor is a plain, contiguous `torch.Tensor` (the general path checks
    and copies anything else)."""
    tensors = (*rows, topk_idx) if topk_weights is None else (*rows, topk_idx, topk_weights)
    shape, addresses = [], []
    for tensor in tensors:
        if type(tensor) is not torch.Tensor or not tensor.is_contiguous():
            return None, addresses
        shape += (tensor.dtype, tensor.shape, tensor.device)
        addresses.append(tensor.data_ptr())
    return (len(rows), *shape, *arguments, *map(type, arguments)), addresses


class Buffer:
    """Expert-parallel dispatch and combine over one process group.

    Args:
        group: the EP process group (gloo for CPU tensors; NCCL, or gloo with host staging,
            for CUDA tensors; the symmetric backend bootstraps over any group).
        num_max_tokens_per_rank: M, the most tokens any rank passes to one dispatch (the same
            value on every rank); sizes sync-free outputs (`R * M` compact rows).
        hidden: H, the row width of dispatched and combined tensors.
        num_topk: K, the top-k slots of each token.
        use_fp8_dispatch: whether dispatch inputs will be FP8 tuples (informational: both
            bf16 and FP8 dispatch are accepted; combine is always bf16).
        deterministic: accepted for DeepEP parity; epcomm results are always deterministic.
        backend: "auto", "collective" or "symmetric" (see `buffer.backend` for the choice).
        num_sms: SMs for the communication kernels of the symmetric backend (None: default).
        device: where tensors live; default the current CUDA device, else CPU.
        timeout_s: how long a peer may be waited for before a timeout error.
    """

    def __init__(self, group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int,
                 num_topk: int, use_fp8_dispatch: bool = False, deterministic: bool = True,
                 backend: str = "auto", num_sms: Optional[int] = None,
                 device: Optional[Union[str, torch.device]] = None,
                 timeout_s: float = 100.0) -> None:
        for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank),
                            ("hidden", hidden), ("num_topk", num_topk)):
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if backend not in ("auto", "collective", "symmetric"):
            raise ValueError("backend must be 'auto', 'collective' or 'symmetric', "
                             f"got {backend!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden = hidden
        self.num_topk = num_topk
        self.use_fp8_dispatch = use_fp8_dispatch
        self.deterministic = deterministic
        self.timeout_s = timeout_s
        self.avoid_record_stream = os.environ.get("EP_AVOID_RECORD_STREAM", "0") == "1"
        self.buffer_id = next(_buffer_ids)
        self._pending: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []
        self._streams: dict[int, "torch.cuda.Stream"] = {}  # raw handle -> Stream
        self._entry_event = torch.cuda.Event() if self.device.type == "cuda" else None
        # The stream after whose queued work every device call of this buffer so far comes
        # (None: not one stream; the next call goes through the comm stream), and the stream
        # the last calls ran on if they ran there instead of on the comm stream: see `_launch`.
        self._ordered_on: Optional["torch.cuda.Stream"] = None
        self._direct_stream: Optional["torch.cuda.Stream"] = None
        self._direct_event = torch.cuda.Event() if self.device.type == "cuda" else None
        self._direct_alloc: Optional[OutputAllocator] = None  # the direct calls' allocator
        # How a prepared dispatch on the current stream allocates: None, the plan's own
        # `torch.empty` calls; or `empty(shape, dtype)` (tests and timing scripts set one).
        self._direct_empty = None
        self.num_sms = num_sms
        # Validated sync-free call shapes (`_call_shape`) -> the backend's prepared call.
        self._prepared: dict = {}
        self._impl = make_backend(backend, self)
        self.num_sms = getattr(self._impl, "num_sms", num_sms)
        self._destroyed = False

    # -- information -----------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The backend in use: "collective" or "symmetric"."""
        return self._impl.name

    @staticmethod
    def get_buffer_size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int) -> int:
        """Bytes of the symmetric heap one rank allocates (and every peer maps): a dispatch
        region of `R * M` records (a bf16 row or an FP8 row with its scales, expert ids,
        weights, source index) and a combine region of `R * M` bf16 rows with weights, 16-byte
        aligned, plus the counters. The collective backend allocates per call instead."""
        from .backends.symmetric import heap_layout
        return heap_layout(num_ranks, num_max_tokens_per_rank, hidden, num_topk)[-1]

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The communication stream of this process's device (None for CPU buffers)."""
        if self.device.type != "cuda":
            return None
        index = self.device.index
        if index not in _comm_streams:
            _comm_streams[index] = torch.cuda.Stream(device=self.device)
        return _comm_streams[index]

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current CUDA stream (an empty one without CUDA), to pass
        as `previous_event`."""
        if not torch.cuda.is_available():
            return EventOverlap()
        event = torch.cuda.Event()
        event.record()
        return EventOverlap(event)

    def barrier(self) -> None:
        """Wait until every rank of the group has reached this point."""
        self._check_alive()
        dist.barrier(group=self.group)

    def release_completed(self) -> None:
        """Drop the references this buffer holds (EP_AVOID_RECORD_STREAM=1) to inputs and
        outputs whose communication has completed (a non-blocking event query each). The next
        dispatch or combine does this anyway; call it to give memory back earlier."""
        self._drain_pending()

    def check_errors(self) -> None:
        """Raise `EPError` for any error a sync-free call flagged on the device (reads the flag
        back to the host, so it synchronizes), and clear the flag."""
        flags_tensor = self._impl.error_flags()
        if flags_tensor is None:
            return
        flags = int(flags_tensor.item())
        if flags:
            flags_tensor.zero_()
            error = errors.EPTimeoutError if flags & errors.WAIT_TIMEOUT else errors.EPError
            raise error(f"rank {self.rank}: {errors.describe_flags(flags)}")

    def destroy(self) -> None:
        """Release the backend's communication memory; the buffer cannot be used afterwards."""
        if not self._destroyed:
            self._drain_pending(wait=True)
            self._impl.destroy()
            self._destroyed = True

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed")

    # -- validation ------------------------------------------------------------------------
    def _validate_dispatch(self, x, topk_idx, topk_weights, num_experts, max_tokens,
                           expert_alignment, do_cpu_sync, handle, previous_event,
                           allocate_on_comm_stream):
        dev = self.device
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ValueError("x must be a bf16 tensor or a tuple (x_fp8, scales)")
            x_fp8, scales = x
            _check_tensor("x[0] (FP8 rows)", x_fp8, (torch.float8_e4m3fn,), 2, dev)
            _check_tensor("x[1] (FP8 scales)", scales, (torch.float32, torch.int32), 2, dev)
            expect = (x_fp8.shape[0], math.ceil(x_fp8.shape[1] / FP8_BLOCK))
            if scales.shape != expect:
                raise ValueError(f"x[1] (FP8 scales) must have shape {expect}, "
                                 f"got {tuple(scales.shape)}")
            rows = [x_fp8, scales]
        else:
            _check_tensor("x", x, (torch.bfloat16,), 2, dev)
            rows = [x]
        num_tokens, hidden = rows[0].shape
        if hidden != self.hidden:
            raise ValueError(f"x must have hidden size {self.hidden}, got {hidden}")
        if num_tokens > max_tokens:
            raise ValueError(f"x has {num_tokens} tokens, more than "
                             f"num_max_tokens_per_rank={max_tokens}")
        if not (isinstance(expert_alignment, int) and expert_alignment >= 1):
            raise ValueError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
        if previous_event is not None and not allocate_on_comm_stream:
            raise ValueError("previous_event requires allocate_on_comm_stream=True")
        if handle is not None:
            self._validate_handle(handle, num_tokens)
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
            if num_experts % self.num_ranks != 0:
                raise ValueError(f"num_experts={num_experts} must be divisible by the group size "
                                 f"{self.num_ranks}")
            if topk_idx is None:
                raise ValueError("topk_idx is required unless a handle is given")
            _check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), 2, dev)
            if topk_idx.shape != (num_tokens, self.num_topk):
                raise ValueError(f"topk_idx must have shape {(num_tokens, self.num_topk)}, "
                                 f"got {tuple(topk_idx.shape)}")
            if dev.type == "cpu" or do_cpu_sync:
                _check_expert_ids(topk_idx, num_experts)
        if topk_weights is not None:
            _check_tensor("topk_weights", topk_weights, (torch.float32,), 2, dev)
            if topk_weights.shape != topk_idx.shape:
                raise ValueError(f"topk_weights must have shape {tuple(topk_idx.shape)}, "
                                 f"got {tuple(topk_weights.shape)}")
        return rows, topk_idx, topk_weights

    def _validate_handle(self, handle, num_tokens: Optional[int] = None) -> None:
        """`handle` is one this buffer made (for `num_tokens` tokens, if given)."""
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be an EPHandle, got {type(handle).__name__}")
        if handle.buffer_id != self.buffer_id:
            raise ValueError("handle was made by another Buffer; use the buffer that dispatched it")
        if num_tokens is not None and handle.num_tokens != num_tokens:
            raise ValueError(f"handle was made for {handle.num_tokens} tokens, "
                             f"this call has {num_tokens}")

    # -- stream control --------------------------------------------------------------------
    def _drain_pending(self, wait: bool = False) -> None:
        """Drop references the comm stream no longer needs (EP_AVOID_RECORD_STREAM=1)."""
        if not self._pending or torch.cuda.is_current_stream_capturing():
            return
        if wait:
            self._pending[-1][0].synchronize()
        self._pending = [entry for entry in self._pending if not entry[0].query()]

    def _current_stream(self) -> "torch.cuda.Stream":
        """The current stream of the buffer's device. `torch.cuda.current_stream()` builds a
        new Python object each call (6-8 us of host time on the GPU machine); the raw handle
        is cheap, so keep one object per handle."""
        raw = torch._C._cuda_getCurrentRawStream(self.device.index)
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.current_stream(self.device)
        return stream

    def _direct_stream_now(self, previous_event: Optional[EventOverlap],
                           async_with_compute_stream: bool,
                           allocate_on_comm_stream: bool) -> Optional["torch.cuda.Stream"]:
        """The current stream, if a call that may skip the comm stream (see `_launch`) can run
        on it now, else None: the current stream waits for the call anyway (no
        `async_with_compute_stream`, no `previous_event` to wait on, outputs from its own pool),
        this buffer's earlier calls are all queued on it (`_ordered_on`), its device is the
        buffer's and it is not capturing. Then the call keeps the order the comm stream would
        give, without the two event hand-offs or any `record_stream` (every tensor is used in
        the current stream's order)."""
        compute = self._current_stream()
        if (compute is not self._ordered_on or async_with_compute_stream
                or allocate_on_comm_stream
                or (previous_event is not None and previous_event.event is not None)):
            return None
        # (torch.cuda.current_device() costs 2-4 us of host time; this is what it returns.)
        if torch._C._cuda_getDevice() != self.device.index or \
                torch._C._cuda_isCurrentStreamCapturing():  # (torch.cuda wraps it: 1 us)
            return None
        return compute

    def _launch(self, work, inputs: Sequence[Optional[torch.Tensor]],
                previous_event: Optional[EventOverlap], async_with_compute_stream: bool,
                allocate_on_comm_stream: bool, host_reads: bool):
        """Run `work(alloc, stream)` with the contract's stream rules; `work` queues its device
        work on `stream`.

        A call the current stream waits for anyway of a backend that queues its work on a
        named stream (`explicit_streams`), reading nothing back (`host_reads` False) and
        needing no copies (contiguous inputs) runs on the current stream itself when
        `_direct_stream_now` allows it. Otherwise the comm stream runs it; it is made current
        only when `work` needs that (switching costs host time)."""
        self._check_alive()
        if self.device.type != "cuda":
            return work(OutputAllocator(self.device), None), EventOverlap()
        self._drain_pending()
        direct = not host_reads and self._impl.explicit_streams
        alignment = self._impl.input_alignment
        for tensor in inputs:  # (a copy `_as_input` would make runs on the comm stream)
            if direct and tensor is not None:
                direct = _taken_as_is(tensor, alignment)
        if direct:
            stream = self._direct_stream_now(previous_event, async_with_compute_stream,
                                             allocate_on_comm_stream)
            if stream is not None:
                alloc = self._direct_alloc  # (a new allocator costs 1-2 us of host time)
                if alloc is None or alloc.stream is not stream:
                    alloc = self._direct_alloc = OutputAllocator(self.device, stream, stream,
                                                                 remember=False)
                result = work(alloc, stream)
                self._direct_stream = stream
                return result, EventOverlap(stream=stream)  # recorded when first needed
        compute = self._current_stream()
        # (torch.cuda.current_device() costs 2-4 us of host time; this is what it returns.)
        same_device = torch._C._cuda_getDevice() == self.device.index
        # Never while capturing: an event recorded in a capture cannot be waited on after it.
        capturing = torch._C._cuda_isCurrentStreamCapturing()  # (torch.cuda wraps it: 1 us)
        entry_event = None if previous_event is None else previous_event.event
        switch = not (direct and same_device)
        comm = self.get_comm_stream()
        used = [t for t in inputs if t is not None]
        if self._direct_stream is not None:
            # Calls through one buffer never overlap: this one waits for the direct ones,
            # whichever stream is current now (for what their stream queued up to now: no
            # less). A graph's replays are ordered by their caller, and a capture cannot wait
            # on work queued outside it.
            if not capturing:
                self._direct_event.record(self._direct_stream)
                comm.wait_event(self._direct_event)
            self._direct_stream = None
        if entry_event is not None:
            comm.wait_event(entry_event)
        else:
            self._entry_event.record(compute)  # what `comm.wait_stream(compute)` does, one
            comm.wait_event(self._entry_event)  # Event object fewer
        alloc = OutputAllocator(self.device, comm if allocate_on_comm_stream else compute,
                                comm if switch else compute)
        if switch:
            # Another current device is kept current afterwards (a stream context costs 16-20
            # us; `set_stream` alone would leave the buffer's device current).
            device = contextlib.nullcontext() if same_device else torch.cuda.device(self.device)
            with device:
                torch.cuda.set_stream(comm)
                try:
                    result = work(alloc, comm)
                finally:
                    torch.cuda.set_stream(compute)
        else:
            result = work(alloc, comm)
        event = torch.cuda.Event()
        event.record(comm)
        outputs = alloc.allocated
        # Without `async_with_compute_stream` the current stream waits for the comm stream
        # below, so blocks of its pool (every output allocated there) are reused only after the
        # comm stream is done with them, and blocks of the comm stream's pool in the comm
        # stream's own order: then only inputs (they may come from any stream's pool) and
        # outputs of the comm stream's pool, read on the current stream, need protecting.
        guard_outputs = async_with_compute_stream or allocate_on_comm_stream
        held = None
        if self.avoid_record_stream:
            # (With allocate_on_comm_stream and no async, nothing marks the current stream as
            # a reader of the outputs: README, EP_AVOID_RECORD_STREAM.)
            held = used + outputs if async_with_compute_stream else used
            # A captured event cannot be queried later; inside a graph the graph's private
            # pool keeps the memory, and the event still carries the references.
            if not capturing:
                self._pending.append((event, held))
        else:
            for tensor in used:
                tensor.record_stream(comm)
            if guard_outputs:
                for tensor in outputs:
                    tensor.record_stream(compute if allocate_on_comm_stream else comm)
        if not async_with_compute_stream:
            compute.wait_event(event)
        # Async: the comm stream's work joins no stream here, so the next call starts there
        # (as does the first call after a capture: captured work runs only when replayed).
        self._ordered_on = None if async_with_compute_stream or capturing else compute
        return result, EventOverlap(event, extra_tensors=held)

    # -- dispatch and combine --------------------------------------------------------------
    def dispatch(self, x: DispatchInput, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None, expert_alignment: int = 1,
                 do_cpu_sync: bool = True, do_expand: bool = False,
                 do_zero_padding: bool = False, handle: Optional[EPHandle] = None,
                 previous_event: Optional[EventOverlap] = None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 do_handle_copy: bool = True):
        """Send every token to the ranks holding its top-k experts.

        Args:
            x: [T, H] bf16, or (x_fp8 [T, H] float8_e4m3fn, scales [T, ceil(H/128)] float32 or
                int32), T <= M.
            topk_idx: [T, K] int64 or int32 global expert ids, -1 for none. Not needed with
                `handle`. Ids outside [-1, E) raise where the call reads the host (CPU tensors,
                `do_cpu_sync=True`); a sync-free GPU call treats them as -1 and flags an error
                for `check_errors()`.
            topk_weights: [T, K] float32 or None.
            num_experts: E, divisible by the group size (taken from `handle` when given).
            num_max_tokens_per_rank: M, at most the buffer's (default: the buffer's).
            expert_alignment: each expert's row count (compact) or segment start (expand) is
                aligned to this.
            do_cpu_sync: True: exact-size outputs and `handle.num_recv_tokens_per_expert_list`.
                False: capacity-size outputs, counts only on the device, no host sync.
            do_expand: False: compact layout, one row per (source token, this rank).
                True: expand layout, one row per (token, local expert slot), grouped by expert.
            do_zero_padding: zero the rows that carry no token (alignment gaps, sync-free tail).
            handle: reuse this handle's routing and layout (cached dispatch: no count exchange).
            previous_event: the comm stream waits on this instead of the current stream
                (requires `allocate_on_comm_stream=True`).
            async_with_compute_stream: if True, wait on the returned event before reading.
            allocate_on_comm_stream: allocate outputs from the comm stream's pool.
            do_handle_copy: store a copy of `topk_idx` in the handle (else a reference).

        Returns:
            recv_x: [N, H] bf16, or (fp8 [N, H], scales [N, ceil(H/128)]); N rows as the layout.
            recv_topk_idx: compact: [N, K] local expert ids, -1 for other ranks' experts;
                expand: None.
            recv_topk_weights: compact [N, K] float32 full rows; expand [N] float32; None
                without `topk_weights`.
            handle: `EPHandle` for combine and cached dispatch.
            event: `EventOverlap` on the comm stream.
        """
        shape = prepared = None
        if not do_cpu_sync and handle is None:
            rows = tuple(x) if isinstance(x, (tuple, list)) else (x,)
            shape, addresses = _call_shape(rows, topk_idx, topk_weights, num_experts,
                                           num_max_tokens_per_rank, expert_alignment, do_expand,
                                           do_zero_padding, do_handle_copy,
                                           previous_event is not None, allocate_on_comm_stream)
            prepared = self._prepared.get(shape)
            if prepared is not None and prepared.takes(addresses):
                return self._dispatch_prepared(prepared, addresses, rows, topk_idx, topk_weights,
                                               num_experts, previous_event,
                                               async_with_compute_stream, allocate_on_comm_stream)
        rows, topk_idx, topk_weights, sync, work = self._dispatch_work(
            x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank, expert_alignment,
            do_cpu_sync, do_expand, do_zero_padding, handle, previous_event,
            allocate_on_comm_stream, do_handle_copy)
        result, event = self._launch(work, [*rows, topk_idx, topk_weights], previous_event,
                                     async_with_compute_stream, allocate_on_comm_stream,
                                     host_reads=sync)
        if sync and self.device.type == "cuda":
            self.check_errors()  # this call reads the host anyway: report earlier sync-free errors
        if shape is not None and result.prepared not in (None, prepared):
            remember(self._prepared, shape, result.prepared)  # (or replacing a stale one)
        return self._dispatch_returns(result, rows, handle, event)

    def _dispatch_prepared(self, prepared, addresses: list[int], rows, topk_idx: torch.Tensor,
                           topk_weights: Optional[torch.Tensor], num_experts: int,
                           previous_event: Optional[EventOverlap],
                           async_with_compute_stream: bool, allocate_on_comm_stream: bool):
        """A sync-free dispatch of a call shape validated before, through the backend's
        prepared call (`DispatchResult.prepared`): no validation and no request. On the current
        stream when `_direct_stream_now` allows it (the plan checked the tensors: `addresses`),
        else through `_launch`."""
        self._check_alive()
        if self.device.type == "cuda":
            stream = self._direct_stream_now(previous_event, async_with_compute_stream,
                                             allocate_on_comm_stream)
            if stream is None:  # (`_launch` checks and drains for itself)
                def work(alloc: OutputAllocator, stream):
                    return prepared.run(addresses, topk_idx, alloc.empty, stream)

                result, event = self._launch(work, [*rows, topk_idx, topk_weights],
                                             previous_event, async_with_compute_stream,
                                             allocate_on_comm_stream, host_reads=False)
                return self._dispatch_returns(result, rows, None, event)
            self._drain_pending()
            self._direct_stream = stream
            event = EventOverlap(stream=stream)  # recorded when first needed
        else:
            _check_expert_ids(topk_idx, num_experts)  # (CPU tensors: the values are at hand)
            stream, event = None, EventOverlap()
        result = prepared.run(addresses, topk_idx, self._direct_empty, stream)
        return self._dispatch_returns(result, rows, None, event)

    def _dispatch_returns(self, result, rows, handle: Optional[EPHandle], event: EventOverlap):
        """`Buffer.dispatch`'s returns from the backend's `result` (`handle`: the caller's, of
        a cached dispatch)."""
        new_handle = result.handle
        if handle is not None:
            new_handle = handle
        else:
            new_handle.buffer_id = self.buffer_id
            new_handle.num_tokens = rows[0].shape[0]
            new_handle.hidden = self.hidden
        recv_x = result.recv_rows[0] if len(rows) == 1 else tuple(result.recv_rows)
        return recv_x, result.recv_topk_idx, result.recv_topk_weights, new_handle, event

    def _dispatch_work(self, x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                       expert_alignment, do_cpu_sync, do_expand, do_zero_padding, handle,
                       previous_event, allocate_on_comm_stream, do_handle_copy):
        """Validate a dispatch's arguments (raising before any communication): (payload rows,
        topk_idx, topk_weights, whether the call reads the host (`do_cpu_sync`, a cached
        dispatch's from its handle), `work(alloc, stream)` that runs the backend's dispatch)."""
        max_tokens = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None \
            else num_max_tokens_per_rank
        if not (isinstance(max_tokens, int) and 0 < max_tokens <= self.num_max_tokens_per_rank):
            raise ValueError("num_max_tokens_per_rank must be in "
                             f"[1, {self.num_max_tokens_per_rank}] (the buffer's), "
                             f"got {max_tokens!r}")
        rows, topk_idx, topk_weights = self._validate_dispatch(
            x, topk_idx, topk_weights, num_experts, max_tokens, expert_alignment, do_cpu_sync,
            handle, previous_event, allocate_on_comm_stream)
        if handle is not None:
            num_experts, expert_alignment = handle.num_experts, handle.expert_alignment
            do_cpu_sync, do_expand = handle.do_cpu_sync, handle.do_expand
        copy_topk_idx = handle is None and do_handle_copy

        def work(alloc: OutputAllocator, stream):
            # Copies run here, on the comm stream: with `previous_event` it does not wait for
            # work queued on the current stream after that event.
            alignment = self._impl.input_alignment
            return self._impl.dispatch(DispatchRequest(
                rows=[_as_input(row, alignment) for row in rows],
                topk_idx=_as_input(topk_idx, alignment),
                topk_weights=_as_input(topk_weights, alignment),
                num_experts=num_experts, num_max_tokens_per_rank=max_tokens,
                expert_alignment=expert_alignment, do_cpu_sync=do_cpu_sync, do_expand=do_expand,
                do_zero_padding=do_zero_padding, cached=handle, alloc=alloc,
                copy_topk_idx=copy_topk_idx, stream=stream))

        return rows, topk_idx, topk_weights, do_cpu_sync, work

    def combine(self, x: torch.Tensor, handle: EPHandle,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, tuple[torch.Tensor, ...]] = None,
                previous_event: Optional[EventOverlap] = None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """Bring expert outputs back to their source tokens and reduce them (fp32, fixed order).

        Args:
            x: bf16, shaped like the dispatch output of `handle` ([num_recv_tokens, H] compact,
                [num_expanded_tokens, H] expand); rows past the valid prefix are ignored.
            handle: the `EPHandle` of that dispatch.
            topk_weights: compact [num_recv_tokens, K] or expand [num_expanded_tokens] float32,
                sent back per slot; or None.
            bias: None, one [T, H] bf16 tensor or a tuple of up to two, added in fp32 first.
            previous_event, async_with_compute_stream, allocate_on_comm_stream: as in dispatch.

        Returns:
            combined_x: [T, H] bf16, `bf16(bias_sum + sum over receiving ranks)` in the order
                of each rank's last top-k slot of the token.
            combined_topk_weights: [T, K] float32, the weight each slot's owner sent back,
                0 for -1 slots; None without `topk_weights`.
            event: `EventOverlap` on the comm stream.
        """
        self._validate_handle(handle)
        rows = handle.num_output_rows
        _check_tensor("x", x, (torch.bfloat16,), 2, self.device)
        if x.shape != (rows, self.hidden):
            raise ValueError(f"x must have shape {(rows, self.hidden)} (the dispatch output of "
                             f"handle), got {tuple(x.shape)}")
        if topk_weights is not None:
            expect = (rows,) if handle.do_expand else (rows, self.num_topk)
            _check_tensor("topk_weights", topk_weights, (torch.float32,), len(expect), self.device)
            if topk_weights.shape != expect:
                raise ValueError(f"topk_weights must have shape {expect}, "
                                 f"got {tuple(topk_weights.shape)}")
        biases = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
        if len(biases) > 2:
            raise ValueError(f"bias takes at most 2 tensors, got {len(biases)}")
        for index, tensor in enumerate(biases):
            _check_tensor(f"bias[{index}]", tensor, (torch.bfloat16,), 2, self.device)
            if tensor.shape != (handle.num_tokens, self.hidden):
                raise ValueError(f"bias[{index}] must have shape "
                                 f"{(handle.num_tokens, self.hidden)}, got {tuple(tensor.shape)}")
        if previous_event is not None and not allocate_on_comm_stream:
            raise ValueError("previous_event requires allocate_on_comm_stream=True")

        def work(alloc: OutputAllocator, stream):
            alignment = self._impl.input_alignment
            return self._impl.combine(CombineRequest(
                x=_as_input(x, alignment), handle=handle,
                topk_weights=_as_input(topk_weights, alignment),
                biases=tuple(_as_input(b, alignment) for b in biases), alloc=alloc,
                stream=stream))

        (combined_x, combined_weights), event = self._launch(
            work, [x, topk_weights, *biases], previous_event, async_with_compute_stream,
            allocate_on_comm_stream, host_reads=handle.do_cpu_sync)
        return combined_x, combined_weights, event
