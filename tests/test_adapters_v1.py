"""The call sequences of three frameworks' DeepEP V1 normal-mode adapters, replayed against
`epcomm.legacy.Buffer` on local gloo ranks and checked bitwise against
`epcomm.testing.reference`:

- vLLM `fused_moe/prepare_finalize/deepep_ht.py` (`DeepEPHTPrepareAndFinalize`): layout, dispatch
  with `async_finish`, `event.event is not None` checks, local-to-global id remapping,
  `combine(topk_weights=None)`, `output.copy_`; also its micro-batch (DBO) form, where
  `previous_event` comes without `allocate_on_comm_stream`, and block-FP8 tokens.
- SGLang `token_dispatcher/deepep.py` normal mode (`_DeepEPDispatcherImplNormal`): buffer sizing
  from `Config` size hints, `Config(**json)`, the layout's event passed on as `previous_event`
  (an empty event when not async), `expert_alignment=128`, the handle kept on the dispatcher,
  column-major FP8 scales.
- Megatron-LM `transformer/moe/fused_a2a.py` (`FusedDispatch` / `FusedCombine` autograd
  functions, `get_buffer`) with the flex dispatcher's multihot permutation: forward and backward
  (combine of the gradients with `topk_weights`, cached dispatch of the combine's gradient).

The adapters' code is not copied: each replay makes the same calls (argument names, tuple
unpacking, handle and event use) with a `Buffer` from `epcomm.legacy`.
"""
import pytest
import torch
import torch.distributed as dist

from epcomm.fp8 import per_token_cast_back, per_token_cast_to_fp8
from epcomm.legacy import Buffer, Config
from epcomm.testing.launch import run_local_ranks
from epcomm.testing.reference import reference_combine, reference_dispatch
from epcomm.testing.verify import assert_equal

H, K = 256, 4
REF_M = 1024
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="CUDA runs need a GPU (none on this machine)")
DEVICES = ["cpu", pytest.param("cuda", marks=_NO_CUDA)]  # CUDA: the ranks share the GPUs


def cpu(t):
    """A host copy for the reference (gloo moves host tensors); tuples part by part."""
    return tuple(map(cpu, t)) if isinstance(t, tuple) else t.cpu()


def inputs(seed, num_tokens, num_experts, device):
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    topk_weights, topk_ids = torch.topk(scores, K, dim=-1)
    topk_ids[torch.rand(num_tokens, K, generator=gen) < 0.2] = -1
    x = torch.randn(num_tokens, H, generator=gen).to(torch.bfloat16)
    return gen, x.to(device), topk_ids.to(device), topk_weights.float().to(device)


def weighted_experts(x, local_ids, weights):
    """An expert stand-in: each row times (local expert + 1), weighted and summed over its
    local slots (fp32, one bf16 rounding)."""
    valid = local_ids >= 0
    scale = torch.where(valid, weights * (local_ids + 1).float(), 0.0).sum(dim=1)
    return (x.float() * scale[:, None]).to(torch.bfloat16)


