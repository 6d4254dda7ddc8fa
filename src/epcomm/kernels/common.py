"""Small device functions shared by the kernel families."""
import triton
import triton.language as tl


@triton.jit
def i32_ptr(addr):
    """An int64 address as a pointer to int32 words."""
    return addr.to(tl.pointer_type(tl.int32))


@triton.jit
def bf16_to_f32(bits):
    """bf16 bits (int16) to fp32, exactly."""
    return (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16(x):
    """fp32 to bf16 bits (int16), rounding to nearest even like torch (NaN -> 0x7FC0).

    Done in integer arithmetic because the interpreter's conversion truncates.
    """
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + ((u >> 16) & 1) + 0x7FFF) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.int16)


@triton.jit
def program_chunk(num_items):
    """[begin, end) of this program's contiguous share of `num_items` (P equal chunks, the
    last ones shorter or empty)."""
    num_programs = tl.num_programs(0)
    chunk = (num_items + num_programs - 1) // num_programs
    begin = tl.program_id(0) * chunk
    return begin, tl.minimum(begin + chunk, num_items)


@triton.jit
def flag_mask(mask, flag):
    """`mask` where the run-time int `flag` is non-zero, else all False (built as a block: the
    interpreter cannot mix a plain bool into a mask)."""
    return mask & ((mask.to(tl.int32) * 0 + flag) != 0)


@triton.jit
def word_ptrs(addr, VEC: tl.constexpr):
    """int64 byte addresses (a block of row starts) as int32 pointers, hinted 4*VEC-byte aligned
    so that Triton emits VEC-word vector accesses."""
    return tl.multiple_of(addr.to(tl.pointer_type(tl.int32)), 4 * VEC)


@triton.jit
def columns(offs, num, VEC: tl.constexpr):
    """offs < num, for a `num` that VEC divides, written so that Triton sees the mask constant
    over VEC neighbours and keeps vector accesses (`offs < num` alone makes them scalar when
    num is a run-time value)."""
    return (offs // VEC) < (num // VEC)


@triton.jit
def copy_rows(src, dst, rows_mask, num_words, VEC: tl.constexpr, BLOCK_W: tl.constexpr):
    """dst[i][0:num_words] = src[i][0:num_words] for every row i of the block where
    `rows_mask` (src, dst: int32 pointers to row starts; a tile of rows per step keeps many
    loads in flight per program)."""
    copy_row_span(src, dst, rows_mask, 0, num_words, num_words, VEC, BLOCK_W)


@triton.jit
def copy_row_span(src, dst, rows_mask, start, stop, num_words, VEC: tl.constexpr,
                  BLOCK_W: tl.constexpr):
    """`copy_rows` of the words [start, min(stop, num_words)) alone (start: a multiple of
    BLOCK_W; pointers of any element type)."""
    num_words = tl.multiple_of(num_words, VEC)
    for step in range(start, stop, BLOCK_W):
        offs = step + tl.arange(0, BLOCK_W)
        mask = rows_mask[:, None] & columns(offs, num_words, VEC)[None, :]
        tl.store(dst[:, None] + offs[None, :], tl.load(src[:, None] + offs[None, :], mask=mask),
                 mask=mask)


# Parts of Triton's library (tl.sum, tl.cumsum, tl.zeros, ...) are @triton.jit functions decorated when
# triton is imported; if that happened before the interpreter was chosen they cannot run under
# it. These are decorated here, after the choice, so they work either way.
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def total(x):
    """Sum along axis 0 of a block."""
    return tl.reduce(x, 0, _add)


@triton.jit
def running_total(x):
    """Inclusive prefix sum along axis 0 of a block."""
    return tl.associative_scan(x, 0, _add)


# Prefix sums over the small axes of a tile are sums over a comparison matrix, not
# `tl.associative_scan`: Triton 3.6 fails an assertion lowering some 2-D scans on the GPU
# (ScanOpToLLVM, seen with a [16, 4] tile and 16 warps).
@triton.jit
def exclusive_rows(x, ROWS: tl.constexpr):
    """Exclusive prefix sum along axis 0 of a [ROWS, C] block."""
    i = tl.arange(0, ROWS)
    before = i[None, :] < i[:, None]  # [i, j]: row j comes before row i
    return sum_along(tl.where(before[:, :, None], x[None, :, :], 0), 1)


@triton.jit
def exclusive_columns(x, COLS: tl.constexpr):
    """Exclusive prefix sum along axis 1 of an [R, COLS] block."""
    j = tl.arange(0, COLS)
    before = j[None, :] < j[:, None]  # [j, k]: column k comes before column j
    return sum_along(tl.where(before[None, :, :], x[:, None, :], 0), 2)


@triton.jit
def sum_along(x, AXIS: tl.constexpr):
    """Sum along axis AXIS of a block."""
    return tl.reduce(x, AXIS, _add)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def max_along(x, AXIS: tl.constexpr):
    """Maximum along axis AXIS of a block."""
    return tl.reduce(x, AXIS, _max)
