"""Check a `Buffer` against the independent reference, bitwise (shared by tests and benchmarks).

`check_round_trip(buffer, case)` dispatches and combines one `Case` through the buffer and
through `epcomm.testing.reference`, and raises `AssertionError` naming the first field that differs.
The reference runs on CPU copies when the group is gloo (gloo moves only CPU tensors), else on
the tensors' own device.

`assert_equal(name, got, want)` is the one comparison, here and in the tests: bitwise
(`bitwise_equal`: `torch.equal` on the raw bits, so NaN payloads and signed zeros count), naming
the field and showing got and want on failure. `assert_filled` (a tensor holds one value),
`assert_fields_equal` (dicts of fields, e.g. `handle_fields`) and `assert_same_dispatch` (two
dispatch results, e.g. two backends) are built on it.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..buffer import Buffer
from ..fp8 import per_token_cast_to_fp8
from ..layout import align_up, expand_capacity
from .reference import ReferenceDispatch, reference_combine, reference_dispatch

ROUTINGS = ("balanced", "masked", "skewed", "same_rank")


def make_routing(routing: str, num_tokens: int, num_topk: int, num_experts: int, num_ranks: int,
                 generator: torch.Generator) -> torch.Tensor:
    """[T, K] int64 expert ids with distinct ids per row.

    balanced: K distinct experts drawn uniformly. masked: balanced with about a third of the
    slots -1 (some rows all -1). skewed: only experts of rank 0 (other ranks receive nothing).
    same_rank: slots 0 and 1 pick two experts of one rank (needs E_l >= 2).
    """
    num_local = num_experts // num_ranks
    pool = num_local if routing == "skewed" else num_experts
    k_real = min(num_topk, pool)
    scores = torch.rand(num_tokens, pool, generator=generator)
    idx = torch.full((num_tokens, num_topk), -1, dtype=torch.long)
    idx[:, :k_real] = scores.argsort(dim=1)[:, :k_real]
    if routing == "masked":
        drop = torch.rand(num_tokens, num_topk, generator=generator) < 0.35
        drop[: max(1, num_tokens // 8)] = True  # some tokens go nowhere
        idx[drop] = -1
    elif routing == "same_rank" and num_local >= 2 and num_topk >= 2:
        ranks = torch.randint(0, num_ranks, (num_tokens,), generator=generator)
        first = ranks * num_local + torch.randint(0, num_local, (num_tokens,), generator=generator)
        second = ranks * num_local + (first - ranks * num_local + 1) % num_local
        rest = idx[:, 2:]
        clash = (rest == first[:, None]) | (rest == second[:, None])
        idx[:, 2:] = torch.where(clash, -1, rest)
        idx[:, 0], idx[:, 1] = first, second
    return idx


@dataclass
class Case:
    """One dispatch + combine. Inputs are drawn by `make_inputs` from the case's seed."""

    routing: str = "balanced"
    tokens: str = "uneven"      # "full": T = M; "uneven": T = M - rank; "empty_last": also T = 0 on the last rank
    num_experts: int = 8
    expert_alignment: int = 1
    do_expand: bool = False
    do_cpu_sync: bool = True
    do_zero_padding: bool = False
    fp8: bool = False
    with_weights: bool = True
    num_bias: int = 0
    check_cached: bool = True
    async_with_compute_stream: bool = False
    allocate_on_comm_stream: bool = False
    use_previous_event: bool = False  # pass `Buffer.capture()` (needs allocate_on_comm_stream)
    memory_form: str = "plain"  # of every tensor passed to a call: see `in_memory_form`
    seed: int = 0

    def stream_kwargs(self) -> dict:
        """Stream options of one call; a fresh previous event is captured for each call."""
        return dict(async_with_compute_stream=self.async_with_compute_stream,
                    allocate_on_comm_stream=self.allocate_on_comm_stream,
                    previous_event=Buffer.capture() if self.use_previous_event else None)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor (on the CPU), for a `torch.equal` that is exact for every dtype:
    NaN payloads and the sign of zero count, and a NaN equals the same NaN."""
    size = tensor.element_size()
    return tensor.detach().contiguous().view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]).cpu()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor of any layout (a column-major or otherwise non-contiguous view
    too), as a flat uint8 tensor of a contiguous copy, in row-major element order."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_tma_aligned_col_major(name: str, scales: torch.Tensor) -> None:
    """`scales` [N, S] has the layout of DeepEP's `use_tma_aligned_col_major_sf=True`: column
    major, strides (1, align(N, 16 bytes / element size)) (a 16-byte aligned column stride)."""
    rows = scales.shape[0]
    per_line = 16 // scales.element_size()
    want = (1, -(-rows // per_line) * per_line)
    assert scales.dim() == 2 and scales.stride() == want, \
        f"{name}: strides {scales.stride()} (shape {tuple(scales.shape)}), want {want}"


def bitwise_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether `got` and `want` have the same shape, the same element size and the same bits
    (no dtype cast: compare bf16 with bf16). The one tensor comparison of `assert_equal`; use it
    directly only where a difference is an outcome to count, not a failure (a negative control).

    Example: bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0])) is False, and
    bitwise_equal(torch.tensor([float("nan")]), torch.tensor([float("nan")])) is True."""
    return got.shape == want.shape and got.element_size() == want.element_size() and \
        torch.equal(_bits(got), _bits(want))


