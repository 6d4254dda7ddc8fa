"""The stream policy of a `Buffer`: which stream a call's device work goes to, what waits for
what, and how tensors are kept alive until the communication stream is done with them
(contract: streams and events).

One decision, `StreamPolicy.run`: a call the current stream waits for anyway (no
`async_with_compute_stream`, no `previous_event`, outputs from the current stream's pool) whose
inputs the backend takes without copies runs on the current stream itself when the buffer's
earlier calls are all queued there (`_direct_stream`): the same order the communication stream
would give, without two event hand-offs or any `record_stream`. Every other call goes through
the communication stream, made current for it unless the backend queues its work on the stream
it is named.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch

from .backends.base import OutputAllocator
from .events import EventHandle, EventOverlap

_comm_streams: dict[int, "torch.cuda.Stream"] = {}


def comm_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """The communication stream of `device` (one per device and process; None for CPU)."""
    if device.type != "cuda":
        return None
    if device.index not in _comm_streams:
        _comm_streams[device.index] = torch.cuda.Stream(device=device)
    return _comm_streams[device.index]


class StreamPolicy:
    """Runs a buffer's calls with the contract's stream rules on `device`.

    avoid_record_stream: keep inputs and outputs alive by holding references until the comm
    stream's event completes (`EP_AVOID_RECORD_STREAM=1`) instead of `record_stream`."""

    def __init__(self, device: torch.device, avoid_record_stream: bool) -> None:
        self.device = device
        self.avoid_record_stream = avoid_record_stream
        cuda = device.type == "cuda"
        self._pending: list[tuple[torch.cuda.Event, list[torch.Tensor]]] = []
        self._streams: dict[int, "torch.cuda.Stream"] = {}  # raw handle -> Stream
        self._entry_event = torch.cuda.Event() if cuda else None
        # The stream after whose queued work every device call so far comes (None: not one
        # stream; the next call goes through the comm stream), and the stream the last calls
        # ran on if they ran there instead of on the comm stream.
        self._ordered_on: Optional["torch.cuda.Stream"] = None
        self._direct_stream: Optional["torch.cuda.Stream"] = None
        self._direct_event = torch.cuda.Event() if cuda else None
        self._direct_alloc: Optional[OutputAllocator] = None  # the direct calls' allocator

    def release_completed(self, wait: bool = False) -> None:
        """Drop held references the comm stream no longer needs (all of them, waiting for the
        last call, with `wait`)."""
        if not self._pending or torch.cuda.is_current_stream_capturing():
            return
        if wait:
            self._pending[-1][0].synchronize()
        self._pending = [entry for entry in self._pending if not entry[0].query()]

    def _current_stream(self) -> "torch.cuda.Stream":
        """The current stream of the device. `torch.cuda.current_stream()` builds a new Python
        object each call (6-8 us of host time on the GPU machine); the raw handle is cheap, so
        keep one object per handle."""
        raw = torch._C._cuda_getCurrentRawStream(self.device.index)
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.current_stream(self.device)
        return stream

    def _direct_stream_now(self, previous_event: Optional[EventOverlap],
                           async_with_compute_stream: bool,
                           allocate_on_comm_stream: bool) -> Optional["torch.cuda.Stream"]:
        """The current stream, if a call may run on it now (module docstring), else None: its
        device is the buffer's and it is not capturing."""
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

    def run(self, work: Callable, inputs: Sequence[Optional[torch.Tensor]],
            previous_event: Optional[EventOverlap], async_with_compute_stream: bool,
            allocate_on_comm_stream: bool, direct: bool, explicit: bool):
        """Run `work(alloc, stream)`, which queues its device work on `stream` and allocates
        its outputs through `alloc`: (its result, the call's `EventOverlap`). `inputs`: the
        tensors the call reads. `direct`: the call may run on the current stream (its inputs
        are taken as they are; a call that reads counts back waits for that stream, as it would
        for the comm stream); it does when `_direct_stream_now` allows it. Otherwise the comm
        stream runs it, made current unless `direct` and `explicit` (`work` queues everything
        on the stream it is given, copies of inputs included: switching costs host time)."""
        if self.device.type != "cuda":
            return work(OutputAllocator(self.device), None), EventOverlap()
        self.release_completed()
        if direct:
            stream = self._direct_stream_now(previous_event, async_with_compute_stream,
                                             allocate_on_comm_stream)
            if stream is not None:
                alloc = self._direct_alloc  # (a new allocator costs 1-2 us of host time)
                if alloc is None or alloc.stream is not stream:
                    alloc = self._direct_alloc = OutputAllocator(self.device, stream, stream,
                                                                 remember=False)
                self._direct_stream = stream  # (first: a call that raises has queued work too)
                return work(alloc, stream), EventOverlap(stream=stream)  # (recorded when needed)
        compute = self._current_stream()
        # (torch.cuda.current_device() costs 2-4 us of host time; this is what it returns.)
        same_device = torch._C._cuda_getDevice() == self.device.index
        # Never while capturing: an event recorded in a capture cannot be waited on after it.
        capturing = torch._C._cuda_isCurrentStreamCapturing()  # (torch.cuda wraps it: 1 us)
        entry_event = None if previous_event is None else previous_event.event
        switch = not (direct and explicit and same_device)
        comm = comm_stream(self.device)
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
        event = EventHandle()
        event.record(comm)
        outputs = alloc.allocated
        # Without `async_with_compute_stream` the current stream waits for the comm stream
        # below, so the call is ordered like any op queued on the current stream: blocks of its
        # pool (inputs and outputs allocated there) are reused only by later current-stream
        # work, which runs after the comm stream is done with them; a block of another
        # stream's pool is the caller's to guard, as for any op (`record_stream` for the
        # current stream, the standard rule). Only the comm stream's own outputs, read on the
        # current stream, need protecting then; with `async_with_compute_stream` everything.
        guard_outputs = async_with_compute_stream or allocate_on_comm_stream
        guarded_inputs = [t for t in inputs if t is not None] if async_with_compute_stream \
            else []
        held = None
        if self.avoid_record_stream:
            # (With allocate_on_comm_stream and no async, nothing marks the current stream as
            # a reader of the outputs: README, EP_AVOID_RECORD_STREAM.)
            if async_with_compute_stream:
                held = guarded_inputs + outputs
                # A captured event cannot be queried later; inside a graph the graph's private
                # pool keeps the memory, and the event still carries the references.
                if not capturing:
                    self._pending.append((event, held))
        else:
            for tensor in guarded_inputs:
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
