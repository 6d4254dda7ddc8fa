"""DeepEP V1's `Buffer` in its normal (high-throughput) and low-latency modes, on top of
epcomm.

Code written against DeepEP V1 (`deep_ep.Buffer` with `get_dispatch_layout`, `dispatch`,
`combine`, `Config`, `EventOverlap`) runs unchanged against `epcomm.legacy.Buffer`:

    buffer = Buffer(group, num_nvl_bytes)
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = \\
        buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \\
        buffer.dispatch(x, num_tokens_per_rank=num_tokens_per_rank,
                        is_token_in_rank=is_token_in_rank,
                        num_tokens_per_expert=num_tokens_per_expert,
                        topk_idx=topk_idx, topk_weights=topk_weights)
    combined_x, _, event = buffer.combine(expert_out, handle)

Every call is carried by an internal `epcomm.Buffer` (compact layout), so results are
deterministic and bitwise equal to `epcomm.testing.reference` (docs/semantics.md).

Sizing. V1 learns the hidden size `H`, the top-k count `K` and the token count only at
dispatch, and its `num_nvl_bytes` sizes a ring buffer that any number of tokens streams through.
epcomm sizes by tokens: an internal `epcomm.Buffer` holds `M` tokens per rank for one `(H, K)`.
Every dispatch shares one small row per rank with the group (its token count and its per-rank,
per-channel and per-expert counts: one all-gather, which also yields the handle's rank prefix
matrix, as DeepEP's notify step does). The first dispatch of an `(H, K)` makes the internal
buffer, with `M` the largest token count of any rank rounded up to a power of two (with
`num_worst_tokens`, instead the larger of that count and `ceil(num_worst_tokens / R)`, so that
its `R * M` rows cover the outputs, which are views of epcomm's when they are as many). A later
synchronizing dispatch with more tokens on any rank makes a new, larger one (every rank sees all
counts, so all decide alike); the old one stays alive, its handles working, until `destroy()`.
`num_nvl_bytes` and `num_rdma_bytes` are kept as attributes (callers compare them to decide
whether to rebuild the buffer) but limit nothing; the symmetric backend's heap is
`epcomm.Buffer.get_buffer_size_hint(R, M, H, K)` bytes per rank, which grows with `M`, unlike
DeepEP's fixed ring buffer. Pass `num_max_tokens_per_rank=M` to fix `M` (no growth; more tokens
raise).

Streams. As in V1, the work waits for `previous_event` (else the current stream), outputs come
from the comm stream's pool with `allocate_on_comm_stream`, and with `async_finish` the current
stream does not wait (the returned event says when the outputs are ready; without it the
event is empty). A `previous_event` without `allocate_on_comm_stream` makes the current stream
wait for it first (DeepEP makes only its comm stream wait): the same order or a stronger one.

V1 semantics kept (intranode, DeepEP's docstrings and kernels):
- `recv_x` rows: one per (source rank, token sent to this rank), ordered by source rank, then
  source token index (DeepEP's channels are contiguous token ranges, so its order is this one).
- `recv_topk_idx[n, j]`: the local expert id (`topk_idx - rank * E_l`) where slot `j` maps to
  this rank, else -1; same dtype as `topk_idx`.
- `recv_topk_weights[n, j]`: the weight where slot `j` maps to this rank, else 0.
- `num_recv_tokens_per_expert_list`: per local expert, the received (row, slot) count aligned up
  to `expert_alignment`; `[]` with `num_worst_tokens > 0`.
- `num_worst_tokens > 0`: no host sync, outputs of exactly `num_worst_tokens` rows, rows past the
  received ones have `recv_topk_idx == -1` (and weight 0 here).
- The handle is DeepEP's six-tensor intranode tuple, with DeepEP's values (see `DispatchHandle`).
- Cached dispatch (`handle=`) returns `(recv_x, None, None, None, None, event)`.
- `combine` sums, in fp32 then one bf16 rounding, the biases and each receiving rank's row.

Where DeepEP leaves something unspecified, epcomm's contract decides: the order in which combine
adds the ranks (by each rank's last top-k slot of the token, docs/semantics.md; for a dispatch
without `topk_idx`, rank order), and expert ids outside `[-1, num_experts)` (they raise instead of
being ignored).

Low-latency mode (`low_latency_mode=True`): `low_latency_dispatch` / `low_latency_combine`,
their receive hooks, `get_next_low_latency_combine_buffer`, `clean_low_latency_buffer` and the
mask API (`enable_shrink=True`) are DeepEP's, carried by `epcomm.low_latency` over peer memory
(CUDA, one node; Triton kernels) or point-to-point messages of the group (anywhere else);
docs/semantics.md ("Low-latency mode") defines every output bit, including the row order
DeepEP leaves to its atomics. `use_logfmt=True` sends the combine's rows in epcomm's own
10-bit LogFMT-10 (`epcomm.logfmt`), as lossy as DeepEP's but with other values.

Differences and what is missing:
- `combined_topk_weights[t, j]` is the weight the rank owning slot `j`'s expert sent back (0 for
  -1 slots). DeepEP sums slot `j` over every rank the token went to; the two agree when the other
  ranks send 0 in that slot, which is what `recv_topk_weights` holds there (and its gradient in
  training), up to the sign of a zero.
- Routing follows `topk_idx`; `is_token_in_rank`, `num_tokens_per_rank` and
  `num_tokens_per_expert` must be what `get_dispatch_layout` returns for it (DeepEP routes by
  `is_token_in_rank` and counts by `num_tokens_per_expert`). Without `topk_idx`, routing follows
  `is_token_in_rank` and the counts `num_tokens_per_expert`, as in DeepEP.
- FP8 scales must have `ceil(hidden / 128)` columns (float32 or int32): UE8M0-packed scales of
  other widths are not accepted.
- An mpi4py `comm` instead of a group, `get_local_buffer_tensor`, and DeepEP's ten-tensor
  internode handle (groups of more than 8 ranks get the intranode form too) are not supported.
- `Config` and `num_sms` shape the handle's channel tensors only; epcomm's kernels choose their
  own launch sizes.
- Less strict than DeepEP: tensors need not be contiguous (they are copied), and the hidden size
  need not be a multiple of 16 bytes.
- `num_worst_tokens > 0` must be used on every rank or on none (epcomm's sync-free and
  synchronizing dispatches do not mix in one collective call), and it does not grow the internal
  buffer (that would need a host sync): the first dispatch, or `num_max_tokens_per_rank`, must
  cover the largest token count. Rows past `num_worst_tokens` would be dropped.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from .backends.symmetric.heap import heap_reachable
from .buffer import Buffer as _EPBuffer, register_buffer
from .checks import check_tensor
from .elastic import topk_idx_t
from .events import EventHandle, EventOverlap
from .fp8 import BLOCK_SIZE as _FP8_BLOCK, num_scales
from .handle import EPHandle
from .low_latency import (CollectiveLowLatency, LowLatencyHandle, LowLatencyShape,
                          LowLatencyTransport, SymmetricLowLatency, low_latency_size_hint)

__all__ = ["Buffer", "Config", "DispatchHandle", "EventOverlap", "LowLatencyHandle",
           "topk_idx_t"]

_NUM_MAX_NVL_PEERS = 8     # ranks DeepEP connects by NVLink (one node)
_BUFFER_ALIGNMENT = 128    # DeepEP's buffer sizes are multiples of this many bytes
_SOURCE_META_BYTES = 8     # DeepEP's per-token source record in the internode path
_MAX_TOPK = 128            # top-k slots and scale columns DeepEP's size hints provision for
_MAX_SCALES = 128
_TOPK_IDX_BYTES = 8        # sizeof(topk_idx_t)
_HEADER = 6                # T, H, K, E, num_worst_tokens, channels: the head of a shared row

DispatchInput = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


# ---------------------------------------------------------------------------------- Config
class Config:
    """DeepEP's performance config of one dispatch or combine (channels and chunk sizes).

    epcomm's kernels do not use chunked transfers; a `Config` keeps DeepEP's fields and checks,
    gives the buffer size hints callers size `num_nvl_bytes` / `num_rdma_bytes` with, and its
    `num_sms` sets the channel count (`num_sms // 2`) of a dispatch handle's channel tensors.

    Args:
        num_sms: SMs of DeepEP's kernels (>= 0; even for a dispatch or combine).
        num_max_nvl_chunked_send_tokens: tokens per NVLink send chunk (> 0).
        num_max_nvl_chunked_recv_tokens: NVLink receive ring slots per channel and rank
            (> the send chunk).
        num_max_rdma_chunked_send_tokens: tokens per RDMA send chunk (> 0).
        num_max_rdma_chunked_recv_tokens: RDMA receive ring slots (> 0); rounded up to a
            multiple of the RDMA send chunk, which must then be at most half of it.
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        values = dict(num_sms=num_sms,
                      num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                      num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                      num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                      num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for name, value in values.items():
            if not _is_int(value):
                raise TypeError(f"Config {name} must be an int, got {value!r}")
        if num_sms < 0:
            raise ValueError(f"Config num_sms must be >= 0, got {num_sms}")
        nvl_send, nvl_recv = num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens
        if nvl_send <= 0 or nvl_recv <= 0:
            raise ValueError("Config num_max_nvl_chunked_send_tokens and "
                             "num_max_nvl_chunked_recv_tokens must be > 0, got "
                             f"{nvl_send} and {nvl_recv}")
        if nvl_send >= nvl_recv:
            raise ValueError(f"Config num_max_nvl_chunked_send_tokens ({nvl_send}) must be less "
                             f"than num_max_nvl_chunked_recv_tokens ({nvl_recv})")
        rdma_send, rdma_recv = num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens
        if rdma_send <= 0 or rdma_recv <= 0:
            raise ValueError("Config num_max_rdma_chunked_send_tokens and "
                             "num_max_rdma_chunked_recv_tokens must be > 0, got "
                             f"{rdma_send} and {rdma_recv}")
        rdma_recv = -(-rdma_recv // rdma_send) * rdma_send
        if rdma_send >= rdma_recv or rdma_send > rdma_recv // 2:
            raise ValueError(f"Config num_max_rdma_chunked_send_tokens ({rdma_send}) must be at "
                             "most half of num_max_rdma_chunked_recv_tokens (rounded up to a "
                             f"multiple of it: {rdma_recv})")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = nvl_send
        self.num_max_nvl_chunked_recv_tokens = nvl_recv
        self.num_max_rdma_chunked_send_tokens = rdma_send
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, num_max_nvl_chunked_send_tokens="
                f"{self.num_max_nvl_chunked_send_tokens}, num_max_nvl_chunked_recv_tokens="
                f"{self.num_max_nvl_chunked_recv_tokens}, num_max_rdma_chunked_send_tokens="
                f"{self.num_max_rdma_chunked_send_tokens}, num_max_rdma_chunked_recv_tokens="
                f"{self.num_max_rdma_chunked_recv_tokens})")

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's NVLink buffer bytes for this config (the value DeepEP returns; epcomm
        allocates by tokens and only records it as `Buffer.num_nvl_bytes`).

        Args:
            hidden_bytes: bytes of one token row (`hidden * max(element_size, 2)` in callers).
            num_ranks: group size; below 8, or a multiple of 8 (then `num_sms` must be even).

        Returns:
            int: bytes, a multiple of 128.
        """
        _check_size_hint_args(hidden_bytes, num_ranks)
        if not (num_ranks < _NUM_MAX_NVL_PEERS or num_ranks % _NUM_MAX_NVL_PEERS == 0):
            raise ValueError(f"num_ranks must be below {_NUM_MAX_NVL_PEERS} or a multiple of it, "
                             f"got {num_ranks}")
        if num_ranks > _NUM_MAX_NVL_PEERS and self.num_sms % 2:
            raise ValueError(f"Config num_sms must be even above {_NUM_MAX_NVL_PEERS} ranks, "
                             f"got {self.num_sms}")
        rdma_ranks = max(num_ranks // _NUM_MAX_NVL_PEERS, 1)
        nvl_ranks = min(num_ranks, _NUM_MAX_NVL_PEERS)
        slots = (self.num_sms // 2) * nvl_ranks * self.num_max_nvl_chunked_recv_tokens
        num_bytes = (self.num_sms // 2) * nvl_ranks * (2 * rdma_ranks + 3) * 4
        num_bytes += slots * (hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * _TOPK_IDX_BYTES
                              + _MAX_TOPK * 4 + _MAX_SCALES * 4)
        return _round_up(num_bytes, _BUFFER_ALIGNMENT)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """DeepEP's RDMA buffer bytes for this config: 0 up to 8 ranks (one node).

        Args:
            hidden_bytes: bytes of one token row.
            num_ranks: group size; above 8 a multiple of 8 (then `num_sms` must be even).

        Returns:
            int: bytes, a multiple of 128.
        """
        _check_size_hint_args(hidden_bytes, num_ranks)
        if num_ranks <= _NUM_MAX_NVL_PEERS:
            return 0
        if num_ranks % _NUM_MAX_NVL_PEERS:
            raise ValueError(f"num_ranks above {_NUM_MAX_NVL_PEERS} must be a multiple of it, "
                             f"got {num_ranks}")
        if self.num_sms % 2:
            raise ValueError(f"Config num_sms must be even, got {self.num_sms}")
        rdma_ranks = num_ranks // _NUM_MAX_NVL_PEERS
        channels = self.num_sms // 2
        slots = channels * rdma_ranks * self.num_max_rdma_chunked_recv_tokens
        num_bytes = channels * rdma_ranks * (_NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        num_bytes += slots * 2 * (hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * _TOPK_IDX_BYTES
                                  + _MAX_TOPK * 4 + _MAX_SCALES * 4 + 16)
        return _round_up(num_bytes, _BUFFER_ALIGNMENT)


# DeepEP's recommended configs by group size: (nvl send, nvl recv, rdma send, rdma recv).
_DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
_COMBINE_CONFIGS = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}


# ---------------------------------------------------------------------------------- handle
@dataclass(eq=False)
class _HandleState:
    """What a `DispatchHandle` carries besides DeepEP's tensors."""

    inner: _EPBuffer        # the epcomm buffer that dispatched
    ep: EPHandle            # its handle (combine and cached dispatch)
    num_rows: int           # rows of recv_x as returned (num_worst_tokens, or the exact count)
    num_tokens: int         # T, this rank's tokens
    hidden: int
    num_topk: int           # K of the epcomm dispatch (the group size without topk_idx)
    has_topk: bool          # dispatched with topk_idx (combine may send topk_weights back)
    worst: bool             # num_worst_tokens > 0: no host sync


