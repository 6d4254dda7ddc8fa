"""Dispatch and combine as registered `torch.library` custom ops, for `torch.compile`.

`epcomm.autograd.dispatch` / `combine` call these ops; use them (not the ops directly) in a
model. The ops (namespace `epcomm`):

- `epcomm::dispatch(x, x_scales?, topk_idx, topk_weights?, buffer_id, num_experts,
  num_max_tokens_per_rank, expert_alignment, do_cpu_sync, do_expand, do_zero_padding, num_sms)`:
  `Buffer.dispatch` (x [T, H] bf16, or FP8 [T, H] with `x_scales` [T, S]; topk_idx [T, K];
  topk_weights [T, K] float32). Returns `recv_x` [N, H], `recv_x_scales` [N, S] (FP8) or None,
  `recv_topk_idx` [N, K] (compact) or None, `recv_topk_weights` ([N, K] compact, [N] expand) or
  None, the handle's `key` (below), copies of the handle's
  `psum_num_recv_tokens_per_scaleup_rank` [R] and `psum_num_recv_tokens_per_expert` [E_l]
  int32, and `storage0`, `storage1` (`storage_views`: int32 [1] stand-ins for the handle's
  allocations, which the ops below take as `storage`).
- `epcomm::cached_dispatch(x, x_scales?, topk_weights?, key, storage, buffer_id, num_rows,
  do_expand, do_zero_padding, owned_weights_only)`: `Buffer.dispatch(x, topk_weights=...,
  handle=...)` through the handle `key` names (`num_rows`, `do_expand`: its output rows and layout).
  `owned_weights_only`: compact weights rows keep only the slots of this rank's experts (0
  elsewhere). Returns `recv_x`, `recv_x_scales`, `recv_topk_weights` as `dispatch`.
- `epcomm::combine(x, topk_weights?, bias0?, bias1?, key, storage, buffer_id, num_tokens)`:
  `Buffer.combine` through the handle `key` names (`num_tokens`: its T). Returns `combined_x`
  [T, H] bf16 and `combined_topk_weights` [T, K] float32 or None.

The low-latency (decode) pair has ops of its own in `epcomm.ops_low_latency` (imported on
demand: it needs Triton).

Each has a fake (meta) implementation whose shapes follow the contract: a sync-free dispatch
returns the capacity rows (compact `R * M`, expand `align(R * M * min(K, E_l) + (a - 1) * E_l)`);
a synchronizing one returns a data-dependent row count, declared to the compiler as a new
dynamic size. Autograd is registered on the ops: the backward of a dispatch (cached or not) is a
combine of the gradient through the same handle; the backward of a combine is a cached
dispatch of the gradient. An FP8 dispatch's rows have no gradient; its weights' gradient flows
as a bf16 one's.

The ops are collectives: every rank must run them in the same order. Data orders them (a
layer's dispatch, experts, combine; one layer's output is the next one's input; each backward
step needs the gradient of the one before), and every schedule keeps that. Collectives with no
data path between them (two layers on the same input) keep program order under `aot_eager`;
under Inductor give every rank the same shapes for such a graph, as its schedule may depend
on tensor sizes. (The ops are not declared as ordered effects: with torch's effect tokens a
compiled activation-checkpointed region around a dispatch fails, as AOTAutograd then saves
the op's None outputs for backward.)

How the handle and the buffer cross the op boundary:

- The buffer is named by its `buffer_id` (an int, a constant of the compiled graph); the op
  finds the live `Buffer` by it (`epcomm.buffer.live_buffer`). A destroyed buffer is gone.
- A dispatch's `EPHandle` is named by a *key*: an int64 tensor [1] on the buffer's device that
  the dispatch op returns (`key_of`). The key's memory holds the `EPHandle`, so the handle lives
  exactly as long as that memory: the key tensor and its views, wherever they are kept (a
  `Handle`, a tensor saved for backward, a compiled graph's activations). When the last of them
  is freed, the handle is freed. The key's address names the handle (its content is never
  read, so resolving a key never waits for the device); a copy of a key names nothing. There
  is no per-buffer or per-layer "current handle", so any number of layers and buffers may
  interleave their dispatches and combines.

(Tensors rather than torch's opaque objects: an opaque object cannot be created inside a
compiled region, and a handle is made by the dispatch inside it. On the device rather than the
host: Inductor cuts a CUDA graph around any CPU tensor, and every output of a dispatch is on the
device, so a compiled layer's ops stay in one CUDA graph under `mode="reduce-overhead"`.)

Under CUDA-graph replay nothing on the host runs: the captured kernels read and write the same
device tensors, which is what the sync-free path needs (its shapes never change).
"""
from __future__ import annotations