def _shown(tensor: torch.Tensor) -> str:
    return str(tensor.detach().cpu().tolist() if tensor.dtype != torch.float8_e4m3fn
               else tensor.detach().cpu().float().tolist())


def assert_equal(name: str, got, want, *, check_dtype: bool = False) -> None:
    """Assert `got` equals `want` bitwise, naming the field `name` and showing got and want on
    failure (the differing elements; whole tensors when small).

    Tensors: same shape and the same bits after casting `want` to `got`'s dtype, or, with
    `check_dtype`, the same dtype first and no cast. `want=None`: `got` must be None. Tuples and
    lists of tensors (FP8 rows and scales): the same length and each part equal (`name[i]`).
    Anything else (counts, lists of ints, flags): `==`."""
    if want is None or got is None:
        assert got is None and want is None, f"{name}: got {_brief(got)}, want {_brief(want)}"
        return
    if isinstance(want, (tuple, list)) and any(isinstance(w, torch.Tensor) for w in want):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), \
            f"{name}: got {_brief(got)}, want {len(want)} parts"
        for index, (g, w) in enumerate(zip(got, want)):
            assert_equal(f"{name}[{index}]", g, w, check_dtype=check_dtype)
        return
    if not isinstance(want, torch.Tensor):
        assert not isinstance(got, torch.Tensor) and got == want, f"{name}: got {got!r}, want {want!r}"
        return
    assert isinstance(got, torch.Tensor), f"{name}: got {_brief(got)}, want a tensor"
    if check_dtype:
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    cast = want.to(got.dtype)
    if bitwise_equal(got, cast):
        return
    diff = _bits(got) != _bits(cast)
    where = diff.nonzero()[:5]
    at = [tuple(i) for i in where.tolist()]
    got_at = [_shown(got.detach().cpu()[tuple(i)]) for i in where.tolist()]
    want_at = [_shown(cast.detach().cpu()[tuple(i)]) for i in where.tolist()]
    message = (f"{name}: {int(diff.sum())} of {diff.numel()} elements differ; first at {at}: "
               f"got {', '.join(got_at)}, want {', '.join(want_at)}")
    if got.numel() <= 64:
        message += f"\n got {_shown(got)}\nwant {_shown(cast)}"
    raise AssertionError(message)


