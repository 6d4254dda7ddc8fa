"""Exceptions and the device-side error bits that sync-free kernels raise."""
from __future__ import annotations

# Sticky bits of a backend's device error flag; `Buffer.check_errors()` turns them into errors.
INVALID_EXPERT_ID = 1  # an expert id outside [-1, num_experts) was treated as -1
EXPAND_OVERFLOW = 2    # repeated expert ids needed more expand rows than the capacity
DISPATCH_TIMEOUT = 4   # a peer did not arrive within the buffer's timeout, in a dispatch
COMBINE_TIMEOUT = 8    # ... in a combine
RECEIVE_OVERFLOW = 16  # peers sent more rows than R * num_max_tokens_per_rank of this rank
CALL_MISMATCH = 32     # a peer's call had other arguments; its rows were ignored
OUT_OF_STEP = 64       # a peer's signal carried another call number; its rows were ignored
WAIT_TIMEOUT = DISPATCH_TIMEOUT | COMBINE_TIMEOUT

# What every rank's call must agree on, in the order the collective backend sends them with
# each call; a sync-free call that finds a peer's value differing sets CALL_MISMATCH (or
# OUT_OF_STEP for the call sequence number) and, once, the peer's rank + 1 in bits
# MISMATCH_PEER_SHIFT.. of the flag.
CALL_FIELDS = ("call sequence number", "call (dispatch or combine)", "do_cpu_sync",
               "num_experts", "num_max_tokens_per_rank", "do_expand",
               "row bytes (dispatch dtype and hidden)", "hidden", "num_topk",
               "topk_weights given")
MISMATCH_PEER_SHIFT = 16  # bits 16..30
FAULT = WAIT_TIMEOUT | OUT_OF_STEP  # after these the ranks' counters disagree: buffer broken

_FLAG_TEXT = {
    INVALID_EXPERT_ID: "an expert id in topk_idx was outside [-1, num_experts) and was ignored",
    EXPAND_OVERFLOW: "repeated expert ids in a topk_idx row overflowed the expand capacity; "
                     "the excess rows were dropped",
    DISPATCH_TIMEOUT: "dispatch: a peer did not arrive within the buffer timeout",
    COMBINE_TIMEOUT: "combine: a peer did not arrive within the buffer timeout",
    RECEIVE_OVERFLOW: "peers sent more rows than R * num_max_tokens_per_rank of this rank (the "
                      "ranks passed different num_max_tokens_per_rank); the excess rows were "
                      "dropped",
    CALL_MISMATCH: "a peer called with other arguments (num_experts, num_max_tokens_per_rank, "
                   "the row layout (bf16 or FP8) or topk_weights given or not); its rows were "
                   "ignored",
    OUT_OF_STEP: "a peer is out of step (its signal carried another call number: a rank "
                 "skipped, repeated or timed out a call); its rows were ignored",
}


class EPError(RuntimeError):
    """A dispatch or combine failed on the device (reported by `Buffer.check_errors`)."""


class EPFaultError(EPError):
    """A peer was lost, did not arrive in time, or fell out of step. The `Buffer` that raised
    it is broken: every later call raises `EPBrokenError`; destroy it and make a new process
    group and buffer (docs/semantics.md, Faults)."""


class EPTimeoutError(EPFaultError, TimeoutError):
    """A peer did not arrive in time; the message names the rank, the stage and the timeout."""


class EPBrokenError(EPFaultError):
    """A call on a `Buffer` that faulted before; the message names the first failure."""


class EPMismatchError(EPError, ValueError):
    """Ranks passed different configurations or call arguments; the message names the field
    and the ranks that differ."""


class EPInputError(EPError, ValueError):
    """A kernel found bad input that no host check read (expert ids outside [-1, E) in a
    prepared call, repeated ids that overflowed the expand capacity)."""


class EPPeerLostError(EPFaultError, ConnectionError):
    """A peer's connection failed during a call (it exited or crashed); the message names the
    stage and, where known, the peer."""


def describe_flags(flags: int) -> str:
    """Human-readable text for a set of error bits."""
    text = "; ".join(text for bit, text in _FLAG_TEXT.items() if flags & bit)
    peer = (flags >> MISMATCH_PEER_SHIFT) & 0x7FFF
    return text + (f" (first seen from rank {peer - 1})" if peer else "")


def flags_error(flags: int, where: str, timeout_s: float) -> EPError:
    """The exception for error bits `flags` read back by a call at `where` (e.g. "rank 0:
    dispatch"): `EPTimeoutError` naming the timeout that applied, `EPFaultError` for a peer out
    of step, `EPMismatchError` for a peer whose call differed, else `EPError`."""
    text = f"{where}: {describe_flags(flags)}"
    if flags & WAIT_TIMEOUT:
        return EPTimeoutError(f"{text} (timeout_s={timeout_s}, wall-clock)")
    if flags & FAULT:
        return EPFaultError(text)
    if flags & CALL_MISMATCH:
        return EPMismatchError(text)
    if flags & (INVALID_EXPERT_ID | EXPAND_OVERFLOW) == flags & ((1 << MISMATCH_PEER_SHIFT) - 1):
        return EPInputError(text)
    return EPError(text)