class DispatchHandle(tuple):
    """DeepEP's intranode dispatch handle: a tuple of six tensors, plus the epcomm handle.

    `R` ranks, `T` tokens on this rank, `N` rows of `recv_x`, `C = config.num_sms // 2` channels
    (DeepEP splits a rank's tokens into `C` contiguous ranges of `ceil(T / C)` tokens):

    0. rank_prefix_matrix: [R, R] int32; `[i][j]` = tokens ranks `0..i` send to rank `j`
       (inclusive prefix over source ranks, the same on every rank); `recv_x` rows
       `[rank_prefix_matrix[i-1][rank], rank_prefix_matrix[i][rank])` came from rank `i`.
    1. channel_prefix_matrix: [R, C] int32; `[r][c]` = tokens of channels `0..c` this rank sends
       to rank `r` (inclusive prefix).
    2. recv_channel_prefix_matrix: [R, C] int32; `[s][c]` = where source `s`'s channel `c` starts
       within `s`'s rows of `recv_x` (exclusive prefix of `s`'s channel counts for this rank).
    3. recv_src_idx: [N] int32, the source token index of each `recv_x` row (-1 past the received
       rows with `num_worst_tokens`).
    4. is_token_in_rank: [T, R] bool, the tensor the dispatch was given.
    5. send_head: [T, R] int32, the position of token `t` among the tokens its channel sends to
       rank `r`, -1 where `t` is not sent to `r` (DeepEP's combine rewrites its copy in place;
       this one is left as dispatch made it).

    Combine and cached dispatch use the epcomm handle inside (also found through
    `recv_src_idx` when the tuple is rebuilt from the same tensors).
    """

    _state: _HandleState

    def __new__(cls, tensors: tuple, state: _HandleState) -> "DispatchHandle":
        handle = super().__new__(cls, tensors)
        handle._state = state
        return handle

    @property
    def ep_handle(self) -> EPHandle:
        """The epcomm `EPHandle` of this dispatch."""
        return self._state.ep


# ---------------------------------------------------------------------------------- helpers
def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _round_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _check_size_hint_args(hidden_bytes, num_ranks) -> None:
    if not (_is_int(hidden_bytes) and hidden_bytes > 0):
        raise ValueError(f"hidden_bytes must be a positive int, got {hidden_bytes!r}")
    if not (_is_int(num_ranks) and num_ranks > 0):
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")


def _check_tensor(name: str, tensor, dtypes, shape: Optional[tuple], device: torch.device,
                  ndim: Optional[int] = None) -> None:
    """`checks.check_tensor` as DeepEP's methods check: `shape` (None entries: any) or, without
    it, `ndim`; `device` is x's."""
    check_tensor(name, tensor, dtypes, len(shape) if shape is not None else ndim, device,
                 shape=shape, device_of="x's device")


