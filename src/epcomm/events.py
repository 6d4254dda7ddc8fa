"""`EventOverlap`: what a dispatch or combine returns to order later work after it.

On CUDA it wraps a `torch.cuda.Event` recorded on the communication stream when the call's
work was queued. A call that ran on the current stream itself (`Buffer._launch`) records its
event on that stream when the event is first needed (an event costs about 3 us of host time,
and most callers of such a call never use it): it then also covers work queued on that stream
after the call, never less than the call. On CPU tensors every call is synchronous and the event
is empty: waiting on it does nothing but run the registered hooks.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


class EventOverlap:
    """An event on the communication stream, plus hooks that run after the first wait.

    Use `event.current_stream_wait()` (or `with event:`) before the current stream reads the
    outputs of a call made with `async_with_compute_stream=True`.
    """

    def __init__(self, event: Optional[torch.cuda.Event] = None,
                 extra_tensors: Optional[tuple] = None,
                 stream: Optional["torch.cuda.Stream"] = None) -> None:
        self._event = event
        self._stream = stream  # where to record the event when first needed (no `event`)
        # References that must outlive the queued communication work (EP_AVOID_RECORD_STREAM=1).
        self.extra_tensors = extra_tensors
        self._hooks: list[Callable[[], None]] = []

    @property
    def event(self) -> Optional[torch.cuda.Event]:
        """The CUDA event (None on CPU)."""
        if self._event is None and self._stream is not None:
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
            self._stream = None
        return self._event

    def add_hook(self, hook: Callable[[], None]) -> None:
        """Run `hook()` once, right after the first `current_stream_wait()`."""
        self._hooks.append(hook)

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for the event, then run pending hooks once."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def synchronize(self) -> None:
        """Block the host until the event has completed (a host sync: not for sync-free code)."""
        if self.event is not None:
            self.event.synchronize()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait()
