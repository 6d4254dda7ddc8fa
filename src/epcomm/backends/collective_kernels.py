"""The collective backend's device path: dispatch and combine through the kernels of
`epcomm.kernels.collective`, around the same all-to-all and wire format as its torch path,
except that a rank's own block does not travel: the pack kernels write it straight into the
receive buffer (first there), and where the caller's rows can be read instead its payload is
not copied at all (`kernels.collective`'s docstring). At one rank no all-to-all is left.

A dispatch is five launches and the all-to-all (count, pack, all-to-all, unpack, expert
prefix, expand), a combine two and the all-to-all (pack, all-to-all, reduce); the torch path
issues 70-190 operations per call. Sync-free calls read nothing back (capturable in a CUDA
graph over NCCL); a synchronizing first call reads one thing back, its count exchange, which
carries every size of the call (records per rank, slots per local expert) and the error flag.

Over NCCL a call of a shape seen before is a prepared call (`DispatchPlan`, `SyncDispatchPlan`,
`CombinePlan`; the dispatches are `base.PreparedDispatch`es): its launches' arguments are built
once, with `Address` stand-ins for the tensors (and, after a count exchange, for the sizes it
read), by the same code as every other call's; per call it allocates, fills the templates and
launches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Hashable, Optional, Sequence, Union

import torch

from .. import errors
from ..handle import EPHandle
from ..kernels import INTERPRET
from ..kernels import collective as kernels
from ..kernels.launcher import (Address, Launcher, address, addresses_aligned,
                                next_power_of_2, vector_words)
from ..layout import expand_capacity
from .blocks import BlockLayout, TensorBlock
from .base import (CombineRequest, DispatchRequest, DispatchResult, HostCounts,
                   caller_tensors, empty_makers, exact_result, remember)
from .collective import _HEADER_WORDS
from .graphed import GRAPH_MEMORY, GraphedCall, graph_bytes, graphable

if TYPE_CHECKING:
    from .collective import CollectiveBackend, _Record

# Tiles (registers from `ptxas -v` for sm_90a, Triton 3.9, K = 8, R = 8, no spills): dispatch
# kernels 16 rows x 512 words at 8 warps (pack 198, unpack 176, expand 80 registers); combine
# kernels 8 rows x 1024 bf16 at 16 warps (88 and 78; 16 rows spill at 8 or 16 warps). At 4096
# tokens, EP=1 (H100, kernel us): unpack 43.8 at 16 x 512, 44.8 at 16 x 256, 45.9 at 8 x 512.
ROWS = 16
GROUP = 4          # rows per step of the expand ranking ([4, 8, 4, 8] pair comparisons)
BLOCK_W = 512
NUM_WARPS = 8
COMBINE_ROWS = 8
BLOCK_H = 1024
COMBINE_WARPS = 16
_ROWS_PER_PROGRAM = 4  # programs: one per 4 rows of the largest side, up to 2 per SM
# A synchronizing dispatch over NCCL moves padded blocks (the sync-free call, then one read of
# its counts) where the padding it is expected to add is at most this many bytes per rank
# (`padded_sync`), else exact blocks (a count exchange and its host read, then the payload).
# The exact call costs 300-450 us more than the sync-free one on the GPU machine's host (a
# second NCCL call, the read in series with the device, six launches): about the time of
# 16 MiB at 50 GB/s.
PADDED_SYNC_BYTES = 16 << 20


def padded_sync(num_ranks: int, max_tokens: int, num_topk: int, record_bytes: int) -> bool:
    """Whether a synchronizing dispatch moves padded blocks (`PADDED_SYNC_BYTES`): the rows
    that padding adds to the blocks it receives, expected under uniform routing of full blocks
    (a source's M tokens each come with probability 1 - (1 - 1/R)^K), times the record bytes.
    The call's shape alone decides, so every rank decides alike.

    Example: padded_sync(1, 4096, 8, 14_400) (one rank: nothing added) and
    padded_sync(8, 128, 8, 14_400) (about 5 MB added) are True, padded_sync(8, 4096, 8, 14_400)
    (about 160 MB) is False."""
    absent = (1 - 1 / num_ranks) ** num_topk
    return num_ranks * max_tokens * absent * record_bytes <= PADDED_SYNC_BYTES


@dataclass
class KernelState:
    """What combine and a cached dispatch reuse besides the handle's tensors (its block also
    holds `pos`, [T, R] int32, each token's row among those sent to each rank, -1 where not
    sent, and `send_counts`, [R] int32): splits (exact blocks, synchronizing calls that
    exchanged counts; None for padded blocks): records sent to / received from each rank,
    host lists, and recv_counts the rows of the count exchange that hold the latter ([R, n]
    int64 on the device, row r's record count at word _HEADER_WORDS - 1)."""

    send_splits: Optional[list[int]]
    recv_splits: Optional[list[int]]
    recv_counts: Optional[torch.Tensor]


@dataclass(frozen=True)
class _Call:
    """What a dispatch's launches depend on besides its tensors and sizes: its call shape.
    Payload rows as int32 words: w0 (and w1) words per row, the second row's field at word
    off1 of a record, the metadata at meta_off."""

    num_tokens: int
    num_topk: int
    num_experts: int
    max_tokens: int
    rows: tuple[tuple[tuple, torch.dtype], ...]  # (shape past the first dim, dtype) per row
    idx_dtype: torch.dtype
    has_w: bool
    w0: int
    w1: int
    off1: int
    meta_off: int
    record_words: int
    expand: bool
    zero_padding: bool
    alignment: int
    copy_idx: bool
    sync: bool

    @staticmethod
    def of(request: DispatchRequest, record: "_Record") -> "_Call":
        payload = [row.shape[1] * row.element_size() // 4 if row.dim() > 1 else 1
                   for row in request.rows]
        num_tokens, num_topk = request.topk_idx.shape
        return _Call(num_tokens, num_topk, request.num_experts,
                     request.num_max_tokens_per_rank,
                     tuple((tuple(row.shape[1:]), row.dtype) for row in request.rows),
                     request.topk_idx.dtype, request.topk_weights is not None, payload[0],
                     payload[1] if len(payload) > 1 else 0,
                     record.payload[1][0] // 4 if len(payload) > 1 else 0, record.meta // 4,
                     record.nbytes // 4, request.do_expand, request.do_zero_padding,
                     request.expert_alignment, request.copy_topk_idx, request.do_cpu_sync)

    @property
    def vec(self) -> int:
        return vector_words((self.w0, self.w1, self.off1))

    @property
    def idx_variant(self) -> tuple:
        return self.idx_dtype, self.vec


@dataclass(frozen=True)
class _Sizes:
    """A dispatch's sizes on the host: exact ones after a synchronizing call's count exchange
    (splits: records sent to / received from each rank), else the capacity (splits None)."""

    send_splits: Optional[list[int]]
    recv_splits: Optional[list[int]]
    num_rows: int                      # compact output rows
    counts_list: Optional[list[int]]   # each local expert's rows aligned (exact calls)
    num_expanded: int                  # expand output rows (0 in the compact layout)


def _blocks(splits: Optional[list[int]], num_ranks: int, max_tokens: int) -> list[int]:
    """Rows of each rank's block: a header row, then its records (`splits`, or `max_tokens`
    each for padded blocks when None)."""
    return [max_tokens + 1] * num_ranks if splits is None else [n + 1 for n in splits]


def _block_rows(splits: Optional[list[int]], num_ranks: int, max_tokens: int,
                rank: Optional[int] = None) -> int:
    """Rows of one side's buffer (`_blocks`): every block (a receiving buffer, its own block
    first), or given this `rank` every block but its own (a sending buffer: the own block
    never travels)."""
    blocks = _blocks(splits, num_ranks, max_tokens)
    return sum(blocks) - (blocks[rank] if rank is not None else 0)


def _handle_block(call: _Call, layout: BlockLayout, block: torch.Tensor,
                  topk_idx: torch.Tensor) -> TensorBlock:
    """A dispatch's handle tensors: the parts of `layout` in its `block` allocation, and the
    caller's `topk_idx` when the call keeps no copy of it."""
    return TensorBlock(block, layout, None if call.copy_idx else {"topk_idx": topk_idx})


class _Plan:
    """What every prepared call of the kernel path has: the (shape, dtype) of the tensors it
    allocates first (with bound makers), and `launches`, (launcher, variant, ArgTemplate) each,
    filled per call."""

    def __init__(self, path: "KernelPath", shapes: Sequence[tuple], launches: list) -> None:
        self.path, self.shapes, self.launches = path, shapes, launches
        self._makers = empty_makers(shapes, path.backend.device)

    def takes(self, addresses: Sequence[int]) -> bool:
        """Each address 16-byte aligned, and every kernel still kept."""
        return addresses_aligned(addresses) and all(
            launcher.kept(variant) for launcher, variant, _ in self.launches)


class _GraphedPlan(_Plan):
    """A prepared call over padded blocks (its sizes fixed by its shape), replayed as a CUDA
    graph (`graphed.GraphedCall`, made on the first call that may take one) when its tensors
    are CUDA tensors, its inputs and outputs few bytes (`graphed.graphable`), its graph's
    buffers fit in what the path's graphs may keep (`GRAPH_MEMORY`) and the stream is not being
    captured; else issued launch by launch (`issue`).
    allocations: (name, shape, dtype, output) of each tensor it allocates; inputs: (bytes, row
    bytes) of each caller tensor, in slot order (`graphed.GraphedCall`)."""

    def __init__(self, path: "KernelPath", allocations: Sequence[tuple[str, tuple, torch.dtype,
                                                                       bool]],
                 launches: list, inputs: Sequence[tuple[int, int]]) -> None:
        super().__init__(path, [(shape, dtype) for _, shape, dtype, _ in allocations], launches)
        self.names = [name for name, *_ in allocations]
        self.allocations = [(shape, dtype, output) for _, shape, dtype, output in allocations]
        self.input_bytes = inputs
        outputs = [(name, shape, dtype) for name, shape, dtype, output in allocations if output]
        self.output_names = [name for name, _, _ in outputs]
        self.output_shapes = [(shape, dtype) for _, shape, dtype in outputs]
        self._output_makers = empty_makers(self.output_shapes, path.backend.device)
        self.graph: Optional[GraphedCall] = None
        self.graphable = path.backend.device.type == "cuda" and graphable(
            [*[n for n, _ in inputs],
             *[math.prod(shape) * dtype.itemsize for shape, dtype in self.output_shapes]])

    def issue(self, values: Sequence[int], tensors: Sequence[torch.Tensor],
              stream: Optional["torch.cuda.Stream"]) -> None:
        """Queue the call's launches and all-to-all on `stream` (None: the current one):
        `values` the address of every slot, `tensors` the allocations."""
        raise NotImplementedError

    def tensors(self, addresses: Sequence[int], alloc, stream: Optional["torch.cuda.Stream"],
                input_bytes: Optional[Sequence[int]] = None) -> dict[str, torch.Tensor]:
        """Run the call on the caller tensors at `addresses` (`input_bytes`: the bytes of the
        first ones, where they change per call): its allocations by name (the outputs alone
        after a graph's replay)."""
        self.path.backend._check_usable()
        graph = self._graph(stream)
        if graph is not None:
            outputs = alloc.empty_all(self.output_shapes, self._output_makers)
            self.path.issue_on(stream, graph.replay, addresses, outputs, input_bytes)
            return dict(zip(self.output_names, outputs))
        tensors = alloc.empty_all(self.shapes, self._makers)
        # (each template takes the slots up to its last one)
        self.issue([*addresses, *[tensor.data_ptr() for tensor in tensors]], tensors, stream)
        return dict(zip(self.names, tensors))

    def _graph(self, stream: Optional["torch.cuda.Stream"]) -> Optional[GraphedCall]:
        """The graph this call replays, None when it takes none."""
        if not self.graphable or torch._C._cuda_isCurrentStreamCapturing():  # (the wrapper: 1 us)
            return None
        if self.graph is None:
            path = self.path
            nbytes = graph_bytes([n for n, _ in self.input_bytes], self.allocations)
            if path.graph_bytes + nbytes > GRAPH_MEMORY:
                self.graphable = False
                return None
            self.graph = path.issue_on(stream, GraphedCall, path.backend.device, self.input_bytes,
                                       self.allocations,
                                       lambda values, tensors: self.issue(values, tensors, None))
            path.graph_bytes += nbytes
        return self.graph


class DispatchPlan(_GraphedPlan):
    """A dispatch over NCCL of one call shape over padded blocks (`base.PreparedDispatch`):
    a sync-free one, or with `host` a synchronizing one (`padded_sync`), whose results are
    made exact from the counts its last launch leaves in `host`. Template slots: the caller's
    tensors (`base.caller_tensors`), then the allocations in order."""

    def __init__(self, path: "KernelPath", call: _Call, sizes: _Sizes,
                 allocations: Sequence[tuple[str, tuple, torch.dtype, bool]], launches: list,
                 inputs: Sequence[tuple[int, int]], host: Optional[HostCounts]) -> None:
        super().__init__(path, allocations, launches, inputs)  # count, pack, the rest
        self.call, self.sizes, self.host = call, sizes, host
        self.layout = path.handle_layout(call, sizes.num_rows)
        self._recv, self._send = self.names.index("recv"), self.names.index("send")

    def issue(self, values: Sequence[int], tensors: Sequence[torch.Tensor],
              stream: Optional["torch.cuda.Stream"]) -> None:
        for at, (launcher, variant, template) in enumerate(self.launches):
            if at == 2:  # after count and pack
                self.path.issue_on(stream, self.path.all_to_all, "dispatch",
                                   tensors[self._recv], tensors[self._send], None, None,
                                   self.call.max_tokens)
            launcher.launch_filled(variant, stream, template.fill(values[:template.slots]))

    def run(self, addresses: Sequence[int], topk_idx: torch.Tensor, alloc,
            stream: Optional["torch.cuda.Stream"]) -> DispatchResult:
        t = self.tensors(addresses, alloc, stream)
        block = _handle_block(self.call, self.layout, t["block"], topk_idx)
        result = self.path.result(self.call, self.sizes, t, block, None, False)
        return result if self.host is None else self.path.exact(result, stream, self.host)


class SyncDispatchPlan(_Plan):
    """A synchronizing dispatch over NCCL of one call shape (`base.PreparedDispatch`): the
    count and header launches, the count exchange and its one host read, then the allocations
    of the sizes read and the other four launches, each filled from a template. Slots: the
    caller's tensors (`base.caller_tensors`), the counts, the slots-per-expert accumulator, the
    count rows, the exchanged rows, the allocations of `KernelPath._allocations` in order, then
    two ints: the compact output rows and the expand bound (`KernelPath._bound`)."""

    def __init__(self, path: "KernelPath", call: _Call,
                 first: Sequence[tuple[str, tuple, torch.dtype, bool]], names: Sequence[str],
                 launches: list) -> None:
        super().__init__(path, [(shape, dtype) for _, shape, dtype, _ in first],
                         launches)  # count, header, pack, the rest
        self.call, self.names = call, names

    def run(self, addresses: Sequence[int], topk_idx: torch.Tensor, alloc,
            stream: Optional["torch.cuda.Stream"]) -> DispatchResult:
        path, call = self.path, self.call
        b = path.backend
        b._check_usable()
        counts, rows = alloc.empty_all(self.shapes, self._makers)
        values = [*addresses, counts.data_ptr(), path._experts(call.num_experts).data_ptr(),
                  rows.data_ptr()]
        count, header, pack, *rest = self.launches
        for launcher, variant, template in (count, header):
            launcher.launch_filled(variant, stream, template.fill(values[:template.slots]))
        received, table = path.issue_on(stream, b._exchange_headers,
                                        "dispatch (count exchange)", rows)
        sizes, flags = path._sizes(call, None, table)
        tensors = [alloc.empty(shape, dtype) for _, shape, dtype, _ in
                   path._allocations(call, sizes)]
        values += [received.data_ptr(), *[tensor.data_ptr() for tensor in tensors],
                   sizes.num_rows, path._bound(call, sizes)]
        t = dict(zip(self.names, tensors), exact_counts=received)
        block = _handle_block(call, path.handle_layout(call, sizes.num_rows), t["block"],
                              topk_idx)
        launcher, variant, template = pack
        launcher.launch_filled(variant, stream, template.fill(values[:template.slots]))
        path.issue_on(stream, path.all_to_all, "dispatch", t["recv"], t["send"],
                      sizes.recv_splits, sizes.send_splits, call.max_tokens)
        for launcher, variant, template in rest:
            launcher.launch_filled(variant, stream, template.fill(values[:template.slots]))
        if flags:  # (only then: `issue_on` costs host time)
            path.issue_on(stream, path.raise_flags, flags)
        return path.result(call, sizes, t, block, None, True)


class KernelPath:
    """Launches the collective kernels for `backend` (its transport, header and flags)."""

    def __init__(self, backend: "CollectiveBackend") -> None:
        self.backend = backend
        config = backend.config
        if INTERPRET or config.device.type != "cuda":
            self.programs = 2  # the interpreter runs programs one by one
        else:
            sms = torch.cuda.get_device_properties(config.device).multi_processor_count
            rows = config.num_ranks * config.num_max_tokens_per_rank
            self.programs = max(1, min(-(-rows // _ROWS_PER_PROGRAM), 2 * sms))
        self.launchers: dict = {}
        self.plans: dict = {}
        self.combine_plans: dict = {}
        self.handle_layouts: dict = {}
        self.graph_bytes = 0  # the fixed buffers of the plans' graphs (`GRAPH_MEMORY`)
        # slots per expert of a synchronizing call ([E] int64), zeroed again by header_kernel
        self.experts = torch.zeros(0, dtype=torch.int64, device=config.device)
        # stands in for the weights of a call without them (the kernels do not read it)
        self.no_weights = torch.empty(1, dtype=torch.float32, device=config.device)

    def _launcher(self, fn, programs: Optional[int] = None, **constants) -> Launcher:
        """The cached `Launcher` of `fn` on `programs` (None: the path's P) with `constants`."""
        constants.setdefault("num_warps", NUM_WARPS)
        programs = self.programs if programs is None else programs
        key = (fn.__name__, programs, *constants.values())
        launcher = self.launchers.get(key)
        if launcher is None:
            launcher = self.launchers[key] = Launcher(fn, programs, constants)
        return launcher

    def issue_on(self, stream: Optional["torch.cuda.Stream"], fn, *args):
        """`fn(*args)` (a transport call of the backend, which issues on the current stream)
        with `stream` current (None: the current stream)."""
        if stream is None or \
                stream.cuda_stream == torch._C._cuda_getCurrentRawStream(stream.device_index):
            return fn(*args)
        with torch.cuda.stream(stream):
            return fn(*args)

    def exact(self, result: DispatchResult, stream: Optional["torch.cuda.Stream"],
              host: HostCounts) -> DispatchResult:
        """A synchronizing dispatch over padded blocks: the results of its sync-free call cut
        to the counts its last launch left in `host` (one wait for `stream`), after raising
        the error flag read with them."""
        num_rows, per_expert, flags = host.read(stream)
        self.raise_flags(flags)
        return exact_result(result, num_rows, per_expert)

    def all_to_all(self, stage: str, recv: torch.Tensor, send: torch.Tensor,
                   recv_splits: Optional[list[int]], send_splits: Optional[list[int]],
                   max_tokens: int) -> None:
        """The backend's all-to-all of a call's blocks between the ranks (`_blocks` of the
        splits; none at one rank): this rank's own block, first in `recv`, was written there
        by the pack kernel and does not travel."""
        b = self.backend
        if b.num_ranks == 1:
            return
        out, inp = (_blocks(splits, b.num_ranks, max_tokens)
                    for splits in (recv_splits, send_splits))
        own = out[b.rank]
        out[b.rank] = inp[b.rank] = 0
        b._all_to_all(stage, recv[own:], send, out, inp)

    def raise_flags(self, flags: int) -> None:
        """Raise (and clear) what a synchronizing dispatch read of this rank's error flag
        (`flags`, 0 for none; carried by its count exchange, or left with its counts), once the
        call has completed, as every peer's does."""
        if flags:
            b = self.backend
            b._flags.bitwise_and_(~flags)
            raise errors.flags_error(flags, f"rank {b.rank}: dispatch", b.config.timeout_s)

    # -- dispatch --------------------------------------------------------------------------
    def prepared(self, key: Hashable) -> Optional[DispatchPlan]:
        return self.plans.get(key)

    def _preparable(self, request: DispatchRequest) -> bool:
        """A call without a handle over NCCL (no header exchange on the host), with a call
        key."""
        return request.key is not None and request.cached is None and \
            not self.backend._host_transport and not INTERPRET

    def _counts_allocation(self) -> tuple[str, tuple, torch.dtype, bool]:
        """The count kernel's output, allocated before the rest (`_allocations`)."""
        return "counts", (self.programs, next_power_of_2(self.backend.num_ranks)), \
            torch.int32, False

    def _allocations(self, call: _Call, sizes: _Sizes) -> list[tuple[str, tuple, torch.dtype,
                                                                      bool]]:
        """(name, shape, dtype, output) of every tensor a dispatch allocates after its count
        (scratch unless `output`)."""
        b = self.backend
        R, M, K = b.num_ranks, call.max_tokens, call.num_topk
        num_local = call.num_experts // R
        nbytes = call.record_words * 4
        i32 = torch.int32
        out = [("send", (_block_rows(sizes.send_splits, R, M, b.rank), nbytes), torch.uint8,
                False),
               ("recv", (_block_rows(sizes.recv_splits, R, M), nbytes), torch.uint8, False),
               ("block", (self.handle_layout(call, sizes.num_rows).words,), i32, True),
               ("hist", (self.programs, max(num_local, 1)), i32, False)]
        rows = sizes.num_expanded if call.expand else sizes.num_rows
        out += [(f"out{i}", (rows, *shape), dtype, True) for i, (shape, dtype)
                in enumerate(call.rows)]
        if not call.expand:
            out.append(("recv_idx", (rows, K), call.idx_dtype, True))
        if call.has_w:
            out.append(("recv_w", (rows, K) if not call.expand else (rows,), torch.float32,
                        True))
        return out

    def handle_layout(self, call: _Call, num_rows: int) -> BlockLayout:
        """Where the int32 tensors a dispatch keeps (its handle's, `pos` and `send_counts` of
        `KernelState`, and the copy of topk_idx if it makes one) lie in its one "block"
        allocation, cached per call shape and row count. recv_src_metadata comes last, so that
        every other part lies where it does whatever the row count (`SyncDispatchPlan`'s
        templates hold the offsets of its capacity)."""
        key = (call, num_rows)
        layout = self.handle_layouts.get(key)
        if layout is None:
            R, T, K, i32 = self.backend.num_ranks, call.num_tokens, call.num_topk, torch.int32
            num_local = call.num_experts // R
            parts = [("pos", (T, R), i32), ("send_counts", (R,), i32),
                     ("psum_num_recv_tokens_per_scaleup_rank", (R,), i32),
                     ("num_unaligned_recv_tokens_per_expert", (num_local,), i32),
                     ("psum_num_recv_tokens_per_expert", (num_local,), i32),
                     ("dst_buffer_slot_idx", (T, K), i32)]
            if call.copy_idx:
                parts.append(("topk_idx", (T, K), call.idx_dtype))
            parts.append(("recv_src_metadata", (num_rows, K + 2), i32))
            layout = BlockLayout(parts)
            remember(self.handle_layouts, key, layout)
        return layout

    def _count_launch(self, call: _Call, t: dict, per_expert: bool) -> tuple:
        b = self.backend
        return self._launcher(kernels.count_kernel, ROWS=ROWS, **self._common(call)), \
            call.idx_variant, dict(
                idx_ptr=t["idx"], num_tokens=call.num_tokens, num_experts=call.num_experts,
                num_ranks=b.num_ranks, counts_ptr=t["counts"], flags_ptr=b._flags,
                experts_ptr=t["experts"], per_expert=int(per_expert))

    def _common(self, call: _Call) -> dict:
        return dict(K=call.num_topk, BLOCK_K=next_power_of_2(call.num_topk),
                    BLOCK_R=next_power_of_2(self.backend.num_ranks))

    def _launches(self, call: _Call, t: dict, h: TensorBlock, header: torch.Tensor,
                  exchanged: bool, exact: bool, num_rows, bound,
                  host: Optional[HostCounts]) -> list[tuple]:
        """(launcher, variant, fields) of pack, unpack, expert prefix and expand, with the
        tensors (or stand-ins) of `t` and the handle block `h`, over exact blocks or padded
        ones; `num_rows` (compact output rows) and `bound` (`_bound`) are ints, or stand-ins of
        a prepared call's per-call ints; expand leaves the call's counts in `host` if given."""
        b = self.backend
        R, M, K, E = b.num_ranks, call.max_tokens, call.num_topk, call.num_experts
        num_local = E // R
        vec, common, exact = call.vec, self._common(call), int(exact)
        block_p = max(2, next_power_of_2(self.programs))
        block_e = next_power_of_2(max(num_local, 1))
        pack = self._launcher(kernels.pack_kernel, BLOCK_P=block_p, BLOCK_F=kernels.BLOCK_F,
                              ROWS=ROWS, VEC=vec, BLOCK_W=BLOCK_W, **common), \
            call.idx_variant, dict(
                idx_ptr=t["idx"], weights_ptr=t["weights"], has_w=int(call.has_w),
                num_tokens=call.num_tokens, num_experts=E, num_ranks=R, rank=b.rank,
                max_tokens=M, counts_ptr=t["counts"], send_addr=address(t["send"]),
                recv_addr=address(t["recv"]), record_words=call.record_words,
                p0_addr=address(t["p0"]), w0=call.w0, p1_addr=address(t["p1"]), w1=call.w1,
                off1=call.off1, meta_off=call.meta_off, pos_ptr=h.arg("pos"),
                slot_ptr=h.arg("dst_buffer_slot_idx"), send_counts_ptr=h.arg("send_counts"),
                idx_copy=h.arg("topk_idx") if call.copy_idx else t["idx"],
                copy_idx=int(call.copy_idx), fields_ptr=header, seq_ptr=b._seq,
                bump=int(not exchanged), exact=exact)
        o0 = t["out0"] if not call.expand else t["p0"]
        o1 = t.get("out1", o0) if not call.expand else o0
        layout = dict(recv_addr=address(t["recv"]), record_words=call.record_words,
                      num_ranks=R, rank=b.rank, max_tokens=M, exact=exact, num_rows=num_rows,
                      p0_in=address(t["p0"]), p1_in=address(t["p1"]),
                      num_local=num_local, w0=call.w0, w1=call.w1, off1=call.off1,
                      meta_off=call.meta_off, expand=int(call.expand),
                      zero_padding=int(call.zero_padding), has_w=int(call.has_w),
                      meta_out=h.arg("recv_src_metadata"), flags_ptr=b._flags)
        compact_w = t["recv_w"] if call.has_w and not call.expand else t["weights"]
        unpack = self._launcher(kernels.unpack_kernel, BLOCK_M=next_power_of_2(K + 2),
                                BLOCK_E=min(block_e, 1024), BLOCK_F=kernels.BLOCK_F,
                                ROWS=ROWS, VEC=vec, BLOCK_W=BLOCK_W, **common), \
            call.idx_variant, dict(
                layout, counts_ptr=t["exact_counts"],
                counts_stride=t["exact_counts"].shape[1] if exact else 0,
                rank_psum_out=h.arg("psum_num_recv_tokens_per_scaleup_rank"),
                p0_out=address(o0), p1_out=address(o1),
                idx_out=t["recv_idx"] if not call.expand else t["idx"], w_out=compact_w,
                hist_ptr=t["hist"], check=int(not exchanged), fields_ptr=header,
                seq_ptr=b._seq)
        prefix = self._launcher(kernels.expert_prefix_kernel, BLOCK_P=block_p), (), dict(
            hist_ptr=t["hist"], num_local=num_local,
            expert_counts_out=h.arg("num_unaligned_recv_tokens_per_expert"))
        e0 = t["out0"] if call.expand else o0
        e1 = t.get("out1", e0) if call.expand else o1
        expand = self._launcher(kernels.expand_kernel, BLOCK_E=block_e, GROUP=GROUP,
                                ROWS=ROWS, VEC=vec, BLOCK_W=BLOCK_W, **common), vec, dict(
            layout, rank_psum=h.arg("psum_num_recv_tokens_per_scaleup_rank"),
            alignment=call.alignment, capacity=bound,
            expert_counts=h.arg("num_unaligned_recv_tokens_per_expert"),
            expert_psum_out=h.arg("psum_num_recv_tokens_per_expert"),
            p0_out=address(e0), p1_out=address(e1),
            w_out=t["recv_w"] if call.has_w and call.expand else t["weights"],
            hist_ptr=t["hist"], read_counts=int(host is not None),
            counts_host=t["hist"] if host is None else host.words)
        return [pack, unpack, prefix, expand]

    def _experts(self, num_experts: int) -> torch.Tensor:
        """The zeroed slots-per-expert accumulator of a synchronizing call ([E] int64)."""
        if self.experts.numel() < num_experts:
            self.experts = torch.zeros(num_experts, dtype=torch.int64,
                                       device=self.backend.device)
        return self.experts[:num_experts]

    def _count_rows_allocation(self, call: _Call, sizes_read: bool,
                               ) -> tuple[str, tuple, torch.dtype, bool]:
        """The rows a dispatch's count exchange sends: the header, then with `sizes_read`
        the words every size of the call comes from (see `_sizes`)."""
        R = self.backend.num_ranks
        words = _HEADER_WORDS + (1 + R + call.num_experts // R if sizes_read else 0)
        return "count rows", (R, words), torch.int64, False

    def _header_launch(self, call: _Call, t: dict, header: torch.Tensor,
                       sizes_read: bool) -> tuple:
        """The launch that fills t["count rows"] after the count launch
        (`kernels.header_kernel`)."""
        b = self.backend
        R, num_local = b.num_ranks, call.num_experts // b.num_ranks
        _, (_, words), _, _ = self._count_rows_allocation(call, sizes_read)
        return self._launcher(
            kernels.header_kernel, programs=1, BLOCK_P=max(2, next_power_of_2(self.programs)),
            BLOCK_R=next_power_of_2(R), BLOCK_E=min(next_power_of_2(max(num_local, 1)), 1024),
            BLOCK_F=next_power_of_2(_HEADER_WORDS + 1)), (), dict(
                counts_ptr=t["counts"], num_programs=self.programs, num_ranks=R,
                flags_ptr=b._flags, experts_ptr=t["experts"], num_local=num_local,
                fields_ptr=header, seq_ptr=b._seq, rows_ptr=t["count rows"], row_words=words,
                extra=int(sizes_read))

    def _bound(self, call: _Call, sizes: _Sizes) -> int:
        """The expand rows a call may fill (`expand_kernel`'s capacity): the expand output's in
        the expand layout, else every pair's aligned row (the handle's expand rows)."""
        num_local = call.num_experts // self.backend.num_ranks
        return sizes.num_expanded if call.expand else \
            sizes.num_rows * call.num_topk + call.alignment * num_local

    def _sizes(self, call: _Call, cached: Optional[EPHandle],
               table: Optional[list[list[int]]]) -> tuple[_Sizes, int]:
        """The call's sizes, and the error flag its count exchange carried (0 if none): a
        cached call's, those a synchronizing call's count exchange gave (`table`), else the
        capacity."""
        b = self.backend
        R, M = b.num_ranks, call.max_tokens
        num_local = call.num_experts // R
        flags = 0
        send_splits = recv_splits = counts_list = None
        if cached is not None:
            state: KernelState = cached.backend_state
            if call.sync:
                send_splits, recv_splits = state.send_splits, state.recv_splits
            counts_list = cached.num_recv_tokens_per_expert_list
            num_expanded = cached.num_expanded_tokens if call.expand else 0
        elif call.sync and table is not None:
            # After the header: this rank's error flag and its records for every rank (each
            # rank reads its own in the row it sent itself), then the slots sent to each of
            # the receiver's local experts.
            at, me = _HEADER_WORDS, b.rank
            flags = table[me][at]
            send_splits = table[me][at + 1:at + 1 + R]
            recv_splits = [source[at - 1] for source in table]
            slots = [sum(column) for column in zip(*(source[at + 1 + R:] for source in table))]
            counts_list = [-(-n // call.alignment) * call.alignment for n in slots]
            num_expanded = sum(counts_list) if call.expand else 0
        else:
            num_expanded = expand_capacity(R, M, call.num_topk, num_local, call.alignment) \
                if call.expand else 0
        num_rows = cached.num_recv_tokens if cached is not None else \
            sum(recv_splits) if recv_splits is not None else R * M
        return _Sizes(send_splits, recv_splits, num_rows, counts_list, num_expanded), flags

    def dispatch(self, request: DispatchRequest, record: "_Record",
                 header: torch.Tensor) -> DispatchResult:
        b = self.backend
        call = _Call.of(request, record)
        host = None
        if call.sync and not b._host_transport and padded_sync(
                b.num_ranks, call.max_tokens, call.num_topk, record.nbytes):
            # padded blocks: the sync-free call, then (without a handle) one read of its counts
            call = replace(call, sync=False)
            if request.cached is None:
                host = b.host_counts(call.num_experts // b.num_ranks)
        if self._preparable(request):
            plan = self.plans.get(request.key) or self._prepare(request, call, header, host)
            if plan is not None:
                addresses = [tensor.data_ptr() for tensor in caller_tensors(
                    request.rows, request.topk_idx, request.topk_weights)]
                if plan.takes(addresses):
                    return plan.run(addresses, request.topk_idx, request.alloc, request.stream)
        rows, topk_idx = request.rows, request.topk_idx
        t = dict(idx=topk_idx, p0=rows[0], p1=rows[-1],
                 weights=request.topk_weights if call.has_w else self.no_weights)
        name, shape, dtype, _ = self._counts_allocation()
        t[name] = b._workspace.tensor(name, shape, dtype)
        exchange = b._dispatch_exchange(call.sync, request.cached)
        sizes_read = call.sync and request.cached is None  # one host read gives every size
        t["experts"] = self._experts(call.num_experts) if sizes_read else b._seq
        launcher, variant, fields = self._count_launch(call, t, sizes_read)
        launcher(variant, None, fields)
        table, t["exact_counts"] = None, b._seq  # (exact counts: none, the kernel reads none)
        if exchange:
            name, shape, dtype, _ = self._count_rows_allocation(call, sizes_read)
            t[name] = b._workspace.tensor(name, shape, dtype)
            launcher, variant, fields = self._header_launch(call, t, header, sizes_read)
            launcher(variant, None, fields)
            received, table = b._exchange_headers(exchange, t[name])
        if sizes_read:
            t["exact_counts"] = received
        elif call.sync:
            t["exact_counts"] = request.cached.backend_state.recv_counts
        sizes, flags = self._sizes(call, request.cached, table)
        for name, shape, dtype, output in self._allocations(call, sizes):
            t[name] = request.alloc.empty(shape, dtype) if output else \
                b._workspace.tensor(name, shape, dtype)
        block = _handle_block(call, self.handle_layout(call, sizes.num_rows), t["block"],
                              topk_idx)
        pack, *rest = self._launches(call, t, block, header, bool(exchange),
                                     sizes.send_splits is not None, sizes.num_rows,
                                     self._bound(call, sizes), host)
        pack[0](pack[1], None, pack[2])
        self.all_to_all("dispatch", t["recv"], t["send"], sizes.recv_splits, sizes.send_splits,
                        call.max_tokens)
        for launcher, variant, fields in rest:
            launcher(variant, None, fields)
        self.raise_flags(flags)
        result = self.result(call, sizes, t, block, request.cached, sizes_read)
        return result if host is None else self.exact(result, None, host)

    def _prepare(self, request: DispatchRequest, call: _Call, header: torch.Tensor,
                 host: Optional[HostCounts]) -> Union[DispatchPlan, SyncDispatchPlan, None]:
        """The plan of this call shape (`DispatchPlan`, or `SyncDispatchPlan` for a
        synchronizing call over exact blocks; `host`: where a synchronizing call over padded
        blocks leaves its counts), None while a kernel is not kept (the first call compiles
        them)."""
        b = self.backend
        sizes, _ = self._sizes(call, None, None)  # (the capacity: names and dtypes)
        callers = caller_tensors(request.rows, request.topk_idx, request.topk_weights)
        slots = {id(tensor): Address(at) for at, tensor in enumerate(callers)}
        first = [self._counts_allocation()]
        names = ["counts"]
        if call.sync:
            first.append(self._count_rows_allocation(call, True))
            names += ["experts", first[1][0], "exact_counts"]
        allocations = self._allocations(call, sizes)
        names += [name for name, *_ in allocations]
        t = {name: Address(len(callers) + at) for at, name in enumerate(names)}
        t.update(idx=slots[id(request.topk_idx)], p0=slots[id(request.rows[0])],
                 p1=slots[id(request.rows[-1])],
                 weights=slots[id(request.topk_weights)] if call.has_w else self.no_weights)
        block = TensorBlock(t["block"], self.handle_layout(call, sizes.num_rows))
        num_rows, bound = sizes.num_rows, self._bound(call, sizes)
        if call.sync:  # exact blocks: the rows exchanged and two ints per call
            t["exact_counts"].shape = first[1][1]
            num_rows, bound = Address(len(callers) + len(names)), \
                Address(len(callers) + len(names) + 1)
        else:
            t.update(experts=b._seq, exact_counts=b._seq)  # (not read)
        launches = [self._count_launch(call, t, call.sync),
                    *([self._header_launch(call, t, header, True)] if call.sync else []),
                    *self._launches(call, t, block, header, call.sync, call.sync, num_rows,
                                    bound, host)]
        if not all(launcher.kept(variant) for launcher, variant, _ in launches):
            return None
        templates = [(launcher, variant, launcher.template(fields, t["block"].slot))
                     for launcher, variant, fields in launches]
        plan = SyncDispatchPlan(self, call, first, [name for name, *_ in allocations],
                                templates) if call.sync else \
            DispatchPlan(self, call, sizes, first + allocations, templates,
                         [(tensor.nbytes, tensor.nbytes) for tensor in callers], host)
        remember(self.plans, request.key, plan)
        return plan

    def result(self, call: _Call, sizes: _Sizes, t: dict, block: TensorBlock, cached,
               flags_checked: bool) -> DispatchResult:
        """The dispatch's outputs and handle from its tensors `t` and handle block."""
        b = self.backend
        outputs = [t[f"out{i}"] for i in range(len(call.rows))]
        recv_idx = None if call.expand else t["recv_idx"]
        recv_w = t["recv_w"] if call.has_w else None
        if cached is not None:
            return DispatchResult(outputs, recv_idx, recv_w, cached)
        handle = EPHandle(
            tensors=block,
            num_recv_tokens_per_expert_list=sizes.counts_list,
            num_experts=call.num_experts,
            expert_alignment=call.alignment,
            num_max_tokens_per_rank=call.max_tokens,
            do_expand=call.expand,
            do_cpu_sync=call.sync,
            num_recv_tokens=sizes.num_rows,
            num_expanded_tokens=sizes.num_expanded,
            buffer_id=b.config.buffer_id,
            num_tokens=call.num_tokens,
            hidden=b.config.hidden,
            backend_state=KernelState(sizes.send_splits, sizes.recv_splits, t["exact_counts"]
                                      if sizes.recv_splits is not None else None),
            storage=block.storage(),
            num_sms=b.config.num_sms or 0,
        )
        return DispatchResult(outputs, recv_idx, recv_w, handle, flags_checked=flags_checked)

    # -- combine ---------------------------------------------------------------------------
    def combine(self, request: CombineRequest, record: "_Record", header: torch.Tensor,
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        b = self.backend
        handle = request.handle
        state: KernelState = handle.backend_state
        topk_idx = handle.tensors["topk_idx"]
        x, weights, biases = request.x, request.topk_weights, request.biases
        if b._host_transport:
            counts = handle.tensors["psum_num_recv_tokens_per_scaleup_rank"].diff(
                prepend=torch.zeros(1, dtype=torch.int32, device=b.device))
            b._exchange_headers("combine (header exchange)",
                                b._header_rows(header, counts.long()))
        elif state.send_splits is None and not INTERPRET:  # padded blocks: a prepared call
            key = (handle.num_tokens, topk_idx.dtype, handle.num_max_tokens_per_rank,
                   handle.num_experts, handle.expert_alignment, handle.do_expand,
                   handle.do_cpu_sync, weights is not None, tuple(bias.dtype for bias in biases))
            plan = self.combine_plans.get(key) or self._prepare_combine(
                key, handle, _combine_callers(handle, x, weights, biases), biases, record,
                header)
            if plan is not None:
                block: TensorBlock = handle.tensors
                addresses = [x.data_ptr(), *[tensor.data_ptr() for tensor in
                                             (weights, *biases) if tensor is not None],
                             *[block.address_of(name) for name in _HANDLE_READS]]
                if plan.takes(addresses):
                    return plan.run(addresses, request.alloc, x, weights)
        callers = _combine_callers(handle, x, weights, biases)
        t = dict(callers, weights=callers.get("weights", self.no_weights), biases=biases)
        for name, shape, dtype, output in self._combine_allocations(handle, record):
            t[name] = request.alloc.empty(shape, dtype) if output else \
                b._workspace.tensor(name, shape, dtype)
        pack, reduce = self._combine_launches(handle, weights is not None, biases, record,
                                              header, t)
        pack[0](pack[1], None, pack[2])
        self.all_to_all("combine", t["returned"], t["send"], state.send_splits,
                        state.recv_splits, handle.num_max_tokens_per_rank)
        reduce[0](reduce[1], None, reduce[2])
        return t["out"], t.get("w_out")

    def _combine_allocations(self, handle: EPHandle, record: "_Record",
                             ) -> list[tuple[str, tuple, torch.dtype, bool]]:
        """(name, shape, dtype, output) of a combine's tensors: its send and receive rows
        (exact blocks after a synchronizing dispatch, else padded), then its outputs."""
        b = self.backend
        state: KernelState = handle.backend_state
        R, M, H = b.num_ranks, handle.num_max_tokens_per_rank, b.config.hidden
        T, K = handle.tensors["topk_idx"].shape
        # (blocks run the other way: back along the dispatch's receive side)
        out = [("send", (_block_rows(state.recv_splits, R, M, b.rank), record.nbytes),
                torch.uint8, False),
               ("returned", (_block_rows(state.send_splits, R, M), record.nbytes),
                torch.uint8, False),
               ("out", (T, H), torch.bfloat16, True)]
        if record.meta_words:  # (weights travel back)
            out.append(("w_out", (T, K), torch.float32, True))
        return out

    def _combine_launches(self, handle: EPHandle, has_w: bool, biases: Sequence,
                          record: "_Record", header: torch.Tensor, t: dict) -> list[tuple]:
        """(launcher, variant, fields) of the combine's pack and reduce, with the tensors (or
        stand-ins) of `t`: x, weights, each handle tensor it reads, send_counts, pos, then the
        allocations of `_combine_allocations`."""
        b = self.backend
        R, M, H = b.num_ranks, handle.num_max_tokens_per_rank, b.config.hidden
        T, K = handle.tensors["topk_idx"].shape
        exact = handle.backend_state.send_splits is not None
        vec = 8 if H % 8 == 0 else 4 if H % 4 == 0 else 2
        common = dict(K=K, BLOCK_K=next_power_of_2(K), BLOCK_R=next_power_of_2(R),
                      BLOCK_F=kernels.BLOCK_F, ROWS=COMBINE_ROWS, VEC=vec,
                      BLOCK_H=BLOCK_H, num_warps=COMBINE_WARPS)
        record_words, meta_off = record.nbytes // 4, record.meta // 4
        pack = self._launcher(kernels.combine_pack_kernel, **common), vec, dict(
            x_addr=address(t["x"]), hidden=H, num_ranks=R, rank=b.rank, max_tokens=M,
            exact=int(exact), rank_psum=t["psum_num_recv_tokens_per_scaleup_rank"],
            num_rows=handle.num_recv_tokens if exact else R * M, send_addr=address(t["send"]),
            recv_addr=address(t["returned"]), record_words=record_words, meta_off=meta_off,
            metadata=t["recv_src_metadata"], expand=int(handle.do_expand), w_ptr=t["weights"],
            has_w=int(has_w), fields_ptr=header, seq_ptr=b._seq, bump=int(not b._host_transport))
        dtypes = [bias.dtype for bias in biases] or [torch.bfloat16]  # (no bias: `out`)
        bias0 = t["biases"][0] if biases else t["out"]
        bias1 = t["biases"][1] if len(biases) > 1 else bias0
        reduce = self._launcher(kernels.combine_reduce_kernel, **common), \
            (handle.tensors["topk_idx"].dtype, dtypes[0], dtypes[-1]), dict(
                recv_addr=address(t["returned"]), record_words=record_words,
                meta_off=meta_off, num_ranks=R, rank=b.rank, max_tokens=M, exact=int(exact),
                send_counts=t["send_counts"], x_addr=address(t["x"]),
                rank_psum=t["psum_num_recv_tokens_per_scaleup_rank"],
                expand=int(handle.do_expand), idx_ptr=t["topk_idx"], num_tokens=T,
                num_experts=handle.num_experts, pos_ptr=t["pos"], bias0=bias0, bias1=bias1,
                num_bias=len(biases), out_ptr=t["out"], hidden=H, has_w=int(has_w),
                w_out=t["w_out"] if has_w else t["weights"],
                check=int(not b._host_transport), fields_ptr=header, seq_ptr=b._seq,
                flags_ptr=b._flags)
        return [pack, reduce]

    def _prepare_combine(self, key: Hashable, handle: EPHandle, callers: dict,
                         biases: tuple, record: "_Record", header: torch.Tensor,
                         ) -> Optional["CombinePlan"]:
        """The prepared combine of this call shape (`CombinePlan`; `callers`: the call's
        `_combine_callers`), None while a kernel is not kept (the first call compiles them)."""
        allocations = self._combine_allocations(handle, record)
        names = [*callers, *[name for name, *_ in allocations]]
        t = {name: Address(at) for at, name in enumerate(names)}
        t["biases"] = [t[f"bias{i}"] for i in range(len(biases))]
        has_w = "weights" in callers
        if not has_w:
            t["weights"] = self.no_weights
        launches = self._combine_launches(handle, has_w, biases, record, header, t)
        if not all(launcher.kept(variant) for launcher, variant, _ in launches):
            return None
        plan = CombinePlan(self, allocations, [(launcher, variant, launcher.template(fields, 0))
                                               for launcher, variant, fields in launches],
                           self._combine_inputs(handle, callers),
                           handle.num_max_tokens_per_rank)
        remember(self.combine_plans, key, plan)
        return plan

    def _combine_inputs(self, handle: EPHandle, callers: dict) -> list[tuple[int, int]]:
        """(bytes, row bytes) of a prepared combine's caller tensors (`GraphedCall`): x and
        the weights hold at most the capacity rows of the handle's layout (after a
        synchronizing dispatch over padded blocks, the exact rows of each call), the rest
        their bytes."""
        R, M = self.backend.num_ranks, handle.num_max_tokens_per_rank
        rows = expand_capacity(R, M, handle.tensors["topk_idx"].shape[1],
                               handle.num_experts // R, handle.expert_alignment) \
            if handle.do_expand else R * M
        inputs = []
        for name, tensor in callers.items():
            if name in ("x", "weights"):
                row = math.prod(tensor.shape[1:]) * tensor.element_size()
                inputs.append((rows * row, row))
            else:
                inputs.append((tensor.nbytes, tensor.nbytes))
        return inputs


# The handle block's tensors a combine reads (after x, weights and the biases in
# `_combine_callers`); the last two are the dispatch's own, not the handle's fields.
_HANDLE_READS = ("psum_num_recv_tokens_per_scaleup_rank", "recv_src_metadata", "topk_idx",
                 "send_counts", "pos")


def _combine_callers(handle: EPHandle, x: torch.Tensor, weights: Optional[torch.Tensor],
                     biases: tuple) -> dict[str, torch.Tensor]:
    """A combine's caller tensors by name, in a prepared combine's slot order: x, weights (if
    given), bias0.., the handle block's tensors it reads (`_HANDLE_READS`)."""
    callers = {"x": x} if weights is None else {"x": x, "weights": weights}
    callers.update((f"bias{i}", bias) for i, bias in enumerate(biases))
    callers.update((name, handle.tensors[name]) for name in _HANDLE_READS)
    return callers


class CombinePlan(_GraphedPlan):
    """A combine over NCCL of one call shape after a dispatch over padded blocks: the pack
    and reduce launches kept as templates (slots: the caller tensors of `_combine_callers`,
    then the allocations of `KernelPath._combine_allocations`: send and receive rows, the
    outputs; `max_tokens`: the handle's, which sizes the blocks)."""

    def __init__(self, path: "KernelPath", allocations: Sequence[tuple[str, tuple, torch.dtype,
                                                                       bool]],
                 launches: list, inputs: Sequence[tuple[int, int]], max_tokens: int) -> None:
        super().__init__(path, allocations, launches, inputs)
        self.max_tokens = max_tokens

    def issue(self, values: Sequence[int], tensors: Sequence[torch.Tensor],
              stream: Optional["torch.cuda.Stream"]) -> None:
        (pack, pack_variant, pack_args), (reduce, reduce_variant, reduce_args) = self.launches
        pack.launch_filled(pack_variant, stream, pack_args.fill(values[:pack_args.slots]))
        self.path.issue_on(stream, self.path.all_to_all, "combine", tensors[1], tensors[0],
                           None, None, self.max_tokens)
        reduce.launch_filled(reduce_variant, stream,
                             reduce_args.fill(values[:reduce_args.slots]))

    def run(self, addresses: Sequence[int], alloc, x: torch.Tensor,
            weights: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        t = self.tensors(addresses, alloc, None,
                         (x.nbytes,) if weights is None else (x.nbytes, weights.nbytes))
        return t["out"], t.get("w_out")
