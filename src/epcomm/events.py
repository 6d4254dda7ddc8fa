"""`EventOverlap`: what a dispatch or combine returns to order later work after it, and
`EventHandle`, the CUDA event inside it (DeepEP's names and methods).

On CUDA an `EventOverlap` wraps an `EventHandle` recorded on the communication stream when the
call's work was queued. A call that ran on the current stream itself (`StreamPolicy.run`)
records its event on that stream when the event is first needed (an event costs about 3 us of
host time, and most callers of such a call never use it): it then also covers work queued on
that stream after the call, never less than the call. On CPU tensors every call is synchronous
and the event is empty (`.event` is None): waiting on it does nothing but run the registered
hooks.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


class EventHandle(torch.cuda.Event):
    """A `torch.cuda.Event` with DeepEP's `EventHandle.current_stream_wait()`.

    `EventOverlap.event` is one; `previous_event` of dispatch and combine takes one (as well
    as an `EventOverlap` or any `torch.cuda.Event`).
    """

    def current_stream_wait(self) -> None:
        """Make the current CUDA stream wait for this event (a device-side wait)."""
        torch.cuda.current_stream().wait_event(self)


def check_flag(name: str, value) -> bool:
    """`value` as a bool: True, False, or the ints 1 and 0 (DeepEP's callers pass those)."""
    if value is True or value is False:
        return value
    if type(value) is int and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


class EventOverlap:
    """An event on the communication stream, plus hooks that run after the first wait.

    Use `event.current_stream_wait()` (or `with event:`) before the current stream reads the
    outputs of a call made with `async_with_compute_stream=True`.

    Attributes:
        event: the `EventHandle` (None on CPU, and after a wait with `release_handle=True`).
        extra_tensors: references that must outlive the queued communication work
            (`EP_AVOID_RECORD_STREAM=1`), or None.
    """

    def __init__(self, event: Optional[torch.cuda.Event] = None,
                 extra_tensors: Optional[tuple] = None,
                 stream: Optional["torch.cuda.Stream"] = None) -> None:
        self._event = event
        self._stream = stream  # where to record the event when first needed (no `event`)
        self.extra_tensors = extra_tensors
        self._hooks: list[Callable[[], None]] = []
        self._release_handle_by_call = False  # `with event(release_handle=True):`

    @property
    def event(self) -> Optional[torch.cuda.Event]:
        """The CUDA event (an `EventHandle`; None on CPU)."""
        if self._event is None and self._stream is not None:
            self._event = EventHandle()
            self._event.record(self._stream)
            self._stream = None
        return self._event

    @event.setter
    def event(self, value: Optional[torch.cuda.Event]) -> None:
        if value is not None and not isinstance(value, torch.cuda.Event):
            raise TypeError(f"event must be a torch.cuda.Event or None, "
                            f"got {type(value).__name__}")
        self._event, self._stream = value, None

    @property
    def hook_after_wait(self) -> Optional[Callable[[], None]]:
        """The first hook still to run after the next wait, or None."""
        return self._hooks[0] if self._hooks else None

    @hook_after_wait.setter
    def hook_after_wait(self, hook: Optional[Callable[[], None]]) -> None:
        """Replace the pending hooks by `hook` (None: none)."""
        if hook is not None and not callable(hook):
            raise TypeError(f"hook_after_wait must be callable or None, got {type(hook).__name__}")
        self._hooks = [] if hook is None else [hook]

    def add_hook(self, hook: Callable[[], None]) -> None:
        """Run `hook()` once, right after the first `current_stream_wait()` (any number)."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        self._hooks.append(hook)

    def register_hook_after_wait(self, hook_after_wait: Callable[[], None]) -> None:
        """Run `hook_after_wait()` once, right after the next `current_stream_wait()`, on the
        stream that waited (DeepEP: one hook per event; a second raises RuntimeError)."""
        if not callable(hook_after_wait):
            raise TypeError(f"hook_after_wait must be callable, "
                            f"got {type(hook_after_wait).__name__}")
        if self._hooks:
            raise RuntimeError("a hook is already registered on this EventOverlap")
        self._hooks.append(hook_after_wait)

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Make the current CUDA stream wait for the event (device-side, no host sync), then
        run pending hooks once. `release_handle=True` then drops the event and the references
        it holds (the buffer keeps what its queued work still needs)."""
        release_handle = check_flag("release_handle", release_handle)
        event = self.event
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()
        if release_handle:
            self._event = self._stream = None
            self.extra_tensors = None

    def synchronize(self) -> None:
        """Block the host until the event has completed (a host sync: not for sync-free code)."""
        if self.event is not None:
            self.event.synchronize()

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        """`with event(release_handle=True):` waits on leaving the block, then releases."""
        self._release_handle_by_call = check_flag("release_handle", release_handle)
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        release, self._release_handle_by_call = self._release_handle_by_call, False
        self.current_stream_wait(release_handle=release)


def as_event_overlap(name: str, value) -> Optional[EventOverlap]:
    """`value` (None, an `EventOverlap`, or a `torch.cuda.Event` such as `EventOverlap.event`
    or an `EventHandle`) as an `EventOverlap`; TypeError naming `name` for anything else."""
    if value is None or value.__class__ is EventOverlap or isinstance(value, EventOverlap):
        return value
    if isinstance(value, torch.cuda.Event):
        return EventOverlap(value)
    raise TypeError(f"{name} must be an EventOverlap, an EventHandle (torch.cuda.Event) or "
                    f"None, got {type(value).__name__}")
