"""`torch.compile(fullgraph=True)` of MoE layers through the custom ops (`epcomm.ops`).

A small MoE layer (router, dispatch, per-expert MLP, combine) is compiled forward and backward
with no graph break (`fullgraph=True` raises on one; a counting backend checks one graph and
no recompilation on new data). Two layers on two buffers interleave in one graph: layer a
(compact, synchronizing) with activation-checkpointed expert MLPs, layer b (expand, sync-free)
activation-checkpointed whole, between a's dispatch and combine. Outputs and gradients equal
the eager run bitwise (with Inductor: the same routing, close values), and the compiled
dispatch outputs and combines equal `epcomm.testing.reference` bitwise. CPU ranks use
`aot_eager` (no C compiler), on both backends; the CUDA variants (Inductor, and CUDA graphs with
`mode="reduce-overhead"` for the sync-free path) need a GPU.
"""
from __future__ import annotations

import gc
import os
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint

from epcomm import Buffer, ElasticBuffer
from epcomm import autograd as ep
from epcomm import ops
from epcomm.fp8 import per_token_cast_to_fp8
from epcomm.testing.launch import run_local_ranks
from epcomm.testing.reference import reference_combine, reference_dispatch
from epcomm.testing.verify import assert_equal

BASE_SEED = int(os.environ.get("EPCOMM_TEST_SEED", time.time_ns() % 1_000_000))
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="CUDA tests need a GPU (none on this machine)")
# CPU tensors on the symmetric backend need the Triton interpreter, which epcomm selects only
# on a machine without CUDA (there the cuda targets run the same kernels compiled).
_NO_INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(),
                                     reason="no Triton interpreter on a machine with CUDA")
# "device:backend:compile backend"
TARGETS = ["cpu:collective:aot_eager", pytest.param("cpu:symmetric:aot_eager",
                                                    marks=_NO_INTERPRETER),
           pytest.param("cuda:symmetric:inductor", marks=_NO_CUDA)]
M, H, K, F, EXPERTS_PER_RANK, ALIGNMENT = 8, 32, 3, 16, 3, 4


class MoE(torch.nn.Module):
    """Router (top-K of a softmax; slots of weight < 0.1 dropped as -1) -> dispatch -> one
    ReLU MLP per local expert (activation-checkpointed with `checkpoint_experts`), weighted ->
    combine.

    `route_and_dispatch` and `experts_and_combine` are its two halves, so that two layers can
    interleave them; `block` is the whole layer."""

    def __init__(self, buffer: Buffer, do_expand: bool, do_cpu_sync: bool,
                 checkpoint_experts: bool, gen: torch.Generator) -> None:
        super().__init__()
        self.buffer, self.do_expand, self.do_cpu_sync = buffer, do_expand, do_cpu_sync
        self.checkpoint_experts = checkpoint_experts
        self.num_experts = EXPERTS_PER_RANK * buffer.num_ranks
        device = buffer.device
        self.router = torch.nn.Parameter(torch.randn(H, self.num_experts, generator=gen)
                                         .to(device))
        self.w1 = torch.nn.Parameter((torch.randn(EXPERTS_PER_RANK, H, F, generator=gen) / 4)
                                     .to(device, torch.bfloat16))
        self.w2 = torch.nn.Parameter((torch.randn(EXPERTS_PER_RANK, F, H, generator=gen) / 4)
                                     .to(device, torch.bfloat16))

    def route_and_dispatch(self, x: torch.Tensor):
        """x [T, H] bf16 -> (topk_idx [T, K], topk_weights [T, K], dispatch returns)."""
        weights, idx = (x.float() @ self.router).softmax(-1).topk(K, dim=-1)
        idx = idx.masked_fill(weights < 0.1, -1)
        return idx, weights, ep.dispatch(
            self.buffer, x, idx, weights, num_experts=self.num_experts, do_expand=self.do_expand,
            do_cpu_sync=self.do_cpu_sync, expert_alignment=ALIGNMENT, do_zero_padding=True)

    def experts_and_combine(self, dispatched):
        """The local experts on the received rows, then the combine: (y [rows, H] bf16, the
        combine input; combined [T, H] bf16)."""
        recv_x, recv_idx, recv_w, handle = dispatched
        if self.do_expand:  # expert of each row from the segment bounds (gaps have weight 0)
            rows = torch.arange(recv_x.shape[0], device=recv_x.device, dtype=torch.int32)
            row_expert = torch.searchsorted(handle.psum_num_recv_tokens_per_expert, rows,
                                            right=True)
        y = torch.zeros_like(recv_x, dtype=torch.float32)
        for i in range(EXPERTS_PER_RANK):
            if self.checkpoint_experts:
                out = checkpoint(_mlp, recv_x, self.w1[i], self.w2[i], use_reentrant=False)
            else:
                out = _mlp(recv_x, self.w1[i], self.w2[i])
            if self.do_expand:
                row_w = torch.where(row_expert == i, recv_w, 0.0)
            else:
                row_w = torch.where(recv_idx == i, recv_w, 0.0).sum(-1)
            y = y + out.float() * row_w[:, None]
        y = y.to(torch.bfloat16)
        combined, _ = ep.combine(self.buffer, y, handle)
        return y, combined

    def block(self, x: torch.Tensor):
        """The whole layer: (topk_idx, topk_weights, recv_x, recv_topk_weights, y, combined)."""
        idx, weights, dispatched = self.route_and_dispatch(x)
        y, combined = self.experts_and_combine(dispatched)
        return idx, weights, dispatched[0], dispatched[2], y, combined


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w1) @ w2