def _brief(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {value.dtype} {tuple(value.shape)}"
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return f"{type(value).__name__} of {len(value)} ({', '.join(_brief(v) for v in value)})"
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def assert_filled(name: str, got: torch.Tensor, value) -> None:
    """Every element of `got` is `value`, bitwise (`assert_equal` against a filled tensor):
    the contract's rows past a valid prefix (-1 ids, 0 weights, zero padding)."""
    assert_equal(name, got, torch.full_like(got, value), check_dtype=True)


HANDLE_TENSORS = ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                  "num_unaligned_recv_tokens_per_expert", "recv_src_metadata")
HANDLE_VALUES = ("num_recv_tokens_per_expert_list", "num_experts", "expert_alignment",
                 "num_max_tokens_per_rank", "do_expand", "do_cpu_sync", "num_recv_tokens",
                 "num_expanded_tokens")


def handle_fields(handle) -> dict:
    """The public fields of an `EPHandle` that two dispatches of the same routing must agree
    on (its routing tensors and counts; not `topk_idx`, which is the caller's input), by name."""
    return {name: getattr(handle, name) for name in HANDLE_TENSORS + HANDLE_VALUES}


def assert_fields_equal(name: str, got: dict, want: dict, *, check_dtype: bool = True) -> None:
    """Two dicts of fields (e.g. `handle_fields`) have the same keys and `assert_equal` values
    (named `name field`)."""
    assert got.keys() == want.keys(), f"{name}: fields {sorted(got)} != {sorted(want)}"
    for field_name, value in want.items():
        assert_equal(f"{name} {field_name}", got[field_name], value, check_dtype=check_dtype)


def specified_rows(handle, zero_padding: bool):
    """The rows of a dispatch's `recv_x` whose contents the contract specifies, as an index:
    all of them with `do_zero_padding`; else the valid compact prefix, or the expand rows that
    hold a (token, slot) pair (the alignment gaps and the sync-free tail are left open)."""
    if zero_padding:
        return slice(None)
    if handle.do_expand:
        keep = torch.zeros(handle.num_expanded_tokens, dtype=torch.bool)
        rows = handle.recv_src_metadata[:, 2:].flatten().long().cpu()
        keep[rows[rows >= 0]] = True
        return keep.to(handle.recv_src_metadata.device)
    return slice(0, int(handle.psum_num_recv_tokens_per_scaleup_rank[-1]))


def assert_same_dispatch(name: str, got, want, zero_padding: bool = False) -> None:
    """Two `Buffer.dispatch` results of the same call (e.g. two backends) agree bitwise: every
    `handle_fields` entry, `recv_topk_idx`, `recv_topk_weights` (dtypes included) and the
    `specified_rows` of `recv_x` (each part of an FP8 tuple)."""
    (gx, gi, gw, gh), (wx, wi, ww, wh) = got[:4], want[:4]
    assert_fields_equal(f"{name} handle", handle_fields(gh), handle_fields(wh))
    assert_equal(f"{name} recv_topk_idx", gi, wi, check_dtype=True)
    assert_equal(f"{name} recv_topk_weights", gw, ww, check_dtype=True)
    keep = specified_rows(wh, zero_padding)
    parts = lambda x: tuple(x) if isinstance(x, tuple) else (x,)  # noqa: E731
    assert len(parts(gx)) == len(parts(wx)), f"{name} recv_x: {len(parts(gx))} parts, want {len(parts(wx))}"
    for index, (g, w) in enumerate(zip(parts(gx), parts(wx))):
        assert g.shape == w.shape, f"{name} recv_x[{index}]: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert_equal(f"{name} recv_x[{index}]", g[keep], w[keep], check_dtype=True)


def num_tokens_of(case: Case, rank: int, num_ranks: int, max_tokens: int) -> int:
    if case.tokens == "full":
        return max_tokens
    if case.tokens == "empty_last" and rank == num_ranks - 1:
        return 0
    return max(0, max_tokens - rank)


def make_inputs(buffer, case: Case):
    """Random inputs for this rank: (x, topk_idx, topk_weights, generator for later draws)."""
    rank, num_ranks = buffer.rank, buffer.num_ranks
    gen = torch.Generator().manual_seed(case.seed * 1000 + rank)
    num_tokens = num_tokens_of(case, rank, num_ranks, buffer.num_max_tokens_per_rank)
    topk_idx = make_routing(case.routing, num_tokens, buffer.num_topk, case.num_experts,
                            num_ranks, gen)
    x = torch.randn(num_tokens, buffer.hidden, generator=gen).to(torch.bfloat16)
    weights = torch.rand(num_tokens, buffer.num_topk, generator=gen) if case.with_weights else None
    x = per_token_cast_to_fp8(x) if case.fp8 else x
    x, topk_idx, weights = _placed(case, buffer.device, x, topk_idx, weights)
    return x, topk_idx, weights, gen


