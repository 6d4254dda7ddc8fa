"""DeepEP V1's low-latency (decode) dispatch and combine: the layout, the FP8 cast, the double
buffer, and the two transports behind one interface (`LowLatencyTransport`).

`epcomm.legacy.Buffer.low_latency_dispatch` / `low_latency_combine` validate their arguments and
delegate here; docs/semantics.md ("Low-latency mode") pins every bit of the outputs.

Terms: `R` ranks, `E` experts, `E_l = E // R` per rank (expert `g` lives on rank `g // E_l` as
local expert `g % E_l`), `M` = `num_max_dispatch_tokens_per_rank`, `T <= M` tokens on this rank,
`K` top-k slots, `H` hidden, `S = H / 128` scale columns.

Transports. A transport implements the send of a dispatch and of a combine, each returning the
callable that receives (called at once, or by the hook with `return_recv_hook`):
- `SymmetricLowLatency`: peer memory (`SymmetricHeap`, one node), the Triton kernels of
  `epcomm.kernels.low_latency` (two launches per call, one where a rank has nothing to wait
  for; device-side counters: sync-free and graph-capturable; a missing peer sets a timeout
  flag).
- `CollectiveLowLatency`: fixed-size point-to-point messages of the group
  (`torch.distributed.batch_isend_irecv`: gloo for CPU tensors, NCCL for CUDA tensors), one per
  unmasked peer and direction, of `min(K, E_l) * M` row slots each, so that no count has to
  reach the host. The rows sent to a peer are its local experts' rows of this rank, ordered by
  local expert, then token, so that the receiver places them with one prefix sum.

Buffers. Every call (dispatch or combine) takes the next of two slots; a slot holds its call's
outputs and bookkeeping (and the collective transport's messages), so the results of two
consecutive calls are alive at once and a third call reuses the first one's slot. Each slot
counts its dispatches; a handle records the count it was made with, so a combine whose slot was
reused raises, and a call whose slot still waits for its hook raises. The slots of a shape
`(M, H, E, K, use_fp8, use_ue8m0)` (and the heap, for peer memory) are allocated by the first
call of that shape, on every rank; later calls allocate nothing but, on the collective
transport, PyTorch's temporaries (from the caching allocator, or the graph's pool while a CUDA
graph is captured).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import errors, logfmt
from .backends.symmetric.heap import SymmetricHeap
from .fp8 import BLOCK_SIZE, block_scales
from .kernels import INTERPRET
from .kernels.launcher import next_power_of_2
from .kernels.low_latency import (LowLatencyLayout, ll_combine_reduce, ll_combine_send,
                                  ll_dispatch_local, ll_dispatch_recv, ll_dispatch_send)
from .kernels.sync import timeout_units
from .nan import canonical_nan_

__all__ = ["LowLatencyHandle", "LowLatencyShape", "LowLatencyTransport", "CollectiveLowLatency",
           "SymmetricLowLatency", "cast_blocks_to_fp8",
           "low_latency_size_hint", "UE8M0_PER_WORD"]

UE8M0_PER_WORD = 4           # UE8M0 exponent bytes per int32 scale word
_ALIGNMENT = 128             # DeepEP's buffer sizes are multiples of this many bytes
_MSG_HEADER = 16             # DeepEP's per-message control bytes (source index and reserve)


@dataclass(frozen=True)
class LowLatencyTile:
    """One kernel's launch shape: channels per program (a row's part; P = ceil(H / block_c)
    programs per row), warps, and for the combine's send the rows it moves per step."""
    block_c: int
    num_warps: int
    rows: int = 1


# The symmetric kernels' tiles on the GPU, each kernel's fastest of `scripts/gpu_tune.py
# --low-latency` (H100, EP=1, H = 7168, M = 128 tokens, FP8; GPU us in one run): send 10.9
# (whole rows, 8 warps: one program per token and one for its routing, all resident at once),
# receive 7.3 (whole rows, 8 warps), reduce 9.5 (whole rows, 16 warps; 60 registers, no spill;
# 4096 channels and 8 warps 9.6, 2048 and 4 warps 9.7, 1024 and 4 warps 10.9). The combine's
# send (whole rows, 8 warps, 4 rows a step) is not launched at EP=1; timed when it also moved
# the rank's own rows, it took 4.3 against 7.1 with parts of 1024 channels and 4 warps. The
# one-rank dispatch (whole rows, 8 warps; H200, 128 tokens): 12.5 us against 14.0 at 4096
# channels and 8 warps, 19.4 at 2048 and 4, 28.7 at 1024 and 4 (its time is per program).
GPU_TILES = dict(ll_dispatch_send=LowLatencyTile(8192, 8),
                 ll_dispatch_recv=LowLatencyTile(8192, 8),
                 ll_dispatch_local=LowLatencyTile(8192, 8),
                 ll_combine_send=LowLatencyTile(8192, 8, rows=4),
                 ll_combine_reduce=LowLatencyTile(8192, 16))
# Under the interpreter: small parts, so that the tests' rows span several parts and steps as
# on the GPU, and a different part count per kernel, as the GPU tiles may have.
CPU_TILES = dict(ll_dispatch_send=LowLatencyTile(128, 1),
                 ll_dispatch_recv=LowLatencyTile(256, 1),
                 ll_dispatch_local=LowLatencyTile(128, 1),
                 ll_combine_send=LowLatencyTile(128, 1, rows=2),
                 ll_combine_reduce=LowLatencyTile(256, 1))


