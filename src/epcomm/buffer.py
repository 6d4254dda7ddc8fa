"""The public `Buffer`: checks arguments (`checks`), hands streams to the stream policy
(`streams`) and the data to a backend (`backends`)."""
from __future__ import annotations

import itertools
import os
from typing import Optional, Union

import torch
import torch.distributed as dist

from . import errors
from .backends import make_backend
from .backends.base import BufferConfig, CombineRequest, DispatchRequest, OutputAllocator
from .checks import call_key, check_combine, check_dispatch, check_expert_ids
from .events import EventOverlap
from .handle import EPHandle
from .streams import StreamPolicy, comm_stream

DispatchInput = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]

_buffer_ids = itertools.count()


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
        self.config = BufferConfig(self.device, self.rank, self.num_ranks,
                                    num_max_tokens_per_rank, hidden, num_topk, timeout_s, num_sms,
                                    self.buffer_id)
        self._streams = StreamPolicy(self.device, self.avoid_record_stream)
        self._backend = make_backend(backend, group, self.config)
        self.num_sms = num_sms if self._backend.num_sms is None else self._backend.num_sms
        self._destroyed = False

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
        self._streams.release_completed()

    def check_errors(self) -> None:
        """Raise `EPError` for any error a sync-free call flagged on the device (reads the flag
        back to the host, so it synchronizes), and clear the flag."""
        flags_tensor = self._backend.error_flags()
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
            self._streams.release_completed(wait=True)
            self._backend.destroy()
            self._destroyed = True

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed")

    def _direct(self, inputs, host_reads: bool) -> bool:
        """Whether a call may run on the current stream as far as the backend and the inputs
        go (`StreamPolicy.run`): the backend queues on named streams, the call reads nothing
        back, and the backend takes every input without a copy."""
        if host_reads or not self._backend.explicit_streams:
            return False
        alignment = self._backend.input_alignment
        return all(tensor is None or _taken_as_is(tensor, alignment) for tensor in inputs)

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
        key = None
        if not do_cpu_sync and handle is None:
            rows = tuple(x) if isinstance(x, (tuple, list)) else (x,)
            key, addresses = call_key(rows, topk_idx, topk_weights, num_experts,
                                      num_max_tokens_per_rank, expert_alignment, do_expand,
                                      do_zero_padding, do_handle_copy, previous_event is not None,
                                      allocate_on_comm_stream)
            prepared = None if addresses is None else self._backend.prepared_dispatch(key)
            if prepared is not None and prepared.takes(addresses):
                # A call shape checked before: no checks, no request.
                self._check_alive()
                if self.device.type == "cpu":
                    check_expert_ids(topk_idx, num_experts)  # (the values are at hand)
                result, event = self._streams.run(
                    lambda alloc, stream: prepared.run(addresses, topk_idx, alloc, stream),
                    (*rows, topk_idx, topk_weights), previous_event, async_with_compute_stream,
                    allocate_on_comm_stream, direct=True)
                return self._dispatch_returns(result, len(rows), event)
        self._check_alive()
        max_tokens = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None \
            else num_max_tokens_per_rank
        if not (isinstance(max_tokens, int) and 0 < max_tokens <= self.num_max_tokens_per_rank):
            raise ValueError("num_max_tokens_per_rank must be in "
                             f"[1, {self.num_max_tokens_per_rank}] (the buffer's), "
                             f"got {max_tokens!r}")
        rows, topk_idx, topk_weights = check_dispatch(
            self.config, x, topk_idx, topk_weights, num_experts, max_tokens, expert_alignment,
            do_cpu_sync, handle, previous_event, allocate_on_comm_stream)
        if handle is not None:
            num_experts, expert_alignment = handle.num_experts, handle.expert_alignment
            do_cpu_sync, do_expand = handle.do_cpu_sync, handle.do_expand
        copy_topk_idx = handle is None and do_handle_copy

        def work(alloc: OutputAllocator, stream):
            # Copies run here, on the stream the call runs on: with `previous_event` it does
            # not wait for work queued on the current stream after that event.
            alignment = self._backend.input_alignment
            return self._backend.dispatch(DispatchRequest(
                rows=[_as_input(row, alignment) for row in rows],
                topk_idx=_as_input(topk_idx, alignment),
                topk_weights=_as_input(topk_weights, alignment),
                num_experts=num_experts, num_max_tokens_per_rank=max_tokens,
                expert_alignment=expert_alignment, do_cpu_sync=do_cpu_sync, do_expand=do_expand,
                do_zero_padding=do_zero_padding, cached=handle, alloc=alloc,
                copy_topk_idx=copy_topk_idx, stream=stream, key=key))

        inputs = (*rows, topk_idx, topk_weights)
        result, event = self._streams.run(work, inputs, previous_event,
                                          async_with_compute_stream, allocate_on_comm_stream,
                                          self._direct(inputs, do_cpu_sync))
        if do_cpu_sync and self.device.type == "cuda":
            self.check_errors()  # this call reads the host anyway: report earlier sync-free errors
        return self._dispatch_returns(result, len(rows), event)

    @staticmethod
    def _dispatch_returns(result, num_payloads: int, event: EventOverlap):
        """`dispatch`'s returns from the backend's `result` (one or two payload tensors)."""
        recv_x = result.recv_rows[0] if num_payloads == 1 else tuple(result.recv_rows)
        return recv_x, result.recv_topk_idx, result.recv_topk_weights, result.handle, event

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
        self._check_alive()
        biases = check_combine(self.config, x, handle, topk_weights, bias, previous_event,
                               allocate_on_comm_stream)

        def work(alloc: OutputAllocator, stream):
            alignment = self._backend.input_alignment
            return self._backend.combine(CombineRequest(
                x=_as_input(x, alignment), handle=handle,
                topk_weights=_as_input(topk_weights, alignment),
                biases=tuple(_as_input(b, alignment) for b in biases), alloc=alloc,
                stream=stream))

        inputs = (x, topk_weights, *biases)
        (combined_x, combined_weights), event = self._streams.run(
            work, inputs, previous_event, async_with_compute_stream, allocate_on_comm_stream,
            self._direct(inputs, handle.do_cpu_sync))
        return combined_x, combined_weights, event