# ------------------------------------------------------------------------------------ vLLM
class VllmHighThroughput:
    """The calls of vLLM's DeepEPHTPrepareAndFinalize (prepare_async / _receiver / _finalize)."""

    available_rank_configs = [2, 4, 8, 16, 24, 32, 64, 128, 144, 160]

    def __init__(self, buffer, num_dispatchers, rank_expert_offset):
        self.buffer = buffer
        self.num_dispatchers_ = num_dispatchers
        self.rank_expert_offset = rank_expert_offset
        self.async_prepare = True
        self.handles = [None, None]

    def _get_dispatch_config(self):
        if self.num_dispatchers_ not in self.available_rank_configs:
            return None
        return Buffer.get_dispatch_config(self.num_dispatchers_)

    def _get_combine_config(self):
        if self.num_dispatchers_ not in self.available_rank_configs:
            return None
        return Buffer.get_combine_config(self.num_dispatchers_)

    def prepare(self, a1, topk_weights, topk_ids, num_experts, block_fp8, dbo):
        tokens, token_scales = per_token_cast_to_fp8(a1) if block_fp8 else (a1, None)
        has_scales = token_scales is not None
        previous_event = self.buffer.capture() if dbo else None  # dbo_get_previous_event
        (num_tokens_per_rank, num_tokens_per_rdma_rank, dispatch_expert_num_tokens,
         is_token_in_rank, event) = self.buffer.get_dispatch_layout(
            topk_idx=topk_ids, num_experts=num_experts, previous_event=previous_event,
            async_finish=False, allocate_on_comm_stream=False)
        token_data = (tokens, token_scales) if has_scales else tokens
        (token_data, expert_topk_ids, expert_topk_weights, expert_num_tokens_per_expert_list,
         handle, event) = self.buffer.dispatch(
            x=token_data, handle=None, num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=dispatch_expert_num_tokens, topk_idx=topk_ids,
            topk_weights=topk_weights, expert_alignment=1, config=self._get_dispatch_config(),
            previous_event=previous_event, async_finish=self.async_prepare and not dbo,
            allocate_on_comm_stream=False)
        self.handles[0] = handle
        # _receiver
        if event.event is not None:
            event.current_stream_wait()
        expert_x, expert_x_scale = token_data if has_scales else (token_data, None)
        expert_topk_ids = torch.where(expert_topk_ids == -1,
                                      num_experts - 1 if self.rank_expert_offset == 0 else 0,
                                      expert_topk_ids + self.rank_expert_offset)
        expert_num_tokens = torch.tensor(expert_num_tokens_per_expert_list, dtype=torch.int32)
        return expert_x, expert_x_scale, expert_num_tokens, expert_topk_ids, expert_topk_weights

    def finalize(self, output, fused_expert_output, do_async, dbo):
        handle = self.handles[0]
        previous_event = self.buffer.capture() if dbo else None
        combined_x, _, event = self.buffer.combine(
            x=fused_expert_output, handle=handle, topk_weights=None,
            config=self._get_combine_config(), previous_event=previous_event,
            async_finish=do_async and not dbo, allocate_on_comm_stream=False)
        if do_async:
            if event.event is not None:
                event.current_stream_wait()
        output.copy_(combined_x, non_blocking=True)


def run_vllm(seed, device):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    E = 4 * num_ranks
    num_local = E // num_ranks
    buffer = Buffer(group, Config().get_nvl_buffer_size_hint(H * 2, num_ranks))
    adapter = VllmHighThroughput(buffer, num_ranks, rank * num_local)
    cases = 0
    for block_fp8, dbo in ((False, False), (True, False), (False, True)):
        gen, a1, topk_ids, topk_weights = inputs(seed + cases, 9 + 2 * rank, E, device)
        expert_x, expert_x_scale, expert_num_tokens, global_ids, expert_w = adapter.prepare(
            a1, topk_weights, topk_ids, E, block_fp8, dbo)
        # Quantized where the adapter quantizes (devices may round the scales differently).
        x_sent = cpu(per_token_cast_to_fp8(a1)) if block_fp8 else a1.cpu()
        ref = reference_dispatch(x_sent, topk_ids.cpu(), topk_weights.cpu(), E, REF_M, group)
        assert_equal("expert_x", (expert_x, expert_x_scale) if block_fp8 else expert_x,
                     ref.recv_x, check_dtype=True)
        want_ids = torch.where(ref.recv_topk_idx == -1, E - 1 if rank == 0 else 0,
                               ref.recv_topk_idx + rank * num_local)
        assert_equal("global expert_topk_ids", global_ids, want_ids)
        want_w = torch.where(ref.recv_topk_idx >= 0, ref.recv_topk_weights, 0.0)
        assert_equal("expert_topk_weights", expert_w, want_w, check_dtype=True)
        assert_equal("expert_num_tokens", expert_num_tokens,
                     ref.num_recv_tokens_per_expert.int())

        # The experts (dequantized for FP8) and TopKWeightAndReduce on each received row.
        rows = per_token_cast_back(expert_x, expert_x_scale) if block_fp8 else expert_x
        local_ids = torch.where(global_ids - rank * num_local >= 0,
                                global_ids - rank * num_local, -1)
        local_ids = torch.where(local_ids < num_local, local_ids, -1)
        fused = weighted_experts(rows, local_ids, expert_w)
        output = torch.empty_like(a1)
        adapter.finalize(output, fused, do_async=True, dbo=dbo)
        want_rows = per_token_cast_back(*(p.to(device) for p in ref.recv_x)) if block_fp8 \
            else ref.recv_x.to(device)
        want_fused = weighted_experts(want_rows, ref.recv_topk_idx.to(device),
                                      want_w.to(device))  # on the same device: same bits
        want, _ = reference_combine(want_fused.cpu(), ref, topk_ids.cpu(), E, group)
        assert_equal("vLLM output", output, want, check_dtype=True)
        cases += 1
    return cases


