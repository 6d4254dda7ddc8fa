"""How the host launches the kernels: their compile-time `KernelShape`, the heap memory of a
`Stage`, and a `Launcher` that skips Triton's per-call argument binding once a variant is
compiled.

Arguments are named: a caller builds a mapping from each runtime parameter name of the kernel
to its value (the phase builders of `kernels.dispatch` and `kernels.combine` return such
mappings), and `Launcher.bind` orders it by the kernel's signature, raising on a missing or an
unknown name. There is one way to build them: with tensors, or with `Address` stand-ins for
tensors whose addresses change per call.

Host time of one launch of a 40-argument kernel on the GPU machine: Triton's generic
`kernel[grid](...)`, which binds and specializes every argument, 44.7 us;
`CompiledKernel[grid](...)` 19.5 us; the compiled kernel's `run` on a stream the caller names
14.3 us; with every pointer an int (no `data_ptr()` call and no driver query per pointer) less
again. A `Launcher` keeps the `CompiledKernel` of each variant it has launched and later calls
its `run` directly.

The caller names the variant: everything Triton would specialize on must be in the key (the
dtypes of tensors whose dtype varies; whether every pointer is 16-byte aligned: pass
`variant=None` when one is not, which always takes the generic path). Integer arguments are
all `do_not_specialize` in our kernels. Under the interpreter every launch is generic.

A caller that launches one shape of call many times (a prepared call) builds its arguments
once with `Address` stand-ins, keeps them as an `ArgTemplate` (`Launcher.template`), and per
call launches `Launcher.launch_filled(variant, stream, template.fill(addresses))`: every
pointer an int, one C-level pick instead of the builders' Python.
"""
from __future__ import annotations

import operator
from functools import reduce
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Optional, Sequence, Union

import torch
from triton import knobs

from . import INTERPRET


def _hook(hook):
    """A launch hook to pass to a compiled kernel, None if there is nothing to call (Triton 3.9
    keeps an empty `HookChain` when no hook is set; calling it costs host time)."""
    return None if hook is None or not getattr(hook, "calls", True) else hook


class Launcher:
    """Launches `fn` on a 1-D grid of `programs` with fixed compile-time `constants`
    (constexpr parameters, which must be `fn`'s last parameters, plus options like
    `num_warps`). `params`: the names of `fn`'s runtime parameters, in order."""

    def __init__(self, fn, programs: int, constants: dict) -> None:
        self.fn = fn
        self.grid = (programs, 1, 1)
        self.constants = {name: value for name, value in constants.items()
                          if name in fn.arg_names or name.startswith("num_")}
        self.params = tuple(name for name in fn.arg_names if name not in self.constants)
        # The compiled kernel takes every parameter, constexprs included, in order.
        self.tail = tuple(self.constants[name] for name in fn.arg_names
                          if name in self.constants)
        self.compiled: dict = {}  # variant -> CompiledKernel
        self.fast = not INTERPRET
        self.generic_launches = 0
        self.fallback: Optional[str] = None  # why `fast` was turned off

    def bind(self, fields: Mapping) -> tuple:
        """The positional arguments of `fn` from `fields` (runtime parameter name -> value),
        which must name every runtime parameter and nothing else.

        Example: for `fn(a, b, C: tl.constexpr)` with constants {"C": 4},
        `bind({"b": 2, "a": 1}) == (1, 2)`; `bind({"a": 1})` raises naming `b`."""
        try:
            args = tuple([fields[name] for name in self.params])
        except KeyError as missing:
            raise ValueError(f"{self.fn.__name__}: no argument for parameter {missing}") from None
        if len(fields) != len(args):
            unknown = sorted(set(fields) - set(self.params))
            raise ValueError(f"{self.fn.__name__}: no parameter named {', '.join(unknown)}")
        return args

    def kept(self, variant: Optional[Hashable]) -> bool:
        """Whether a launch of `variant` takes the compiled kernel's fast path (then a
        template's filled arguments may be launched)."""
        return self._kept_kernel(variant) is not None

    def _kept_kernel(self, variant: Optional[Hashable]):
        """The kept `CompiledKernel` of `variant`, None when a launch of it takes the generic
        path."""
        return self.compiled.get(variant) if self.fast and variant is not None else None

    def __call__(self, variant: Optional[Hashable], stream, fields: Mapping) -> None:
        """Launch with `fields` (see `bind`; tensors for pointers) on `stream` (a CUDA stream;
        None: the current stream, and always under the interpreter)."""
        args = self.bind(fields)
        kernel = self._kept_kernel(variant)
        if kernel is not None:
            try:
                self.run_kept(kernel, stream, args + self.tail)
                return
            except (TypeError, OverflowError):
                pass  # the generic path, from now on
        self.generic_launches += 1
        current = None
        if stream is not None:
            current = torch.cuda.current_stream(stream.device)
            torch.cuda.set_stream(stream)
        try:
            kernel = self.fn[self.grid](*args, **self.constants)
        finally:
            if current is not None:
                torch.cuda.set_stream(current)
        if self.fast and variant is not None:
            kernel._init_handles()
            self.compiled[variant] = kernel

    def template(self, fields: Mapping, base: int) -> "ArgTemplate":
        """The `ArgTemplate` of a launch whose `fields` hold `Address` stand-ins (see
        `ArgTemplate`; offsets only from slot `base`), the constexprs appended."""
        return ArgTemplate(self.bind(fields) + self.tail, base)

    def launch_filled(self, variant: Optional[Hashable], stream, args: tuple) -> None:
        """Launch the kept kernel of `variant` with `args` filled from a `template`."""
        kernel = self._kept_kernel(variant)
        if kernel is None:
            raise RuntimeError(f"{self.fn.__name__}: filled arguments for variant {variant!r}, "
                               "which has no kept compiled kernel")
        self.run_kept(kernel, stream, args)

    def run_kept(self, kernel, stream, args: tuple) -> None:
        """Launch the kept compiled `kernel` on `stream` (None: the current stream) with `args`,
        every parameter of `fn` in order (the constexprs of `tail` included). What
        `CompiledKernel[grid](...)` does, without looking up the current stream and device on
        every call (5 us of the 19.5 us it costs on the GPU machine)."""
        raw = (torch.cuda.current_stream() if stream is None else stream).cuda_stream
        enter = _hook(knobs.runtime.launch_enter_hook)  # profilers' hooks
        metadata = None if enter is None else kernel.launch_metadata(self.grid, raw, *args)
        try:
            kernel.run(*self.grid, raw, kernel.function, kernel.packed_metadata, metadata,
                       enter, _hook(knobs.runtime.launch_exit_hook), *args)
        except (TypeError, OverflowError) as error:
            # Rejected before launching: a Triton whose compiled kernels take their arguments
            # differently, or an int that no longer fits the variant's i32 (the generic path
            # picks the i64 one; address arguments never start as 0, which would type them
            # i32: `address`). Use the generic path from now on (filled arguments cannot take
            # it: this call fails, later calls are not prepared).
            self.fast, self.fallback = False, repr(error)
            raise


