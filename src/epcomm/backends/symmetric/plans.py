"""Prepared calls of the symmetric backend: the launch arguments of one call shape built once,
with `Address` stand-ins for the tensors that change per call (`kernels.launcher.ArgTemplate`).

A call of a prepared shape allocates its outputs, fills the template with the caller's and the
outputs' addresses and launches: no argument builders, no views, every pointer an int.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Optional, Sequence

import torch

from ...handle import EPHandle
from ...kernels.launcher import ArgTemplate, Launcher, addresses_aligned
from ..base import DispatchResult, OutputAllocator, empty_makers
from ..blocks import BlockLayout, TensorBlock


@dataclass(frozen=True)
class OutputShapes:
    """(shape, dtype) of each output of a dispatch: the received payload tensors, the received
    weights (None without weights), the local ids (None in the expand layout)."""

    rows: tuple
    weights: Optional[tuple]
    idx: Optional[tuple]


@dataclass(frozen=True)
class OutputSpec:
    """What a dispatch's output shapes depend on besides its row counts: each payload row's
    trailing shape and dtype, whether weights travel, the local ids' dtype, K and the layout."""

    rows: tuple  # ((trailing shape, dtype) of each payload tensor)
    weights: bool
    idx_dtype: torch.dtype
    num_topk: int
    expand: bool

    def shapes(self, num_rows: int, num_expanded: int) -> OutputShapes:
        """The shapes for `num_rows` compact rows and `num_expanded` expand rows."""
        K, out_rows = self.num_topk, num_expanded if self.expand else num_rows
        return OutputShapes(
            tuple(((out_rows, *trailing), dtype) for trailing, dtype in self.rows),
            ((out_rows,) if self.expand else (out_rows, K), torch.float32) if self.weights
            else None,
            None if self.expand else ((num_rows, K), self.idx_dtype))

    def allocate(self, alloc: OutputAllocator, num_rows: int, num_expanded: int) -> tuple:
        """(received payload rows, received weights or None, local ids or None (expand))."""
        shapes = self.shapes(num_rows, num_expanded)
        recv_rows = [alloc.empty(shape, dtype) for shape, dtype in shapes.rows]
        recv_weights = None if shapes.weights is None else alloc.empty(*shapes.weights)
        local_idx = None if shapes.idx is None else alloc.empty(*shapes.idx)
        return recv_rows, recv_weights, local_idx


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


class DispatchPlan:
    """A dispatch of one call shape (`base.PreparedDispatch`), made with capacity-sized outputs.
    Template slots, in order: the caller's payload rows, topk_idx, weights (if any); the
    handle's block, the received rows, the received weights (if any), the local ids (compact);
    the receive scratch. exact: for a synchronizing call, `exact(result, stream)` makes its
    exact-size results from those (one host read)."""

    def __init__(self, launcher: Launcher, variant: Hashable, block_layout: BlockLayout,
                 outputs: OutputShapes, copy: bool, handle_fields: dict,
                 template: ArgTemplate, device: torch.device, hist: Scratch,
                 exact: Optional[Callable] = None) -> None:
        self.launcher, self.variant, self.block_layout = launcher, variant, block_layout
        self.copy, self.handle_fields, self.template, self.hist = copy, handle_fields, \
            template, hist
        self.exact = exact
        self.allocations = [((block_layout.words,), torch.int32), *outputs.rows]
        self.rows_end = len(self.allocations)
        self.weights_at = self.idx_at = None
        if outputs.weights is not None:
            self.weights_at = len(self.allocations)
            self.allocations.append(outputs.weights)
        if outputs.idx is not None:
            self.idx_at = len(self.allocations)
            self.allocations.append(outputs.idx)
        self._makers = empty_makers(self.allocations, device)

    def takes(self, addresses: Sequence[int]) -> bool:
        """Each address 16-byte aligned, and the kernel still kept (the compiled launcher
        never rejected a launch)."""
        return addresses_aligned(addresses) and self.launcher.kept(self.variant)

    def run(self, addresses: Sequence[int], topk_idx: torch.Tensor, alloc: OutputAllocator,
            stream: Optional["torch.cuda.Stream"]) -> DispatchResult:
        outputs = alloc.empty_all(self.allocations, self._makers)
        self.launcher.launch_filled(self.variant, stream, self.template.fill(
            [*addresses, *[tensor.data_ptr() for tensor in outputs],
             self.hist.tensor.data_ptr()]))
        tensors = TensorBlock(outputs[0], self.block_layout,
                              None if self.copy else {"topk_idx": topk_idx})
        handle = EPHandle(tensors, None, **self.handle_fields, backend_state=tensors,
                          storage=tensors.storage())
        result = DispatchResult(outputs[1:self.rows_end],
                                None if self.idx_at is None else outputs[self.idx_at],
                                None if self.weights_at is None else outputs[self.weights_at],
                                handle)
        return result if self.exact is None else self.exact(result, stream)


class CombinePlan:
    """A combine of one call shape. Template slots, in order: the handle's block, its
    `recv_src_metadata`, x, the weights (if any), the biases, the combined rows, the combined
    weights (if any)."""

    def __init__(self, launcher: Launcher, variant: Hashable, outputs: Sequence[tuple],
                 template: ArgTemplate, device: torch.device) -> None:
        self.launcher, self.variant, self.template = launcher, variant, template
        self.allocations = list(outputs)
        self._makers = empty_makers(self.allocations, device)

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
