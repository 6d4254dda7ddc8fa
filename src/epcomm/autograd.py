"""Dispatch and combine as autograd functions.

The backward of dispatch is a combine through the same handle (each received row's gradient
flows back to its source token and is summed there); the backward of combine is a cached
dispatch of the output gradient. bf16 inputs only (FP8 dispatch is not differentiable).

Weight gradients: in the expand layout they are exact. In the compact layout every receiving
rank gets the token's full weights row, but the gradient returned for slot `j` is the one from
the rank that owns slot `j`'s expert; that is exact when each rank uses only the weights of its
local slots (`recv_topk_idx >= 0`), which is what an MoE layer does.
"""
from __future__ import annotations

from typing import Optional

import torch

from .buffer import Buffer
from .handle import EPHandle


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, buffer: Buffer, topk_idx, kwargs):
        recv_x, recv_topk_idx, recv_weights, handle, _ = buffer.dispatch(
            x, topk_idx, topk_weights, **kwargs)
        ctx.buffer, ctx.handle = buffer, handle
        return recv_x, recv_weights, recv_topk_idx, handle

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_weights, _grad_idx, _grad_handle):
        handle = ctx.handle
        if grad_recv_x is None:
            grad_recv_x = torch.zeros(handle.num_output_rows, handle.hidden,
                                      dtype=torch.bfloat16, device=handle.topk_idx.device)
        grad_x, grad_weights, _ = ctx.buffer.combine(grad_recv_x.to(torch.bfloat16).contiguous(),
                                                     handle, topk_weights=grad_recv_weights)
        return grad_x, grad_weights, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, bias0, bias1, buffer: Buffer, handle: EPHandle):
        biases = tuple(b for b in (bias0, bias1) if b is not None)
        combined_x, combined_weights, _ = buffer.combine(x, handle, topk_weights=topk_weights,
                                                         bias=biases or None)
        ctx.buffer, ctx.handle = buffer, handle
        ctx.has_bias = (bias0 is not None, bias1 is not None)
        return combined_x, combined_weights

    @staticmethod
    def backward(ctx, grad_combined_x, grad_combined_weights):
        buffer, handle = ctx.buffer, ctx.handle
        grad_x, _, grad_weights, _, _ = buffer.dispatch(
            grad_combined_x.to(torch.bfloat16).contiguous(), topk_weights=grad_combined_weights,
            handle=handle)
        if grad_weights is not None and not handle.do_expand:
            # Only the slots this rank owns produced a combined weight.
            grad_weights = torch.where(handle.recv_src_metadata[:, 2:] >= 0, grad_weights, 0.0)
        grad_bias = tuple(grad_combined_x if present else None for present in ctx.has_bias)
        return grad_x, grad_weights, *grad_bias, None, None


def dispatch(buffer: Buffer, x: torch.Tensor, topk_idx: torch.Tensor,
             topk_weights: Optional[torch.Tensor] = None, **kwargs):
    """Differentiable `buffer.dispatch` (bf16 `x`); keyword arguments as `Buffer.dispatch`.

    Returns `(recv_x, recv_topk_idx, recv_topk_weights, handle)`; gradients flow to `x` and
    `topk_weights`.
    """
    recv_x, recv_weights, recv_topk_idx, handle = _Dispatch.apply(x, topk_weights, buffer,
                                                                 topk_idx, kwargs)
    return recv_x, recv_topk_idx, recv_weights, handle


def combine(buffer: Buffer, x: torch.Tensor, handle: EPHandle,
            topk_weights: Optional[torch.Tensor] = None, bias=None):
    """Differentiable `buffer.combine`; returns `(combined_x, combined_topk_weights)`."""
    biases = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
    padded = tuple(biases) + (None,) * (2 - len(biases))
    return _Combine.apply(x, topk_weights, padded[0], padded[1], buffer, handle)
