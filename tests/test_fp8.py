"""Tests of epcomm.fp8: per-token, per-128-channel FP8 casts."""

import pytest
import torch

from epcomm.fp8 import per_token_cast_back, per_token_cast_to_fp8
from epcomm.testing.verify import assert_equal, assert_filled

FP8 = torch.float8_e4m3fn


def _block_amax(x: torch.Tensor) -> torch.Tensor:
    """[T, H] -> [T, H]: the amax of each element's 128-channel block (clamped like the cast)."""
    out = torch.empty_like(x, dtype=torch.float32)
    for b in range(0, x.shape[1], 128):
        out[:, b:b + 128] = x[:, b:b + 128].float().abs().amax(dim=1, keepdim=True).clamp(min=1e-4)
    return out


@pytest.mark.parametrize("hidden", [1, 100, 128, 200, 256, 7168])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shapes_and_dtypes(hidden, dtype):
    x = torch.randn(5, hidden, dtype=dtype)
    q, s = per_token_cast_to_fp8(x)
    assert q.dtype == FP8 and q.shape == (5, hidden) and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (5, (hidden + 127) // 128) and s.is_contiguous()
    y = per_token_cast_back(q, s)
    assert y.dtype == torch.bfloat16 and y.shape == (5, hidden)


@pytest.mark.parametrize("hidden", [100, 128, 300, 1024])
def test_round_trip_error_bound(hidden):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(64, hidden, generator=g) * torch.logspace(-3, 3, 64)[:, None]).to(torch.bfloat16)
    q, s = per_token_cast_to_fp8(x)
    y = per_token_cast_back(q, s).float()
    xf = x.float()
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal step 2^-9 of the
    # scale (amax / 448); then one bf16 rounding (2^-9 relative).
    bound = xf.abs() * (2 ** -4 + 2 ** -8) + _block_amax(xf) / 448 * 2 ** -10 * 1.01
    assert bool(((y - xf).abs() <= bound).all())
    # scales are exactly amax / 448 per block, and each block's amax maps to +-448
    amax = torch.stack([xf[:, b:b + 128].abs().amax(dim=1) for b in range(0, hidden, 128)], 1)
    assert_equal("scales", s, amax.clamp(min=1e-4) / 448.0, check_dtype=True)
    qf = q.float().abs()
    for i, b in enumerate(range(0, hidden, 128)):
        assert_filled(f"block {i} amax", qf[:, b:b + 128].amax(dim=1), 448.0)
    assert not bool(q.float().isnan().any())


def test_cast_formula_exact():
    x = torch.randn(3, 260, dtype=torch.float32)
    q, s = per_token_cast_to_fp8(x)
    pad = torch.nn.functional.pad(x, (0, 384 - 260)).view(3, 3, 128)
    scale = pad.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    want = (pad / scale[..., None]).to(FP8).view(3, 384)[:, :260]
    assert_equal("scales", s, scale, check_dtype=True)
    assert_equal("fp8 values", q, want, check_dtype=True)
    back = (q.float().view(3, 260) * scale.repeat_interleave(128, dim=1)[:, :260]).to(torch.bfloat16)
    assert_equal("cast back", per_token_cast_back(q, s), back, check_dtype=True)


def test_zero_rows_and_zero_tokens():
    x = torch.zeros(4, 300, dtype=torch.bfloat16)
    x[1, :5] = 3.0
    q, s = per_token_cast_to_fp8(x)
    assert_filled("scales of a zero row (clamped amax)", s[0], 1e-4 / 448.0)
    assert_filled("scales of zero blocks", s[1, 1:], 1e-4 / 448.0)
    assert not bool(q.float().isnan().any())
    y = per_token_cast_back(q, s)
    assert_equal("cast back of zero rows", y, x, check_dtype=True)
    q0, s0 = per_token_cast_to_fp8(torch.zeros(0, 300, dtype=torch.bfloat16))
    assert q0.shape == (0, 300) and s0.shape == (0, 3)
    assert per_token_cast_back(q0, s0).shape == (0, 300)


def test_bad_arguments():
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    q, s = per_token_cast_to_fp8(x)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        per_token_cast_to_fp8([[1.0]])
    with pytest.raises(ValueError, match="x must be 2-D"):
        per_token_cast_to_fp8(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="x must be"):
        per_token_cast_to_fp8(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="x_fp8 must be float8_e4m3fn"):
        per_token_cast_back(x, s)
    with pytest.raises(TypeError, match="scales must be float32"):
        per_token_cast_back(q, s.double())
    with pytest.raises(ValueError, match="scales must have shape"):
        per_token_cast_back(q, s[:, :1])
    with pytest.raises(ValueError, match="x_fp8 must be 2-D"):
        per_token_cast_back(q.view(-1), s)
    with pytest.raises(TypeError, match="scales must be a torch.Tensor"):
        per_token_cast_back(q, None)
