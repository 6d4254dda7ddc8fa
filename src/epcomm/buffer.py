"""The public `Buffer`: checks arguments (`checks`), hands streams to the stream policy
(`streams`) and the data to a backend (`backends`). `ElasticBuffer` (`elastic`) serves
DeepEP V2's interface through `Buffer` objects."""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import weakref
from typing import Optional, Union

import torch
import torch.distributed as dist

from . import errors
from .backends import make_backend
from .backends.base import (BufferConfig, CombineRequest, DispatchRequest, DispatchResult,
                            OutputAllocator)
from .checks import (call_key, check_combine, check_combine_options, check_dispatch,
                     check_expert_ids, check_flag, check_int, check_timeout, tensor_signature)
from .events import EventHandle, EventOverlap, as_event_overlap
from .handle import EPHandle
from .nan import canonical_nan_
from .streams import StreamPolicy, comm_stream

DispatchInput = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]

_buffer_ids = itertools.count()
# The live buffers by `buffer_id` (weak references: a buffer leaves on `destroy()` or when it is
# collected), so that a custom op names its buffer by an int (`epcomm.ops`,
# `epcomm.ops_low_latency`): `Buffer`s and V1 `epcomm.legacy.Buffer`s, ids never reused.
_live_buffers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register_buffer(buffer) -> int:
    """A new `buffer_id` under which `live_buffer` finds `buffer` while it lives."""
    buffer_id = next(_buffer_ids)
    _live_buffers[buffer_id] = buffer
    return buffer_id


def live_buffer(buffer_id: int, kind: Optional[type] = None):
    """The live buffer of class `kind` (default `Buffer`) whose `buffer_id` is `buffer_id`
    (ValueError if there is none: destroyed, collected or of another class)."""
    kind = Buffer if kind is None else kind
    buffer = _live_buffers.get(buffer_id)
    if not isinstance(buffer, kind):
        raise ValueError(f"buffer_id {buffer_id}: no live {kind.__module__}.{kind.__name__} has "
                         "this id (destroyed or collected)")
    return buffer


# Failures after which the ranks' protocol state disagrees: the buffer is broken.
_FAULTS = (errors.EPFaultError, dist.DistBackendError)


def _agree(group: dist.ProcessGroup, fields: dict) -> None:
    """Raise `EPMismatchError` on every rank of `group` unless every rank passed equal `fields`
    (name -> value; one all-gather), naming each field that differs and the ranks of each
    value."""
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, fields, group=group)
    differ = []
    for name in fields:
        ranks: dict = {}
        for rank, theirs in enumerate(every):
            ranks.setdefault(repr(theirs.get(name)), []).append(rank)
        if len(ranks) > 1:
            differ.append(f"{name}: " + ", ".join(f"{value} on rank(s) {members}"
                                                  for value, members in ranks.items()))
    if differ:
        raise errors.EPMismatchError("Buffer: the ranks of the group were given different "
                                     "configurations: " + "; ".join(differ))


# TMA needs the column stride of a column-major scale tensor to be a multiple of 16 bytes.
_TMA_ALIGNMENT_BYTES = 16


def _taken_as_is(tensor: torch.Tensor, alignment: int) -> bool:
    """Whether a backend takes `tensor` without a copy: contiguous, its address a multiple of
    `alignment` bytes (`Backend.input_alignment`). An empty view counts as contiguous and
    reports address 0 whatever its offset and strides, which a backend's word views of it may
    not accept: taken as is only at offset 0 with unit last stride (inputs are at least 1-D)."""
    if not tensor.numel():
        return not tensor.storage_offset() and tensor.stride(-1) == 1
    return tensor.is_contiguous() and not tensor.data_ptr() % alignment


def _as_input(tensor: Optional[torch.Tensor], alignment: int) -> Optional[torch.Tensor]:
    """`tensor` as a backend takes it (a new copy unless `_taken_as_is`: fresh allocations are
    aligned)."""
    if tensor is None or _taken_as_is(tensor, alignment):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _on(stream: Optional["torch.cuda.Stream"]):
    """A context in which torch operations are queued on `stream` (the stream a call's device
    work goes to): nothing to do when it is already current (compared by raw handle: cheap).
    Allocate a call's outputs (`OutputAllocator`) outside it: the allocator makes its own
    `current` stream current again after allocating for another one."""
    if stream is None or \
            torch._C._cuda_getCurrentRawStream(stream.device_index) == stream.cuda_stream:
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)


