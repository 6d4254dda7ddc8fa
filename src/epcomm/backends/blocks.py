"""A dispatch's handle tensors in one allocation: `BlockLayout` (where each lies) and
`TensorBlock` (the tensors, views made on first access)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Optional, Sequence, Union

import torch

from ..kernels.launcher import Address


def _words(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """int32 words of a tensor of `shape` and 4- or 8-byte `dtype`."""
    return math.prod(shape) * dtype.itemsize // 4


class BlockLayout:
    """Where named tensors lie in one int32 allocation: each starts on a 16-byte boundary.
    parts: name -> (word offset, shape, dtype) for (name, shape, dtype) in `parts` order.

    Example: BlockLayout([("a", (3,), torch.int32), ("b", (2,), torch.int64)]) puts "a" at
    word 0 and "b" at word 4 (16 bytes), 8 words in all."""

    def __init__(self, parts: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        self.parts: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        words = 0
        for name, shape, dtype in parts:
            self.parts[name] = (words, shape, dtype)
            words += (_words(shape, dtype) + 3) // 4 * 4
        self.words = words


class TensorBlock(Mapping):
    """The tensors of a `BlockLayout` in one allocation `block` (int32), each a view made on
    first access (a view costs about a microsecond of host time per call, and most are never
    read on the host), plus `extra` tensors allocated on their own. `block` may be an
    `Address` stand-in (a prepared call's template): `arg` then gives parts as addresses."""

    def __init__(self, block: Union[torch.Tensor, Address], layout: BlockLayout,
                 extra: Optional[dict] = None) -> None:
        self.block, self.layout = block, layout
        self.address = block.data_ptr()
        self.extra = {} if extra is None else extra
        self._views: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        view = self.extra.get(name)
        if view is None:
            view = self._views.get(name)
        if view is None:
            offset, shape, dtype = self.layout.parts[name]
            view = self._views[name] = \
                self.block[offset:offset + _words(shape, dtype)].view(dtype).view(shape)
        return view

    def __iter__(self):
        return iter({**self.layout.parts, **self.extra})

    def __len__(self) -> int:
        return len({**self.layout.parts, **self.extra})

    def arg(self, name: str):
        """Part `name` as a kernel argument: its tensor, or its `Address` in a stand-in block."""
        if isinstance(self.block, Address) and name not in self.extra:
            return self.block + 4 * self.layout.parts[name][0]
        return self[name]

    def storage(self) -> tuple:
        """The allocations holding these tensors: the block, and the extra tensors but a
        caller's `topk_idx` (which a handle made without a copy keeps)."""
        return (self.block, *(t for name, t in self.extra.items() if name != "topk_idx"))

    def address_of(self, name: str) -> int:
        """The address of part `name` (no view made)."""
        if name in self.extra:
            return self.extra[name].data_ptr()
        return self.address + 4 * self.layout.parts[name][0]