def two_layers(layer_a: MoE, layer_b: MoE, x: torch.Tensor):
    """Both layers on `x`, interleaved: dispatch a, then all of layer b activation-checkpointed
    (its dispatch and combine run again in the backward), then combine a. Returns the sum of
    the layers' outputs and, per layer, (topk_idx, topk_weights, recv_x, recv_w, y,
    combined)."""
    idx_a, w_a, dispatched_a = layer_a.route_and_dispatch(x)
    parts_b = checkpoint(layer_b.block, x, use_reentrant=False)
    y_a, out_a = layer_a.experts_and_combine(dispatched_a)
    return out_a + parts_b[-1], [(idx_a, w_a, dispatched_a[0], dispatched_a[2], y_a, out_a),
                                 parts_b]


def _same_routing_close_values(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Inductor against eager: integer tensors (the routing) equal, floating ones close (its
    generated kernels may fuse and reduce in another order; the communication itself is
    checked bitwise against the reference)."""
    if got.is_floating_point():
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=name)
    else:
        assert_equal(name, got, want)


def _check_against_reference(name: str, layer: MoE, x: torch.Tensor, parts) -> None:
    """The compiled dispatch outputs (valid rows) and combine equal the reference's."""
    idx, weights, recv_x, recv_w, y, combined = (p.detach().cpu() for p in parts)
    ref = reference_dispatch(x.detach().cpu(), idx, weights, layer.num_experts, M, dist.group.WORLD,
                             ALIGNMENT, layer.do_expand)
    rows = ref.recv_x.shape[0]
    if layer.do_expand:  # rows outside the experts' segments are unspecified
        valid = ref.expand_valid
        assert_equal(f"{name} recv_x", recv_x[:rows][valid], ref.recv_x[valid])
    else:
        assert_equal(f"{name} recv_x", recv_x[:rows], ref.recv_x)
    assert_equal(f"{name} recv_topk_weights", recv_w[:rows], ref.recv_topk_weights)
    want, _ = reference_combine(y, ref, idx, layer.num_experts, dist.group.WORLD)
    assert_equal(f"{name} combined", combined, want)


def _layers(buffers: list, seed: int) -> tuple[MoE, MoE]:
    """Layer a (compact, synchronizing, checkpointed experts) on buffers[0], layer b (expand,
    sync-free) on buffers[1], with the same parameters on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return (MoE(buffers[0], do_expand=False, do_cpu_sync=True, checkpoint_experts=True,
                gen=gen),
            MoE(buffers[1], do_expand=True, do_cpu_sync=False, checkpoint_experts=False,
                gen=gen))


def run_training(target: str, seed: int) -> int:
    """Eager and compiled training steps of two interleaved layers, bitwise equal, on two
    draws of data (one graph, no recompilation); dispatch and combine against the reference."""
    device, backend, compiler = target.split(":")
    rank = dist.get_rank()
    buffers = [Buffer(dist.group.WORLD, M, H, K, device=device, backend=backend)
               for _ in range(2)]
    eager_a, eager_b = _layers(buffers, seed)
    compiled_a, compiled_b = _layers(buffers, seed)  # the same parameters
    counter = CompileCounterWithBackend(compiler)
    step = torch.compile(two_layers, fullgraph=True, backend=counter)
    data = torch.Generator().manual_seed(seed + 1 + rank)
    for draw in range(2):
        # Uneven counts (with Inductor the same on every rank: the graph has collectives
        # with no data path between them, epcomm.ops). New data, the same shapes.
        tokens = M - rank if compiler == "aot_eager" else M - 1
        x = torch.randn(tokens, H, generator=data).to(device, torch.bfloat16)
        grad = torch.randn(tokens, H, generator=data).to(device, torch.bfloat16)
        results = []
        for run, (layer_a, layer_b) in ((two_layers, (eager_a, eager_b)),
                                        (step, (compiled_a, compiled_b))):
            x_in = x.clone().requires_grad_()
            out, parts = run(layer_a, layer_b, x_in)
            (out.float() * grad.float()).sum().backward()
            params = [p.grad for layer in (layer_a, layer_b) for p in layer.parameters()]
            results.append((out, x_in.grad, params, parts))
            for layer in (layer_a, layer_b):
                layer.zero_grad(set_to_none=True)
        (out, grad_x, params, parts), (c_out, c_grad_x, c_params, c_parts) = results
        same = assert_equal if compiler == "aot_eager" else _same_routing_close_values
        same(f"draw {draw}: compiled output", c_out, out)
        same(f"draw {draw}: compiled x.grad", c_grad_x, grad_x)
        for index, (got, want) in enumerate(zip(c_params, params)):
            same(f"draw {draw}: compiled parameter grad {index}", got, want)
        for name, layer, got, want in (("compact", compiled_a, c_parts[0], parts[0]),
                                       ("expand", compiled_b, c_parts[1], parts[1])):
            for index, (g, w) in enumerate(zip(got, want)):
                same(f"draw {draw}: {name} part {index}", g, w)
            _check_against_reference(f"draw {draw}: {name}", layer, x, got)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs compiled (recompilation)"
    for buffer in buffers:
        buffer.destroy()
    return counter.frame_count


def run_inference(target: str, seed: int) -> int:
    """Through an `ElasticBuffer`: a compiled FP8 sync-free dispatch, a cached bf16 dispatch
    through its handle and a combine with weights, against eager and the reference; then
    handle lifetime (keys of freed handles name nothing, no handle outlives its tensors) and
    bad input (raised while tracing)."""
    device, backend, compiler = target.split(":")
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    buffer = ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=M, hidden=H, num_topk=K,
                           explicitly_destroy=True, device=device, backend=backend)
    num_experts = EXPERTS_PER_RANK * num_ranks
    gen = torch.Generator().manual_seed(seed + rank)
    tokens = M - rank
    x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    x2 = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:K] for _ in range(tokens)])
    idx[0, :] = -1  # a token sent nowhere
    idx[1, 1] = -1
    weights = torch.rand(tokens, K, generator=gen)
    fp8 = per_token_cast_to_fp8(x)

    def infer(fp8_x, scales, topk_idx, topk_weights, x_bf16):
        (recv_x, recv_scales), recv_idx, recv_w, handle = ep.dispatch(
            buffer, (fp8_x, scales), topk_idx, topk_weights, num_experts=num_experts,
            num_max_tokens_per_rank=M, do_cpu_sync=False, do_zero_padding=True)
        recv_x2, _, recv_w2, _ = ep.dispatch(buffer, x_bf16, topk_weights=topk_weights,
                                             handle=handle, do_zero_padding=True)
        combined, combined_w = ep.combine(buffer, recv_x2, handle, topk_weights=recv_w2)
        return recv_x, recv_scales, recv_idx, recv_w, recv_x2, combined, combined_w

    inputs = [t.to(device) for t in (*fp8, idx, weights, x2)]
    counter = CompileCounterWithBackend(compiler)
    with torch.no_grad():
        eager = infer(*inputs)
        compiled = torch.compile(infer, fullgraph=True, backend=counter)(*inputs)
    names = ("recv_x", "recv_scales", "recv_topk_idx", "recv_topk_weights", "cached recv_x",
             "combined_x", "combined_topk_weights")
    for name, got, want in zip(names, compiled, eager):
        assert_equal(f"compiled {name}", got, want)
    compiled = [t.cpu() for t in compiled]
    group = dist.group.WORLD
    ref = reference_dispatch(fp8, idx, weights, num_experts, M, group)
    rows = ref.recv_x[0].shape[0]
    assert compiled[0].shape[0] == num_ranks * M  # the sync-free capacity
    assert_equal("recv_x (fp8)", compiled[0][:rows].view(torch.uint8),
                 ref.recv_x[0].view(torch.uint8))
    assert_equal("recv_scales", compiled[1][:rows], ref.recv_x[1])
    assert_equal("recv_topk_idx", compiled[2][:rows], ref.recv_topk_idx)
    assert_equal("recv_topk_weights", compiled[3][:rows], ref.recv_topk_weights)
    ref2 = reference_dispatch(x2, idx, weights, num_experts, M, group)
    assert_equal("cached recv_x", compiled[4][:rows], ref2.recv_x)
    want_x, want_w = reference_combine(ref2.recv_x, ref2, idx, num_experts, group,
                                       topk_weights=ref2.recv_topk_weights)
    assert_equal("combined_x", compiled[5], want_x)
    assert_equal("combined_topk_weights", compiled[6], want_w)

    # Lifetime: a handle lives as long as its key tensor.
    gc.collect()
    assert len(ops._keys) == 0, f"{len(ops._keys)} handles outlived their keys"
    _, _, _, handle = ep.dispatch(buffer, x.to(device), idx.to(device), num_experts=num_experts)
    assert handle.key.device.type == device  # (a CPU key would cut a CUDA graph)
    assert handle.num_recv_tokens_per_expert_list is not None  # EPHandle fields, eagerly
    assert ops.handle_of(handle.key[:1]) is handle.resolve()  # a view names it too
    for copy in (handle.key.clone(), torch.zeros_like(handle.key)):
        with pytest.raises(ValueError, match="names no live handle"):
            ops.handle_of(copy)
    held = weakref.ref(handle.resolve())
    view = handle.key[:1]
    del handle
    gc.collect()
    assert held() is not None, "a handle died while a view of its key was alive"
    del view
    gc.collect()
    assert held() is None and len(ops._keys) == 0, "a handle outlived its key"

    # Bad input fails while tracing (before anything is sent), naming the argument.
    def bad(x_bf16, topk_idx):
        return ep.dispatch(buffer, x_bf16, topk_idx[1:], num_experts=num_experts)[0]

    try:
        torch.compile(bad, fullgraph=True, backend=compiler)(x.to(device), idx.to(device))
    except Exception as exc:  # (Dynamo wraps the ValueError)
        assert f"topk_idx must have shape ({tokens}, {K})" in str(exc), exc
    else:
        raise AssertionError("a compiled dispatch took topk_idx of the wrong shape")
    buffer.destroy()
    return counter.frame_count


def run_fp8_weights_gradient(target: str, seed: int) -> None:
    """A compiled FP8 dispatch in training: its rows get no gradient, its weights the same one
    as through a bf16 dispatch of the same routing (eager). Then the dispatch op's fake
    outputs against a real call's."""
    device, backend, compiler = target.split(":")
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    buffer = Buffer(dist.group.WORLD, M, H, K, device=device, backend=backend)
    num_experts = EXPERTS_PER_RANK * num_ranks
    gen = torch.Generator().manual_seed(seed + 7 * rank)
    x = torch.randn(M - rank, H, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(num_experts, generator=gen)[:K] for _ in range(M - rank)])
    idx[0, 1] = -1
    scale = torch.randn(num_ranks * M, K, generator=gen).to(device)

    def loss(payload, topk_idx, topk_weights):
        recv_x, _, recv_w, _ = ep.dispatch(buffer, payload, topk_idx, topk_weights,
                                           num_experts=num_experts, do_cpu_sync=False)
        return (recv_w * scale).sum()

    grads = []
    for payload, run in ((x, loss), (per_token_cast_to_fp8(x), torch.compile(
            loss, fullgraph=True, backend=compiler))):
        weights = torch.rand(M - rank, K, generator=torch.Generator().manual_seed(seed + rank))
        weights = weights.to(device).requires_grad_()
        payload = tuple(t.to(device) for t in payload) if isinstance(payload, tuple) else \
            payload.to(device)
        run(payload, idx.to(device), weights).backward()
        grads.append(weights.grad)
    assert_equal("FP8 dispatch's weights gradient", grads[1], grads[0])

    # The fake implementation of a sync-free dispatch gives each output's shape, strides and
    # dtype of a real call (the storage views too).
    weights = torch.rand(M - rank, K, generator=gen).to(device)
    for expand, fp8 in ((False, False), (True, True)):
        payload = per_token_cast_to_fp8(x) if fp8 else (x, None)
        inputs = [t if t is None else t.to(device) for t in (*payload, idx, weights)]
        args = (buffer.buffer_id, num_experts, M, 4, False, expand, False, 0)
        with FakeTensorMode() as mode:
            fake = torch.ops.epcomm.dispatch(
                *[t if t is None else mode.from_tensor(t) for t in inputs], *args)
        real = torch.ops.epcomm.dispatch(*inputs, *args)
        for got, want in zip(fake, real):
            if want is not None:
                assert (got.shape, got.stride(), got.dtype, got.device) == \
                    (want.shape, want.stride(), want.dtype, want.device), (got, want)
    buffer.destroy()