def low_latency_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                          num_experts: int) -> int:
    """DeepEP's `get_low_latency_rdma_size_hint`: the bytes of its two send, two receive and
    two signalling buffers for BF16 messages (a multiple of 128). epcomm checks
    `num_rdma_bytes` against it as DeepEP does; its own buffers are described above."""
    num_scales = hidden // BLOCK_SIZE
    dispatch_msg = _MSG_HEADER + max(hidden * 2, hidden + num_scales * 4)
    combine_msg = num_scales * 4 + hidden * 2
    per_expert = num_experts * num_max_dispatch_tokens_per_rank
    send = max(num_max_dispatch_tokens_per_rank * dispatch_msg, per_expert * combine_msg)
    recv = max(per_expert * dispatch_msg, per_expert * combine_msg)
    signal = -(-num_experts * 4 // _ALIGNMENT) * _ALIGNMENT
    total = 2 * (send + recv + signal)
    return (total + _ALIGNMENT) // _ALIGNMENT * _ALIGNMENT


def cast_blocks_to_fp8(x: torch.Tensor, round_scale: bool):
    """Cast bf16 rows `x` [T, H] (H a multiple of 128) per 128-channel block.

    Returns (fp8 [T, H] float8_e4m3fn, scales [T, H / 128] float32): `amax` = the block's
    largest |x| in fp32, at least 1e-4; the scale is `amax / 448` (fp32 division), or with
    `round_scale` the least power of two >= `amax / 448`; `fp8 = e4m3(x / scale)` (fp32
    division, round to nearest even)."""
    tokens, hidden = x.shape
    blocks = x.float().view(tokens, hidden // BLOCK_SIZE, BLOCK_SIZE)
    scales = block_scales(blocks.abs().amax(dim=2), round_scale)
    fp8 = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn).view(tokens, hidden)
    return fp8, scales


def _ue8m0_words(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales [N, S] -> UE8M0 words [N, ceil(S / 4)] int32: byte `b` of
    word `j` (little-endian) is the biased exponent of scale `4 j + b` (0 past `S`)."""
    rows, num = scales.shape
    words = -(-num // UE8M0_PER_WORD)
    exponents = torch.zeros((rows, words * UE8M0_PER_WORD), dtype=torch.uint8,
                            device=scales.device)
    exponents[:, :num] = (scales.view(torch.int32) >> 23).to(torch.uint8)
    return exponents.view(torch.int32)


@dataclass(frozen=True)
class LowLatencyShape:
    """What fixes a low-latency call's buffers (the same on every rank)."""
    num_ranks: int
    rank: int
    max_tokens: int      # M
    hidden: int          # H
    num_experts: int     # E
    num_topk: int        # K
    use_fp8: bool
    use_ue8m0: bool

    @property
    def num_local(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def rows(self) -> int:
        """R * M: rows per local expert in the outputs."""
        return self.num_ranks * self.max_tokens

    @property
    def capacity(self) -> int:
        """Row slots of one message: a token sends at most min(K, E_l) rows to one rank."""
        return self.max_tokens * min(self.num_topk, self.num_local)

    @property
    def num_scales(self) -> int:
        return self.hidden // BLOCK_SIZE

    @property
    def scale_columns(self) -> int:
        """Columns of the received scales: S floats, or ceil(S / 4) UE8M0 words."""
        return -(-self.num_scales // UE8M0_PER_WORD) if self.use_ue8m0 else self.num_scales

    @property
    def payload_bytes(self) -> int:
        """Bytes of one message row: the payload (bf16, or FP8 and fp32 scales) and the
        (local expert, source token) pair as two int32."""
        data = self.hidden + 4 * self.num_scales if self.use_fp8 else 2 * self.hidden
        return data + 8


@dataclass
class _Messages:
    """The collective transport's message tensors and bookkeeping of one slot."""
    send: torch.Tensor            # [R * cap + 1, W] uint8 dispatch rows out (last: discard)
    recv: torch.Tensor            # [R, cap, W] uint8 dispatch rows in
    send_counts: torch.Tensor     # [R, E_l] int32 rows per (destination, local expert)
    recv_counts: torch.Tensor     # [R, E_l] int32 rows per (source, local expert)
    placed: torch.Tensor          # [R * cap] int64: output row (flat) of each received row
    slot_row: torch.Tensor        # [M, K] int64: message row (flat) of each top-k slot, or -1
    combine_send: torch.Tensor    # [R, cap, H] bf16 expert outputs back to their sources
    combine_recv: torch.Tensor    # [R * cap, H] bf16 expert outputs of this rank's rows


@dataclass
class _Slot:
    """One of the two alternating buffers of a shape: outputs and bookkeeping."""
    recv_x: torch.Tensor          # [E_l + 1, R * M, H] bf16 / fp8 (last expert: discard)
    scales: Optional[torch.Tensor]  # [E_l + 1, S', R * M] float32 / int32, or None
    src_info: torch.Tensor        # [E_l + 1, R * M] int32
    recv_slot: torch.Tensor       # [E_l + 1, R * M] int32: top-k slot of each row at its source
    recv_count: torch.Tensor      # [E_l] int32
    layout_range: torch.Tensor    # [E_l, R] int64
    combined: torch.Tensor        # [M, H] bf16 default combine output
    messages: Optional[_Messages] = None  # the collective transport's
    zero_copy: Optional[torch.Tensor] = None  # [E_l, R * M, H] bf16, made when first asked
    dispatches: int = 0           # dispatches that used this slot (stale-handle check)
    peers: tuple = ()             # the unmasked ranks at the dispatch
    num_tokens: int = 0           # T of the dispatch


@dataclass
class _Pending:
    """Receives a call issued and has not waited for yet."""
    works: list                   # (peer, work) pairs in peer order
    started: int = field(default_factory=time.perf_counter_ns)
    copy_back: list = field(default_factory=list)  # (device tensor, host copy) received


class LowLatencyHandle(tuple):
    """DeepEP's low-latency handle: `(src_info, layout_range, M, H, E)`.

    - src_info: [E_l, R * M] int32, the source token index of each received row (rows past
      `recv_count` unspecified);
    - layout_range: [E_l, R] int64, `(begin << 32) | count` of the rows expert `e` got from
      rank `r` (DeepEP's `pack2<int, int64_t>(count, begin)`);
    - M, H, E: ints.

    It also records which buffer slot holds the dispatch and how many dispatches that slot had
    seen, so that a combine of a reused slot raises."""

    slot_key: tuple
    slot_index: int
    generation: int

    def __new__(cls, tensors: tuple, slot_key: tuple, slot_index: int,
                generation: int) -> "LowLatencyHandle":
        handle = super().__new__(cls, tensors)
        handle.slot_key, handle.slot_index, handle.generation = slot_key, slot_index, generation
        return handle


class LowLatencyTransport:
    """What both transports share: the two alternating slots of each shape, stale-handle and
    unreceived-hook checks, and the call flow. A transport implements `_make_messages`,
    `_send_dispatch` and `_send_combine` (each send returns the callable that receives)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self._slots: dict[tuple, list[_Slot]] = {}
        self.next_slot = 0
        self._unreceived = [False, False]  # slot -> a hook of its last call not yet called

    # -- slots ---------------------------------------------------------------------------
    def slots(self, shape: LowLatencyShape, device: torch.device) -> list[_Slot]:
        """The two slots of `shape` on `device` (allocated on first use)."""
        key = (shape, str(device))
        if key not in self._slots:
            self._slots[key] = [self._make_slot(shape, device) for _ in range(2)]
        return self._slots[key]

    def _make_slot(self, shape: LowLatencyShape, device: torch.device) -> _Slot:
        R, E_l, M, H = shape.num_ranks, shape.num_local, shape.max_tokens, shape.hidden
        scales = None
        if shape.use_fp8:
            scales = torch.zeros((E_l + 1, shape.scale_columns, R * M),
                                 dtype=torch.int32 if shape.use_ue8m0 else torch.float32,
                                 device=device)
        return _Slot(
            recv_x=torch.zeros((E_l + 1, R * M, H),
                               dtype=torch.float8_e4m3fn if shape.use_fp8 else torch.bfloat16,
                               device=device),
            scales=scales,
            src_info=torch.zeros((E_l + 1, R * M), dtype=torch.int32, device=device),
            recv_slot=torch.zeros((E_l + 1, R * M), dtype=torch.int32, device=device),
            recv_count=torch.zeros(E_l, dtype=torch.int32, device=device),
            layout_range=torch.zeros((E_l, R), dtype=torch.int64, device=device),
            combined=torch.zeros((M, H), dtype=torch.bfloat16, device=device),
            messages=self._make_messages(shape, device))

    def _make_messages(self, shape: LowLatencyShape, device: torch.device):
        """The transport's per-slot message tensors (None: it needs none)."""
        return None

    def _send_dispatch(self, shape: LowLatencyShape, slot: _Slot, index: int, x: torch.Tensor,
                       topk_idx: torch.Tensor, *, masked: tuple, round_scale: bool,
                       cumulative_stats: Optional[torch.Tensor],
                       wait_stats: Optional[torch.Tensor]) -> Callable[[], None]:
        """Start a dispatch into `slot` (number `index`) and return the callable that receives
        into the slot's outputs. x: [T, H] bf16; topk_idx: [T, K] int32/int64 (contiguous);
        masked: ranks not sent to nor waited for; stats as in `dispatch`."""
        raise NotImplementedError

    def _send_combine(self, shape: LowLatencyShape, slot: _Slot, index: int, source: _Slot,
                      source_index: int, x: torch.Tensor, topk_idx: torch.Tensor,
                      topk_weights: torch.Tensor, *, peers: tuple, result: torch.Tensor,
                      wait_stats: Optional[torch.Tensor], use_logfmt: bool,
                      now: bool) -> Callable[[], None]:
        """Start a combine in `slot` of the dispatch held by `source` (slot number
        `source_index`) and return the callable that reduces into `result` [T, H] bf16.
        x: [E_l, R * M, H] bf16 expert outputs;
        peers: the ranks unmasked at the dispatch and now; use_logfmt: rows travel in
        LogFMT-10 (`epcomm.logfmt`); now: the callable runs right after, before the caller
        can touch x again (no hook)."""
        raise NotImplementedError

    def take_slot(self) -> int:
        """The slot index of the next call (they alternate); raises if the hook of the call
        two calls back, which used that slot, was not called."""
        index = self.next_slot
        if self._unreceived[index]:
            raise RuntimeError("a low-latency call's hook was not called before the "
                               "next-but-one low-latency call (at most two calls' results are "
                               "alive at once: call the hook first)")
        self.next_slot ^= 1
        return index

    def peek_slot(self) -> int:
        """The slot index the next call will take."""
        return self.next_slot

    def clean(self) -> None:
        """Forget every slot's dispatches (handles made before become stale) and restart the
        alternation at slot 0 (collective: every rank must call it)."""
        if any(self._unreceived):
            raise RuntimeError("clean_low_latency_buffer with a low-latency hook not yet "
                               "called: call it first")
        for pair in self._slots.values():
            for slot in pair:
                slot.dispatches += 1
        self.next_slot = 0

    def num_tokens(self, handle: LowLatencyHandle) -> int:
        """T of the dispatch that made `handle`; raises if another buffer made it."""
        if handle.slot_key not in self._slots:
            raise ValueError("handle: not a handle of this buffer's low_latency_dispatch")
        return self._slots[handle.slot_key][handle.slot_index].num_tokens

    def destroy(self) -> None:
        """Release every slot (the outputs of earlier calls stay valid while referenced)."""
        self._slots.clear()

    def zero_copy_buffer(self, shape: LowLatencyShape, device: torch.device) -> torch.Tensor:
        """The [E_l, R * M, H] bf16 tensor the next combine reads with `zero_copy=True`."""
        slot = self.slots(shape, device)[self.peek_slot()]
        if slot.zero_copy is None:
            slot.zero_copy = torch.zeros((shape.num_local, shape.rows, shape.hidden),
                                         dtype=torch.bfloat16, device=device)
        return slot.zero_copy

    def _hooked(self, index: int, receive: Callable[[], None], check: Callable[[], None]):
        """The hook of a call in slot `index`: `check()`, then `receive()`, once."""
        self._unreceived[index] = True
        called = []

        def hook() -> None:
            if called:
                raise RuntimeError("a low-latency hook was called twice")
            check()
            receive()
            called.append(True)
            self._unreceived[index] = False
        return hook

    # -- calls ---------------------------------------------------------------------------
    def dispatch(self, shape: LowLatencyShape, x: torch.Tensor, topk_idx: torch.Tensor, *,
                 masked: tuple, round_scale: bool,
                 cumulative_stats: Optional[torch.Tensor], wait_stats: Optional[torch.Tensor],
                 return_recv_hook: bool, fresh_outputs: bool = False):
        """Send, and receive now or in the returned hook. With `fresh_outputs`, recv_x, its
        scales and recv_count are new tensors of this call (as a compiled op's outputs must
        be) instead of the slot's; the handle's tensors stay the slot's.

        Returns (recv_x or (fp8, scales), recv_count, handle, hook or None)."""
        device = x.device
        slots = self.slots(shape, device)
        index = self.take_slot()
        slot = slots[index]
        slot.dispatches += 1
        slot.num_tokens = x.shape[0]
        slot.peers = tuple(r for r in range(shape.num_ranks) if r not in masked)
        generation = slot.dispatches
        outputs = slot if not fresh_outputs else dataclasses.replace(
            slot, recv_x=torch.empty_like(slot.recv_x),
            scales=None if slot.scales is None else torch.empty_like(slot.scales),
            recv_count=torch.empty_like(slot.recv_count))
        receive = self._send_dispatch(shape, outputs, index, x, topk_idx, masked=masked,
                                      round_scale=round_scale,
                                      cumulative_stats=cumulative_stats, wait_stats=wait_stats)
        E_l = shape.num_local
        recv_x = outputs.recv_x[:E_l]
        if shape.use_fp8:
            recv_x = (recv_x, outputs.scales[:E_l].transpose(1, 2))
        handle = LowLatencyHandle((slot.src_info[:E_l], slot.layout_range, shape.max_tokens,
                                   shape.hidden, shape.num_experts), (shape, str(device)),
                                  index, generation)
        if not return_recv_hook:
            receive()
            return recv_x, outputs.recv_count, handle, None

        def check() -> None:
            if slot.dispatches != generation:
                raise RuntimeError("low_latency_dispatch's hook called after its buffer was "
                                   "cleaned")
        return recv_x, outputs.recv_count, handle, self._hooked(index, receive, check)

    def combine(self, shape: LowLatencyShape, x: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor, handle: LowLatencyHandle, *, masked: tuple,
                zero_copy: bool, out: Optional[torch.Tensor],
                wait_stats: Optional[torch.Tensor], return_recv_hook: bool,
                use_logfmt: bool = False):
        """Send the expert outputs back, and reduce now or in the returned hook.

        Returns (combined_x [T, H] bf16, hook or None)."""
        device = topk_weights.device
        slots = self.slots(shape, device)
        source = slots[handle.slot_index]
        if source.dispatches != handle.generation:
            raise RuntimeError("low_latency_combine: the handle's buffer was reused by a later "
                               "low-latency dispatch (at most two low-latency calls' results are "
                               "alive at once)")
        if self._unreceived[handle.slot_index]:
            raise RuntimeError("low_latency_combine before the hook of the handle's dispatch "
                               "(or of a later call in its buffer) was called")
        if zero_copy:
            x = self.zero_copy_buffer(shape, device)
        index = self.take_slot()
        T = topk_weights.shape[0]
        result = out if out is not None else slots[index].combined[:T]
        peers = tuple(r for r in source.peers if r not in masked)
        receive = self._send_combine(shape, slots[index], index, source, handle.slot_index,
                                     x, topk_idx, topk_weights, peers=peers, result=result,
                                     wait_stats=wait_stats, use_logfmt=use_logfmt,
                                     now=not return_recv_hook)
        if not return_recv_hook:
            receive()
            return result, None
        return result, self._hooked(index, receive, lambda: None)


class CollectiveLowLatency(LowLatencyTransport):
    """The portable low-latency transport: point-to-point messages over a process group.
    A gloo group carries CUDA tensors through host copies (a host sync per call)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(group)
        self._host_staged = dist.get_backend(group) == "gloo"

    def _agree(self, stage: str, fields: dict, peers: tuple, tag: int) -> None:
        """On a gloo group, before any message of the call moves: exchange `fields` (what the
        sizes and format of the call's messages follow from) with every live peer, point to
        point, and raise `EPMismatchError` naming the first field and peer that differ (every
        rank raises, the ranks stay in step). Messages of other sizes would abort the process
        inside gloo. (Over NCCL the host reads nothing: the ranks must agree.)"""
        if not self._host_staged:
            return
        mine = torch.tensor(list(fields.values()), dtype=torch.int64)
        theirs = [torch.empty_like(mine) for _ in range(self.num_ranks)]
        self._wait(self._exchange([(mine,)] * self.num_ranks, [(t,) for t in theirs], peers,
                                  tag), None)
        for peer in peers:
            if peer != self.rank and not torch.equal(theirs[peer], mine):
                name, ours, other = next((name, a, b) for name, a, b in zip(
                    fields, mine.tolist(), theirs[peer].tolist()) if a != b)
                raise errors.EPMismatchError(
                    f"rank {self.rank}: {stage}: rank {peer} called with {name}={other}, this "
                    f"rank with {ours}; every rank must make the same low-latency calls")

    def _make_messages(self, shape: LowLatencyShape, device: torch.device) -> _Messages:
        R, E_l, M, H, cap = (shape.num_ranks, shape.num_local, shape.max_tokens, shape.hidden,
                             shape.capacity)
        width = shape.payload_bytes
        return _Messages(
            send=torch.zeros((R * cap + 1, width), dtype=torch.uint8, device=device),
            recv=torch.zeros((R, cap, width), dtype=torch.uint8, device=device),
            send_counts=torch.zeros((R, E_l), dtype=torch.int32, device=device),
            recv_counts=torch.zeros((R, E_l), dtype=torch.int32, device=device),
            placed=torch.zeros(R * cap, dtype=torch.int64, device=device),
            slot_row=torch.full((M, shape.num_topk), -1, dtype=torch.int64, device=device),
            combine_send=torch.zeros((R, cap, H), dtype=torch.bfloat16, device=device),
            combine_recv=torch.zeros((R * cap, H), dtype=torch.bfloat16, device=device))

    # -- messages ------------------------------------------------------------------------
    def _exchange(self, sends: list, recvs: list, peers: tuple, tag: int) -> _Pending:
        """Issue the messages `sends[p]` to and `recvs[p]` from every peer `p` in `peers` (this
        rank copies its own). `tag` (the call kind and slot) keeps overlapping calls apart."""
        ops, owners, staged = [], [], []
        for peer in peers:
            if peer == self.rank:
                for send, recv in zip(sends[peer], recvs[peer]):
                    recv.copy_(send)
                continue
            for part, (send, recv) in enumerate(zip(sends[peer], recvs[peer])):
                if self._host_staged and send.is_cuda:
                    send, device_recv = send.cpu(), recv
                    recv = torch.empty(recv.shape, dtype=recv.dtype)
                    staged.append((device_recv, recv))
                message_tag = tag * 4 + part
                ops.append(dist.P2POp(dist.isend, send, peer, self.group, message_tag))
                ops.append(dist.P2POp(dist.irecv, recv, peer, self.group, message_tag))
                owners += [peer, peer]
        works = dist.batch_isend_irecv(ops) if ops else []
        return _Pending(list(zip(owners, works)), copy_back=staged)

    @staticmethod
    def _wait(pending: _Pending, stats: Optional[torch.Tensor]) -> None:
        """Wait for every message, in peer order. On CPU, add to `stats[p]` the host
        nanoseconds from issuing the call's messages until peer `p`'s had arrived (on CUDA the
        wait is stream-ordered, the host does not wait, and `stats` is left as is)."""
        timed = stats is not None and stats.device.type == "cpu"
        arrived: dict[int, int] = {}
        for peer, work in pending.works:
            work.wait()
            if timed:
                arrived[peer] = time.perf_counter_ns() - pending.started
        for peer, spent in arrived.items():
            stats[peer] += spent
        for target, received in pending.copy_back:
            target.copy_(received)

    def _send_dispatch(self, shape, slot, index, x, topk_idx, *, masked, round_scale,
                       cumulative_stats, wait_stats):
        self._agree("low_latency_dispatch", _message_fields(shape, 0, False), slot.peers,
                    tag=4 + index)
        messages = slot.messages
        self._pack_dispatch(shape, slot, x, topk_idx, masked, round_scale)
        cap, R = shape.capacity, shape.num_ranks
        sends = [(messages.send[p * cap:(p + 1) * cap], messages.send_counts[p])
                 for p in range(R)]
        recvs = [(messages.recv[p], messages.recv_counts[p]) for p in range(R)]
        for peer in masked:
            messages.recv_counts[peer].zero_()
        pending = self._exchange(sends, recvs, slot.peers, tag=index)

        def receive() -> None:
            self._wait(pending, wait_stats)
            self._unpack_dispatch(shape, slot, cumulative_stats)
        return receive

    @staticmethod
    def _pack_dispatch(shape: LowLatencyShape, slot: _Slot, x: torch.Tensor,
                       topk_idx: torch.Tensor, masked: tuple, round_scale: bool) -> None:
        """Fill the slot's dispatch messages, their counts and `slot_row` (no host sync)."""
        device = x.device
        T, K = topk_idx.shape
        R, E, E_l, cap = shape.num_ranks, shape.num_experts, shape.num_local, shape.capacity
        idx = topk_idx.long()
        valid = (idx >= 0) & (idx < E)
        expert = torch.where(valid, idx, 0)
        if masked:
            is_masked = torch.zeros(R, dtype=torch.bool, device=device)
            is_masked[list(masked)] = True
            valid &= ~is_masked[expert // E_l]
        # The first slot of each (token, expert) pair carries the row; repeats share it.
        same = (expert.unsqueeze(2) == expert.unsqueeze(1)) & valid.unsqueeze(1)
        earlier = torch.ones((K, K), dtype=torch.bool, device=device).tril(-1)
        repeat = (same & earlier).any(2)
        first = valid & ~repeat
        hits = torch.zeros((T + 1, E), dtype=torch.int64, device=device)
        hits[1:].scatter_add_(1, expert, first.long())
        before = hits.cumsum(0)                           # [T + 1, E]: rows of tokens < t
        position = before[:-1].gather(1, expert)          # token's rank among its expert's rows
        per_expert = before[-1].view(R, E_l)
        slot.messages.send_counts.copy_(per_expert)
        expert_start = per_expert.cumsum(1) - per_expert  # [R, E_l] within each message
        row = (expert // E_l) * cap + expert_start.view(-1)[expert] + position
        # Repeated slots point at their pair's first slot's row.
        first_of = torch.where(same & (earlier | torch.eye(K, dtype=torch.bool, device=device)),
                               torch.arange(K, device=device), K).amin(2)
        row = row.gather(1, first_of.clamp(max=K - 1))
        slot.messages.slot_row.fill_(-1)
        slot.messages.slot_row[:T] = torch.where(valid, row, -1)
        if shape.use_fp8:
            fp8, scales = cast_blocks_to_fp8(x, round_scale)
            data = torch.cat([fp8.view(torch.uint8), scales.view(torch.uint8)], dim=1)
        else:
            data = x.view(torch.uint8)
        meta = torch.stack([torch.remainder(expert, E_l),
                            torch.arange(T, device=device).unsqueeze(1).expand(T, K)], dim=2)
        records = torch.cat([data.unsqueeze(1).expand(T, K, data.shape[1]),
                             meta.to(torch.int32).view(torch.uint8)], dim=2)
        target = torch.where(first, row, R * cap)         # others go to the discard row
        slot.messages.send.index_copy_(0, target.view(-1), records.view(T * K, records.shape[2]))

    @staticmethod
    def _unpack_dispatch(shape: LowLatencyShape, slot: _Slot,
                         cumulative_stats: Optional[torch.Tensor]) -> None:
        """Place the received rows (source rank, then local expert, then token order within
        each message) into the expert-major outputs (no host sync)."""
        device = slot.recv_x.device
        R, E_l, M, H, cap = (shape.num_ranks, shape.num_local, shape.max_tokens, shape.hidden,
                             shape.capacity)
        counts = slot.messages.recv_counts.long()                  # [R (source), E_l]
        total = counts.sum(0)                             # [E_l]
        begin = counts.cumsum(0) - counts                 # [R, E_l] first row of each source
        slot.recv_count.copy_(total)
        slot.layout_range.copy_(((begin << 32) | counts).t())
        if cumulative_stats is not None:
            cumulative_stats += total.to(cumulative_stats.dtype)
        recv = slot.messages.recv.view(R * cap, -1)
        meta = recv[:, -8:].contiguous().view(torch.int32)   # [R * cap, 2]: expert, token
        source = torch.arange(R, device=device).repeat_interleave(cap)
        i = torch.arange(cap, device=device).repeat(R)
        expert = meta[:, 0].long().clamp(0, E_l - 1)
        in_message = counts.sum(1)[source]
        expert_start = (counts.cumsum(1) - counts)[source, expert]
        live = i < in_message
        out_row = begin[source, expert] + i - expert_start
        flat = torch.where(live, expert * (R * M) + out_row, E_l * (R * M))
        slot.messages.placed.copy_(flat)
        width = H if shape.use_fp8 else 2 * H
        rows = recv[:, :width].contiguous()
        slot.recv_x.view(-1, H).view(torch.uint8).view(-1, width).index_copy_(0, flat, rows)
        slot.src_info.view(-1).index_copy_(0, flat, meta[:, 1].contiguous())
        if shape.use_fp8:
            scales = recv[:, width:width + 4 * shape.num_scales].contiguous().view(torch.float32)
            if shape.use_ue8m0:
                scales = _ue8m0_words(scales)
            # scales live as [E_l + 1, S', R * M]: column `c` of row `flat` is at
            # (flat // (R * M), c, flat % (R * M)).
            plane = slot.scales.permute(0, 2, 1)          # [E_l + 1, R * M, S'] view
            e_of, j_of = flat // (R * M), flat % (R * M)
            plane[e_of, j_of] = scales

    def _send_combine(self, shape, slot, index, source, source_index, x, topk_idx,
                      topk_weights, *, peers, result, wait_stats, use_logfmt, now):
        self._agree("low_latency_combine", _message_fields(shape, 1, use_logfmt), peers,
                    tag=6 + index)
        R, cap, H = shape.num_ranks, shape.capacity, shape.hidden
        messages, sent = slot.messages, source.messages
        flat = sent.placed.clamp(max=shape.num_local * shape.rows - 1)
        rows = x.reshape(-1, H).index_select(0, flat)
        if use_logfmt:  # each peer's message: the first cap rows of LogFMT-10 bytes of its part
            width = logfmt.wire_bytes(H)
            send = messages.combine_send.view(R, -1).view(torch.uint8)[:, :cap * width]
            recv = messages.combine_recv.view(R, -1).view(torch.uint8)[:, :cap * width]
            logfmt.encode_rows(rows.view(R, cap, H), send.view(R, cap, width))
        else:
            send, recv = messages.combine_send, messages.combine_recv.view(R, cap, H)
            send.view(R * cap, H).copy_(rows)
        pending = self._exchange([(send[p],) for p in range(R)], [(recv[p],) for p in range(R)],
                                 peers, tag=2 + index)
        slot_row = sent.slot_row[:topk_weights.shape[0]]
        if len(peers) < len(source.peers):   # ranks masked since the dispatch: skip them
            owner = torch.where(slot_row >= 0, slot_row // cap, 0)
            alive = torch.zeros(R, dtype=torch.bool, device=slot_row.device)
            alive[list(peers)] = True
            slot_row = torch.where(alive[owner], slot_row, -1)

        def receive() -> None:
            self._wait(pending, wait_stats)
            rows = logfmt.decode_rows(recv.view(R, cap, -1), H).view(R * cap, H) \
                if use_logfmt else messages.combine_recv
            reduce_slots(rows, slot_row, topk_weights, result)
        return receive


def _message_fields(shape: LowLatencyShape, kind: int, use_logfmt: bool) -> dict:
    """What the sizes and format of a call's messages follow from (`kind`: 0 dispatch, 1
    combine)."""
    return {"call (0 dispatch, 1 combine)": kind,
            "num_max_dispatch_tokens_per_rank": shape.max_tokens, "hidden": shape.hidden,
            "num_experts": shape.num_experts, "num_topk": shape.num_topk,
            "use_fp8": int(shape.use_fp8), "use_ue8m0": int(shape.use_ue8m0),
            "use_logfmt": int(use_logfmt)}


def reduce_slots(rows: torch.Tensor, slot_row: torch.Tensor, topk_weights: torch.Tensor,
                 out: torch.Tensor) -> None:
    """`out[t] = bf16(acc)`, `acc = 0.0` (fp32), then for `k = 0..K-1` with
    `slot_row[t, k] >= 0`: `acc = acc + fp32(topk_weights[t, k] * fp32(rows[slot_row[t, k]]))`;
    a NaN result is the canonical bf16 NaN (docs/semantics.md, NaN).

    rows: [N, H] bf16; slot_row:
    [T, K] int64; topk_weights: [T, K] float32; out: [T, H] bf16, written in place."""
    T, K = slot_row.shape
    acc = torch.zeros((T, rows.shape[1]), dtype=torch.float32, device=rows.device)
    take = slot_row.clamp(min=0)
    for k in range(K):
        term = topk_weights[:, k:k + 1] * rows.index_select(0, take[:, k]).float()
        acc = acc + torch.where(slot_row[:, k:k + 1] >= 0, term, 0.0)
    canonical_nan_(out.copy_(acc.to(torch.bfloat16)))


@dataclass
class _HeapState:
    """The symmetric transport's memory for one shape: the heap, and per (kind, slot) the
    call count and the receiving kernel's finished-program count (local int64 [1] tensors;
    kind 0 dispatch, 1 combine)."""
    heap: SymmetricHeap
    layout: LowLatencyLayout
    epochs: list
    done: list


class SymmetricLowLatency(LowLatencyTransport):
    """The low-latency transport over peer memory (`SymmetricHeap`, one node): the kernels of
    `epcomm.kernels.low_latency`, two launches per call (send; receive, in the hook with
    `return_recv_hook`). In a group of one rank the dispatch is one launch that writes the
    outputs itself (its hook has nothing left to do), and a combine received right away is the
    reduce alone."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        super().__init__(group)
        self.timeout_s = timeout_s
        self._timeout = timeout_units(timeout_s)
        self._heaps: dict[tuple, _HeapState] = {}
        self._masks: dict[str, tuple] = {}   # device -> (masked ranks written, int32 [R])
        self._errors: dict[str, torch.Tensor] = {}
        self._dummies: dict[str, tuple] = {}

    def destroy(self) -> None:
        """Release every slot and unmap every heap."""
        super().destroy()
        for state in self._heaps.values():
            state.heap.destroy()
        self._heaps.clear()

    def _heap(self, shape: LowLatencyShape, device: torch.device) -> _HeapState:
        key = (shape, str(device))
        if key not in self._heaps:
            layout = LowLatencyLayout(num_ranks=shape.num_ranks, num_local=shape.num_local,
                                      max_tokens=shape.max_tokens, num_topk=shape.num_topk,
                                      hidden=shape.hidden, payload=shape.payload_bytes - 8)
            counter = [[torch.zeros(1, dtype=torch.int64, device=device) for _ in range(2)]
                       for _ in range(2)]
            done = [[torch.zeros(1, dtype=torch.int64, device=device) for _ in range(2)]
                    for _ in range(2)]
            self._heaps[key] = _HeapState(SymmetricHeap(self.group, layout.total, device),
                                          layout, counter, done)
        return self._heaps[key]

    def _device_tensors(self, device: torch.device, masked: tuple):
        """(mask [R] int32 holding `masked`, error flag [1] int32, dummy int32 [R + 1] and
        int64 [R] for absent stats) of `device`."""
        name = str(device)
        if name not in self._errors:
            self._errors[name] = torch.zeros(1, dtype=torch.int32, device=device)
            self._masks[name] = ((), torch.zeros(self.num_ranks, dtype=torch.int32,
                                                 device=device))
            self._dummies[name] = (torch.zeros(1, dtype=torch.int32, device=device),
                                   torch.zeros(self.num_ranks, dtype=torch.int64, device=device))
        written, mask = self._masks[name]
        if written != masked:
            mask.copy_(torch.tensor([int(r in masked) for r in range(self.num_ranks)],
                                    dtype=torch.int32))
            self._masks[name] = (masked, mask)
        return mask, self._errors[name], self._dummies[name]

    def check_errors(self, device: torch.device) -> None:
        """Raise `EPTimeoutError` (and clear the flag) if a kernel on `device` timed out
        waiting for a peer (reads the flag back: a host sync)."""
        flag = self._errors.get(str(device))
        if flag is None:
            return
        bits = int(flag.item())
        if bits:
            flag.zero_()
            raise errors.EPTimeoutError(
                f"rank {self.rank}: low-latency {errors.describe_flags(bits)} "
                f"(timeout_s={self.timeout_s}, wall-clock); the buffer is out of step: make a "
                "new one")

    def _common(self, shape: LowLatencyShape, state: _HeapState, mask, error) -> dict:
        # ALIGN: heap rows of bf16 start on 16 bytes when H is a multiple of 8.
        return dict(bases_ptr=state.heap.bases, rank=self.rank, num_ranks=shape.num_ranks,
                    num_local=shape.num_local, hidden=shape.hidden, num_topk=shape.num_topk,
                    mask_ptr=mask, error_ptr=error, timeout=self._timeout,
                    BLOCK_R=next_power_of_2(shape.num_ranks),
                    ALIGN=16 if shape.hidden % 8 == 0 else 2, SCOPE=state.heap.scope)

    @staticmethod
    def _tile(shape: LowLatencyShape, kernel) -> tuple[int, dict]:
        """(`kernel`'s programs per row, its tile arguments)."""
        tile = (CPU_TILES if INTERPRET else GPU_TILES)[kernel.__name__]
        parts = -(-shape.hidden // tile.block_c)
        args = dict(num_parts=parts, BLOCK_C=tile.block_c, num_warps=tile.num_warps)
        if kernel is ll_combine_send:
            args["ROWS"] = tile.rows
        return parts, args

    def _send_dispatch(self, shape, slot, index, x, topk_idx, *, masked, round_scale,
                       cumulative_stats, wait_stats):
        device = x.device
        state = self._heap(shape, device)
        mask, error, (dummy32, dummy64) = self._device_tensors(device, masked)
        layout = state.layout
        own_rows_off = layout.own_rows(index)
        M = shape.max_tokens
        scales = slot.scales
        if scales is None:
            scales = dummy32
        elif shape.use_ue8m0:
            scales = scales.view(torch.uint8)
        recv_x = slot.recv_x.view(torch.uint8 if shape.use_fp8 else torch.int16)
        outputs = dict(recv_x_ptr=recv_x, scales_ptr=scales, num_scale_cols=shape.scale_columns,
                       src_info_ptr=slot.src_info, slot_ptr=slot.recv_slot,
                       count_ptr=slot.recv_count, range_ptr=slot.layout_range,
                       stats_ptr=dummy32 if cumulative_stats is None else cumulative_stats,
                       has_stats=int(cumulative_stats is not None), USE_FP8=shape.use_fp8,
                       USE_UE8M0=shape.use_ue8m0, BLOCK_K=next_power_of_2(shape.num_topk))
        if shape.num_ranks == 1:  # nothing to wait for: one launch, nothing left to receive
            parts, tile = self._tile(shape, ll_dispatch_local)
            # (8 experts a counting program: an [8, M, K] comparison, 8K elements at M = 128)
            ll_dispatch_local[(M * parts + -(-shape.num_local // 8),)](
                **tile, **outputs, bases_ptr=state.heap.bases, x_ptr=x.view(torch.int16),
                idx_ptr=topk_idx, num_tokens=x.shape[0], num_experts=shape.num_experts,
                num_local=shape.num_local, max_tokens=M, hidden=shape.hidden,
                num_topk=shape.num_topk, mask_ptr=mask, own_rows_off=own_rows_off,
                ROUND_SCALE=round_scale, BLOCK_T=next_power_of_2(M), BLOCK_E=8)
            return lambda: None
        ntok, counts, records, payloads = layout.dispatch(index)
        common = self._common(shape, state, mask, error)
        offsets = dict(arrive_off=layout.counters(index, 0), free_off=layout.counters(index, 1),
                       ntok_off=ntok, counts_off=counts, records_off=records,
                       payload_off=payloads, payload_stride=layout.payload_stride)
        parts, tile = self._tile(shape, ll_dispatch_send)
        senders = M * (parts + 1)  # (each token's parts and its routing program)
        ll_dispatch_send[(senders,)](
            **common, **tile, **offsets, x_ptr=x.view(torch.int16), idx_ptr=topk_idx,
            num_tokens=x.shape[0], num_experts=shape.num_experts, max_tokens=M,
            epoch_ptr=state.epochs[0][index], USE_FP8=shape.use_fp8, ROUND_SCALE=round_scale,
            BLOCK_T=next_power_of_2(M), BLOCK_K=next_power_of_2(shape.num_topk))

        def receive() -> None:
            parts, tile = self._tile(shape, ll_dispatch_recv)
            ll_dispatch_recv[(shape.num_ranks * M * parts,)](
                **common, **tile, **offsets, **outputs, max_tokens=M, senders=senders,
                own_rows_off=own_rows_off, epoch_ptr=state.epochs[0][index],
                done_ptr=state.done[0][index],
                wait_ptr=dummy64 if wait_stats is None else wait_stats,
                has_wait=int(wait_stats is not None), BLOCK_E=next_power_of_2(shape.num_local))
            if device.type == "cpu":
                self.check_errors(device)
        return receive

    def _send_combine(self, shape, slot, index, source, source_index, x, topk_idx,
                      topk_weights, *, peers, result, wait_stats, use_logfmt, now):
        device = topk_weights.device
        state = self._heap(shape, device)
        masked = tuple(r for r in range(shape.num_ranks) if r not in peers)
        mask, error, (_, dummy64) = self._device_tensors(device, masked)
        layout = state.layout
        common = self._common(shape, state, mask, error)
        # Received right away, the rows this rank owns skip the heap: the reduce reads them
        # from x, which nothing can change in between (not with LogFMT, whose rows the
        # reduce decodes), at the rows the dispatch's receive noted.
        direct = int(now and not use_logfmt)
        offsets = dict(arrive_off=layout.counters(index, 2), free_off=layout.counters(index, 3),
                       rows_off=layout.combine(index), direct=direct)
        parts, tile = self._tile(shape, ll_combine_send)
        senders = shape.num_local * parts
        x = x.contiguous().view(torch.int16)
        if not direct or any(r != self.rank for r in peers):
            ll_combine_send[(senders * shape.num_ranks,)](
                **common, **tile, **offsets, max_tokens=shape.max_tokens,
                epoch_ptr=state.epochs[1][index],
                x_ptr=x, src_info_ptr=source.src_info,
                slot_ptr=source.recv_slot, range_ptr=source.layout_range,
                LOGFMT=use_logfmt)

        def receive() -> None:
            parts, tile = self._tile(shape, ll_combine_reduce)
            reduce_common = dict(common)
            if x.data_ptr() % 16:  # the reduce reads rows of x: hint their alignment
                reduce_common["ALIGN"] = 2
            ll_combine_reduce[(shape.max_tokens * parts,)](
                **reduce_common, **tile, **offsets, senders=senders,
                own_rows_off=layout.own_rows(source_index),
                num_tokens=topk_weights.shape[0],
                num_experts=shape.num_experts, max_tokens=shape.max_tokens,
                epoch_ptr=state.epochs[1][index],
                done_ptr=state.done[1][index], x_ptr=x, idx_ptr=topk_idx,
                weights_ptr=topk_weights,
                out_ptr=result.view(torch.int16),
                wait_ptr=dummy64 if wait_stats is None else wait_stats,
                has_wait=int(wait_stats is not None),
                BLOCK_K=next_power_of_2(shape.num_topk), LOGFMT=use_logfmt,
                enable_fp_fusion=False)
            if device.type == "cpu":
                self.check_errors(device)
        return receive
