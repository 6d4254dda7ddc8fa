"""`ElasticBuffer`: DeepEP V2's buffer interface (constructor, attributes, methods, return
tuples) over epcomm's backends.

An `ElasticBuffer` serves dispatch and combine through one `epcomm.Buffer` per (hidden, top-k)
pair it is used with (its "engine"): `Buffer` is the one implementation of both calls, and the
engines only fix the shapes its backends are built for.

Sizing. `num_bytes` is the communication memory one engine may take per rank: the symmetric
backend's heap (`Buffer.get_buffer_size_hint`), by the same formula for both backends, so the
limits do not depend on which backend runs.

- Given `num_max_tokens_per_rank` (M), every engine has that M and must fit `num_bytes`.
- Given `num_bytes` alone, each engine takes the largest M that fits `num_bytes` for its
  hidden size and top-k (`get_num_max_tokens_per_rank(hidden, num_topk)` says which).
- Given neither, `num_bytes` is `get_buffer_size_hint(group, M, hidden, num_topk)`.

The engine of a (hidden, top-k) pair is built when the buffer is made if `hidden` and
`num_topk` are given, else by the first dispatch with that pair (every rank makes that call
together, as every dispatch). Building one is collective and, on the symmetric backend, maps the
peers' memory and compiles its kernels (host syncs); later calls of the pair are sync-free as
any `Buffer` call. `num_topk=0` lets one buffer serve any top-k: `get_buffer_size_hint` then
sizes records for top-k up to `SIZING_TOPK`. A program that dispatches with several (hidden,
top-k) pairs holds one engine, and up to `num_bytes`, per pair.

One level of ranks: every rank of the group is a scale-up peer (scale-out size 1), on one node
(symmetric backend) or several (collective backend).
"""
from __future__ import annotations

import numbers
import os
from typing import Optional, Union

import torch
import torch.distributed as dist

from .buffer import Buffer
from .checks import check_flag, check_int
from .events import EventHandle, EventOverlap
from .handle import EPHandle
from .streams import comm_stream

__all__ = ["ElasticBuffer", "topk_idx_t", "get_physical_domain_size", "get_logical_domain_size",
           "SIZING_TOPK"]

topk_idx_t = torch.int64
"""The dtype of `topk_idx` (DeepEP's `topk_idx_t`); int32 ids are accepted too."""

SIZING_TOPK = 32
"""The top-k that `num_topk=0` sizes a buffer for (records hold ids and weights per slot)."""

_SIZE_ALIGNMENT = 2 << 20  # sizes are whole 2 MiB pages, as DeepEP's


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _heap_bytes(num_ranks: int, num_max_tokens_per_rank: int, hidden: int,
                num_topk: int) -> int:
    """Bytes of one rank's symmetric heap for (R, M, H, K) (`heap.heap_layout`)."""
    try:
        from .backends.symmetric.heap import heap_layout
    except ImportError:  # no Triton: the same arithmetic (tests keep the two equal)
        return _heap_bytes_without_triton(num_ranks, num_max_tokens_per_rank, hidden, num_topk)
    return heap_layout(num_ranks, num_max_tokens_per_rank, hidden, num_topk)[-1]


