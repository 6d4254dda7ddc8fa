"""Exceptions and the device-side error bits that sync-free kernels raise."""
from __future__ import annotations

# Sticky bits of a backend's device error flag; `Buffer.check_errors()` turns them into errors.
INVALID_EXPERT_ID = 1  # an expert id outside [-1, num_experts) was treated as -1
EXPAND_OVERFLOW = 2    # repeated expert ids needed more expand rows than the capacity
DISPATCH_TIMEOUT = 4   # a peer did not arrive within the buffer's timeout, in a dispatch
COMBINE_TIMEOUT = 8    # ... in a combine
RECEIVE_OVERFLOW = 16  # peers sent more rows than R * num_max_tokens_per_rank of this rank
WAIT_TIMEOUT = DISPATCH_TIMEOUT | COMBINE_TIMEOUT

_FLAG_TEXT = {
    INVALID_EXPERT_ID: "an expert id in topk_idx was outside [-1, num_experts) and was ignored",
    EXPAND_OVERFLOW: "repeated expert ids in a topk_idx row overflowed the expand capacity; "
                     "the excess rows were dropped",
    DISPATCH_TIMEOUT: "dispatch: a peer did not arrive within the buffer timeout",
    COMBINE_TIMEOUT: "combine: a peer did not arrive within the buffer timeout",
    RECEIVE_OVERFLOW: "peers sent more rows than R * num_max_tokens_per_rank of this rank (the "
                      "ranks passed different num_max_tokens_per_rank); the excess rows were "
                      "dropped",
}


class EPError(RuntimeError):
    """A dispatch or combine failed on the device (reported by `Buffer.check_errors`)."""


class EPTimeoutError(EPError, TimeoutError):
    """A peer did not arrive in time; the message names the rank and the stage."""


def describe_flags(flags: int) -> str:
    """Human-readable text for a set of error bits."""
    return "; ".join(text for bit, text in _FLAG_TEXT.items() if flags & bit)
