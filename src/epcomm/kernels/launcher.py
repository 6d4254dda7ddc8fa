"""A launcher that skips Triton's per-call argument binding once a variant is compiled.

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

from typing import Hashable, Optional

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
        if compiled is None:
            compiled = self.fn[self.grid](*args, **self.constants)
            if self.fast and variant is not None:
                self.compiled[variant] = compiled
            return
        compiled[self.grid](*args, *self.tail)
