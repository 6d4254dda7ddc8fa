"""`epcomm.legacy.Buffer` (DeepEP V1, normal mode) on local gloo ranks.

Layout against a plain-torch count; dispatch and combine (bf16 and FP8, with and without top-k,
cached dispatch, biases, expert alignment, `num_worst_tokens`, buffer growth) bitwise against
`epcomm.testing.reference` through `epcomm.testing.verify.assert_equal`, the handle's six tensors
against DeepEP's definitions written out with loops; bad arguments raise naming the argument.
The symmetric backend runs one round trip under the Triton interpreter.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from epcomm.fp8 import per_token_cast_to_fp8
from epcomm.legacy import Buffer, Config, DispatchHandle
from epcomm.testing.launch import run_local_ranks
from epcomm.testing.reference import reference_combine, reference_dispatch
from epcomm.testing.verify import assert_equal

H, K = 256, 3
REF_M = 1024  # the reference's token stride in its source ids (any value >= every T)
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="CUDA runs need a GPU (none on this machine)")
# "device:backend"; on CUDA the ranks share the GPUs (gloo group).
TARGETS = ["cpu:collective", pytest.param("cuda:collective", marks=_NO_CUDA),
           pytest.param("cuda:symmetric", marks=_NO_CUDA)]


# ------------------------------------------------------------------------------ plain torch
def plain_layout(topk_idx, num_experts, num_ranks):
    """DeepEP's layout, counted token by token."""
    num_local = num_experts // num_ranks
    per_rank = torch.zeros(num_ranks, dtype=torch.int32)
    per_expert = torch.zeros(num_experts, dtype=torch.int32)
    in_rank = torch.zeros(topk_idx.shape[0], num_ranks, dtype=torch.bool)
    for t, row in enumerate(topk_idx.tolist()):
        for e in row:
            if 0 <= e < num_experts:
                per_expert[e] += 1
                in_rank[t, e // num_local] = True
    per_rank += in_rank.sum(0).int()
    return per_rank, per_expert, in_rank


def plain_channels(is_token_in_rank, num_channels):
    """DeepEP's channel_prefix_matrix [R, C] and send_head [T, R], token by token."""
    num_tokens, num_ranks = is_token_in_rank.shape
    per = -(-num_tokens // num_channels)
    prefix = torch.zeros(num_ranks, num_channels, dtype=torch.int32)
    head = torch.full((num_tokens, num_ranks), -1, dtype=torch.int32)
    for r in range(num_ranks):
        total = 0
        for c in range(num_channels):
            in_channel = 0
            for t in range(min(per * c, num_tokens), min(per * (c + 1), num_tokens)):
                if is_token_in_rank[t, r]:
                    head[t, r] = in_channel
                    in_channel += 1
            total += in_channel
            prefix[r, c] = total
    return prefix, head


def routing(gen, num_tokens, num_experts, masked=True):
    """[T, K] distinct expert ids per row, about a third -1."""
    idx = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :K]
    if masked:
        idx[torch.rand(num_tokens, K, generator=gen) < 0.3] = -1
    return idx


def aligned(counts, alignment):
    return [-(-int(c) // alignment) * alignment for c in counts]


def check_handle(handle, is_token_in_rank, ref, num_channels, num_rows):
    """The six tensors against DeepEP's definitions (collective: gathers every rank's)."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    assert isinstance(handle, DispatchHandle) and isinstance(handle, tuple) and len(handle) == 6
    rank_prefix, channel_prefix, recv_channel_prefix, recv_src_idx, in_rank, send_head = handle
    assert in_rank is is_token_in_rank
    is_token_in_rank = is_token_in_rank.cpu()
    # [0]: every rank's send counts, prefix-summed over source ranks.
    sends = [torch.zeros(num_ranks, dtype=torch.int32) for _ in range(num_ranks)]
    dist.all_gather(sends, is_token_in_rank.sum(0).int())
    assert_equal("rank_prefix_matrix", rank_prefix, torch.stack(sends).cumsum(0).int(),
                 check_dtype=True)
    assert_equal("rank_prefix_matrix column of this rank", rank_prefix[:, rank],
                 ref.num_recv_tokens_per_rank.cumsum(0).int())
    want_prefix, want_head = plain_channels(is_token_in_rank, num_channels)
    assert_equal("channel_prefix_matrix", channel_prefix, want_prefix, check_dtype=True)
    assert_equal("send_head", send_head, want_head, check_dtype=True)
    # [2]: where each source's channel starts in its rows here.
    prefixes = [torch.zeros(num_ranks, num_channels, dtype=torch.int32) for _ in range(num_ranks)]
    dist.all_gather(prefixes, want_prefix)
    want_recv = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int32), p[rank, :-1]])
                             for p in prefixes])
    assert_equal("recv_channel_prefix_matrix", recv_channel_prefix, want_recv, check_dtype=True)
    # [3]: the source token index of each row, -1 past the received ones.
    n = ref.src_token.shape[0]
    want_src = torch.full((num_rows,), -1, dtype=torch.int32)
    want_src[:n] = (ref.src_token % REF_M).int()
    assert_equal("recv_src_idx", recv_src_idx, want_src, check_dtype=True)


# ------------------------------------------------------------------------------ rank bodies
def run_layout(seed, device):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    buffer = Buffer(dist.group.WORLD, Config().get_nvl_buffer_size_hint(H * 2, num_ranks))
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    checked = 0
    for num_tokens, num_experts in ((13, 8), (0, 4), (40, 2 * num_ranks)):
        idx = routing(gen, num_tokens, num_experts)
        if num_tokens:
            idx[0, 0] = num_experts + 3  # out of range: not counted (as DeepEP)
        for dtype in (torch.int64, torch.int32):
            per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(
                idx.to(device=device, dtype=dtype), num_experts)
            want_rank, want_expert, want_in_rank = plain_layout(idx, num_experts, num_ranks)
            assert per_rdma is None and event.event is None
            assert_equal("num_tokens_per_rank", per_rank, want_rank, check_dtype=True)
            assert_equal("num_tokens_per_expert", per_expert, want_expert, check_dtype=True)
            assert_equal("is_token_in_rank", in_rank, want_in_rank, check_dtype=True)
            assert in_rank.is_contiguous()
            checked += 1
    # Stream options: no-ops on CPU, checked like DeepEP.
    out = buffer.get_dispatch_layout(idx.to(device), 8, previous_event=buffer.capture(),
                                     async_finish=True, allocate_on_comm_stream=True)
    out[4].current_stream_wait()
    assert_equal("is_token_in_rank (comm stream)", out[3], plain_layout(idx, 8, num_ranks)[2])
    return checked


def round_trip(buffer, gen, num_tokens, num_experts, *, fp8=False, with_topk=True,
               alignment=1, worst=0, num_bias=0, cached=True, stream=None, config=None,
               device="cpu"):
    """One V1 dispatch (+ cached dispatch) + combine, bitwise against the reference. Returns
    (handle, the combine input, the combined result) for later replays."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    stream = stream or {}
    idx = routing(gen, num_tokens, num_experts)
    weights = torch.rand(num_tokens, K, generator=gen)
    x_bf16 = torch.randn(num_tokens, H, generator=gen).to(torch.bfloat16)
    x = per_token_cast_to_fp8(x_bf16) if fp8 else x_bf16

    def on(t):  # to the device under test (tuples part by part)
        return None if t is None else tuple(map(on, t)) if isinstance(t, tuple) else t.to(device)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(on(idx), num_experts)
    if worst == "tight":  # one row more than this rank receives
        sends = [torch.zeros(num_ranks, dtype=torch.int32) for _ in range(num_ranks)]
        dist.all_gather(sends, per_rank.cpu())
        worst = int(torch.stack(sends)[:, rank].sum()) + 1
    topk = dict(topk_idx=on(idx), topk_weights=on(weights)) if with_topk else {}
    def kwargs():
        return {k: (buffer.capture() if v == "capture" else v) for k, v in stream.items()}
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        on(x), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=None,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, expert_alignment=alignment,
        num_worst_tokens=worst, config=config, **topk, **kwargs())
    event.current_stream_wait()
    num_local = num_experts // num_ranks
    ref = reference_dispatch(x, idx, weights, num_experts, REF_M, group, alignment)
    n = ref.src_token.shape[0]
    rows = worst or n
    parts = recv_x if fp8 else (recv_x,)
    want_parts = ref.recv_x if fp8 else (ref.recv_x,)
    assert isinstance(recv_x, tuple) == fp8
    for index, (got, want) in enumerate(zip(parts, want_parts)):
        assert got.shape == (rows, want.shape[1])
        assert_equal(f"recv_x[{index}]", got[:n], want, check_dtype=True)
    if with_topk:
        assert recv_idx.dtype == idx.dtype and recv_idx.shape == (rows, K)
        assert_equal("recv_topk_idx", recv_idx[:n], ref.recv_topk_idx)
        assert_equal("recv_topk_idx past the received rows", recv_idx[n:],
                     torch.full((rows - n, K), -1))
        # V1: weights only where the slot's expert is here, 0 elsewhere.
        want_w = torch.where(ref.recv_topk_idx >= 0, ref.recv_topk_weights, 0.0)
        assert_equal("recv_topk_weights", recv_w[:n], want_w, check_dtype=True)
        assert_equal("recv_topk_weights past the received rows", recv_w[n:],
                     torch.zeros(rows - n, K))
    else:
        assert recv_idx is None and recv_w is None
    assert counts == ([] if worst else aligned(ref.num_recv_tokens_per_expert, alignment))
    num_channels = (config.num_sms if config else Buffer.num_sms) // 2
    check_handle(handle, in_rank, ref, num_channels, rows)
    in_rank = in_rank.cpu()

    # Without top-k, rows go where is_token_in_rank says: one slot per rank.
    combine_idx, combine_ref = idx, ref
    if not with_topk:
        combine_idx = torch.where(in_rank, torch.arange(num_ranks) * num_local, -1)
        combine_ref = reference_dispatch(x, combine_idx, None, num_experts, REF_M, group)

    if cached:
        x2_bf16 = torch.randn(num_tokens, H, generator=gen).to(torch.bfloat16)
        x2 = per_token_cast_to_fp8(x2_bf16) if fp8 else x2_bf16
        out = buffer.dispatch(on(x2), handle=handle, config=config, **kwargs())
        out[5].current_stream_wait()
        assert out[1:5] == (None, None, None, None)
        want2 = reference_dispatch(x2, idx, None, num_experts, REF_M, group).recv_x
        for index, (got, want) in enumerate(zip(out[0] if fp8 else (out[0],),
                                                want2 if fp8 else (want2,))):
            assert got.shape == (rows, want.shape[1])
            assert_equal(f"cached recv_x[{index}]", got[:n], want, check_dtype=True)

    y = (torch.randn(rows, H, generator=gen) * 8).to(torch.bfloat16)
    y[n:] = float("nan")  # past the received rows: ignored
    y_w = None
    if with_topk:
        y_w = torch.where(recv_idx.cpu() >= 0, torch.rand(rows, K, generator=gen), 0.0)
        y_w[n:] = float("nan")
    biases = tuple(torch.randn(num_tokens, H, generator=gen).to(torch.bfloat16)
                   for _ in range(num_bias))
    bias = None if not biases else biases[0] if num_bias == 1 else biases
    combined, combined_w, event = buffer.combine(
        on(y), handle, topk_weights=on(y_w), bias=on(bias), config=config, **kwargs())
    event.current_stream_wait()
    want_x, want_w = reference_combine(y[:n], combine_ref, combine_idx, num_experts, group,
                                       topk_weights=None if y_w is None else y_w[:n],
                                       bias=biases or None)
    assert_equal("combined_x", combined, want_x, check_dtype=True)
    assert_equal("combined_topk_weights", combined_w, want_w, check_dtype=True)
    return handle, (on(y), on(y_w), on(bias)), combined


def run_round_trips(seed, target):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    E = 4 * num_ranks
    device, backend = target.split(":")
    buffer = Buffer(dist.group.WORLD, explicitly_destroy=True, backend=backend)
    trip = functools.partial(round_trip, device=device)

    count = 0
    for fp8 in (False, True):
        for with_topk in (True, False):
            trip(buffer, gen, 12 - rank, E, fp8=fp8, with_topk=with_topk,
                 alignment=1 if with_topk else 4, num_bias=(0, 1, 2)[count % 3])
            count += 1
    # Expert alignment, a rank without tokens, a config with other channels, stream options.
    trip(buffer, gen, 0 if rank == 1 else 11, E, alignment=128, num_bias=2,
         config=Config(8, 4, 32), stream=dict(previous_event="capture", async_finish=True,
                                              allocate_on_comm_stream=True))
    count += 1
    # Async without a previous event; a previous event with outputs on the current stream.
    trip(buffer, gen, 5, E, stream=dict(async_finish=True))
    trip(buffer, gen, 6, E, fp8=True, stream=dict(previous_event="capture"))
    count += 2
    assert len(buffer.inner_buffers) == 2  # (H, K) and, without top-k, (H, R) slots
    first = buffer.inner_buffers[0]
    assert first.num_max_tokens_per_rank == 16  # 12 tokens, rounded up to a power of two

    # More tokens than the buffer holds: a new, larger one; old handles keep working.
    old_handle, (y, y_w, bias), old_combined = trip(buffer, gen, 9, E, cached=False)
    trip(buffer, gen, 20 + rank, E, fp8=True)
    assert len(buffer.inner_buffers) == 3 and buffer.inner_buffers[2].num_max_tokens_per_rank == 32
    again, again_w, _ = buffer.combine(y, old_handle, topk_weights=y_w, bias=bias)
    assert_equal("combine through an old handle after growth", again, old_combined)
    count += 2

    # num_worst_tokens: outputs of exactly that many rows, no host sync.
    worst = Buffer(dist.group.WORLD, backend=backend)
    trip(worst, gen, 10, E, worst=num_ranks * 10, num_bias=1)  # R * M = worst: views
    assert worst.inner_buffers[0].num_max_tokens_per_rank == 10
    trip(worst, gen, 7, E, worst=num_ranks * 10 + 5, fp8=True)  # padded
    trip(worst, gen, 3, E, worst="tight")  # a prefix of epcomm's R * M rows
    with pytest.raises(ValueError, match="cannot grow"):
        worst.dispatch(torch.zeros(11, H, dtype=torch.bfloat16, device=device),
                       num_tokens_per_rank=torch.zeros(num_ranks, dtype=torch.int32,
                                                       device=device),
                       is_token_in_rank=torch.zeros(11, num_ranks, dtype=torch.bool,
                                                    device=device),
                       num_tokens_per_expert=torch.zeros(E, dtype=torch.int32, device=device),
                       topk_idx=torch.full((11, K), -1, device=device),
                       topk_weights=torch.zeros(11, K, device=device), num_worst_tokens=20)
    count += 3
    buffer.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        buffer.get_dispatch_layout(torch.zeros(1, K, dtype=torch.long), E)
    return count


def run_bad_input(seed):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    E = 2 * num_ranks
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        Buffer(group, 100)
    with pytest.raises(ValueError, match="group"):
        Buffer(None)
    with pytest.raises(RuntimeError, match="explicitly_destroy"):
        Buffer(group).destroy()
    with pytest.raises(ValueError, match="new_num_sms"):
        Buffer.set_num_sms(3)
    with pytest.raises(ValueError, match="num_ranks"):
        Buffer.get_dispatch_config(3)
    buffer = Buffer(group, num_max_tokens_per_rank=8, backend="collective")
    with pytest.raises(RuntimeError, match="low_latency_mode=True"):
        buffer.low_latency_dispatch(None, None, 8, E)
    with pytest.raises(NotImplementedError):
        buffer.get_local_buffer_tensor(torch.bfloat16)

    with pytest.raises(ValueError, match="topk_idx"):
        buffer.get_dispatch_layout(torch.zeros(4, dtype=torch.long), E)
    with pytest.raises(TypeError, match="topk_idx"):
        buffer.get_dispatch_layout(torch.zeros(4, K), E)
    with pytest.raises(ValueError, match="num_experts"):
        buffer.get_dispatch_layout(torch.zeros(4, K, dtype=torch.long), 2 * num_ranks + 1)
    with pytest.raises(ValueError, match="allocate_on_comm_stream"):
        buffer.get_dispatch_layout(torch.zeros(4, K, dtype=torch.long), E,
                                   allocate_on_comm_stream=True)

    T = 5
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    idx = torch.full((T, K), -1)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, E)
    good = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=torch.zeros(T, K))

    def bad(error, match, x=x, **changes):
        with pytest.raises(error, match=match):
            buffer.dispatch(x, **{**good, **changes})

    bad(ValueError, "num_tokens_per_rank", num_tokens_per_rank=None)
    bad(ValueError, "is_token_in_rank", is_token_in_rank=None)
    bad(ValueError, "is_token_in_rank", is_token_in_rank=in_rank[:, :1])
    bad(TypeError, "is_token_in_rank", is_token_in_rank=in_rank.int())
    bad(TypeError, "num_tokens_per_rank", num_tokens_per_rank=per_rank.long())
    bad(TypeError, "num_tokens_per_expert", num_tokens_per_expert=per_expert.float())
    bad(ValueError, "num_tokens_per_expert", num_tokens_per_expert=per_expert[:-1])
    bad(ValueError, "together", topk_weights=None)
    bad(ValueError, "topk_idx", topk_idx=idx[:-1])
    bad(TypeError, "topk_weights", topk_weights=torch.zeros(T, K, dtype=torch.float64))
    bad(ValueError, "topk_weights", topk_weights=torch.zeros(T, K + 1))
    bad(TypeError, "x", x=x.float())
    bad(ValueError, "x", x=(x, x, x))
    bad(ValueError, "scales", x=(x.to(torch.float8_e4m3fn), torch.zeros(T, 1)))
    bad(ValueError, "expert_alignment", expert_alignment=0)
    bad(ValueError, "num_worst_tokens", num_worst_tokens=-1)
    bad(ValueError, "num_worst_tokens", num_worst_tokens=4, topk_idx=None, topk_weights=None)
    bad(ValueError, "allocate_on_comm_stream", allocate_on_comm_stream=True,
        previous_event=buffer.capture())
    bad(ValueError, "num_sms", config=Config(3, 4, 32))
    bad(TypeError, "config", config=object())
    with pytest.raises(ValueError, match="Config"):
        Config(20, 8, 8)
    with pytest.raises(ValueError, match="Config"):
        Config(20, 6, 256, 128, 100)
    # More tokens than num_max_tokens_per_rank (collective: every rank sees it and raises).
    big = {**good, **dict(zip(("num_tokens_per_rank", "num_tokens_per_expert",
                               "is_token_in_rank", "topk_idx", "topk_weights"),
                              (per_rank, per_expert, torch.zeros(9, num_ranks, dtype=torch.bool),
                               torch.full((9, K), -1), torch.zeros(9, K))))}
    with pytest.raises(ValueError, match="num_max_tokens_per_rank"):
        buffer.dispatch(torch.zeros(9, H, dtype=torch.bfloat16), **big)

    _, _, _, _, handle, _ = buffer.dispatch(x, **good)
    with pytest.raises(ValueError, match="no topk_idx"):
        buffer.dispatch(x, handle=handle, topk_idx=idx)
    with pytest.raises(ValueError, match="x"):
        buffer.dispatch(x[:2], handle=handle)
    with pytest.raises(TypeError, match="handle"):
        buffer.combine(x, handle=(1, 2))
    n = handle[3].shape[0]
    y = torch.zeros(n, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x"):
        buffer.combine(torch.zeros(n + 1, H, dtype=torch.bfloat16), handle)
    with pytest.raises(ValueError, match="topk_weights"):
        buffer.combine(y, handle, topk_weights=torch.zeros(n + 1, K))
    with pytest.raises(ValueError, match="bias"):
        buffer.combine(y, handle, bias=(x, x, x))
    with pytest.raises(ValueError, match=r"bias\[0\]"):
        buffer.combine(y, handle, bias=x[:1])
    # Rebuilt from the same tensors, the tuple still finds its dispatch.
    combined, _, _ = buffer.combine(y, tuple(handle))
    assert_equal("combined_x of nothing", combined, torch.zeros(T, H, dtype=torch.bfloat16))
    return 1


def run_symmetric(seed):
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    buffer = Buffer(dist.group.WORLD, backend="symmetric", num_max_tokens_per_rank=8)
    round_trip(buffer, gen, 8 - rank, 2 * num_ranks, num_bias=1)
    round_trip(buffer, gen, 6, 2 * num_ranks, fp8=True, worst=num_ranks * 8, cached=False)
    assert buffer.inner_buffers[0].backend == "symmetric"
    return 1


# ------------------------------------------------------------------------------ tests
def test_config_and_size_hints():
    config = Config()
    assert (config.num_sms, config.num_max_nvl_chunked_send_tokens,
            config.num_max_nvl_chunked_recv_tokens, config.num_max_rdma_chunked_send_tokens,
            config.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 258)  # 256 -> 6 * 43
    assert Config(24, 6, 256, 6, 130).num_max_rdma_chunked_recv_tokens == 132  # rounded up
    assert Config(num_sms=24, num_max_nvl_chunked_send_tokens=8).num_sms == 24
    # DeepEP's formula, term by term: channels x NVLink ranks x slots x bytes per slot.
    hidden_bytes = 7168 * 2
    for ranks, nvl_ranks, rdma_ranks in ((2, 2, 1), (8, 8, 1), (16, 8, 2)):
        channels, slots = 10, 256
        want = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4 + channels * nvl_ranks * slots * (
            hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4)
        assert config.get_nvl_buffer_size_hint(hidden_bytes, ranks) == -(-want // 128) * 128
    assert config.get_rdma_buffer_size_hint(hidden_bytes, 8) == 0
    rdma = config.get_rdma_buffer_size_hint(hidden_bytes, 16)
    want = 10 * 2 * 18 * 2 * 4 + 10 * 2 * 258 * 2 * (hidden_bytes + 8 + 1024 + 512 + 512 + 16)
    assert rdma == -(-want // 128) * 128
    dispatch, combine = Buffer.get_dispatch_config(8), Buffer.get_combine_config(8)
    assert (dispatch.num_sms, dispatch.num_max_nvl_chunked_send_tokens) == (Buffer.num_sms, 6)
    assert combine.num_max_nvl_chunked_send_tokens == 4
    with pytest.raises(ValueError, match="num_ranks"):
        config.get_nvl_buffer_size_hint(hidden_bytes, 12)


def run_layout_and_bad_input(seed, device):
    return run_layout(seed, device), run_bad_input(seed) if device == "cpu" else None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_NO_CUDA)])
def test_layout_matches_plain_torch_and_bad_input_raises(device):
    """(One launch for both: the bad arguments are checked on CPU tensors.)"""
    want = (6, 1 if device == "cpu" else None)
    assert run_local_ranks(run_layout_and_bad_input, 2, 1, device) == [want, want]


@pytest.mark.parametrize("target", TARGETS)
def test_round_trips_bitwise_against_reference(target):
    assert run_local_ranks(run_round_trips, 2, 2, target) == [12, 12]


def test_symmetric_backend_under_interpreter():
    pytest.importorskip("triton")
    assert run_local_ranks(run_symmetric, 2, 4) == [1, 1]