def run_compiled(target: str, seed: int) -> list[str]:
    """`run_training`, `run_inference` and `run_fp8_weights_gradient` on one set of ranks
    (one process start)."""
    done = []
    for run in (run_training, run_inference, run_fp8_weights_gradient):
        try:
            run(target, seed)
        except AssertionError as exc:
            raise AssertionError(f"{run.__name__}: {exc}") from exc  # (its line, in the chain)
        done.append(run.__name__)
    return done


@pytest.mark.parametrize("target", TARGETS)
def test_compiled_moe_matches_eager_and_reference(target: str) -> None:
    """Training (two interleaved layers, checkpointed experts) and inference (FP8, cached
    dispatch), compiled with fullgraph=True: one graph each, bitwise as eager and the
    reference; handles freed with their keys. (The symmetric backend on CPU: the kernels
    under the Triton interpreter.)"""
    if target.startswith("cpu:symmetric"):
        pytest.importorskip("triton")
    assert run_local_ranks(run_compiled, 2, target, BASE_SEED) == \
        [["run_training", "run_inference", "run_fp8_weights_gradient"]] * 2


def run_cuda_graph(seed: int) -> int:
    """The sync-free layer (expand) compiled with mode="reduce-overhead": forward and backward
    replay as CUDA graphs (no dispatch runs on the host after the warm-up and recording calls,
    no cudagraph skip), bitwise as eager on new data every step."""
    os.environ["EP_AVOID_RECORD_STREAM"] = "1"  # (no record_stream under capture)
    rank = dist.get_rank()
    buffer = Buffer(dist.group.WORLD, M, H, K, device="cuda", backend="symmetric")
    eager_layer = _layers([buffer, buffer], seed)[1]
    compiled_layer = _layers([buffer, buffer], seed)[1]

    def forward(layer: MoE, x: torch.Tensor) -> torch.Tensor:
        return layer.block(x)[-1]

    torch._dynamo.utils.counters.clear()
    # (a failing pool check then names where each stray allocation was made)
    import torch._inductor.config as inductor_config
    inductor_config.triton.cudagraph_trees_history_recording = True
    step = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    keys_made = []  # the dispatches that ran on the host (each makes a key)
    make_key = ops.key_of
    ops.key_of = lambda handle, device: keys_made.append(1) or make_key(handle, device)
    data = torch.Generator().manual_seed(seed + 1 + rank)
    steps = 5
    for index in range(steps):
        if index == 2:  # after the warm-up and the recording call: replays only
            keys_before_replays = len(keys_made)
        x = torch.randn(M - rank, H, generator=data).to("cuda", torch.bfloat16)
        grad = torch.randn(M - rank, H, generator=data).to("cuda", torch.bfloat16)
        got_grads = []
        for run, layer in ((forward, eager_layer), (step, compiled_layer)):
            x_in = x.clone().requires_grad_()
            out = run(layer, x_in)
            (out.float() * grad.float()).sum().backward()
            got_grads.append([out.detach().clone(), x_in.grad,
                              *(p.grad.clone() for p in layer.parameters())])
            layer.zero_grad(set_to_none=True)
        for position, (got, want) in enumerate(zip(got_grads[1], got_grads[0])):
            _same_routing_close_values(f"step {index}: reduce-overhead result {position}",
                                       got, want)
    # Each eager step made one key; the replays made none.
    ops.key_of = make_key
    assert len(keys_made) == keys_before_replays + (steps - 2), \
        "a replay ran a dispatch on the host"
    skips = dict(torch._dynamo.utils.counters["inductor"])
    assert not skips.get("cudagraph_skips"), f"CUDA graphs skipped: {skips}"
    buffer.destroy()
    return steps


@_NO_CUDA
def test_sync_free_layer_in_cuda_graphs() -> None:
    assert run_local_ranks(run_cuda_graph, 2, BASE_SEED) == [5, 5]
