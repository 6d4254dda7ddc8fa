"""Per-token, per-128-channel FP8 (e4m3fn) casts for dispatch inputs.

Each token row is cut into blocks of 128 channels (the last block may be shorter); each block
gets one fp32 scale ``amax / 448`` (``amax`` clamped to at least ``1e-4``), so its largest
element maps to +-448, the largest finite float8_e4m3fn value.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

__all__ = ["BLOCK_SIZE", "FP8_MAX", "num_scales", "per_token_cast_to_fp8", "per_token_cast_back"]

BLOCK_SIZE = 128  # channels per scale, for every FP8 path of the library
FP8_MAX = 448.0
_AMAX_MIN = 1e-4
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def num_scales(hidden: int) -> int:
    """Scales per token row of `hidden` channels: ceil(hidden / 128)."""
    return (hidden + BLOCK_SIZE - 1) // BLOCK_SIZE


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` -> fp32 ``[T, ceil(H/128), 128]``, the last block zero-padded."""
    num_tokens, hidden = x.shape
    num_blocks = num_scales(hidden)
    padded = F.pad(x.float(), (0, num_blocks * BLOCK_SIZE - hidden))
    return padded.view(num_tokens, num_blocks, BLOCK_SIZE)


def block_scales(amax: torch.Tensor, round_scale: bool = False) -> torch.Tensor:
    """fp32 scales of blocks whose largest |x| is `amax` (fp32): `max(amax, 1e-4) / 448` as an
    IEEE fp32 division, or with `round_scale` the least power of two >= that. (The divisor is a
    tensor on `amax`'s device: CUDA turns a division by a Python number into a multiplication
    by its reciprocal, which can differ in the last bit.)"""
    amax = amax.clamp(min=_AMAX_MIN)
    scales = amax / torch.full_like(amax, FP8_MAX)
    if round_scale:
        mantissa, exponent = torch.frexp(scales)      # scales = mantissa * 2**exponent
        exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # exact powers stay
        scales = torch.ldexp(torch.ones_like(scales), exponent)
    return scales


def per_token_cast_to_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[T, H]`` (bf16, fp16 or fp32) per token and 128-channel block.

    Returns ``(x_fp8 [T, H] float8_e4m3fn, scales [T, ceil(H/128)] float32)`` with
    ``scale = max(amax(|block|), 1e-4) / 448`` and ``x_fp8 = fp8(x / scale)``, computed in fp32.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    num_tokens, hidden = x.shape
    blocks = _blocks(x)
    scales = block_scales(blocks.abs().amax(dim=2))   # [T, B]
    x_fp8 = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn)
    x_fp8 = x_fp8.reshape(num_tokens, blocks.shape[1] * BLOCK_SIZE)[:, :hidden].contiguous()
    return x_fp8, scales.contiguous()


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantize: ``x_fp8.float() * scale`` per token and 128-channel block, rounded to bf16.

    ``x_fp8``: ``[T, H]`` float8_e4m3fn; ``scales``: ``[T, ceil(H/128)]`` float32.
    Returns ``[T, H]`` bfloat16.
    """
    if not isinstance(x_fp8, torch.Tensor):
        raise TypeError(f"x_fp8 must be a torch.Tensor, got {type(x_fp8).__name__}")
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"scales must be a torch.Tensor, got {type(scales).__name__}")
    if x_fp8.dtype != torch.float8_e4m3fn:
        raise TypeError(f"x_fp8 must be float8_e4m3fn, got {x_fp8.dtype}")
    if scales.dtype != torch.float32:
        raise TypeError(f"scales must be float32, got {scales.dtype}")
    if x_fp8.dim() != 2:
        raise ValueError(f"x_fp8 must be 2-D [T, H], got shape {tuple(x_fp8.shape)}")
    num_tokens, hidden = x_fp8.shape
    expected = (num_tokens, num_scales(hidden))
    if tuple(scales.shape) != expected:
        raise ValueError(f"scales must have shape {expected} for x_fp8 {tuple(x_fp8.shape)}, "
                         f"got {tuple(scales.shape)}")
    if scales.device != x_fp8.device:
        raise ValueError(f"scales must be on x_fp8's device {x_fp8.device}, got {scales.device}")
    out = _blocks(x_fp8) * scales.unsqueeze(2)
    return out.reshape(num_tokens, scales.shape[1] * BLOCK_SIZE)[:, :hidden].to(torch.bfloat16)
