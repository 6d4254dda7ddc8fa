"""Portable backend over `torch.distributed.all_to_all_single` (gloo on CPU, NCCL on GPU).

Every call moves one all-to-all of byte rows per direction. The send buffer is a block per
destination rank: a header row, then one record row per token sent there. A dispatch record is
`[payload bytes | src_rank * M + src_token + 1 | expert ids + 1 (K) | weights (K)]` (int32 and
fp32 words; 0 in the id fields: nothing), a combine record `[bf16 row | weights (K)]`. The
header (int64 words, `errors.CALL_FIELDS` then the block's row count) is what the call depends
on: the receiver compares it with its own call, so ranks that disagree are caught instead of
exchanging garbage.

- `do_cpu_sync=True`: the headers travel first in a small all-to-all (the count exchange), are
  read on the host and checked (a mismatch raises `EPMismatchError` on every rank before the
  payload moves), then an exact-split all-to-all moves the real rows.
- `do_cpu_sync=False`: every block has `M` record rows; the receiver takes the row counts from
  the header rows and checks the other fields on the device (a mismatch sets CALL_MISMATCH or
  OUT_OF_STEP for `check_errors()`). Nothing is read back to the host and every shape follows
  from M, R, K and E, so over NCCL the call is sync-free and can be captured in a CUDA graph.
- On a gloo group (the transport runs on the host anyway) every call, a cached dispatch too,
  exchanges and checks its headers on the host first: gloo aborts the process when the sizes
  of an all-to-all disagree. Its waits use the buffer's `timeout_s`, wall-clock; CUDA tensors
  are staged through host memory. With the counts on the host, a sync-free dispatch there
  (torch path) moves exact splits too; its outputs keep the capacity shapes.
- Over NCCL only the headers in the payload are checked, on the device: ranks whose calls
  differ in a field that sets the all-to-all's size (M, the dtype) are undefined behaviour of
  NCCL before the flag can say so.

A timeout or a lost peer leaves the ranks out of step: it raises `EPTimeoutError` or
`EPPeerLostError` (naming the stage), and every later call raises `EPBrokenError` naming it.

The receiver gathers each output straight from the received rows (a zero row past the end
stands for padding), so a dispatch costs one pass to pack, the all-to-all and one pass per
output; a combine one pass to reduce and pack, the all-to-all and the reduction on the source.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .. import errors
from ..handle import EPHandle
from ..layout import (SendLayout, compute_expert_layout, compute_send_layout, expand_capacity,
                      last_slot_per_rank)
from ..nan import canonical_nan_
from .base import Backend, BufferConfig, CombineRequest, DispatchRequest, DispatchResult


def kernel_rows(rows: Sequence[torch.Tensor], hidden: int) -> bool:
    """Whether the kernel path takes payload tensors `rows`: every row a whole number of int32
    words, and hidden even (combine rows as words)."""
    return hidden % 2 == 0 and all(
        math.prod(row.shape[1:]) * row.element_size() % 4 == 0 for row in rows)

_NUM_FIELDS = len(errors.CALL_FIELDS)
_HEADER_WORDS = _NUM_FIELDS + 1        # the fields, then the block's record count
_SEQ = errors.CALL_FIELDS.index("call sequence number")
_COUNT = _NUM_FIELDS
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)
# Transport errors of a lost peer (gloo's texts; the OS's for a closed socket).
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "connection refused", "econnreset", "epipe", "socket closed")


def _as_words(*spans: tuple[torch.Tensor, int, int]) -> list[torch.Tensor]:
    """For each `(tensor, begin, end)`: bytes [begin, end) of every row of the tensor (bytes
    contiguous within a row) as a strided [rows, n] view, all in the widest integer word that
    tiles every span (a gather of 8-byte words is several times faster than a byte-wise or
    bf16 one on CPU)."""
    rows = [(_row_bytes(tensor), begin, end) for tensor, begin, end in spans]
    word = next(w for w in _WORDS if all(
        (begin % w.itemsize, end % w.itemsize, row.shape[1] % w.itemsize,
         row.storage_offset() % w.itemsize) == (0, 0, 0, 0) for row, begin, end in rows))
    size = word.itemsize
    return [row.view(word)[:, begin // size:end // size] for row, begin, end in rows]


def _row_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor with contiguous rows as [T, n * itemsize] uint8 (a view)."""
    if tensor.stride(-1) != 1:  # a [T, 1] tensor may carry any stride in its last dimension
        tensor = tensor.flatten().view(tensor.shape)
    return tensor.view(torch.uint8).view(tensor.shape[0],
                                         math.prod(tensor.shape[1:]) * tensor.element_size())


