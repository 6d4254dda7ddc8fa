"""Prepared calls of the symmetric backend: the launch arguments of one call shape built once,
with `Address` stand-ins for the tensors that change per call (`kernels.launcher.ArgTemplate`).

A call of a prepared shape allocates its outputs, fills the template with the caller's and the
outputs' addresses and launches: no argument builders, no views, every pointer an int.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from functools import partial, reduce
from typing import Hashable, Optional, Sequence

import torch

from ...handle import EPHandle
from ...kernels.launcher import ArgTemplate, Launcher
from ..base import DispatchResult, OutputAllocator
from .blocks import BlockLayout, TensorBlock


@dataclass(frozen=True)
class OutputShapes:
    """(shape, dtype) of each output of a dispatch: the received payload tensors, the received
    weights (None without weights), the local ids (None in the expand layout)."""

    rows: tuple
    weights: Optional[tuple]
    idx: Optional[tuple]


class Scratch:
    """A device scratch tensor that only grows (zeroed), whose current address prepared calls
    read per call, so a replaced tensor never leaves them with a freed address."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tensor = torch.zeros(0, dtype=torch.int32, device=device)

    def at_least(self, words: int, stream: Optional["torch.cuda.Stream"]) -> torch.Tensor:
        """The tensor, replaced by a zeroed one of `words` int32 (on `stream`, where the
        kernel that uses it runs) when smaller."""
        if self.tensor.numel() < words:
            if stream is None:
                self.tensor = torch.zeros(words, dtype=torch.int32, device=self.device)
            else:
                with torch.cuda.stream(stream):
                    self.tensor = torch.zeros(words, dtype=torch.int32, device=self.device)
        return self.tensor


def _makers(shapes: Sequence[tuple], device: torch.device) -> list:
    # Each allocation as one bound call, with its size as separate ints: Python's argument
    # parsing of `torch.empty(shape_tuple, ...)` costs 0.4 us more per call.
    return [partial(torch.empty, *shape, dtype=dtype, device=device) for shape, dtype in shapes]


class DispatchPlan:
    """A sync-free dispatch of one call shape (`base.PreparedDispatch`). Template slots, in
    order: the caller's payload rows, topk_idx, weights (if any); the handle's block, the
    received rows, the received weights (if any), the local ids (compact); the receive
    scratch."""

    def __init__(self, launcher: Launcher, variant: Hashable, block_layout: BlockLayout,
                 outputs: OutputShapes, copy: bool, handle_fields: dict,
                 template: ArgTemplate, device: torch.device, hist: Scratch) -> None:
        self.launcher, self.variant, self.block_layout = launcher, variant, block_layout
        self.copy, self.handle_fields, self.template, self.hist = copy, handle_fields, \
            template, hist
        self.allocations = [((block_layout.words,), torch.int32), *outputs.rows]
        self.rows_end = len(self.allocations)
        self.weights_at = self.idx_at = None
        if outputs.weights is not None:
            self.weights_at = len(self.allocations)
            self.allocations.append(outputs.weights)
        if outputs.idx is not None:
            self.idx_at = len(self.allocations)
            self.allocations.append(outputs.idx)
        self._makers = _makers(self.allocations, device)

    def takes(self, addresses: Sequence[int]) -> bool:
        """Each address 16-byte aligned, and the kernel still kept (the compiled launcher
        never rejected a launch)."""
        return not reduce(operator.or_, addresses) % 16 and self.launcher.kept(self.variant)

    def run(self, addresses: Sequence[int], topk_idx: torch.Tensor, alloc: OutputAllocator,
            stream: Optional["torch.cuda.Stream"]) -> DispatchResult:
        outputs = alloc.empty_all(self.allocations, self._makers)
        self.launcher.launch_filled(self.variant, stream, self.template.fill(
            [*addresses, *[tensor.data_ptr() for tensor in outputs],
             self.hist.tensor.data_ptr()]))
        tensors = TensorBlock(outputs[0], self.block_layout,
                              None if self.copy else {"topk_idx": topk_idx})
        handle = EPHandle(tensors, None, **self.handle_fields, backend_state=tensors)
        return DispatchResult(outputs[1:self.rows_end],
                              None if self.idx_at is None else outputs[self.idx_at],
                              None if self.weights_at is None else outputs[self.weights_at],
                              handle)


class CombinePlan:
    """A combine of one call shape. Template slots, in order: the handle's block, its
    `recv_src_metadata`, x, the weights (if any), the biases, the combined rows, the combined
    weights (if any)."""

    def __init__(self, launcher: Launcher, variant: Hashable, outputs: Sequence[tuple],
                 template: ArgTemplate, device: torch.device) -> None:
        self.launcher, self.variant, self.template = launcher, variant, template
        self.allocations = list(outputs)
        self._makers = _makers(self.allocations, device)

    def run(self, block: TensorBlock, x: torch.Tensor, weights: Optional[torch.Tensor],
            biases: Sequence[torch.Tensor], alloc: OutputAllocator,
            stream: Optional["torch.cuda.Stream"]) -> tuple:
        """(combined rows, combined weights or None)."""
        outputs = alloc.empty_all(self.allocations, self._makers)
        addresses = [block.address, block.address_of("recv_src_metadata"), x.data_ptr()]
        if weights is not None:
            addresses.append(weights.data_ptr())
        addresses += [tensor.data_ptr() for tensor in (*biases, *outputs)]
        self.launcher.launch_filled(self.variant, stream, self.template.fill(addresses))
        return outputs[0], outputs[1] if len(outputs) > 1 else None
