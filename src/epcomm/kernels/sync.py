"""Epoch-tagged flags between ranks: `signal` and `wait`.

A flag is an int64 `epoch << 32 | count` in a flag array `[R]` (one slot per writing rank) at a
fixed byte offset of every heap. Epochs only grow (one per call of a stage, counted on the
device so CUDA graphs can replay calls), so a waiter compares with `>=` and never needs a reset.
"""
import triton
import triton.language as tl

from .. import errors
from . import INTERPRET
from .common import total

@triton.jit(do_not_specialize=["flag_offset", "slot", "num_ranks"])
def signal_kernel(bases_ptr, flag_offset, slot, num_ranks, epoch_ptr, counts_ptr,
                  HAS_COUNTS: tl.constexpr, BLOCK_R: tl.constexpr):
    r = tl.arange(0, BLOCK_R)
    mask = r < num_ranks
    base = tl.load(bases_ptr + r, mask=mask, other=0)
    value = tl.load(epoch_ptr) << 32
    if HAS_COUNTS:
        value = value + tl.load(counts_ptr + r, mask=mask, other=0)
    flag = (base + flag_offset + slot * 8).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(flag, value, mask=mask, sem="release", scope="sys")


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit(do_not_specialize=["rank", "flag_offset", "num_ranks", "lag", "timeout", "error_bit"])
def wait_kernel(bases_ptr, rank, flag_offset, num_ranks, epoch_ptr, lag, counts_ptr, error_ptr,
                timeout, error_bit, BUMP: tl.constexpr, HAS_COUNTS: tl.constexpr, USE_TIMER: tl.constexpr,
                BLOCK_R: tl.constexpr):
    epoch = tl.load(epoch_ptr)
    if BUMP:
        epoch += 1
        tl.store(epoch_ptr, epoch)
    target = epoch - lag
    r = tl.arange(0, BLOCK_R)
    mask = r < num_ranks
    flag = (tl.load(bases_ptr + rank) + flag_offset + r * 8).to(tl.pointer_type(tl.int64))
    value = tl.atomic_add(flag, 0, mask=mask, sem="acquire", scope="sys")
    arrived = ((value >> 32) >= target) | ~mask
    waiting = total((~arrived).to(tl.int32))
    if USE_TIMER:
        start = _globaltimer()
    spent = tl.full([], 0, tl.int64)
    while (waiting > 0) & (spent < timeout):
        value = tl.atomic_add(flag, 0, mask=mask, sem="acquire", scope="sys")
        arrived = ((value >> 32) >= target) | ~mask
        waiting = total((~arrived).to(tl.int32))
        if USE_TIMER:
            spent = _globaltimer() - start
        else:
            spent += 1
    if waiting > 0:
        tl.atomic_or(error_ptr, error_bit)
    if HAS_COUNTS:
        count = value - ((value >> 32) << 32)
        tl.store(counts_ptr + r, tl.where(arrived, count, 0), mask=mask)


def _block(num_ranks: int) -> int:
    return triton.next_power_of_2(num_ranks)


def signal(bases, flag_offset: int, slot: int, epoch, counts=None) -> None:
    """Release-store `epoch << 32 | counts[p]` (or `epoch << 32`) into flag `slot` of the flag
    array at byte `flag_offset` of every rank p's heap (one program, all ranks at once).

    Example (one process, two "heaps" a and b, both int64 [2]):
        bases = [a.data_ptr(), b.data_ptr()], epoch = [3], counts = [5, 7], slot 1:
        signal(bases, 0, 1, epoch, counts) -> a = [0, 3 << 32 | 5], b = [0, 3 << 32 | 7].
    """
    signal_kernel[(1,)](bases, flag_offset, slot, bases.numel(), epoch,
                        bases if counts is None else counts, HAS_COUNTS=counts is not None,
                        BLOCK_R=_block(bases.numel()))


def wait(bases, rank: int, flag_offset: int, epoch, error, timeout_s: float, lag: int = 0,
         bump: bool = False, counts=None, error_bit: int = errors.DISPATCH_TIMEOUT) -> None:
    """Spin (acquire loads, system scope) until every flag of the array at byte `flag_offset`
    of `rank`'s heap carries an epoch >= `epoch[0] - lag`; with `bump`, first `epoch[0] += 1`.
    With `counts`, store each flag's count (0 for a flag that never arrived). After `timeout_s`
    it ORs `error_bit` (the stage's timeout bit of `errors`) into `error[0]` and returns.

    Example: two ranks; rank 0's heap a = int64 [0, 3 << 32 | 5, 2 << 32 | 7] (flags at byte 8),
    epoch = [2], error = [0]:
        wait([a.data_ptr(), b.data_ptr()], 0, 8, epoch, error, 0.01, bump=True, counts=c)
        -> epoch = [3]; flag 1 (epoch 2) is late: error = [DISPATCH_TIMEOUT], c = [5, 0].
    """
    # The interpreter has no clock to read inside a kernel: bound it by spins (~50 us each).
    timeout = int(timeout_s * 2e4) if INTERPRET else int(timeout_s * 1e9)
    num_ranks = bases.numel()
    wait_kernel[(1,)](bases, rank, flag_offset, num_ranks, epoch, lag,
                      bases if counts is None else counts, error, timeout, error_bit, BUMP=bump,
                      HAS_COUNTS=counts is not None, USE_TIMER=not INTERPRET,
                      BLOCK_R=_block(num_ranks))