@dataclass(frozen=True)
class _Record:
    """Byte offsets of the fields of one row: payload (begin, end) per payload tensor; the
    int32 meta words from byte `meta`; `nbytes` per row (a multiple of 16, so that rows start
    on vector boundaries; at least the header, which fills the first row of each block)."""

    payload: tuple[tuple[int, int], ...]
    meta: int
    meta_words: int
    nbytes: int

    @staticmethod
    def of(payload_bytes: Sequence[int], meta_words: int) -> "_Record":
        spans, offset = [], 0
        for nbytes in payload_bytes:
            spans.append((offset, offset + nbytes))
            offset += nbytes
        meta = offset + -offset % 4
        nbytes = max(meta + 4 * meta_words, 8 * _HEADER_WORDS)
        return _Record(tuple(spans), meta, meta_words, nbytes + -nbytes % 16)

    @property
    def meta_end(self) -> int:
        return self.meta + 4 * self.meta_words


@dataclass
class _Blocks:
    """The blocks of one side of an all-to-all: per rank a header row, then its records.

    counts: [R] int64 device, records per block; start: [R] int64 device, the header row of
    each block; rows: total rows (host int); splits: rows per block (host; exact-split calls
    only, None for the padded blocks of M records of a sync-free call over NCCL).
    """

    counts: torch.Tensor
    start: torch.Tensor
    rows: int
    splits: Optional[list[int]]

    @staticmethod
    def exact(counts: torch.Tensor, splits: list[int]) -> "_Blocks":
        sizes = counts + 1
        return _Blocks(counts, sizes.cumsum(0) - sizes, sum(splits) + len(splits),
                       [n + 1 for n in splits])

    @staticmethod
    def padded(counts: torch.Tensor, max_tokens: int) -> "_Blocks":
        num_ranks = counts.shape[0]
        start = torch.arange(num_ranks, device=counts.device) * (max_tokens + 1)
        return _Blocks(counts, start, num_ranks * (max_tokens + 1), None)

    def record_rows(self, num_rows: int, missing: int) -> torch.Tensor:
        """[num_rows] int64: the row of the n-th record counted over the blocks in rank
        order; `missing` for n past the last record."""
        psum = self.counts.cumsum(0)
        n = torch.arange(num_rows, device=psum.device)
        block = torch.searchsorted(psum, n, right=True)
        inside = block < psum.shape[0]
        block = block.clamp(max=psum.shape[0] - 1)
        row = self.start[block] + 1 + n - (psum[block] - self.counts[block])
        return torch.where(inside, row, missing)


