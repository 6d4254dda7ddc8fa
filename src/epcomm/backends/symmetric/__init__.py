"""The fast intranode backend: fused Triton kernels store straight into peers' memory.

Every rank owns one symmetric heap (`heap`), mapped by all ranks: counters, then a dispatch and
a combine staging region of R blocks x S records (S = the buffer's `num_max_tokens_per_rank`).
Block s of a staging region is written only by rank s, so no two ranks ever write the same
bytes. Counters only grow (each of the P programs of a kernel adds 1 per call), so nothing is
ever reset and CUDA graphs can replay calls.

One call is one launch (the kernels' docstrings have the steps):
- dispatch: `dispatch_kernel`, its send part (route, wait for the peers to free the previous
  call's records, push, raise ready) then its receive part (wait for ready, copy out into the
  layout, free); a synchronizing dispatch is the same launch into capacity-sized outputs, then
  one host read of its counts and exact-size views of those outputs.
- combine: one launch, `combine_kernel` (return rows, reduced per token in the expand layout,
  then reduce what came back).

Modules: `heap` (the heap and its layout), `plans` (prepared calls: a dispatch or a combine
of one call shape, launched from an argument template), `warmup` (every kernel variant
compiled and loaded when the backend is made), `backend` (`SymmetricBackend`).

A wait that runs past the buffer's timeout (wall-clock) sets the stage's timeout bit of `errors`
in the device error flag and gives up; a synchronizing call raises `EPTimeoutError` naming the
rank, the stage and the timeout, a sync-free one leaves it for `Buffer.check_errors()`. Each
call's signals carry a stamp (its arguments and call number, `kernels.sync`): a peer out of step
or whose call had other arguments is flagged, and its rows are not mixed in. After a timeout or
a peer out of step the ranks' counters disagree: `Buffer` marks itself broken.

Results are bitwise those of the collective backend (docs/semantics.md).
"""
from .backend import SymmetricBackend, symmetric_supported
from .heap import heap_layout

__all__ = ["SymmetricBackend", "symmetric_supported", "heap_layout"]
