"""LogFMT-10: the low-latency combine's optional wire format (`use_logfmt=True`; the values are
defined in docs/semantics.md, "Low-latency mode").

A row of `H` bf16 channels (`H` a multiple of 128) is `G = H / 128` groups; on the wire a row is
`G * 164` bytes, group `g` at byte `164 g`: an int32 header `top | step << 16`, then 128 bytes
holding bits 0..7 of each channel's 9-bit code, then 32 bytes where byte `i` holds, for
channels `4i .. 4i + 3`, `(code >> 8 | sign << 1) << 2 * (channel % 4)`. The symmetric
transport's kernels (`epcomm.kernels.low_latency`) write and read the same bytes.

`encode_rows(x, wire)` writes the wire form of `x` ([..., H] bf16) into `wire` ([..., G * 164]
uint8); `decode_rows(wire, hidden)` returns the [N, H] bf16 rows it holds.

Example (one group; 1.0 and 0.0 are kept, -0.5 moves by 2 bf16 steps, the group spanning 32
octaves below 1.0 in steps of 9):
    >>> import torch
    >>> x = torch.zeros(1, 128, dtype=torch.bfloat16)
    >>> x[0, :2] = torch.tensor([1.0, -0.5])
    >>> wire = torch.empty(1, 164, dtype=torch.uint8)
    >>> encode_rows(x, wire)
    >>> decode_rows(wire, 128)[0, :3].tolist()
    [1.0, -0.5078125, 0.0]
"""
from __future__ import annotations

import torch

GROUP = 128                 # channels per group
GROUP_BYTES = 164           # header 4 + low code bytes 128 + high bits 32
_SPAN = 4096                # 32 octaves of bf16 magnitude bits (128 steps per octave)
_LEVELS = 508               # steps between the lowest and the highest finite code
_INF, _NAN = 0x7F80, 0x7FC0
_CODE_INF, _CODE_NAN = 510, 511


def wire_bytes(hidden: int) -> int:
    """Bytes of one row of `hidden` channels on the wire."""
    return hidden // GROUP * GROUP_BYTES


def _fields(wire: torch.Tensor, num_groups: int):
    """(header [..., G] int32, low [..., G, 128] uint8, high [..., G, 32] uint8) views of
    `wire` ([..., G * 164] uint8, unit stride in its last dimension)."""
    groups = wire.unflatten(-1, (num_groups, GROUP_BYTES))
    return (groups[..., :4].view(torch.int32).squeeze(-1), groups[..., 4:4 + GROUP],
            groups[..., 4 + GROUP:])


def encode_rows(x: torch.Tensor, wire: torch.Tensor) -> None:
    """Write the LogFMT-10 form of `x` ([..., H] bf16) into `wire` ([..., H / 128 * 164]
    uint8, the same leading shape, any strides but a unit last one)."""
    num_groups = x.shape[-1] // GROUP
    bits = x.contiguous().view(torch.int16).unflatten(-1, (num_groups, GROUP)).int() & 0xFFFF
    sign, m = bits >> 15, bits & 0x7FFF
    finite = m < _INF
    top = torch.where(finite, m, 0).amax(-1, keepdim=True)
    low = torch.minimum(torch.where(finite, m, _INF).amin(-1, keepdim=True), top)
    lo = torch.maximum(low, top - _SPAN)
    step = ((top - lo + _LEVELS - 1) // _LEVELS).clamp(min=1)
    j = (top - m + step // 2) // step
    code = torch.where(j <= _LEVELS, _LEVELS + 1 - j, 0)
    code = torch.where(finite, code, torch.where(m == _INF, _CODE_INF, _CODE_NAN))
    header, low_bytes, high_bytes = _fields(wire, num_groups)
    header.copy_((top | step << 16).squeeze(-1))
    low_bytes.copy_(code & 0xFF)
    pairs = ((code >> 8) | sign << 1).unflatten(-1, (GROUP // 4, 4))
    shifts = torch.arange(0, 8, 2, device=x.device, dtype=torch.int32)
    high_bytes.copy_((pairs << shifts).sum(-1))


def decode_rows(wire: torch.Tensor, hidden: int) -> torch.Tensor:
    """The [..., hidden] bf16 rows that `wire` ([..., hidden / 128 * 164] uint8) holds."""
    header, low_bytes, high_bytes = _fields(wire, hidden // GROUP)
    header = header.unsqueeze(-1)
    top, step = header & 0xFFFF, header >> 16
    shifts = torch.arange(0, 8, 2, device=wire.device, dtype=torch.int32)
    pairs = ((high_bytes.int().unsqueeze(-1) >> shifts) & 3).flatten(-2)   # [..., G, 128]
    code = low_bytes.int() | (pairs & 1) << 8
    magnitude = torch.where(code == 0, 0, (top - (_LEVELS + 1 - code) * step).clamp(min=0))
    magnitude = torch.where(code == _CODE_INF, _INF,
                            torch.where(code == _CODE_NAN, _NAN, magnitude))
    signed = magnitude - (pairs >> 1 << 15)      # the int16 of `magnitude | sign << 15`
    return signed.to(torch.int16).view(torch.bfloat16).flatten(-2)
