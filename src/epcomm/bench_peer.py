"""Baselines of `python -m epcomm bench` that need one process per GPU (NCCL group, 2+ GPUs).

- `p2p_copy`: every rank copies its received bytes into a buffer on the next GPU, all ranks at
  once (each link direction carries one copy): the link roofline, logical bytes per second.
- `vdev_2d`: PyTorch's NVSHMEM all-to-all for MoE, `torch.ops.symm_mem.all_to_all_vdev_2d`
  (dispatch: one row per (token, expert) pair, sent in expert order, received grouped by local
  expert with each expert's block aligned to `major_align`) and its inverse
  `all_to_all_vdev_2d_offset` (combine: the rows back to their sources). It moves a row per
  pair where a compact dispatch moves one per (token, rank), so the bench reports its time next
  to ours and its GB/s over the same logical bytes.

Neither runs on a CPU machine or with ranks sharing a GPU; `bench.py` calls them only with one
process per GPU. A baseline that cannot run records why (`*_error`) instead of a figure.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist


def expert_order(topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs of `topk_idx` ([T, K], -1 for none) in the order
    `all_to_all_vdev_2d` takes its input rows (by global expert id, so by destination rank and
    then local expert; stable, so by token within an expert): (token of each pair, int64 [pairs];
    pairs per global expert, int64 [num_experts]).

    Example: topk_idx = [[2, 0], [-1, 2]], 4 experts -> tokens [0, 0, 1], splits [1, 0, 2, 0].
    """
    flat = topk_idx.reshape(-1).to(torch.int64)
    valid = flat >= 0
    tokens = torch.arange(topk_idx.shape[0]).repeat_interleave(topk_idx.shape[1])[valid]
    experts = flat[valid]
    order = torch.sort(experts, stable=True).indices
    return tokens[order], torch.bincount(experts, minlength=num_experts)


def p2p_copy(measure: Callable, nbytes: int, device: torch.device) -> dict:
    """Time of copying `nbytes` from this GPU into memory on the next one."""
    peer = torch.device("cuda", (device.index + 1) % torch.cuda.device_count())
    src = torch.empty(max(1, nbytes), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src, device=peer)
    return dict(measure(lambda: dst.copy_(src, non_blocking=True)), bytes=nbytes)


def _symmetric(shape, dtype, device, group_name: str) -> torch.Tensor:
    import torch.distributed._symmetric_memory as symm_mem
    tensor = symm_mem.empty(shape, dtype=dtype, device=device)
    symm_mem.rendezvous(tensor, group_name)
    return tensor


def vdev_2d(measure: Callable, rows: dict[str, torch.Tensor], topk_idx: torch.Tensor,
            num_experts: int, alignment: int, group, device: torch.device) -> dict[str, Any]:
    """Dispatch (per dtype of `rows`: [T, row bytes] uint8 on `device`) and bf16 combine
    through `all_to_all_vdev_2d`; keys `vdev2d_dispatch_<dtype>`, `vdev2d_combine` (timings with
    `pairs`, the rows this rank sent), or `vdev2d_error`."""
    num_tokens, num_topk = topk_idx.shape
    num_ranks = dist.get_world_size(group)
    tokens, splits = expert_order(topk_idx, num_experts)
    # Symmetric buffers have one size on every rank: the most rows any rank can send or get.
    max_in = num_tokens * num_topk
    max_out = num_ranks * max_in + num_experts // num_ranks * alignment
    widest = max(r.shape[1] for r in rows.values())
    try:
        import torch.distributed._symmetric_memory as symm_mem
        # NVSHMEM sizes its symmetric heap once, at start-up (1 GiB by default): enough for
        # the buffers below at the widest row (DeepSeek-V3 at EP8: 9 GB), at least 16 GiB so
        # that a smaller first configuration does not starve a later one.
        need = (3 * max_in + 2 * max_out) * widest + (64 << 20)
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(need, 16 << 30)))
        symm_mem.set_backend("NVSHMEM")
        group_name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.9
            symm_mem.enable_symm_mem_for_group(group_name)
        in_splits = _symmetric((num_experts,), torch.int64, device, group_name)
        in_splits.copy_(splits)
        out_splits = _symmetric((2, num_experts), torch.int64, device, group_name)
        back_splits = _symmetric((2, num_experts), torch.int64, device, group_name)
        tokens_dev = tokens.to(device)
        result: dict[str, Any] = {}
        for dtype, payload in rows.items():
            # Rows as bf16 elements (every row size here is even): the op moves whole rows.
            width = payload.shape[1] // 2
            inp = _symmetric((max_in, width), torch.bfloat16, device, group_name)
            inp[:tokens.numel()].copy_(payload.view(torch.bfloat16)[tokens_dev])
            out = _symmetric((max_out, width), torch.bfloat16, device, group_name)

            def dispatch(inp=inp, out=out):
                torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, in_splits, out_splits,
                                                      group_name, major_align=alignment)
            result[f"vdev2d_dispatch_{dtype}"] = dict(measure(dispatch), pairs=tokens.numel())
            if dtype == "bf16":
                back = _symmetric((max_in, width), torch.bfloat16, device, group_name)

                def combine(out=out, back=back):
                    torch.ops.symm_mem.all_to_all_vdev_2d_offset(out, back, out_splits,
                                                                 back_splits, group_name)
                result["vdev2d_combine"] = dict(measure(combine), pairs=tokens.numel())
        return result
    except Exception as exc:  # no NVSHMEM, an older torch, too little memory: say so
        return {"vdev2d_error": f"{type(exc).__name__}: {exc}"}