# The address passed for an empty tensor, which a kernel never dereferences: 0 (what
# `data_ptr()` gives) would make Triton type the argument int32 when a kernel compiles, and a
# kept kernel compiled so could not take a real address later.
EMPTY_ADDRESS = 1 << 40


def address(tensor) -> Union[int, "Address"]:
    """`tensor.data_ptr()` as an int64 kernel argument (`EMPTY_ADDRESS` for 0); an `Address`
    stand-in as it is."""
    at = tensor.data_ptr()
    return EMPTY_ADDRESS if isinstance(at, int) and at == 0 else at


class Address:
    """A pointer argument left open in an `ArgTemplate`: the address in slot `slot` of a call's
    addresses plus `offset` bytes. Stands in for a tensor when a launch's arguments are built
    once for many calls: `shape` and `data_ptr()` answer what the argument builders read of the
    tensor, and adding bytes (a part of an allocation) gives another `Address`."""

    __slots__ = ("slot", "offset", "shape")

    def __init__(self, slot: int, shape: tuple = (), offset: int = 0) -> None:
        self.slot, self.shape, self.offset = slot, shape, offset

    def __add__(self, offset: int) -> "Address":
        return Address(self.slot, self.shape, self.offset + offset)

    def data_ptr(self) -> "Address":
        """Itself, as a tensor's `data_ptr()` is its address."""
        return self

    def view(self, dtype) -> "Address":
        """Itself: a dtype view has the same address (the builders view rows as words)."""
        return self

    def __repr__(self) -> str:
        return f"Address({self.slot}, +{self.offset})"