# ---------------------------------------------------------------------------------- SGLang
class SglangNormal:
    """The calls of SGLang's DeepEPBuffer.get_deepep_buffer and _DeepEPDispatcherImplNormal."""

    def __init__(self, group, num_experts, hidden_size, params_bytes, async_finish, config_json,
                 deep_gemm):
        self.group, self.num_experts, self.async_finish = group, num_experts, async_finish
        self.deep_gemm = deep_gemm
        if config_json:  # DeepEPConfig
            self.normal_dispatch_config = Config(**config_json["normal_dispatch"])
            self.normal_combine_config = Config(**config_json["normal_combine"])
            num_sms = config_json["normal_dispatch"]["num_sms"]
        else:
            self.normal_dispatch_config = self.normal_combine_config = None
            num_sms = Buffer.num_sms
        num_nvl_bytes, num_rdma_bytes = 0, 0
        hidden_bytes = hidden_size * params_bytes
        for config in (self.normal_dispatch_config or Buffer.get_dispatch_config(group.size()),
                       self.normal_combine_config or Buffer.get_combine_config(group.size())):
            num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()),
                                num_nvl_bytes)
            num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()),
                                 num_rdma_bytes)
        self.buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=False,
                             num_qps_per_rank=num_sms, allow_mnnvl=True)
        self.handle = None

    def dispatch(self, hidden_states, topk_ids, topk_weights, fp8):
        # dispatch_a
        topk_ids = topk_ids.to(torch.int64)
        if fp8:  # per-token-group FP8, scales column-major
            x_fp8, scales = per_token_cast_to_fp8(hidden_states)
            hidden_states = (x_fp8, scales.T.contiguous().T)
        previous_event = Buffer.capture() if self.async_finish else None
        # _dispatch_core
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
         previous_event) = self.buffer.get_dispatch_layout(
            topk_ids, self.num_experts, previous_event=previous_event,
            async_finish=self.async_finish, allocate_on_comm_stream=previous_event is not None)
        (recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, self.handle,
         event) = self.buffer.dispatch(
            hidden_states, topk_idx=topk_ids, topk_weights=topk_weights,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event,
            async_finish=self.async_finish,
            allocate_on_comm_stream=(previous_event is not None) and self.async_finish,
            expert_alignment=128 if self.deep_gemm else 1, config=self.normal_dispatch_config)
        # dispatch_b
        event.current_stream_wait() if self.async_finish else ()
        if isinstance(recv_x, tuple):
            hidden_states, hidden_states_scale = recv_x
        else:
            hidden_states, hidden_states_scale = recv_x, None
        return (hidden_states, hidden_states_scale, recv_topk_ids, recv_topk_weights,
                num_recv_tokens_per_expert)

    def combine(self, hidden_states):
        # combine_a
        output = hidden_states
        previous_event = Buffer.capture() if self.async_finish else None
        # combine_b / _combine_core
        combined_x, _, event = self.buffer.combine(
            output, self.handle, async_finish=self.async_finish, previous_event=previous_event,
            allocate_on_comm_stream=previous_event is not None,
            config=self.normal_combine_config)
        event.current_stream_wait() if self.async_finish else ()
        self.handle = None
        return combined_x


