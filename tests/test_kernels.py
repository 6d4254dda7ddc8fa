"""The kernels of `epcomm.kernels` on exactly their docstring examples, on local tensors.

One rank: the "heap" is an ordinary tensor and `bases` holds its address, so a kernel's stores
into "peers" land there and its waits are satisfied by its own signals. Without CUDA the
kernels run under the Triton interpreter (importing `epcomm.kernels` selects it first).
"""
import dataclasses

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from epcomm import errors  # noqa: E402
from epcomm.kernels import INTERPRET  # noqa: E402
from epcomm.kernels import combine, dispatch  # noqa: E402
from epcomm.kernels.launcher import KernelShape, Launcher, Stage  # noqa: E402
from epcomm.kernels.sync import timeout_units  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
i32, i64, bf16 = torch.int32, torch.int64, torch.bfloat16
S, K, H = 4, 2, 2
REGION = 64  # bytes: the six int64 counters of one rank (dispatch), then the staging records
SHAPE = KernelShape(num_ranks=1, num_topk=K, vec=1, block_w=16, rows=4, programs=1,
                             num_warps=1)
TIMEOUT = timeout_units(10.0)
# The variants `dispatch.variant` names for the examples' int64 ids: without idx_out (a send
# launch or an expand receive), and with an int64 idx_out (a compact receive).
SEND_VARIANT, FULL_VARIANT = (i64, i32), (i64, i64)


def _t(values, dtype):
    return torch.tensor(values, dtype=dtype, device=DEV)