def _header_words(buf: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """[R, _HEADER_WORDS] int64: where in the flat int64 words of the [rows, nbytes] byte
    buffer `buf` the header of each block (first rows `start`) lies."""
    offsets = torch.arange(_HEADER_WORDS, device=start.device)
    return (start * (buf.shape[1] // 8)).view(-1, 1) + offsets


def _read_headers(buf: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """[R, _HEADER_WORDS] int64: the header of each block of `buf`."""
    return buf.view(torch.int64).view(-1)[_header_words(buf, start)]


def _write_headers(buf: torch.Tensor, start: torch.Tensor, rows: torch.Tensor) -> None:
    """Write `rows` ([R, _HEADER_WORDS] int64) as the header of each block of `buf`."""
    buf.view(torch.int64).view(-1).index_copy_(0, _header_words(buf, start).flatten(),
                                               rows.flatten())


class _Workspace:
    """Scratch tensors kept across calls on CPU, where a fresh large tensor costs a page fault
    per 4 KB written (the allocator gives large blocks back to the system); on a GPU the
    caching allocator reuses memory already (and a CUDA graph keeps what it captured), so there
    every call allocates. Each name is one buffer: a call must be done with a tensor before it
    asks for the same name again."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def tensor(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of `shape` and `dtype` (the buffer `name`, on CPU)."""
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=self.device)
        size = math.prod(shape) * dtype.itemsize
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < size:
            buffer = self.buffers[name] = torch.empty(size, dtype=torch.uint8)
        return buffer[:size].view(dtype).view(shape)

    def rows(self, name: str, num_rows: int, nbytes: int) -> torch.Tensor:
        """An uninitialised [num_rows, nbytes] uint8 tensor."""
        return self.tensor(name, (num_rows, nbytes), torch.uint8)

    def copy_rows(self, source: torch.Tensor, rows: torch.Tensor, target: torch.Tensor,
                  skip: int, write_skipped: bool) -> None:
        """`target[i] = source[rows[i]]` ([rows, n] integer words); rows equal to `skip` (the
        zero row) may be left unwritten unless `write_skipped`. On the device every row is
        written (one pass, no shape from the data); on CPU, where most rows are skipped
        (alignment gaps of an expand output), only the others: a fresh output's untouched
        pages cost nothing."""
        if not write_skipped and self.device.type == "cpu":
            present = (rows != skip).nonzero().squeeze(1)
            if 2 * present.shape[0] < rows.shape[0]:
                temp = self.tensor("rows", (present.shape[0], source.shape[1]), source.dtype)
                target.index_copy_(0, present, torch.index_select(source, 0, rows[present],
                                                                  out=temp))
                return
        torch.index_select(source, 0, rows, out=target)

    def place_rows(self, source: torch.Tensor, rows: torch.Tensor, target: torch.Tensor) -> None:
        """`target[rows[i]] = source[i]` (a row named twice gets one of its sources); the rows
        of `target` that `rows` does not name are left with unspecified content. On CPU a
        gather through the inverse map: `index_copy_` there costs about 5x `index_select`
        per row (512 rows of 14 KB, one thread: 1.23 ms against 0.22 ms)."""
        if self.device.type != "cpu":
            target.index_copy_(0, rows, source)
        elif source.shape[0] > 0:
            inverse = torch.zeros(target.shape[0], dtype=torch.int64).index_put_(
                (rows,), torch.arange(rows.shape[0]))
            torch.index_select(source, 0, inverse, out=target)

    def gather_sum(self, words: torch.Tensor, index: torch.Tensor,
                   biases: Sequence[torch.Tensor], out: torch.Tensor,
                   target_rows: Optional[torch.Tensor] = None,
                   zero_row: Optional[int] = None, canonical_nan: bool = True) -> None:
        """Row sums: for n < N, `out[target_rows[n]] = bf16(acc)` (`out[n]` without
        target_rows), `acc = 0.0 + biases[0][n] + ... + row(index[n, 0]) + row(index[n, 1])
        + ...` in fp32, in that order, where `row(i)` is row i of the bf16 rows `words`
        ([rows, 2H] bytes as integer words); entries of `index` ([N, W] int64) below 0 are
        skipped. With `canonical_nan`, a NaN result is the canonical bf16 NaN 0x7FC0 (not
        needed for a sum that is summed again). `out`: bf16 [*, H], may be a strided view;
        with target_rows, its rows not named there get unspecified content (`place_rows`).

        A skipped entry adds nothing, as adding +0.0 would: `acc` starts at +0.0 and so is
        never -0.0. On the device every entry costs a pass of fixed shape: a skipped one reads
        `zero_row` (a row of zeros) if given, else is masked. On CPU only the entries that are
        there are read: rows are ordered by their number of entries, so that pass j adds to a
        prefix."""
        num_rows, width = index.shape
        hidden = out.shape[1]
        present = index >= 0
        if self.device.type == "cpu":
            counts = present.sum(1)
            row_order = torch.sort(counts, descending=True, stable=True).indices
            firsts = torch.sort((~present).to(torch.uint8), dim=1, stable=True).indices
            index = index.gather(1, firsts).index_select(0, row_order)
            lengths = (counts[row_order].view(-1, 1) > torch.arange(width)).sum(0).tolist()
            target_rows = row_order if target_rows is None else target_rows[row_order]
        else:
            row_order, lengths = None, [num_rows] * width
        acc = self.tensor("sum", (num_rows, hidden), torch.float32).zero_()
        for bias in biases:
            acc.add_((bias if row_order is None else bias.index_select(0, row_order)).float())
        for column, length in zip(index.unbind(1), lengths):
            if length == 0:
                break
            column = column[:length]
            read = column
            if row_order is None:
                read = column.clamp(min=0) if zero_row is None else \
                    torch.where(column >= 0, column, zero_row)
            part = torch.index_select(words, 0, read, out=self.tensor(
                "part", (length, words.shape[1]), words.dtype))
            if row_order is None and zero_row is None:  # skipped entries read row 0: zero them
                part.bitwise_and_(torch.where(column >= 0, -1, 0).to(part.dtype).view(-1, 1))
            wide = self.tensor("wide", (length, hidden), torch.float32)
            acc[:length].add_(wide.copy_(part.view(torch.bfloat16)))
        result = self.tensor("result", (num_rows, hidden), torch.bfloat16).copy_(acc)
        # (on CPU a sum shows whether there is any NaN at all: one read instead of two passes)
        if canonical_nan and (self.device.type != "cpu" or bool(acc.sum().isnan())):
            canonical_nan_(result)
        if target_rows is None:
            out.copy_(result)
        else:
            self.place_rows(result, target_rows, out)


@dataclass
class _CollectiveState:
    """What combine and cached dispatch reuse (device tensors int64).

    send: this rank's routing. sent / received: the blocks of the dispatch's send and receive
        buffers (a combine sends along `received` and receives along `sent`).
    token_of_row: [sent.rows] the token each send row packs (0 for header and padding rows).
    recv_row: [rows] the received row of each compact output row (`received.rows`, the zero
        row past the end, for rows past the valid prefix).
    expand_pair: [expanded rows] the (compact row * K + slot) pair of each expand row, -1 for
        gaps; None in the compact layout.
    """

    send: SendLayout
    sent: _Blocks
    received: _Blocks
    token_of_row: torch.Tensor
    recv_row: Optional[torch.Tensor] = None
    expand_pair: Optional[torch.Tensor] = None


class CollectiveBackend(Backend):
    name = "collective"

    def __init__(self, group: dist.ProcessGroup, config: BufferConfig,
                 kernels: Optional[bool] = None) -> None:
        """`kernels`: pack and unpack with the Triton kernels of `collective_kernels` (None:
        with CUDA tensors; True also runs them on CPU tensors,
        through the Triton interpreter); otherwise with torch operations."""
        super().__init__(config)
        self.group = group
        self.timeout = timedelta(seconds=config.timeout_s)
        device = self.device
        pg_backend = dist.get_backend(group)
        self._host_transport = pg_backend == "gloo" or device.type == "cpu"
        self._stage_on_host = device.type == "cuda" and pg_backend == "gloo"
        self._flags = torch.zeros((), dtype=torch.int32, device=device)
        self._seq = torch.zeros((), dtype=torch.int64, device=device)  # calls so far
        self._headers: dict[tuple, torch.Tensor] = {}
        self._failure: Optional[str] = None
        self._workspace = _Workspace(device)
        # gloo takes an operation's timeout from its group's options: set to the buffer's
        # timeout around each operation where this torch exposes them
        options = getattr(group._get_backend(torch.device("cpu")), "options", None) \
            if self._host_transport else None
        self._sets_op_timeout = getattr(options, "_timeout", None) is not None
        self._kernels = None
        if kernels is None:
            kernels = device.type == "cuda"
        if kernels:
            from .collective_kernels import KernelPath  # (Triton: an optional dependency)
            self._kernels = KernelPath(self)
            self.input_alignment = 16

    def error_flags(self) -> torch.Tensor:
        return self._flags

    def destroy(self) -> None:
        """Drop the kernel path's prepared calls and the CUDA graphs they keep (their fixed
        buffers), once the device has run every call queued so far (a replay on another stream
        than the one its buffers were allocated on may still read them)."""
        if self._kernels is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._kernels.plans.clear()
            self._kernels.combine_plans.clear()
            self._kernels = None

    def prepared_dispatch(self, key):
        return None if self._kernels is None else self._kernels.prepared(key)

    # -- transport -------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._failure is not None:
            raise errors.EPBrokenError(
                f"rank {self.rank}: the collective backend is out of step with its peers since "
                f"an earlier failure ({self._failure}); destroy the buffer and make a new "
                "process group and buffer")

    def _fail(self, stage: str, exc: BaseException) -> errors.EPError:
        """The epcomm error for a transport failure in `stage`; marks the backend broken."""
        text = str(exc)
        lower = text.lower()
        others = [r for r in range(self.num_ranks) if r != self.rank]
        peer = f" (peer: rank {others[0]})" if len(others) == 1 else ""
        if "timed out" in lower or "timeout" in lower:
            applied = f"{self.config.timeout_s:g} s" if self._sets_op_timeout else \
                f"{self.config.timeout_s:g} s or the process group's timeout if shorter"
            message = (f"rank {self.rank}: {stage} timed out after {applied} waiting for its "
                       f"peers ({text.strip()})")
            error = errors.EPTimeoutError(message)
        elif any(key in lower for key in _PEER_LOST):
            message = f"rank {self.rank}: {stage}: lost a peer{peer} ({text.strip()})"
            error = errors.EPPeerLostError(message)
        else:
            message = f"rank {self.rank}: {stage}: the transport failed ({text.strip()})"
            error = errors.EPPeerLostError(message)
        self._failure = message
        return error

    def _all_to_all(self, stage: str, out: torch.Tensor, inp: torch.Tensor,
                    out_splits: Optional[list[int]] = None,
                    in_splits: Optional[list[int]] = None) -> torch.Tensor:
        """`all_to_all_single` along dim 0 into `out` (equal blocks when the splits are None).

        On a host transport the wait is bounded by the buffer's timeout, wall-clock: gloo takes
        the timeout of an operation from its group when the operation is made, so the group's
        default is set to the buffer's for that moment."""
        source = inp.cpu() if self._stage_on_host else inp
        target = torch.empty(out.shape, dtype=out.dtype) if self._stage_on_host else out
        try:
            if self._host_transport:
                backend = self.group._get_backend(torch.device("cpu"))
                previous = backend.options._timeout if self._sets_op_timeout else self.timeout
                if previous != self.timeout:
                    backend._set_default_timeout(self.timeout)
                try:
                    work = dist.all_to_all_single(target, source, out_splits, in_splits,
                                                  group=self.group, async_op=True)
                finally:
                    if previous != self.timeout:
                        backend._set_default_timeout(previous)
                work.wait(self.timeout)
            else:  # NCCL: the stream waits for the work; the host does not. (Not async_op:
                # with fresh tensors on a side stream that costs 40-55 us more host time per
                # call, H100, torch 2.11.)
                dist.all_to_all_single(target, source, out_splits, in_splits, group=self.group)
        except RuntimeError as exc:  # (DistBackendError is one)
            raise self._fail(stage, exc) from None
        if self._stage_on_host:
            out.copy_(target)
        return out

    def _header(self, call: int, sync: bool, num_experts: int, max_tokens: int, expand: bool,
                row_bytes: int, has_weights: bool) -> torch.Tensor:
        """[_NUM_FIELDS - 1] int64 on the device: the call's fields after the sequence number
        (made once per call shape with fills, so no host-to-device copy)."""
        values = (call, int(sync), num_experts, max_tokens, int(expand), row_bytes,
                  self.config.hidden, self.config.num_topk, int(has_weights))
        header = self._headers.get(values)
        if header is None:
            header = torch.empty(len(values), dtype=torch.int64, device=self.device)
            for index, value in enumerate(values):
                header[index].fill_(value)
            self._headers[values] = header
        return header

    def _header_rows(self, header: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """[R, _HEADER_WORDS] int64: this call's header for each destination (its record count
        last); advances the call sequence number."""
        self._seq.add_(1)
        R = self.num_ranks
        return torch.cat([self._seq.expand(R, 1), header.expand(R, header.shape[0]),
                          counts.view(R, 1)], dim=1)

    def _dispatch_exchange(self, sync: bool, cached: Optional[EPHandle]) -> Optional[str]:
        """The stage name of a dispatch's header exchange on the host, where it has one: the
        host reads the headers where it needs the counts (a synchronizing call over exact
        blocks without a handle, `cached` None) or runs the transport anyway (gloo). None
        otherwise (NCCL, sync-free, over padded blocks or cached: the headers travel with the
        records and are checked on the device)."""
        if sync and cached is None:
            return "dispatch (count exchange)"
        return "dispatch (header exchange)" if self._host_transport else None

    def _exchange_headers(self, stage: str, rows: torch.Tensor,
                          ) -> tuple[torch.Tensor, list[list[int]]]:
        """All-to-all of the header rows, read and checked on the host: the rows received
        (row r from rank r, on the device) and their values (each source's header, its count
        last, then any words after it). Raises EPMismatchError naming the field and the
        ranks."""
        rows = self._all_to_all(stage, torch.empty_like(rows), rows)
        received = rows.tolist()
        mine = received[self.rank]  # (this rank's own header, fields as sent to every rank)
        for field, name in enumerate(errors.CALL_FIELDS):
            values = [header[field] for header in received]
            if any(value != mine[field] for value in values):
                ranks = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
                error = errors.EPMismatchError(
                    f"rank {self.rank}: {stage}: the ranks' calls differ in {name} ({ranks}); "
                    "every rank must make the same calls with the same arguments")
                if field == _SEQ:  # a rank skipped or repeated a call: out of step for good
                    self._failure = str(error)
                raise error
        return rows, received

    def _check_headers(self, buf: torch.Tensor, blocks: _Blocks, expected: torch.Tensor) -> None:
        """Compare the header of every received block with `expected` ([_HEADER_WORDS], this
        call's; the count is not compared) on the device: OUT_OF_STEP for the sequence
        number, CALL_MISMATCH for another field, and the first such peer, go to the flag."""
        got = _read_headers(buf, blocks.start)
        differs = got[:, :_NUM_FIELDS] != expected[:_NUM_FIELDS]
        any_peer = differs.any(1)
        bits = differs[:, _SEQ].any().int() * errors.OUT_OF_STEP + \
            differs[:, _SEQ + 1:].any().int() * errors.CALL_MISMATCH
        peer = (torch.argmax(any_peer.int()) + 1).int() << errors.MISMATCH_PEER_SHIFT
        first = any_peer.any() & ((self._flags >> errors.MISMATCH_PEER_SHIFT) == 0)
        self._flags.bitwise_or_(bits | first.int() * peer)

    # -- dispatch --------------------------------------------------------------------------
    def dispatch(self, request: DispatchRequest) -> DispatchResult:
        self._check_usable()
        R, me, M, E = self.num_ranks, self.rank, request.num_max_tokens_per_rank, request.num_experts
        topk_idx = request.topk_idx
        num_tokens, num_topk = topk_idx.shape
        sync, cached = request.do_cpu_sync, request.cached
        has_weights = request.topk_weights is not None
        record = _Record.of([_row_bytes(t).shape[1] for t in request.rows],
                            1 + num_topk * (2 if has_weights else 1))
        header = self._header(0, sync, E, M, request.do_expand, record.meta, has_weights)
        if self._kernels is not None and kernel_rows(request.rows, self.config.hidden):
            return self._kernels.dispatch(request, record, header)
        exchange = self._dispatch_exchange(request.do_cpu_sync, request.cached)
        if cached is not None:
            state: _CollectiveState = cached.backend_state
            send, sent = state.send, state.sent
            rows = self._header_rows(header, sent.counts)
        else:
            send = compute_send_layout(topk_idx, E, R)
            out_of_range = ((topk_idx < -1) | (topk_idx >= E)).any()
            self._flags.bitwise_or_(out_of_range.int() * errors.INVALID_EXPERT_ID)
            rows = self._header_rows(header, send.send_counts)
        if exchange:
            _, table = self._exchange_headers(exchange, rows)
        if cached is None:
            if exchange:  # the counts are on the host: exact splits, sync-free calls too
                recv_splits = [source[_COUNT] for source in table]
                sent = _Blocks.exact(send.send_counts, send.send_counts.tolist())
                received = _Blocks.exact(torch.tensor(recv_splits, device=self.device),
                                         recv_splits)
            else:
                sent = _Blocks.padded(send.send_counts, M)
            token_of_row = torch.zeros(sent.rows + 1, dtype=torch.long, device=self.device)
            destination = torch.where(send.send_pos >= 0, sent.start + 1 + send.send_pos,
                                      sent.rows)
            token_of_row.scatter_(0, destination.flatten(),
                                  torch.arange(num_tokens, device=self.device)
                                  .repeat_interleave(R))
            state = _CollectiveState(send, sent, None, token_of_row[:sent.rows])

        # Pack: one gather per field, straight into the send rows; then the headers.
        send_buf = self._workspace.rows("send", sent.rows, record.nbytes)
        if num_tokens:
            expert_ids = torch.where(send.slot_rank >= 0, topk_idx.long() + 1, 0).int()
            src = (torch.arange(num_tokens, device=self.device, dtype=torch.int32)
                   + (me * M + 1)).view(-1, 1)
            meta = [src, expert_ids]
            if has_weights:
                meta.append(request.topk_weights.float().view(torch.int32))
            fields = [(tensor, span) for tensor, span in zip(request.rows, record.payload)]
            fields.append((torch.cat(meta, dim=1), (record.meta, record.meta_end)))
            for tensor, (begin, end) in fields:
                column, source = _as_words((send_buf, begin, end), (tensor, 0, end - begin))
                torch.index_select(source, 0, state.token_of_row, out=column)
        _write_headers(send_buf, sent.start, rows)

        if cached is not None:
            received = state.received
        exact = sent.splits is not None
        recv_rows = received.rows if exact else R * (M + 1)
        recv_buf = self._workspace.rows("receive", recv_rows + 1, record.nbytes)
        recv_buf[-1].zero_()  # the zero row: rows past the valid prefix read it
        self._all_to_all("dispatch", recv_buf[:-1], send_buf,
                         received.splits if exact else None, sent.splits)
        if not exact:  # the record counts come with the headers
            received = _Blocks.padded(recv_buf.view(torch.int64)[:-1:M + 1, _COUNT], M)
            self._flags.bitwise_or_((received.counts > M).any().int() * errors.RECEIVE_OVERFLOW)
            received.counts = received.counts.clamp(0, M)
        if not exchange:
            self._check_headers(recv_buf, received, rows[me])
        if cached is None:
            state.received = received
        return self._finish_dispatch(request, record, recv_buf, state)

    def _finish_dispatch(self, request: DispatchRequest, record: _Record,
                         recv_buf: torch.Tensor, state: _CollectiveState) -> DispatchResult:
        """Gather the outputs from the received rows and make the handle."""
        R, me, M = self.num_ranks, self.rank, request.num_max_tokens_per_rank
        sync, alloc, cached = request.do_cpu_sync, request.alloc, request.cached
        num_topk = request.topk_idx.shape[1]
        num_local = request.num_experts // R
        zero_row = recv_buf.shape[0] - 1
        num_rows = state.received.rows - R if sync else R * M
        if cached is None:
            state.recv_row = state.received.record_rows(num_rows, zero_row)
        recv_row = state.recv_row
        meta = torch.index_select(recv_buf.view(torch.int32)[:, record.meta // 4:
                                                             record.meta_end // 4], 0, recv_row)
        expert_ids = meta[:, 1:1 + num_topk].long() - 1
        local_idx = torch.where((expert_ids >= 0)
                                & (expert_ids.div(num_local, rounding_mode="floor") == me),
                                expert_ids - me * num_local, -1)
        weights = meta[:, 1 + num_topk:].view(torch.float32) \
            if request.topk_weights is not None else None

        counts_list = None
        if cached is None:
            capacity = None if sync else expand_capacity(R, M, num_topk, num_local,
                                                         request.expert_alignment)
            experts = compute_expert_layout(local_idx, num_local, request.expert_alignment,
                                            capacity)
            self._flags.bitwise_or_(experts.overflow.int() * errors.EXPAND_OVERFLOW)
            if sync:
                counts_list = (experts.psum_aligned - experts.starts).tolist()
                num_expanded = sum(counts_list) if request.do_expand else 0
            else:
                num_expanded = capacity if request.do_expand else 0
            if request.do_expand:
                pair = torch.full((num_expanded + 1,), -1, dtype=torch.long, device=self.device)
                flat_rows = experts.expand_rows.flatten()
                pair.scatter_(0, torch.where(flat_rows >= 0, flat_rows, num_expanded),
                              torch.arange(flat_rows.numel(), device=self.device))
                state.expand_pair = pair[:num_expanded]
        else:
            num_expanded = cached.num_expanded_tokens

        recv_rows, recv_topk_idx, recv_weights = [], None, None
        if request.do_expand:
            pair = state.expand_pair
            rows = torch.where(pair >= 0, recv_row[pair.div(num_topk, rounding_mode="floor")],
                               zero_row)
        else:
            rows = recv_row
        for tensor, (begin, end) in zip(request.rows, record.payload):
            out = alloc.empty((rows.shape[0], *tensor.shape[1:]), tensor.dtype)
            column, target = _as_words((recv_buf, begin, end), (out, 0, end - begin))
            self._workspace.copy_rows(column, rows, target, zero_row, request.do_zero_padding)
            recv_rows.append(out)
        if weights is not None:
            if request.do_expand:
                recv_weights = alloc.empty((num_expanded,), torch.float32).copy_(
                    torch.where(pair >= 0, weights.flatten()[pair.clamp(min=0)], 0.0))
            else:
                recv_weights = alloc.empty((num_rows, num_topk), torch.float32).copy_(weights)
        if not request.do_expand:
            recv_topk_idx = alloc.empty((num_rows, num_topk), request.topk_idx.dtype)
            recv_topk_idx.copy_(local_idx)

        if cached is not None:
            return DispatchResult(recv_rows, recv_topk_idx, recv_weights, cached)
        last_slot = last_slot_per_rank(torch.where(local_idx >= 0, me, -1), me)
        metadata = alloc.empty((num_rows, num_topk + 2), torch.int32)
        metadata.copy_(torch.cat([meta[:, :1] - 1, last_slot.view(-1, 1),
                                  experts.expand_rows], dim=1))
        psum_expert = experts.starts + experts.counts if request.do_expand \
            else experts.psum_aligned
        send = state.send
        destination = send.slot_rank.clamp(min=0)
        dst_slot = torch.where(send.slot_rank >= 0,
                               destination * M + send.send_pos.gather(1, destination), -1)
        handle = EPHandle(
            tensors=dict(
                psum_num_recv_tokens_per_scaleup_rank=state.received.counts.cumsum(0).int(),
                psum_num_recv_tokens_per_expert=psum_expert.int(),
                num_unaligned_recv_tokens_per_expert=experts.counts.int(),
                recv_src_metadata=metadata,
                topk_idx=request.topk_idx.clone() if request.copy_topk_idx else request.topk_idx,
                dst_buffer_slot_idx=dst_slot.int()),
            num_recv_tokens_per_expert_list=counts_list,
            num_experts=request.num_experts,
            expert_alignment=request.expert_alignment,
            num_max_tokens_per_rank=M,
            do_expand=request.do_expand,
            do_cpu_sync=sync,
            num_recv_tokens=num_rows,
            num_expanded_tokens=num_expanded,
            buffer_id=self.config.buffer_id,
            num_tokens=request.topk_idx.shape[0],
            hidden=self.config.hidden,
            backend_state=state,
            num_sms=self.config.num_sms or 0,
        )
        return DispatchResult(recv_rows, recv_topk_idx, recv_weights, handle)

    # -- combine ---------------------------------------------------------------------------
    def combine(self, request: CombineRequest) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        self._check_usable()
        handle = request.handle
        state = handle.backend_state
        H = self.config.hidden
        num_tokens, num_topk = handle.tensors["topk_idx"].shape
        x, weights = request.x, request.topk_weights
        sync = handle.do_cpu_sync
        record = _Record.of([2 * H], num_topk if weights is not None else 0)
        header = self._header(1, sync, handle.num_experts, handle.num_max_tokens_per_rank,
                              handle.do_expand, 2 * H, weights is not None)
        if not isinstance(state, _CollectiveState):  # made by the kernel path
            return self._kernels.combine(request, record, header)
        # Blocks run the other way: this rank sends along the dispatch's receive side.
        back, returned_blocks = state.received, state.sent
        rows = self._header_rows(header, back.counts)
        if self._host_transport:
            self._exchange_headers("combine (header exchange)", rows)

        # Receiver: reduce the expand rows of each compact row; pack into the rows they came
        # from (rows past the valid prefix go to a scratch row past the end).
        send_buf = self._workspace.rows("send", back.rows + 1, record.nbytes)
        if handle.do_expand:
            slot_rows = handle.tensors["recv_src_metadata"][:, 2:].long()
            self._workspace.gather_sum(_as_words((x, 0, 2 * H))[0], slot_rows, (),
                                       send_buf.view(torch.bfloat16)[:, :H], state.recv_row,
                                       canonical_nan=False)
            if weights is not None:
                weights = torch.where(slot_rows >= 0, weights[slot_rows.clamp(min=0)], 0.0)
        else:
            column, source = _as_words((send_buf, 0, 2 * H), (x, 0, 2 * H))
            self._workspace.place_rows(source, state.recv_row, column)
        if weights is not None:
            column = send_buf.view(torch.int32)[:, record.meta // 4:record.meta_end // 4]
            column.index_copy_(0, state.recv_row, weights.float().view(torch.int32))
        _write_headers(send_buf, back.start, rows)

        returned = self._workspace.rows("receive", returned_blocks.rows + 1, record.nbytes)
        returned[-1].zero_()  # the zero row: slots without a rank read it
        self._all_to_all("combine", returned[:-1], send_buf[:-1], returned_blocks.splits,
                         back.splits)
        if not self._host_transport:
            self._check_headers(returned, returned_blocks, rows[self.rank])

        # Source: each token's rows from its ranks, in the order of their last slots.
        send = state.send
        owner = send.slot_rank.clamp(min=0)
        slot_row = returned_blocks.start[owner] + 1 + send.send_pos.gather(1, owner)
        slots = torch.arange(num_topk, device=self.device)
        key, order = torch.sort(torch.where(send.is_last_slot, slots, num_topk), dim=1)
        width = min(num_topk, self.num_ranks)
        sum_rows = torch.where(key[:, :width] < num_topk, slot_row.gather(1, order[:, :width]),
                               -1)
        combined_x = request.alloc.empty((num_tokens, H), torch.bfloat16)
        self._workspace.gather_sum(_as_words((returned, 0, 2 * H))[0], sum_rows,
                                   request.biases, combined_x, zero_row=returned_blocks.rows)

        combined_weights = None
        if weights is not None:
            words = returned.view(torch.int32).view(-1)
            where = slot_row * (record.nbytes // 4) + record.meta // 4 + slots
            got = words[torch.where(send.slot_rank >= 0, where, 0)].view(torch.float32)
            combined_weights = request.alloc.empty((num_tokens, num_topk), torch.float32)
            combined_weights.copy_(torch.where(send.slot_rank >= 0, got, 0.0))
            canonical_nan_(combined_weights)
        return combined_x, combined_weights