def _placed(case: Case, dev, *tensors) -> list:
    """`tensors` (tensors, tuples of them or None) moved to `dev` in the case's
    `memory_form`."""

    def place(tensor):
        if tensor is None:
            return None
        if isinstance(tensor, tuple):
            return tuple(place(part) for part in tensor)
        return in_memory_form(tensor.to(dev), case.memory_form)

    return [place(tensor) for tensor in tensors]


def in_memory_form(tensor: torch.Tensor, form: str) -> torch.Tensor:
    """The values of `tensor` laid out as `form`: "plain" (itself), "strided" (not contiguous:
    every other element of a larger allocation) or "offset" (contiguous, starting one element
    past a 16-byte boundary), to drive a call off its fast paths.

    Example: in_memory_form(torch.zeros(2, 3), "offset").data_ptr() % 16 == 4, and
    in_memory_form(torch.zeros(2, 3), "strided").stride() == (6, 2)."""
    if form == "plain":
        return tensor
    if form == "strided":
        return torch.stack([tensor, tensor], dim=-1)[..., 0]
    if form == "offset":
        spare = 16 // tensor.element_size()
        base = torch.empty(tensor.numel() + spare, dtype=tensor.dtype, device=tensor.device)
        start = 1 + (-base.data_ptr() // tensor.element_size()) % spare
        return base[start:start + tensor.numel()].view_as(tensor).copy_(tensor)
    raise ValueError(f"form must be plain, strided or offset, got {form!r}")


def _reference_group(group):
    return dist.get_backend(group) == "gloo"


def _host(value, to_cpu: bool):
    if value is None or not to_cpu:
        return value
    if isinstance(value, tuple):
        return tuple(v.cpu() for v in value)
    return value.cpu()


def run_reference_dispatch(buffer, case: Case, x, topk_idx: torch.Tensor,
                           topk_weights: Optional[torch.Tensor]) -> ReferenceDispatch:
    """`reference_dispatch` of this rank's inputs for `case` (on host copies under gloo)."""
    to_cpu = _reference_group(buffer.group) and buffer.device.type != "cpu"
    return reference_dispatch(_host(x, to_cpu), _host(topk_idx, to_cpu), _host(topk_weights, to_cpu),
                              case.num_experts, buffer.num_max_tokens_per_rank, buffer.group,
                              case.expert_alignment, case.do_expand)


def check_dispatch_outputs(buffer, case: Case, outputs, ref: ReferenceDispatch) -> None:
    """Compare `buffer.dispatch` outputs with the reference (prefix, tails and handle)."""
    recv_x, recv_idx, recv_w, handle = outputs[:4]
    num_ranks, M, K = buffer.num_ranks, handle.num_max_tokens_per_rank, buffer.num_topk
    num_local = case.num_experts // num_ranks
    n = int(ref.src_token.shape[0])
    counts = ref.num_recv_tokens_per_expert
    aligned = (counts + case.expert_alignment - 1) // case.expert_alignment * case.expert_alignment
    parts = recv_x if isinstance(recv_x, tuple) else (recv_x,)
    ref_parts = ref.recv_x if isinstance(ref.recv_x, tuple) else (ref.recv_x,)
    assert len(parts) == len(ref_parts), f"recv_x has {len(parts)} parts, want {len(ref_parts)}"

    assert_equal("psum_num_recv_tokens_per_scaleup_rank", handle.psum_num_recv_tokens_per_scaleup_rank,
                 ref.num_recv_tokens_per_rank.cumsum(0))
    assert_equal("num_unaligned_recv_tokens_per_expert", handle.num_unaligned_recv_tokens_per_expert, counts)
    want_psum = ref.expert_starts + counts if case.do_expand else aligned.cumsum(0)
    assert_equal("psum_num_recv_tokens_per_expert", handle.psum_num_recv_tokens_per_expert, want_psum)
    assert_equal("num_recv_tokens_per_expert_list", handle.num_recv_tokens_per_expert_list,
                 aligned.tolist() if case.do_cpu_sync else None)

    rows = n if case.do_cpu_sync else num_ranks * M
    assert_equal("num_recv_tokens", handle.num_recv_tokens, rows)
    meta = handle.recv_src_metadata
    assert meta.shape == (rows, K + 2), f"recv_src_metadata shape {tuple(meta.shape)}"
    assert_equal("recv_src_metadata[:, 0]", meta[:n, 0], ref.src_token)
    assert_equal("recv_src_metadata[:, 1]", meta[:n, 1], ref.last_slot)
    assert_equal("recv_src_metadata[:, 2:]", meta[:n, 2:], ref.expand_rows)
    assert_filled("recv_src_metadata past the valid prefix", meta[n:], -1)

    if case.do_expand:
        n_e = int(ref.expand_valid.shape[0])
        cap = n_e if case.do_cpu_sync else expand_capacity(num_ranks, M, K, num_local, case.expert_alignment)
        assert_equal("num_expanded_tokens", handle.num_expanded_tokens, cap)
        assert_equal("recv_topk_idx (None in the expand layout)", recv_idx, None)
        valid = ref.expand_valid.to(parts[0].device)
        for index, (got, want) in enumerate(zip(parts, ref_parts)):
            assert got.shape[0] == cap, f"recv_x[{index}] has {got.shape[0]} rows, want {cap}"
            assert_equal(f"recv_x[{index}] expand rows", got[:n_e][valid], want.to(got.device)[valid],
                         check_dtype=True)
            if case.do_zero_padding:
                assert_equal(f"recv_x[{index}] with zero padding", got[:n_e], want)
                assert_filled(f"recv_x[{index}] tail bytes (zero padding)", _bytes(got[n_e:]), 0)
        if ref.recv_topk_weights is not None:
            assert recv_w.shape == (cap,), f"recv_topk_weights shape {tuple(recv_w.shape)}"
            assert_equal("recv_topk_weights (expand)", recv_w[:n_e], ref.recv_topk_weights,
                         check_dtype=True)
            assert_filled("recv_topk_weights tail (expand)", recv_w[n_e:], 0.0)
        else:
            assert_equal("recv_topk_weights (None without topk_weights)", recv_w, None)
    else:
        for index, (got, want) in enumerate(zip(parts, ref_parts)):
            assert got.shape[0] == rows, f"recv_x[{index}] has {got.shape[0]} rows, want {rows}"
            assert_equal(f"recv_x[{index}]", got[:n], want, check_dtype=True)
            if case.do_zero_padding:
                assert_filled(f"recv_x[{index}] tail bytes (zero padding)", _bytes(got[n:]), 0)
        assert recv_idx is not None, "compact layout returns recv_topk_idx"
        assert_equal("recv_topk_idx", recv_idx[:n], ref.recv_topk_idx)
        assert_filled("recv_topk_idx past the valid prefix", recv_idx[n:], -1)
        if ref.recv_topk_weights is not None:
            assert_equal("recv_topk_weights", recv_w[:n], ref.recv_topk_weights, check_dtype=True)
            assert_filled("recv_topk_weights past the valid prefix", recv_w[n:], 0.0)
        else:
            assert_equal("recv_topk_weights (None without topk_weights)", recv_w, None)


def check_round_trip(buffer, case: Case) -> None:
    """Dispatch, (cached dispatch), combine one case; compare everything with the reference."""
    x, topk_idx, weights, gen = make_inputs(buffer, case)
    outputs = buffer.dispatch(x, topk_idx, weights, num_experts=case.num_experts,
                              expert_alignment=case.expert_alignment, do_cpu_sync=case.do_cpu_sync,
                              do_expand=case.do_expand, do_zero_padding=case.do_zero_padding,
                              **case.stream_kwargs())
    outputs[4].current_stream_wait()
    ref = run_reference_dispatch(buffer, case, x, topk_idx, weights)
    check_dispatch_outputs(buffer, case, outputs, ref)
    handle = outputs[3]

    if case.check_cached:
        x2, _, weights2, _ = make_inputs(buffer, Case(**{**case.__dict__, "seed": case.seed + 7919}))
        cached = buffer.dispatch(x2, topk_weights=weights2, handle=handle,
                                 do_zero_padding=case.do_zero_padding, **case.stream_kwargs())
        cached[4].current_stream_wait()
        ref2 = run_reference_dispatch(buffer, case, x2, topk_idx, weights2)
        try:
            check_dispatch_outputs(buffer, case, cached, ref2)
        except AssertionError as exc:
            raise AssertionError(f"cached dispatch: {exc}") from None

    # Expert outputs: random bf16 rows; rows outside the valid prefix hold NaN, which combine
    # must ignore.
    rows = handle.num_output_rows
    ignored = ignored_rows(case, ref, rows)
    # Magnitudes spread over 2^-20..2^20 so that any change of summation order changes bits.
    scale = torch.exp2(torch.randint(-20, 21, (rows, 1), generator=gen).float())
    y = (torch.randn(rows, buffer.hidden, generator=gen) * scale).to(torch.bfloat16)
    y[ignored] = float("nan")
    y_weights = None
    if case.with_weights:
        y_weights = torch.rand((rows,) if case.do_expand else (rows, buffer.num_topk), generator=gen)
        y_weights[ignored] = float("nan")
    num_tokens = topk_idx.shape[0]
    biases = tuple(torch.randn(num_tokens, buffer.hidden, generator=gen).to(torch.bfloat16)
                   for _ in range(case.num_bias))
    check_combine(buffer, case, handle, ref, topk_idx, y, y_weights, biases)


def _num_valid_rows(case: Case, ref: ReferenceDispatch) -> int:
    return int(ref.expand_valid.shape[0]) if case.do_expand else int(ref.src_token.shape[0])


def ignored_rows(case: Case, ref: ReferenceDispatch, rows: int) -> torch.Tensor:
    """[rows] bool (CPU): the rows of a combine input (`rows = handle.num_output_rows`) that
    combine must ignore: past the valid prefix, and the expand layout's alignment gaps."""
    n = min(rows, _num_valid_rows(case, ref))
    ignored = torch.ones(rows, dtype=torch.bool)
    ignored[:n] = ~ref.expand_valid[:n].cpu() if case.do_expand else False
    return ignored


def _first_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """`t[:n]`, zero-padded to n rows when `t` is shorter (a wrong handle, which the dispatch
    check reports; the reference combine is collective and must still run on every rank)."""
    if t.shape[0] >= n:
        return t[:n]
    return torch.cat([t, t.new_zeros((n - t.shape[0],) + tuple(t.shape[1:]))])


def check_combine(buffer, case: Case, handle, ref: ReferenceDispatch, topk_idx: torch.Tensor,
                  y: torch.Tensor, y_weights: Optional[torch.Tensor] = None,
                  biases: tuple = ()) -> None:
    """Combine expert outputs `y` ([handle.num_output_rows, H] bf16, any device; the rows that
    `ignored_rows` marks may hold anything) with `y_weights` and `biases` through `buffer` and
    through the reference (of the dispatch `ref`, routed by this rank's `topk_idx`); assert the
    results are equal. Both combines (collective) run on every rank before any comparison."""
    to_cpu = _reference_group(buffer.group) and buffer.device.type != "cpu"
    dev = buffer.device
    call_y, call_weights, call_biases = _placed(case, dev, y, y_weights, tuple(biases))
    combined, combined_w, event = buffer.combine(
        call_y, handle, topk_weights=call_weights, bias=call_biases or None,
        **case.stream_kwargs())
    event.current_stream_wait()
    n_valid = _num_valid_rows(case, ref)
    ref_dev = "cpu" if to_cpu or dev.type == "cpu" else dev
    want, want_w = reference_combine(
        _first_rows(y, n_valid).to(ref_dev), ref, _host(topk_idx, to_cpu), case.num_experts,
        buffer.group,
        topk_weights=None if y_weights is None else _first_rows(y_weights, n_valid).to(ref_dev),
        bias=tuple(b.to(ref_dev) for b in biases) or None)
    assert_equal("combined_x", combined, want, check_dtype=True)
    assert_equal("combined_topk_weights", combined_w, want_w, check_dtype=True)


def describe(case: Case) -> str:
    flags = [case.routing, "expand" if case.do_expand else "compact", f"a={case.expert_alignment}",
             "sync" if case.do_cpu_sync else "sync-free", "fp8" if case.fp8 else "bf16",
             "w" if case.with_weights else "no-w", f"bias={case.num_bias}", f"tokens={case.tokens}"]
    if case.do_zero_padding:
        flags.append("zero-pad")
    if case.memory_form != "plain":
        flags.append(case.memory_form)
    return " ".join(flags)


__all__ = ["Case", "ROUTINGS", "make_routing", "make_inputs", "check_round_trip",
           "run_reference_dispatch", "check_dispatch_outputs", "ignored_rows", "check_combine",
           "assert_equal", "bitwise_equal", "assert_filled", "assert_tma_aligned_col_major", "handle_fields", "assert_fields_equal",
           "specified_rows", "assert_same_dispatch", "describe", "align_up", "in_memory_form",
           "memory_form_cases", "run_cases"]


def matrix_cases(num_experts: int, seed: int):
    """The test matrix (64 cases): every routing x layout x sync mode x dtype x alignment; token
    counts, weights, biases and zero padding rotate with the index."""
    grid = itertools.product(ROUTINGS, (False, True), (True, False), (False, True), (1, 128))
    for i, (routing, expand, sync, fp8, align) in enumerate(grid):
        yield Case(routing=routing, tokens=("uneven", "full", "empty_last")[i % 3],
                   num_experts=num_experts, expert_alignment=align, do_expand=expand,
                   do_cpu_sync=sync, fp8=fp8, with_weights=i % 4 != 3, num_bias=i % 3,
                   do_zero_padding=i % 5 < 2, seed=seed + i)


def memory_form_cases(num_experts: int, seed: int, quick: bool = False):
    """Calls whose tensors are not contiguous or not 16-byte aligned (`in_memory_form`, every
    tensor of the dispatch, cached dispatch and combine), each form right after a plain call of
    the same shape (a sync-free one prepares that shape): for bf16 and FP8, both layouts and
    both sync modes (24 cases), or with `quick` bf16 compact sync-free and FP8 expand sync
    (6 cases); every other group with an empty last rank (an empty view past an offset)."""
    grid = [(False, False, False), (True, True, True)] if quick else \
        itertools.product((False, True), (False, True), (True, False))
    for i, (fp8, expand, sync) in enumerate(grid):
        for j, form in enumerate(("plain", "strided", "offset")):
            yield Case(num_experts=num_experts, do_expand=expand, do_cpu_sync=sync, fp8=fp8,
                       num_bias=1, memory_form=form, tokens=("uneven", "empty_last")[i % 2],
                       seed=seed + 3 * i + j)


def run_cases(buffer, cases, seed: int) -> int:
    """Each case's round trip through `buffer`, bitwise (collective: all ranks call it); the
    number of cases checked. A failure names the base `seed`, rank and case."""
    count = 0
    for case in cases:
        try:
            check_round_trip(buffer, case)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}, rank {buffer.rank}, {describe(case)}: {exc}") \
                from None
        count += 1
    return count


def run_matrix_cases(buffer, experts_per_rank: int, seed: int) -> int:
    """Every `matrix_cases` round trip through `buffer` (`run_cases`)."""
    return run_cases(buffer, matrix_cases(experts_per_rank * buffer.num_ranks, seed), seed)
