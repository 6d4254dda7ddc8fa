"""How the host launches the kernels: their compile-time `KernelShape`, the heap memory of a
`Stage`, and a `Launcher` that skips Triton's per-call argument binding once a variant is
compiled.

Triton's generic launch (`kernel[grid](...)`) binds and specializes every argument on each call:
about 43 us of host time for a 26-argument kernel on the GPU machine (`scripts/gpu_tune.py
--host`), so two launches alone would exceed a 40 us host budget per call. A `Launcher` keeps
the `CompiledKernel` of each variant it has launched and later calls it directly.

The caller names the variant: everything Triton would specialize on must be in the key (the
dtypes of tensors whose dtype varies; whether every pointer is 16-byte aligned: pass
`variant=None` when one is not, which always takes the generic path). Integer arguments are
all `do_not_specialize` in our kernels. Under the interpreter every launch is generic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional

import torch
import triton

from . import INTERPRET


class Launcher:
    """Launches `fn` on a 1-D grid of `programs` with fixed compile-time `constants`
    (constexpr parameters, which must be `fn`'s last parameters, plus options like
    `num_warps`)."""

    def __init__(self, fn, programs: int, constants: dict) -> None:
        self.fn = fn
        self.grid = (programs, 1, 1)
        self.constants = constants
        # The compiled kernel takes every parameter, constexprs included, in order.
        self.tail = tuple(constants[name] for name in fn.arg_names if name in constants)
        self.compiled: dict = {}
        self.fast = not INTERPRET

    def __call__(self, variant: Optional[Hashable], *args) -> None:
        compiled = self.compiled.get(variant) if self.fast and variant is not None else None
        if compiled is not None:
            try:
                compiled[self.grid](*args, *self.tail)
                return
            except (TypeError, OverflowError):
                # Rejected before launching: a Triton whose compiled kernels take their
                # arguments differently, or an int that no longer fits the variant's i32 (the
                # generic path picks the i64 one). Use the generic path from now on.
                self.fast = False
        compiled = self.fn[self.grid](*args, **self.constants)
        if self.fast and variant is not None:
            self.compiled[variant] = compiled


@dataclass(frozen=True)
class KernelShape:
    """Compile-time shape of a buffer's kernels (fixed at construction, so warm-up compiles
    every variant). vec: elements per vector access (it divides every row width); block_w:
    elements per copy step; rows: rows per tile; programs: P, the grid of every launch."""

    num_ranks: int
    num_topk: int
    vec: int
    block_w: int
    rows: int
    programs: int
    num_warps: int
    use_timer: bool

    def constants(self, width: str = "BLOCK_W") -> dict:
        """Keyword arguments of a launch; `width` names the kernel's copy-step constant."""
        return {"K": self.num_topk, "BLOCK_K": triton.next_power_of_2(self.num_topk),
                "BLOCK_R": self.block_r, "ROWS": self.rows,
                "VEC": self.vec, width: self.block_w, "USE_TIMER": self.use_timer,
                "num_warps": self.num_warps}

    @property
    def block_r(self) -> int:
        """The ranks as one block (lanes past R are masked)."""
        return triton.next_power_of_2(self.num_ranks)

    @property
    def block_p(self) -> int:
        """The programs as one block (kernels that read a value of every program)."""
        return max(2, triton.next_power_of_2(self.programs))

    def launch(self, fn, variant, *args, width: str = "BLOCK_W", **extra) -> None:
        """Launch `fn` on P programs with this shape's constants (and `extra` ones) through a
        cached `Launcher`; `variant` as `Launcher` takes it."""
        key = (fn, self, width, tuple(sorted(extra.items())))
        launcher = _LAUNCHERS.get(key)
        if launcher is None:
            launcher = _LAUNCHERS[key] = Launcher(fn, self.programs,
                                                  {**self.constants(width), **extra})
        launcher(variant, *args)


_LAUNCHERS: dict = {}  # (kernel, shape, constants) -> Launcher


def aligned(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether every given tensor starts on a 16-byte boundary (what Triton specializes on)."""
    return all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


@dataclass(frozen=True)
class Stage:
    """One stage's heap memory as the kernels see it: `bases` (int64 [R], every heap's address
    in this process), this rank, the byte offsets of the stage's counters and staging region,
    and S, records per source block."""

    bases: torch.Tensor
    rank: int
    flags_offset: int
    region_offset: int
    stride_tokens: int

    def args(self) -> tuple:
        return (self.bases, self.rank, self.bases.numel(), self.flags_offset, self.region_offset,
                self.stride_tokens)
