"""Tests of the independent reference (epcomm.testing.reference) on gloo process groups.

The expected tensors of the 2-rank example are worked out by hand from docs/semantics.md.
"""

import pytest
import torch
import torch.distributed as dist

from epcomm.testing.launch import run_local_ranks
from epcomm.testing.reference import ReferenceDispatch, reference_combine, reference_dispatch
from epcomm.testing.verify import assert_equal

bf16, f32, i64 = torch.bfloat16, torch.float32, torch.int64
BIG = 2.0 ** 30  # exact in bf16; BIG + 1 == BIG in fp32, so it reveals the summation order


def _call(fn) -> bool:
    fn(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
    return True


def _spawn(fn, world_size):
    """`fn(rank, world_size, group)` on `world_size` local gloo ranks (`run_local_ranks`)."""
    assert run_local_ranks(_call, world_size, fn, timeout_s=60.0) == [True] * world_size


def _t(values, dtype, width=None):
    """Tensor from a literal; ``width`` gives the row width when the list is empty."""
    t = torch.tensor(values, dtype=dtype)
    return t.reshape(0, width) if width is not None and t.numel() == 0 else t


# ----------------------------------------------------------------------------- hand example
#
# R = 2, E = 4 (E_l = 2), M = 4, K = 3, H = 2, alignment 2.
# Rank 0 has 4 tokens, rank 1 has none.
#   t0 -> experts [1, 3, -1]   a -1 slot
#   t1 -> experts [1, 2, 0]    two experts on rank 0 (slots 0 and 2) around one on rank 1,
#                              so its last-slot rank order (r1 at j1, r0 at j2) differs from
#                              its first-slot order
#   t2 -> experts [3, -1, 3]   a repeated id (two (row, slot) pairs on rank 1)
#   t3 -> experts [-1, -1, -1] sent nowhere

X0 = [[1, 2], [3, 4], [5, 6], [7, 8]]
IDX0 = [[1, 3, -1], [1, 2, 0], [3, -1, 3], [-1, -1, -1]]
W0 = [[0.5, 0.25, 0.125], [0.75, 0.375, 0.25], [1.5, 2.5, 3.5], [4.0, 5.0, 6.0]]
BIAS_A = [[0.5, 0], [BIG, 0], [0, 0.25], [1, -1]]
BIAS_B = [[0.25, 1], [0, 1], [0, 0], [2, 2]]

# Expected dispatch, per receiving rank.
EXPECT = {
    0: dict(
        recv_x=[[1, 2], [3, 4]],                          # t0, t1
        recv_topk_idx=[[1, -1, -1], [1, -1, 0]],
        recv_topk_weights=[[0.5, 0.25, 0.125], [0.75, 0.375, 0.25]],
        num_recv_tokens_per_rank=[2, 0],
        num_recv_tokens_per_expert=[1, 2],                 # e0: (1,2); e1: (0,0),(1,0)
        src_token=[0, 1],
        last_slot=[0, 2],
        expand_rows=[[2, -1, -1], [3, -1, 0]],             # starts [0, align(1) = 2]
        expand_valid=[True, False, True, True],            # N_e = align(2 + 2) = 4
        expert_starts=[0, 2],
        expand_x=[[3, 4], [0, 0], [1, 2], [3, 4]],
        expand_w=[0.25, 0.0, 0.5, 0.75],
    ),
    1: dict(
        recv_x=[[1, 2], [3, 4], [5, 6]],                  # t0, t1, t2
        recv_topk_idx=[[-1, 1, -1], [-1, 0, -1], [1, -1, 1]],
        recv_topk_weights=[[0.5, 0.25, 0.125], [0.75, 0.375, 0.25], [1.5, 2.5, 3.5]],
        num_recv_tokens_per_rank=[3, 0],
        num_recv_tokens_per_expert=[1, 3],                 # e0: (1,1); e1: (0,1),(2,0),(2,2)
        src_token=[0, 1, 2],
        last_slot=[1, 1, 2],
        expand_rows=[[-1, 2, -1], [-1, 0, -1], [3, -1, 4]],  # starts [0, align(1) = 2]
        expand_valid=[True, False, True, True, True, False],  # N_e = align(2 + 3) = 6
        expert_starts=[0, 2],
        expand_x=[[3, 4], [0, 0], [1, 2], [5, 6], [5, 6], [0, 0]],
        expand_w=[0.375, 0.0, 0.25, 1.5, 3.5, 0.0],
    ),
}

# Combine inputs on each receiving rank: compact rows / weights, expand rows / weights
# (gap rows hold garbage that must be ignored).
COMBINE_IN = {
    0: dict(xc=[[1, 2], [1, 3]], wc=[[10, 11, 12], [13, 14, 15]],
            xe=[[0, 2], [1000, 1000], [1, 2], [1, 1]], we=[10, 99, 12, 13]),
    1: dict(xc=[[4, 8], [-BIG, 16], [0.5, -3]], wc=[[20, 21, 22], [23, 24, 25], [26, 27, 28]],
            xe=[[-BIG, 16], [1000, 1000], [4, 8], [1, 256], [1, 1], [-7, 7]],
            we=[20, 99, 22, 23, 24, 99]),
}
# Expected combine results on rank 0 (rank 1 has no tokens).
# Compact, bias (A, B): t0 = A+B + r0 + r1; t1 = A+B + r1 (last slot 1) + r0 (last slot 2):
#   [BIG, 1] + [-BIG, 16] + [1, 3] = [1, 20] (first-slot order would give 0 in column 0).
COMPACT_X = [[5.75, 11], [1, 20], [0.5, -2.75], [3, 1]]
COMPACT_W = [[10, 21, 0], [13, 24, 15], [26, 0, 28], [0, 0, 0]]
# Compact, no bias: t1 = (0 - BIG) + 1 = -BIG in fp32.
COMPACT_X_NOBIAS = [[5, 10], [-BIG, 19], [0.5, -3], [0, 0]]
# Expand, bias A: receivers first reduce per compact row in bf16:
#   r0: n0 = [1, 2]; n1 = [1, 1] (slot 0) + [0, 2] (slot 2) = [1, 3]
#   r1: n0 = [4, 8]; n1 = [-BIG, 16]; n2 = bf16([2, 257]) = [2, 256] (ties to even)
#   t1 = [BIG, 0] + [-BIG, 16] + [1, 3] = [1, 19]
#   t2 = bf16([0, 0.25] + [2, 256]) = [2, 256] (without the row rounding: 258).
EXPAND_X = [[5.5, 10], [1, 19], [2, 256], [1, -1]]
EXPAND_W = [[12, 22, 0], [13, 20, 10], [23, 0, 24], [0, 0, 0]]


def _hand_example(rank, world_size, group):
    tokens = 4 if rank == 0 else 0
    x = _t(X0[:tokens], bf16, 2)
    idx = _t(IDX0[:tokens], i64, 3)
    w = _t(W0[:tokens], f32, 3)
    exp = EXPECT[rank]
    kw = dict(num_experts=4, num_max_tokens_per_rank=4, group=group, expert_alignment=2)

    d = reference_dispatch(x, idx, w, do_expand=False, **kw)
    assert isinstance(d, ReferenceDispatch)
    assert_equal("recv_x", d.recv_x, _t(exp["recv_x"], bf16), check_dtype=True)
    assert_equal("recv_topk_idx", d.recv_topk_idx, _t(exp["recv_topk_idx"], i64), check_dtype=True)
    assert_equal("recv_topk_weights",
                 d.recv_topk_weights, _t(exp["recv_topk_weights"], f32), check_dtype=True)
    for name in ("num_recv_tokens_per_rank", "num_recv_tokens_per_expert", "src_token",
                 "last_slot", "expand_rows", "expert_starts"):
        assert_equal(name, getattr(d, name), _t(exp[name], i64), check_dtype=True)
    assert_equal("expand_valid",
                 d.expand_valid, _t(exp["expand_valid"], torch.bool), check_dtype=True)

    de = reference_dispatch(x, idx, w, do_expand=True, **kw)
    assert_equal("expand recv_x", de.recv_x, _t(exp["expand_x"], bf16), check_dtype=True)
    assert_equal("expand recv_topk_idx", de.recv_topk_idx, None)
    assert_equal("expand recv_topk_weights",
                 de.recv_topk_weights, _t(exp["expand_w"], f32), check_dtype=True)
    for name in ("num_recv_tokens_per_rank", "num_recv_tokens_per_expert", "src_token",
                 "last_slot", "expand_rows", "expert_starts", "expand_valid"):
        assert_equal(f"expand {name}", getattr(de, name), getattr(d, name), check_dtype=True)

    dn = reference_dispatch(x, idx, None, do_expand=False, **kw)
    assert_equal("recv_topk_weights without weights", dn.recv_topk_weights, None)

    cin = COMBINE_IN[rank]
    bias_a, bias_b = _t(BIAS_A[:tokens], bf16, 2), _t(BIAS_B[:tokens], bf16, 2)
    ckw = dict(topk_idx=idx, num_experts=4, group=group)
    empty_x, empty_w = torch.zeros(0, 2, dtype=bf16), torch.zeros(0, 3, dtype=f32)

    cx, cw = reference_combine(_t(cin["xc"], bf16), d, topk_weights=_t(cin["wc"], f32),
                               bias=(bias_a, bias_b), **ckw)
    assert_equal("compact combined_x",
                 cx, _t(COMPACT_X, bf16) if rank == 0 else empty_x, check_dtype=True)
    assert_equal("compact combined_topk_weights",
                 cw, _t(COMPACT_W, f32) if rank == 0 else empty_w, check_dtype=True)

    cx, cw = reference_combine(_t(cin["xc"], bf16), d, **ckw)
    assert_equal("compact combined_x, no bias",
                 cx, _t(COMPACT_X_NOBIAS, bf16) if rank == 0 else empty_x, check_dtype=True)
    assert_equal("compact combined_topk_weights without weights", cw, None)

    cx, cw = reference_combine(_t(cin["xe"], bf16), de, topk_weights=_t(cin["we"], f32),
                               bias=bias_a, **ckw)
    assert_equal("expand combined_x",
                 cx, _t(EXPAND_X, bf16) if rank == 0 else empty_x, check_dtype=True)
    assert_equal("expand combined_topk_weights",
                 cw, _t(EXPAND_W, f32) if rank == 0 else empty_w, check_dtype=True)


def test_hand_example_two_ranks():
    _spawn(_hand_example, 2)


# ----------------------------------------------------------------------------- one rank


def _one_rank(rank, world_size, group):
    g = torch.Generator().manual_seed(0)
    T, M, H, K, E = 7, 8, 16, 3, 4
    x = torch.randint(-4, 5, (T, H), generator=g).to(bf16)
    idx = torch.tensor([[0, 1, 2], [3, -1, -1], [-1, -1, -1], [2, 2, -1],
                        [1, 0, 3], [-1, 3, -1], [0, 0, 0]], dtype=i64)
    w = torch.rand(T, K, generator=g)
    bias = torch.randint(-4, 5, (T, H), generator=g).to(bf16)
    valid = idx >= 0
    sent = valid.any(dim=1)
    n_slots = valid.sum(dim=1)
    kw = dict(num_experts=E, num_max_tokens_per_rank=M, group=group)

    d = reference_dispatch(x, idx.to(torch.int32), w, expert_alignment=1, **kw)
    assert_equal("recv_x", d.recv_x, x[sent], check_dtype=True)
    assert_equal("recv_topk_idx", d.recv_topk_idx, idx[sent], check_dtype=True)
    assert_equal("src_token", d.src_token, torch.nonzero(sent).flatten(), check_dtype=True)
    assert_equal("per expert",
                 d.num_recv_tokens_per_expert, torch.bincount(idx[valid], minlength=E),
                 check_dtype=True)
    cx, cw = reference_combine(d.recv_x, d, idx, E, group, topk_weights=d.recv_topk_weights)
    assert_equal("compact combine", cx, torch.where(sent[:, None], x, 0), check_dtype=True)
    assert_equal("compact combined weights", cw, torch.where(valid, w, 0.0), check_dtype=True)
    cx, _ = reference_combine(d.recv_x, d, idx, E, group, bias=(bias,))
    assert_equal("compact combine + bias",
                 cx, (x.float() * sent[:, None] + bias.float()).to(bf16), check_dtype=True)

    de = reference_dispatch(x, idx, w, expert_alignment=4, do_expand=True, **kw)
    assert_equal("aligned starts",
                 de.expert_starts % 4, torch.zeros(E, dtype=i64), check_dtype=True)
    assert_equal("expand rows % 4", de.recv_x.shape[0] % 4, 0)
    assert_equal("expand valid rows", int(de.expand_valid.sum()), int(n_slots.sum()))
    cx, cw = reference_combine(de.recv_x, de, idx, E, group, topk_weights=de.recv_topk_weights)
    # (0.0 + ...: the sum starts at +0.0, so a token sent nowhere gets +0, never -0)
    assert_equal("expand combine sums each slot once",
                 cx, (0.0 + x.float() * n_slots[:, None]).to(bf16), check_dtype=True)
    assert_equal("expand combined weights", cw, torch.where(valid, w, 0.0), check_dtype=True)

    # Bad input raises before any communication.
    with pytest.raises(ValueError, match="topk_idx"):
        reference_dispatch(x, torch.full((T, K), E, dtype=i64), None, **kw)
    with pytest.raises(ValueError, match="num_max_tokens_per_rank"):
        reference_dispatch(x, idx, None, num_experts=E, num_max_tokens_per_rank=T - 1,
                           group=group)
    with pytest.raises(ValueError, match="x must be"):
        reference_combine(d.recv_x.float(), d, idx, E, group)


def test_one_rank_combine_of_dispatch():
    _spawn(_one_rank, 1)


def _single_reduction_hand(rank, world_size, group):
    # One rank, E = 2, one token with slots [0, 1] (both on rank 0): expand rows 0 (slot 0)
    # and 1 (slot 1). Column 0: bias -BIG, rows BIG then 1; column 1: bias 1, rows 2^-8, 2^-8.
    x = torch.zeros(1, 2, dtype=bf16)
    idx = torch.tensor([[0, 1]], dtype=i64)
    w = torch.tensor([[0.25, 0.5]], dtype=f32)
    d = reference_dispatch(x, idx, w, num_experts=2, num_max_tokens_per_rank=1, group=group,
                           do_expand=True)
    assert_equal("expand rows", d.expand_rows, torch.tensor([[0, 1]]), check_dtype=True)
    y = torch.tensor([[BIG, 2.0 ** -8], [1.0, 2.0 ** -8]], dtype=bf16)
    bias = torch.tensor([[-BIG, 1.0]], dtype=bf16)
    cx, cw = reference_combine(y, d, idx, 2, group, topk_weights=d.recv_topk_weights,
                               bias=bias, single_reduction=True)
    # fp32 (0 + bias) + row 0 + row 1, one rounding at the end: -BIG + BIG + 1 = 1 (slot
    # order: 1 first would vanish into -BIG); 1 + 2^-8 + 2^-8 = 1 + 2^-7 (bf16 rounding after
    # each add would give 1).
    assert_equal("single reduction", cx, torch.tensor([[1.0, 1.0 + 2.0 ** -7]], dtype=bf16),
                 check_dtype=True)
    assert_equal("single reduction weights", cw, w, check_dtype=True)
    # The default reduces on the receiver first: bf16(BIG + 1) = BIG, so column 0 is 0.
    cx, cw = reference_combine(y, d, idx, 2, group, topk_weights=d.recv_topk_weights,
                               bias=bias)
    assert_equal("multiple reduction", cx, torch.tensor([[0.0, 1.0 + 2.0 ** -7]], dtype=bf16),
                 check_dtype=True)
    assert_equal("multiple reduction weights", cw, w, check_dtype=True)
    # Compact layout: the option changes nothing.
    dc = reference_dispatch(x, idx, w, num_experts=2, num_max_tokens_per_rank=1, group=group)
    yc = y[:1]
    assert_equal("compact, single_reduction ignored",
                 reference_combine(yc, dc, idx, 2, group, bias=bias, single_reduction=True)[0],
                 reference_combine(yc, dc, idx, 2, group, bias=bias)[0], check_dtype=True)


def test_single_reduction_hand_example():
    _spawn(_single_reduction_hand, 1)


# ----------------------------------------------------------------------------- FP8 bytes

FP8_T = [5, 0, 3]  # tokens per rank (rank 1 has none)
FP8_M, FP8_H, FP8_K, FP8_E = 6, 200, 3, 6


def _fp8_inputs(rank):
    """Random raw bytes (NaN patterns included) as fp8 rows and scale rows, per source rank."""
    g = torch.Generator().manual_seed(100 + rank)
    T = FP8_T[rank]
    x = torch.randint(0, 256, (T, FP8_H), generator=g, dtype=torch.uint8)
    s = torch.randint(-2 ** 31, 2 ** 31, (T, 2), generator=g, dtype=torch.int64).to(torch.int32)
    idx = torch.randint(-1, FP8_E, (T, FP8_K), generator=g)
    return x.view(torch.float8_e4m3fn), s.view(f32), idx


def _fp8_bytes(rank, world_size, group):
    x, s, idx = _fp8_inputs(rank)
    E_l = FP8_E // world_size
    # The rows this rank must receive, computed directly from every source's inputs.
    want_x, want_s, pairs = [], [], []  # pairs: (local expert, x row, s row) in compact order
    for src in range(world_size):
        sx, ss, sidx = _fp8_inputs(src)
        for t in range(FP8_T[src]):
            slots = [j for j in range(FP8_K) if sidx[t, j] >= 0 and sidx[t, j] // E_l == rank]
            if slots:
                want_x.append(sx[t].view(torch.uint8))
                want_s.append(ss[t].view(torch.uint8))
                pairs += [(int(sidx[t, j]) % E_l, sx[t], ss[t]) for j in slots]
    u8 = torch.uint8
    stack = lambda rows, w: torch.stack(rows) if rows else torch.zeros(0, w, dtype=u8)  # noqa
    kw = dict(num_experts=FP8_E, num_max_tokens_per_rank=FP8_M, group=group)

    d = reference_dispatch((x, s), idx, None, **kw)
    rx, rs = d.recv_x
    assert rx.dtype == torch.float8_e4m3fn and rs.dtype == f32
    assert_equal("fp8 rows", rx.view(u8), stack(want_x, FP8_H), check_dtype=True)
    assert_equal("scale rows", rs.view(u8), stack(want_s, 8), check_dtype=True)

    de = reference_dispatch((x, s), idx, None, expert_alignment=4, do_expand=True, **kw)
    ex, es = de.recv_x
    n_e = de.expand_valid.shape[0]
    want_ex = torch.zeros(n_e, FP8_H, dtype=u8)
    want_es = torch.zeros(n_e, 8, dtype=u8)
    for i in range(E_l):
        mine = [(px, ps) for (e, px, ps) in pairs if e == i]
        start = int(de.expert_starts[i])
        for k, (px, ps) in enumerate(mine):
            want_ex[start + k] = px.view(u8)
            want_es[start + k] = ps.view(u8)
    assert_equal("expand fp8 rows", ex.view(u8), want_ex, check_dtype=True)
    assert_equal("expand scale rows", es.view(u8), want_es, check_dtype=True)


def test_fp8_tuple_travels_as_bytes():
    _spawn(_fp8_bytes, 3)