import weakref
from typing import NamedTuple, Optional, Union

import torch

from .buffer import Buffer, live_buffer
from .checks import check_tensor, dispatch_rows
from .handle import EPHandle
from .layout import expand_capacity

_LIB = torch.library.Library("epcomm", "DEF")


def define(schema: str) -> None:
    """Define the op `epcomm::<schema>` (a collective that graphs may trace: pt2-compliant)."""
    _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))


define(
    "dispatch(Tensor x, Tensor? x_scales, Tensor topk_idx, Tensor? topk_weights, int buffer_id, "
    "int num_experts, int num_max_tokens_per_rank, int expert_alignment, bool do_cpu_sync, "
    "bool do_expand, bool do_zero_padding, int num_sms) -> (Tensor recv_x, Tensor? recv_x_scales, "
    "Tensor? recv_topk_idx, Tensor? recv_topk_weights, Tensor key, "
    "Tensor psum_num_recv_tokens_per_scaleup_rank, Tensor psum_num_recv_tokens_per_expert, "
    "Tensor storage0, Tensor storage1)")
define(
    "cached_dispatch(Tensor x, Tensor? x_scales, Tensor? topk_weights, Tensor key, "
    "Tensor[] storage, int buffer_id, SymInt num_rows, bool do_expand, bool do_zero_padding, "
    "bool owned_weights_only) "
    "-> (Tensor recv_x, Tensor? recv_x_scales, Tensor? recv_topk_weights)")
define(
    "combine(Tensor x, Tensor? topk_weights, Tensor? bias0, Tensor? bias1, Tensor key, "
    "Tensor[] storage, int buffer_id, SymInt num_tokens) "
    "-> (Tensor combined_x, Tensor? combined_topk_weights)")


# -- handle keys -------------------------------------------------------------------------------
class _KeyEntry:
    """What a key's memory holds: the handle the key names, and the key's storage (its
    identity: a copy of a key is a tensor of another storage and names nothing)."""

    __slots__ = ("handle", "storage", "__weakref__")

    def __init__(self, handle) -> None:
        self.handle = handle
        self.storage = 0


# Key address -> entry of the live key there (an entry lives exactly as long as its key's memory,
# and that memory's address is not reused before it is freed).
_keys: "weakref.WeakValueDictionary[int, _KeyEntry]" = weakref.WeakValueDictionary()


def key_of(handle, device: torch.device) -> torch.Tensor:
    """A new key for `handle` (an `EPHandle`, or what `epcomm.ops_low_latency` keys): an int64
    [1] tensor on `device` whose memory keeps `handle` alive (its content is unspecified: only
    its address names the handle, so nothing is read back from the device).

    The memory is allocated as usual (in a CUDA graph's pool while one records) and carries the
    entry as an attribute of the tensor that owns it; the key is a DLPack alias of that tensor,
    whose storage holds the owner until the key and all its views are freed."""
    owner = torch.empty(1, dtype=torch.int64, device=device)
    entry = _KeyEntry(handle)
    owner._epcomm_key = entry  # (kept while a C++ reference holds the tensor: the key's storage)
    key = torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(owner))
    entry.storage = key.untyped_storage()._cdata
    _keys[key.data_ptr()] = entry
    return key


