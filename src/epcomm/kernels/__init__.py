"""Triton kernels, one module per kernel family.

- `sync`: monotone int64 counters (add with release, await with acquire and a bounded spin
  that sets a timeout bit), grid barriers, the named error bits.
- `dispatch`: `dispatch_kernel`, a send part (routing, per-destination positions, records pushed
  into the peers' staging regions) and a receive part (the records copied out into the compact
  or expand layout).
- `combine`: `combine_kernel`, a send part (expert outputs back to their sources, reduced per
  token in the expand layout) and a reduce part (bias + per-rank rows in the order of
  docs/semantics.md).
- `collective`: the collective backend's passes around its all-to-all (count, pack, unpack,
  expand; the combine's pack and reduce).
- `low_latency`: V1's low-latency mode (dispatch send and receive, combine send and reduce).
- `copy`: copies between fixed buffers and per-call tensors listed in a table on the device (a
  replayed CUDA graph's inputs and outputs).
- `common`: vector-access, copy and prefix-sum helpers; `launcher`: how the host launches them.

Comment lines `# phase-mark: <name>` in the kernels are read by the phase tracer
(`scripts/gpu_phases.py`, which puts a time stamp at each in a traced copy): keep each where its
phase ends, and rename or remove one only together with that script's `TARGETS`.

Kernels take local tensors, runtime sizes and a table of heap base addresses (`bases`, int64
`[R]`); they know nothing about process groups. Heap memory is only ever reached through
`bases`, never passed as a tensor argument (the interpreter copies tensor arguments back after
a launch, which could undo a peer's concurrent store).

Without CUDA, Triton runs kernels on CPU tensors only through its interpreter, which must be
chosen before any kernel is decorated: importing this package selects it then (it changes
nothing for a process that has CUDA).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