def run_sglang(seed, device):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    E = 2 * num_ranks
    config_json = {
        "normal_dispatch": dict(num_sms=24, num_max_nvl_chunked_send_tokens=16,
                                num_max_nvl_chunked_recv_tokens=256,
                                num_max_rdma_chunked_send_tokens=6,
                                num_max_rdma_chunked_recv_tokens=128),
        "normal_combine": dict(num_sms=24, num_max_nvl_chunked_send_tokens=6,
                               num_max_nvl_chunked_recv_tokens=256,
                               num_max_rdma_chunked_send_tokens=6,
                               num_max_rdma_chunked_recv_tokens=128),
    }
    cases = 0
    for async_finish, fp8, json, deep_gemm in ((False, False, None, False),
                                               (True, True, config_json, True)):
        dispatcher = SglangNormal(group, E, H, 1 if fp8 else 2, async_finish, json, deep_gemm)
        assert dispatcher.buffer.num_nvl_bytes > 0 and dispatcher.buffer.num_rdma_bytes == 0
        gen, x, topk_ids, topk_weights = inputs(seed + 10 + cases, 12 - 3 * rank, E, device)
        hidden, scale, recv_ids, recv_w, counts = dispatcher.dispatch(x, topk_ids.int(),
                                                                      topk_weights, fp8)
        alignment = 128 if deep_gemm else 1
        x_sent = cpu(per_token_cast_to_fp8(x)) if fp8 else x.cpu()
        ref = reference_dispatch(x_sent, topk_ids.cpu(), topk_weights.cpu(), E, REF_M, group,
                                 alignment)
        assert_equal("hidden_states", (hidden, scale) if fp8 else hidden, ref.recv_x,
                     check_dtype=True)
        assert_equal("topk_ids", recv_ids, ref.recv_topk_idx, check_dtype=True)
        want_w = torch.where(ref.recv_topk_idx >= 0, ref.recv_topk_weights, 0.0)
        assert_equal("topk_weights", recv_w, want_w, check_dtype=True)
        assert counts == [-(-int(c) // alignment) * alignment
                          for c in ref.num_recv_tokens_per_expert]
        rows = per_token_cast_back(hidden, scale) if fp8 else hidden
        combined = dispatcher.combine(weighted_experts(rows, recv_ids, recv_w))
        assert dispatcher.handle is None
        want_rows = per_token_cast_back(*(p.to(device) for p in ref.recv_x)) if fp8 \
            else ref.recv_x.to(device)
        want_y = weighted_experts(want_rows, ref.recv_topk_idx.to(device), want_w.to(device))
        want, _ = reference_combine(want_y.cpu(), ref, topk_ids.cpu(), E, group)
        assert_equal("SGLang combined hidden states", combined, want, check_dtype=True)
        cases += 1
    return cases


# -------------------------------------------------------------------------------- Megatron
_buffer = None


def get_hidden_bytes(x):
    return x.size(1) * max(x.element_size(), 2)


def get_buffer(group, hidden_bytes):
    """Megatron's get_buffer: size from both configs' hints, rebuild when too small."""
    global _buffer
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (Buffer.get_dispatch_config(group.size()),
                   Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()),
                            num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()),
                             num_rdma_bytes)
    if (_buffer is None or _buffer.group != group or _buffer.num_nvl_bytes < num_nvl_bytes
            or _buffer.num_rdma_bytes < num_rdma_bytes):
        _buffer = Buffer(group, num_nvl_bytes, num_rdma_bytes)
    return _buffer


