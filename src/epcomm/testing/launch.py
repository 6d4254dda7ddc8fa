"""Start N local ranks, one process each, with a process group (tests, benchmarks, examples).

`run_local_ranks(fn, world_size, *args)` starts processes that each call `fn(*args)` after
`torch.distributed` is initialised (gloo by default, bootstrapped over a TCP store on
127.0.0.1), and re-raises the first rank's failure in the parent.
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


_RENDEZVOUS_S = 60.0
# Ranks start from a fork server that has imported torch once (0.08 s a start on a 2-core
# machine, against 1.4 s for a fresh interpreter); "spawn" where there is none. The server is
# a fresh process (it never inherits an initialised CUDA context); it takes the environment of
# the first call: set variables inside `fn`, not in the parent between calls.
_START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, pg_backend: str, timeout_s: float,
               fn: Callable[..., Any], args: tuple, result_queue) -> None:
    # Keep CPU ranks from oversubscribing small machines.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # The rendezvous waits for every rank to start (slow on a loaded machine); the group's own
    # timeout, which may be short on purpose, applies to its collectives only.
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                          timeout=timedelta(seconds=max(timeout_s, _RENDEZVOUS_S)))
    dist.init_process_group(pg_backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(*args)
        result_queue.put((rank, "ok", result))
    except BaseException:
        result_queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_local_ranks(fn: Callable[..., Any], world_size: int, *args: Any, pg_backend: str = "gloo",
                    timeout_s: float = 120.0, deadline_s: float = 900.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` local ranks; return each rank's result, in rank order.

    `fn` must be a module-level function (it is pickled to the new processes). A failure on any
    rank raises RuntimeError carrying that rank's traceback. `timeout_s` is the process group's
    timeout; after `deadline_s` in all, the ranks are killed and RuntimeError is raised.
    """
    context = mp.get_context(_START_METHOD)
    if _START_METHOD == "forkserver":
        context.set_forkserver_preload(["torch", "torch.distributed"])
    queue = context.SimpleQueue()
    port = free_port()
    processes = [context.Process(target=_rank_main, daemon=False,
                                 args=(rank, world_size, port, pg_backend, timeout_s, fn, args, queue))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + deadline_s
    while len(results) + len(failures) < world_size:
        if queue.empty():
            if not any(p.is_alive() for p in processes) and queue.empty():
                break
            if time.monotonic() > deadline:
                failures.append(f"ranks still running after {deadline_s:.0f}s (deadline)")
                break
            time.sleep(0.02)
            continue
        rank, status, payload = queue.get()
        if status == "ok":
            results[rank] = payload
        else:
            failures.append(f"rank {rank}:\n{payload}")
            break
    if failures:  # the other ranks would wait for the failed one until their timeout
        for process in processes:
            if process.is_alive():
                process.terminate()
    for process in processes:
        process.join(timeout=timeout_s)
        if process.is_alive():
            process.kill()
    if failures:
        raise RuntimeError("a rank failed:\n" + "\n".join(failures))
    if len(results) < world_size:
        codes = [p.exitcode for p in processes]
        raise RuntimeError(f"ranks exited without a result (exit codes {codes})")
    return [results[rank] for rank in range(world_size)]


def run_seeded(fn: Callable[..., Any], world_size: int, seed: int, *args: Any,
               **kwargs: Any) -> list[Any]:
    """`run_local_ranks(fn, world_size, *args, **kwargs)` whose failure names `seed`, so that
    `EPCOMM_TEST_SEED=seed` replays it."""
    try:
        return run_local_ranks(fn, world_size, *args, **kwargs)
    except RuntimeError as exc:
        raise RuntimeError(f"EPCOMM_TEST_SEED={seed}: {exc}") from None


def capture_graph(step: Callable[[], Any], warmup: int = 2) -> tuple["torch.cuda.CUDAGraph", Any]:
    """`step()` run `warmup` times on a side stream (as PyTorch's graph capture wants), then
    captured once in a CUDA graph: (the graph, what the captured `step()` returned, whose
    tensors each `graph.replay()` refills)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs
