"""The call sequences of DeepEP V2's users replayed on `epcomm.ElasticBuffer` (local CPU ranks,
collective backend; the same on a GPU when there is one): DeepEP's own V2 test
(`tests/elastic/test_ep.py`), torchtitan's adapter (`torchtitan/distributed/deepep/deepep.py`:
custom ops with autograd, cached dispatch in combine's backward), vLLM's
(`.../fused_moe/prepare_finalize/deepep_v2.py`) and SGLang's
(`.../moe/token_dispatcher/deepep_v2.py`). Each replays the argument names, tuple unpacking and
handle and event use of its source; results are checked bitwise against
`epcomm.testing.reference` through `epcomm.testing.verify`.
"""
from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
import torch.distributed as dist

import epcomm
from epcomm.fp8 import per_token_cast_back, per_token_cast_to_fp8
from epcomm.testing.launch import run_seeded
from epcomm.testing.reference import reference_combine, reference_dispatch
from epcomm.testing.verify import (Case, assert_equal, assert_tma_aligned_col_major,
                                   check_dispatch_outputs)

SEED = int(os.environ.get("EPCOMM_TEST_SEED", time.time_ns() % 1_000_000))


def _run(fn, world_size: int, *args, **kwargs):
    return run_seeded(fn, world_size, SEED, *args, **kwargs)
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="CUDA tests need a GPU (none on this machine)")


def _group():
    return dist.group.WORLD


def _cpu(value):
    if value is None:
        return None
    if isinstance(value, tuple):
        return tuple(part.cpu() for part in value)
    return value.cpu()


def _check_dispatch(outputs, num_topk: int, ref, **case) -> None:
    """`verify.check_dispatch_outputs` of `outputs` (recv_x, recv_topk_idx, recv_topk_weights,
    handle) against the reference dispatch `ref`; `case`: the `Case` fields of the call (FP8
    scales as returned, column-major ones too)."""
    view = type("View", (), dict(num_ranks=dist.get_world_size(), num_topk=num_topk))()
    check_dispatch_outputs(view, Case(**case), outputs, ref)


# ------------------------------------------------------------------ DeepEP's V2 test


def _slot_rows(src_global: torch.Tensor, num_topk: int, hidden: int, seed: int) -> torch.Tensor:
    """[N, K, H] bf16: the expert output of slot j of the token with global index
    `src_rank * M + src_token` (a function of that index, so the source can compute what it
    gets back), magnitudes spread over 2^-8..2^8 so that the summation order shows."""
    ids = src_global.long().cpu()[:, None] * num_topk + torch.arange(num_topk)[None, :]
    phase = ((ids * 7919 + seed) % 1009).float()[..., None] / 1009
    columns = torch.arange(1, hidden + 1).float()
    scale = torch.exp2(((ids * 31 + seed) % 17 - 8).float())[..., None]
    return (torch.sin(phase * columns + 0.5) * scale).to(torch.bfloat16)


