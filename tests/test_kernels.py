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
