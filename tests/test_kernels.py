"""Each kernel of `epcomm.kernels` on exactly its docstring example, on local tensors.

"Heaps" are ordinary tensors here; `bases` holds their addresses. Without CUDA the kernels run
under the Triton interpreter (importing `epcomm.kernels` selects it before any kernel exists).
"""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from epcomm import errors  # noqa: E402
from epcomm.kernels import combine, dispatch  # noqa: E402
from epcomm.kernels.sync import signal, wait  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
i32, i64 = torch.int32, torch.int64


def _t(values, dtype):
    return torch.tensor(values, dtype=dtype, device=DEV)


def _bases(*heaps):
    return _t([h.data_ptr() for h in heaps], i64)


def _word(values, dtype):
    """The int32 word holding `values` (two bf16 or one fp32) as stored in a record."""
    return int(torch.tensor(values, dtype=dtype).view(i32)[0])


def test_signal_example():
    a, b = torch.zeros(2, dtype=i64, device=DEV), torch.zeros(2, dtype=i64, device=DEV)
    signal(_bases(a, b), 0, 1, _t([3], i64), _t([5, 7], i64))
    assert a.tolist() == [0, 3 << 32 | 5] and b.tolist() == [0, 3 << 32 | 7]


def test_wait_example():
    a = _t([0, 3 << 32 | 5, 2 << 32 | 7], i64)
    b = torch.zeros(3, dtype=i64, device=DEV)
    epoch, error, counts = _t([2], i64), _t(0, i32), _t([-9, -9], i64)
    wait(_bases(a, b), 0, 8, epoch, error, 0.01, bump=True, counts=counts)
    assert epoch.tolist() == [3] and int(error) == errors.DISPATCH_TIMEOUT
    assert counts.tolist() == [5, 0]
    # Once the late flag arrives, the same wait returns without an error.
    a[2] = 3 << 32 | 7
    error.zero_()
    wait(_bases(a, b), 0, 8, epoch, error, 10.0, counts=counts)
    assert int(error) == 0 and counts.tolist() == [5, 7]


def _record(values):
    """A 12-word record (layout K=2, one payload word) from {word index: value}."""
    rec = [0] * 12
    for index, value in values.items():
        rec[index] = value
    return rec


def test_push_example():
    x = _t([[1, 2], [3, 4]], torch.bfloat16)
    layout = dispatch.RecordLayout(2, dispatch.payload_words([x]))
    assert (layout.offsets, layout.words) == ((8,), 12)
    a, b = torch.zeros(48, dtype=i32, device=DEV), torch.zeros(48, dtype=i32, device=DEV)
    dispatch.push(_bases(a, b), 0, 0, 2, _t([[0, 0], [1, -1]], i64), _t([[0, 3], [1, -1]], i32),
                  None, [x], layout, 2)
    x0, x1 = _word([1, 2], torch.bfloat16), _word([3, 4], torch.bfloat16)
    first = _record({0: 0, 1: 0, 2: 3, 8: x0})
    assert a.tolist() == first + _record({0: 1, 1: 1, 2: -1, 8: x1}) + [0] * 24
    assert b.tolist() == first + [0] * 36


def test_compact_example():
    layout = dispatch.RecordLayout(2, (1,))
    heap = torch.zeros(48, dtype=i32, device=DEV)
    heap[0:12] = _t(_record({0: 0, 1: 0, 2: 3, 8: 11}), i32)
    heap[24:36] = _t(_record({0: 1, 1: 2, 2: -1, 8: 22}), i32)
    local_idx, src, stage = (torch.full(shape, -5, dtype=i32, device=DEV)
                             for shape in ((3, 2), (3,), (3,)))
    rows = torch.zeros(3, 2, dtype=torch.bfloat16, device=DEV)
    dispatch.compact(_bases(torch.empty(0), heap), 0, 1, 2, 2, 2, _t([1, 1], i64), layout,
                     local_idx, None, src, stage, [rows], 2)
    assert local_idx.tolist() == [[-1, 1], [0, -1], [-5, -5]]  # row 2: past the count
    assert src.tolist() == [0, 3, -5] and stage.tolist() == [0, 2, -5]
    assert rows.view(i32).flatten().tolist() == [11, 22, 0]
    # fill_tail: rows past the count get -1 ids / sources, zero weights and (zero_rows) rows.
    rows.fill_(7)
    weights = torch.full((3, 2), 9.0, device=DEV)
    dispatch.compact(_bases(torch.empty(0), heap), 0, 1, 2, 2, 2, _t([1, 1], i64), layout,
                     local_idx, weights, src, stage, [rows], 2, fill_tail=True, zero_rows=True)
    assert local_idx.tolist() == [[-1, 1], [0, -1], [-1, -1]]
    assert src.tolist() == [0, 3, -1] and stage.tolist() == [0, 2, -1]
    assert rows.view(i32).flatten().tolist() == [11, 22, 0]
    assert weights.tolist() == [[0, 0], [0, 0], [0, 0]]  # the records' weights are 0 too


def test_expand_example():
    layout = dispatch.RecordLayout(2, (1,))
    heap = torch.zeros(36, dtype=i32, device=DEV)
    x = _word([1, 2], torch.bfloat16)
    heap[24:36] = _t(_record({0: 0, 1: 1, 2: 0, 3: _word([0.5], torch.float32),
                              4: _word([0.25], torch.float32), 8: x}), i32)
    rows = torch.zeros(4, 2, dtype=torch.bfloat16, device=DEV)
    weights = torch.zeros(4, dtype=torch.float32, device=DEV)
    dispatch.expand(_bases(heap), 0, 0, _t([1], i64), layout, _t([2], i32),
                    _t([[0, 1, 3, 0]], i32), weights, [rows], 2)
    assert rows.view(i32).flatten().tolist() == [x, 0, 0, x]
    assert weights.tolist() == [0.25, 0, 0, 0.5]


def test_combine_push_example():
    layout = combine.CombineLayout(hidden=1, num_topk=2)
    assert (layout.weight_offset, layout.words) == (4, 8)
    heap = torch.zeros(4 * 8, dtype=i32, device=DEV)
    combine.push(_bases(heap), 0, 0, 4, _t([1], i32), _t([2], i32), _t([[2, 1, 1, 0]], i32),
                 _t([[1], [256]], torch.bfloat16), _t([0.5, 0.25], torch.float32), layout,
                 expand=True, num_programs=2)
    record = heap[16:24]
    assert record[0:1].view(torch.bfloat16).tolist() == [256, 0]  # bf16(256 + 1): ties to even
    assert record[4:6].view(torch.float32).tolist() == [0.25, 0.5]
    assert int(heap[:16].abs().sum()) == 0 and int(heap[24:].abs().sum()) == 0


def _combine_heap(layout, records):
    """A combine region of 6 records from {record: (bf16 row values, fp32 weights)}."""
    heap = torch.zeros(6 * layout.words, dtype=i32, device=DEV)
    for index, (row, weights) in records.items():
        at = index * layout.words
        heap[at:at + layout.weight_offset].view(torch.bfloat16)[:len(row)] = \
            _t(row, torch.bfloat16)
        heap[at + layout.weight_offset:at + layout.weight_offset + len(weights)] = \
            _t(weights, torch.float32).view(i32)
    return heap


def test_reduce_example():
    layout = combine.CombineLayout(hidden=1, num_topk=2)
    heap = _combine_heap(layout, {0: ([1], [0.5, 0.5]), 5: ([2], [0.25, 0.75])})
    out = torch.zeros(1, 1, dtype=torch.bfloat16, device=DEV)
    weights = torch.zeros(1, 2, dtype=torch.float32, device=DEV)
    combine.reduce(_bases(heap), 0, 0, _t([[5, 0]], i64), _t([[5, 0]], i64),
                   [_t([[4]], torch.bfloat16)], out, weights, layout, 2)
    assert out.tolist() == [[7]] and weights.tolist() == [[0.25, 0.5]]


