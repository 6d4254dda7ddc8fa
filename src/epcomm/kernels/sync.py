"""Device-side synchronization shared by the fused kernels: counters, a grid barrier, timeouts.

Every flag is a monotone int64 *counter* that is never reset: each of the P programs of a
kernel adds 1 to it once per call of a stage, so after call n of that stage it holds n * P and a
waiter compares with `>=`. Counters in a heap are written by peers (system scope, release) and
polled by the owner (acquire); the grid-barrier counters live in a local tensor (GPU scope).

All spins are bounded: past `timeout` (nanoseconds of %globaltimer on the GPU, spins under the
interpreter, which has no clock) they give up and return False; the caller ORs its stage's
timeout bit into the device error flag, so a missing peer never hangs a stream.

A grid barrier needs every program of the launch resident at once; the launchers keep P at or
under the SM count (GPU) and at 1 under the interpreter, which runs programs one after another.
"""
import triton
import triton.language as tl

from .. import errors
from .common import total

# `errors` bits as values kernels can read (a kernel may only use constexpr globals).
INVALID_EXPERT_ID = tl.constexpr(errors.INVALID_EXPERT_ID)
EXPAND_OVERFLOW = tl.constexpr(errors.EXPAND_OVERFLOW)
DISPATCH_TIMEOUT = tl.constexpr(errors.DISPATCH_TIMEOUT)
COMBINE_TIMEOUT = tl.constexpr(errors.COMBINE_TIMEOUT)
RECEIVE_OVERFLOW = tl.constexpr(errors.RECEIVE_OVERFLOW)


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def wait_counters(ptrs, mask, target, timeout, USE_TIMER: tl.constexpr):
    """Spin until every counter `ptrs[i]` (int64, where `mask`) is >= `target`; acquire loads
    at system scope. Returns True if all arrived before `timeout`. The caller puts a
    `tl.debug_barrier()` after it before other threads read what the counters guard."""
    value = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys")
    waiting = total(((value < target) & mask).to(tl.int32))
    if USE_TIMER:
        start = _globaltimer()
    spent = tl.full([], 0, tl.int64)
    while (waiting > 0) & (spent < timeout):
        value = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="sys")
        waiting = total(((value < target) & mask).to(tl.int32))
        if USE_TIMER:
            spent = _globaltimer() - start
        else:
            spent += 1
    return waiting == 0


@triton.jit
def await_counters(ptrs, mask, target, error_ptr, error_bit, timeout, USE_TIMER: tl.constexpr):
    """`wait_counters`, then on a timeout OR `error_bit` into the error flag (the caller goes on:
    a late counter reads as not arrived), then a barrier so that every thread of the program
    reads what the counters guard only after them."""
    if not wait_counters(ptrs, mask, target, timeout, USE_TIMER):
        tl.atomic_or(error_ptr, error_bit)
    tl.debug_barrier()


@triton.jit
def add_counters(ptrs, mask):
    """Add 1 to every counter `ptrs[i]` (where `mask`), releasing at system scope everything
    this program wrote or read before (the barrier first orders all its threads' accesses)."""
    tl.debug_barrier()
    tl.atomic_add(ptrs, 1, mask=mask, sem="release", scope="sys")


@triton.jit
def grid_barrier(counter_ptr, error_ptr, error_bit, timeout, USE_TIMER: tl.constexpr):
    """All programs of the launch meet here; returns this call's number n >= 1 (the counter
    reaches n * P when all arrived). What any program wrote before is visible after."""
    tl.debug_barrier()
    num_programs = tl.num_programs(0)
    old = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    call = old // num_programs + 1
    one = tl.arange(0, 2) < 1  # a 1-element view: wait_counters works on blocks
    await_counters(counter_ptr + tl.arange(0, 2) * 0, one, call * num_programs, error_ptr,
                   error_bit, timeout, USE_TIMER)
    return call


@triton.jit
def peer_counters(bases_ptr, offset, slot, rr, rmask):
    """Pointers to counter `slot` of the counter array at byte `offset` of each rank rr's heap."""
    base = tl.load(bases_ptr + rr, mask=rmask, other=0)
    return (base + offset + slot * 8).to(tl.pointer_type(tl.int64))


@triton.jit
def own_counters(bases_ptr, rank, offset, rr):
    """Pointers to counters rr of the counter array at byte `offset` of `rank`'s own heap."""
    return (tl.load(bases_ptr + rank) + offset + rr * 8).to(tl.pointer_type(tl.int64))


def timeout_units(timeout_s: float, interpret: bool) -> int:
    """`wait_counters`' bound: spins under the interpreter (~50 us each), else nanoseconds."""
    return int(timeout_s * 2e4) if interpret else int(timeout_s * 1e9)