def _payload(x) -> list[torch.Tensor]:
    """A dispatch's `x` checked: `[x]` (bf16 [T, H]) or `[x_fp8, scales]`."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ValueError(f"x must be a bf16 tensor or a tuple (x_fp8, scales), "
                             f"got a tuple of {len(x)}")
        x_fp8, scales = x
        if not isinstance(x_fp8, torch.Tensor):
            raise TypeError(f"x[0] must be a torch.Tensor, got {type(x_fp8).__name__}")
        _check_tensor("x[0] (FP8 rows)", x_fp8, (torch.float8_e4m3fn,), None, x_fp8.device, 2)
        tokens, hidden = x_fp8.shape
        _check_tensor("x[1] (FP8 scales)", scales, (torch.float32, torch.int32),
                      (tokens, None), x_fp8.device)
        if scales.shape[1] != num_scales(hidden):
            raise ValueError(f"x[1] (FP8 scales) must have ceil(hidden / 128) = "
                             f"{num_scales(hidden)} columns (one per 128 channels), got "
                             f"{scales.shape[1]}; packed UE8M0 scales are not supported")
        return [x_fp8, scales]
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor or a tuple (x_fp8, scales), "
                        f"got {type(x).__name__}")
    _check_tensor("x", x, (torch.bfloat16,), None, x.device, 2)
    return [x]


def _num_channels(config: Optional[Config], default_sms: int) -> int:
    """The channel count `num_sms // 2` of `config` (or of `Buffer.num_sms`), checked."""
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be an epcomm.legacy.Config or None, "
                        f"got {type(config).__name__}")
    num_sms = default_sms if config is None else config.num_sms
    if num_sms < 2 or num_sms % 2:
        raise ValueError(f"config num_sms must be even and at least 2, got {num_sms}")
    return num_sms // 2


def _check_stream_options(previous_event, async_finish, allocate_on_comm_stream) -> None:
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError("allocate_on_comm_stream=True requires previous_event and "
                         "async_finish=True")


def _cuda_event(previous_event) -> Optional["torch.cuda.Event"]:
    """The CUDA event of a `previous_event` (an `EventOverlap`, or a `torch.cuda.Event`);
    None for none or an empty `EventOverlap`."""
    if previous_event is None or isinstance(previous_event, torch.cuda.Event):
        return previous_event
    return getattr(previous_event, "event", None)


def _check_hook_options(async_finish, return_recv_hook) -> None:
    if async_finish and return_recv_hook:
        raise ValueError("async_finish=True and return_recv_hook=True cannot be combined (the "
                         "hook receives on the current stream)")


def _finish_event(device: torch.device, async_finish: bool) -> EventOverlap:
    """A low-latency call's event: with `async_finish` on CUDA, one recorded on the current
    stream (where the call's work runs); else empty."""
    if async_finish and device.type == "cuda":
        return _EPBuffer.capture()
    return EventOverlap()


def _low_latency_handle(handle) -> tuple[LowLatencyShape, torch.device]:
    """The (shape, device) of a low-latency dispatch's handle, checked to be one."""
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError("handle must be the handle low_latency_dispatch of "
                        f"epcomm.legacy.Buffer returned, got {type(handle).__name__}")
    shape, device = handle.slot_key
    return shape, torch.device(device)


def _fit_rows(tensor: torch.Tensor, rows: int, fill=None) -> torch.Tensor:
    """`tensor` with exactly `rows` rows: its first rows (a view), or a copy padded with
    `fill` (0 as bytes for any dtype; None: left unset)."""
    have = tensor.shape[0]
    if have >= rows:
        return tensor[:rows]
    out = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    out[:have].copy_(tensor)
    if fill == 0:
        out[have:].view(torch.uint8).fill_(0)
    elif fill is not None:
        out[have:].fill_(fill)
    return out


def _channel_layout(is_token_in_rank: torch.Tensor, num_channels: int):
    """DeepEP's send-side channel tensors of `is_token_in_rank` [T, R] bool:
    (channel_prefix_matrix [R, C] int32, send_head [T, R] int32), device-side, no host sync."""
    num_tokens, num_ranks = is_token_in_rank.shape
    device = is_token_in_rank.device
    per = -(-num_tokens // num_channels)
    sent = is_token_in_rank.to(torch.int32)
    before = torch.zeros((num_tokens + 1, num_ranks), dtype=torch.int32, device=device)
    torch.cumsum(sent, 0, out=before[1:])  # before[t]: tokens < t sent to each rank
    starts = (torch.arange(num_channels, device=device) * per).clamp(max=num_tokens)
    ends = (starts + per).clamp(max=num_tokens)
    channel_prefix = before[ends].t().contiguous()
    if num_tokens:
        channel_of = torch.arange(num_tokens, device=device) // per
        position = before[:-1] - before[starts[channel_of]]
    else:
        position = before[:0]
    send_head = torch.where(is_token_in_rank, position, -1).to(torch.int32)
    return channel_prefix, send_head


class _Calls:
    """Where a call's own tensor work runs, mapped from V1's stream rules onto epcomm's.

    V1: the comm stream waits for `previous_event` (else the current stream); with
    `allocate_on_comm_stream` outputs come from the comm stream's pool; with `async_finish` the
    current stream does not wait. Here: with `allocate_on_comm_stream` this wrapper's tensor work
    before the epcomm call runs on the comm stream after `previous_event` and epcomm waits for
    it; otherwise the current stream first waits for `previous_event` (a superset of what V1
    orders, never less), and the work runs there. Work after the epcomm call runs where its
    outputs are ready: the current stream, or with `async_finish` the comm stream, whose new
    event the call returns. On CPU tensors all of this is a no-op."""

    def __init__(self, device: torch.device, previous_event, async_finish: bool,
                 allocate_on_comm_stream: bool, comm: Optional["torch.cuda.Stream"]) -> None:
        self.cuda = device.type == "cuda"
        self.async_finish = async_finish
        self.on_comm = allocate_on_comm_stream and self.cuda
        self.comm = comm
        self.compute = torch.cuda.current_stream(device) if self.cuda else None
        self.made: list[torch.Tensor] = []  # tensors made on the comm stream for the caller
        event = _cuda_event(previous_event) if self.cuda else None
        if self.on_comm:
            if event is not None:
                comm.wait_event(event)
            else:
                comm.wait_stream(self.compute)
        elif event is not None:
            self.compute.wait_event(event)

    def before(self):
        """Context for the work before the epcomm call."""
        return torch.cuda.stream(self.comm) if self.on_comm else contextlib.nullcontext()

    def inner_previous_event(self) -> Optional[EventOverlap]:
        """The `previous_event` for the epcomm call (after `before()` work)."""
        if not self.on_comm:
            return None
        event = EventHandle()
        event.record(self.comm)
        return EventOverlap(event)

    def after(self, event: EventOverlap):
        """Context for the work after the epcomm call returned `event`."""
        if self.cuda and self.async_finish:
            self.comm.wait_event(event.event)
            return torch.cuda.stream(self.comm)
        return contextlib.nullcontext()

    def keep(self, *tensors: Optional[torch.Tensor]) -> None:
        """Tensors made on the comm stream that the caller reads on its own stream."""
        self.made.extend(t for t in tensors if t is not None)

    def finish(self, event: EventOverlap) -> EventOverlap:
        """The event V1 returns: empty without `async_finish` (the current stream waited)."""
        if not self.cuda:
            return EventOverlap()
        # `keep` tensors may come from the comm stream's pool (inside a CUDA-graph capture the
        # graph's private pool keeps them instead).
        if (self.on_comm or self.async_finish) and \
                not torch.cuda.is_current_stream_capturing():
            for tensor in self.made:
                tensor.record_stream(self.compute)
        if not self.async_finish:
            return EventOverlap()
        done = EventHandle()
        done.record(self.comm)
        return EventOverlap(done, extra_tensors=event.extra_tensors)


# ---------------------------------------------------------------------------------- Buffer
class Buffer:
    """DeepEP V1's communication buffer over epcomm: the normal (high-throughput) mode, and the
    low-latency (decode) mode with `low_latency_mode=True`.

    Attributes:
        num_sms: class attribute, DeepEP's SM count of high-throughput kernels (default 20);
            it sets the default configs and the channel count of dispatch handles.
        rank: this process's rank in `group`.
        group_size: the group's size `R`.
        group: the process group.
        num_nvl_bytes, num_rdma_bytes: the sizes passed (recorded, not used: see the module
            documentation on sizing).
        low_latency_mode, explicitly_destroy, enable_shrink: as passed.
    """

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0,
                 num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm: Any = None, *,
                 num_max_tokens_per_rank: Optional[int] = None,
                 backend: str = "auto", low_latency_timeout_s: float = 100.0) -> None:
        """Make a buffer over `group` (nothing is allocated until the first dispatch).

        Args:
            group: the EP process group (gloo for CPU tensors, NCCL for CUDA tensors).
            num_nvl_bytes: DeepEP's NVLink buffer bytes (int >= 0, multiple of 128); recorded.
            num_rdma_bytes: DeepEP's RDMA buffer bytes (int >= 0, multiple of 128); recorded.
            low_latency_mode: enable the low-latency calls (`low_latency_dispatch`, ...);
                they need `num_rdma_bytes >= get_low_latency_rdma_size_hint(...)`.
            num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl: RDMA and
                low-latency settings of DeepEP; accepted and ignored.
            explicitly_destroy: True: `destroy()` releases the buffer (and must be called
                for that); False: resources go with the object, and `destroy()` raises.
            enable_shrink: enable the low-latency mask API (`low_latency_update_mask_buffer`,
                ...).
            comm: an mpi4py communicator instead of `group`: not supported (pass a group).
            num_max_tokens_per_rank: epcomm only: fix `M`, the most tokens any rank passes to
                one dispatch (the same on every rank); default None: sized from the calls.
            backend: epcomm only: "auto", "collective" or "symmetric" (`epcomm.Buffer`). The
                low-latency mode follows it: "auto" takes peer memory on CUDA where every rank
                maps every peer's, else the collective transport.
            low_latency_timeout_s: epcomm only: how long a low-latency kernel waits for a peer
                (seconds of wall-clock time) before it gives up and flags a timeout.
        """
        if group is None:
            if comm is not None:
                raise NotImplementedError("an mpi4py comm is not supported by "
                                          "epcomm.legacy.Buffer: pass a torch.distributed group")
            raise ValueError("Either 'group' or 'comm' must be provided (epcomm.legacy.Buffer "
                             "needs group)")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if not (_is_int(value) and value >= 0):
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
            if value % _BUFFER_ALIGNMENT:
                raise ValueError(f"{name} must be a multiple of {_BUFFER_ALIGNMENT} bytes, "
                                 f"got {value}")
        if num_max_tokens_per_rank is not None and not (
                _is_int(num_max_tokens_per_rank) and num_max_tokens_per_rank > 0):
            raise ValueError(f"num_max_tokens_per_rank must be a positive int or None, "
                             f"got {num_max_tokens_per_rank!r}")
        if not (isinstance(low_latency_timeout_s, (int, float)) and low_latency_timeout_s > 0):
            raise ValueError(f"low_latency_timeout_s must be a positive number of seconds, "
                             f"got {low_latency_timeout_s!r}")
        if backend not in ("auto", "collective", "symmetric"):
            raise ValueError(f"backend must be 'auto', 'collective' or 'symmetric', "
                             f"got {backend!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self._fixed_max_tokens = num_max_tokens_per_rank
        self._backend = backend
        self._gather_on_host = dist.get_backend(group) == "gloo"
        self._inner: dict[tuple, _EPBuffer] = {}   # (hidden, num_topk, device) -> current
        self._made: list[_EPBuffer] = []           # every internal buffer, oldest first
        self._headers: dict[tuple, torch.Tensor] = {}  # device copies of `_share` headers
        self._destroyed = False
        self._low_latency: dict[str, LowLatencyTransport] = {}  # device -> transport
        self._low_latency_timeout_s = low_latency_timeout_s
        self._masked: set[int] = set()             # ranks masked by the mask API
        self.buffer_id = register_buffer(self)  # epcomm only: names it to the compiled ops

    # -- static and information ----------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether FP8 dispatch is available (always, in epcomm)."""
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set `Buffer.num_sms` (an even int) for the default configs and handle channels."""
        if not _is_int(new_num_sms) or new_num_sms % 2 or new_num_sms < 2:
            raise ValueError(f"new_num_sms must be an even int >= 2 (the SM count must be "
                             f"even), got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current CUDA stream (empty without CUDA), for `previous_event`."""
        return _EPBuffer.capture()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """DeepEP's recommended dispatch `Config` for `num_ranks` ranks (2, 4, 8, 16, 24, 32,
        48, 64, 96, 128, 144 or 160), with `Buffer.num_sms` SMs."""
        return Buffer._recommended(_DISPATCH_CONFIGS, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """DeepEP's recommended combine `Config` for `num_ranks` ranks (as
        `get_dispatch_config`)."""
        return Buffer._recommended(_COMBINE_CONFIGS, num_ranks)

    @staticmethod
    def _recommended(table: dict, num_ranks: int) -> Config:
        if num_ranks not in table:
            raise ValueError(f"Unsupported number of EP ranks: num_ranks={num_ranks!r} (DeepEP "
                             f"recommends configs for {sorted(table)})")
        return Config(Buffer.num_sms, *table[num_ranks])

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                       num_ranks: int, num_experts: int) -> int:
        """DeepEP's minimum `num_rdma_bytes` for the low-latency mode (its BF16 sizing): the
        value DeepEP returns, a multiple of 128. The low-latency calls check `num_rdma_bytes`
        against it as DeepEP does (epcomm's own buffers: `epcomm.low_latency`).

        Args:
            num_max_dispatch_tokens_per_rank: M, the most tokens one rank dispatches (> 0).
            hidden: H (> 0).
            num_ranks: R (> 0).
            num_experts: E, a positive multiple of `num_ranks`.
        """
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("hidden", hidden), ("num_ranks", num_ranks),
                            ("num_experts", num_experts)):
            if not (_is_int(value) and value > 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_experts % num_ranks:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_ranks "
                             f"({num_ranks})")
        return low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                     num_experts)

    @property
    def inner_buffers(self) -> list:
        """The internal `epcomm.Buffer`s made so far, oldest first (read-only list)."""
        return list(self._made)

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The communication stream of the current CUDA device (epcomm has one per device and
        process, shared by every buffer); None without CUDA."""
        if not torch.cuda.is_available():
            return None
        return self._comm_stream(torch.device("cuda", torch.cuda.current_device()))

    def _comm_stream(self, device: torch.device) -> Optional["torch.cuda.Stream"]:
        """The communication stream epcomm uses for `device` (None for CPU)."""
        if device.type != "cuda":
            return None
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        for inner in self._made:
            if inner.device == device:
                return inner.get_comm_stream()
        from .streams import comm_stream  # the same stream every epcomm buffer of `device` uses
        return comm_stream(device)

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None,
                                offset: int = 0, use_rdma_buffer: bool = False) -> torch.Tensor:
        """Not supported: epcomm has no raw NVLink/RDMA buffer to expose."""
        raise NotImplementedError("get_local_buffer_tensor: epcomm.legacy.Buffer has no raw "
                                  "communication buffer (epcomm allocates by tokens)")

    def destroy(self) -> None:
        """Release every internal buffer (requires `explicitly_destroy=True`); the buffer
        cannot be used afterwards."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() requires Buffer(..., explicitly_destroy=True)")
        for inner in self._made:
            inner.destroy()
        self._inner.clear()
        for transport in self._low_latency.values():
            transport.destroy()
        self._low_latency.clear()
        self._destroyed = True

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed")

    # -- low-latency mode ----------------------------------------------------------------
    def _check_low_latency(self, name: str) -> None:
        self._check_alive()
        if not self.low_latency_mode:
            raise RuntimeError(f"{name} requires Buffer(..., low_latency_mode=True)")

    def _low_latency_transport(self, name: str, device: torch.device) -> LowLatencyTransport:
        """The low-latency transport of `device`, checked usable for call `name`; the first
        call on a device chooses it (collective over the group with `backend="auto"` on CUDA:
        whether every rank maps every peer's memory)."""
        self._check_low_latency(name)
        transport = self._low_latency.get(str(device))
        if transport is None:
            symmetric = self._backend == "symmetric" or (
                self._backend == "auto" and device.type == "cuda")
            if symmetric:
                reachable, why = heap_reachable(self.group, device)
                if not reachable and self._backend == "symmetric":
                    raise RuntimeError(f"{name}: backend='symmetric' needs every rank to map "
                                       f"every peer's memory: {why}")
                symmetric = reachable
            transport = (SymmetricLowLatency(self.group, self._low_latency_timeout_s)
                         if symmetric else CollectiveLowLatency(self.group))
            self._low_latency[str(device)] = transport
        return transport

    def _check_rdma_bytes(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        need = low_latency_size_hint(max_tokens, hidden, self.group_size, num_experts)
        if self.num_rdma_bytes < need:
            raise ValueError(f"num_rdma_bytes={self.num_rdma_bytes} given to Buffer is less than "
                             f"get_low_latency_rdma_size_hint({max_tokens}, {hidden}, "
                             f"{self.group_size}, {num_experts}) = {need}")

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Restart the low-latency buffers (every rank must call it at the same point): the
        next call takes slot 0, and handles of earlier dispatches become stale (combining
        them raises). Not needed between normal and low-latency calls in epcomm (they share
        no memory); kept for DeepEP code.

        Args:
            num_max_dispatch_tokens_per_rank, hidden, num_experts: as in
                `low_latency_dispatch` (checked against `num_rdma_bytes`).
        """
        self._check_low_latency("clean_low_latency_buffer")
        for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
                            ("hidden", hidden), ("num_experts", num_experts)):
            if not (_is_int(value) and value > 0):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_experts % self.group_size:
            raise ValueError(f"num_experts must be a multiple of the group size "
                             f"{self.group_size}, got {num_experts}")
        self._check_rdma_bytes(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        for transport in self._low_latency.values():
            transport.clean()

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Send each token to the experts of its top-k slots, expert-major, without a host
        sync (collective; every rank calls it with the same `M` and `E`).

        `R` ranks, `E_l = E // R` local experts, `M` = `num_max_dispatch_tokens_per_rank`,
        `T <= M` tokens here, `H` hidden, `K` top-k slots. docs/semantics.md ("Low-latency
        mode") defines every output bit.

        Args:
            x: [T, H] bf16 tokens (H a multiple of 128 with `use_fp8`).
            topk_idx: [T, K] int64 (`topk_idx_t`) or int32 global expert ids; -1 (or any id
                outside [0, E)) selects no expert. A token with an expert twice sends one row.
            num_max_dispatch_tokens_per_rank: M (> 0, >= T, the same on every rank).
            num_experts: E, a positive multiple of R.
            cumulative_local_expert_recv_stats: None or [E_l] int32; each call adds the rows
                each local expert received.
            dispatch_wait_recv_cost_stats: None or [R] int64; on CPU, each call adds the host
                nanoseconds from issuing its messages to the arrival of each source rank's
                (unchanged on CUDA, where waiting is stream-ordered).
            use_fp8: cast to FP8 e4m3 with one fp32 scale per 128 channels while sending.
            round_scale: scales rounded up to powers of two (with `use_fp8`).
            use_ue8m0: scales as UE8M0 exponent bytes packed in int32 (needs `round_scale`).
            async_finish: return an event to wait on (CUDA); not with `return_recv_hook`.
            return_recv_hook: only issue the sends; the returned `hook()` receives.

        Returns:
            recv_x: [E_l, R * M, H] bf16, or with `use_fp8` a tuple (fp8 [E_l, R * M, H],
                scales [E_l, R * M, H / 128] float32, or [E_l, R * M, ceil(H / 512)] int32
                with `use_ue8m0`; column-major in the last two dims, for TMA). Expert `e`'s
                rows are `[0, recv_count[e])`, ordered by source rank, then source token;
                later rows are unspecified.
            recv_count: [E_l] int32 rows per local expert.
            handle: a `LowLatencyHandle`, DeepEP's `(src_info, layout_range, M, H, E)`.
            event: an `EventOverlap` (empty unless `async_finish` on CUDA).
            hook: with `return_recv_hook`, a callable that receives (call it before reading
                the outputs, and before the next-but-one low-latency call); else None.

        The outputs live in one of two alternating buffers: they stay valid until the
        next-but-one low-latency call (dispatch or combine) of this buffer.
        """
        transport, shape = self._low_latency_call(
            x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
            cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
            round_scale, use_ue8m0)
        _check_hook_options(async_finish, return_recv_hook)
        recv_x, recv_count, handle, hook = transport.dispatch(
            shape, x.contiguous(), topk_idx.contiguous(), masked=tuple(sorted(self._masked)),
            round_scale=bool(round_scale), cumulative_stats=cumulative_local_expert_recv_stats,
            wait_stats=dispatch_wait_recv_cost_stats, return_recv_hook=bool(return_recv_hook))
        return recv_x, recv_count, handle, _finish_event(x.device, async_finish), hook

    def _low_latency_call(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                          cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                          use_fp8, round_scale, use_ue8m0):
        """Check a low-latency dispatch's arguments (before any communication); returns its
        (transport, shape)."""
        self._check_low_latency("low_latency_dispatch")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        device = x.device
        _check_tensor("x", x, (torch.bfloat16,), None, device, 2)
        num_tokens, hidden = x.shape
        _check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), (num_tokens, None),
                      device)
        if topk_idx.shape[1] == 0:
            raise ValueError("topk_idx must have at least one column (top-k slot)")
        max_tokens = num_max_dispatch_tokens_per_rank
        if not (_is_int(max_tokens) and max_tokens > 0):
            raise ValueError(f"num_max_dispatch_tokens_per_rank must be a positive int, "
                             f"got {max_tokens!r}")
        if num_tokens > max_tokens:
            raise ValueError(f"x has {num_tokens} tokens, more than "
                             f"num_max_dispatch_tokens_per_rank={max_tokens}")
        num_ranks = self.group_size
        if not (_is_int(num_experts) and num_experts > 0 and num_experts % num_ranks == 0):
            raise ValueError(f"num_experts must be a positive multiple of the group size "
                             f"{num_ranks}, got {num_experts!r}")
        if hidden == 0:
            raise ValueError("x must have a positive hidden size")
        if use_fp8 and hidden % _FP8_BLOCK:
            raise ValueError(f"x's hidden size must be a multiple of {_FP8_BLOCK} with "
                             f"use_fp8=True, got {hidden}")
        if round_scale and not use_fp8:
            raise ValueError("round_scale=True needs use_fp8=True")
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0=True needs round_scale=True (UE8M0 scales are powers "
                             "of two)")
        num_local = num_experts // num_ranks
        if cumulative_local_expert_recv_stats is not None:
            _check_tensor("cumulative_local_expert_recv_stats",
                          cumulative_local_expert_recv_stats, (torch.int32,), (num_local,),
                          device)
        if dispatch_wait_recv_cost_stats is not None:
            _check_tensor("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats,
                          (torch.int64,), (num_ranks,), device)
        self._check_rdma_bytes(max_tokens, hidden, num_experts)
        transport = self._low_latency_transport("low_latency_dispatch", device)
        return transport, LowLatencyShape(
            num_ranks=num_ranks, rank=self.rank, max_tokens=max_tokens, hidden=hidden,
            num_experts=num_experts, num_topk=topk_idx.shape[1], use_fp8=bool(use_fp8),
            use_ue8m0=bool(use_ue8m0))

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor,
                            topk_weights: torch.Tensor, handle: tuple, use_logfmt: bool = False,
                            zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """Send expert outputs back to their tokens and reduce them with the top-k weights,
        without a host sync (collective).

        Args:
            x: [E_l, R * M, H] bf16, the expert outputs in `recv_x`'s layout (rows past
                `recv_count` are ignored); with `zero_copy`, only its shape is used and the
                outputs are read from `get_next_low_latency_combine_buffer(handle)`.
            topk_idx: [T, K] int64 or int32, the dispatch's `topk_idx` (which slots count is
                decided by the dispatch's routing).
            topk_weights: [T, K] float32 weights.
            handle: the `LowLatencyHandle` of the dispatch (not stale: see the buffers note in
                `low_latency_dispatch`).
            use_logfmt: send the expert outputs in LogFMT-10, 10 bits a value (`epcomm.logfmt`;
                lossy: docs/semantics.md defines the values, which are not DeepEP's LogFMT
                values); needs H a multiple of 128, not with `zero_copy`; the same on every
                rank (the rows' format is not checked across ranks).
            zero_copy: read the expert outputs from the combine buffer (see `x`).
            async_finish: return an event to wait on (CUDA); not with `return_recv_hook`.
            return_recv_hook: only issue the sends; the returned `hook()` receives and reduces.
            out: None or [T, H] bf16, written in place and returned.
            combine_wait_recv_cost_stats: None or [R] int64, as `dispatch_wait_recv_cost_stats`.

        Returns:
            combined_x: [T, H] bf16, `bf16(acc)` with `acc = 0.0` (fp32) and, for `k = 0..K-1`
                in order, for each slot dispatched to an unmasked rank,
                `acc = acc + fp32(topk_weights[t, k] * fp32(expert output row))`.
            event: an `EventOverlap` (empty unless `async_finish` on CUDA).
            hook: with `return_recv_hook`, the receiving callable; else None.
        """
        self._check_low_latency("low_latency_combine")
        shape, device = _low_latency_handle(handle)
        transport = self._low_latency_transport("low_latency_combine", device)
        if use_logfmt and (zero_copy or shape.hidden % 128):
            raise ValueError(f"use_logfmt=True needs zero_copy=False and a hidden size that is a "
                             f"multiple of 128 (got zero_copy={zero_copy}, hidden="
                             f"{shape.hidden})")
        _check_tensor("x", x, (torch.bfloat16,), (shape.num_local, shape.rows, shape.hidden),
                      device)
        num_tokens = transport.num_tokens(handle)
        _check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32),
                      (num_tokens, shape.num_topk), device)
        _check_tensor("topk_weights", topk_weights, (torch.float32,),
                      (num_tokens, shape.num_topk), device)
        if out is not None:
            _check_tensor("out", out, (torch.bfloat16,), (num_tokens, shape.hidden), device)
            if not out.is_contiguous():
                raise ValueError("out must be contiguous")
        if combine_wait_recv_cost_stats is not None:
            _check_tensor("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats,
                          (torch.int64,), (shape.num_ranks,), device)
        _check_hook_options(async_finish, return_recv_hook)
        combined, hook = transport.combine(
            shape, x, topk_idx.contiguous(), topk_weights.contiguous(), handle,
            masked=tuple(sorted(self._masked)), zero_copy=bool(zero_copy), out=out,
            wait_stats=combine_wait_recv_cost_stats, return_recv_hook=bool(return_recv_hook),
            use_logfmt=bool(use_logfmt))
        return combined, _finish_event(device, async_finish), hook

    def get_next_low_latency_combine_buffer(self, handle: tuple) -> torch.Tensor:
        """The [E_l, R * M, H] bf16 buffer the next `low_latency_combine(...,
        zero_copy=True)` reads the expert outputs from (fill it, then combine; any other
        low-latency call in between moves to the other buffer).

        Args:
            handle: the `LowLatencyHandle` of the dispatch to be combined.
        """
        shape, device = _low_latency_handle(handle)
        transport = self._low_latency_transport("get_next_low_latency_combine_buffer", device)
        return transport.zero_copy_buffer(shape, device)

    def low_latency_check_errors(self) -> None:
        """epcomm only: raise `epcomm.errors.EPTimeoutError` if a low-latency kernel gave up
        waiting for a peer since the last check (reads a device flag back: a host sync; on CPU
        every receive checks by itself). After a timeout the buffer is out of step with its
        peers: make a new one."""
        self._check_alive()
        for device, transport in self._low_latency.items():
            if isinstance(transport, SymmetricLowLatency):
                transport.check_errors(torch.device(device))

    def _check_mask_api(self, name: str) -> None:
        self._check_alive()
        if not self.enable_shrink:
            raise RuntimeError(f"{name} requires Buffer(..., enable_shrink=True)")

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (or unmask) a rank: later low-latency calls neither send to it nor wait for
        it (its rows count as none, its experts' slots add nothing in combine). Every live
        rank must mask the same ranks before the same call.

        Args:
            rank_to_mask: the rank, in [0, R).
            mask: True to mask, False to unmask.
        """
        self._check_mask_api("low_latency_update_mask_buffer")
        if not (_is_int(rank_to_mask) and 0 <= rank_to_mask < self.group_size):
            raise ValueError(f"rank_to_mask must be an int in [0, {self.group_size}), "
                             f"got {rank_to_mask!r}")
        if mask:
            self._masked.add(rank_to_mask)
        else:
            self._masked.discard(rank_to_mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write the mask into `mask_status`: [R] int32, 1 for a masked rank, else 0."""
        self._check_mask_api("low_latency_query_mask_buffer")
        if not isinstance(mask_status, torch.Tensor):
            raise TypeError(f"mask_status must be a torch.Tensor, "
                            f"got {type(mask_status).__name__}")
        _check_tensor("mask_status", mask_status, (torch.int32,), (self.group_size,),
                      mask_status.device)
        status = [1 if r in self._masked else 0 for r in range(self.group_size)]
        mask_status.copy_(torch.tensor(status, dtype=torch.int32))

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        self._check_mask_api("low_latency_clean_mask_buffer")
        self._masked.clear()

    # -- layout --------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor,
                                       torch.Tensor, EventOverlap]:
        """Count where this rank's tokens go (local: no communication).

        Args:
            topk_idx: [T, K] int64 (`topk_idx_t`) or int32, the global expert ids of each token,
                -1 for none; ids outside [0, num_experts) are not counted.
            num_experts: E, a positive multiple of the group size; expert `e` lives on rank
                `e // (E // R)`.
            previous_event: work to wait for first (an `EventOverlap`, e.g. `capture()`).
            async_finish: if True, the current stream does not wait: wait on the returned event.
            allocate_on_comm_stream: compute and allocate on the comm stream (requires
                `previous_event` and `async_finish`).

        Returns:
            num_tokens_per_rank: [R] int32, tokens with at least one expert on each rank.
            num_tokens_per_rdma_rank: [R // 8] int32, the same per node of 8 ranks, for groups
                of more than 8 ranks (a multiple of 8); None otherwise (one node).
            num_tokens_per_expert: [E] int32, (token, slot) pairs choosing each expert.
            is_token_in_rank: [T, R] bool, whether token `t` goes to rank `r`.
            event: an `EventOverlap` on the stream that computed them (empty unless
                `async_finish`).
        """
        self._check_alive()
        if not isinstance(topk_idx, torch.Tensor):
            raise TypeError(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
        _check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), None, topk_idx.device, 2)
        num_ranks = self.group_size
        if not (_is_int(num_experts) and num_experts > 0 and num_experts % num_ranks == 0):
            raise ValueError(f"num_experts must be a positive multiple of the group size "
                             f"{num_ranks}, got {num_experts!r}")
        _check_stream_options(previous_event, async_finish, allocate_on_comm_stream)
        device = topk_idx.device
        calls = _Calls(device, previous_event, async_finish, allocate_on_comm_stream,
                       self._comm_stream(device))
        with calls.before():
            idx = topk_idx.long()
            valid = (idx >= 0) & (idx < num_experts)
            num_tokens_per_expert = torch.bincount(idx[valid], minlength=num_experts).int()
            owner = torch.where(valid, idx // (num_experts // num_ranks), num_ranks)
            hits = torch.zeros((idx.shape[0], num_ranks + 1), dtype=torch.bool, device=device)
            hits.scatter_(1, owner, True)
            is_token_in_rank = hits[:, :num_ranks].contiguous()
            num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
            num_tokens_per_rdma_rank = None
            if num_ranks > _NUM_MAX_NVL_PEERS and num_ranks % _NUM_MAX_NVL_PEERS == 0:
                num_tokens_per_rdma_rank = is_token_in_rank.view(
                    -1, num_ranks // _NUM_MAX_NVL_PEERS, _NUM_MAX_NVL_PEERS).any(2).sum(
                        0, dtype=torch.int32)
        event = EventOverlap()
        if calls.cuda:
            if calls.on_comm:
                calls.keep(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
                           is_token_in_rank)
                if not torch.cuda.is_current_stream_capturing():
                    for tensor in calls.made:
                        tensor.record_stream(calls.compute)
                event = EventOverlap(EventHandle())
                event.event.record(calls.comm)
            elif async_finish:
                event = _EPBuffer.capture()
        return (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
                is_token_in_rank, event)

    # -- internal buffers ----------------------------------------------------------------
    def _share(self, rows: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Every rank's int64 row (all the same length), [R, n], on the collective's device
        (CPU for gloo)."""
        where = torch.device("cpu") if self._gather_on_host else device
        mine = torch.cat([row.reshape(-1).to(device=where, dtype=torch.int64) for row in rows])
        parts = [torch.empty_like(mine) for _ in range(self.group_size)]
        dist.all_gather(parts, mine, group=self.group)
        return torch.stack(parts)

    def _header(self, values: tuple, device: torch.device) -> torch.Tensor:
        """`values` as an int64 tensor where `_share` gathers: on CUDA without a host-to-device
        copy (none is allowed while a CUDA graph is captured), kept for the next call."""
        if self._gather_on_host or device.type != "cuda":
            return torch.tensor(values)
        header = self._headers.get((values, device))
        if header is None:
            if len(self._headers) >= 64:
                self._headers.clear()
            header = torch.empty(len(values), dtype=torch.int64, device=device)
            for index, value in enumerate(values):
                header[index].fill_(value)
            self._headers[(values, device)] = header
        return header

    def _inner_buffer(self, hidden: int, num_topk: int, device: torch.device,
                      num_tokens: int, header: Optional[list], worst: int) -> _EPBuffer:
        """The internal buffer for `(hidden, num_topk)` on `device` that takes `num_tokens` on
        this rank; a new one when none exists or (synchronizing dispatch) some rank has more
        tokens than it holds. `header`: every rank's [T, H, K, E, num_worst_tokens, channels]
        when read on the host (then the same decision on every rank), else None."""
        key = (hidden, num_topk, str(device))
        inner = self._inner.get(key)
        capacity = 0 if inner is None else inner.num_max_tokens_per_rank
        if header is None:  # sync-free and read nowhere: inner exists (made with a header)
            if num_tokens > capacity:
                raise ValueError(self._no_growth(num_tokens, capacity))
            return inner
        most = max(row[0] for row in header)
        if inner is not None and most <= capacity:
            return inner
        fixed = self._fixed_max_tokens
        if fixed is not None and most > fixed:
            raise ValueError(f"a rank has {most} tokens, more than num_max_tokens_per_rank="
                             f"{fixed} given to Buffer")
        if worst and inner is not None:
            raise ValueError(self._no_growth(most, capacity))
        if fixed is not None:
            max_tokens = fixed
        elif worst:  # R * M >= num_worst_tokens: outputs are views, exactly M * R when it divides
            max_tokens = max(most, -(-max(row[4] for row in header) // self.group_size), 1)
        else:
            max_tokens = 1 << max(most - 1, 0).bit_length()
        inner = _EPBuffer(self.group, max_tokens, hidden, num_topk, backend=self._backend,
                          device=device)
        self._inner[key] = inner
        self._made.append(inner)
        return inner

    @staticmethod
    def _no_growth(num_tokens: int, capacity: int) -> str:
        return (f"x has {num_tokens} tokens, more than the {capacity} per rank the buffer holds; "
                "a dispatch with num_worst_tokens > 0 cannot grow it without a host sync: make "
                "the first dispatch with the largest token count, or pass "
                "num_max_tokens_per_rank to Buffer")

    @staticmethod
    def _state(handle) -> _HandleState:
        state = getattr(handle, "_state", None)
        if state is None and isinstance(handle, tuple) and len(handle) == 6:
            state = getattr(handle[3], "_epcomm_legacy_state", None)
        if not isinstance(state, _HandleState):
            raise TypeError("handle must be the handle a dispatch of epcomm.legacy.Buffer "
                            f"returned, got {type(handle).__name__}")
        return state

    # -- dispatch ------------------------------------------------------------------------
    def dispatch(self, x: DispatchInput, handle: Optional[tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False
                 ) -> Tuple[DispatchInput, Optional[torch.Tensor], Optional[torch.Tensor],
                            Optional[List[int]], Optional[DispatchHandle], EventOverlap]:
        """Send each token to every rank holding one of its top-k experts (collective).

        `R` ranks, `E` experts (`E_l = E // R` per rank), `T` tokens here, `H` hidden, `K` top-k
        slots, `N` rows received (exactly `num_worst_tokens` when that is > 0).

        Args:
            x: [T, H] bf16, or a tuple (x_fp8 [T, H] float8_e4m3fn, scales [T, ceil(H / 128)]
                float32 or int32, one scale per 128 channels; moved as bytes).
            handle: a handle from an earlier dispatch of the same routing (cached dispatch: no
                count exchange); then only `x` (same `T` and `H`) and the stream options count,
                and `topk_idx` / `topk_weights` must be None.
            num_tokens_per_rank: [R] int32, from `get_dispatch_layout` (required without
                `handle`).
            num_tokens_per_rdma_rank: DeepEP's per-node counts; accepted and unused.
            is_token_in_rank: [T, R] bool, from `get_dispatch_layout` (required without
                `handle`; becomes `handle[4]`).
            num_tokens_per_expert: [E] int32, from `get_dispatch_layout` (required without
                `handle`); gives `E`, a multiple of `R`.
            topk_idx: [T, K] int64 (or int32) global expert ids, -1 for none (ids outside
                [-1, E) raise). With `topk_weights`, or both None: then rows go where
                `is_token_in_rank` says and no top-k tensors are received.
            topk_weights: [T, K] float32 weights, with `topk_idx`.
            expert_alignment: int >= 1; each local expert's count in
                `num_recv_tokens_per_expert_list` is rounded up to a multiple of it.
            num_worst_tokens: 0: exact outputs and a host sync; > 0 (with `topk_idx`, on every
                rank): outputs of exactly this many rows, no host sync; it must be at least the
                rows this rank receives.
            config: a `Config` (its `num_sms`, even, sets the handle's channels); None:
                `Buffer.num_sms`.
            previous_event: work to wait for first (an `EventOverlap`).
            async_finish: if True, the current stream does not wait: wait on the returned event.
            allocate_on_comm_stream: allocate outputs on the comm stream (requires
                `previous_event` and `async_finish`).

        Returns:
            recv_x: [N, H] bf16, or a tuple (fp8 [N, H], scales [N, ceil(H / 128)]) like `x`;
                rows ordered by source rank, then source token index. With `num_worst_tokens`,
                rows past the received ones are unspecified.
            recv_topk_idx: [N, K] of `topk_idx`'s dtype: the local expert id (0..E_l-1) of each
                slot whose expert is on this rank, else -1 (all -1 past the received rows);
                None without `topk_idx` and for a cached dispatch.
            recv_topk_weights: [N, K] float32: the slot's weight where `recv_topk_idx >= 0`,
                else 0; None without `topk_idx` and for a cached dispatch.
            num_recv_tokens_per_expert_list: list of E_l ints, the (row, slot) pairs received
                per local expert, each rounded up to `expert_alignment`; `[]` with
                `num_worst_tokens`; None for a cached dispatch.
            handle: a `DispatchHandle` (DeepEP's six tensors) for combine and cached dispatch;
                None for a cached dispatch.
            event: an `EventOverlap` (empty unless `async_finish`).
        """
        self._check_alive()
        rows = _payload(x)
        device = rows[0].device
        num_channels = _num_channels(config, Buffer.num_sms)
        _check_stream_options(previous_event, async_finish, allocate_on_comm_stream)
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("a cached dispatch (handle given) takes no topk_idx and no "
                                 "topk_weights")
            return self._cached_dispatch(rows, handle, previous_event, async_finish,
                                         allocate_on_comm_stream)
        num_ranks, rank = self.group_size, self.rank
        missing = [name for name, value in (("num_tokens_per_rank", num_tokens_per_rank),
                                            ("is_token_in_rank", is_token_in_rank),
                                            ("num_tokens_per_expert", num_tokens_per_expert))
                   if value is None]
        if missing:
            raise ValueError(f"dispatch without handle requires {', '.join(missing)} "
                             "(from get_dispatch_layout)")
        num_tokens, hidden = rows[0].shape
        _check_tensor("is_token_in_rank", is_token_in_rank, (torch.bool,),
                      (num_tokens, num_ranks), device)
        _check_tensor("num_tokens_per_rank", num_tokens_per_rank, (torch.int32,), (num_ranks,),
                      device)
        _check_tensor("num_tokens_per_expert", num_tokens_per_expert, (torch.int32,), (None,),
                      device)
        num_experts = num_tokens_per_expert.shape[0]
        if num_experts == 0 or num_experts % num_ranks:
            raise ValueError(f"num_tokens_per_expert must have a positive multiple of the group "
                             f"size {num_ranks} entries (one per expert), got {num_experts}")
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("topk_idx and topk_weights must be given together (or both None)")
        has_topk = topk_idx is not None
        if has_topk:
            _check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), (num_tokens, None),
                          device)
            if topk_idx.shape[1] == 0:
                raise ValueError("topk_idx must have at least one column (top-k slot)")
            _check_tensor("topk_weights", topk_weights, (torch.float32,),
                          tuple(topk_idx.shape), device)
        if not (_is_int(expert_alignment) and expert_alignment >= 1):
            raise ValueError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
        if not (_is_int(num_worst_tokens) and num_worst_tokens >= 0):
            raise ValueError(f"num_worst_tokens must be an int >= 0, got {num_worst_tokens!r}")
        if num_worst_tokens and not has_topk:
            raise ValueError("num_worst_tokens > 0 requires topk_idx and topk_weights")
        worst = num_worst_tokens > 0
        num_local = num_experts // num_ranks

        calls = _Calls(device, previous_event, async_finish, allocate_on_comm_stream,
                       self._comm_stream(device))
        with calls.before():
            if has_topk:
                routing = topk_idx
            else:  # one slot per rank: its first local expert where the token goes
                first = torch.arange(num_ranks, device=device) * num_local
                routing = torch.where(is_token_in_rank, first, -1)
            num_topk = routing.shape[1]
            channel_prefix, send_head = _channel_layout(is_token_in_rank, num_channels)
            header = self._header((num_tokens, hidden, num_topk, num_experts, num_worst_tokens,
                                   num_channels), device)
            shared = self._share([header, num_tokens_per_rank, channel_prefix,
                                  num_tokens_per_expert], device)
            # Read on the host when the call may sync anyway, or must agree on a new buffer.
            read = not worst or self._gather_on_host or \
                (hidden, num_topk, str(device)) not in self._inner
            table = shared[:, :_HEADER].tolist() if read else None
        if table is not None:
            for column, name in ((1, "hidden size"), (2, "top-k count"), (3, "num_experts"),
                                 (5, "config num_sms")):
                if len({row[column] for row in table}) != 1:
                    raise ValueError(f"ranks disagree on the {name}: "
                                     f"{[row[column] for row in table]}")
        inner = self._inner_buffer(hidden, num_topk, device, num_tokens, table, num_worst_tokens)
        with calls.before():
            counts = shared[:, _HEADER:_HEADER + num_ranks]
            rank_prefix_matrix = counts.cumsum(0).to(device=device, dtype=torch.int32)
            start = _HEADER + num_ranks + rank * num_channels
            from_sources = shared[:, start:start + num_channels - 1]
            recv_channel_prefix = torch.cat([torch.zeros_like(shared[:, :1]), from_sources],
                                            dim=1).to(device=device, dtype=torch.int32)
            counts_list = None
            if not has_topk:
                start = _HEADER + num_ranks * (1 + num_channels) + rank * num_local
                per_expert = shared[:, start:start + num_local].sum(0).tolist()
                counts_list = [_round_up(c, expert_alignment) for c in per_expert]
            calls.keep(rank_prefix_matrix, channel_prefix, recv_channel_prefix, send_head)
            inner_event = calls.inner_previous_event()

        recv_x, recv_idx, recv_w, ep, event = inner.dispatch(
            tuple(rows) if len(rows) == 2 else rows[0], routing,
            topk_weights, num_experts=num_experts, expert_alignment=expert_alignment,
            do_cpu_sync=not worst, previous_event=inner_event,
            async_with_compute_stream=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)

        recv_rows = list(recv_x) if len(rows) == 2 else [recv_x]
        with calls.after(event):
            metadata = ep.recv_src_metadata[:, 0]
            recv_src_idx = torch.where(metadata >= 0, metadata % ep.num_max_tokens_per_rank,
                                       -1).to(torch.int32)
            if has_topk:
                if recv_w is not None:
                    recv_w.masked_fill_(recv_idx < 0, 0.0)
                counts_list = [] if worst else list(ep.num_recv_tokens_per_expert_list)
            else:
                recv_idx = recv_w = None
            num_rows = num_worst_tokens if worst else ep.num_recv_tokens
            if worst:
                recv_rows = [_fit_rows(part, num_rows, 0) for part in recv_rows]
                recv_idx = _fit_rows(recv_idx, num_rows, -1)
                recv_w = _fit_rows(recv_w, num_rows, 0)
                recv_src_idx = _fit_rows(recv_src_idx, num_rows, -1)
            calls.keep(recv_src_idx, *recv_rows, recv_idx, recv_w)
        event = calls.finish(event)

        state = _HandleState(inner, ep, num_rows, num_tokens, hidden, num_topk, has_topk, worst)
        recv_src_idx._epcomm_legacy_state = state
        handle = DispatchHandle((rank_prefix_matrix, channel_prefix, recv_channel_prefix,
                                 recv_src_idx, is_token_in_rank, send_head), state)
        recv_x = tuple(recv_rows) if len(rows) == 2 else recv_rows[0]
        return recv_x, recv_idx, recv_w, counts_list, handle, event

    def _cached_dispatch(self, rows, handle, previous_event, async_finish,
                         allocate_on_comm_stream):
        state = self._state(handle)
        num_tokens, hidden = rows[0].shape
        if num_tokens != state.num_tokens or hidden != state.hidden:
            raise ValueError(f"x must have shape {(state.num_tokens, state.hidden)} (the "
                             f"handle's tokens and hidden size), got {(num_tokens, hidden)}")
        if state.inner.device != rows[0].device:
            raise ValueError(f"x must be on {state.inner.device} (the handle's device), "
                             f"got {rows[0].device}")
        device = rows[0].device
        calls = _Calls(device, previous_event, async_finish, allocate_on_comm_stream,
                       state.inner.get_comm_stream())
        with calls.before():
            inner_event = calls.inner_previous_event()
        recv_x, _, _, _, event = state.inner.dispatch(
            tuple(rows) if len(rows) == 2 else rows[0], handle=state.ep,
            previous_event=inner_event, async_with_compute_stream=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        recv_rows = list(recv_x) if len(rows) == 2 else [recv_x]
        if state.worst:
            with calls.after(event):
                recv_rows = [_fit_rows(part, state.num_rows, 0) for part in recv_rows]
                calls.keep(*recv_rows)
        event = calls.finish(event)
        recv_x = tuple(recv_rows) if len(rows) == 2 else recv_rows[0]
        return recv_x, None, None, None, None, event

    # -- combine -------------------------------------------------------------------------
    def combine(self, x: torch.Tensor, handle: tuple,
                topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Send expert outputs back to their source tokens and add them up (collective; no
        weights are applied).

        `N` rows of the dispatch's `recv_x`, `T` tokens this rank dispatched, `H` hidden, `K`
        top-k slots.

        Args:
            x: [N, H] bf16, one row per `recv_x` row of the dispatch of `handle` (rows past the
                received ones, with `num_worst_tokens`, are ignored).
            handle: the `DispatchHandle` that dispatch returned.
            topk_weights: [N, K] float32 or None; needs a dispatch with `topk_idx`.
            bias: None, a [T, H] bf16 tensor, or a tuple of two (either may be None), added
                first.
            config: a `Config` (its `num_sms` must be even) or None; no other effect.
            previous_event, async_finish, allocate_on_comm_stream: as in `dispatch`.

        Returns:
            combined_x: [T, H] bf16, `bf16(bias_0 + bias_1 + the rows of every rank the token
                went to)`, summed in fp32 from 0 in a fixed order (epcomm's: by each rank's last
                top-k slot of the token; rank order without `topk_idx`); a token sent nowhere
                gets the bias sum (or 0).
            combined_topk_weights: [T, K] float32, for each slot the weight the rank owning
                its expert sent back (0 for -1 slots); None without `topk_weights`.
            event: an `EventOverlap` (empty unless `async_finish`).
        """
        self._check_alive()
        state = self._state(handle)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        device = state.inner.device
        _check_tensor("x", x, (torch.bfloat16,), (state.num_rows, state.hidden), device)
        if topk_weights is not None:
            if not state.has_topk:
                raise ValueError("topk_weights needs a dispatch with topk_idx (this handle's "
                                 "dispatch had none)")
            _check_tensor("topk_weights", topk_weights, (torch.float32,),
                          (state.num_rows, state.num_topk), device)
        if bias is None:
            biases = ()
        elif isinstance(bias, torch.Tensor):
            biases = (bias,)
        elif isinstance(bias, tuple):
            if len(bias) != 2:
                raise ValueError(f"bias must be a tensor or a tuple of two, got a tuple of "
                                 f"{len(bias)}")
            biases = tuple(b for b in bias if b is not None)
        else:
            raise TypeError(f"bias must be None, a tensor or a tuple of two tensors, "
                            f"got {type(bias).__name__}")
        for index, tensor in enumerate(biases):
            _check_tensor(f"bias[{index}]", tensor, (torch.bfloat16,),
                          (state.num_tokens, state.hidden), device)
        if config is not None:
            _num_channels(config, Buffer.num_sms)
        _check_stream_options(previous_event, async_finish, allocate_on_comm_stream)

        calls = _Calls(device, previous_event, async_finish, allocate_on_comm_stream,
                       state.inner.get_comm_stream())
        with calls.before():
            capacity = state.ep.num_recv_tokens
            if state.num_rows != capacity:  # num_worst_tokens rows <-> epcomm's capacity
                x = _fit_rows(x, capacity)  # rows past the received ones are ignored
                if topk_weights is not None:
                    topk_weights = _fit_rows(topk_weights, capacity)
            inner_event = calls.inner_previous_event()
        combined_x, combined_w, event = state.inner.combine(
            x, state.ep, topk_weights=topk_weights, bias=biases or None,
            previous_event=inner_event, async_with_compute_stream=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        return combined_x, combined_w, calls.finish(event)
