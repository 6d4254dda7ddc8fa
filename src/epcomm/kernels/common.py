"""Small device functions shared by the kernel families."""
import triton
import triton.language as tl


@triton.jit
def i32_ptr(addr):
    """An int64 address as a pointer to int32 words."""
    return addr.to(tl.pointer_type(tl.int32))


@triton.jit
def i16_ptr(addr):
    """An int64 address as a pointer to 16-bit values (bf16 bits)."""
    return addr.to(tl.pointer_type(tl.int16))


@triton.jit
def record_addr(bases_ptr, rank, region_offset, slot, record_words):
    """Address of record `slot` of the region at byte `region_offset` of `rank`'s heap."""
    base = tl.load(bases_ptr + rank)
    return base + region_offset + tl.cast(slot, tl.int64) * record_words * 4


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
def copy_words(src, dst, num_words, BLOCK: tl.constexpr):
    """dst[0:num_words] = src[0:num_words] (pointers of one element type)."""
    for start in range(0, num_words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < num_words
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


# Parts of Triton's library (tl.sum, tl.cumsum, tl.zeros, ...) are @triton.jit functions decorated when
# triton is imported; if that happened before the interpreter was chosen they cannot run under
# it. These are decorated here, after the choice, so they work either way.
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def total(x):
    """Sum of a 1-D block."""
    return tl.reduce(x, 0, _add)


@triton.jit
def running_total(x):
    """Inclusive prefix sum of a 1-D block."""
    return tl.associative_scan(x, 0, _add)