def _wait(stream: Optional["torch.cuda.Stream"], event: Optional[EventOverlap]) -> None:
    """`stream` waits for `event` (a device-side wait; nothing on CPU)."""
    if stream is not None and event is not None and event.event is not None:
        stream.wait_event(event.event)


def tma_aligned_col_major(scales: torch.Tensor, alloc: OutputAllocator,
                          stream: Optional["torch.cuda.Stream"] = None) -> torch.Tensor:
    """`scales` [N, S] (4-byte elements) as a column-major tensor whose column stride is N
    rounded up to 16 bytes: shape [N, S], strides (1, align(N, 4)) (the layout TMA loads of
    FP8 GEMMs read). Allocated through `alloc`, filled on `stream` (None: the current one)."""
    rows, cols = scales.shape
    per_line = _TMA_ALIGNMENT_BYTES // scales.element_size()
    storage = alloc.empty((cols, -(-rows // per_line) * per_line), scales.dtype)
    with _on(stream):
        storage[:, :rows].copy_(scales.t())
    return storage[:, :rows].t()


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
        timeout_s: how long a peer may be waited for before a timeout error, in seconds of
            wall-clock time (a positive finite number).
        allow_multiple_reduction: True (default): an expand-layout combine reduces each
            token's local expert rows on the receiving rank first (one bf16 rounding there),
            then sums the ranks' rows on the source. False: a single reduction: every expert
            row travels back to the source, which sums them in top-k slot order in fp32 and
            rounds once (`combine` has the exact rule; it moves one round of compact rows per
            top-k slot). The compact layout has one reduction either way.
    """

    def __init__(self, group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int,
                 num_topk: int, use_fp8_dispatch: bool = False, deterministic: bool = True,
                 backend: str = "auto", num_sms: Optional[int] = None,
                 device: Optional[Union[str, torch.device]] = None,
                 timeout_s: float = 100.0, allow_multiple_reduction: bool = True) -> None:
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup, "
                            f"got {type(group).__name__}")
        for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank),
                            ("hidden", hidden), ("num_topk", num_topk)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if backend not in ("auto", "collective", "symmetric"):
            raise ValueError("backend must be 'auto', 'collective' or 'symmetric', "
                             f"got {backend!r}")
        use_fp8_dispatch = check_flag("use_fp8_dispatch", use_fp8_dispatch)
        deterministic = check_flag("deterministic", deterministic)
        allow_multiple_reduction = check_flag("allow_multiple_reduction",
                                              allow_multiple_reduction)
        if num_sms is not None:
            num_sms = check_int("num_sms", num_sms, 1)
        timeout_s = check_timeout("timeout_s", timeout_s)
        if device is not None and not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
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
        self.allow_multiple_reduction = allow_multiple_reduction
        self.timeout_s = timeout_s
        self.avoid_record_stream = os.environ.get("EP_AVOID_RECORD_STREAM", "0") == "1"
        self.buffer_id = register_buffer(self)
        self.config = BufferConfig(self.device, self.rank, self.num_ranks,
                                    num_max_tokens_per_rank, hidden, num_topk, timeout_s, num_sms,
                                    self.buffer_id)
        # Every rank must agree before any memory is shared (heaps are sized from these).
        _agree(group, dict(num_max_tokens_per_rank=num_max_tokens_per_rank, hidden=hidden,
                           num_topk=num_topk, backend=backend, device_type=self.device.type,
                           allow_multiple_reduction=allow_multiple_reduction))
        self._streams = StreamPolicy(self.device, self.avoid_record_stream)
        self._backend = make_backend(backend, group, self.config)
        self.num_sms = num_sms if self._backend.num_sms is None else self._backend.num_sms
        self._destroyed = False
        self._fault: Optional[str] = None  # the first failure that broke the buffer
        # Handles of dispatches with do_handle_copy=False -> (id, version) of their topk_idx
        # then: a cached dispatch refuses a topk_idx changed in place since.
        self._idx_versions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # -- information -----------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """The backend in use: "collective" or "symmetric"."""
        return self._backend.name

    @staticmethod
    def get_buffer_size_hint(num_ranks: int, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int) -> int:
        """Bytes of the symmetric heap one rank allocates (and every peer maps): a dispatch
        region of `R * M` records (a bf16 row or an FP8 row with its scales, expert ids,
        weights, source index) and a combine region of `R * M` bf16 rows with weights, 16-byte
        aligned, plus the counters. The collective backend allocates per call instead."""
        for name, value in (("num_ranks", num_ranks), ("num_max_tokens_per_rank",
                                                        num_max_tokens_per_rank),
                            ("hidden", hidden), ("num_topk", num_topk)):
            check_int(name, value, 1)
        from .backends.symmetric.heap import heap_layout
        return heap_layout(num_ranks, num_max_tokens_per_rank, hidden, num_topk)[-1]

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The communication stream of this process's device (None for CPU buffers)."""
        return comm_stream(self.device)

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current CUDA stream (an empty one without CUDA), to pass
        as `previous_event`."""
        if not torch.cuda.is_available():
            return EventOverlap()
        event = EventHandle()
        event.record()
        return EventOverlap(event)

    def barrier(self) -> None:
        """Wait until every rank of the group has reached this point."""
        self._check_alive()
        try:
            dist.barrier(group=self.group)
        except dist.DistBackendError as exc:
            raise self._broken_by(errors.EPFaultError(
                f"rank {self.rank}: barrier: the process group failed ({exc})")) from exc

    def release_completed(self) -> None:
        """Drop the references this buffer holds (EP_AVOID_RECORD_STREAM=1) to inputs and
        outputs whose communication has completed (a non-blocking event query each). The next
        dispatch or combine does this anyway; call it to give memory back earlier."""
        self._streams.release_completed()

    def check_errors(self) -> None:
        """Raise `EPError` for any error a sync-free call flagged on the device (reads the flag
        back to the host, so it synchronizes), and clear the flag: `EPTimeoutError` or
        `EPFaultError` for a timeout or a peer out of step (the buffer is broken from then on),
        `EPMismatchError` for a peer that called with other arguments, else `EPError`."""
        flags_tensor = self._backend.error_flags()
        if flags_tensor is None:
            return
        flags = int(flags_tensor.item())
        if flags:
            flags_tensor.zero_()
            error = errors.flags_error(flags, f"rank {self.rank}", self.timeout_s)
            raise self._broken_by(error) if isinstance(error, errors.EPFaultError) else error

    def destroy(self) -> None:
        """Release the backend's communication memory; the buffer cannot be used afterwards."""
        if not self._destroyed:
            self._streams.release_completed(wait=True)
            self._backend.destroy()
            self._destroyed = True
            _live_buffers.pop(self.buffer_id, None)

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed")
        if self._fault is not None:
            raise errors.EPBrokenError(
                f"rank {self.rank}: this Buffer is broken by an earlier failure: {self._fault}. "
                "Its ranks no longer agree on the protocol's state: destroy it "
                "(buffer.destroy()) and make a new process group and a new Buffer")

    def _broken_by(self, exc: BaseException) -> BaseException:
        """Record `exc` (a timeout, a lost peer, ranks out of step) as the failure that broke
        the buffer (the first one is kept); returns `exc` for the caller to raise."""
        if self._fault is None:
            self._fault = f"{type(exc).__name__}: {exc}"
        return exc

    def _direct(self, inputs) -> bool:
        """Whether a call may run on the current stream as far as its inputs go
        (`StreamPolicy.run`): the backend takes every input without a copy."""
        alignment = self._backend.input_alignment
        return all(tensor is None or _taken_as_is(tensor, alignment) for tensor in inputs)

    # -- dispatch and combine --------------------------------------------------------------
    def dispatch(self, x: DispatchInput, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = 1, do_cpu_sync: Optional[bool] = True,
                 do_expand: bool = False, do_zero_padding: bool = False,
                 handle: Optional[EPHandle] = None, previous_event=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 do_handle_copy: bool = True,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event_before_epilogue=None,
                 use_tma_aligned_col_major_sf: bool = False):
        """Send every token to the ranks holding its top-k experts.

        R ranks, E experts, E_l = E // R, K top-k slots, H hidden, T tokens on this rank.

        Args:
            x: [T, H] bf16, or (x_fp8 [T, H] float8_e4m3fn, scales [T, ceil(H/128)] float32 or
                int32 (e.g. four packed UE8M0 exponents)), T <= M.
            topk_idx: [T, K] int64 (`epcomm.topk_idx_t`) or int32 global expert ids, -1 for
                none. Not needed with `handle` (the handle's is used). Ids outside [-1, E)
                raise where the call reads the host (CPU tensors, `do_cpu_sync=True`); a
                sync-free GPU call treats them as -1 and flags an error for `check_errors()`.
            topk_weights: [T, K] float32 or None; with `handle` too (e.g. a backward pass).
            num_experts: E, divisible by the group size (taken from `handle` when given).
            num_max_tokens_per_rank: M of this call, at most the buffer's, the same on every
                rank: the per-source stride of `recv_src_metadata[:, 0]` and the sync-free
                capacity. None: the buffer's, or with `handle` the handle's (an explicit value
                must then equal it).
            expert_alignment: each expert's row count (compact) or segment start (expand) is
                aligned to this (int >= 1; None: 1). Ignored with `handle` (the handle's).
            do_cpu_sync: True: exact-size outputs and `handle.num_recv_tokens_per_expert_list`.
                False: capacity-size outputs, counts only on the device, no host sync.
                None: True without `handle`. With `handle` the value is ignored: a cached
                dispatch never reads the host, and its outputs have the handle's sizes
                (exact if the handle's dispatch synchronized, else the capacity).
            do_expand: False: compact layout, one row per (source token, this rank).
                True: expand layout, one row per (token, local expert slot), grouped by expert.
            do_zero_padding: zero the rows that carry no token (alignment gaps, sync-free tail).
            handle: reuse this handle's routing and layout (cached dispatch: no count exchange);
                the returned handle is this same object.
            previous_event: the comm stream waits on this (`EventOverlap`, `EventHandle` or any
                `torch.cuda.Event`) instead of the current stream (requires
                `allocate_on_comm_stream=True`).
            async_with_compute_stream: if True, wait on the returned event before reading.
            allocate_on_comm_stream: allocate outputs from the comm stream's pool.
            do_handle_copy: store a copy of `topk_idx` in the handle (else a reference).
            cumulative_local_expert_recv_stats: [E_l] int32, contiguous, on the buffer's
                device, or None: the number of (token, slot) pairs this rank received for
                each local expert (`handle.num_unaligned_recv_tokens_per_expert`) is added to
                it in place, on the call's stream (no host sync; cached dispatches add too).
            num_sms: the SMs (kernel programs) of this call: 0 for the buffer's
                (`buffer.num_sms`). The symmetric backend's kernels are built for one count
                (the same on every rank): another value raises ValueError. The collective
                backend runs no kernels of its own and ignores it.
            num_qps: RDMA queue pairs, int >= 0: accepted and ignored (no RDMA here).
            previous_event_before_epilogue: an event (as `previous_event`) that must complete
                before the call writes its outputs, or None. epcomm's dispatch is one step, so
                the whole call waits for it on the stream it runs on.
            use_tma_aligned_col_major_sf: FP8 input only: return the received scales
                column-major, [N, S] with strides (1, align(N, 16 bytes)) (one extra copy);
                else row-major [N, S].

        Returns:
            recv_x: [N, H] bf16, or (fp8 [N, H], scales [N, ceil(H/128)]); N rows as the layout:
                compact `handle.num_recv_tokens`, expand `handle.num_expanded_tokens`.
            recv_topk_idx: compact: [N, K] local expert ids (dtype of topk_idx), -1 for other
                ranks' experts and rows past the valid prefix; expand: None.
            recv_topk_weights: compact [N, K] float32 full rows; expand [N] float32; None
                without `topk_weights`.
            handle: `EPHandle` for combine and cached dispatch.
            event: `EventOverlap` on the comm stream.
        """
        if previous_event is not None and previous_event.__class__ is not EventOverlap:
            previous_event = as_event_overlap("previous_event", previous_event)
        if previous_event_before_epilogue is not None and \
                previous_event_before_epilogue.__class__ is not EventOverlap:
            previous_event_before_epilogue = as_event_overlap("previous_event_before_epilogue",
                                                              previous_event_before_epilogue)
        stats = cumulative_local_expert_recv_stats
        key = None
        if type(do_cpu_sync) is bool and handle is None:
            rows = tuple(x) if isinstance(x, (tuple, list)) else (x,)
            key, addresses = call_key(rows, topk_idx, topk_weights, do_cpu_sync, num_experts,
                                      num_max_tokens_per_rank, expert_alignment, do_expand,
                                      do_zero_padding, do_handle_copy, previous_event is not None,
                                      allocate_on_comm_stream, async_with_compute_stream,
                                      num_sms, num_qps, use_tma_aligned_col_major_sf,
                                      None if stats is None else tensor_signature(stats),
                                      previous_event_before_epilogue is not None)
            prepared = None if addresses is None else self._backend.prepared_dispatch(key)
            if prepared is not None and prepared.takes(addresses):
                # A call shape checked before: no checks, no request.
                self._check_alive()
                if self.device.type == "cpu":
                    check_expert_ids(topk_idx, num_experts)  # (the values are at hand)
                if stats is None and previous_event_before_epilogue is None and \
                        not use_tma_aligned_col_major_sf:
                    def work(alloc, stream):
                        return prepared.run(addresses, topk_idx, alloc, stream)
                    inputs = (*rows, topk_idx, topk_weights)
                else:
                    def work(alloc, stream):
                        _wait(stream, previous_event_before_epilogue)
                        return self._epilogue(prepared.run(addresses, topk_idx, alloc, stream),
                                              alloc, stream, stats, use_tma_aligned_col_major_sf)
                    inputs = (*rows, topk_idx, topk_weights, stats)
                try:
                    result, event = self._streams.run(work, inputs, previous_event,
                                                      async_with_compute_stream,
                                                      allocate_on_comm_stream, direct=True,
                                                      explicit=True)
                except _FAULTS as exc:
                    raise self._broken_by(exc)
                if not do_handle_copy:
                    self._idx_versions[result.handle] = (id(topk_idx), topk_idx._version)
                return self._dispatch_returns(result, len(rows), event)
        self._check_alive()
        args = check_dispatch(self.config, self._backend.num_sms, x, topk_idx, topk_weights,
                              num_experts, num_max_tokens_per_rank, expert_alignment,
                              do_cpu_sync, do_expand, do_zero_padding, handle, previous_event,
                              async_with_compute_stream, allocate_on_comm_stream,
                              do_handle_copy, stats, num_sms, num_qps,
                              previous_event_before_epilogue, use_tma_aligned_col_major_sf)
        copy_topk_idx = handle is None and args.do_handle_copy
        if handle is not None:
            self._check_topk_idx_unchanged(handle)

        def work(alloc: OutputAllocator, stream):
            # Copies run here, on the stream the call runs on: with `previous_event` it does
            # not wait for work queued on the current stream after that event.
            _wait(stream, args.previous_event_before_epilogue)
            alignment = self._backend.input_alignment
            result = self._backend.dispatch(DispatchRequest(
                rows=[_as_input(row, alignment) for row in args.rows],
                topk_idx=_as_input(args.topk_idx, alignment),
                topk_weights=_as_input(args.topk_weights, alignment),
                num_experts=args.num_experts, num_max_tokens_per_rank=args.num_max_tokens_per_rank,
                expert_alignment=args.expert_alignment, do_cpu_sync=args.do_cpu_sync,
                do_expand=args.do_expand, do_zero_padding=args.do_zero_padding, cached=handle,
                alloc=alloc, copy_topk_idx=copy_topk_idx, stream=stream, key=key))
            if handle is not None:
                result.handle = handle  # a cached dispatch returns its handle
            return self._epilogue(result, alloc, stream, stats, args.use_tma_aligned_col_major_sf)

        inputs = (*args.rows, args.topk_idx, args.topk_weights)
        # A cached dispatch never reads the host: it has the handle's sizes.
        host_reads = args.do_cpu_sync and handle is None
        try:
            result, event = self._streams.run(
                work, inputs if stats is None else (*inputs, stats), args.previous_event,
                args.async_with_compute_stream, args.allocate_on_comm_stream,
                self._direct(inputs), self._backend.explicit_streams)
        except _FAULTS as exc:
            raise self._broken_by(exc)
        if handle is None and not args.do_handle_copy:
            self._idx_versions[result.handle] = (id(args.topk_idx), args.topk_idx._version)
        if (host_reads or (handle is None and self.device.type == "cpu")) and \
                not result.flags_checked:
            # This call reads the host anyway (CPU tensors: the flags are at hand; a cached
            # dispatch never reads it): report its own errors (an expand overflow, ...) and
            # earlier sync-free ones at once.
            self.check_errors()
        return self._dispatch_returns(result, len(args.rows), event)

    def _check_topk_idx_unchanged(self, handle: EPHandle) -> None:
        """A cached dispatch of a handle that holds the caller's topk_idx (do_handle_copy=False)
        raises if that tensor was changed in place since its dispatch (its version counter
        moved): the cached layout and the new ids would not match."""
        made = self._idx_versions.get(handle)
        topk_idx = handle.tensors["topk_idx"]
        if made is not None and made[0] == id(topk_idx) and made[1] != topk_idx._version:
            raise ValueError("handle.topk_idx (the caller's tensor: the dispatch had "
                             "do_handle_copy=False) was modified in place after that dispatch; "
                             "a cached dispatch would mix the old layout with the new ids. "
                             "Dispatch again without the handle, or use do_handle_copy=True")

    @staticmethod
    def _epilogue(result: DispatchResult, alloc: OutputAllocator, stream, stats,
                  col_major_scales: bool) -> DispatchResult:
        """A dispatch's optional steps after the backend's, on the call's stream: the received
        counts added to `stats`; the received FP8 scales made TMA-aligned column-major."""
        if stats is not None:
            with _on(stream):
                stats.add_(result.handle.tensors["num_unaligned_recv_tokens_per_expert"])
        if col_major_scales and len(result.recv_rows) == 2:
            result.recv_rows[1] = tma_aligned_col_major(result.recv_rows[1], alloc, stream)
        return result

    @staticmethod
    def _dispatch_returns(result, num_payloads: int, event: EventOverlap):
        """`dispatch`'s returns from the backend's `result` (one or two payload tensors)."""
        recv_x = result.recv_rows[0] if num_payloads == 1 else tuple(result.recv_rows)
        return recv_x, result.recv_topk_idx, result.recv_topk_weights, result.handle, event

    def combine(self, x: torch.Tensor, handle: EPHandle,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, tuple[torch.Tensor, ...]] = None,
                previous_event=None, async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False, num_sms: int = 0, num_qps: int = 0,
                previous_event_before_epilogue=None):
        """Bring expert outputs back to their source tokens and reduce them (fp32, fixed order).

        Args:
            x: bf16, shaped like the dispatch output of `handle` ([num_recv_tokens, H] compact,
                [num_expanded_tokens, H] expand); rows past the valid prefix are ignored.
            handle: the `EPHandle` of that dispatch.
            topk_weights: compact [num_recv_tokens, K] or expand [num_expanded_tokens] float32,
                sent back per slot; or None.
            bias: None, one [T, H] bf16 tensor or a tuple of up to two, added in fp32 first.
            previous_event, async_with_compute_stream, allocate_on_comm_stream: as in dispatch.
            num_sms: 0 (the handle's) or the buffer's kernel programs (as in dispatch).
            num_qps: accepted and ignored (int >= 0).
            previous_event_before_epilogue: an event the whole call waits for, or None.

        Returns:
            combined_x: [T, H] bf16. With the buffer's `allow_multiple_reduction=True` (and in
                the compact layout always): `bf16(bias_sum + sum over receiving ranks)`, each
                rank's row (in the expand layout the bf16 sum of its local slots' rows) added
                at the token's last top-k slot on that rank, in slot order. Expand layout with
                `allow_multiple_reduction=False`: `bf16(bias_sum + sum of the rows of every
                valid slot j, j = 0..K-1)` in fp32, one rounding.
            combined_topk_weights: [T, K] float32, the weight each slot's owner sent back,
                0 for -1 slots; None without `topk_weights`.
            event: `EventOverlap` on the comm stream.
        """
        self._check_alive()
        biases = check_combine(self.config, x, handle, topk_weights, bias)
        if previous_event is not None or previous_event_before_epilogue is not None or \
                async_with_compute_stream is not False or allocate_on_comm_stream is not False \
                or num_sms.__class__ is not int or num_qps.__class__ is not int or num_sms \
                or num_qps < 0:  # (the defaults need no checks)
            previous_event, async_with_compute_stream, allocate_on_comm_stream, \
                previous_event_before_epilogue = check_combine_options(
                    self._backend.num_sms, previous_event, async_with_compute_stream,
                    allocate_on_comm_stream, num_sms, num_qps, previous_event_before_epilogue)
        before_epilogue = previous_event_before_epilogue
        single = handle.do_expand and not self.allow_multiple_reduction

        def work(alloc: OutputAllocator, stream):
            if before_epilogue is not None:
                _wait(stream, before_epilogue)
            alignment = self._backend.input_alignment
            if single:
                return self._combine_single_reduction(
                    handle, _as_input(x, alignment), _as_input(topk_weights, alignment),
                    tuple(_as_input(b, alignment) for b in biases), alloc, stream)
            return self._backend.combine(CombineRequest(
                x=_as_input(x, alignment), handle=handle,
                topk_weights=_as_input(topk_weights, alignment),
                biases=tuple(_as_input(b, alignment) for b in biases), alloc=alloc,
                stream=stream))

        inputs = (x, topk_weights, *biases)
        try:
            (combined_x, combined_weights), event = self._streams.run(
                work, inputs, previous_event, async_with_compute_stream,
                allocate_on_comm_stream, self._direct(inputs), self._backend.explicit_streams)
        except _FAULTS as exc:
            raise self._broken_by(exc)
        if self.device.type == "cpu":
            self.check_errors()  # CPU tensors: the flags are at hand
        return combined_x, combined_weights, event

    def _combine_single_reduction(self, handle: EPHandle, x: torch.Tensor,
                                  weights: Optional[torch.Tensor], biases: tuple,
                                  alloc: OutputAllocator, stream) -> tuple:
        """An expand-layout combine with one reduction (`allow_multiple_reduction=False`).

        Round j (j = 0..K-1) is a compact combine through the handle's routing whose row for
        compact row n is `x[expand row of slot j]` where slot j of n is local, else +0.0: each
        source token gets back exactly the row of its slot j (its other ranks send +0.0, and
        `bf16(0.0 + y) = y`), or +0.0 for a -1 slot. The source adds the rounds to
        `acc = 0.0 + biases` in slot order in fp32 and rounds once. The weights travel in round
        0, as the compact weights row of each slot's expand row."""
        meta = handle.tensors["recv_src_metadata"]
        num_topk = meta.shape[1] - 2
        compact = dataclasses.replace(handle, do_expand=False, num_expanded_tokens=0)
        combined_x = alloc.empty((handle.num_tokens, self.hidden), torch.bfloat16)
        combined_weights = None if weights is None else \
            alloc.empty((handle.num_tokens, num_topk), torch.float32)
        with _on(stream):
            temp = OutputAllocator(self.device, stream, stream, remember=False)
            slot_rows = meta[:, 2:].long()
            local = slot_rows >= 0
            slot_rows = slot_rows.clamp(min=0)
            acc = torch.zeros(handle.num_tokens, self.hidden, dtype=torch.float32,
                              device=self.device)
            for bias in biases:
                acc = acc + bias.float()
            round_weights = None if weights is None else \
                torch.where(local, weights[slot_rows], 0.0)
            zero = x.new_zeros(())
            for slot in range(num_topk):
                rows = torch.where(local[:, slot, None], x.index_select(0, slot_rows[:, slot]),
                                   zero)
                returned, returned_weights = self._backend.combine(CombineRequest(
                    x=rows, handle=compact, topk_weights=round_weights if slot == 0 else None,
                    biases=(), alloc=temp, stream=stream))
                acc += returned.float()
                if slot == 0 and combined_weights is not None:
                    combined_weights.copy_(returned_weights)
            canonical_nan_(combined_x.copy_(acc))
        return combined_x, combined_weights
