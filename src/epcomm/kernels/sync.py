"""Device-side synchronization shared by the fused kernels: counters, a grid barrier, timeouts.

Every flag is a monotone int64 *counter* that is never reset: each of the P programs of a
kernel adds 1 to it once per call of a stage, so after call n of that stage it holds n * P and a
waiter compares with `>=`. Counters in a heap are written by peers (release) and polled by the
owner (acquire) at the heap's scope, a kernel's `SCOPE` constexpr: "gpu" where every rank's heap
is on this process's GPU (one rank, or processes sharing the GPU), "sys" otherwise
(`SymmetricHeap.scope`); a system-scope release waits for this program's writes to reach every
device (measured on an H100 at 128 tokens, EP=1: about 1 us per hand-off more than at GPU
scope). The grid-barrier counters live in a local tensor (GPU scope).

All spins are bounded: past `timeout` nanoseconds of wall-clock time (`clock_ns`: %globaltimer
on the GPU, the host's monotonic clock under the interpreter) they give up and return False;
the caller ORs its stage's timeout bit into the device error flag, so a missing peer never hangs
a stream.

Call numbers and stamps: a peer's ready counter is exactly `call * P` once it has signalled
call `call` (it cannot signal the next one before this rank frees the stage), so a waiter that
finds more knows that peer is out of step. With its counts a source stores a stamp (`stamp`):
what the call depends on (`call_signature`, from the host) and the low bits of its call number;
a receiver ignores the rows of a source whose stamp differs from its own and flags
`CALL_MISMATCH` or `OUT_OF_STEP`.

A grid barrier needs every program of the launch resident at once; the launchers keep P at or
under the SM count (GPU) and at 1 under the interpreter, which runs programs one after another.
"""
import time
import zlib

import triton
import triton.language as tl

from .. import errors
from . import INTERPRET
from .common import max_along, sum_along, total

# `errors` bits as values kernels can read (a kernel may only use constexpr globals).
INVALID_EXPERT_ID = tl.constexpr(errors.INVALID_EXPERT_ID)
EXPAND_OVERFLOW = tl.constexpr(errors.EXPAND_OVERFLOW)
DISPATCH_TIMEOUT = tl.constexpr(errors.DISPATCH_TIMEOUT)
COMBINE_TIMEOUT = tl.constexpr(errors.COMBINE_TIMEOUT)
RECEIVE_OVERFLOW = tl.constexpr(errors.RECEIVE_OVERFLOW)
CALL_MISMATCH = tl.constexpr(errors.CALL_MISMATCH)
OUT_OF_STEP = tl.constexpr(errors.OUT_OF_STEP)
MISMATCH_PEER_SHIFT = tl.constexpr(errors.MISMATCH_PEER_SHIFT)

# A stamp (int64): [0 | signature: 23 bits | call number: low 8 bits | 32 bits left for a count].
_SIGNATURE_MASK = (1 << 23) - 1


