"""A prepared call replayed as one CUDA graph (`GraphedCall`).

Over NCCL a decode-size call is bound by the host: a prepared dispatch is five kernel launches
of about 7 us of host time each around an `all_to_all_single` of about 30, for under 10 us of
device work at 128 tokens. A CUDA graph issues all of it in one launch. Its kernels' arguments
are fixed at capture, so the graph works on fixed buffers of its own: it copies the caller's
tensors in, runs the call's launches and its all-to-all, and copies the outputs out into the
call's fresh tensors. Per call the host writes the addresses of the caller's tensors and of the
fresh outputs into a table on the device (one copy from pageable host memory, which CUDA stages
and queues without waiting for the device) and replays the graph. The copies cost device time
(both ways, the bytes of the inputs and of the outputs), so only calls with few bytes take a
graph (`GRAPH_BYTES`).

The outputs are fresh tensors, as an eager call's (the receive-tensor lifetime contract is
unchanged); the fixed buffers are touched by this graph's replays alone, one after another: a
replay on another stream than the last one's first waits for that stream.
"""
from __future__ import annotations

import ctypes
import math
from typing import Callable, Optional, Sequence

import torch

from ..kernels.copy import copy_spans_kernel
from ..kernels.launcher import Launcher, next_power_of_2, vector_words

# Calls whose inputs and outputs together are at most this many bytes take a graph. The copies
# cost (inputs + outputs) * 2 bytes of device traffic, about 11 us per 16 MiB on an H100; a
# graph saves about 60 us of host time per prepared call over NCCL (five launches and the NCCL
# call's host time). Above this size a call's device time outweighs its host time (4096
# tokens: 117 MB in and out, and the eager call is within 2x of its floor).
GRAPH_BYTES = 32 << 20
# Bytes of fixed buffers a backend's graphs keep: each graph holds its call's inputs, outputs
# and scratch (`graph_bytes`: at hidden 7168 and 128 tokens about 8 MB for a compact
# dispatch and 35 MB for an expand one); call shapes past it launch their kernels.
GRAPH_MEMORY = 256 << 20
SPAN_WORDS = 2048  # int32 words per program of `copy_spans_kernel` (16 words per thread)
COPY_WARPS = 4


