"""Every path a framework calls, at EP=1 in one process, beside its baselines from the same run.

`python -m epcomm bench` runs this after its multi-rank cases (on a GPU by default; `--paths`
asks for it on CPU too, where only the collective backend runs, over gloo). One rank, so the
figures are each path's own cost with no peer to wait for: the fixed costs that decode-size
batches pay and the passes around the all-to-all that the collective backend adds.

Paths, for each token count and layout (hidden, top-k and experts of `--configs`' last entry
on a GPU, a small shape on CPU): dispatch sync-free, dispatch with `do_cpu_sync=True`, combine;
on CUDA also a CUDA-graph replay of sync-free dispatch + combine. Backends: symmetric (CUDA)
and collective (NCCL on CUDA, gloo on CPU). On CUDA, for up to 256 tokens, also V1's
low-latency mode (`legacy.Buffer.low_latency_*`, FP8 dispatch, bf16 combine, the symmetric
transport): dispatch, combine and the pair replayed in CUDA graphs, and the pair eager, with
the copy time of the bytes the pair moves as its floor.

Baselines, same data and run:
- `copy x`: a device copy of the tokens (the memory roofline of moving them once);
- `a2a x`: `all_to_all_single` of the tokens' bytes on the same process group;
- `a2a + copy out`: the collective backend's floor, the all-to-all of the bytes a call must
  send plus one copy of the bytes it writes (the dispatch's output rows, the combine's tokens);
- `torch permute` (expand): argsort of the expert ids, `index_select` of the rows (dispatch)
  and `index_add_` back into fp32 tokens (combine), as a plain-torch MoE layer would.

Each figure is the mean of back-to-back calls between two synchronizations (CUDA events on a
GPU), after warm-up: for the synchronizing dispatch that includes its host round trip. A path's
row also gives the host time per call of the same loop (until its calls return): about the
figure where the host bounds the path, less where the device does. The synchronizing
dispatch's goal on a GPU is set against `sync-free, then wait`: the sync-free call followed by
the host's wait for its stream, the least a call that hands counts to the host can cost (back
to back, a sync-free call's launch overlaps the previous call's kernels; a synchronizing one
cannot).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["PathRow", "run_paths", "shared_replays", "shared_rows", "low_latency_pair",
           "low_latency_rows", "format_paths", "plot_paths", "example", "copy_us", "time_us",
           "time_calls"]


@dataclass
class PathRow:
    """One timed path or baseline: `what` (e.g. "symmetric dispatch sync-free"), tokens per
    rank, layout ("compact", "expand" or "" for a baseline of the tokens), microseconds per
    call, and `floor_us` / `goal` where the path has one (None otherwise); `host_us`, for a
    path's own calls, the host time per call of the same loop (the time for the calls to
    return): about `us` where the host bounds the path, less where the device does."""

    what: str
    tokens: int
    layout: str
    us: float
    floor_us: Optional[float] = None
    goal: Optional[str] = None
    host_us: Optional[float] = None


def time_calls(fn: Callable[[], object], device: torch.device, iters: int,
               warmup: int = 3) -> tuple[float, float]:
    """Mean microseconds per call of `fn`, back to back after `warmup` calls, and the host's
    microseconds per call in the same loop (until the last call returns; on CPU the same)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        start_s = time.perf_counter()
        for _ in range(iters):
            fn()
        host_s = time.perf_counter() - start_s
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) * 1e3 / iters, host_s * 1e6 / iters
    start_s = time.perf_counter()
    for _ in range(iters):
        fn()
    us = (time.perf_counter() - start_s) * 1e6 / iters
    return us, us