def handle_of(key: torch.Tensor):
    """The handle that `key` (a key a dispatch op returned, or a view of one) names (host
    only: reads the key's address, never its content)."""
    if not isinstance(key, torch.Tensor) or key.dtype != torch.int64 or key.shape != (1,):
        raise ValueError("key must be the int64 tensor [1] a dispatch returned as its handle "
                         f"key, got {key!r}")
    entry = _keys.get(key.data_ptr())
    if entry is None or entry.storage != key.untyped_storage()._cdata:
        raise ValueError("key names no live handle: its handle was freed, or this is a copy of "
                         "a key (a handle lives as long as the key tensor its dispatch returned "
                         "and that tensor's views; a copy names nothing)")
    return entry.handle


_STORAGE = 2  # storage views a dispatch op returns


def storage_views(handle: EPHandle, device: torch.device) -> tuple:
    """`_STORAGE` int32 [1] tensors standing for the allocations that hold `handle`'s device
    tensors (`EPHandle.storage`): a one-element view of each, then new tensors. A dispatch op
    returns them and the ops that use the handle take them, so that the graph holds those
    allocations as long as the handle is used (CUDA-graph trees require every allocation that
    stays alive in their pool to be among the graph's tensors)."""
    views = [t.view(-1)[:1] for t in handle.storage if t.numel()]
    if len(views) > _STORAGE:
        raise AssertionError(f"a handle with {len(views)} allocations")
    return (*views, *(torch.zeros(1, dtype=torch.int32, device=device)
                      for _ in range(_STORAGE - len(views))))


class Handle(NamedTuple):
    """A dispatch's handle as the compiler sees it (`epcomm.autograd.dispatch` returns one).

    key: int64 [1] on the buffer's device, names (and keeps alive) the dispatch's `EPHandle`
        (`resolve()`).
    psum_num_recv_tokens_per_scaleup_rank: [R] int32 on the buffer's device, inclusive prefix
        sum of the compact rows received from each rank (`[-1]`: the valid compact rows).
    psum_num_recv_tokens_per_expert: [E_l] int32 on the buffer's device, as `EPHandle`'s
        (expand layout: expert i owns rows `[align(psum[i-1]), psum[i])`).
    buffer_id: the `Buffer` that dispatched.
    num_tokens: T, the tokens of this rank's dispatch input (rows of the combine output).
    num_rows: rows of the dispatch output (and of the combine input): the capacity after a
        sync-free dispatch, else the exact count (a dynamic size under `torch.compile`).
    do_expand: the layout of the dispatch.
    storage: the dispatch's `storage_views` (int32 [1] tensors standing for the handle's
        allocations; passed to the ops that use the handle).

    Outside a compiled region, other attribute names read the `EPHandle` (for example
    `handle.num_recv_tokens_per_expert_list` after `do_cpu_sync=True`).
    """

    key: torch.Tensor
    psum_num_recv_tokens_per_scaleup_rank: torch.Tensor
    psum_num_recv_tokens_per_expert: torch.Tensor
    buffer_id: int
    num_tokens: Union[int, torch.SymInt]
    num_rows: Union[int, torch.SymInt]
    do_expand: bool
    storage: tuple = ()

    def resolve(self) -> EPHandle:
        """The `EPHandle` of this dispatch (host code only, not inside a compiled region)."""
        return handle_of(self.key)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    @classmethod
    def wrap(cls, handle: EPHandle) -> "Handle":
        """A `Handle` naming an `EPHandle` from `Buffer.dispatch` (host code only)."""
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be an EPHandle or an epcomm.ops.Handle, "
                            f"got {type(handle).__name__}")
        device = handle.tensors["topk_idx"].device
        return cls(key=key_of(handle, device),
                   psum_num_recv_tokens_per_scaleup_rank=handle.tensors[
                       "psum_num_recv_tokens_per_scaleup_rank"],
                   psum_num_recv_tokens_per_expert=handle.tensors[
                       "psum_num_recv_tokens_per_expert"],
                   buffer_id=handle.buffer_id, num_tokens=handle.num_tokens,
                   num_rows=handle.num_output_rows, do_expand=handle.do_expand,
                   storage=storage_views(handle, device))