def _heap_bytes_without_triton(num_ranks: int, num_max_tokens_per_rank: int, hidden: int,
                               num_topk: int) -> int:
    def words(n: int) -> int:  # whole 16-byte vectors of int32 words
        return -(-n // 4) * 4

    scales = -(-hidden // 128)
    record = words(1 + 2 * num_topk) + max(words(hidden // 2),
                                           words(hidden // 4) + words(scales))
    combine = words((hidden + 7) // 8 * 4 + num_topk)
    counters = _align(2 * 3 * num_ranks * 8, 256)
    return counters + num_ranks * num_max_tokens_per_rank * (record + combine) * 4


def _check_group(group) -> None:
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup, "
                        f"got {type(group).__name__}")


def get_physical_domain_size(group: dist.ProcessGroup) -> tuple[int, int]:
    """(RDMA ranks, NVLink ranks) of `group` as epcomm sees it: (1, group size).

    Args:
        group: the EP process group.
    """
    _check_group(group)
    return 1, dist.get_world_size(group)


def get_logical_domain_size(group: dist.ProcessGroup,
                            allow_hybrid_mode: bool = True) -> tuple[int, int]:
    """(scale-out ranks, scale-up ranks) of `group`: (1, group size) (one level of ranks).

    Args:
        group: the EP process group.
        allow_hybrid_mode: accepted (bool); epcomm has no hybrid mode.
    """
    _check_group(group)
    check_flag("allow_hybrid_mode", allow_hybrid_mode)
    return 1, dist.get_world_size(group)


class ElasticBuffer:
    """Expert-parallel dispatch and combine with DeepEP V2's `ElasticBuffer` interface.

    Args:
        group: the EP process group (gloo for CPU tensors; NCCL, or gloo with host staging,
            for CUDA tensors).
        num_bytes: communication bytes per rank for one engine (see the module docstring),
            including `num_cpu_bytes`; None: `get_buffer_size_hint(group, M, hidden,
            num_topk, ...)` (then M and hidden are required).
        num_cpu_bytes: DeepEP's host-memory part of `num_bytes` (Engram storage), int >= 0,
            less than `num_bytes`; epcomm allocates no host buffer, the rest is the budget.
        num_max_tokens_per_rank: M, the default and largest tokens per rank of one dispatch
            (the same on every rank); 0: each engine's largest M that fits `num_bytes`.
        hidden: H for sizing, 0 if unknown (int >= 0).
        num_topk: K for sizing, 0: any top-k (sized for up to `SIZING_TOPK`).
        use_fp8_dispatch: whether dispatch inputs will be FP8 tuples (sizing: records hold a
            bf16 row or an FP8 row with its scales alike).
        deterministic: accepted: epcomm's results are deterministic in every mode (the order
            DeepEP's deterministic sort produces; `EPHandle.deterministic_sort`).
        allow_hybrid_mode: accepted (one level of ranks: no hybrid mode).
        allow_multiple_reduction: True: an expand-layout combine reduces each token's local
            rows on the receiver first, then across ranks; False: one reduction on the source,
            in top-k slot order (`combine`).
        prefer_overlap_with_compute: accepted; the symmetric backend's kernels use
            `get_theoretical_num_sms` programs either way.
        sl_idx: RDMA service level (int >= 0, `EP_OVERRIDE_RDMA_SL` overrides it): accepted,
            no RDMA here.
        num_allocated_qps: RDMA queue pairs to allocate, 0: automatic (129 with hybrid mode,
            else 17, as DeepEP without fast RDMA atomics); a call's `num_qps` must not exceed
            it. No RDMA here: nothing is allocated.
        num_cpu_timeout_secs: how long a host wait for peers may take (CPU buffers).
        num_gpu_timeout_secs: how long a device wait for peers may take (CUDA buffers).
        explicitly_destroy: True: call `destroy()` to release the memory; False: it is
            released when the buffer is garbage collected (and `destroy()` raises).
        backend: epcomm's backend: "auto", "collective" or "symmetric" (keyword only).
        device: where tensors live (keyword only); default the current CUDA device, else CPU.

    Attributes: group, rank_idx, num_ranks, num_bytes, num_cpu_bytes, num_max_tokens_per_rank,
    hidden, num_topk, use_fp8_dispatch, deterministic, allow_hybrid_mode,
    allow_multiple_reduction, prefer_overlap_with_compute, sl_idx, num_allocated_qps,
    num_cpu_timeout_secs, num_gpu_timeout_secs, explicitly_destroy, num_scaleout_ranks (1),
    num_scaleup_ranks (R), scaleout_rank_idx (0), scaleup_rank_idx (the rank), num_rdma_ranks
    (1), num_nvlink_ranks (R), num_sms (`get_theoretical_num_sms`), device.
    """

    def __init__(self, group: dist.ProcessGroup, num_bytes: Optional[int] = None,
                 num_cpu_bytes: int = 0, num_max_tokens_per_rank: int = 0, hidden: int = 0,
                 num_topk: int = 0, use_fp8_dispatch: bool = False, deterministic: bool = False,
                 allow_hybrid_mode: bool = True, allow_multiple_reduction: bool = True,
                 prefer_overlap_with_compute: bool = True, sl_idx: int = 3,
                 num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False, *,
                 backend: str = "auto",
                 device: Optional[Union[str, torch.device]] = None) -> None:
        _check_group(group)
        num_cpu_bytes = check_int("num_cpu_bytes", num_cpu_bytes)
        num_max_tokens_per_rank = check_int("num_max_tokens_per_rank", num_max_tokens_per_rank)
        hidden = check_int("hidden", hidden)
        num_topk = check_int("num_topk", num_topk)
        self.use_fp8_dispatch = check_flag("use_fp8_dispatch", use_fp8_dispatch)
        self.deterministic = check_flag("deterministic", deterministic)
        self.allow_hybrid_mode = check_flag("allow_hybrid_mode", allow_hybrid_mode)
        self.allow_multiple_reduction = check_flag("allow_multiple_reduction",
                                                   allow_multiple_reduction)
        self.prefer_overlap_with_compute = check_flag("prefer_overlap_with_compute",
                                                      prefer_overlap_with_compute)
        self.explicitly_destroy = check_flag("explicitly_destroy", explicitly_destroy)
        sl_idx = check_int("sl_idx", sl_idx)
        if "EP_OVERRIDE_RDMA_SL" in os.environ:
            sl_idx = int(os.environ["EP_OVERRIDE_RDMA_SL"])
        self.sl_idx = sl_idx
        num_allocated_qps = check_int("num_allocated_qps", num_allocated_qps)
        self.num_allocated_qps = num_allocated_qps or (129 if self.allow_hybrid_mode else 17)
        for name, value in (("num_cpu_timeout_secs", num_cpu_timeout_secs),
                            ("num_gpu_timeout_secs", num_gpu_timeout_secs)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.num_cpu_timeout_secs, self.num_gpu_timeout_secs = num_cpu_timeout_secs, \
            num_gpu_timeout_secs
        if backend not in ("auto", "collective", "symmetric"):
            raise ValueError("backend must be 'auto', 'collective' or 'symmetric', "
                             f"got {backend!r}")
        if device is not None and not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) \
                if torch.cuda.is_available() else torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

        self.group = group
        self.rank_idx = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.num_scaleout_ranks, self.num_scaleup_ranks = self.get_logical_domain_size()
        self.scaleout_rank_idx = self.rank_idx // self.num_scaleup_ranks
        self.scaleup_rank_idx = self.rank_idx % self.num_scaleup_ranks
        self.num_rdma_ranks, self.num_nvlink_ranks = self.get_physical_domain_size()

        if num_bytes is None:
            if num_cpu_bytes:
                raise ValueError("num_cpu_bytes needs num_bytes (it is a part of it)")
            if not (num_max_tokens_per_rank and hidden):
                raise ValueError("give num_bytes, or num_max_tokens_per_rank and hidden (and "
                                 "num_topk) to size the buffer")
            num_bytes = self.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden,
                                                  num_topk, self.use_fp8_dispatch,
                                                  self.allow_hybrid_mode,
                                                  self.allow_multiple_reduction)
        num_bytes = check_int("num_bytes", num_bytes, 1)
        if num_cpu_bytes >= num_bytes:
            raise ValueError(f"num_cpu_bytes={num_cpu_bytes} must be less than "
                             f"num_bytes={num_bytes} (it is a part of it)")
        self.num_bytes, self.num_cpu_bytes = num_bytes, num_cpu_bytes
        self.num_max_tokens_per_rank, self.hidden, self.num_topk = \
            num_max_tokens_per_rank, hidden, num_topk
        self._backend_choice = backend
        self.num_sms = self._default_num_sms()
        self._engines: dict[tuple[int, int], Buffer] = {}  # (hidden, top-k) -> engine
        self._by_id: dict[int, Buffer] = {}  # engine.buffer_id -> engine (for handles)
        self._destroyed = False
        if hidden and num_topk:
            self._engine(hidden, num_topk)
        dist.barrier(group=group)  # every rank has made it before any uses it

    # -- information -----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank in the group (`rank_idx`; `Buffer`'s name for it)."""
        return self.rank_idx

    @property
    def backend(self) -> str:
        """The backend of the engines ("collective" or "symmetric"; the requested choice
        before the first engine is made)."""
        for engine in self._engines.values():
            return engine.backend
        return self._backend_choice

    def _default_num_sms(self) -> int:
        """The kernel programs of every engine: one per 16 tokens of M up to the SM count (all
        SMs when M is derived per engine); 1 on CPU (the interpreter runs one program)."""
        if self.device.type != "cuda":
            return 1
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if self.num_max_tokens_per_rank:
            return max(1, min(sms, -(-self.num_max_tokens_per_rank // 16)))
        return sms

    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int,
                             hidden: int, num_topk: int = 0, use_fp8_dispatch: bool = False,
                             allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes per rank for one engine of (M, H, K) on `group`: the symmetric heap (R * M
        dispatch records of a bf16 or FP8 row with ids, weights and source index, R * M
        combine rows with weights, counters), rounded up to 2 MiB. The same for bf16 and FP8
        dispatch, for both reduction modes and with or without hybrid mode.

        Args:
            group: the EP process group (its size R).
            num_max_tokens_per_rank: M, int >= 1.
            hidden: H, int >= 1.
            num_topk: K, int >= 0; 0 sizes for top-k up to `SIZING_TOPK`.
            use_fp8_dispatch, allow_hybrid_mode, allow_multiple_reduction: bools (no effect
                on the size).
        """
        _check_group(group)
        num_max_tokens_per_rank = check_int("num_max_tokens_per_rank", num_max_tokens_per_rank,
                                            1)
        hidden = check_int("hidden", hidden, 1)
        num_topk = check_int("num_topk", num_topk)
        for name, value in (("use_fp8_dispatch", use_fp8_dispatch),
                            ("allow_hybrid_mode", allow_hybrid_mode),
                            ("allow_multiple_reduction", allow_multiple_reduction)):
            check_flag(name, value)
        nbytes = _heap_bytes(dist.get_world_size(group), num_max_tokens_per_rank, hidden,
                             num_topk or SIZING_TOPK)
        return _align(nbytes, _SIZE_ALIGNMENT)

    def get_num_max_tokens_per_rank(self, hidden: int, num_topk: int) -> int:
        """The M an engine of (hidden, num_topk) has: `num_max_tokens_per_rank` if the buffer
        was given one, else the largest M whose heap fits `num_bytes` (0 if none fits).

        Args:
            hidden: H, int >= 1.
            num_topk: K, int >= 1.
        """
        hidden = check_int("hidden", hidden, 1)
        num_topk = check_int("num_topk", num_topk, 1)
        if self.num_max_tokens_per_rank:
            return self.num_max_tokens_per_rank
        budget = self.num_bytes - self.num_cpu_bytes
        base = _heap_bytes(self.num_ranks, 0, hidden, num_topk)
        per_token = _heap_bytes(self.num_ranks, 1, hidden, num_topk) - base
        return max(0, (budget - base) // per_token)

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int,
                                num_scaleout_topk: int = 0, rdma_gbs: float = 0,
                                nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """The SMs (kernel programs) dispatch and combine use with `num_sms=0`: the buffer's
        `num_sms`, fixed when it is made (the symmetric backend's kernels are built for it;
        the collective backend ignores it). The bandwidth arguments of DeepEP's estimate are
        checked and do not change it.

        Args:
            num_experts: E, int >= 1.
            num_topk: K, int >= 1.
            num_scaleout_topk: must be 0 (as DeepEP).
            rdma_gbs, nvlink_gbs, sm_read_gbs, sm_write_gbs: numbers >= 0.
        """
        check_int("num_experts", num_experts, 1)
        check_int("num_topk", num_topk, 1)
        if check_int("num_scaleout_topk", num_scaleout_topk):
            raise ValueError("num_scaleout_topk must be 0")
        for name, value in (("rdma_gbs", rdma_gbs), ("nvlink_gbs", nvlink_gbs),
                            ("sm_read_gbs", sm_read_gbs), ("sm_write_gbs", sm_write_gbs)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        return self.num_sms

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """DeepEP's queue-pair count for `num_sms` SMs (int >= 1): `num_sms * 16 + 1` with
        hybrid mode, else `min(num_sms, 9)`, at most `num_allocated_qps`. No RDMA here: the
        value is only accepted back as `num_qps`."""
        num_sms = check_int("num_sms", num_sms, 1)
        num_qps = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 8 + 1)
        return min(num_qps, self.num_allocated_qps)

    def get_physical_domain_size(self) -> tuple[int, int]:
        """(RDMA ranks, NVLink ranks): (1, R)."""
        return get_physical_domain_size(self.group)

    def get_logical_domain_size(self) -> tuple[int, int]:
        """(scale-out ranks, scale-up ranks): (1, R)."""
        return get_logical_domain_size(self.group, self.allow_hybrid_mode)

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The communication stream of this process's device (None for CPU buffers)."""
        return comm_stream(self.device)

    @staticmethod
    def capture() -> Union[EventHandle, EventOverlap]:
        """An event recorded on the current CUDA stream, for `previous_event` and
        `previous_event_before_epilogue` (which take an `EventHandle` as well as an
        `EventOverlap`).

        With CUDA: a bare `EventHandle`, as DeepEP's `ElasticBuffer.capture()` returns (it
        has `current_stream_wait()`, `wait()`, `synchronize()`; it has no `.event` and no
        hooks). Without CUDA (a CPU-only torch): an empty `EventOverlap` (`.event` is None), since
        no CUDA event can be made; waiting on it does nothing.
        (`Buffer.capture()`, DeepEP's legacy one, returns an `EventOverlap` either way.)"""
        if not torch.cuda.is_available():
            return EventOverlap()
        event = EventHandle()
        event.record()
        return event

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False,
                sequential: bool = True) -> None:
        """Wait until every rank of the group has reached this point (the ranks meet on the
        host, `torch.distributed.barrier`).

        Args:
            use_comm_stream: accepted (bool): the barrier waits for no stream.
            with_cpu_sync: also synchronize the device before and after (CUDA buffers).
            sequential: accepted (bool): there is one kind of barrier.
        """
        check_flag("use_comm_stream", use_comm_stream)
        with_cpu_sync = check_flag("with_cpu_sync", with_cpu_sync)
        check_flag("sequential", sequential)
        self._check_alive()
        cuda = with_cpu_sync and self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        if cuda:
            torch.cuda.synchronize(self.device)

    def check_errors(self) -> None:
        """Raise `EPError` for an error a sync-free call flagged on the device (see
        `Buffer.check_errors`; reads the flags back, so it synchronizes)."""
        for engine in self._engines.values():
            engine.check_errors()

    def destroy(self) -> None:
        """Release the communication memory of every engine (needs `explicitly_destroy=True`);
        the buffer cannot be used afterwards."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs explicitly_destroy=True when the buffer is made "
                               "(otherwise its memory is released when it is garbage collected)")
        for engine in self._engines.values():
            engine.destroy()
        self._engines.clear()
        self._by_id.clear()
        self._destroyed = True

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this ElasticBuffer was destroyed")

    # -- engines ---------------------------------------------------------------------------
    def _engine(self, hidden: int, num_topk: int) -> Buffer:
        """The engine of (hidden, num_topk), made now if needed (collective)."""
        engine = self._engines.get((hidden, num_topk))
        if engine is not None:
            return engine
        self._check_alive()
        max_tokens = self.get_num_max_tokens_per_rank(hidden, num_topk)
        need = _heap_bytes(self.num_ranks, max(1, max_tokens), hidden, num_topk)
        if max_tokens < 1 or need > self.num_bytes - self.num_cpu_bytes:
            raise ValueError(
                f"hidden={hidden} with top-{num_topk} needs {need} bytes per rank for "
                f"num_max_tokens_per_rank={max(1, max_tokens)} (R={self.num_ranks}), more than "
                f"num_bytes={self.num_bytes} (less num_cpu_bytes={self.num_cpu_bytes}): make the "
                f"buffer with ElasticBuffer.get_buffer_size_hint(group, M, {hidden}, {num_topk})")
        timeout = self.num_gpu_timeout_secs if self.device.type == "cuda" else \
            self.num_cpu_timeout_secs
        engine = Buffer(self.group, max_tokens, hidden, num_topk,
                        use_fp8_dispatch=self.use_fp8_dispatch, deterministic=self.deterministic,
                        backend=self._backend_choice, num_sms=self.num_sms, device=self.device,
                        timeout_s=timeout, allow_multiple_reduction=self.allow_multiple_reduction)
        self._engines[(hidden, num_topk)] = engine
        self._by_id[engine.buffer_id] = engine
        return engine

    def _dispatch_engine(self, x, topk_idx) -> Buffer:
        """The engine of a dispatch without a handle, its inputs' types checked first."""
        self._check_alive()
        rows = x[0] if isinstance(x, (tuple, list)) and len(x) == 2 else x
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"x must be a bf16 torch.Tensor or a tuple (x_fp8, scales), "
                            f"got {type(x).__name__}")
        if rows.dim() != 2:
            raise ValueError(f"x must be 2-D [num_tokens, hidden], got shape {tuple(rows.shape)}")
        if topk_idx is None:
            raise ValueError("topk_idx is required unless a handle is given")
        if not isinstance(topk_idx, torch.Tensor):
            raise TypeError(f"topk_idx must be a torch.Tensor, got {type(topk_idx).__name__}")
        if topk_idx.dim() != 2 or topk_idx.shape[1] < 1:
            raise ValueError(f"topk_idx must be 2-D [num_tokens, num_topk] with num_topk >= 1, "
                             f"got shape {tuple(topk_idx.shape)}")
        if rows.shape[1] < 1:
            raise ValueError("x must have hidden >= 1")
        return self._engine(rows.shape[1], topk_idx.shape[1])

    def _handle_engine(self, handle) -> Buffer:
        """The engine that made `handle`."""
        self._check_alive()
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be an EPHandle, got {type(handle).__name__}")
        engine = self._by_id.get(handle.buffer_id)
        if engine is None:
            raise ValueError("handle was made by another buffer; use the buffer that "
                             "dispatched it")
        return engine

    def _check_qps(self, num_qps) -> None:
        if check_int("num_qps", num_qps) > self.num_allocated_qps:
            raise ValueError(f"num_qps={num_qps} is more than num_allocated_qps="
                             f"{self.num_allocated_qps}")

    # -- dispatch and combine --------------------------------------------------------------
    def dispatch(self, x, topk_idx: Optional[torch.Tensor] = None,
                 topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                 num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None,
                 expert_alignment: Optional[int] = None, num_sms: int = 0, num_qps: int = 0,
                 previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True,
                 do_cpu_sync: Optional[bool] = None, do_expand: bool = False,
                 do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """Send every token to the ranks holding its top-k experts (`Buffer.dispatch`).

        R ranks, E experts, E_l = E // R local experts, K top-k slots, H hidden, T tokens on
        this rank, M this call's `num_max_tokens_per_rank`, a the expert alignment. Exact row
        order, rounding and padding: docs/semantics.md.

        Args:
            x: [T, H] bf16, or a tuple (x_fp8 [T, H] float8_e4m3fn, scales [T, ceil(H/128)]
                float32, or int32 packs of four UE8M0 exponents); T <= M. Its hidden size and
                the top-k pick the engine.
            topk_idx: [T, K] `topk_idx_t` (int64) or int32 global expert ids, -1 for none;
                must be None with `handle` (the handle's routing is used).
            topk_weights: [T, K] float32 weights sent with each token, or None (also with
                `handle`, e.g. a backward pass).
            cumulative_local_expert_recv_stats: [E_l] int32, contiguous, on the buffer's
                device, or None: the (token, slot) pairs received per local expert are added
                in place on the call's stream (no host sync), cached dispatches included.
            num_experts: E, divisible by R; from the handle with `handle`.
            num_max_tokens_per_rank: M, at most the engine's (the same on every rank): the
                per-source stride of `recv_src_metadata[:, 0]` and the sync-free capacity.
                None: the buffer's (the engine's), or with `handle` the handle's.
            expert_alignment: a, int >= 1 (None: 1; with `handle`, None or the handle's).
            num_sms: 0 (automatic: `num_sms` of the buffer or the handle) or the buffer's
                `num_sms`; the symmetric backend rejects another value (its kernels are built
                for one program count), the collective backend ignores it.
            num_qps: int >= 0, at most `num_allocated_qps`; accepted and ignored (no RDMA).
            previous_event: an `EventOverlap` (e.g. `capture()`), `EventHandle` or
                `torch.cuda.Event`: the comm stream waits on it instead of the current stream
                (needs `allocate_on_comm_stream=True`).
            previous_event_before_epilogue: an event the call waits for before writing its
                outputs (epcomm's dispatch is one step: the whole call waits), or None.
            async_with_compute_stream: True: the current stream does not wait; call
                `event.current_stream_wait()` before reading the outputs.
            allocate_on_comm_stream: allocate the outputs from the comm stream's pool.
            handle: an `EPHandle` of this buffer: cached dispatch (the handle's routing,
                layout and sizes, no count exchange, no host sync); returns the same handle.
            do_handle_copy: the handle keeps a copy of `topk_idx` (else the caller's tensor).
            do_cpu_sync: True: exact-size outputs and `handle.num_recv_tokens_per_expert_list`
                (a host sync). False: capacity-size outputs, counts on the device only, no host
                sync (CUDA-graph capturable). None: True, or with `handle` no sync (True with
                `handle` raises ValueError).
            do_expand: False: compact layout, one row per (source token, this rank), in
                source-rank then token order. True: expand layout, one row per (token, local
                expert slot), grouped by local expert.
            do_zero_padding: zero the rows that carry no token (alignment gaps, sync-free tail).
            use_tma_aligned_col_major_sf: FP8 input: received scales column-major with a
                16-byte aligned column stride (one extra copy); ignored for bf16.

        Returns:
            recv_x: [N, H] bf16, or (fp8 [N, H], scales [N, ceil(H/128)]); N = compact
                `handle.num_recv_tokens` or expand `handle.num_expanded_tokens` rows (exact
                with `do_cpu_sync`, else the capacity: compact R * M, expand
                align(R * M * min(K, E_l) + (a - 1) * E_l, a)); rows past the valid prefix hold
                no token.
            recv_topk_idx: compact [N, K] (topk_idx's dtype) local expert ids, -1 for other
                ranks' experts and past the valid prefix; None in the expand layout.
            recv_topk_weights: compact [N, K] float32 (each token's full weights row), expand
                [N] float32 (the row's slot weight), 0 past the valid prefix; None without
                `topk_weights`.
            handle: the `EPHandle` for combine and cached dispatch.
            event: an `EventOverlap` (its `.event` an `EventHandle` on CUDA, None on CPU).
        """
        if handle is None:
            try:
                engine = self._engines[
                    (x if x.__class__ is torch.Tensor else x[0]).shape[1], topk_idx.shape[1]]
            except (AttributeError, TypeError, IndexError, KeyError):
                engine = self._dispatch_engine(x, topk_idx)
        else:
            engine = self._handle_engine(handle)
            if topk_idx is not None:
                raise ValueError("topk_idx must be None with handle (a cached dispatch uses "
                                 "the handle's routing)")
            if do_cpu_sync is not None and check_flag("do_cpu_sync", do_cpu_sync):
                raise ValueError("do_cpu_sync=True cannot be used with handle: a cached "
                                 "dispatch has the handle's sizes and never syncs (pass None "
                                 "or False)")
            if expert_alignment is not None and \
                    check_int("expert_alignment", expert_alignment, 1) != handle.expert_alignment:
                raise ValueError(f"expert_alignment={expert_alignment} differs from the "
                                 f"handle's {handle.expert_alignment}")
        if num_qps:
            self._check_qps(num_qps)
        return engine.dispatch(x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                               expert_alignment, do_cpu_sync, do_expand, do_zero_padding,
                               handle, previous_event, async_with_compute_stream,
                               allocate_on_comm_stream, do_handle_copy,
                               cumulative_local_expert_recv_stats, num_sms, num_qps,
                               previous_event_before_epilogue, use_tma_aligned_col_major_sf)

    def combine(self, x: torch.Tensor, handle: EPHandle,
                topk_weights: Optional[torch.Tensor] = None, bias=None, num_sms: int = 0,
                num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream: bool = False,
                allocate_on_comm_stream: bool = False):
        """Bring expert outputs back to their source tokens and reduce them (`Buffer.combine`).

        Args:
            x: bf16 [handle.num_recv_tokens, H] (compact) or [handle.num_expanded_tokens, H]
                (expand): the expert outputs in the dispatch output's rows; rows past the valid
                prefix (and expand alignment gaps) are ignored, NaN there is fine.
            handle: the `EPHandle` of that dispatch (of this buffer).
            topk_weights: float32 [num_recv_tokens, K] (compact) or [num_expanded_tokens]
                (expand), sent back to each slot's source, or None.
            bias: None, a [T, H] bf16 tensor, or a tuple of two, added first (in fp32).
            num_sms: 0 (the handle's) or the buffer's `num_sms` (as in dispatch).
            num_qps: int >= 0, at most `num_allocated_qps`; accepted and ignored.
            previous_event, previous_event_before_epilogue, async_with_compute_stream,
                allocate_on_comm_stream: as in `dispatch`.

        Returns:
            combined_x: [T, H] bf16 (T = the dispatch's tokens). Compact layout, and expand
                layout with `allow_multiple_reduction=True`: fp32 `0 + biases`, then for each
                top-k slot j in order that is the token's last slot on its rank r, rank r's row
                (expand: the bf16 of the fp32 sum of r's local slot rows in slot order), rounded
                to bf16 once at the end. Expand layout with `allow_multiple_reduction=False`:
                fp32 `0 + biases`, then the row of every valid slot j in slot order, rounded
                once (every row travels back: one round of compact rows per slot).
            combined_topk_weights: [T, K] float32, each slot's weight sent back by its owner, 0
                for -1 slots; None without `topk_weights`.
            event: an `EventOverlap`.
        """
        try:
            engine = self._by_id[handle.buffer_id]
        except (AttributeError, KeyError):
            engine = self._handle_engine(handle)
        if num_qps:
            self._check_qps(num_qps)
        return engine.combine(x, handle, topk_weights, bias, previous_event,
                              async_with_compute_stream, allocate_on_comm_stream, num_sms,
                              num_qps, previous_event_before_epilogue)
