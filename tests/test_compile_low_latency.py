"""The low-latency pair as custom ops (`epcomm.ops_low_latency`) under
`torch.compile(fullgraph=True)`: a decode step (dispatch, one bf16 matmul per local expert,
combine; FP8 dispatch and LogFMT combine too) compiles into one graph with no recompilation on
new data, and its outputs equal the eager V1 calls bitwise. The op's outputs are new tensors:
they survive the buffer's next two calls unchanged. CPU: gloo ranks on the collective transport
and on peer memory under the Triton interpreter (`aot_eager`); CUDA (skipped without a GPU):
processes sharing the GPU on peer memory (Inductor).
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

from epcomm.legacy import Buffer
from epcomm.ops import key_of
from epcomm.ops_low_latency import low_latency_combine, low_latency_dispatch
from epcomm.testing.launch import run_seeded
from epcomm.testing.verify import assert_equal

SEED = int(os.environ.get("EPCOMM_TEST_SEED", time.time_ns() % 1_000_000))
M, H, K, EXPERTS_PER_RANK = 4, 128, 3, 2
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="CUDA runs need a GPU (none on this machine)")


def _step(buffer, x, topk_idx, weights, w, use_fp8, use_logfmt):
    """One decode step through the ops: the expert outputs are recv_x (bf16, or FP8 times its
    scales) times each local expert's matrix."""
    num_experts = EXPERTS_PER_RANK * buffer.group_size
    recv_x, count, handle = low_latency_dispatch(buffer, x, topk_idx, M, num_experts,
                                                 use_fp8=use_fp8)
    if use_fp8:
        fp8, scales = recv_x
        rows = (fp8.float().unflatten(2, (-1, 128)) * scales.unsqueeze(3)).flatten(2)
    else:
        rows = recv_x.float()
    out = torch.bmm(rows, w).to(torch.bfloat16)
    return recv_x, count, low_latency_combine(buffer, out, topk_idx, weights, handle,
                                              use_logfmt=use_logfmt)


def _eager(buffer, x, topk_idx, weights, w, use_fp8, use_logfmt):
    """The same step through the V1 methods (the fresh-output copies taken at once)."""
    num_experts = EXPERTS_PER_RANK * buffer.group_size
    recv_x, count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, M, num_experts,
                                                              use_fp8=use_fp8)
    if use_fp8:
        fp8, scales = recv_x
        rows = (fp8.float().unflatten(2, (-1, 128)) * scales.unsqueeze(3)).flatten(2)
        recv_x = (fp8.clone(), scales.clone())
    else:
        rows = recv_x.float()
        recv_x = recv_x.clone()
    count = count.clone()
    out = torch.bmm(rows, w).to(torch.bfloat16)
    combined = buffer.low_latency_combine(out, topk_idx, weights, handle,
                                          use_logfmt=use_logfmt)[0].clone()
    return recv_x, count, combined


def _valid_rows(recv_x, count):
    """recv_x's rows below each expert's count (later rows are unspecified)."""
    data = recv_x[0] if isinstance(recv_x, tuple) else recv_x
    rows = [data[e, :int(count[e])] for e in range(data.shape[0])]
    if isinstance(recv_x, tuple):
        rows += [recv_x[1][e, :int(count[e])] for e in range(data.shape[0])]
    return rows


def run(seed: int, backend: str, device: str, compile_backend: str) -> int:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    num_experts = EXPERTS_PER_RANK * num_ranks
    hint = Buffer.get_low_latency_rdma_size_hint(M, H, num_ranks, num_experts)
    buffer = Buffer(dist.group.WORLD, num_rdma_bytes=hint, low_latency_mode=True,
                    backend=backend)
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    w = (torch.randn(EXPERTS_PER_RANK, H, H, generator=gen) / 16).to(device)
    counter = CompileCounterWithBackend(compile_backend)
    compiled = torch.compile(_step, backend=counter, fullgraph=True, dynamic=False)
    checked = 0
    variants = ((False, False), (True, True))
    for use_fp8, use_logfmt in variants:
        for _ in range(2):  # new data, same shapes: no recompilation
            num_tokens = M - rank % 2
            x = torch.randn(num_tokens, H, generator=gen).to(device, torch.bfloat16)
            scores = torch.rand(num_tokens, num_experts, generator=gen)
            topk_idx = scores.topk(K, dim=1).indices
            topk_idx[scores.max(1).values < 0.2, -1] = -1
            topk_idx, weights = topk_idx.to(device), torch.rand(num_tokens, K, generator=gen) \
                .to(device)
            want = _eager(buffer, x, topk_idx, weights, w, use_fp8, use_logfmt)
            got = compiled(buffer, x, topk_idx, weights, w, use_fp8, use_logfmt)
            # the op's outputs are its own: two later calls of the buffer leave them alone
            kept = [t.clone() for t in _valid_rows(got[0], got[1])] + [got[2].clone()]
            _eager(buffer, -x, topk_idx, weights, -w, use_fp8, use_logfmt)
            assert_equal("recv_count", got[1].cpu(), want[1].cpu())
            for name, g, e, k in zip(("rows", "scales"), _valid_rows(got[0], got[1]),
                                     _valid_rows(want[0], want[1]), kept):
                assert_equal(name, g.cpu(), e.cpu())
                assert_equal(f"{name} after later calls", g.cpu(), k.cpu())
            assert_equal("combined_x", got[2].cpu(), want[2].cpu())
            assert_equal("combined_x after later calls", got[2].cpu(), kept[-1].cpu())
            checked += 1
    assert counter.frame_count == len(variants), counter.frame_count  # one graph per variant
    # The fake implementation gives each output's shape, strides and dtype of a real call.
    for use_fp8, use_ue8m0 in ((False, False), (True, False), (True, True)):
        args = (buffer.buffer_id, M, num_experts, use_fp8, use_ue8m0, use_ue8m0)
        with FakeTensorMode() as mode:
            fake = torch.ops.epcomm.low_latency_dispatch(mode.from_tensor(x),
                                                         mode.from_tensor(topk_idx), *args)
        real = torch.ops.epcomm.low_latency_dispatch(x, topk_idx, *args)
        for got, want in zip(fake, real):
            if want is not None:
                assert (got.shape, got.stride(), got.dtype, got.device) == \
                    (want.shape, want.stride(), want.dtype, want.device), (got, want)
    with pytest.raises(ValueError, match="low-latency dispatch"):  # another op's key
        low_latency_combine(buffer, torch.zeros(EXPERTS_PER_RANK, num_ranks * M, H,
                                                dtype=torch.bfloat16, device=device),
                            topk_idx, weights, key_of(object(), device))
    return checked


@pytest.mark.parametrize("num_ranks,backend,device,compile_backend", [
    (2, "collective", "cpu", "aot_eager"),
    pytest.param(2, "symmetric", "cpu", "aot_eager", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="no Triton interpreter on a machine with CUDA "
        "(epcomm selects it only without CUDA; the cuda case runs the kernels compiled)")),
    pytest.param(2, "symmetric", "cuda", "inductor", marks=_NO_CUDA)])
def test_compiled_decode_step_matches_eager(num_ranks, backend, device, compile_backend):
    if backend == "symmetric":
        pytest.importorskip("triton")
    assert run_seeded(run, num_ranks, SEED, SEED, backend, device, compile_backend) == \
        [4] * num_ranks
