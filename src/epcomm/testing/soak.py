"""Soak: many mixed round trips through one `Buffer`, each bitwise against the reference, with
the process's memory sampled at intervals (a call must keep nothing once its outputs are gone).

`soak(buffer, num_round_trips, seed)` draws one random `verify.Case` per round trip (routing,
token counts with empty ranks, number of experts, alignment, layout, sync mode, BF16 / FP8,
weights, biases, zero padding, cached dispatch, memory forms; on CUDA the stream options) from a
generator seeded alike on every rank, so all ranks make the same calls, and checks it with
`verify.check_round_trip` (a dispatch, a cached dispatch where the case says so, a combine:
two or three calls). Every `report_every` round trips it samples the memory.

Example (one rank):
    >>> import random
    >>> case = random_case(random.Random(3), num_ranks=2, seed=3)
    >>> case.num_experts % 2 == 0 and case.seed == 3
    True
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .verify import ROUTINGS, Case, check_round_trip, describe


def random_case(rng: random.Random, num_ranks: int, seed: int, cuda: bool = False) -> Case:
    """One random round trip for a group of `num_ranks` (E a multiple of it); the same `rng`
    state gives the same case on every rank."""
    expand = rng.random() < 0.5
    stream = cuda and rng.random() < 0.3
    return Case(routing=rng.choice(ROUTINGS),
                tokens=rng.choice(("uneven", "full", "empty_last")),
                num_experts=num_ranks * rng.choice((1, 2, 4)),
                expert_alignment=rng.choice((1, 2, 4, 128)) if expand else rng.choice((1, 4)),
                do_expand=expand,
                do_cpu_sync=rng.random() < 0.5,
                do_zero_padding=rng.random() < 0.3,
                fp8=rng.random() < 0.3,
                with_weights=rng.random() < 0.8,
                num_bias=rng.choice((0, 0, 1, 2)),
                check_cached=rng.random() < 0.4,
                async_with_compute_stream=stream and rng.random() < 0.5,
                allocate_on_comm_stream=stream and rng.random() < 0.5,
                memory_form=rng.choice(("plain",) * 8 + ("strided", "offset")),
                seed=seed)


def resident_mb() -> float:
    """This process's resident memory in MB (Linux `/proc/self/statm`; elsewhere the peak,
    from `resource`)."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class MemorySample:
    """Memory after `round_trips` round trips: host resident MB, CUDA MB allocated (0 on
    CPU), seconds since the start."""

    round_trips: int
    host_mb: float
    cuda_mb: float
    seconds: float


@dataclass
class SoakResult:
    round_trips: int
    calls: int
    samples: list[MemorySample] = field(default_factory=list)

    def growth_mb(self) -> tuple[float, float]:
        """(host, CUDA) MB grown from the first sample after warm-up (the second sample) to the
        last; (0, 0) with fewer than three samples."""
        if len(self.samples) < 3:
            return 0.0, 0.0
        first, last = self.samples[1], self.samples[-1]
        return last.host_mb - first.host_mb, last.cuda_mb - first.cuda_mb


def soak(buffer, num_round_trips: int, seed: int, report_every: int = 500,
         report: Optional[Callable[[MemorySample], None]] = None) -> SoakResult:
    """`num_round_trips` random round trips through `buffer` (every rank calls it with the same
    `seed`), each bitwise against the reference; a failure raises AssertionError naming the
    seed, the round trip and its case. Memory is sampled before the first round trip, every
    `report_every` and after the last (`report` is called with each sample)."""
    rng = random.Random(seed)
    cuda = buffer.device.type == "cuda"
    result = SoakResult(0, 0)
    start = time.monotonic()

    def sample() -> None:
        if cuda:
            torch.cuda.synchronize(buffer.device)
        point = MemorySample(result.round_trips, resident_mb(),
                             torch.cuda.memory_allocated(buffer.device) / 2**20 if cuda else 0.0,
                             time.monotonic() - start)
        result.samples.append(point)
        if report is not None:
            report(point)

    sample()
    for index in range(num_round_trips):
        case = random_case(rng, buffer.num_ranks, seed * 100_003 + index, cuda)
        try:
            check_round_trip(buffer, case)
        except AssertionError as exc:
            raise AssertionError(f"soak seed {seed}, round trip {index}, rank {buffer.rank}, "
                                 f"{describe(case)}: {exc}") from None
        result.round_trips += 1
        result.calls += 3 if case.check_cached else 2
        if result.round_trips % report_every == 0 and result.round_trips < num_round_trips:
            sample()
    sample()
    return result