# -- implementations ---------------------------------------------------------------------------
def _payload(x: torch.Tensor, x_scales: Optional[torch.Tensor]):
    return x if x_scales is None else (x, x_scales)


def _split(recv_x):
    """(recv_x, recv_x_scales) of a dispatch's first return."""
    return tuple(recv_x) if isinstance(recv_x, tuple) else (recv_x, None)


@torch.library.impl(_LIB, "dispatch", "CompositeExplicitAutograd")
def _dispatch(x, x_scales, topk_idx, topk_weights, buffer_id, num_experts,
              num_max_tokens_per_rank, expert_alignment, do_cpu_sync, do_expand, do_zero_padding,
              num_sms):
    buffer = live_buffer(buffer_id)
    recv_x, recv_topk_idx, recv_weights, handle, _ = buffer.dispatch(
        _payload(x, x_scales), topk_idx, topk_weights, num_experts=num_experts,
        num_max_tokens_per_rank=num_max_tokens_per_rank, expert_alignment=expert_alignment,
        do_cpu_sync=do_cpu_sync, do_expand=do_expand, do_zero_padding=do_zero_padding,
        num_sms=num_sms)
    # Copies: an op's outputs may not alias each other or live on inside the handle (the
    # storage views excepted: they stand for the handle's allocations, never read).
    return (*_split(recv_x), recv_topk_idx, recv_weights, key_of(handle, buffer.device),
            handle.tensors["psum_num_recv_tokens_per_scaleup_rank"].clone(),
            handle.tensors["psum_num_recv_tokens_per_expert"].clone(),
            *storage_views(handle, buffer.device))


