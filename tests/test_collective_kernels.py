"""The collective backend's kernel path (`backends.collective_kernels`, Triton; the
interpreter on CPU) on local gloo ranks: dispatch, cached dispatch and combine, compact and
expand, synchronizing and sync-free, bitwise against the reference."""
from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

pytest.importorskip("triton")

from epcomm import Buffer  # noqa: E402
from epcomm.backends.collective import CollectiveBackend  # noqa: E402
from epcomm.testing.launch import run_local_ranks  # noqa: E402
from epcomm.testing.verify import Case, check_round_trip  # noqa: E402

SEED = int(os.environ.get("EPCOMM_TEST_SEED", time.time_ns() % 1_000_000))


def run_kernel_path(seed: int) -> int:
    buffer = Buffer(dist.group.WORLD, 8, 64, 4, backend="collective")
    buffer._backend = CollectiveBackend(dist.group.WORLD, buffer.config, kernels=True)
    checked = 0
    for expand in (False, True):
        for sync in (True, False):
            case = Case(num_experts=4 * buffer.num_ranks, do_expand=expand, do_cpu_sync=sync,
                        expert_alignment=4 if expand else 1, num_bias=1, routing="skewed",
                        check_cached=True, seed=seed + checked)
            check_round_trip(buffer, case)
            checked += 1
    return checked


@pytest.mark.parametrize("num_ranks", [1, 3])
def test_kernel_path(num_ranks: int) -> None:
    assert run_local_ranks(run_kernel_path, num_ranks, SEED) == [4] * num_ranks
