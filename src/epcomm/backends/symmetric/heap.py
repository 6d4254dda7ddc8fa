"""The symmetric heap: one communication buffer per rank, mapped into every peer's address space,
and its layout (`heap_layout`).

Each rank allocates `nbytes` of zeroed memory and maps every peer's; `SymmetricHeap.bases` is a
device int64 tensor `[R]` of the peers' base addresses *as seen by this process*, which Triton
kernels turn into pointers (`addr.to(tl.pointer_type(...))`) to load from and store into peers.

- CUDA: the buffer is an ordinary caching-allocator tensor; peers open it through CUDA IPC (the
  handle `torch.multiprocessing.reductions.reduce_tensor` makes, exchanged with
  `all_gather_object`). Works with several processes on one GPU (NCCL and PyTorch's symmetric
  memory refuse that) and with one process per GPU when peer access is possible.
- CPU: the buffer is a file in /dev/shm mapped with `torch.from_file(shared=True)`; peers map the
  same file by name, then the owner unlinks it (the mappings outlive the name, so nothing leaks).
  Kernels reach it under `TRITON_INTERPRET=1`.

The bootstrap only needs `all_gather_object` and `barrier`, so any process group works (gloo too).
"""
from __future__ import annotations

import os
import socket
import uuid
from typing import Optional

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from ...fp8 import num_scales
from ...kernels.combine import CombineLayout
from ...kernels.dispatch import RecordLayout

_SHM_DIR = "/dev/shm"


def all_gather_objects(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _local_view(device: torch.device) -> tuple[str, Optional[str]]:
    """(host name, device UUID or None for CPU) of this process."""
    uid = None
    if device.type == "cuda":
        uid = str(torch.cuda.get_device_properties(device).uuid)
    return socket.gethostname(), uid


def _reason(views: list, host: str, uid: Optional[str], device: torch.device) -> str:
    """Why this rank cannot map every peer's heap ("" if it can)."""
    if any(h != host for h, _ in views):
        return "ranks are on different hosts"
    if device.type == "cpu":
        return "" if os.path.isdir(_SHM_DIR) else f"{_SHM_DIR} is missing"
    visible = {str(torch.cuda.get_device_properties(i).uuid): i
               for i in range(torch.cuda.device_count())}
    for _, peer_uid in views:
        if peer_uid == uid:
            continue
        if peer_uid not in visible:
            return f"device {peer_uid} of a peer is not visible here"
        if not torch.cuda.can_device_access_peer(device, visible[peer_uid]):
            return f"no peer access from {device} to device {peer_uid}"
    return ""


def heap_reachable(group: dist.ProcessGroup, device: torch.device,
                   local_reason: str = "") -> tuple[bool, str]:
    """Whether every rank can map every other rank's heap; the same answer on all ranks.

    CPU: all ranks on one host with /dev/shm. CUDA: all ranks on one host, and every pair of
    devices is the same device or has peer access. A non-empty `local_reason` (the caller's own
    objection on this rank) also makes the answer False. Collective over `group`; returns
    (ok, the reasons of the ranks that objected).
    """
    host, uid = _local_view(device)
    views = all_gather_objects((host, uid), group)
    reason = local_reason or _reason(views, host, uid, device)
    reasons = all_gather_objects(reason, group)
    failed = [f"rank {r}: {text}" for r, text in enumerate(reasons) if text]
    return not failed, "; ".join(failed)


class SymmetricHeap:
    """`nbytes` of zeroed memory on every rank of `group`, each mapped by all (collective).

    local: this rank's buffer (uint8 [nbytes]); bases: int64 [R] on `device`, the address of
    rank r's buffer in this process; scope: the memory-model scope of the kernels' signals
    through the heap (`kernels.sync`): "gpu" when every rank's buffer is on this process's GPU
    (one rank, or processes sharing one GPU), else "sys" (peers on other GPUs, or CPU ranks).
    """

    def __init__(self, group: dist.ProcessGroup, nbytes: int, device: torch.device) -> None:
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.nbytes = nbytes
        if device.type == "cuda":
            self.local = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            torch.cuda.synchronize(device)  # peers must see the zeros before they map it
            rebuild, args = reduce_tensor(self.local)
            views = all_gather_objects((args, _local_view(device)[1]), group)
            self._peers = [self.local if r == self.rank else rebuild(*views[r][0])
                           for r in range(self.num_ranks)]
            self.scope = "gpu" if len({uid for _, uid in views}) == 1 else "sys"
        else:
            path = os.path.join(_SHM_DIR, f"epcomm-{uuid.uuid4().hex}-r{self.rank}")
            self.local = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            paths = all_gather_objects(path, group)
            try:
                self._peers = [self.local if r == self.rank else
                               torch.from_file(paths[r], shared=True, size=nbytes,
                                               dtype=torch.uint8)
                               for r in range(self.num_ranks)]
                dist.barrier(group=group)  # everyone mapped everyone: the names can go
            finally:
                os.unlink(path)
            self.scope = "sys"
        self.bases = torch.tensor([t.data_ptr() for t in self._peers], dtype=torch.int64,
                                  device=device)

    def destroy(self) -> None:
        """Drop the mappings (the memory goes once no process maps it any more)."""
        self._peers = []
        self.local = None
        self.bases = None


def payload_words(hidden: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """int32 words of a bf16 row, and of an FP8 row and its scales."""
    return (hidden // 2,), (hidden // 4, num_scales(hidden))


def heap_layout(num_ranks: int, stride_tokens: int, hidden: int,
                num_topk: int) -> tuple[int, int, int, int]:
    """Byte offsets of one rank's heap: (combine counters, dispatch staging, combine staging,
    total bytes). The dispatch counters are at 0; records fit bf16 and FP8 rows alike.

        [dispatch counters: ready[R] | free[R] | count[R]]
        [combine counters: ready[R] | free[R] | stamp[R]] (int64; `kernels.sync`)
        [dispatch staging: R blocks x S records (`kernels.dispatch.RecordLayout`)]
        [combine staging:  R blocks x S records (`kernels.combine.CombineLayout`)]
    """
    R, S = num_ranks, stride_tokens
    record_words = max(RecordLayout(num_topk, words).words for words in payload_words(hidden))
    flags = 3 * R * 8
    dispatch_region = (2 * flags + 255) // 256 * 256
    combine_region = dispatch_region + R * S * record_words * 4
    total = combine_region + R * S * CombineLayout(hidden, num_topk).words * 4
    return flags, dispatch_region, combine_region, total
