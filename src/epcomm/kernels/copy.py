"""Copies between fixed buffers and per-call tensors, listed in a table on the device (what a
replayed CUDA graph uses to take a call's inputs and give back its outputs:
`backends.graphed`)."""
import triton
import triton.language as tl

from .common import columns, total, word_ptrs


@triton.jit(do_not_specialize=["num_spans"])
def copy_spans_kernel(spans_ptr, addresses_ptr, words_ptr, num_spans, INWARD: tl.constexpr,
                      VEC: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr):
    """Copy `num_spans` spans of int32 words, each between a fixed buffer and a per-call
    address, BLOCK_W words per program.

    spans: int64 [num_spans, 2], per span the fixed buffer's address and its first program
    (span s takes the programs from its first up to the next span's first, enough for the
    fixed buffer; the grid ends with the last span's). addresses, words: int64 [num_spans], the
    per-call address of each span and the words to copy (at most its programs' BLOCK_W each, a
    multiple of VEC). INWARD copies from the per-call addresses into the fixed buffers, else
    from the fixed buffers out to them. Every address is 4 * VEC-byte aligned.

    Example: spans [[A, 0], [B, 2]] with BLOCK_W = 4 (three programs), addresses [a, b] and
    words [5, 2], INWARD: program 0 copies words 0-3 of a to A, program 1 word 4, program 2
    words 0-1 of b to B.
    """
    p = tl.program_id(0)
    nn = tl.arange(0, BLOCK_N)
    firsts = tl.load(spans_ptr + nn * 2 + 1, mask=nn < num_spans, other=1 << 62)
    s = total((firsts <= p).to(tl.int32)) - 1
    fixed = tl.load(spans_ptr + s * 2)
    offs = (p - tl.load(spans_ptr + s * 2 + 1)) * BLOCK_W + tl.arange(0, BLOCK_W)
    other = tl.load(addresses_ptr + s)
    if INWARD:
        src, dst = other, fixed
    else:
        src, dst = fixed, other
    mask = columns(offs, tl.load(words_ptr + s), VEC)
    tl.store(word_ptrs(dst, VEC) + offs, tl.load(word_ptrs(src, VEC) + offs, mask=mask),
             mask=mask)