def test_reduce_rounds_like_torch():
    """fp32 sums of bf16 values land between bf16 values, often on ties: the kernel's rounding
    (integer arithmetic, also under the interpreter) must match torch bit for bit."""
    hidden = 256
    layout = combine.CombineLayout(hidden=hidden, num_topk=1)
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(hidden, generator=gen).bfloat16()
    row[:4] = torch.tensor([1.0, -1.0, 3.0, 0.0])
    bias = torch.randn(1, hidden, generator=gen).bfloat16() * 1e-2
    bias[0, :4] = torch.tensor([2.0 ** -8, -(2.0 ** -8), 2.0 ** -7, -0.0])
    heap = _combine_heap(layout, {3: (row.tolist(), [0.0])})
    out = torch.zeros(1, hidden, dtype=torch.bfloat16, device=DEV)
    combine.reduce(_bases(heap), 0, 0, _t([[3]], i64), _t([[3]], i64), [bias.to(DEV)], out,
                   None, layout, 1)
    want = (0.0 + bias.float() + row.float()).bfloat16()
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))


# -- routing layout kernels (epcomm.kernels.layout) ------------------------------------------
from epcomm import layout as torch_layout  # noqa: E402
from epcomm.kernels import layout as layout_kernels  # noqa: E402


def _route(topk_idx, num_experts, num_ranks, stride):
    outs = layout_kernels.route_outputs(topk_idx.shape[0], topk_idx.shape[1], num_ranks, DEV)
    error = _t(0, i32)
    layout_kernels.route(topk_idx, num_experts, num_ranks, stride, *outs, error,
                         errors.INVALID_EXPERT_ID)
    return outs, int(error)


def test_route_example():
    (pos, counts, ids, stage, last), error = _route(_t([[0, 3], [1, -1], [2, 3]], i64), 4, 2, 8)
    assert pos.tolist() == [[0, 0], [1, -1], [-1, 1]] and counts.tolist() == [2, 2]
    assert ids.tolist() == [[0, 3], [1, -1], [2, 3]]
    assert stage.tolist() == [[0, 8], [1, -1], [9, 9]]
    assert last.tolist() == [[0, 8], [1, -1], [-1, 9]] and error == 0


@pytest.mark.parametrize("seed", range(4))
def test_route_matches_torch(seed):
    gen = torch.Generator().manual_seed(seed)
    num_ranks, num_topk = [(1, 8), (2, 3), (3, 4), (4, 2)][seed]
    num_experts = num_ranks * [1, 2, 4, 3][seed]
    stride = 300
    num_tokens = [0, 1, 200, 257][seed]
    idx = torch.randint(-2 if seed == 3 else -1, num_experts + (1 if seed == 3 else 0),
                        (num_tokens, num_topk), generator=gen)
    if seed == 2:
        idx = torch.where(torch.rand(idx.shape, generator=gen) < 0.5, idx % 2, idx)
    idx = idx.to(i32 if seed % 2 else i64).to(DEV)
    (pos, counts, ids, stage, last), error = _route(idx, num_experts, num_ranks, stride)
    send = torch_layout.compute_send_layout(idx, num_experts, num_ranks)
    valid = send.slot_rank >= 0
    owner = send.slot_rank.clamp(min=0)
    want_stage = torch.where(valid, owner * stride + send.send_pos.gather(1, owner), -1)
    assert torch.equal(pos, send.send_pos) and torch.equal(counts, send.send_counts)
    assert torch.equal(ids, torch.where(valid, idx.long(), -1).int())
    assert torch.equal(stage, want_stage)
    assert torch.equal(last, torch.where(send.is_last_slot, want_stage, -1))
    bad = bool(((idx < -1) | (idx >= num_experts)).any())
    assert error == (errors.INVALID_EXPERT_ID if bad else 0)


