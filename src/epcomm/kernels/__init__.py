"""Triton kernels of the symmetric backend, one module per kernel family.

- `sync`: epoch-tagged flags: `signal` (release store, system scope) and `wait` (acquire loads,
  bounded spin, timeout error bit).
- `dispatch`: `push` (token records into peers' staging regions), `compact` and `expand` (copy
  epilogues from the local staging region into ordinary output tensors).
- `combine`: `push` (expert outputs, reduced per token in expand mode, back to their sources) and
  `reduce` (bias + per-rank rows in the order of docs/semantics.md).

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