@triton.jit
def _globaltimer():
    """Nanoseconds of the GPU's %globaltimer."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _host_clock():
    """Nanoseconds of the host's monotonic clock: only under the interpreter, which runs
    kernels as Python (a compiled kernel cannot call the host)."""
    return tl.full([], time.monotonic_ns(), tl.int64)


# The wall clock of `wait_counters`.
clock_ns = _host_clock if INTERPRET else _globaltimer


@triton.jit
def wait_counters(ptrs, mask, target, timeout, SCOPE: tl.constexpr):
    """Spin until every counter `ptrs[i]` (int64, where `mask`) is >= `target`; acquire loads
    at `SCOPE` ("sys", or "gpu" where every writer runs on this GPU: the heap's `scope`, or
    the programs of one launch). Returns True if all arrived within `timeout` nanoseconds of
    wall-clock time. The caller puts a `tl.debug_barrier()` after it before other threads
    read what the counters guard."""
    value = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope=SCOPE)
    waiting = total(((value < target) & mask).to(tl.int32))
    start = clock_ns()
    spent = tl.full([], 0, tl.int64)
    while (waiting > 0) & (spent < timeout):
        value = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope=SCOPE)
        waiting = total(((value < target) & mask).to(tl.int32))
        spent = clock_ns() - start
    return waiting == 0


@triton.jit
def await_counters(ptrs, mask, target, error_ptr, error_bit, timeout, SCOPE: tl.constexpr):
    """`wait_counters`, then on a timeout OR `error_bit` into the error flag (the caller goes on:
    a late counter reads as not arrived), then a barrier so that every thread of the program
    reads what the counters guard only after them."""
    if not wait_counters(ptrs, mask, target, timeout, SCOPE):
        tl.atomic_or(error_ptr, error_bit)
    tl.debug_barrier()


@triton.jit
def stamp(signature, call):
    """The stamp of call number `call` whose arguments hash to `signature`
    (`call_signature`), shifted past a 32-bit count it is ORed with."""
    return ((signature.to(tl.int64) << 8) | (call.to(tl.int64) & 255)) << 32


@triton.jit
def stamped_words(ready_ptrs, stamp_ptrs, rr, mask, call, num_programs, signature, error_ptr,
                  SCOPE: tl.constexpr):
    """After waiting for call `call`: the word at `stamp_ptrs` of each peer rr (where `mask`)
    whose ready counter shows exactly this call and whose stamp in that word matches this
    rank's, 0 for the others. Flags `OUT_OF_STEP` for an arrived peer ahead of this call or
    with another call number in its stamp, `CALL_MISMATCH` for one with other arguments, and
    the first such peer (rank + 1 at bit `MISMATCH_PEER_SHIFT`) unless one is flagged."""
    ready = tl.atomic_add(ready_ptrs, 0, mask=mask, sem="acquire", scope=SCOPE)
    arrived = mask & (ready >= call * num_programs)
    words = tl.load(stamp_ptrs, mask=arrived, other=0, volatile=True)
    mine = stamp(signature, call)
    seen = words >> 32
    in_step = arrived & (ready == call * num_programs) & ((seen & 255) == ((mine >> 32) & 255))
    same = in_step & ((seen >> 8) == (mine >> 40))
    if total((arrived & ~in_step).to(tl.int32)) > 0:
        tl.atomic_or(error_ptr, OUT_OF_STEP)
    if total((in_step & ~same).to(tl.int32)) > 0:
        tl.atomic_or(error_ptr, CALL_MISMATCH)
    odd = arrived & ~same
    if total(odd.to(tl.int32)) > 0:
        peer = -max_along(tl.where(odd, -rr, -(1 << 20)), 0)  # every program finds the same
        if (tl.load(error_ptr, volatile=True) >> MISMATCH_PEER_SHIFT) == 0:
            tl.atomic_or(error_ptr, (peer + 1) << MISMATCH_PEER_SHIFT)
    return tl.where(same, words, 0)


@triton.jit
def add_counters(ptrs, mask, SCOPE: tl.constexpr):
    """Add 1 to every counter `ptrs[i]` (where `mask`), releasing at `SCOPE` (as in
    `wait_counters`) everything this program wrote or read before (the barrier first orders
    all its threads' accesses)."""
    tl.debug_barrier()
    tl.atomic_add(ptrs, 1, mask=mask, sem="release", scope=SCOPE)


@triton.jit
def grid_barrier(counter_ptr, error_ptr, error_bit, timeout):
    """All programs of the launch meet here; returns this call's number n >= 1 (the counter
    reaches n * P when all arrived). What any program wrote before is visible after."""
    tl.debug_barrier()
    num_programs = tl.num_programs(0)
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    call = old // num_programs + 1
    one = tl.arange(0, 2) < 1  # a 1-element view: the wait works on blocks
    # (gpu scope: only programs of this launch touch the counter)
    await_counters(counter_ptr + tl.arange(0, 2) * 0, one, call * num_programs, error_ptr,
                   error_bit, timeout, "gpu")
    return call


@triton.jit
def heap_bases(bases_ptr, rank, rr, rmask):
    """(every rank rr's heap base, 0 past the ranks; this rank's own), loaded at once when the
    combine starts: each later step takes them from registers, where a reload after an
    acquire wait (which invalidates the L1 cache) would put an L2 round trip in front of the
    step (the combine at 128 tokens, EP=1, H100: 9.1 -> 8.5 us compact, 11.9 -> 11.3
    expand; the dispatch measured slower with it, 14.3 -> 15.1 and 18.5 -> 19.9, and loads
    them where it uses them)."""
    bases = tl.load(bases_ptr + rr, mask=rmask, other=0)
    return bases, total(tl.where(rr == rank, bases, 0))


@triton.jit
def bases_of(bases, rr, peers):
    """The heap bases of ranks `peers` (a 1-D block) among `bases` (`heap_bases`)."""
    return sum_along(tl.where(peers[:, None] == rr[None, :], bases[None, :], 0), 1)


@triton.jit
def peer_counters(bases, offset, slot):
    """Pointers to counter `slot` of the counter array at byte `offset` of each rank's heap
    (`bases`, from `heap_bases`)."""
    return (bases + offset + slot * 8).to(tl.pointer_type(tl.int64))


@triton.jit
def own_counters(own, offset, rr):
    """Pointers to counters rr of the counter array at byte `offset` of the heap at `own`."""
    return (own + offset + rr * 8).to(tl.pointer_type(tl.int64))


def timeout_units(timeout_s: float) -> int:
    """`wait_counters`' bound: nanoseconds of wall-clock time."""
    return int(timeout_s * 1e9)


def call_signature(*values: int) -> int:
    """What a call depends on (ints the host knows: num_experts, num_max_tokens_per_rank, ...)
    as the 23-bit signature of its stamps (`stamp`): equal on ranks that pass equal values,
    different otherwise except with probability 2**-23."""
    return zlib.crc32(repr(values).encode()) & _SIGNATURE_MASK
