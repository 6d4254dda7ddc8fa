"""The FP8 arithmetic of the low-latency kernels (`epcomm.kernels.low_latency`), against torch.

On the GPU the kernels take two shortcuts to torch's exact results: the hardware e4m3
conversion and a division by a block's scale in a multiply and two fmas (`divide_rn`). Both are
checked here on every (value, scale) pair the FP8 cast can meet; without CUDA the interpreter's
exact forms run and are checked against torch on the same values.
"""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epcomm.kernels.common import bf16_to_f32  # noqa: E402
from epcomm.kernels.low_latency import (divide_rn, e4m3_codes, f32_to_e4m3,  # noqa: E402
                                        fp8_scale)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CUDA = DEV.type == "cuda"
BF16_PATTERNS = 1 << 16


@triton.jit
def _codes_kernel(values_ptr, codes_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(values_ptr + offs, mask=offs < n, other=0.0)
    tl.store(codes_ptr + offs, e4m3_codes(values), mask=offs < n)


def _codes(values: torch.Tensor) -> torch.Tensor:
    codes = torch.empty(values.shape, dtype=torch.uint8, device=DEV)
    block = 4096 if CUDA else 1 << 16
    _codes_kernel[(triton.cdiv(values.numel(), block),)](values, codes, values.numel(),
                                                         BLOCK=block)
    return codes


def test_e4m3_codes_round_like_torch():
    # every bf16 value up to 456 in magnitude (past 448 the cast's quotients never reach),
    # then fp32 values with random low mantissa bits, the subnormal steps and their midpoints
    patterns = torch.arange(BF16_PATTERNS, dtype=torch.int32).to(torch.int16)
    bf16 = patterns.view(torch.bfloat16).float()
    gen = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    wide = (torch.rand(1 << (22 if CUDA else 16), generator=gen) * 2 - 1) * 456
    steps = torch.arange(-1024, 1025, dtype=torch.float32) * 2.0 ** -10  # 2^-9 halves
    values = torch.cat([bf16[bf16.abs() <= 456], wide, steps, -steps]).to(DEV)
    want = values.to(torch.float8_e4m3fn).view(torch.uint8)
    got = _codes(values)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, (f"{bad.numel()} codes differ, first at {values[bad[0]].item()!r}: "
                              f"{got[bad[0]].item()} != {want[bad[0]].item()}")


@triton.jit
def _every_pair_kernel(mismatch_ptr, ROUND_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """Program a: amax = the a-th positive finite bf16 value; every bf16 value v with |v| <=
    the clamped amax, cast with the block's scale the kernels' way and the exact way (an IEEE
    division, the integer e4m3 form); adds the number of differing codes to `mismatch_ptr`."""
    amax = bf16_to_f32(tl.full([1], 1, tl.int32) + tl.program_id(0))
    scale = fp8_scale(amax, ROUND_SCALE)
    inverse = tl.math.div_rn(scale * 0 + 1.0, scale)
    limit = tl.maximum(amax, 1e-4)
    bad = tl.zeros([BLOCK], tl.int32)
    for start in range(0, 1 << 16, BLOCK):
        values = bf16_to_f32(start + tl.arange(0, BLOCK))
        inside = tl.abs(values) <= limit
        fast = e4m3_codes(divide_rn(values, scale + values * 0, inverse + values * 0))
        exact = f32_to_e4m3(tl.math.div_rn(values, scale + values * 0)).to(tl.uint8)
        bad += (inside & (fast != exact)).to(tl.int32)
    tl.atomic_add(mismatch_ptr, tl.sum(bad, 0))


@pytest.mark.skipif(not CUDA, reason="the GPU's shortcuts (hardware e4m3, multiply-add "
                    "division) need CUDA; the interpreter runs the exact forms")
@pytest.mark.parametrize("round_scale", [False, True])
def test_gpu_cast_exact_on_every_value_and_scale(round_scale):
    # 0x7F7F positive finite bf16 maxima x 2^16 bf16 values: every pair a block can hold
    mismatches = torch.zeros(1, dtype=torch.int32, device=DEV)
    _every_pair_kernel[(0x7F7F,)](mismatches, ROUND_SCALE=round_scale, BLOCK=4096)
    assert mismatches.item() == 0