def time_us(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Mean microseconds per call of `fn`, back to back after `warmup` calls."""
    return time_calls(fn, device, iters, warmup)[0]


def example(tokens: int, hidden: int, topk: int, experts: int, device: torch.device,
             seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] bf16, top-k ids [T, K] int64 (distinct per token, uniform), weights [T, K]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
    weights = torch.rand(tokens, topk, generator=gen)
    return x.to(device), idx.to(device), weights.to(device)


def copy_us(nbytes: int, device: torch.device, iters: int) -> float:
    """Microseconds of a copy of `nbytes` bytes on `device` (reads and writes `nbytes` each)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return time_us(lambda: dst.copy_(src), device, iters)


def _baselines(x: torch.Tensor, idx: torch.Tensor, group, iters: int) -> dict:
    """Microseconds of the baselines of one token count (see the module docstring), and the
    helpers that time a copy and an all-to-all of n bytes."""
    device = x.device

    def copy_of(nbytes: int) -> float:
        return copy_us(nbytes, device, iters)

    def a2a_us(nbytes: int) -> float:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        return time_us(lambda: dist.all_to_all_single(dst, src, group=group), device, iters)

    tokens, topk = idx.shape
    flat = idx.flatten()

    def permute():
        order = torch.argsort(flat, stable=True)
        return x.index_select(0, order // topk)

    rows = permute()
    source = torch.argsort(flat, stable=True) // topk

    def unpermute():
        out = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=device)
        return out.index_add_(0, source, rows.float()).to(torch.bfloat16)

    nbytes = x.numel() * x.element_size()
    return dict(copy=copy_of(nbytes), a2a=a2a_us(nbytes), copy_us=copy_of, a2a_us=a2a_us,
                permute=time_us(permute, device, iters),
                unpermute=time_us(unpermute, device, iters))


def _paths_of(buffer, backend: str, x, idx, weights, num_experts: int, expand: bool,
              iters: int, base: dict, goals: bool) -> list[PathRow]:
    """The rows of one buffer, token count and layout."""
    device, tokens = x.device, x.shape[0]
    layout = "expand" if expand else "compact"
    row_bytes = x.shape[1] * x.element_size()
    state = {}

    def dispatch(sync: bool):
        state["out"] = buffer.dispatch(x, idx, weights, num_experts=num_experts,
                                       do_cpu_sync=sync, do_expand=expand)

    def combine():
        recv_x, _, recv_w, handle, _ = state["out"]
        buffer.combine(recv_x, handle, topk_weights=recv_w)

    def dispatch_and_wait():
        dispatch(False)
        torch.cuda.current_stream(device).synchronize()

    free, free_host = time_calls(lambda: dispatch(False), device, iters)
    comb, comb_host = time_calls(combine, device, iters)
    sync, sync_host = time_calls(lambda: dispatch(True), device, iters)
    waited = time_us(dispatch_and_wait, device, iters) if device.type == "cuda" else None
    out_rows = state["out"][0].shape[0]  # the synchronizing call's exact rows
    floor = dispatch_floor = combine_floor = None
    if backend == "collective":
        dispatch_floor = base["a2a"] + base["copy_us"](out_rows * row_bytes)
        combine_floor = base["a2a_us"](out_rows * row_bytes) + base["copy"]
    rows = [
        PathRow(f"{backend} dispatch sync-free", tokens, layout, free, dispatch_floor,
                "<= 1.5x floor" if dispatch_floor else None, free_host),
        PathRow(f"{backend} dispatch do_cpu_sync", tokens, layout, sync,
                waited + 25.0 if goals and waited is not None else dispatch_floor,
                "<= sync-free + wait + 25 us" if goals and waited is not None else
                ("<= 1.5x floor" if dispatch_floor else None), sync_host),
        PathRow(f"{backend} combine", tokens, layout, comb, combine_floor,
                "<= 1.5x floor" if combine_floor else None, comb_host),
    ]
    if waited is not None:
        rows.insert(1, PathRow(f"{backend} dispatch sync-free, then wait", tokens, layout,
                               waited))
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        dispatch(False)
        combine()
        torch.cuda.synchronize(device)
        with torch.cuda.graph(graph):
            dispatch(False)
            combine()
        replay, replay_host = time_calls(graph.replay, device, iters)
        goal = None
        if goals and tokens <= 128:
            floor, goal = (40.0, "<= 40 us") if expand else (25.0, "<= 25 us")
        rows.append(PathRow(f"{backend} graph replay dispatch+combine", tokens, layout, replay,
                            floor, goal, replay_host))
    return rows


def low_latency_pair(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                     num_experts: int, **options) -> tuple:
    """V1's low-latency mode on one rank (symmetric transport) for these tokens, with
    `num_max_dispatch_tokens_per_rank` M = max(T, 128), as decode servers set it, and random
    expert outputs [E, M, H] bf16: (buffer, M, dispatch, combine), where `dispatch()` is the
    FP8 dispatch and `combine()` combines the last dispatch's handle. `options` go to the
    buffer (`explicitly_destroy=True`, ...)."""
    from .legacy import Buffer as LegacyBuffer
    tokens, hidden = x.shape
    M = max(tokens, 128)
    buffer = LegacyBuffer(dist.group.WORLD, num_rdma_bytes=LegacyBuffer.
                          get_low_latency_rdma_size_hint(M, hidden, 1, num_experts),
                          low_latency_mode=True, backend="symmetric", **options)
    out = torch.randn(num_experts, M, hidden, device=x.device).to(torch.bfloat16)
    state = {}

    def dispatch():
        state["handle"] = buffer.low_latency_dispatch(x, idx, M, num_experts, use_fp8=True)[2]

    def combine():
        buffer.low_latency_combine(out, idx, weights, state["handle"])

    return buffer, M, dispatch, combine


def low_latency_rows(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                     num_experts: int, iters: int, goals: bool) -> list[PathRow]:
    """V1's low-latency dispatch (FP8) and combine of these tokens at EP=1
    (`low_latency_pair`); the floor: a copy of the bytes the pair reads and writes with every
    row through the heap (x read; FP8 rows and scales written and read in staging, written to
    the expert-major output; K bf16 rows per token read, written, read back in combine; the
    output written)."""
    from .testing.launch import capture_graph
    tokens, hidden = x.shape
    topk = idx.shape[1]
    buffer, _, dispatch, combine = low_latency_pair(x, idx, weights, num_experts)

    def both():
        dispatch()
        combine()

    def replay_us(step) -> float:
        return time_us(capture_graph(step)[0].replay, x.device, iters)

    eager = time_us(both, x.device, iters)
    pair = replay_us(both)
    alone_d = replay_us(lambda: (dispatch(), dispatch())) / 2
    alone_c = replay_us(lambda: (combine(), combine())) / 2
    buffer.low_latency_check_errors()
    routed, fp8_row = tokens * topk, hidden + hidden // 32
    nbytes = tokens * hidden * 2 + 2 * tokens * fp8_row + routed * fp8_row \
        + 3 * routed * hidden * 2 + tokens * hidden * 2
    floor = copy_us(nbytes // 2, x.device, iters)  # a copy of n bytes reads n and writes n
    goal = goals and tokens == 128
    return [PathRow("low-latency dispatch (fp8) graph replay", tokens, "ll", alone_d),
            PathRow("low-latency combine graph replay", tokens, "ll", alone_c),
            PathRow("low-latency dispatch+combine graph replay", tokens, "ll", pair,
                    20.0 if goal else floor, "<= 20 us" if goal else "copy of the bytes"),
            PathRow("low-latency dispatch+combine eager", tokens, "ll", eager, floor,
                    "copy of the bytes")]


def _rank_paths(tokens_list: Sequence[int], hidden: int, topk: int, experts: int,
                backends: Sequence[str], iters: int, seed: int) -> list[dict]:
    """Runs in a one-rank process group: every row, as dicts."""
    from .buffer import Buffer
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    group = dist.group.WORLD
    rows: list[PathRow] = []
    for tokens in tokens_list:
        x, idx, weights = example(tokens, hidden, topk, experts, device, seed)
        base = _baselines(x, idx, group, iters)
        rows += [PathRow("copy x", tokens, "", base["copy"]),
                 PathRow("a2a x", tokens, "", base["a2a"]),
                 PathRow("torch permute (argsort + index_select)", tokens, "expand",
                         base["permute"]),
                 PathRow("torch unpermute (index_add_)", tokens, "expand", base["unpermute"])]
        goals = (hidden, topk, experts) == (7168, 8, 256)
        for backend in backends:
            buffer = Buffer(group, tokens, hidden, topk, backend=backend)
            for expand in (False, True):
                rows += _paths_of(buffer, backend, x, idx, weights, experts, expand, iters,
                                  base, goals)
            buffer.destroy()
        if device.type == "cuda" and tokens <= 256:
            rows += low_latency_rows(x, idx, weights, experts, iters, goals)
    return [asdict(row) for row in rows]


def shared_replays(tokens: int, hidden: int, topk: int, experts: int, iters: int = 50,
                   seed: int = 0) -> dict[str, float]:
    """Runs in every process of a group whose processes share one GPU (gloo, CUDA IPC): a
    symmetric `Buffer`, then per layout a CUDA graph of sync-free dispatch + combine of this
    process's tokens, replayed `iters` times back to back by every process at once.
    Returns {"compact": us, "expand": us}: the median over the processes of their mean us
    per replay (every process gets the same figures)."""
    from .buffer import Buffer
    from .testing.launch import capture_graph
    device = torch.device("cuda", torch.cuda.current_device())
    buffer = Buffer(dist.group.WORLD, tokens, hidden, topk, backend="symmetric")
    x, idx, weights = example(tokens, hidden, topk, experts, device, seed + dist.get_rank())
    figures = {}
    for layout in ("compact", "expand"):
        def pair():
            out = buffer.dispatch(x, idx, weights, num_experts=experts, do_cpu_sync=False,
                                  do_expand=layout == "expand")
            buffer.combine(out[0], out[3], topk_weights=out[2])
            return out
        graph, _ = capture_graph(pair)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize(device)
        dist.barrier()  # (every process's graph is ready: they replay at once)
        mine = time_us(graph.replay, device, iters, warmup=0)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        figures[layout] = sorted(every)[len(every) // 2]
        del graph
    buffer.destroy()
    return figures


def shared_rows(processes: int, tokens: int, hidden: int, topk: int, experts: int,
                rows: Sequence[dict], seed: int = 0, timeout_s: float = 600.0) -> list[dict]:
    """`processes` processes sharing the GPU, each replaying its graph of dispatch + combine
    (`shared_replays`), as rows beside `processes` x the EP=1 replay of the same token count
    in `rows` (`run_paths`' rows; its floor, the goal being no slower than that)."""
    from .testing.launch import run_local_ranks
    figures = run_local_ranks(shared_replays, processes, tokens, hidden, topk, experts, 50,
                              seed, timeout_s=timeout_s)[0]
    single = {row["layout"]: row["us"] for row in rows if row["tokens"] == tokens
              and row["what"] == "symmetric graph replay dispatch+combine"}
    return [asdict(PathRow(
        f"symmetric graph replay dispatch+combine, {processes} processes sharing the GPU",
        tokens, layout, us, processes * single[layout] if layout in single else None,
        f"<= {processes}x EP=1")) for layout, us in figures.items()]


def run_paths(tokens_list: Sequence[int], hidden: int, topk: int, experts: int,
              iters: int = 20, seed: int = 0, timeout_s: float = 600.0) -> list[dict]:
    """Every path at EP=1 in a fresh one-rank process (NCCL on a GPU, gloo on CPU): rows as
    dicts (`PathRow`'s fields)."""
    from .testing.launch import run_local_ranks
    cuda = torch.cuda.is_available()
    backends = ("symmetric", "collective") if cuda else ("collective",)
    return run_local_ranks(_rank_paths, 1, list(tokens_list), hidden, topk, experts, backends,
                           iters, seed, pg_backend="nccl" if cuda else "gloo",
                           timeout_s=timeout_s)[0]


def format_paths(rows: Sequence[dict]) -> str:
    """The rows as one markdown table: us per call, the floor or goal figure, their ratio, the
    host us per call where timed."""
    lines = ["| path | tokens | layout | us | floor / goal us | ratio | goal | host us |",
             "|---|---:|---|---:|---:|---:|---|---:|"]
    for row in rows:
        floor, host = row["floor_us"], row.get("host_us")
        ratio = f"{row['us'] / floor:.2f}" if floor else ""
        lines.append(f"| {row['what']} | {row['tokens']} | {row['layout']} | {row['us']:.1f} | "
                     f"{'' if floor is None else f'{floor:.1f}'} | {ratio} | "
                     f"{row['goal'] or ''} | {'' if host is None else f'{host:.1f}'} |")
    return "\n".join(lines)


def plot_paths(rows: Sequence[dict], path: str) -> None:
    """Latency against tokens per rank, one line per path and layout (log-log), to `path`
    (matplotlib: `pip install "epcomm[plot]"`)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError('--plot needs matplotlib: pip install "epcomm[plot]"') from exc
    series: dict = {}
    for row in rows:
        label = f"{row['what']} ({row['layout']})" if row["layout"] else row["what"]
        series.setdefault(label, []).append((row["tokens"], row["us"]))
    figure, axes = plt.subplots(figsize=(10, 6))
    for label, points in sorted(series.items()):
        points.sort()
        style = "--" if not label.startswith(("symmetric", "collective")) else "-"
        axes.plot([p[0] for p in points], [p[1] for p in points], style, marker="o",
                  label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("tokens per rank")
    axes.set_ylabel("us per call")
    axes.set_title("epcomm paths at EP=1 (dashed: baselines)")
    axes.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
