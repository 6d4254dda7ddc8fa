"""Triton kernels of the low-latency (decode) dispatch and combine over peer memory.

Four kernels, two per call; with a receive hook the second runs in the hook (a fifth,
`ll_dispatch_local`, is the whole dispatch of a group of one rank). Each splits a row into
parts of BLOCK_C channels, one part per program (P = ceil(H / BLOCK_C), the kernel's own: the
kernels may split rows differently):

- `ll_dispatch_send`, programs (token slot t < M, part p <= P): part p < P casts its part of
  token `t` (FP8 in registers, or bf16 as is) and writes it once into the heap of each rank one
  of the token's top-k experts lives on; part P, the token's routing program, writes a record
  of (local expert, row position) per slot to every live rank and, where the token is an
  expert's last, that expert's row count, tagged with the call's number (a count with another
  call's tag reads as 0, so experts nobody chose need no write). Then every program adds 1 to
  the destination's arrival counter.
- `ll_dispatch_recv`, programs (source rank, token slot, part): waits for every live source,
  takes the prefix of the row counts over sources, and copies its part of its token into the
  rows of its local experts (expert-major outputs, FP8 scales column-major); for this rank's
  own tokens part 0 also notes each (token, first top-k slot of the expert) output row in the
  heap's own rows. The last program to finish frees the slot at every source.
- `ll_combine_send`, programs (local expert, source rank, part): writes the expert output
  rows of that source's tokens into the source's heap at (token, top-k slot). With `direct`
  (the combine is received right away, rows in bf16) the programs of this rank's own tokens
  do nothing, and with no other peer the host does not launch it.
- `ll_combine_reduce`, programs (token slot, part): waits for every live owner (with `direct`
  not for itself), then sums the weighted rows of its token in slot order (fp32, one bf16
  rounding), one load per slot: from the heap, or with `direct` for this rank's own experts
  straight from x at the noted rows.

Heap of one rank, per slot `s` in {0, 1} (`LowLatencyLayout`): int64 counters (dispatch
arrivals and frees, combine arrivals and frees, one per rank each), the dispatch region (token
counts, tagged row counts `[R, E_l]`, records `[R, M, 2K]` int32, payloads `[R, M, payload]`
bytes), and the combine region (rows `[M, K, H]` bf16). Counters are monotone: a slot's `n`-th
dispatch waits for `M * (P + 1) * n` arrivals from each source (P of the send), its `n`-th
combine for `E_l * P * n` from each owner (P of the combine's send); a sender first waits
until the destination has freed the slot's previous use. `n` lives in a local int64 tensor
(`epochs`), advanced by the last program of the receiving kernel, so that graph replays count
on their own.

Kernels take heap base addresses (`bases`, int64 `[R]`) and local tensors; they know nothing
about process groups. What a peer wrote is read with plain loads after the wait for its
counter: the wait is an acquire at system scope and a CTA barrier follows it, so the loads are
ordered after the peer's release (volatile loads would also be kept in order among themselves,
one memory round trip after another). Waits are bounded (`sync.wait_counters`); a timeout ORs
the stage's bit into the error flag and the kernel goes on.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from . import INTERPRET
from .common import bf16_to_f32, exclusive_rows, f32_to_bf16, flag_mask, sum_along, total
from .sync import (COMBINE_TIMEOUT, DISPATCH_TIMEOUT, add_counters, clock_ns, own_counters,
                   peer_counters, wait_counters)

_REGION = 256  # bytes between heap regions


def _up(n: int, a: int = _REGION) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class LowLatencyLayout:
    """Byte offsets in one rank's heap for `R` ranks, `E_l` local experts, `M` tokens, `K`
    slots, `H` hidden, `payload` bytes per token (2H bf16, or H + 4H/128 FP8)."""
    num_ranks: int
    num_local: int
    max_tokens: int
    num_topk: int
    hidden: int
    payload: int

    @property
    def payload_stride(self) -> int:
        return _up(self.payload, 16)

    def counters(self, slot: int, kind: int) -> int:
        """Counter array `kind` (0 dispatch arrivals, 1 dispatch frees, 2 combine arrivals,
        3 combine frees) of `slot`: R int64."""
        return (slot * 4 + kind) * self.num_ranks * 8

    @property
    def _counter_bytes(self) -> int:
        return _up(8 * 4 * self.num_ranks * 2)

    @property
    def _dispatch_bytes(self) -> int:
        R, M = self.num_ranks, self.max_tokens
        return (_up(4 * R) + _up(8 * R * self.num_local) + _up(4 * R * M * 2 * self.num_topk)
                + R * M * self.payload_stride)

    def dispatch(self, slot: int) -> tuple[int, int, int, int]:
        """(token counts [R] int32, row counts [R, E_l] int64 (`call << 32 | count`), records
        [R, M, 2K] int32, payloads [R, M, stride] bytes) of `slot`."""
        R, M = self.num_ranks, self.max_tokens
        base = self._counter_bytes + slot * self._dispatch_bytes
        counts = base + _up(4 * R)
        records = counts + _up(8 * R * self.num_local)
        payloads = records + _up(4 * R * M * 2 * self.num_topk)
        return base, counts, records, payloads

    def combine(self, slot: int) -> int:
        """Rows [M, K, H] bf16 of `slot`."""
        rows = _up(2 * self.max_tokens * self.num_topk * self.hidden)
        return self._counter_bytes + 2 * self._dispatch_bytes + slot * rows

    def own_rows(self, slot: int) -> int:
        """[M, K] int32 of dispatch slot `slot`: for this rank's tokens sent to its own
        experts, the output row of each (token, first top-k slot of the expert), written by
        the receive; a combine received right away (`direct`) reads those rows from its x."""
        return self.combine(2) + slot * _up(4 * self.max_tokens * self.num_topk)

    @property
    def total(self) -> int:
        return self.own_rows(2)


# ------------------------------------------------------------------------------- helpers
# The GPU takes shortcuts to the interpreter's exact results: the FP8 conversion is one
# hardware instruction (`cvt.rn.satfinite`; the interpreter's own conversion rounds otherwise),
# and a division by a block's scale a multiply and two fmas (older interpreters round an fma
# twice). A GPU test checks both on every (value, scale) the FP8 cast can meet.
_ON_GPU = tl.constexpr(not INTERPRET)


@triton.jit
def f32_to_e4m3(v):
    """fp32 -> float8_e4m3fn bits (int32 0..255), rounding to nearest even like torch;
    magnitudes past 448 saturate to 448 (the callers' values are at most 448 plus rounding).
    Integer arithmetic, which the interpreter runs exactly as the GPU does."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(v)
    abits = a.to(tl.int32, bitcast=True)
    mantissa = abits & 0x7FFFFF
    normal = (((abits >> 23) - 120) << 3) + ((mantissa + 0x7FFFF + ((mantissa >> 20) & 1)) >> 20)
    # below 2^-6: multiples of 2^-9, rounded to nearest even by the fp32 adder
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.minimum(tl.where(a < 0.015625, subnormal, normal), 0x7E)
    return code | sign


@triton.jit
def _at(address, dtype: tl.constexpr, ALIGN: tl.constexpr):
    """A heap address (int64) as a pointer to `dtype`, hinted `ALIGN`-byte aligned so that
    Triton emits vector accesses (16 when rows are multiples of 16 bytes)."""
    return tl.multiple_of(address.to(tl.pointer_type(dtype)), ALIGN)


@triton.jit
def _live_ids(ids, num_experts, num_local, mask_ptr):
    """Top-k ids with those outside [0, E) or on a masked rank replaced by -1."""
    valid = (ids >= 0) & (ids < num_experts)
    owner = tl.where(valid, ids // num_local, 0)
    masked = tl.load(mask_ptr + owner, mask=valid, other=1) != 0
    return tl.where(valid & ~masked, ids, -1)


@triton.jit
def _first_slots(ids, kk, BLOCK_K: tl.constexpr):
    """For each slot k: the first slot j <= k with the same id (k itself for -1)."""
    same = (ids[:, None] == ids[None, :]) & (kk[None, :] <= kk[:, None])
    return tl.min(tl.where(same, kk[None, :], BLOCK_K), 1)


@triton.jit
def _program(num_inner, num_parts):
    """This program's (outer, inner, part) for a grid of outer x inner x part programs."""
    pid = tl.program_id(0)
    item = pid // num_parts
    return item // num_inner, item % num_inner, pid % num_parts


@triton.jit
def _prologue(mask_ptr, epoch_ptr, error_ptr, timeout, num_ranks, BLOCK_R: tl.constexpr):
    """(rr, rr < R, the unmasked ranks, this call's number for the slot, the wait bound: 0
    once a wait has timed out on this rank, which is out of step then, so that later waits
    give up at once instead of each waiting in full)."""
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < num_ranks
    live = rmask & (tl.load(mask_ptr + rr, mask=rmask, other=1) == 0)
    call = tl.load(epoch_ptr) + 1
    timeout = tl.where(tl.load(error_ptr, volatile=True) != 0, 0, timeout)
    return rr, rmask, live, call, timeout


@triton.jit
def _await_arrivals(counters, live, target, timeout, timed, wait_ptr, has_wait, error_ptr,
                    error_bit, rr, num_ranks, SCOPE: tl.constexpr):
    """Wait until the arrival counter (int64 array at address `counters`) of every live rank
    reaches `target`; `timed` (one program): rank by rank, adding the wait to `wait_ptr` with
    `has_wait`. Flags `error_bit` on a timeout. Returns the ranks that arrived."""
    arrived = own_counters(counters, 0, rr)
    if timed:
        ok = _wait_each(arrived, live, target, timeout, wait_ptr, has_wait, rr, num_ranks,
                        SCOPE)
    else:
        ok = flag_mask(live, wait_counters(arrived, live, target, timeout, SCOPE).to(tl.int32))
    if total((live & ~ok).to(tl.int32)) > 0:
        tl.atomic_or(error_ptr, error_bit)
    tl.debug_barrier()
    return ok


@triton.jit
def _finish(done_ptr, epoch_ptr, call, bases_ptr, rank, free_off, live, rr, rmask,
            SCOPE: tl.constexpr):
    """The receiving kernel's end: the last of its programs to get here (a local count,
    `call * P` after call `call`) frees the slot at every live peer and stores `call` as the
    slot's count. Returns whether this program was the last."""
    tl.debug_barrier()
    done = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")
    last = done == call * tl.num_programs(0) - 1
    if last:
        bases = tl.load(bases_ptr + rr, mask=rmask, other=0)
        add_counters(peer_counters(bases, free_off, rank), live, SCOPE)
        tl.store(epoch_ptr, call)
    return last


@triton.jit
def _wait_each(ptrs, mask, target, timeout, stats_ptr, has_stats, rr, num_ranks,
               SCOPE: tl.constexpr):
    """Wait for each counter in turn (where `mask`); with `has_stats`, add the nanoseconds
    from the start until counter `r` arrived to `stats_ptr[r]`. Returns the arrived mask."""
    start = clock_ns()
    arrived = mask & (rr < 0)
    for r in range(0, num_ranks):
        one = mask & (rr == r)
        ok = wait_counters(ptrs, one, target, timeout, SCOPE)
        arrived = arrived | flag_mask(one, ok.to(tl.int32))
        if has_stats != 0:
            spent = clock_ns() - start
            tl.atomic_add(stats_ptr + rr, tl.where(one, spent, 0), mask=one)
    return arrived


@triton.jit
def _positions(table, ids, tt, t, kk, BLOCK_K: tl.constexpr):
    """For token `t`'s slots (`ids` [K]): how many earlier and how many later tokens of the
    routing `table` ([T, K], token tt[i] in row i, columns kk) chose the slot's expert.
    has[i, k] (row i holds ids[k]) is built column by column, in the table's own layout: a
    [T, K, K] comparison reduced over its middle axis would cross warps (dozens of barriers)."""
    has = (table * 0) != 0
    for j in tl.static_range(BLOCK_K):
        column = tl.sum(tl.where(kk[None, :] == j, table, 0), 1)                       # [T]
        has = has | (column[:, None] == ids[None, :])
    return (tl.sum(tl.where(tt[:, None] < t, has, False).to(tl.int32), 0),
            tl.sum(tl.where(tt[:, None] > t, has, False).to(tl.int32), 0))


@triton.jit
def e4m3_codes(v):
    """fp32 -> float8_e4m3fn bits (uint8) as `f32_to_e4m3`: the hardware conversion on the
    GPU (saturating too; it also keeps NaN a NaN), the integer form in the interpreter."""
    if _ON_GPU:
        return v.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        return f32_to_e4m3(v).to(tl.uint8)


@triton.jit
def divide_rn(a, b, inverse):
    """`a / b` rounded to nearest even, given `inverse` = 1 / b rounded so (b finite and
    nonzero; the quotient and the residual below neither overflow nor leave the normal range,
    or the quotient is too small to matter: the FP8 cast's below 2^-10 become +-0 either way).
    On the GPU: q = a * inverse is within one ulp of a / b, its residual a - b q is exact in
    one fma, and one more fma rounds q + residual * inverse correctly (Markstein's theorem):
    three operations instead of an IEEE division's dozen. A zero residual keeps q, and with it
    the sign of a zero. The interpreter divides."""
    if _ON_GPU:
        q = a * inverse
        residual = tl.fma(-q, b, a)
        return tl.where(residual == 0, q, tl.fma(residual, inverse, q))
    else:
        return tl.math.div_rn(a, b)


@triton.jit
def fp8_scale(amax, ROUND_SCALE: tl.constexpr):
    """The scale of a block of 128 channels whose largest |x| is `amax` (fp32, any shape):
    `max(amax, 1e-4) / 448` (an IEEE division: `/` is approximate for fp32 on the GPU), or with
    ROUND_SCALE the least power of two at or above it."""
    scale = tl.math.div_rn(tl.maximum(amax, 1e-4), amax * 0 + 448.0)
    if ROUND_SCALE:
        sbits = scale.to(tl.int32, bitcast=True)
        exponent = (sbits >> 23) + ((sbits & 0x7FFFFF) != 0).to(tl.int32)
        scale = (exponent << 23).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def _cast_fp8(bits, ROUND_SCALE: tl.constexpr, BLOCK_C: tl.constexpr):
    """A part of a row (`bits` [BLOCK_C] bf16 bits) in FP8: (e4m3 codes [BLOCK_C] uint8, one
    float32 scale per 128 channels, `fp8_scale`); each value divided by its scale as torch
    does (`divide_rn`, with one IEEE division per scale for its reciprocal)."""
    G: tl.constexpr = BLOCK_C // 128
    values = tl.reshape(bf16_to_f32(bits), (G, 128))
    scale = fp8_scale(tl.max(tl.abs(values), 1), ROUND_SCALE)
    inverse = tl.math.div_rn(scale * 0 + 1.0, scale)
    scaled = divide_rn(values, tl.broadcast_to(scale[:, None], (G, 128)),
                       tl.broadcast_to(inverse[:, None], (G, 128)))
    return tl.reshape(e4m3_codes(scaled), (BLOCK_C,)), scale


@triton.jit
def _note_rows(src_info_ptr, slot_ptr, own_rows_addr, out_row, take, own, t, kk, num_topk):
    """Token `t`'s output rows (`out_row` [K] where `take`): its source index and top-k slot
    in src_info and slot, and where the token is this rank's own (`own`), the row of each
    slot in the own rows ([M, K] int32 at heap address `own_rows_addr`)."""
    tl.store(src_info_ptr + out_row, t, mask=take)
    tl.store(slot_ptr + out_row, kk, mask=take)
    tl.store(own_rows_addr.to(tl.pointer_type(tl.int32)) + t * num_topk + kk,
             out_row.to(tl.int32), mask=flag_mask(take, own.to(tl.int32)))


@triton.jit
def _store_rows(recv_x_ptr, scales_ptr, out_row, take, data, scale, part, hidden, rows,
                num_scale_cols, USE_FP8: tl.constexpr, USE_UE8M0: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """Store channel part `part` of a token (`data` [BLOCK_C]: e4m3 codes with their `scale`
    [BLOCK_C / 128], or bf16 bits) into its output rows `out_row` ([K] of the expert-major
    [E_l, rows, H] recv_x) where `take`: one [K, C] store (a loop over the slots would pick
    each slot's row out of the block with a block-wide reduction, a barrier each). FP8
    scales go column-major ([E_l, S', rows] float32, or UE8M0 bytes of int32 words)."""
    cc = part * BLOCK_C + tl.arange(0, BLOCK_C)
    tl.store(recv_x_ptr + out_row[:, None] * hidden + cc[None, :],
             tl.broadcast_to(data[None, :], (BLOCK_K, BLOCK_C)),
             mask=take[:, None] & (cc < hidden)[None, :])
    if USE_FP8:
        S: tl.constexpr = BLOCK_C // 128
        ss = part * S + tl.arange(0, S)
        sboth = take[:, None] & (ss * 128 < hidden)[None, :]
        expert = (out_row // rows)[:, None]
        j = (out_row % rows)[:, None]
        if USE_UE8M0:
            byte = ((expert * num_scale_cols + ss[None, :] // 4) * rows + j) * 4 \
                + ss[None, :] % 4
            exponent = ((scale.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
            tl.store(scales_ptr + byte, tl.broadcast_to(exponent[None, :], (BLOCK_K, S)),
                     mask=sboth)
        else:
            tl.store(scales_ptr + (expert * num_scale_cols + ss[None, :]) * rows + j,
                     tl.broadcast_to(scale[None, :], (BLOCK_K, S)), mask=sboth)


# ------------------------------------------------------------------------------- dispatch
@triton.jit(do_not_specialize=[
    "rank", "num_ranks", "num_tokens", "num_experts", "num_local", "max_tokens", "num_parts",
    "num_topk", "timeout", "arrive_off", "free_off", "ntok_off", "counts_off", "records_off",
    "payload_off", "payload_stride"])
def ll_dispatch_send(bases_ptr, rank, num_ranks, x_ptr, idx_ptr, num_tokens, num_experts,
                     num_local, max_tokens, num_parts, hidden, num_topk, mask_ptr, epoch_ptr,
                     error_ptr, timeout, arrive_off, free_off, ntok_off, counts_off,
                     records_off, payload_off, payload_stride, USE_FP8: tl.constexpr,
                     ROUND_SCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ALIGN: tl.constexpr,
                     SCOPE: tl.constexpr):
    """Program (token slot t, part p) of M * (P + 1), P = ceil(H / BLOCK_C): parts below P
    send a channel part of the token, part P (its routing program) its records and row counts,
    in parallel. x_ptr: [T, H] bf16 bits (int16); idx_ptr: [T, K] int32/int64; mask_ptr: [R]
    int32; epoch_ptr: this slot's dispatch count (int64, local); error_ptr: int32 flag."""
    _, t, part = _program(max_tokens, num_parts + 1)
    rr, rmask, live, call, timeout = _prologue(mask_ptr, epoch_ptr, error_ptr, timeout,
                                               num_ranks, BLOCK_R)
    own = tl.load(bases_ptr + rank)
    bases = tl.load(bases_ptr + rr, mask=rmask, other=0)
    # What the program sends comes from the caller's tensors, which no counter guards: it is
    # loaded (and masked ranks' ids dropped) first, so that these round trips overlap the
    # wait below.
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < num_topk
    mine = t < num_tokens
    routing = part == num_parts
    ids = tl.load(idx_ptr + t.to(tl.int64) * num_topk + kk,
                  mask=flag_mask(kmask, mine.to(tl.int32)), other=-1).to(tl.int32)
    tt = tl.arange(0, BLOCK_T)
    table = tl.load(idx_ptr + tt[:, None].to(tl.int64) * num_topk + kk[None, :],
                    mask=flag_mask((tt < num_tokens)[:, None] & kmask[None, :],
                                   routing.to(tl.int32)), other=-1).to(tl.int32)
    ids = _live_ids(ids, num_experts, num_local, mask_ptr)
    table = _live_ids(table, num_experts, num_local, mask_ptr)
    cc = part * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cc < hidden
    bits = tl.load(x_ptr + t.to(tl.int64) * hidden + cc,
                   mask=flag_mask(cmask, (mine & ~routing).to(tl.int32)), other=0)
    # phase-mark: ll-send-start
    # 1. Every live destination has freed this slot's previous use.
    freed = own_counters(own, free_off, rr)
    if not wait_counters(freed, live, call - 1, timeout, SCOPE):
        tl.atomic_or(error_ptr, DISPATCH_TIMEOUT)
    tl.debug_barrier()
    # phase-mark: ll-send-freed
    # 2. This token's slots: the first slot of each expert, and the ranks it goes to.
    first = (ids >= 0) & (_first_slots(ids, kk, BLOCK_K) == kk)
    local = tl.where(ids >= 0, ids % num_local, -1)
    dest = tl.where(ids >= 0, ids // num_local, -1)
    to_rank = tl.max((first[:, None] & (dest[:, None] == rr[None, :])).to(tl.int32), 0) > 0
    slot_bytes = (rank * max_tokens + t).to(tl.int64)
    # phase-mark: ll-send-slots
    if routing:
        # 3. Positions and counts need every token's slots: has[t', k] = token t' chose slot
        # k's expert. Records go to every live rank (all -1 where the token goes elsewhere),
        # one [R, K] store each.
        position, later = _positions(table, ids, tt, t, kk, BLOCK_K)
        record = (bases + records_off + slot_bytes * 8 * num_topk).to(
            tl.pointer_type(tl.int32))[:, None] + kk[None, :]
        to_live = flag_mask(live, mine.to(tl.int32))[:, None] & kmask[None, :]
        tl.store(record, tl.where(first[None, :] & (dest[None, :] == rr[:, None]),
                                  local[None, :], -1), mask=to_live)
        tl.store(record + num_topk, tl.broadcast_to(position[None, :], (BLOCK_R, BLOCK_K)),
                 mask=to_live)
        target = tl.load(bases_ptr + tl.where(dest >= 0, dest, 0))
        counts = (target + counts_off + (rank * num_local + local).to(tl.int64) * 8).to(
            tl.pointer_type(tl.int64))
        tl.store(counts, (call << 32) | (position + 1), mask=first & (later == 0))
        if t == 0:
            ntok = (bases + ntok_off + rank * 4).to(tl.pointer_type(tl.int32))
            tl.store(ntok, tl.where(live, num_tokens, 0), mask=live)
    # phase-mark: ll-send-records
    # 4. This part of the payload, cast in registers, to each destination (one [R, C] store).
    if mine & ~routing:
        rows = bases + payload_off + slot_bytes * payload_stride                  # [R]
        both = to_rank[:, None] & cmask[None, :]
        if USE_FP8:
            codes, scale = _cast_fp8(bits, ROUND_SCALE, BLOCK_C)
            tl.store(_at(rows, tl.uint8, 16)[:, None] + cc[None, :],
                     tl.broadcast_to(codes[None, :], (BLOCK_R, BLOCK_C)), mask=both)
            bb = part * (BLOCK_C // 128) + tl.arange(0, BLOCK_C // 128)
            tl.store((rows + hidden).to(tl.pointer_type(tl.float32))[:, None] + bb[None, :],
                     tl.broadcast_to(scale[None, :], (BLOCK_R, BLOCK_C // 128)),
                     mask=to_rank[:, None] & (bb * 128 < hidden)[None, :])
        else:
            tl.store(_at(rows, tl.int16, ALIGN)[:, None] + cc[None, :],
                     tl.broadcast_to(bits[None, :], (BLOCK_R, BLOCK_C)), mask=both)
    # phase-mark: ll-send-payload
    # 5. Arrived at every live destination (M * (P + 1) per call).
    arrive = peer_counters(bases, arrive_off, rank)
    add_counters(arrive, live, SCOPE)
    # phase-mark: ll-send-arrived


@triton.jit(do_not_specialize=[
    "rank", "num_ranks", "num_local", "max_tokens", "num_parts", "senders", "num_topk",
    "timeout", "arrive_off", "free_off", "ntok_off", "counts_off", "records_off",
    "payload_off", "payload_stride", "own_rows_off", "num_scale_cols", "has_stats",
    "has_wait"])
def ll_dispatch_recv(bases_ptr, rank, num_ranks, num_local, max_tokens, num_parts, senders,
                     hidden, num_topk, mask_ptr, epoch_ptr, done_ptr, error_ptr, timeout,
                     arrive_off, free_off, ntok_off, counts_off, records_off, payload_off,
                     payload_stride, own_rows_off, recv_x_ptr, scales_ptr, num_scale_cols,
                     src_info_ptr, slot_ptr, count_ptr, range_ptr, stats_ptr, has_stats,
                     wait_ptr, has_wait, USE_FP8: tl.constexpr, USE_UE8M0: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
                     BLOCK_C: tl.constexpr, ALIGN: tl.constexpr, SCOPE: tl.constexpr):
    """Program (source s, token slot t, channel part p) of R * M * P. Outputs (local): recv_x
    [E_l, R*M, H] (bf16 bits int16, or fp8 bytes uint8), scales [E_l, S', R*M] (float32, or
    the bytes (uint8) of UE8M0 int32 words), src_info and slot [E_l, R*M] int32, count [E_l]
    int32, range [E_l, R] int64, stats [E_l] int32, wait [R] int64; in the heap at
    `own_rows_off` the rows of this rank's own tokens ([M, K] int32, `LowLatencyLayout.own_rows`).
    senders: the programs of a source's `ll_dispatch_send` (M times its parts + 1), each of
    which arrives once per call."""
    src, t, part = _program(max_tokens, num_parts)
    pid = tl.program_id(0)
    rows = num_ranks * max_tokens
    rr, rmask, live, call, timeout = _prologue(mask_ptr, epoch_ptr, error_ptr, timeout,
                                               num_ranks, BLOCK_R)
    own = tl.load(bases_ptr + rank)
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < num_topk
    ee = tl.arange(0, BLOCK_E)
    emask = ee < num_local
    cc = part * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cc < hidden
    slot_bytes = (src * max_tokens + t).to(tl.int64)
    record = (own + records_off + slot_bytes * 8 * num_topk).to(tl.pointer_type(tl.int32))
    payload = own + payload_off + slot_bytes * payload_stride
    # phase-mark: ll-recv-start
    ok = _await_arrivals(own + arrive_off, live, call * senders, timeout,
                         pid == 0, wait_ptr, has_wait, error_ptr, DISPATCH_TIMEOUT, rr,
                         num_ranks, SCOPE)
    # phase-mark: ll-recv-arrived
    # Everything the program reads of the heap, in one round trip: the row counts, the
    # source's token count, the token's record and its part of the row (read whether or not
    # the slot holds a token of this call; only what does is stored).
    words = tl.load((own + counts_off).to(tl.pointer_type(tl.int64))
                    + rr[:, None] * num_local + ee[None, :],
                    mask=ok[:, None] & emask[None, :], other=0)
    ntok = tl.load((own + ntok_off + src * 4).to(tl.pointer_type(tl.int32)))
    local = tl.load(record + kk, mask=kmask, other=-1)
    position = tl.load(record + num_topk + kk, mask=kmask, other=0)
    ss = part * (BLOCK_C // 128) + tl.arange(0, BLOCK_C // 128)
    if USE_FP8:
        data = tl.load(_at(payload, tl.uint8, 16) + cc, mask=cmask)
        scale = tl.load((payload + hidden).to(tl.pointer_type(tl.float32)) + ss,
                        mask=ss * 128 < hidden, other=1.0)
    else:
        data = tl.load(_at(payload, tl.int16, ALIGN) + cc, mask=cmask)
        scale = ss * 0.0  # (no scales)
    counts = tl.where((words >> 32) == call, words & 0xFFFFFFFF, 0).to(tl.int32)
    begin = exclusive_rows(counts, BLOCK_R)  # [R, E_l]: first row of each source
    if pid == 0:
        per_expert = sum_along(counts, 0)
        tl.store(count_ptr + ee, per_expert, mask=emask)
        packed = begin.to(tl.int64) * 4294967296 + counts.to(tl.int64)
        tl.store(range_ptr + ee[None, :] * num_ranks + rr[:, None], packed,
                 mask=rmask[:, None] & emask[None, :])
        if has_stats != 0:
            old = tl.load(stats_ptr + ee, mask=emask, other=0)
            tl.store(stats_ptr + ee, old + per_expert, mask=emask)
    # phase-mark: ll-recv-counts
    src_ok = total(tl.where((rr == src) & ok, 1, 0)) > 0
    take = flag_mask(local >= 0, (src_ok & (t < ntok)).to(tl.int32))
    begin_src = sum_along(tl.where(rr[:, None] == src, begin, 0), 0)              # [E_l]
    first = sum_along(tl.where(ee[None, :] == local[:, None], begin_src[None, :], 0), 1)
    out_row = tl.where(take, local.to(tl.int64) * rows + first + position, 0)
    if part == 0:
        _note_rows(src_info_ptr, slot_ptr, own + own_rows_off, out_row, take, src == rank, t,
                   kk, num_topk)
    _store_rows(recv_x_ptr, scales_ptr, out_row, take, data, scale, part, hidden, rows,
                num_scale_cols, USE_FP8, USE_UE8M0, BLOCK_K, BLOCK_C)
    # phase-mark: ll-recv-copied
    _finish(done_ptr, epoch_ptr, call, bases_ptr, rank, free_off, live, rr, rmask, SCOPE)
    # phase-mark: ll-recv-done


@triton.jit(do_not_specialize=[
    "num_tokens", "num_experts", "num_local", "max_tokens", "num_parts", "num_topk",
    "own_rows_off", "num_scale_cols", "has_stats"])
def ll_dispatch_local(bases_ptr, x_ptr, idx_ptr, num_tokens, num_experts, num_local,
                      max_tokens, num_parts, hidden, num_topk, mask_ptr, own_rows_off,
                      recv_x_ptr, scales_ptr, num_scale_cols, src_info_ptr, slot_ptr,
                      count_ptr, range_ptr, stats_ptr, has_stats, USE_FP8: tl.constexpr,
                      ROUND_SCALE: tl.constexpr, USE_UE8M0: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    """The whole dispatch of a group of one rank (every expert local, nothing to wait for), in
    one launch of M * P + ceil(E_l / BLOCK_E) programs and the outputs of `ll_dispatch_recv`
    (R = 1). Program (t, p) < M * P casts part p of token t and stores it straight into the
    row of each of its experts: the row's position is the number of earlier tokens that chose
    the expert, read off the routing table. Each program after those counts the rows of
    BLOCK_E experts (count, range, stats). No heap traffic but the own rows.

    Example (M = 2, E_l = 2, K = 2): ids [[1, 0], [1, -1]] give token 0 the rows (expert 1,
    0) and (expert 0, 0), token 1 the row (expert 1, 1); counts [1, 2]."""
    pid = tl.program_id(0)
    # phase-mark: ll-local-start
    # Every load first, none depending on another: the row part (none for a counting program,
    # whose t is past the tokens), the heap base, the mask, the routing table.
    t = pid // num_parts
    part = pid % num_parts
    mine = t < num_tokens
    cc = part * BLOCK_C + tl.arange(0, BLOCK_C)
    bits = tl.load(x_ptr + t.to(tl.int64) * hidden + cc,
                   mask=flag_mask(cc < hidden, mine.to(tl.int32)), other=0)
    bases = tl.load(bases_ptr)
    masked = tl.load(mask_ptr)  # (one rank: it owns every expert, so one flag masks them all)
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < num_topk
    tt = tl.arange(0, BLOCK_T)
    table = tl.load(idx_ptr + tt[:, None].to(tl.int64) * num_topk + kk[None, :],
                    mask=(tt < num_tokens)[:, None] & kmask[None, :], other=-1).to(tl.int32)
    table = tl.where((table >= 0) & (table < num_experts) & (masked == 0), table, -1)
    # phase-mark: ll-local-table
    if pid < max_tokens * num_parts:
        # the token's ids: its row of the table (all -1 past the tokens)
        ids = tl.sum(tl.where((tt == t)[:, None], table, 0), 0)
        take = (ids >= 0) & (_first_slots(ids, kk, BLOCK_K) == kk)
        position, _ = _positions(table, ids, tt, t, kk, BLOCK_K)
        # (one rank: the local expert is the id)
        out_row = tl.where(take, ids.to(tl.int64) * max_tokens + position, 0)
        if part == 0:
            _note_rows(src_info_ptr, slot_ptr, bases + own_rows_off, out_row, take, mine, t,
                       kk, num_topk)
        # phase-mark: ll-local-slots
        if USE_FP8:
            data, scale = _cast_fp8(bits, ROUND_SCALE, BLOCK_C)
        else:
            data, scale = bits, bits  # (no scales)
        # phase-mark: ll-local-cast
        _store_rows(recv_x_ptr, scales_ptr, out_row, take, data, scale, part, hidden,
                    max_tokens, num_scale_cols, USE_FP8, USE_UE8M0, BLOCK_K, BLOCK_C)
        # phase-mark: ll-local-stored
    else:
        ee = (pid - max_tokens * num_parts) * BLOCK_E + tl.arange(0, BLOCK_E)
        emask = ee < num_local
        # a token's row of an expert is its expert's first slot
        earlier = (table[:, :, None] == table[:, None, :]) & (kk[None, None, :] < kk[None, :, None])
        first = (table >= 0) & (tl.max(earlier.to(tl.int32), 2) == 0)                 # [T, K]
        chose = (table[None, :, :] == ee[:, None, None]) & first[None, :, :]
        counts = tl.sum(tl.sum(chose.to(tl.int32), 2), 1)                              # [E]
        tl.store(count_ptr + ee, counts, mask=emask)
        tl.store(range_ptr + ee, counts.to(tl.int64), mask=emask)  # (first row 0, count)
        if has_stats != 0:
            old = tl.load(stats_ptr + ee, mask=emask, other=0)
            tl.store(stats_ptr + ee, old + counts, mask=emask)
    # phase-mark: ll-local-done


# ------------------------------------------------------------------------------- LogFMT-10
# The wire form of `epcomm.logfmt` (docs/semantics.md, `use_logfmt`): per group of 128
# channels at byte 164 g of a row, a header `top | step << 16`, 128 low code bytes, 32 bytes of
# (code bit 8 | sign << 1) pairs, four channels a byte.
@triton.jit
def _logfmt_store(values, row_addr, rmask, part, num_groups, ROWS: tl.constexpr,
                  BLOCK_C: tl.constexpr):
    """Encode `values` ([ROWS, BLOCK_C] bf16 bits, channel part `part` of each row) and store
    their groups into the rows at byte addresses `row_addr` ([ROWS] int64) where `rmask`."""
    GP: tl.constexpr = BLOCK_C // 128
    bits = tl.reshape(values.to(tl.int32) & 0xFFFF, [ROWS, GP, 128])
    m = bits & 0x7FFF
    finite = m < 0x7F80
    top = tl.max(tl.where(finite, m, 0), axis=2)
    low = tl.minimum(tl.min(tl.where(finite, m, 0x7F80), axis=2), top)
    step = tl.maximum((top - tl.maximum(low, top - 4096) + 507) // 508, 1)
    below = (top[:, :, None] - m + step[:, :, None] // 2) // step[:, :, None]
    code = tl.where(below <= 508, 509 - below, 0)
    code = tl.where(finite, code, tl.where(m == 0x7F80, 510, 511))
    gg = part * GP + tl.arange(0, GP)
    gmask = rmask[:, None] & (gg < num_groups)[None, :]
    group = row_addr[:, None] + gg[None, :].to(tl.int64) * 164            # [ROWS, GP]
    tl.store(group.to(tl.pointer_type(tl.int32)), top | (step << 16), mask=gmask)
    cc = tl.arange(0, 128)
    tl.store((group[:, :, None] + 4 + cc[None, None, :]).to(tl.pointer_type(tl.uint8)),
             (code & 0xFF).to(tl.uint8), mask=gmask[:, :, None])
    pairs = tl.reshape((code >> 8) | ((bits >> 15) << 1), [ROWS, GP, 32, 4])
    shifts = tl.arange(0, 4) * 2
    high = tl.sum(pairs << shifts[None, None, None, :], axis=3)
    qq = tl.arange(0, 32)
    tl.store((group[:, :, None] + 132 + qq[None, None, :]).to(tl.pointer_type(tl.uint8)),
             high.to(tl.uint8), mask=gmask[:, :, None])


@triton.jit
def _logfmt_load(row_addr, rmask, part, num_groups, BLOCK_K: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """The [BLOCK_K, BLOCK_C] bf16 bits (int32) of channel part `part` of the LogFMT-10 rows
    at byte addresses `row_addr` ([BLOCK_K] int64, read where `rmask`; 0 elsewhere)."""
    GP: tl.constexpr = BLOCK_C // 128
    gg = part * GP + tl.arange(0, GP)
    gmask = rmask[:, None] & (gg < num_groups)[None, :]
    group = row_addr[:, None] + gg[None, :].to(tl.int64) * 164            # [K, GP]
    header = tl.load(group.to(tl.pointer_type(tl.int32)), mask=gmask, other=0)
    top = (header & 0xFFFF)[:, :, None]
    step = (header >> 16)[:, :, None]
    cc = tl.arange(0, 128)
    low = tl.load((group[:, :, None] + 4 + cc[None, None, :]).to(tl.pointer_type(tl.uint8)),
                  mask=gmask[:, :, None], other=0).to(tl.int32)
    high = tl.load((group[:, :, None] + 132 + (cc // 4)[None, None, :])
                   .to(tl.pointer_type(tl.uint8)), mask=gmask[:, :, None],
                   other=0).to(tl.int32)
    pair = (high >> ((cc % 4) * 2)[None, None, :]) & 3
    code = low | ((pair & 1) << 8)
    magnitude = tl.where(code == 0, 0, tl.maximum(top - (509 - code) * step, 0))
    magnitude = tl.where(code == 510, 0x7F80, tl.where(code == 511, 0x7FC0, magnitude))
    return tl.reshape(magnitude | ((pair >> 1) << 15), [BLOCK_K, BLOCK_C])


# ------------------------------------------------------------------------------- combine
@triton.jit(do_not_specialize=[
    "rank", "num_ranks", "num_local", "max_tokens", "num_parts", "num_topk", "timeout",
    "arrive_off", "free_off", "rows_off", "direct"])
def ll_combine_send(bases_ptr, rank, num_ranks, num_local, max_tokens, num_parts, hidden,
                    num_topk, mask_ptr, epoch_ptr, error_ptr, timeout, arrive_off, free_off,
                    rows_off, direct, x_ptr, src_info_ptr, slot_ptr, range_ptr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
                    ALIGN: tl.constexpr, LOGFMT: tl.constexpr, SCOPE: tl.constexpr):
    """Program (local expert e, source s, channel part p) of E_l * R * P: x_ptr [E_l, R*M, H]
    bf16 bits (int16); src_info, slot [E_l, R*M] int32 and range [E_l, R] int64 from the
    dispatch. ROWS rows per step. LOGFMT: rows go in LogFMT-10 (BLOCK_C a multiple of 128).
    direct (0/1): rows of this rank's own tokens stay in x (the reduce reads them there):
    programs of source s = this rank do nothing, not even arrive (the reduce does not wait
    for them)."""
    e, src, part = _program(num_ranks, num_parts)
    rows = num_ranks * max_tokens
    rr, rmask, live, call, timeout = _prologue(mask_ptr, epoch_ptr, error_ptr, timeout,
                                               num_ranks, BLOCK_R)
    own = tl.load(bases_ptr + rank)
    one = live & (rr == src) & ~flag_mask(rr == rank, direct)
    # phase-mark: ll-combine-send-start
    if not wait_counters(own_counters(own, free_off, rr), one,
                         call - 1, timeout, SCOPE):
        tl.atomic_or(error_ptr, COMBINE_TIMEOUT)
    tl.debug_barrier()
    # phase-mark: ll-combine-send-freed
    base = tl.load(bases_ptr + src)
    if total(tl.where(one, 1, 0)) > 0:
        packed = tl.load(range_ptr + e * num_ranks + src)
        count = (packed & 0xFFFFFFFF).to(tl.int32)
        first = (packed >> 32).to(tl.int32)
        cc = part * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cc < hidden
        ii = tl.arange(0, ROWS)
        for i0 in range(0, count, ROWS):
            imask = i0 + ii < count
            at = e.to(tl.int64) * rows + first + i0 + ii
            t = tl.load(src_info_ptr + at, mask=imask, other=0)
            k = tl.load(slot_ptr + at, mask=imask, other=0)
            row = base + rows_off + (t * num_topk + k).to(tl.int64) * hidden * 2
            both = imask[:, None] & cmask[None, :]
            values = tl.load(x_ptr + at[:, None] * hidden + cc[None, :], mask=both, other=0)
            if LOGFMT:
                _logfmt_store(values, row, imask, part, hidden // 128, ROWS, BLOCK_C)
            else:
                tl.store(_at(row, tl.int16, ALIGN)[:, None] + cc[None, :], values, mask=both)
    # phase-mark: ll-combine-send-copied
    # Arrived at the source (E_l * P per owner and call).
    add_counters(peer_counters(base + rr * 0, arrive_off, rank), one, SCOPE)
    # phase-mark: ll-combine-send-arrived


@triton.jit
def _slot_expert(idx_ptr, row, k, num_topk, num_experts, num_local, mask_ptr):
    """The expert of top-k slot `k` (a constant) of the token whose ids start at `idx_ptr +
    row`: -1 past `num_topk`, for an id outside [0, E) or one on a masked rank."""
    ids = tl.load(idx_ptr + row + k, mask=k < num_topk, other=-1).to(tl.int32)
    return _live_ids(ids, num_experts, num_local, mask_ptr)


@triton.jit(do_not_specialize=[
    "rank", "num_ranks", "num_tokens", "num_experts", "num_local", "max_tokens", "num_parts",
    "senders", "num_topk", "timeout", "arrive_off", "free_off", "rows_off", "own_rows_off",
    "direct", "has_wait"])
def ll_combine_reduce(bases_ptr, rank, num_ranks, num_tokens, num_experts, num_local,
                      max_tokens, num_parts, senders, hidden, num_topk, mask_ptr, epoch_ptr,
                      done_ptr, error_ptr, timeout, arrive_off, free_off, rows_off, own_rows_off,
                      direct, x_ptr, idx_ptr, weights_ptr, out_ptr, wait_ptr, has_wait,
                      BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                      ALIGN: tl.constexpr, LOGFMT: tl.constexpr, SCOPE: tl.constexpr):
    """Program (token slot t, channel part p) of M * P: idx_ptr [T, K] int32/int64,
    weights_ptr [T, K] float32, out_ptr [T, H] bf16 bits (int16). The rows of the token's
    slots are loaded one slot at a time (one address each; LOGFMT: decoded from LogFMT-10)
    and added in slot order. direct (0/1, not with LOGFMT): as the combine's send was told;
    the rows of this rank's experts are then read from x_ptr (its x, [E_l, R*M, H] bf16,
    ALIGN-aligned rows) at the rows the dispatch's receive noted (`own_rows_off`). senders:
    the programs of an owner's `ll_combine_send` (E_l times its parts) that arrive here per
    call."""
    _, t, part = _program(max_tokens, num_parts)
    rr, rmask, live, call, timeout = _prologue(mask_ptr, epoch_ptr, error_ptr, timeout,
                                               num_ranks, BLOCK_R)
    own = tl.load(bases_ptr + rank)
    here_only = flag_mask(rr == rank, direct)
    # phase-mark: ll-reduce-start
    _await_arrivals(own + arrive_off, live & ~here_only, call * senders, timeout,
                    tl.program_id(0) == 0,
                    wait_ptr, has_wait, error_ptr, COMBINE_TIMEOUT, rr, num_ranks, SCOPE)
    # phase-mark: ll-reduce-arrived
    if t < num_tokens:
        cc = part * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cc < hidden
        row = t.to(tl.int64) * num_topk
        x_at = x_ptr.to(tl.int64)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        for k in tl.static_range(BLOCK_K):
            expert = _slot_expert(idx_ptr, row, k, num_topk, num_experts, num_local, mask_ptr)
            # the row travelled once per expert, at the expert's first slot
            first = expert * 0 + k
            for j in tl.static_range(k):
                same = _slot_expert(idx_ptr, row, j, num_topk, num_experts, num_local,
                                    mask_ptr) == expert
                first = tl.where(same & (first == k), j, first)
            weight = tl.load(weights_ptr + row + k, mask=k < num_topk, other=0.0)
            take = expert >= 0
            here = flag_mask(take & (expert // num_local == rank), direct)
            noted = tl.load((own + own_rows_off).to(tl.pointer_type(tl.int32)) + row + first,
                            mask=here, other=0)
            at = tl.where(here, x_at + noted.to(tl.int64) * hidden * 2,
                          own + rows_off + (row + first) * hidden * 2)
            if LOGFMT:
                one = tl.full([1], 0, tl.int64)  # the row as a block of one
                values = tl.reshape(_logfmt_load(one + at,
                                                 flag_mask(one == 0, take.to(tl.int32)),
                                                 part, hidden // 128, 1, BLOCK_C), [BLOCK_C])
            else:
                values = tl.load(_at(at, tl.int16, ALIGN) + cc,
                                 mask=flag_mask(cmask, take.to(tl.int32)), other=0)
            # each term rounded to fp32, then added in slot order; a skipped slot adds +0,
            # which leaves acc unchanged (acc is never -0)
            acc = acc + tl.where(take, weight * bf16_to_f32(values), 0.0)
        tl.store(out_ptr + t.to(tl.int64) * hidden + cc, f32_to_bf16(acc), mask=cmask)
    # phase-mark: ll-reduce-summed
    if _finish(done_ptr, epoch_ptr, call, bases_ptr, rank, free_off, live, rr, rmask, SCOPE):
        # the arrivals this rank's own send skipped with `direct`, so that the count stays
        # `call * senders` for a later call that waits for them
        skipped = total(tl.where(here_only & live, senders, 0)).to(tl.int64)
        tl.atomic_add((own + arrive_off + rank * 8).to(tl.pointer_type(tl.int64)), skipped,
                      sem="release", scope="gpu")
    # phase-mark: ll-reduce-done
