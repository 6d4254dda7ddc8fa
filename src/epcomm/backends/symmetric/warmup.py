"""Every kernel variant of a symmetric backend compiled and loaded when it is made.

A module load while one of this process's kernels spins on a flag can hang (measured on the GPU
machine: a kernel waiting on one stream for a flag that a kernel on another stream would set
never progressed while that kernel was being compiled and loaded), so nothing is compiled once
calls may be in flight."""
from __future__ import annotations

import torch

from ...kernels import combine as combine_kernels
from ...kernels import dispatch as dispatch_kernels
from ...kernels.dispatch import RecordLayout, payload_words
from ...kernels.launcher import Stage


def warm_up(backend) -> None:
    """Launch every variant of `backend`'s kernels once: a one-rank exchange with no tokens on
    a scratch "heap" and sync tensor of its own (the counters it raises are the ones it waits
    for). The variants are the ones calls take: (topk_idx dtype, idx_out dtype), where the
    expand layout passes int32 metadata as idx_out, the compact layout topk_idx's dtype."""
    K, H = backend.num_topk, backend.hidden
    dev, i32 = backend.device, torch.int32
    scratch = torch.zeros(6, dtype=torch.int64, device=dev)  # counters of one rank
    bases = torch.tensor([scratch.data_ptr()], dtype=torch.int64, device=dev)
    # The real region offsets and stride (never dereferenced with no tokens): Triton types an
    # int argument i32 or i64 by its value, so they select the variants the calls will use.
    stride = backend.config.num_max_tokens_per_rank
    dispatch = Stage(bases, 0, 0, backend.dispatch_stage.region_offset, stride)
    combine = Stage(bases, 0, 3 * 8, backend.combine_stage.region_offset, stride)
    sync = torch.zeros(8, dtype=torch.int64, device=dev)
    error = torch.zeros((), dtype=i32, device=dev)
    rows = [torch.empty(0, H, dtype=torch.bfloat16, device=dev)]
    layout = RecordLayout(K, payload_words(rows))
    info = [torch.zeros(max(backend.num_ranks, 64), dtype=i32, device=dev) for _ in range(3)]
    meta = torch.empty(0, K + 2, dtype=i32, device=dev)
    hist = backend.receive_scratch(1, None)
    for idx_dtype in (torch.int32, torch.int64):
        idx = torch.empty(0, K, dtype=idx_dtype, device=dev)
        slots = torch.empty(0, K, dtype=i32, device=dev)
        send = dispatch_kernels.send_phase(backend.counts_scratch, backend.pos_scratch, idx, 1,
                                           None, rows, layout, slots)
        for compact in (True, False):  # the two variants: idx_out of idx's dtype, or none
            variant = dispatch_kernels.variant(idx, None, rows, idx_dtype if compact else i32)
            dispatch_kernels.run(
                backend.shape, dispatch, layout, sync, error, backend.timeout, send,
                dispatch_kernels.receive_phase(
                    hist, layout, max_tokens=1, num_local=1, alignment=1,
                    capacity=0, out_rows=0, expand=False, zero_padding=False, tail=False,
                    idx_out=idx if compact else None, weights_out=None, metadata=meta,
                    rank_psum=info[0], expert_counts=info[1], expert_psum=info[2],
                    rows_out=rows),
                variant=variant,
                kernel=dispatch_kernels.launcher(backend.shape, layout, backend.max_rows))
    combine_kernels.combine(backend.combine_shape, combine, backend.combine_layout, sync,
                            info[0], meta, rows[0], None, False, slots, (), rows[0], None, error,
                            backend.timeout, variant=combine_kernels.variant(rows[0], None, ()),
                            kernel=backend.combine_launcher)
    torch.cuda.synchronize(dev)
    if error.item():
        raise RuntimeError("the symmetric backend's warm-up counters did not arrive")