class OneRank:
    """A one-rank heap with the dispatch counters at byte 0, combine counters at byte 24... and
    both staging regions; the scratch tensors of the backend."""

    def __init__(self) -> None:
        self.heap = torch.zeros(512, dtype=i32, device=DEV)
        bases = _t([self.heap.data_ptr()], i64)
        self.dispatch = Stage(bases, 0, 0, REGION, S)
        self.combine = Stage(bases, 0, 24, REGION + 4 * 48, S)
        self.sync = torch.zeros(8, dtype=i64, device=DEV)
        self.error = _t(0, i32)
        self.counts = torch.zeros(16, dtype=i32, device=DEV)
        self.pos = torch.zeros(16, dtype=i32, device=DEV)
        self.hist = torch.zeros(dispatch.hist_scratch_words(1, SHAPE.rows, S, 4, K), dtype=i32,
                                device=DEV)

    def counters(self, offset: int):
        """(ready, free, count) of the counter array at byte `offset` (the count without the
        call's stamp in the word's high bits, `kernels.sync.stamp`)."""
        ready, free, count = self.heap.view(i64)[offset // 8: offset // 8 + 3].tolist()
        return [ready, free, count & 0xFFFFFFFF]

    def record(self, region: int, slot: int, words: int):
        start = region // 4 + slot * words
        return self.heap[start:start + words].tolist()


def _idle_receive(rank: OneRank, layout):
    """Arguments for the receive part of a launch that runs only the send part."""
    return dispatch.receive_phase(
        rank.hist, layout, max_tokens=S, num_local=4, alignment=1,
        capacity=0, out_rows=0, expand=False, zero_padding=False, tail=False, idx_out=None,
        weights_out=None, metadata=rank.pos, rank_psum=rank.counts, expert_counts=rank.hist,
        expert_psum=rank.hist, rows_out=[])


def _example_send_phase(rank: OneRank, slots):
    x = _t([[1, 2], [3, 4]], bf16)
    layout = dispatch.RecordLayout(K, dispatch.payload_words([x]))
    send = dispatch.send_phase(rank.counts, rank.pos, _t([[0, 3], [-1, -1]], i64), 4, None, [x],
                               layout, slots)
    return x, layout, send


def _send_example(rank: OneRank):
    slots = torch.full((2, K), -7, dtype=i32, device=DEV)
    x, layout, send = _example_send_phase(rank, slots)
    dispatch.run(SHAPE, rank.dispatch, layout, rank.sync, rank.error, TIMEOUT, send,
                 _idle_receive(rank, layout), do_receive=False, variant=SEND_VARIANT)
    return x, layout, slots


def test_send_example():
    rank = OneRank()
    x, layout, slots = _send_example(rank)
    assert layout.words == 12 and layout.offsets == (8,)
    record = rank.record(REGION, 0, 12)
    assert record[:3] == [0, 0, 3] and record[8] == 0  # own rows: the payload stays in x
    assert slots.tolist() == [[0, 0], [-1, -1]]
    assert rank.counters(0) == [1, 0, 1]  # ready += P (1), free untouched, count 1
    assert int(rank.error) == 0


def _receive_outputs(out_rows: int) -> dict:
    return dict(idx_out=torch.full((out_rows, K), -7, dtype=i64, device=DEV),
                metadata=torch.full((out_rows, K + 2), -7, dtype=i32, device=DEV),
                rank_psum=torch.full((1,), -7, dtype=i32, device=DEV),
                expert_counts=torch.full((4,), -7, dtype=i32, device=DEV),
                expert_psum=torch.full((4,), -7, dtype=i32, device=DEV),
                rows_out=[torch.full((out_rows, H), -7, dtype=bf16, device=DEV)])


def _receive_phase(rank, layout, out, *, expand=False, out_rows=1, tail=False,
                   capacity=2**31 - 1, counts_host=None):
    return dispatch.receive_phase(rank.hist, layout, max_tokens=S,
                                  num_local=4, alignment=2, capacity=capacity, out_rows=out_rows,
                                  expand=expand, zero_padding=True, tail=tail, weights_out=None,
                                  counts_host=counts_host, **out)


def _receive(rank, layout, *, out_rows=1, **options):
    """A receive-only launch (the send part ran in an earlier one)."""
    out = _receive_outputs(out_rows)
    idle_send = _example_send_phase(rank, torch.empty(2, K, dtype=i32, device=DEV))[2]
    compact = not options.get("expand", False)
    dispatch.run(SHAPE, rank.dispatch, layout, rank.sync, rank.error, TIMEOUT, idle_send,
                 _receive_phase(rank, layout, out, out_rows=out_rows, **options), do_send=False,
                 variant=FULL_VARIANT if compact else SEND_VARIANT)
    return out


def test_receive_example():
    rank = OneRank()
    x, layout, _ = _send_example(rank)
    out = _receive(rank, layout)
    assert out["rank_psum"].tolist() == [1]
    assert out["expert_counts"].tolist() == [1, 0, 0, 1]
    assert out["expert_psum"].tolist() == [2, 2, 2, 4]
    assert out["idx_out"].tolist() == [[0, 3]]
    assert out["metadata"].tolist() == [[0, 1, 0, 2]]
    assert torch.equal(out["rows_out"][0], x[:1])
    assert rank.counters(0) == [1, 1, 1]  # this rank freed its staging block
    assert int(rank.error) == 0


def test_receive_example_leaves_counts_in_host_memory():
    """With counts_host (a synchronizing call's pinned host words): [rows, error flag, aligned
    per-expert counts], the flag as the call leaves it (here one an earlier call raised)."""
    rank = OneRank()
    x, layout, _ = _send_example(rank)
    rank.error.fill_(errors.INVALID_EXPERT_ID)
    host = torch.full((6,), -7, dtype=i32, pin_memory=DEV.type == "cuda")
    out = _receive(rank, layout, counts_host=host)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    assert host.tolist() == [1, errors.INVALID_EXPERT_ID, 2, 0, 0, 2]
    assert out["expert_counts"].tolist() == [1, 0, 0, 1]


def test_send_and_receive_in_one_launch():
    """`dispatch.run` with both parts (what a sync-free dispatch launches): the outputs of the
    send and receive examples."""
    rank = OneRank()
    slots = torch.full((2, K), -7, dtype=i32, device=DEV)
    x, layout, send = _example_send_phase(rank, slots)
    out = _receive_outputs(1)
    dispatch.run(SHAPE, rank.dispatch, layout, rank.sync, rank.error, TIMEOUT, send,
                 _receive_phase(rank, layout, out))
    assert slots.tolist() == [[0, 0], [-1, -1]]
    assert out["idx_out"].tolist() == [[0, 3]] and out["metadata"].tolist() == [[0, 1, 0, 2]]
    assert torch.equal(out["rows_out"][0], x[:1])
    assert rank.counters(0) == [1, 1, 1] and int(rank.error) == 0


def test_receive_sync_free_tail_and_expand_rows():
    rank = OneRank()
    x, layout, _ = _send_example(rank)
    out = _receive(rank, layout, expand=True, out_rows=3, tail=True, capacity=6)
    assert out["metadata"].tolist() == [[0, 1, 0, 2], [-1] * 4, [-1] * 4]
    assert out["expert_psum"].tolist() == [1, 2, 2, 3]  # expand: start + count
    rows = out["rows_out"][0]
    assert torch.equal(rows[0], x[0]) and torch.equal(rows[2], x[0])  # both pairs' rows
    assert rows[1].tolist() == [0, 0] and rows[3:].eq(0).all()  # gap and tail: zero padding


def test_receive_times_out_instead_of_hanging():
    rank = OneRank()
    rank.sync[0] = 1  # one send call counted, but its ready counter never arrives
    layout = dispatch.RecordLayout(K, (1,))
    idle_send = _example_send_phase(rank, torch.empty(2, K, dtype=i32, device=DEV))[2]
    dispatch.run(SHAPE, rank.dispatch, layout, rank.sync, rank.error,
                 timeout_units(0.01), idle_send, _idle_receive(rank, layout),
                 do_send=False)
    assert int(rank.error) == errors.DISPATCH_TIMEOUT
    assert rank.counts[0].item() == 0  # the late source counts as empty


def test_one_block_example(monkeypatch):
    """`dispatch.one_block`'s docstring example, at the GPU's limit of 8192 elements."""
    monkeypatch.setattr(dispatch, "_ONE_BLOCK", 8192)
    decode = KernelShape(1, 8, 4, 2048, 4, 32, 8)
    assert dispatch.one_block(decode, 128) == (128, 128)
    assert dispatch.one_block(decode, 4096) == (0, 0)
    # 8 ranks of 128 tokens still fit; a 16-row tile does not take the receive's block
    assert dispatch.one_block(KernelShape(8, 8, 4, 2048, 4, 32, 8), 1024) == (128, 1024)
    assert dispatch.one_block(KernelShape(1, 8, 4, 512, 16, 32, 8), 128) == (128, 0)


def _dispatch_on(programs: int, topk_idx, x, weights, expand: bool, num_local: int):
    """A dispatch of one rank on `programs` programs, as a send launch then a receive launch
    (4 tokens per buffer row block S = 8, 2-row tiles): every output, by name."""
    tokens, k = topk_idx.shape
    shape = KernelShape(num_ranks=1, num_topk=k, vec=1, block_w=16, rows=2, programs=programs,
                        num_warps=1)
    layout = dispatch.RecordLayout(k, dispatch.payload_words([x]))
    heap = torch.zeros(16 + 8 * layout.words, dtype=i32, device=DEV)
    stage = Stage(_t([heap.data_ptr()], i64), 0, 0, 64, 8)
    sync, error = torch.zeros(8, dtype=i64, device=DEV), _t(0, i32)
    hist = torch.zeros(dispatch.hist_scratch_words(programs, 2, 8, num_local, k), dtype=i32,
                       device=DEV)
    capacity = 8 * k + num_local
    out = dict(slots=torch.full((tokens, k), -7, dtype=i32, device=DEV),
               idx_out=torch.full((8, k), -7, dtype=i64, device=DEV),
               weights_out=torch.full((capacity if expand else 8,) + (() if expand else (k,)),
                                      -7.0, device=DEV),
               metadata=torch.full((8, k + 2), -7, dtype=i32, device=DEV),
               rank_psum=torch.full((1,), -7, dtype=i32, device=DEV),
               expert_counts=torch.full((num_local,), -7, dtype=i32, device=DEV),
               expert_psum=torch.full((num_local,), -7, dtype=i32, device=DEV),
               rows_out=[torch.full((capacity if expand else 8, x.shape[1]), -7, dtype=bf16,
                                    device=DEV)])
    send = dispatch.send_phase(torch.zeros(programs, dtype=i32, device=DEV),
                               torch.zeros(tokens, dtype=i32, device=DEV), topk_idx, num_local,
                               weights, [x], layout, out["slots"])
    receive = dispatch.receive_phase(
        hist, layout, max_tokens=8, num_local=num_local, alignment=2, capacity=capacity,
        out_rows=8, expand=expand, zero_padding=True, tail=True,
        **{name: value for name, value in out.items() if name != "slots"})
    if expand:
        receive.update(idx_out=receive["meta_out"])
    variant = (i64, i32 if expand else i64)
    for part in ("send", "receive"):
        dispatch.run(shape, stage, layout, sync, error, TIMEOUT, send, receive,
                     do_send=part == "send", do_receive=part == "receive", variant=variant)
    assert int(error) == 0
    return {name: value if name != "rows_out" else value[0] for name, value in out.items()}


@pytest.mark.parametrize("expand", [False, True])
def test_one_block_paths_match_the_grid_barriers(expand, monkeypatch):
    """The one-block paths (`dispatch.one_block`) wait for no other program of the launch, so
    the interpreter, which runs programs one after another, runs them on 3 programs too (each
    several tiles): equal to one program's, and to the grid-barrier paths' (forced by a limit
    of 0), on random ids with -1 slots and an expert that gets nothing."""
    gen = torch.Generator().manual_seed(7)
    num_local, k = 6, 3
    topk_idx = torch.randint(-1, num_local - 1, (7, k), generator=gen).to(DEV)
    x = torch.randn(7, 4, generator=gen).bfloat16().to(DEV)
    weights = torch.rand(7, k, generator=gen).to(DEV)
    shape = KernelShape(1, k, 1, 16, 2, 3, 1)
    assert dispatch.one_block(shape, 8) == (8, 8)
    runs = [_dispatch_on(programs, topk_idx, x, weights, expand, num_local)
            for programs in (3, 1)]
    monkeypatch.setattr(dispatch, "_ONE_BLOCK", 0)
    assert dispatch.one_block(shape, 8) == (0, 0)
    runs.append(_dispatch_on(1, topk_idx, x, weights, expand, num_local))
    for run in runs[1:]:
        for name, value in runs[0].items():
            if not (expand and name == "idx_out"):
                assert torch.equal(value, run[name]), name
    assert runs[0]["expert_counts"].tolist() == [
        int((topk_idx == e).sum()) for e in range(num_local)]


@pytest.mark.parametrize("scope", ["sys", "gpu"])
def test_combine_example(scope):
    """`combine.combine`'s docstring example on one rank: the returned record, then the sums;
    with the signals at either scope (`SymmetricHeap.scope`: one rank's heap is on its own
    device, so GPU scope orders them)."""
    rank = OneRank()
    layout = combine.CombineLayout(H, K)
    out = torch.full((2, H), -7, dtype=bf16, device=DEV)
    weights = torch.full((2, K), -7, dtype=torch.float32, device=DEV)
    shape = dataclasses.replace(SHAPE, scope=scope, launchers={})  # (its own launchers)
    assert combine.launcher(shape).constants["SCOPE"] == scope
    combine.combine(shape, rank.combine, layout, rank.sync, _t([1], i32), _t([[0, 1, 0, 2]], i32),
                    _t([[5, 6]], bf16), _t([[0.5, 0.25]], torch.float32), False,
                    _t([[0, 0], [-1, -1]], i32), (_t([[1, 1], [2, 2]], bf16),), out, weights,
                    rank.error, TIMEOUT)
    assert layout.words == 8 and layout.weight_offset == 4  # 16-byte aligned fields
    # The row returned to this rank itself is read from x and the weights: no record.
    assert rank.record(REGION + 4 * 48, 0, 8) == [0] * 8
    assert out.tolist() == [[6, 7], [2, 2]]
    assert weights.tolist() == [[0.5, 0.25], [0, 0]]
    assert rank.counters(24) == [1, 1, 0] and int(rank.error) == 0


def test_reduce_rounds_like_torch():
    """The fp32 sum of bias + row, rounded once to bf16, equals torch's on random data (the
    kernel converts in integer arithmetic: round to nearest even)."""
    hidden, tokens = 64, 4
    gen = torch.Generator().manual_seed(3)
    shape = KernelShape(1, 1, 1, 16, 4, 1, 1)
    layout = combine.CombineLayout(hidden, 1)
    rank = OneRank()
    rank.heap = torch.zeros(4096, dtype=i32, device=DEV)
    bases = _t([rank.heap.data_ptr()], i64)
    stage = Stage(bases, 0, 24, REGION, tokens)
    x = (torch.randn(tokens, hidden, generator=gen) * 1e3).bfloat16().to(DEV)
    bias = torch.randn(tokens, hidden, generator=gen).bfloat16().to(DEV)
    meta = torch.stack([torch.arange(tokens), torch.zeros(tokens, dtype=i64),
                        torch.arange(tokens)], 1).to(i32).to(DEV)
    out = torch.empty(tokens, hidden, dtype=bf16, device=DEV)
    slots = torch.arange(tokens, dtype=i32, device=DEV).view(-1, 1)
    combine.combine(shape, stage, layout, rank.sync, _t([tokens], i32), meta, x, None, False,
                    slots, (bias,), out, None, rank.error, TIMEOUT)
    assert torch.equal(out, (bias.float() + x.float()).bfloat16())


@pytest.mark.parametrize("values", [64, 128, 32768])  # 1, 2 and all 3 slots' rows at once
def test_expand_send_sums_slots_in_order(values, monkeypatch):
    """The expand send's sums, whatever number of slots' rows it loads at once
    (`combine.slots_in_flight`, 2 of K = 3 leaving a last pass of one): each record is the fp32
    sum of the row's expert rows in slot order, rounded once, which the one-rank reduce returns
    unchanged; slots without a row add nothing."""
    monkeypatch.setattr(combine, "_VALUES_IN_FLIGHT", values)
    hidden, tokens, k = 64, 6, 3
    shape = KernelShape(1, k, 1, 16, 4, 1, 1)
    assert combine.slots_in_flight(shape) == min(k, values // 64)
    gen = torch.Generator().manual_seed(values)
    x = (torch.randn(12, hidden, generator=gen) * 10 ** torch.randint(-3, 4, (12, 1),
                                                                      generator=gen)).bfloat16()
    targets = torch.randint(0, 12, (tokens, k), generator=gen)
    targets[torch.rand(tokens, k, generator=gen) < 0.3] = -1
    targets[1] = -1  # a row without any
    layout = combine.CombineLayout(hidden, k)
    rank = OneRank()
    rank.heap = torch.zeros(4096, dtype=i32, device=DEV)
    stage = Stage(_t([rank.heap.data_ptr()], i64), 0, 24, REGION, tokens)
    meta = torch.cat([torch.arange(tokens).view(-1, 1), torch.zeros(tokens, 1, dtype=i64),
                      targets], 1).to(i32).to(DEV)
    out = torch.full((tokens, hidden), -7, dtype=bf16, device=DEV)
    slots = torch.arange(tokens, dtype=i32).view(-1, 1).expand(tokens, k).contiguous()
    combine.combine(shape, stage, layout, rank.sync, _t([tokens], i32), meta, x.to(DEV), None,
                    True, slots.to(DEV), (), out, None, rank.error, TIMEOUT)
    expected = torch.zeros(tokens, hidden)
    for j in range(k):
        expected += torch.where((targets[:, j] >= 0).view(-1, 1), x[targets[:, j]].float(), 0.0)
    assert torch.equal(out.cpu(), expected.bfloat16()) and int(rank.error) == 0


def test_launcher_reuses_the_compiled_variant():
    """A `Launcher` launches the generic way first, then (on the GPU) through the kept compiled
    kernel: both launches must do the same work; `variant=None` always goes the generic way."""
    rank = OneRank()
    x, layout, _ = _send_example(rank)
    out = _receive(rank, layout)
    assert out["metadata"].tolist() == [[0, 1, 0, 2]]
    cached = [kept for kept in SHAPE.launchers.values()
              if kept.fn is dispatch.dispatch_kernel and kept.compiled]
    assert bool(cached) == (not INTERPRET)  # the interpreter has nothing to keep
    generic = {id(kept): kept.generic_launches for kept in SHAPE.launchers.values()}
    for call in range(2):  # a second round trip reuses both kernels
        _send_example(rank)
        again = _receive(rank, layout)
        assert again["metadata"].tolist() == [[0, 1, 0, 2]], call
        assert torch.equal(again["rows_out"][0], x[:1])
    if not INTERPRET:  # ... without Triton's generic launch
        assert all(kept.fallback is None and kept.generic_launches == generic[id(kept)]
                   for kept in SHAPE.launchers.values()), \
            [(kept.fn, kept.fallback) for kept in SHAPE.launchers.values()]
    assert rank.counters(0) == [3, 3, 1] and int(rank.error) == 0
    assert Launcher(dispatch.dispatch_kernel, 1, {}).fast == (not INTERPRET)


def test_launch_hooks_passed_only_when_set():
    """Triton 3.9 keeps an empty `HookChain` as `launch_enter_hook` when no profiler is
    attached; the launcher must treat it as no hook (calling it costs host time, and a check for
    None alone once sent every launch the generic way), and pass any real hook on."""
    from triton import knobs

    from epcomm.kernels.launcher import _hook
    assert _hook(None) is None and _hook(print) is print
    if hasattr(knobs, "HookChain"):  # (a Triton with plain hooks has nothing more to check)
        chain = knobs.HookChain()
        assert _hook(chain) is None
        chain.add(print)
        assert _hook(chain) is chain


def test_template_arguments_only_for_a_kept_variant():
    """A prepared call's arguments: the send and receive examples built once with `Address`
    stand-ins (`Launcher.template`), filled with the real addresses and launched through the
    kept kernel, give the same outputs. Filled arguments for a variant with no kept kernel
    (always, under the interpreter) raise instead of compiling a kernel that would take
    addresses for integers."""
    from epcomm.kernels.launcher import Address
    rank = OneRank()
    x, layout, _ = _send_example(rank)
    _receive(rank, layout)  # keeps both variants (on the GPU)
    launcher = dispatch.launcher(SHAPE, layout, S)
    assert launcher.kept(FULL_VARIANT) == (not INTERPRET) and not launcher.kept(None)
    slots = torch.full((2, K), -7, dtype=i32, device=DEV)
    out = _receive_outputs(1)
    idx = _t([[0, 3], [-1, -1]], i64)
    tensors = [idx, x, slots, out["idx_out"], out["metadata"], out["rows_out"][0]]
    stand = [Address(slot, tuple(tensor.shape)) for slot, tensor in enumerate(tensors)]
    send = dispatch.send_phase(rank.counts, rank.pos, stand[0], 4, None, [stand[1]], layout,
                               stand[2])
    receive = dispatch.receive_phase(
        rank.hist, layout, max_tokens=S, num_local=4, alignment=2,
        capacity=2**31 - 1, out_rows=1, expand=False, zero_padding=True, tail=False,
        weights_out=None, idx_out=stand[3], metadata=stand[4], rank_psum=out["rank_psum"],
        expert_counts=out["expert_counts"], expert_psum=out["expert_psum"],
        rows_out=[stand[5]])
    template = launcher.template(dispatch.arguments(rank.dispatch, layout, rank.sync,
                                                    rank.error, TIMEOUT, send, receive), base=0)
    args = template.fill([tensor.data_ptr() for tensor in tensors])
    if INTERPRET:
        with pytest.raises(RuntimeError, match="filled arguments"):
            launcher.launch_filled(FULL_VARIANT, None, args)
        return
    launcher.launch_filled(FULL_VARIANT, None, args)
    assert slots.tolist() == [[0, 0], [-1, -1]]
    assert out["idx_out"].tolist() == [[0, 3]] and out["metadata"].tolist() == [[0, 1, 0, 2]]
    assert out["rank_psum"].tolist() == [1] and out["expert_psum"].tolist() == [2, 2, 2, 4]
    assert torch.equal(out["rows_out"][0], x[:1])
    assert rank.counters(0) == [2, 2, 1] and int(rank.error) == 0


def test_launcher_binds_arguments_by_name():
    """`Launcher.bind`: the kernel's runtime parameters in signature order from a mapping, a
    missing or an unknown name raising with that name (the phase builders' fields are checked
    against the kernel's parameters)."""
    launcher = combine.launcher(SHAPE)
    names = launcher.params
    assert names[:3] == ("bases_ptr", "rank", "num_ranks") and "K" not in names
    fields = {name: index for index, name in enumerate(reversed(names))}
    assert launcher.bind(fields) == tuple(fields[name] for name in names)
    with pytest.raises(ValueError, match="no argument for parameter 'x_ptr'"):
        launcher.bind({name: 0 for name in names if name != "x_ptr"})
    with pytest.raises(ValueError, match="no parameter named typo"):
        launcher.bind({**fields, "typo": 0})
    rank = OneRank()
    x = torch.zeros(1, H, dtype=bf16, device=DEV)
    built = combine.arguments(rank.combine, combine.CombineLayout(H, K), rank.sync, rank.pos,
                              rank.pos, x, None, False, rank.pos, (), x, None, rank.error, 1)
    assert set(built) == set(names)  # the builder names every parameter, nothing else


def test_address_of_an_empty_tensor_is_int64():
    """`launcher.address`: a tensor's address, a large placeholder for an empty one (whose 0
    Triton would type int32 when a kernel compiles), an `Address` stand-in as it is."""
    from epcomm.kernels.launcher import EMPTY_ADDRESS, Address, address
    full = torch.zeros(4, device=DEV)
    assert address(full) == full.data_ptr() != 0
    assert address(torch.zeros(0, device=DEV)) == EMPTY_ADDRESS >= 1 << 32
    stand_in = Address(3)
    assert address(stand_in) is stand_in


def test_tensor_block_views_on_16_byte_boundaries():
    """`TensorBlock`: named views of one int32 allocation, each 16-byte aligned and not
    overlapping, made on first access; `address_of` gives each view's address without making
    it, and a block of an `Address` stand-in gives `arg` as offsets from it; extra tensors are
    its own."""
    from epcomm.backends.blocks import BlockLayout, TensorBlock
    from epcomm.kernels.launcher import Address
    layout = BlockLayout([("a", (3,), i32), ("b", (2, 4), i32), ("c", (0,), i32),
                          ("d", (5, 3), i64), ("e", (1,), i32)])
    assert layout.words == 4 + 8 + 0 + 32 + 4
    block = TensorBlock(torch.empty(layout.words, dtype=i32), layout,
                        {"f": torch.ones(2)})
    base = block.block.data_ptr()
    ends = []
    for name in "abde":
        view = block[name]
        _, shape, dtype = layout.parts[name]
        assert view.shape == shape and view.dtype == dtype and block[name] is view
        assert view.untyped_storage().data_ptr() == block.block.untyped_storage().data_ptr()
        assert (view.data_ptr() - base) % 16 == 0
        assert block.address_of(name) == view.data_ptr() and block.arg(name) is view
        ends.append((view.data_ptr(), view.data_ptr() + view.numel() * view.element_size()))
    assert all(end <= later for (_, end), (later, _) in zip(ends, ends[1:]))  # no overlap
    assert block.arg("f") is block["f"] and set(block) == set("abcdef")
    assert block.address_of("f") == block["f"].data_ptr()
    stand_in = TensorBlock(Address(3, (layout.words,)), layout, {"f": Address(1)})
    assert [(part.slot, part.offset) for part in map(stand_in.arg, "abde")] == \
        [(3, 0), (3, 16), (3, 48), (3, 176)]
    assert stand_in.arg("f").slot == 1


def test_arg_template_example():
    """`ArgTemplate`: its docstring example, new addresses per fill, a part's offset only from
    the base slot (read only by a template with parts), and the address count checked."""
    from epcomm.kernels.launcher import Address, ArgTemplate
    template = ArgTemplate((7, Address(1), Address(0, offset=16), Address(0)), base=0)
    assert template.fill((1000, 2000)) == (7, 2000, 1016, 1000)
    assert template.fill((3000, 4000)) == (7, 4000, 3016, 3000)
    block = Address(2, shape=(5,)) + 32  # what TensorBlock.arg does with a stand-in block
    assert (block.slot, block.offset, block.shape, block.data_ptr()) == (2, 32, (5,), block)
    assert ArgTemplate((block, Address(0), 1, block), base=2).fill((5, 6, 100)) == \
        (132, 5, 1, 132)
    assert ArgTemplate((Address(1),), base=0).fill((5, 6)) == (6,)
    # without parts the base slot is not read: a launch that takes slots 0-1 of a call whose
    # block is in slot 4 fills from its own two addresses
    assert ArgTemplate((Address(1), Address(0)), base=4).fill((5, 6)) == (6, 5)
    kept = torch.zeros(2)  # a tensor among the constants is kept as its address
    assert ArgTemplate((kept, Address(0)), base=0).fill((9,)) == (kept.data_ptr(), 9)
    with pytest.raises(ValueError, match="slot 0"):
        ArgTemplate((Address(1, offset=4),), base=0)
    with pytest.raises(ValueError, match="expected 2 addresses"):
        template.fill((1,))


@triton.jit
def _work_items_probe(out_ptr, num_rows, hidden, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    begin, end, pieces, per = combine._work_items(num_rows, hidden, ROWS, BLOCK_H)
    pid = tl.program_id(0)
    tl.store(out_ptr + pid * 4 + tl.arange(0, 4),
             tl.where(tl.arange(0, 4) == 0, begin,
                      tl.where(tl.arange(0, 4) == 1, end,
                               tl.where(tl.arange(0, 4) == 2, pieces, per))))


@pytest.mark.parametrize("programs,num_rows,hidden", [
    (32, 128, 7168), (32, 1, 7168), (132, 4096, 7168), (5, 0, 256), (3, 7, 320), (8, 40, 64)])
def test_combine_work_items_cover_every_step_once(programs, num_rows, hidden):
    """`combine._work_items` (its docstring example first): the P programs' items cover every
    (row tile, hidden step) once, spread over as many programs as there are items."""
    rows, block_h = 16, 1024 if hidden >= 1024 else 64
    out = torch.zeros(programs, 4, dtype=i32, device=DEV)
    _work_items_probe[(programs,)](out, num_rows, hidden, ROWS=rows, BLOCK_H=block_h)
    out = out.tolist()
    steps, tiles = -(-hidden // block_h), -(-num_rows // rows)
    pieces, per = out[0][2], out[0][3]
    if (programs, num_rows, hidden) == (32, 128, 7168):
        assert (pieces, per) == (4, 2) and [b for b, _, _, _ in out] == list(range(32))
    covered = []
    for begin, end, p, q in out:
        assert (p, q) == (pieces, per)
        for w in range(begin, end):
            tile, piece = divmod(w, pieces)
            covered += [(tile, step) for step in range(piece * per, min((piece + 1) * per, steps))]
    assert sorted(covered) == [(t, s) for t in range(tiles) for s in range(steps)]
    items = tiles * pieces
    chunk = -(-items // programs)  # program_chunk: equal contiguous chunks
    assert sum(end > begin for begin, end, _, _ in out) == (-(-items // chunk) if items else 0)
    assert tiles * pieces >= min(programs, tiles * steps)


def _copy_spans(spans, addresses, inward: bool, vec: int, block: int, words=None):
    """One launch of `copy.copy_spans_kernel` over `spans` ((fixed tensor, words) each) and the
    per-call tensors `addresses`, `block` words per program; `words`: those copied per span
    this call (None: each span's)."""
    from epcomm.backends.graphed import span_table
    from epcomm.kernels import copy
    table, programs = span_table([n for _, n in spans], block)
    rows = [(fixed.data_ptr(), first) for (fixed, _), (_, first) in zip(spans, table)]
    Launcher(copy.copy_spans_kernel, programs, dict(
        INWARD=int(inward), VEC=vec, BLOCK_W=block, BLOCK_N=4, num_warps=1))(
            (), None, dict(spans_ptr=_t(rows, i64), num_spans=len(spans),
                           addresses_ptr=_t([t.data_ptr() for t in addresses], i64),
                           words_ptr=_t([n for _, n in spans] if words is None else words,
                                        i64)))


def test_copy_spans_example():
    """`copy_spans_kernel` and `graphed.span_table`: their docstring examples (and which calls
    `graphed.graphable` takes), then spans of uneven lengths (an empty one among them) copied
    in and back out, each word once, nothing past a span written."""
    from epcomm.backends.graphed import GRAPH_BYTES, graphable, span_table
    assert span_table([5, 0, 2], 4) == ([(5, 0), (0, 2), (2, 2)], 3)
    assert graphable([GRAPH_BYTES - 16, 16]) and not graphable([GRAPH_BYTES, 16])
    assert not graphable([1024, 6])  # (copies move whole int32 words)
    fixed_a, fixed_b = torch.zeros(8, dtype=i32, device=DEV), torch.zeros(4, dtype=i32, device=DEV)
    a, b = _t([1, 2, 3, 4, 5, 6, 7, 8], i32), _t([9, 10, 11, 12], i32)
    _copy_spans([(fixed_a, 5), (fixed_b, 2)], [a, b], inward=True, vec=1, block=4)
    assert fixed_a.tolist() == [1, 2, 3, 4, 5, 0, 0, 0] and fixed_b.tolist() == [9, 10, 0, 0]
    # a call's spans shorter than the fixed buffers: the rest of each is left as it was
    _copy_spans([(fixed_a, 5), (fixed_b, 2)], [b, a], inward=True, vec=1, block=4,
                words=[3, 0])
    assert fixed_a.tolist() == [9, 10, 11, 4, 5, 0, 0, 0] and fixed_b.tolist() == [9, 10, 0, 0]

    gen = torch.Generator().manual_seed(5)
    lengths = [4 * 37, 0, 4 * 5, 4 * 64]
    fixed = [torch.zeros(n + 4, dtype=i32, device=DEV) for n in lengths]
    inputs = [torch.randint(-2**31, 2**31 - 1, (n + 4,), dtype=i32, generator=gen).to(DEV)
              for n in lengths]
    _copy_spans(list(zip(fixed, lengths)), inputs, inward=True, vec=4, block=32)
    outputs = [torch.full((n + 4,), 7, dtype=i32, device=DEV) for n in lengths]
    _copy_spans(list(zip(fixed, lengths)), outputs, inward=False, vec=4, block=32)
    for n, src, kept, out in zip(lengths, inputs, fixed, outputs):
        assert torch.equal(kept[:n], src[:n]) and torch.equal(out[:n], src[:n]), n
        assert kept[n:].eq(0).all() and out[n:].eq(7).all(), n