def _expected_combine(y: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, biases,
                      reduce_in_rank: bool) -> torch.Tensor:
    """What DeepEP's test expects back at the source, from the source's own data: `y` [T, K, H]
    bf16 (zero for -1 slots), fp32 from the bias sum. `reduce_in_rank`: each rank's slots summed
    in slot order in fp32 and rounded to bf16, added at the rank's last slot (multiple
    reduction); else every slot's row added in slot order (one reduction)."""
    num_tokens, num_topk, hidden = y.shape
    rank_of = torch.where(topk_idx >= 0, topk_idx // (num_experts // dist.get_world_size()), -1)
    acc = torch.zeros(num_tokens, hidden)
    for bias in biases:
        acc = acc + bias.float()
    for j in range(num_topk):
        if not reduce_in_rank:
            acc = acc + y[:, j].float()
            continue
        same = rank_of == rank_of[:, j:j + 1]
        last = (rank_of[:, j] >= 0) & ~same[:, j + 1:].any(1)
        part = torch.zeros(num_tokens, hidden)
        for k in range(j + 1):
            part = part + torch.where(same[:, k, None], y[:, k].float(), 0.0)
        acc = torch.where(last[:, None], acc + part.to(torch.bfloat16).float(), acc)
    return acc.to(torch.bfloat16)


def _ep_modes():
    """A cover of DeepEP's test modes: (do_handle_copy, expert_alignment, use_fp8_dispatch,
    num_bias, with_previous_event, async_with_compute_stream, allocate_on_comm_stream)."""
    return [(1, 128, 1, 0, 0, 0, 0), (0, 1, 0, 1, 1, 1, 1), (1, 1, 1, 2, 0, 1, 0),
            (0, 128, 0, 2, 1, 0, 1), (1, 4, 0, 0, 0, 0, 1)]


def _launch(buffer, name: str, with_previous_event: int, async_with_compute_stream: int,
            params: dict):
    if with_previous_event:
        params.update(previous_event=buffer.capture())
    values = getattr(buffer, name)(**params)
    values[-1].current_stream_wait() if async_with_compute_stream else ()
    return values


def run_deepep_test(device: str, seed: int, num_tokens_max: int = 12, hidden: int = 256,
                    num_topk: int = 4, experts_per_rank: int = 4) -> int:
    """DeepEP's `tests/elastic/test_ep.py` (`test_loop` + `test_dispatch_combine`), checks
    included, on two argument sets: CPU sync with multiple reduction and deterministic mode,
    and sync-free with single reduction."""
    group, rank, R = _group(), dist.get_rank(), dist.get_world_size()
    count = 0
    for do_cpu_sync, allow_multiple_reduction, deterministic in ((1, 1, True), (0, 0, False)):
        buffer = epcomm.ElasticBuffer(group, num_max_tokens_per_rank=num_tokens_max,
                                      hidden=hidden, deterministic=deterministic,
                                      allow_hybrid_mode=1, allow_multiple_reduction=bool(
                                          allow_multiple_reduction),
                                      prefer_overlap_with_compute=bool(0), sl_idx=0,
                                      num_allocated_qps=max(0, 0), explicitly_destroy=True,
                                      num_gpu_timeout_secs=100, num_cpu_timeout_secs=100,
                                      device=device)
        num_scaleout_ranks, num_scaleup_ranks = buffer.get_logical_domain_size()
        assert (num_scaleout_ranks, num_scaleup_ranks) == (1, R)
        num_max_tokens_per_rank = num_tokens_max
        num_tokens = max(1, num_tokens_max - rank)
        num_experts = experts_per_rank * buffer.num_ranks
        num_local_experts = num_experts // buffer.num_ranks
        num_sms = buffer.get_theoretical_num_sms(num_experts, num_topk)
        num_qps = buffer.get_theoretical_num_qps(num_sms)
        assert num_qps <= buffer.num_allocated_qps

        gen = torch.Generator().manual_seed(seed + 97 * rank + do_cpu_sync)
        scores = torch.rand(num_tokens, num_experts, generator=gen).to(device)
        topk_weights, topk_idx = torch.topk(scores, num_topk, dim=-1, largest=True, sorted=False)
        topk_idx = topk_idx.to(epcomm.topk_idx_t)
        masked = torch.rand(topk_idx.shape, generator=gen).to(device) < 0.25
        topk_idx.masked_fill_(masked, -1)
        topk_weights.masked_fill_(topk_idx < 0, 0)

        for (do_handle_copy, expert_alignment, use_fp8_dispatch, num_bias, with_previous_event,
             async_with_compute_stream, allocate_on_comm_stream) in _ep_modes():
            x = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16).to(device)
            x = per_token_cast_to_fp8(x) if use_fp8_dispatch else x
            bias = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16).to(
                device) if num_bias == 1 else None
            if num_bias == 2:
                bias = tuple(torch.randn((num_tokens, hidden), generator=gen).to(
                    torch.bfloat16).to(device) for _ in range(num_bias))
            biases = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else bias

            def get_recv_x_bf16(recv_x) -> torch.Tensor:
                return per_token_cast_back(*recv_x) if use_fp8_dispatch else recv_x

            dispatch_args = dict(
                x=x, topk_idx=topk_idx, topk_weights=topk_weights, num_sms=num_sms,
                num_qps=num_qps, num_max_tokens_per_rank=num_max_tokens_per_rank,
                num_experts=num_experts, expert_alignment=expert_alignment,
                async_with_compute_stream=async_with_compute_stream,
                allocate_on_comm_stream=allocate_on_comm_stream, do_handle_copy=do_handle_copy,
                do_cpu_sync=do_cpu_sync)
            recv_x, recv_topk_idx, recv_topk_weights, handle, dispatch_event = \
                _launch(buffer, "dispatch", with_previous_event, async_with_compute_stream,
                        dispatch_args)
            recv_x_bf16 = get_recv_x_bf16(recv_x)
            expanded_dispatch_args = dispatch_args | dict(do_expand=True,
                                                          use_tma_aligned_col_major_sf=True)
            expanded_recv_x, expanded_recv_topk_idx, expanded_recv_topk_weights, \
                expanded_handle, expanded_dispatch_event = \
                _launch(buffer, "dispatch", with_previous_event, async_with_compute_stream,
                        expanded_dispatch_args)
            expanded_recv_x_bf16 = get_recv_x_bf16(expanded_recv_x)
            cached_dispatch_args = dict(
                x=x, num_sms=num_sms, num_qps=num_qps,
                async_with_compute_stream=async_with_compute_stream,
                allocate_on_comm_stream=allocate_on_comm_stream, handle=handle)
            cached_recv_x, cached_recv_topk_idx, cached_recv_topk_weights, cached_handle, \
                cached_dispatch_event = _launch(buffer, "dispatch", with_previous_event,
                                                async_with_compute_stream, cached_dispatch_args)
            cached_expanded_dispatch_args = cached_dispatch_args | dict(
                topk_weights=topk_weights, do_expand=True, use_tma_aligned_col_major_sf=True,
                do_zero_padding=True, handle=expanded_handle)
            cached_expanded_recv_x, _, cached_expanded_recv_topk_weights, _, _ = _launch(
                buffer, "dispatch", with_previous_event, async_with_compute_stream,
                cached_expanded_dispatch_args)

            num_recv_tokens = handle.psum_num_recv_tokens_per_scaleup_rank[-1].item()
            assert num_recv_tokens == \
                expanded_handle.psum_num_recv_tokens_per_scaleup_rank[-1].item()

            # The reference dispatch (epcomm.testing.reference), both layouts, bitwise.
            ref = reference_dispatch(_cpu(x), _cpu(topk_idx), _cpu(topk_weights), num_experts,
                                     num_max_tokens_per_rank, group, expert_alignment)
            ref_expand = reference_dispatch(_cpu(x), _cpu(topk_idx), _cpu(topk_weights),
                                            num_experts, num_max_tokens_per_rank, group,
                                            expert_alignment, True)
            case = dict(num_experts=num_experts, expert_alignment=expert_alignment,
                        do_cpu_sync=bool(do_cpu_sync), fp8=bool(use_fp8_dispatch))
            _check_dispatch((recv_x, recv_topk_idx, recv_topk_weights, handle), num_topk, ref,
                            **case)
            _check_dispatch((cached_recv_x, cached_recv_topk_idx, cached_recv_topk_weights,
                             cached_handle), num_topk,
                            dataclasses.replace(ref, recv_topk_weights=None), **case)
            _check_dispatch((expanded_recv_x, expanded_recv_topk_idx,
                             expanded_recv_topk_weights, expanded_handle), num_topk, ref_expand,
                            do_expand=True, **case)
            _check_dispatch((cached_expanded_recv_x, None, cached_expanded_recv_topk_weights,
                             expanded_handle), num_topk, ref_expand, do_expand=True,
                            do_zero_padding=True, **case)
            if use_fp8_dispatch:  # TMA-aligned column-major scales
                assert_tma_aligned_col_major("expanded scales", expanded_recv_x[1])
                assert_tma_aligned_col_major("cached expanded scales", cached_expanded_recv_x[1])

            # Combine inputs from the source token's global index, as DeepEP's test builds them.
            src_token_global_idx = handle.recv_src_metadata[:num_recv_tokens, 0]
            local_y = _slot_rows(src_token_global_idx, num_topk, hidden, seed)
            local_y[_cpu(recv_topk_idx[:num_recv_tokens]) == -1] = 0
            local_reduced_y = _ordered_sum(local_y)
            input_for_combine = torch.empty_like(recv_x_bf16, dtype=torch.bfloat16,
                                                 device=device)
            input_for_combine[:num_recv_tokens] = local_reduced_y.to(device)
            expanded_src_token_global_idx = expanded_handle.recv_src_metadata[:num_recv_tokens, 0]
            local_y_expand = _slot_rows(expanded_src_token_global_idx, num_topk, hidden, seed)
            input_for_expand_combine = torch.empty(
                (expanded_recv_x_bf16.shape[0] + 1, hidden), dtype=torch.bfloat16,
                device=device)
            input_for_expand_combine[
                expanded_handle.recv_src_metadata[:num_recv_tokens, 2:].flatten()] = \
                local_y_expand.view(-1, hidden).to(device)
            input_for_expand_combine = input_for_expand_combine[:-1, ...]

            combine_args = dict(x=input_for_combine, topk_weights=recv_topk_weights, bias=bias,
                                handle=handle, num_sms=num_sms, num_qps=num_qps,
                                async_with_compute_stream=async_with_compute_stream,
                                allocate_on_comm_stream=allocate_on_comm_stream)
            combined_x, combined_topk_weights, combine_event = _launch(
                buffer, "combine", with_previous_event, async_with_compute_stream, combine_args)
            reduced_combine_args = dict(x=input_for_expand_combine, bias=bias,
                                        handle=expanded_handle, num_sms=num_sms,
                                        num_qps=num_qps,
                                        async_with_compute_stream=async_with_compute_stream,
                                        allocate_on_comm_stream=allocate_on_comm_stream)
            if allow_multiple_reduction:
                reduced_combine_args["topk_weights"] = expanded_recv_topk_weights
            reduced_combined_x, reduced_combined_topk_weights, reduced_combine_event = _launch(
                buffer, "combine", with_previous_event, async_with_compute_stream,
                reduced_combine_args)

            # Handle copies: a cached dispatch returns its handle.
            assert (topk_idx.data_ptr() != handle.topk_idx.data_ptr()) == bool(do_handle_copy)
            assert (topk_idx.data_ptr() != cached_handle.topk_idx.data_ptr()) == \
                bool(do_handle_copy)
            assert handle.topk_idx.data_ptr() == cached_handle.topk_idx.data_ptr()

            # Combined data: bitwise the reference's, and what DeepEP's test expects from the
            # source's own data (its two reduction recipes).
            ref_y = _slot_rows(torch.arange(num_tokens) + rank * num_max_tokens_per_rank,
                               num_topk, hidden, seed)
            ref_y[_cpu(topk_idx) == -1] = 0
            cpu_biases = tuple(b.cpu() for b in biases)
            want, want_w = reference_combine(
                input_for_combine[:num_recv_tokens].cpu(), ref, _cpu(topk_idx), num_experts,
                group, topk_weights=_cpu(recv_topk_weights)[:num_recv_tokens],
                bias=cpu_biases or None)
            assert_equal("combined_x", combined_x, want, check_dtype=True)
            assert_equal("combined_topk_weights", combined_topk_weights, want_w)
            assert_equal("combined_topk_weights (the weights dispatched)",
                         combined_topk_weights, topk_weights)
            assert_equal("combined_x (DeepEP's recipe)", combined_x,
                         _expected_combine(ref_y, _cpu(topk_idx), num_experts, cpu_biases, True))
            n_e = ref_expand.expand_valid.shape[0]
            if allow_multiple_reduction:
                want_r, want_rw = reference_combine(
                    input_for_expand_combine[:n_e].cpu(), ref_expand, _cpu(topk_idx),
                    num_experts, group, topk_weights=_cpu(expanded_recv_topk_weights)[:n_e],
                    bias=cpu_biases or None)
                assert_equal("reduced_combined_x", reduced_combined_x, want_r)
                assert_equal("reduced_combined_topk_weights", reduced_combined_topk_weights,
                             want_rw)
                assert_equal("reduced_combined_topk_weights (the weights dispatched)",
                             reduced_combined_topk_weights, topk_weights)
            else:
                assert reduced_combined_topk_weights is None
            assert_equal("reduced_combined_x (DeepEP's recipe)", reduced_combined_x,
                         _expected_combine(ref_y, _cpu(topk_idx), num_experts, cpu_biases,
                                           bool(allow_multiple_reduction)))

            # Valid parts of the sync-free outputs; the handle's metadata sliced and assigned
            # back, as DeepEP's test does.
            if not do_cpu_sync:
                if use_fp8_dispatch:
                    recv_x = (recv_x[0][:num_recv_tokens], recv_x[1][:num_recv_tokens])
                    cached_recv_x = (cached_recv_x[0][:num_recv_tokens],
                                     cached_recv_x[1][:num_recv_tokens])
                else:
                    recv_x = recv_x[:num_recv_tokens]
                    cached_recv_x = cached_recv_x[:num_recv_tokens]
                recv_x_bf16 = recv_x_bf16[:num_recv_tokens]
                recv_topk_idx = recv_topk_idx[:num_recv_tokens]
                recv_topk_weights = recv_topk_weights[:num_recv_tokens]
                cached_recv_topk_idx = cached_recv_topk_idx[:num_recv_tokens]
                handle.recv_src_metadata = handle.recv_src_metadata[:num_recv_tokens]
                expanded_handle.recv_src_metadata = \
                    expanded_handle.recv_src_metadata[:num_recv_tokens]
            expanded_indices = expanded_handle.recv_src_metadata[:, 2:]
            expanded_mask = expanded_indices >= 0
            valid_expanded_indices = expanded_indices[expanded_mask]

            if deterministic:  # the same dispatch twice: the same bits
                twice = _launch(buffer, "dispatch", with_previous_event,
                                async_with_compute_stream, dispatch_args)
                assert_equal("recv_x twice", get_recv_x_bf16(twice[0])[:num_recv_tokens],
                             recv_x_bf16)
                assert_equal("recv_topk_idx twice", twice[1][:num_recv_tokens], recv_topk_idx)
                assert_equal("recv_src_metadata twice",
                             twice[3].recv_src_metadata[:num_recv_tokens, :1],
                             handle.recv_src_metadata[:, :1])
                expanded_twice = _launch(buffer, "dispatch", with_previous_event,
                                         async_with_compute_stream, expanded_dispatch_args)
                assert_equal("expanded recv_x twice",
                             get_recv_x_bf16(expanded_twice[0])[valid_expanded_indices],
                             expanded_recv_x_bf16[valid_expanded_indices])

            # The cumulative statistics.
            cumulative_local_expert_recv_stats = torch.zeros((num_local_experts,),
                                                             dtype=torch.int, device=device)
            dispatch_args["cumulative_local_expert_recv_stats"] = \
                cumulative_local_expert_recv_stats
            _launch(buffer, "dispatch", with_previous_event, async_with_compute_stream,
                    dispatch_args)
            assert_equal("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                         ref.num_recv_tokens_per_expert)

            assert expanded_recv_topk_idx is None
            assert expanded_handle.recv_src_metadata.size(0) == num_recv_tokens
            cached_expanded_recv_x_bf16 = get_recv_x_bf16(cached_expanded_recv_x)
            assert_equal("cached expanded recv_x",
                         cached_expanded_recv_x_bf16[valid_expanded_indices],
                         expanded_recv_x_bf16[valid_expanded_indices])
            for expert_idx in range(num_local_experts):  # zero padding
                start = expanded_handle.psum_num_recv_tokens_per_expert[expert_idx].item()
                end = -(-start // expert_alignment) * expert_alignment
                assert (cached_expanded_recv_x_bf16[start:end] == 0).all()
                assert (cached_expanded_recv_topk_weights[start:end] == 0).all()
            if use_fp8_dispatch:
                assert torch.equal(recv_x[0], cached_recv_x[0])
                assert torch.equal(recv_x[1], cached_recv_x[1])
            else:
                assert torch.equal(recv_x, cached_recv_x)
            assert torch.equal(recv_topk_idx, cached_recv_topk_idx)
            assert torch.equal(handle.dst_buffer_slot_idx, cached_handle.dst_buffer_slot_idx)
            assert torch.equal(handle.psum_num_recv_tokens_per_scaleup_rank,
                               cached_handle.psum_num_recv_tokens_per_scaleup_rank)
            assert handle.num_recv_tokens_per_expert_list == \
                cached_handle.num_recv_tokens_per_expert_list
            assert recv_x_bf16.size(0) == num_recv_tokens
            counts = ref.num_recv_tokens_per_expert.tolist()
            if do_cpu_sync:
                assert handle.num_recv_tokens_per_expert_list == \
                    [-(-c // expert_alignment) * expert_alignment for c in counts]
            psum = [0] + handle.psum_num_recv_tokens_per_expert.tolist()
            expanded_psum = [0] + expanded_handle.psum_num_recv_tokens_per_expert.tolist()
            for i in range(num_local_experts):
                aligned = -(-counts[i] // expert_alignment) * expert_alignment
                assert psum[i + 1] - psum[i] == aligned
                assert expanded_psum[i + 1] - \
                    -(-expanded_psum[i] // expert_alignment) * expert_alignment == counts[i]
            count += 1
        buffer.destroy()
    return count


def _ordered_sum(y: torch.Tensor) -> torch.Tensor:
    """[N, K, H] -> [N, H]: fp32 from 0, slot by slot in order, rounded to bf16 once."""
    acc = torch.zeros(y.shape[0], y.shape[2])
    for j in range(y.shape[1]):
        acc = acc + y[:, j].float()
    return acc.to(torch.bfloat16)


# ------------------------------------------------------------------ torchtitan


class _Titan:
    """torchtitan's module state: the process-global buffer, the handle cache behind the CPU
    handle ids, the pending combine event; and its custom-op library."""

    buffer = None
    handles: dict = {}
    counter = 0
    pending_event = None
    library = None


def _titan_next_handle_id() -> torch.Tensor:
    _Titan.counter += 1
    return torch.tensor([_Titan.counter], dtype=torch.int64, device="cpu")


def _titan_dispatch_impl(x, topk_idx, topk_weights, num_experts: int, num_tokens_per_rank: int,
                         cudagraphable: bool):
    buffer = _Titan.buffer
    num_sms = buffer.get_theoretical_num_sms(num_experts, topk_idx.shape[1])
    recv_x, recv_topk_idx, recv_scores, handle, _event = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts,
        num_max_tokens_per_rank=num_tokens_per_rank, num_sms=num_sms, do_expand=cudagraphable,
        do_cpu_sync=not cudagraphable)
    handle_id = _titan_next_handle_id()
    _Titan.handles[handle_id.item()] = handle
    if cudagraphable:
        psum = handle.psum_num_recv_tokens_per_expert
        num_recv_per_expert = torch.diff(psum, prepend=psum.new_zeros(1)).to(torch.int32)
        recv_topk_idx = recv_x.new_empty(0, dtype=torch.long)
    else:
        num_recv_per_expert = torch.tensor(handle.num_recv_tokens_per_expert_list,
                                           dtype=torch.int32, device="cpu")
    return recv_x, recv_topk_idx, recv_scores, num_recv_per_expert, handle_id


def _titan_dispatch_setup(ctx, inputs, output):
    x, *_ = inputs
    *_, handle_id = output
    ctx.input_dtype = x.dtype
    ctx.saved_handle = _Titan.handles.get(handle_id.item())


def _titan_dispatch_backward(ctx, grad_recv_x, grad_recv_topk_idx, grad_recv_scores,
                             grad_num_recv, grad_handle_id):
    if grad_recv_x is None:
        return None, None, None, None, None, None
    grad_x, grad_scores, _event = _Titan.buffer.combine(
        grad_recv_x, handle=ctx.saved_handle,
        topk_weights=grad_recv_scores.float() if grad_recv_scores is not None else None)
    grad_x = grad_x.to(ctx.input_dtype)
    grad_topk_weights = grad_scores.to(ctx.input_dtype) if grad_scores is not None else None
    return grad_x, None, grad_topk_weights, None, None, None


def _titan_combine_impl(x, handle_id, will_backward: bool):
    if not will_backward:
        handle = _Titan.handles.pop(handle_id.item(), None)
    else:
        handle = _Titan.handles.get(handle_id.item())
    combined, _combined_weights, after_event = _Titan.buffer.combine(
        x, handle=handle, topk_weights=None, async_with_compute_stream=True)
    _Titan.pending_event = after_event
    return combined


def _titan_combine_setup(ctx, inputs, output):
    _, handle_id, _will_backward = inputs
    ctx.saved_handle = _Titan.handles.pop(handle_id.item(), None)


def _titan_combine_backward(ctx, grad_combined):
    handle = ctx.saved_handle
    grad_x, _idx, _scores, _handle, _event = _Titan.buffer.dispatch(
        grad_combined, handle=handle, num_sms=handle.num_sms, do_cpu_sync=False)
    return grad_x, None, None


def _titan_ops(device: str):
    """torchtitan's two custom ops, registered once per process (for `device`)."""
    if _Titan.library is None:
        lib = torch.library.Library("epcomm_titan", "DEF")
        lib.define("dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, "
                   "int num_tokens_per_rank, bool cudagraphable) "
                   "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
        lib.define("combine(Tensor x, Tensor handle_id, bool will_backward) -> Tensor")
        key = "CUDA" if device == "cuda" else "CPU"
        lib.impl("dispatch", _titan_dispatch_impl, key)
        lib.impl("combine", _titan_combine_impl, key)
        torch.library.register_autograd("epcomm_titan::dispatch", _titan_dispatch_backward,
                                        setup_context=_titan_dispatch_setup)
        torch.library.register_autograd("epcomm_titan::combine", _titan_combine_backward,
                                        setup_context=_titan_combine_setup)
        _Titan.library = lib
    return torch.ops.epcomm_titan


def _titan_get_buffer(group, *, hidden: int, num_max_tokens_per_rank: int, num_topk: int,
                      use_fp8_dispatch: bool = False, device: str = "cpu"):
    needed_bytes = epcomm.ElasticBuffer.get_buffer_size_hint(
        group, num_max_tokens_per_rank, hidden, num_topk=num_topk,
        use_fp8_dispatch=use_fp8_dispatch)
    if _Titan.buffer is not None and _Titan.buffer.group == group and \
            _Titan.buffer.num_bytes >= needed_bytes:
        return _Titan.buffer
    _Titan.buffer = epcomm.ElasticBuffer(
        group, num_bytes=needed_bytes, num_max_tokens_per_rank=num_max_tokens_per_rank,
        hidden=hidden, num_topk=num_topk, use_fp8_dispatch=use_fp8_dispatch,
        deterministic=torch.are_deterministic_algorithms_enabled(), explicitly_destroy=True,
        device=device)
    return _Titan.buffer


def _titan_sync_combine() -> None:
    if _Titan.pending_event is not None:
        _Titan.pending_event.current_stream_wait()
        _Titan.pending_event = None


def _permute(hidden_states, dispatched_indices, dispatched_scores):
    mask = dispatched_indices != -1
    valid_expert_ids = dispatched_indices[mask]
    valid_scores = dispatched_scores[mask]
    sort_order = torch.argsort(valid_expert_ids, stable=True)
    permuted_indices = torch.arange(len(hidden_states), device=hidden_states.device) \
        .repeat_interleave(mask.sum(dim=1))[sort_order]
    return hidden_states.index_select(0, permuted_indices), valid_scores[sort_order], \
        permuted_indices


def _unpermute(permuted_hidden_states, permuted_indices, num_tokens: int):
    hidden_dim = permuted_hidden_states.shape[1]
    out = torch.zeros((num_tokens, hidden_dim), dtype=permuted_hidden_states.dtype,
                      device=permuted_hidden_states.device)
    out.scatter_add_(0, permuted_indices.unsqueeze(1).expand(-1, hidden_dim),
                     permuted_hidden_states)
    return out


class _RefDispatch(torch.autograd.Function):
    """The reference pipeline's dispatch op: `reference_dispatch` forward, `reference_combine`
    of the gradients backward (torchtitan's adjoint), outputs as torchtitan's op."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, num_experts, num_tokens_per_rank, expand):
        ref = reference_dispatch(x, topk_idx, topk_weights, num_experts, num_tokens_per_rank,
                                 _group(), 1, expand)
        ctx.ref, ctx.topk_idx, ctx.num_experts, ctx.input_dtype = ref, topk_idx, num_experts, \
            x.dtype
        idx = ref.recv_topk_idx if not expand else x.new_empty(0, dtype=torch.long)
        return ref.recv_x, idx, ref.recv_topk_weights

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_idx, grad_recv_scores):
        grad_x, grad_scores = reference_combine(
            grad_recv_x.contiguous(), ctx.ref, ctx.topk_idx, ctx.num_experts, _group(),
            topk_weights=grad_recv_scores.float() if grad_recv_scores is not None else None)
        grad_w = grad_scores.to(ctx.input_dtype) if grad_scores is not None else None
        return grad_x.to(ctx.input_dtype), grad_w, None, None, None, None


class _RefCombine(torch.autograd.Function):
    """The reference pipeline's combine op; backward: the gradient dispatched by the same
    routing (torchtitan's cached dispatch)."""

    @staticmethod
    def forward(ctx, x, ref, topk_idx, num_experts, num_tokens_per_rank):
        ctx.topk_idx, ctx.num_experts, ctx.m = topk_idx, num_experts, num_tokens_per_rank
        ctx.expand = ref.recv_topk_idx is None
        return reference_combine(x, ref, topk_idx, num_experts, _group())[0]

    @staticmethod
    def backward(ctx, grad_combined):
        ref = reference_dispatch(grad_combined.contiguous(), ctx.topk_idx, None, ctx.num_experts,
                                 ctx.m, _group(), 1, ctx.expand)
        return ref.recv_x, None, None, None, None


def _titan_moe(ops, x, topk_idx, scores, num_experts: int, num_tokens_per_rank: int,
               expert_weight: torch.Tensor, cudagraphable: bool, reference: bool):
    """torchtitan's `dispatch_tokens` -> grouped experts -> `combine_tokens` -> `sync_combine`,
    through its custom ops (or, with `reference`, the reference pipeline's)."""
    cudagraphable = cudagraphable and not torch.is_grad_enabled()
    topk_idx = topk_idx.contiguous().masked_fill(scores == 0, -1)
    scores = scores.contiguous().float()
    will_backward = torch.is_grad_enabled()
    if reference:
        recv_x, recv_topk_idx, recv_scores = _RefDispatch.apply(
            x, scores, topk_idx, num_experts, num_tokens_per_rank, cudagraphable)
        ref = reference_dispatch(x.detach(), topk_idx, None, num_experts, num_tokens_per_rank,
                                 _group(), 1, cudagraphable)
    else:
        recv_x, recv_topk_idx, recv_scores, num_recv_per_expert, handle_id = ops.dispatch(
            x, topk_idx, scores, num_experts=num_experts,
            num_tokens_per_rank=num_tokens_per_rank, cudagraphable=cudagraphable)

    def combine(hidden_states):
        if reference:
            return _RefCombine.apply(hidden_states, ref, topk_idx, num_experts,
                                     num_tokens_per_rank)
        out = ops.combine(hidden_states, handle_id, will_backward)
        _titan_sync_combine()
        return out

    # The grouped experts (permute, matmul, score, unpermute) run on the host in both
    # pipelines, so that only the communication differs: on CUDA the backward of a gather (and
    # a scatter_add_) adds in the order its atomics land.
    device = recv_x.device
    recv_x, recv_topk_idx, recv_scores = recv_x.cpu(), recv_topk_idx.cpu(), recv_scores.cpu()

    def experts(rows, row_scores):
        hidden = (rows.float() @ expert_weight).to(torch.bfloat16)
        return hidden * row_scores.to(hidden.dtype)

    if cudagraphable:  # expand layout: already grouped by expert; score per received row
        per_row_score = recv_scores.reshape(recv_x.shape[0], -1).sum(dim=-1, keepdim=True)
        hidden = experts(recv_x, per_row_score)
    else:
        routed, permuted_scores, permuted_indices = _permute(recv_x, recv_topk_idx, recv_scores)
        hidden = _unpermute(experts(routed, permuted_scores.reshape(-1, 1)), permuted_indices,
                            recv_x.shape[0])
    return combine(hidden.to(device)), None if reference else num_recv_per_expert


def run_torchtitan(device: str, seed: int) -> int:
    """torchtitan's training step (compact, CPU sync, autograd through both custom ops:
    combine's backward is a cached dispatch of a handle made with a smaller
    `num_tokens_per_rank` than the buffer's) and its inference forward (expand layout,
    sync-free), bitwise against the reference pipeline."""
    group, rank, R = _group(), dist.get_rank(), dist.get_world_size()
    hidden, num_topk, num_experts = 64, 3, 4 * R
    buffer_tokens, num_tokens_per_rank = 16, 8
    ops = _titan_ops(device)
    buffer = _titan_get_buffer(group, hidden=hidden, num_max_tokens_per_rank=buffer_tokens,
                               num_topk=num_topk, device=device)
    assert _titan_get_buffer(group, hidden=hidden, num_max_tokens_per_rank=8,
                             num_topk=num_topk, device=device) is buffer  # large enough
    gen = torch.Generator().manual_seed(seed + rank)
    num_tokens = num_tokens_per_rank - rank
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    scores, topk_idx = torch.topk(logits.softmax(-1), num_topk, dim=-1)
    scores[0, 1] = 0.0  # a zero score: torchtitan masks its slot to -1
    # The expert: a signed permutation over 8 (its fp32 matmul is exact in any order).
    expert_weight = torch.zeros(hidden, hidden)
    signs = torch.randint(0, 2, (hidden,), generator=gen).float() * 2 - 1
    expert_weight[torch.randperm(hidden, generator=gen), torch.arange(hidden)] = signs / 8
    grad_out = torch.randn(num_tokens, hidden, generator=gen)
    results = []
    for reference in (False, True):
        on = (lambda t: t) if reference else (lambda t: t.to(device))
        xs = on(x).clone().requires_grad_()
        ss = on(scores).clone().requires_grad_()
        out, counts = _titan_moe(ops, xs, on(topk_idx), ss, num_experts, num_tokens_per_rank,
                                 expert_weight, cudagraphable=True, reference=reference)
        (out.float() * on(grad_out)).sum().backward()
        with torch.no_grad():
            inference, inference_counts = _titan_moe(
                ops, on(x), on(topk_idx), on(scores), num_experts, num_tokens_per_rank,
                expert_weight, cudagraphable=True, reference=reference)
        results.append((out.detach(), xs.grad, ss.grad, inference, counts, inference_counts))
    (out, gx, gs, inf, counts, inf_counts), (want, want_gx, want_gs, want_inf, _, _) = results
    assert_equal("torchtitan forward", out, want, check_dtype=True)
    assert_equal("torchtitan x.grad (cached dispatch in combine's backward)", gx, want_gx,
                 check_dtype=True)
    assert_equal("torchtitan scores.grad", gs, want_gs, check_dtype=True)
    assert_equal("torchtitan inference forward (expand, sync-free)", inf, want_inf,
                 check_dtype=True)
    idx = topk_idx.masked_fill(scores == 0, -1)
    ref = reference_dispatch(x, idx, None, num_experts, num_tokens_per_rank, group)
    assert_equal("torchtitan num_recv_per_expert", counts, ref.num_recv_tokens_per_expert)
    assert_equal("torchtitan num_recv_per_expert (inference)", inf_counts,
                 ref.num_recv_tokens_per_expert)
    assert not _Titan.handles, "every handle was released"
    buffer.destroy()
    _Titan.buffer = None
    return 4


# ------------------------------------------------------------------ vLLM


def _expert_rows(x_bf16: torch.Tensor, global_ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """A stand-in for the experts with the weighted top-k reduction: row n is
    `bf16(sum over slots j with global_ids[n, j] >= 0 of w[n, j] * x[n] * (1 + id % 5) / 4)`
    in fp32 (deterministic, the same on any rows given the same inputs)."""
    factor = (1 + global_ids.clamp(min=0) % 5).float() / 4
    terms = torch.where(global_ids >= 0, weights * factor, 0.0)  # [N, K]
    acc = torch.zeros(x_bf16.shape, dtype=torch.float32, device=x_bf16.device)
    for j in range(global_ids.shape[1]):
        acc = acc + x_bf16.float() * terms[:, j:j + 1]
    return acc.to(torch.bfloat16)


def _globalize(recv_topk_idx, psum_recv_per_rank, rank_expert_offset: int, num_experts: int):
    """vLLM's `_globalize_recv_topk_idx` (a Triton kernel there) in torch: local ids to global,
    -1 for other ranks' slots and for rows past the received count (read on the device)."""
    num_recv = psum_recv_per_rank[-1]
    row = torch.arange(recv_topk_idx.shape[0], device=recv_topk_idx.device)[:, None]
    g = recv_topk_idx + rank_expert_offset
    valid = (recv_topk_idx >= 0) & (g < num_experts) & (row < num_recv)
    return torch.where(valid, g, -1)


def run_vllm(device: str, seed: int) -> int:
    """vLLM's DeepEP V2 prepare/finalize: prefill (expand layout, CPU sync, per-expert counts
    from the handle) and decode (compact, sync-free, `num_max_tokens_per_rank` a power of two
    of the largest batch, FP8 block scales), `event.event` tests, the receiver's
    `current_stream_wait()`, finalize with an async combine; bitwise against the reference."""
    group, rank, R = _group(), dist.get_rank(), dist.get_world_size()
    hidden, num_topk, max_tokens = 256, 4, 16
    num_experts = 4 * R
    num_local = num_experts // R
    rank_expert_offset = rank * num_local
    buffer = epcomm.ElasticBuffer(group, num_max_tokens_per_rank=max_tokens, hidden=hidden,
                                  num_topk=num_topk, explicitly_destroy=True, device=device)
    gen = torch.Generator().manual_seed(seed + rank)
    count = 0
    for use_cudagraph, num_tokens, fp8 in ((False, 11 - 2 * rank, False), (True, 3 + rank, True),
                                           (True, 1, False)):
        a1 = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
        topk_weights, topk_ids = torch.topk(torch.rand(num_tokens, num_experts, generator=gen),
                                            num_topk, dim=-1)
        token_data = per_token_cast_to_fp8(a1) if fp8 else a1
        do_expand = not use_cudagraph
        do_cpu_sync = not use_cudagraph
        num_max_tokens_per_rank = None
        if not do_expand:  # the DP-padded batch, rounded up to a power of two
            across = torch.tensor([num_tokens])
            dist.all_reduce(across, op=dist.ReduceOp.MAX)
            n = int(across)
            num_max_tokens_per_rank = min(1 << max(n - 1, 0).bit_length(), max_tokens)
        dev = (lambda t: tuple(p.to(device) for p in t)) if fp8 else (lambda t: t.to(device))
        recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
            x=dev(token_data), topk_idx=topk_ids.to(device), topk_weights=topk_weights.to(device),
            num_experts=num_experts, num_max_tokens_per_rank=num_max_tokens_per_rank,
            do_expand=do_expand, do_cpu_sync=do_cpu_sync, async_with_compute_stream=False)
        dispatched = (recv_x, recv_topk_idx, recv_topk_weights, handle)
        recv_expert_num_tokens = handle.num_recv_tokens_per_expert_list
        psum_recv_per_rank = handle.psum_num_recv_tokens_per_scaleup_rank
        # The receiver.
        if event.event is not None:
            event.current_stream_wait()
        expert_x, expert_x_scale = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        if recv_topk_idx is None:  # prefill: expert ids from the per-expert counts
            assert recv_expert_num_tokens is not None
            total = sum(recv_expert_num_tokens)
            ids = torch.arange(len(recv_expert_num_tokens), dtype=torch.int64,
                               device=expert_x.device) + rank_expert_offset
            recv_topk_idx = torch.repeat_interleave(
                ids, torch.tensor(recv_expert_num_tokens, device=expert_x.device),
                output_size=total).unsqueeze(1)
        else:  # decode: no counts on the host
            assert not recv_expert_num_tokens
            recv_topk_idx = _globalize(recv_topk_idx, psum_recv_per_rank, rank_expert_offset,
                                       num_experts)
        if recv_topk_weights is not None and recv_topk_weights.ndim == 1:
            recv_topk_weights = recv_topk_weights.unsqueeze(1)
        x_bf16 = per_token_cast_back(expert_x, expert_x_scale) if fp8 else expert_x
        fused_expert_output = _expert_rows(x_bf16, recv_topk_idx, recv_topk_weights)
        # Finalize: an async combine, joined by the receiver.
        output = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=device)
        combine_async = True
        combined_x, _, event = buffer.combine(
            x=fused_expert_output, handle=handle, topk_weights=None,
            async_with_compute_stream=combine_async, allocate_on_comm_stream=combine_async)
        if event.event is not None:
            event.current_stream_wait()
        output.copy_(combined_x, non_blocking=True)

        # The same through the reference.
        m = num_max_tokens_per_rank or max_tokens
        ref = reference_dispatch(token_data, topk_ids, topk_weights, num_experts, m, group, 1,
                                 do_expand)
        _check_dispatch(dispatched, num_topk, ref, num_experts=num_experts, do_expand=do_expand,
                        do_cpu_sync=do_cpu_sync, fp8=fp8)
        ref_x = per_token_cast_back(*ref.recv_x) if fp8 else ref.recv_x
        if do_expand:
            counts = ref.num_recv_tokens_per_expert
            ref_ids = torch.repeat_interleave(torch.arange(num_local) + rank_expert_offset,
                                              counts)[:, None]
            ref_w = ref.recv_topk_weights[:, None]
        else:
            ref_ids = torch.where(ref.recv_topk_idx >= 0, ref.recv_topk_idx + rank_expert_offset,
                                  -1)
            ref_w = ref.recv_topk_weights
        want, _ = reference_combine(_expert_rows(ref_x, ref_ids, ref_w), ref, topk_ids,
                                    num_experts, group)
        assert_equal(f"vLLM output (cudagraph={use_cudagraph})", output, want, check_dtype=True)
        count += 1
    buffer.destroy()
    return count


# ------------------------------------------------------------------ SGLang


def run_sglang(device: str, seed: int) -> int:
    """SGLang's DeepEP V2 dispatcher: `num_sms` / `num_qps` from the buffer's estimates on both
    calls, the fixed capacity as `num_max_tokens_per_rank`, expert alignment; extend (compact,
    CPU sync, outputs sliced to the received count, an empty batch padded with one dummy token)
    and decode (expand, sync-free, FP8 with column-major input scales and
    `use_tma_aligned_col_major_sf`); bitwise against the reference."""
    group, rank, R = _group(), dist.get_rank(), dist.get_world_size()
    hidden, router_topk, cap, alignment = 256, 4, 8, 4
    num_experts = 4 * R
    num_local = num_experts // R
    count = 0
    gen = torch.Generator().manual_seed(seed + rank)
    for use_fp8 in (False, True):
        buffer = epcomm.ElasticBuffer(group, num_max_tokens_per_rank=cap, hidden=hidden,
                                      num_topk=router_topk, use_fp8_dispatch=use_fp8,
                                      allow_hybrid_mode=False, sl_idx=0,
                                      prefer_overlap_with_compute=False, device=device)
        assert buffer.num_bytes > 0
        num_sms = buffer.get_theoretical_num_sms(num_experts, router_topk)
        num_qps = buffer.get_theoretical_num_qps(num_sms)
        for use_expand_layout in (False, True):
            num_tokens = 0 if (rank == 1 and not use_expand_layout) else cap - rank
            hidden_states = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
            topk_weights, topk_ids = torch.topk(
                torch.rand(num_tokens, num_experts, generator=gen), router_topk, dim=-1)
            pad = (not use_expand_layout) and hidden_states.shape[0] == 0
            if pad:  # an empty extend batch: one dummy token with zero weights
                hidden_states = hidden_states.new_zeros((1, hidden_states.shape[-1]))
                topk_ids = torch.arange(router_topk, dtype=topk_ids.dtype).unsqueeze(0)
                topk_weights = topk_weights.new_zeros((1, router_topk))
            if use_fp8:
                x_fp8, scales = per_token_cast_to_fp8(hidden_states)
                column_major = torch.empty(scales.shape[1], -(-scales.shape[0] // 4) * 4)
                column_major[:, :scales.shape[0]] = scales.t()
                dispatch_x = (x_fp8.to(device), column_major[:, :scales.shape[0]].t().to(device))
                use_tma_aligned_col_major_sf = use_expand_layout
            else:
                dispatch_x = hidden_states.to(device)
                use_tma_aligned_col_major_sf = False
            do_cpu_sync_val = not use_expand_layout
            recv_x, recv_topk_idx, recv_topk_weights, handle, event = buffer.dispatch(
                dispatch_x, topk_idx=topk_ids.to(device), topk_weights=topk_weights.to(device),
                num_experts=num_experts, num_max_tokens_per_rank=cap,
                expert_alignment=alignment, num_sms=num_sms, num_qps=num_qps,
                use_tma_aligned_col_major_sf=use_tma_aligned_col_major_sf,
                do_cpu_sync=do_cpu_sync_val, do_expand=use_expand_layout)
            if event.event is not None:
                event.current_stream_wait()
            recv_hidden_states, recv_hidden_states_scale = recv_x if isinstance(recv_x, tuple) \
                else (recv_x, None)
            ref_x = (_cpu(x_fp8), scales) if use_fp8 else hidden_states
            ref = reference_dispatch(ref_x, topk_ids, topk_weights, num_experts, cap, group,
                                     alignment, use_expand_layout)
            _check_dispatch((recv_x, recv_topk_idx, recv_topk_weights, handle), router_topk,
                            ref, num_experts=num_experts, expert_alignment=alignment,
                            do_expand=use_expand_layout, do_cpu_sync=do_cpu_sync_val,
                            fp8=use_fp8)
            if use_expand_layout:
                if recv_hidden_states_scale is not None:
                    assert_tma_aligned_col_major("recv_hidden_states_scale",
                                                 recv_hidden_states_scale)
                # one row per local expert slot, weights applied before combine
                local = torch.zeros(recv_hidden_states.shape[0], dtype=torch.int64,
                                    device=recv_hidden_states.device)
                psum = handle.psum_num_recv_tokens_per_expert
                rows = torch.arange(local.shape[0], device=local.device)
                for i in range(1, num_local):
                    start = (psum[i - 1] + alignment - 1) // alignment * alignment
                    local = torch.where(rows >= start, i, local)
                ids, weights = local[:, None], recv_topk_weights[:, None]
                ref_ids = torch.zeros(ref.expand_valid.shape[0], dtype=torch.int64)
                starts = ref.expert_starts
                for i in range(1, num_local):
                    ref_ids[starts[i]:] = i
                ref_ids, ref_w = ref_ids[:, None], ref.recv_topk_weights[:, None]
                combine_weights, ref_combine_weights = None, None
            else:
                num_recv_tokens = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1].item())
                recv_topk_idx = recv_topk_idx[:num_recv_tokens]
                recv_topk_weights = recv_topk_weights[:num_recv_tokens]
                recv_hidden_states = recv_hidden_states[:num_recv_tokens]
                if recv_hidden_states_scale is not None:
                    recv_hidden_states_scale = recv_hidden_states_scale[:num_recv_tokens]
                num_recv_tokens_per_expert = list(handle.num_recv_tokens_per_expert_list)
                assert num_recv_tokens_per_expert == [
                    -(-c // alignment) * alignment for c in ref.num_recv_tokens_per_expert.tolist()]
                ids, weights = recv_topk_idx, recv_topk_weights
                ref_ids, ref_w = ref.recv_topk_idx, ref.recv_topk_weights
                combine_weights, ref_combine_weights = recv_topk_weights, ref.recv_topk_weights
            x_bf16 = per_token_cast_back(recv_hidden_states, recv_hidden_states_scale) \
                if use_fp8 else recv_hidden_states
            ref_bf16 = per_token_cast_back(*ref.recv_x) if use_fp8 else ref.recv_x
            combined_x, _, event = buffer.combine(
                _expert_rows(x_bf16, ids, weights), handle=handle, topk_weights=combine_weights,
                num_sms=num_sms, num_qps=num_qps)
            if event.event is not None:
                event.current_stream_wait()
            want, _ = reference_combine(_expert_rows(ref_bf16, ref_ids, ref_w), ref, topk_ids,
                                        num_experts, group, topk_weights=ref_combine_weights)
            assert_equal(f"SGLang combined (expand={use_expand_layout}, fp8={use_fp8})",
                         combined_x, want, check_dtype=True)
            if pad:
                combined_x = combined_x[:0]
            assert combined_x.shape[0] == (0 if pad else num_tokens)
            count += 1
    return count


# ------------------------------------------------------------------ the tests


def run_adapters(device: str, seed: int) -> list[int]:
    return [run_deepep_test(device, seed), run_torchtitan(device, seed + 1),
            run_vllm(device, seed + 2), run_sglang(device, seed + 3)]


def test_adapters_replay():
    """DeepEP's V2 test, torchtitan, vLLM and SGLang, their calls replayed on 2 CPU ranks."""
    assert _run(run_adapters, 2, "cpu", SEED) == [[10, 4, 3, 4]] * 2


@_NO_CUDA
def test_adapters_replay_cuda():
    assert _run(run_adapters, 2, "cuda", SEED) == [[10, 4, 3, 4]] * 2