def _expert_layout(local_idx, src, num_local, alignment, capacity, expand, rank_counts):
    num_rows, num_topk = local_idx.shape
    metadata = torch.full((num_rows, num_topk + 2), -9, dtype=i32, device=DEV)
    counts, psum, aligned = (torch.full((num_local,), -9, dtype=i32, device=DEV)
                             for _ in range(3))
    rank_psum = torch.full(rank_counts.shape, -9, dtype=i32, device=DEV)
    error = _t(0, i32)
    layout_kernels.expert_layout(local_idx, src, num_local, alignment, capacity, expand, metadata,
                                 counts, psum, aligned, rank_counts, rank_psum, error,
                                 errors.EXPAND_OVERFLOW)
    return metadata, counts, psum, aligned, rank_psum, int(error)


def test_expert_layout_example():
    metadata, counts, psum, aligned, rank_psum, error = _expert_layout(
        _t([[1, -1], [0, 1]], i64), _t([5, 7], i32), 2, 2, None, True, _t([1, 1], i64))
    assert metadata.tolist() == [[5, 0, 2, -1], [7, 1, 0, 3]]
    assert counts.tolist() == [1, 2] and aligned.tolist() == [2, 2] and psum.tolist() == [1, 4]
    assert rank_psum.tolist() == [1, 2] and error == 0


@pytest.mark.parametrize("seed", range(5))
def test_expert_layout_matches_torch(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    num_local, num_topk, alignment = [(1, 1, 1), (3, 4, 4), (40, 8, 128), (5, 3, 2),
                                      (2, 6, 1)][seed]
    num_rows = [0, 37, 70, 129, 40][seed]
    local_idx = torch.randint(-1, num_local, (num_rows, num_topk), generator=gen)
    if seed == 4:  # repeated ids past a small capacity: overflow
        local_idx = local_idx.clamp(min=0) % 2
    capacity = [None, None, 5000, None, 60][seed]
    expand = seed % 2 == 1
    local_idx = local_idx.to(i32 if seed % 2 else i64).to(DEV)
    src = torch.randint(-1, 1000, (num_rows,), generator=gen, dtype=i32).to(DEV)
    rank_counts = torch.randint(0, 50, (1 + seed % 3,), generator=gen).to(DEV)
    metadata, counts, psum, aligned, rank_psum, error = _expert_layout(
        local_idx, src, num_local, alignment, capacity, expand, rank_counts)
    experts = torch_layout.compute_expert_layout(local_idx, num_local, alignment, capacity)
    last = torch_layout.last_slot_per_rank(torch.where(local_idx >= 0, 0, -1), 0)
    want = torch.cat([src.view(-1, 1).long(), last.view(-1, 1), experts.expand_rows], 1).int()
    assert torch.equal(metadata, want)
    assert torch.equal(counts, experts.counts.int())
    assert torch.equal(aligned, (experts.psum_aligned - experts.starts).int())
    assert torch.equal(psum, (experts.starts + experts.counts if expand
                              else experts.psum_aligned).int())
    assert torch.equal(rank_psum, rank_counts.cumsum(0).int())
    assert error == (errors.EXPAND_OVERFLOW if bool(experts.overflow) else 0)
    assert (seed != 4) or error


def test_signal_wait_example():
    from epcomm.kernels.sync import signal_wait
    a = torch.zeros(2, dtype=i64, device=DEV)
    epoch, error, counts = _t([3], i64), _t(0, i32), _t([-9], i64)
    signal_wait(_bases(a), 0, 8, epoch, error, 1.0, _t([5], i64), counts)
    assert a.tolist() == [0, 3 << 32 | 5] and counts.tolist() == [5] and int(error) == 0
    signal_wait(_bases(a), 0, 0, epoch, error, 1.0)  # no counts: flag 0 gets epoch << 32
    assert a.tolist() == [3 << 32, 3 << 32 | 5] and int(error) == 0