class FusedDispatch(torch.autograd.Function):
    """The calls of Megatron's FusedDispatch (`Buffer.capture()` stands for
    `EventOverlap(EventHandle())`: an event on the current stream)."""

    @staticmethod
    def forward(ctx, x, token_indices, token_probs, num_experts, group, async_finish=False,
                allocate_on_comm_stream=False):
        previous_event = None
        if async_finish:
            previous_event = Buffer.capture()
        buffer = get_buffer(group, get_hidden_bytes(x))
        (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
         event) = buffer.get_dispatch_layout(
            token_indices, num_experts, previous_event=previous_event, async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream)
        (recv_x, recv_token_indices, recv_token_probs, num_recv_tokens_per_expert_list, handle,
         after_event_overlap) = buffer.dispatch(
            x, topk_idx=token_indices, topk_weights=token_probs,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, previous_event=event,
            async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after_event_overlap.current_stream_wait()
        ctx.group = group
        ctx.handle = handle
        ctx.async_finish = async_finish
        ctx.allocate_on_comm_stream = allocate_on_comm_stream
        tokens_per_expert = torch.tensor(num_recv_tokens_per_expert_list)
        return recv_x, recv_token_indices, recv_token_probs, tokens_per_expert, handle

    @staticmethod
    def backward(ctx, grad_output, grad_token_indices, grad_token_probs, grad_tokens_per_expert,
                 grad_handle):
        buffer = get_buffer(ctx.group, get_hidden_bytes(grad_output))
        handle = ctx.handle
        previous_event = None
        if ctx.async_finish:
            previous_event = Buffer.capture()
        grad_x, grad_token_probs, after_event = buffer.combine(
            grad_output.contiguous(), handle, topk_weights=grad_token_probs.float(),
            previous_event=previous_event, async_finish=ctx.async_finish,
            allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            after_event.current_stream_wait()
        return grad_x, None, grad_token_probs, None, None, None, None


class FusedCombine(torch.autograd.Function):
    """The calls of Megatron's FusedCombine."""

    @staticmethod
    def forward(ctx, x, group, handle, async_finish=False, allocate_on_comm_stream=False):
        previous_event = None
        if async_finish:
            previous_event = Buffer.capture()
        buffer = get_buffer(group, get_hidden_bytes(x))
        combined_x, _, after_event = buffer.combine(
            x, handle=handle, async_finish=async_finish, previous_event=previous_event,
            allocate_on_comm_stream=allocate_on_comm_stream)
        if async_finish:
            after_event.current_stream_wait()
        ctx.handle = handle
        ctx.group = group
        ctx.async_finish = async_finish
        ctx.allocate_on_comm_stream = allocate_on_comm_stream
        return combined_x, None

    @staticmethod
    def backward(ctx, grad_output, previous_event=None):
        previous_event = None
        if ctx.async_finish:
            previous_event = Buffer.capture()
        buffer = get_buffer(ctx.group, get_hidden_bytes(grad_output))
        grad_x, _, _, _, _, after_event = buffer.dispatch(
            grad_output.contiguous(), handle=ctx.handle, previous_event=previous_event,
            async_finish=ctx.async_finish, allocate_on_comm_stream=ctx.allocate_on_comm_stream)
        if ctx.async_finish:
            after_event.current_stream_wait()
        return grad_x, None, None, None, None


def indices_to_multihot(indices, probs, num_local_experts):
    """Megatron's _DeepepManager._indices_to_multihot."""
    batch_size = indices.shape[0]
    routing_map = torch.zeros((batch_size, num_local_experts), dtype=torch.long,
                              device=indices.device)
    multihot_probs = torch.zeros((batch_size, num_local_experts), dtype=torch.float,
                                 device=indices.device)
    mask = indices != -1
    valid_indices = indices[mask]
    row_indices = torch.arange(batch_size, device=indices.device).repeat_interleave(
        mask.sum(dim=1))
    routing_map[row_indices, valid_indices] = 1
    multihot_probs[row_indices, valid_indices] = probs[mask]
    return routing_map.bool(), multihot_probs


def megatron_experts(recv_x, recv_indices, recv_probs, num_local):
    """Permute by expert, expert e scales its tokens by (e + 1) * prob, unpermute (sum)."""
    routing_map, probs = indices_to_multihot(recv_indices, recv_probs, num_local)
    out = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device)
    for e in range(num_local):
        rows = routing_map[:, e].nonzero().flatten()
        expert_out = recv_x[rows].float() * (probs[rows, e] * (e + 1))[:, None]
        out = out.index_add(0, rows, expert_out.to(torch.bfloat16).float())
    return out.to(torch.bfloat16)


def run_megatron(seed, device):
    global _buffer
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    E = 4 * num_ranks
    num_local = E // num_ranks
    cases = 0
    for async_finish, allocate in ((False, False), (True, True)):
        _buffer = None
        gen, x0, token_indices, probs0 = inputs(seed + 20 + cases, 10 + rank, E, device)
        g = torch.randn(x0.shape, generator=gen).to(device)
        x = x0.clone().requires_grad_(True)
        token_probs = probs0.clone().requires_grad_(True)

        # _DeepepManager.dispatch -> expert computation -> combine, then backward.
        hidden, dispatched_indices, dispatched_probs, tokens_per_expert, handle = \
            FusedDispatch.apply(x.contiguous(), token_indices, token_probs, E, group,
                                async_finish, allocate)
        y = megatron_experts(hidden, dispatched_indices, dispatched_probs, num_local)
        combined, _ = FusedCombine.apply(y, group, handle, async_finish, allocate)
        (combined.float() * g).sum().backward()
        buffer = _buffer
        assert get_buffer(group, H * 2) is buffer  # sized once, reused

        # The same computation through the reference, gradients by hand.
        indices = token_indices.cpu()
        ref = reference_dispatch(x0.cpu(), indices, probs0.cpu(), E, REF_M, group)
        assert_equal("tokens_per_expert", tokens_per_expert, ref.num_recv_tokens_per_expert)
        assert_equal("dispatched_indices", dispatched_indices, ref.recv_topk_idx)
        # The experts and their gradients on the same device as the adapter's: same bits.
        ref_x = ref.recv_x.to(device).requires_grad_(True)
        ref_probs = torch.where(ref.recv_topk_idx >= 0, ref.recv_topk_weights, 0.0) \
            .to(device).requires_grad_(True)
        ref_y = megatron_experts(ref_x, ref.recv_topk_idx.to(device), ref_probs, num_local)
        want, _ = reference_combine(ref_y.detach().cpu(), ref, indices, E, group)
        assert_equal("combined", combined, want, check_dtype=True)
        grad_y = reference_dispatch(g.to(torch.bfloat16).cpu(), indices, None, E, REF_M,
                                    group).recv_x
        grad_rx, grad_rp = torch.autograd.grad(ref_y, (ref_x, ref_probs), grad_y.to(device))
        want_gx, want_gp = reference_combine(grad_rx.cpu(), ref, indices, E, group,
                                             topk_weights=grad_rp.float().cpu())
        assert_equal("x.grad", x.grad, want_gx, check_dtype=True)
        assert_equal("token_probs.grad", token_probs.grad, want_gp, check_dtype=True)
        cases += 1
    return cases


@pytest.mark.parametrize("device", DEVICES)
def test_vllm_deepep_ht(device):
    assert run_local_ranks(run_vllm, 2, 1, device) == [3, 3]


@pytest.mark.parametrize("device", DEVICES)
def test_sglang_deepep_normal(device):
    assert run_local_ranks(run_sglang, 2, 2, device) == [2, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_megatron_fused_a2a_forward_backward(device):
    assert run_local_ranks(run_megatron, 2, 3, device) == [2, 2]
