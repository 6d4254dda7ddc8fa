"""A short soak on CPU ranks (the long one: scripts/soak.py): mixed random round trips through
each backend, each bitwise against the reference, and memory that stays flat."""
import os
import time

import pytest
import torch.distributed as dist

from epcomm import Buffer
from epcomm.testing.launch import run_seeded
from epcomm.testing.soak import soak

SEED = int(os.environ.get("EPCOMM_TEST_SEED", time.time_ns() % 1_000_000))


def run_soak(seed: int, backend: str, round_trips: int):
    buffer = Buffer(dist.group.WORLD, 8, 128, 4, backend=backend)
    result = soak(buffer, round_trips, seed, report_every=max(1, round_trips // 4))
    buffer.destroy()
    assert result.round_trips == round_trips and len(result.samples) == 5
    return result.growth_mb()


@pytest.mark.parametrize("backend, round_trips", [("collective", 160), ("symmetric", 8)])
def test_soak_bitwise_and_flat_memory(backend: str, round_trips: int) -> None:
    if backend == "symmetric":
        pytest.importorskip("triton")
    for host_mb, cuda_mb in run_seeded(run_soak, 2, SEED, SEED, backend, round_trips):
        assert host_mb < 32 and cuda_mb == 0, (host_mb, cuda_mb)
