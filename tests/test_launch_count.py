"""Device work per call of the symmetric backend: torch operator calls plus Triton launches.

On the GPU each counted torch operator is (about) one kernel launch and each Triton launch is
one, and a sync-free call is launch-bound (~18-24 us host time per launch on the H200), so this
CPU-measurable count is the proxy for launches per `dispatch` / `combine`.

Counting rule (`_Counter`):
- torch: every aten operator that reaches a `TorchDispatchMode` during the call, EXCEPT
  * views and aliases (`OpOverload.is_view`, plus `aten.alias`/`detach`/`lift_fresh`), which
    launch nothing;
  * uninitialised allocations (`aten.empty*`, `new_empty*`), which launch nothing (caching
    allocator), and `aten.scalar_tensor` (a Python scalar wrapped as a 0-dim CPU tensor, e.g.
    by `torch.where(c, x, -1)`: no device work);
  * anything torch runs inside a Triton launch (the interpreter copies tensor arguments; on
    the GPU that is part of the one launch).
  `fill_`, `zeros`, `full`, `copy_`, `_local_scalar_dense` (a device-to-host read) all count.
- Only work inside the backend's `dispatch` / `combine` counts (the `Buffer` front end's
  argument checks read the ids on CPU tensors only, never on a sync-free GPU call).
- Triton: every launch (`kernel[grid](...)`), counted by wrapping the interpreter's
  `InterpretedFunction.run`.

Setting: 2 CPU ranks (interpreter), E=8, K=3, H=32, T=M=8, sync-free (`do_cpu_sync=False`),
with weights, alignment 4; one warm-up call, then one counted call of each kind (rank 0's
numbers; the rank-1 numbers are asserted equal, routing does not change the op count).

Counts before the fused layout kernels (torch ops + Triton launches; 2026-12-02):
    dispatch compact: 93 + 6 = 99      dispatch expand: 94 + 7 = 101
    combine  compact:  0 + 6 = 6       combine  expand:  0 + 6 = 6
  (dispatch launches: wait, push, signal, wait, compact, [expand], signal; the torch ops were
  `compute_send_layout`, `compute_expert_layout`, `last_slot_per_rank`, the where/cat/cumsum
  glue and the tail fills.)
After (`LIMITS`):
    dispatch compact:  0 + 5 = 5       dispatch expand:  1 + 7 = 8
    combine  compact:  0 + 5 = 5       combine  expand:  0 + 5 = 5
  dispatch compact: route+wait(free), push, signal_wait(ready), compact (+ tail fill),
  expert_layout+signal(free); expand adds the expand kernel, its weights' zero fill and a
  separate signal(free); combine: wait, push, signal_wait, reduce, signal.
"""
from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist

from epcomm.launch import run_local_ranks

pytest.importorskip("triton")

H, K, M, E = 32, 3, 8, 8

# (torch ops, Triton launches) upper bounds per call: a regression that adds work fails here.
LIMITS = {
    "dispatch compact": (0, 5),
    "dispatch expand": (1, 7),
    "combine compact": (0, 5),
    "combine expand": (0, 5),
}

_SKIP = {"alias", "detach", "lift_fresh", "empty", "empty_strided", "empty_like", "new_empty",
         "new_empty_strided", "scalar_tensor"}


def _make_counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()
            self.launches = collections.Counter()
            self.paused = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.paused and not func.is_view \
                    and func.overloadpacket.__name__ not in _SKIP:
                self.ops[str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    return _Counter


def _patch_launches(counter_ref):
    """Count every interpreter launch in `counter_ref[0]` (if set), torch ops inside paused."""
    from triton.runtime.interpreter import InterpretedFunction
    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        counter = counter_ref[0]
        if counter is None:
            return original(self, *args, **kwargs)
        counter.launches[self.fn.__name__] += 1
        counter.paused += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            counter.paused -= 1

    InterpretedFunction.run = run


def _count_inside(impl, counter_cls, counter_ref, armed):
    """Count the ops and launches of `impl.dispatch` / `impl.combine` while `armed[0]`."""
    for name in ("dispatch", "combine"):
        method = getattr(impl, name)

        def wrapped(*args, _method=method, **kwargs):
            if not armed[0]:
                return _method(*args, **kwargs)
            counter = counter_cls()
            counter_ref[0] = counter
            try:
                with counter:
                    return _method(*args, **kwargs)
            finally:
                counter_ref[0] = None
                armed[0] = False
                armed[1] = counter

        setattr(impl, name, wrapped)


def _count(armed, fn):
    armed[0], armed[1] = True, None
    out = fn()
    assert armed[1] is not None
    return out, armed[1]


def _measure():
    from epcomm.buffer import Buffer
    rank = dist.get_rank()
    counter_cls, counter_ref = _make_counter(), [None]
    _patch_launches(counter_ref)
    buffer = Buffer(dist.group.WORLD, M, H, K, backend="symmetric", timeout_s=30)
    armed = [False, None]
    _count_inside(buffer._impl, counter_cls, counter_ref, armed)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(M, H, generator=gen).bfloat16()
    idx = torch.randint(-1, E, (M, K), generator=gen)
    weights = torch.rand(M, K, generator=gen)
    result = {}
    for expand in (False, True):
        kind = "expand" if expand else "compact"
        opts = dict(num_experts=E, do_cpu_sync=False, do_expand=expand, expert_alignment=4)

        def dispatch():
            return buffer.dispatch(x, idx, weights, **opts)

        def combine(out):
            recv_x, _, recv_w, handle, _ = out
            return buffer.combine(recv_x, handle, topk_weights=recv_w)

        combine(dispatch())  # warm-up
        out, counted = _count(armed, dispatch)
        result[f"dispatch {kind}"] = (sum(counted.ops.values()), sum(counted.launches.values()),
                                      dict(counted.ops), dict(counted.launches))
        _, counted = _count(armed, lambda: combine(out))
        result[f"combine {kind}"] = (sum(counted.ops.values()), sum(counted.launches.values()),
                                     dict(counted.ops), dict(counted.launches))
    buffer.destroy()
    return result


def test_launch_count():
    results = run_local_ranks(_measure, 2)
    over = []
    for name, (max_ops, max_launches) in LIMITS.items():
        ops, launches, op_detail, launch_detail = results[0][name]
        print(f"{name}: {ops} torch ops + {launches} Triton launches\n  ops {op_detail}\n"
              f"  launches {launch_detail}")
        assert results[1][name][:2] == (ops, launches), name
        if ops > max_ops or launches > max_launches:
            over.append(f"{name}: {ops} ops / {launches} launches > {max_ops} / {max_launches}")
    assert not over, "\n".join(over)
