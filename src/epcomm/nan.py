"""The NaN rule of combine outputs (docs/semantics.md, NaN): every NaN element is the canonical
quiet NaN of its dtype, whatever NaN the arithmetic or a conversion produced."""
from __future__ import annotations

import torch

# dtype -> (the integer dtype of its width, the canonical quiet NaN's bits)
_CANONICAL_NAN = {torch.bfloat16: (torch.int16, 0x7FC0), torch.float16: (torch.int16, 0x7E00),
                  torch.float32: (torch.int32, 0x7FC00000)}


def canonical_nan_(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (bf16, fp16 or fp32) with every NaN element replaced in place by its dtype's
    canonical quiet NaN (bf16 0x7FC0, fp16 0x7E00, fp32 0x7FC00000), written through an
    integer view; returns `tensor`."""
    int_dtype, bits = _CANONICAL_NAN[tensor.dtype]
    tensor.view(int_dtype).masked_fill_(torch.isnan(tensor), bits)
    return tensor