def span_table(lengths: Sequence[int], block: int) -> tuple[list[tuple[int, int]], int]:
    """For spans of `lengths` words, copied `block` words per program: each span's (words,
    first program), and the programs in all (an empty span takes none).

    Example: span_table([5, 0, 2], 4) == ([(5, 0), (0, 2), (2, 2)], 3)."""
    spans, first = [], 0
    for words in lengths:
        spans.append((words, first))
        first += -(-words // block)
    return spans, first


def graphable(nbytes: Sequence[int]) -> bool:
    """Whether a call whose inputs and outputs have `nbytes` may take a graph: few enough
    bytes (`GRAPH_BYTES`), each a whole number of int32 words."""
    return sum(nbytes) <= GRAPH_BYTES and all(n % 4 == 0 for n in nbytes)


def graph_bytes(inputs: Sequence[int], allocations: Sequence[tuple[tuple, torch.dtype, bool]],
                ) -> int:
    """The bytes of the fixed buffers a `GraphedCall` of `inputs` (their most bytes) and
    `allocations` keeps."""
    return sum(inputs) + sum(math.prod(shape) * dtype.itemsize for shape, dtype, _ in allocations)


class GraphedCall:
    """One call shape captured as a CUDA graph on `device`, replayed per call (`replay`).

    inputs: (bytes, row bytes) of each caller tensor, in the call's slot order (contiguous
        tensors, 16-byte aligned): the most it holds, and what its size per call is a multiple
        of (the bytes again for a tensor of fixed size); allocations: (shape, dtype, output) of
        each tensor the call allocates, its slots after the inputs'; issue(values, tensors):
        queues the call on the current stream, `values` the address of every slot (the
        inputs', the allocations'), `tensors` the allocations. Inputs of fewer bytes than their
        most leave the rest of their fixed buffer as the last call left it: the call must not
        read past what it is given.

    Construction queues a warm-up of the copies on the current stream and captures the graph
    (no host synchronization)."""

    def __init__(self, device: torch.device, inputs: Sequence[tuple[int, int]],
                 allocations: Sequence[tuple[tuple, torch.dtype, bool]],
                 issue: Callable[[list, list], None]) -> None:
        self.device = device
        # the fixed buffers (kept for the graph's life)
        self.inputs = [torch.empty(n, dtype=torch.uint8, device=device) for n, _ in inputs]
        self.tensors = [torch.empty(shape, dtype=dtype, device=device)
                        for shape, dtype, _ in allocations]
        fixed_outputs = [tensor for tensor, (_, _, output) in zip(self.tensors, allocations)
                         if output]
        lengths = [n // 4 for n, _ in inputs] + \
            [tensor.numel() * tensor.element_size() // 4 for tensor in fixed_outputs]
        rows = []
        self.copies = []  # (launcher, first row, rows) of the copy in, then out
        for inward, tensors, part, vec in (
                (1, self.inputs, lengths[:len(inputs)],
                 vector_words([*lengths[:len(inputs)], *[unit // 4 for _, unit in inputs]])),
                (0, fixed_outputs, lengths[len(inputs):], vector_words(lengths[len(inputs):]))):
            spans, programs = span_table(part, SPAN_WORDS)
            self.copies.append((Launcher(copy_spans_kernel, max(programs, 1), dict(
                INWARD=inward, VEC=vec, BLOCK_W=SPAN_WORDS,
                BLOCK_N=max(2, next_power_of_2(len(spans))), num_warps=COPY_WARPS)),
                len(rows), len(spans)))
            rows += [(tensor.data_ptr(), first) for tensor, (_, first) in zip(tensors, spans)]
        self.spans = _to_device(rows, device)
        # The table: per span its per-call address, then (after every span's) its words. Each
        # call writes them here, then copies them to the device: a copy from pageable memory is
        # staged before it returns, so the next call may write again (torch.tensor of the list
        # would cost 5-7 us more per call).
        self._host = torch.tensor([address for address, _ in rows] + lengths, dtype=torch.int64)
        self._host_words = (ctypes.c_int64 * (2 * len(rows))).from_address(self._host.data_ptr())
        self._words_from = len(rows)
        self.table = self._host.to(device, non_blocking=True)
        # A warm-up that copies each fixed buffer onto itself compiles the copies (nothing may
        # load a module during the capture).
        self._copy(0)
        self._copy(1)
        values = [tensor.data_ptr() for tensor in (*self.inputs, *self.tensors)]
        self.graph = torch.cuda.CUDAGraph()
        current, capture = torch.cuda.current_stream(device), torch.cuda.Stream(device)
        with torch.cuda.stream(capture):
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._copy(0)
                issue(values, self.tensors)
                self._copy(1)
            finally:
                self.graph.capture_end()
        self._last, self._last_raw = current, current.cuda_stream
        self._index = current.device_index

    def _copy(self, direction: int) -> None:
        launcher, first, count = self.copies[direction]
        if count:
            launcher((), None, dict(
                spans_ptr=self.spans[first:], num_spans=count,
                addresses_ptr=self.table[first:],
                words_ptr=self.table[self._words_from + first:]))

    def replay(self, addresses: Sequence[int], outputs: Sequence[torch.Tensor],
               input_bytes: Optional[Sequence[int]] = None) -> None:
        """The call on the current stream: the caller tensors at `addresses` (in slot order),
        the outputs into `outputs` (fresh tensors of the output allocations, in order).
        input_bytes: the bytes of the first caller tensors this call, where they may be fewer
        than their most (None: as the last call's)."""
        raw = torch._C._cuda_getCurrentRawStream(self._index)
        if raw != self._last_raw:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._last)
            self._last, self._last_raw = current, raw
        words = self._host_words
        words[:len(addresses)] = addresses
        words[len(addresses):self._words_from] = [out.data_ptr() for out in outputs]
        if input_bytes is not None:
            words[self._words_from:self._words_from + len(input_bytes)] = \
                [n // 4 for n in input_bytes]
        self.table.copy_(self._host, non_blocking=True)
        self.graph.replay()


def _to_device(values: list, device: torch.device) -> torch.Tensor:
    """`values` as an int64 tensor on `device`, copied without waiting for the device."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