def _check_traced_dispatch(buffer: Buffer, x, x_scales, topk_idx, topk_weights, num_experts,
                           num_max_tokens_per_rank) -> None:
    """What a dispatch's shapes depend on, checked while tracing (with `Buffer.dispatch`'s
    messages): a compiled call fails there, not in a later op. The call checks everything
    again, and the values, before it communicates."""
    rows = dispatch_rows(buffer.config, _payload(x, x_scales))
    check_tensor("topk_idx", topk_idx, (torch.int64, torch.int32), 2, buffer.device)
    if topk_idx.shape != (rows[0].shape[0], buffer.num_topk):
        raise ValueError(f"topk_idx must have shape {(rows[0].shape[0], buffer.num_topk)}, "
                         f"got {tuple(topk_idx.shape)}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, (torch.float32,), 2, buffer.device)
    if num_experts < 1 or num_experts % buffer.num_ranks:
        raise ValueError(f"num_experts={num_experts} must be a positive multiple of the group "
                         f"size {buffer.num_ranks}")
    if not 1 <= num_max_tokens_per_rank <= buffer.num_max_tokens_per_rank:
        raise ValueError(f"num_max_tokens_per_rank must be in "
                         f"[1, {buffer.num_max_tokens_per_rank}] (the buffer's), "
                         f"got {num_max_tokens_per_rank}")


@torch.library.register_fake("epcomm::dispatch")
def _dispatch_fake(x, x_scales, topk_idx, topk_weights, buffer_id, num_experts,
                   num_max_tokens_per_rank, expert_alignment, do_cpu_sync, do_expand,
                   do_zero_padding, num_sms):
    buffer = live_buffer(buffer_id)
    _check_traced_dispatch(buffer, x, x_scales, topk_idx, topk_weights, num_experts,
                           num_max_tokens_per_rank)
    num_ranks, num_topk = buffer.num_ranks, topk_idx.shape[1]
    num_local = num_experts // num_ranks
    capacity = num_ranks * num_max_tokens_per_rank
    if do_expand:
        capacity = expand_capacity(num_ranks, num_max_tokens_per_rank, num_topk, num_local,
                                   expert_alignment)
    rows = torch.library.get_ctx().new_dynamic_size(max=capacity) if do_cpu_sync else capacity
    recv_x = x.new_empty(rows, x.shape[1])
    recv_scales = None if x_scales is None else x_scales.new_empty(rows, x_scales.shape[1])
    recv_topk_idx = None if do_expand else topk_idx.new_empty(rows, num_topk)
    recv_weights = None if topk_weights is None else \
        topk_weights.new_empty((rows,) if do_expand else (rows, num_topk))
    device = buffer.device
    return (recv_x, recv_scales, recv_topk_idx, recv_weights,
            torch.empty(1, dtype=torch.int64, device=device),
            torch.empty(num_ranks, dtype=torch.int32, device=device),
            torch.empty(num_local, dtype=torch.int32, device=device),
            *(torch.empty(1, dtype=torch.int32, device=device) for _ in range(_STORAGE)))


@torch.library.impl(_LIB, "cached_dispatch", "CompositeExplicitAutograd")
def _cached_dispatch(x, x_scales, topk_weights, key, storage, buffer_id, num_rows, do_expand,
                     do_zero_padding, owned_weights_only):
    handle = handle_of(key)
    if num_rows != handle.num_output_rows:
        raise ValueError(f"num_rows={num_rows}: the handle has {handle.num_output_rows} rows")
    if topk_weights is not None and do_expand != handle.do_expand:
        raise ValueError(f"do_expand={do_expand}: the handle has do_expand={handle.do_expand}")
    recv_x, _, recv_weights, _, _ = live_buffer(buffer_id).dispatch(
        _payload(x, x_scales), topk_weights=topk_weights, handle=handle,
        do_zero_padding=do_zero_padding)
    if owned_weights_only and recv_weights is not None and not do_expand:
        recv_weights = torch.where(handle.tensors["recv_src_metadata"][:, 2:] >= 0,
                                   recv_weights, 0.0)
    return (*_split(recv_x), recv_weights)


@torch.library.register_fake("epcomm::cached_dispatch")
def _cached_dispatch_fake(x, x_scales, topk_weights, key, storage, buffer_id, num_rows,
                          do_expand, do_zero_padding, owned_weights_only):
    recv_scales = None if x_scales is None else x_scales.new_empty(num_rows, x_scales.shape[1])
    recv_weights = None if topk_weights is None else \
        topk_weights.new_empty((num_rows,) if do_expand else (num_rows, topk_weights.shape[1]))
    return x.new_empty(num_rows, x.shape[1]), recv_scales, recv_weights


@torch.library.impl(_LIB, "combine", "CompositeExplicitAutograd")
def _combine(x, topk_weights, bias0, bias1, key, storage, buffer_id, num_tokens):
    handle = handle_of(key)
    if num_tokens != handle.num_tokens:
        raise ValueError(f"num_tokens={num_tokens}: the handle has {handle.num_tokens} tokens")
    biases = tuple(bias for bias in (bias0, bias1) if bias is not None)
    combined_x, combined_weights, _ = live_buffer(buffer_id).combine(
        x, handle, topk_weights=topk_weights, bias=biases or None)
    return combined_x, combined_weights


@torch.library.register_fake("epcomm::combine")
def _combine_fake(x, topk_weights, bias0, bias1, key, storage, buffer_id, num_tokens):
    buffer = live_buffer(buffer_id)
    check_tensor("x", x, (torch.bfloat16,), 2, buffer.device)
    if x.shape[1] != buffer.hidden:
        raise ValueError(f"x must have hidden size {buffer.hidden}, got {x.shape[1]}")
    combined_weights = None if topk_weights is None else \
        topk_weights.new_empty(num_tokens, buffer.num_topk)
    return x.new_empty(num_tokens, x.shape[1]), combined_weights


# -- autograd ----------------------------------------------------------------------------------
def _bf16(grad: torch.Tensor) -> torch.Tensor:
    return grad.to(torch.bfloat16).contiguous()


def _save_dispatch(ctx, x, x_scales, key, storage, buffer_id, recv_x) -> None:
    ctx.save_for_backward(key, *storage)
    ctx.buffer_id, ctx.num_tokens, ctx.fp8 = buffer_id, x.shape[0], x_scales is not None
    ctx.recv_shape = recv_x.shape


def _dispatch_setup(ctx, inputs, output) -> None:
    x, x_scales, _, _, buffer_id = inputs[:5]
    _save_dispatch(ctx, x, x_scales, output[4], output[7:], buffer_id, output[0])


def _cached_dispatch_setup(ctx, inputs, output) -> None:
    x, x_scales, _, key, storage, buffer_id = inputs[:6]
    _save_dispatch(ctx, x, x_scales, key, storage, buffer_id, output[0])


def _combine_of_grads(ctx, grad_recv_x, grad_recv_weights, weights_index: int):
    """(grad x, grad topk_weights) of a dispatch: the combine of its output gradients (the
    gradients of outputs are materialized: zeros where an output was not used). FP8 rows
    have no gradient (None for x); the weights' still flows, through a combine of zero rows."""
    key, *storage = ctx.saved_tensors
    if not ctx.needs_input_grad[weights_index]:
        grad_recv_weights = None
    if ctx.fp8:
        if grad_recv_weights is None:
            return None, None
        grad_recv_x = grad_recv_weights.new_zeros(ctx.recv_shape, dtype=torch.bfloat16)
    grad_x, grad_weights = torch.ops.epcomm.combine(
        _bf16(grad_recv_x), None if grad_recv_weights is None else grad_recv_weights.contiguous(),
        None, None, key, storage, buffer_id=ctx.buffer_id, num_tokens=ctx.num_tokens)
    return (None if ctx.fp8 else grad_x), grad_weights


def _dispatch_backward(ctx, grad_recv_x, _grad_scales, _grad_idx, grad_recv_weights, *_rest):
    grad_x, grad_weights = _combine_of_grads(ctx, grad_recv_x, grad_recv_weights, 3)
    return grad_x, None, None, grad_weights, *(None,) * 8


def _cached_dispatch_backward(ctx, grad_recv_x, _grad_scales, grad_recv_weights):
    grad_x, grad_weights = _combine_of_grads(ctx, grad_recv_x, grad_recv_weights, 2)
    # (a list input gets a list of gradients)
    return grad_x, None, grad_weights, None, [None] * (len(ctx.saved_tensors) - 1), \
        *(None,) * 5


def _combine_setup(ctx, inputs, output) -> None:
    x, topk_weights, bias0, bias1, key, storage, buffer_id, _ = inputs
    ctx.save_for_backward(key, *storage)
    ctx.buffer_id, ctx.num_rows = buffer_id, x.shape[0]
    ctx.do_expand = topk_weights is not None and topk_weights.dim() == 1
    ctx.has_bias = (bias0 is not None, bias1 is not None)


def _combine_backward(ctx, grad_combined_x, grad_combined_weights):
    # Rows the combine did not read (alignment gaps, the sync-free tail) get a zero gradient.
    key, *storage = ctx.saved_tensors
    if not ctx.needs_input_grad[1]:
        grad_combined_weights = None
    grad_x, _, grad_weights = torch.ops.epcomm.cached_dispatch(
        _bf16(grad_combined_x), None,
        None if grad_combined_weights is None else grad_combined_weights.contiguous(), key,
        storage, buffer_id=ctx.buffer_id, num_rows=ctx.num_rows, do_expand=ctx.do_expand,
        do_zero_padding=True, owned_weights_only=True)
    grad_bias = tuple(grad_combined_x if present else None for present in ctx.has_bias)
    return grad_x, grad_weights, *grad_bias, None, [None] * len(storage), None, None


torch.library.register_autograd("epcomm::dispatch", _dispatch_backward,
                                setup_context=_dispatch_setup)
torch.library.register_autograd("epcomm::cached_dispatch", _cached_dispatch_backward,
                                setup_context=_cached_dispatch_setup)
torch.library.register_autograd("epcomm::combine", _combine_backward,
                                setup_context=_combine_setup)