class ArgTemplate:
    """A kept kernel's launch arguments with the per-call addresses left open, filled per call
    by one C-level pick: for a 60-argument launch this costs what one Python call does, where
    building the arguments through the phase builders costs microseconds of host time.

    `args` holds `Address`es where a call's addresses go; addresses with an offset must all be
    in `base`'s slot (parts of one allocation). Tensors among the other arguments (the
    caller's own, which outlive the template) are kept as their addresses. `fill(addresses)`
    gives `args` with each `Address(slot, offset)` replaced by `addresses[slot] + offset`.

    Example: ArgTemplate((7, Address(1), Address(0, offset=16), Address(0)), base=0)
    .fill((1000, 2000)) == (7, 2000, 1016, 1000).
    """

    def __init__(self, args: Sequence, base: int) -> None:
        slots = 1 + max((arg.slot for arg in args if isinstance(arg, Address)), default=-1)
        offsets: dict[int, int] = {}  # byte offset from `base` -> its index among the parts
        constants: list = []
        picks = []  # index of each argument in (addresses, parts, constants)
        for arg in args:
            if not isinstance(arg, Address):
                picks.append(("constant", len(constants)))
                constants.append(arg.data_ptr() if isinstance(arg, torch.Tensor) else arg)
            elif arg.offset == 0:
                picks.append(("address", arg.slot))
            else:
                if arg.slot != base:
                    raise ValueError(f"{arg!r}: offsets are only allowed from slot {base}")
                picks.append(("part", offsets.setdefault(arg.offset, len(offsets))))
        where = {"address": 0, "part": slots, "constant": slots + len(offsets)}
        # (without parts `base` is not read: slot 0 stands in, whatever slots there are)
        self.base, self.slots = base if offsets else 0, slots
        self.offsets = tuple(offsets)
        self.constants = tuple(constants)
        indices = [where[kind] + index for kind, index in picks]
        # (itemgetter of one index returns the item, not a 1-tuple)
        self._pick = operator.itemgetter(*indices) if len(indices) > 1 else \
            (lambda values: (values[indices[0]],))

    def fill(self, addresses: Sequence[int]) -> tuple:
        if len(addresses) != self.slots:
            raise ValueError(f"expected {self.slots} addresses, got {len(addresses)}")
        base = addresses[self.base]
        return self._pick((*addresses, *[base + offset for offset in self.offsets],
                           *self.constants))


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
    # The scope of the heap's signals (`kernels.sync`; `SymmetricHeap.scope`).
    scope: str = "sys"
    # (kernel, width, extra constants) -> Launcher; not part of the shape's identity.
    launchers: dict = field(default_factory=dict, compare=False, repr=False)

    def constants(self, width: str = "BLOCK_W") -> dict:
        """Keyword arguments of a launch; `width` names the kernel's copy-step constant (a
        `Launcher` passes a kernel only the constants it has)."""
        return {"K": self.num_topk, "BLOCK_K": next_power_of_2(self.num_topk),
                "BLOCK_R": self.block_r, "BLOCK_P": self.block_p, "ROWS": self.rows,
                "VEC": self.vec, width: self.block_w, "SCOPE": self.scope,
                "num_warps": self.num_warps}

    @property
    def block_r(self) -> int:
        """The ranks as one block (lanes past R are masked)."""
        return next_power_of_2(self.num_ranks)

    @property
    def block_p(self) -> int:
        """The programs as one block (kernels that read a value of every program)."""
        return max(2, next_power_of_2(self.programs))

    def launcher(self, fn, width: str = "BLOCK_W", **extra) -> Launcher:
        """The cached `Launcher` of `fn` on P programs with this shape's constants (and
        `extra` ones). Each call site passes `extra` in a fixed order (it is part of the cache
        key)."""
        # id(fn): hashing a JITFunction hashes its source-derived cache key (2.6 us).
        key = (id(fn), width, *extra.values())
        launcher = self.launchers.get(key)
        if launcher is None:
            launcher = self.launchers[key] = Launcher(fn, self.programs,
                                                      {**self.constants(width), **extra})
        return launcher


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (>= 1); `triton.next_power_of_2` costs microseconds of
    host time per call in Triton 3.6."""
    return 1 << max(0, n - 1).bit_length()


def vector_words(words: Sequence[int]) -> int:
    """The widest vector access (4, 2 or 1 int32 words) that divides each of `words` (sizes and
    offsets in int32 words)."""
    return next(v for v in (4, 2, 1) if all(w % v == 0 for w in words))


def addresses_aligned(addresses: Sequence[int]) -> bool:
    """Each address 16-byte aligned (what kept kernels are specialized on)."""
    return not reduce(operator.or_, addresses, 0) % 16


def aligned(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether every given tensor starts on a 16-byte boundary (what Triton specializes on)."""
    bits = 0
    for tensor in tensors:
        if tensor is not None:
            bits |= tensor.data_ptr()
    return bits % 16 == 0


@dataclass(frozen=True)
class Stage:
    """One stage's heap memory as the kernels see it: `bases` (int64 [R], every heap's address
    in this process), this rank, the byte offsets of the stage's counters and staging region,
    and S, records per source block. `fields`: the kernels' arguments for it, by name."""

    bases: torch.Tensor
    rank: int
    flags_offset: int
    region_offset: int
    stride_tokens: int

    @property
    def fields(self) -> dict:
        return dict(bases_ptr=self.bases, rank=self.rank, num_ranks=self.bases.numel(),
                    flags_offset=self.flags_offset, region_offset=self.region_offset,
                    stride_tokens=self.stride_tokens)
