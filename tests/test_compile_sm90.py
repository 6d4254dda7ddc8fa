"""The GPU kernels compile for sm_90 on this machine (no GPU needed) and keep 16-byte accesses.

Runs `scripts/compile_sm90.py` in a fresh process (it must import the kernels without the
interpreter, which the other tests select). A compile error in the GPU path, or a change that
turns the row copies back into 4-byte accesses (see docs/perf-notes.md), fails here instead of
on the GPU machine.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def test_kernels_compile_for_sm90_with_vector_accesses():
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError as error:
        pytest.skip(f"Triton's NVIDIA backend is not installed: {error}")
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_sm90.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line]
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    # 3 shapes x (2 symmetric + 8 collective kernels), 5 low-latency kernels at dsv3, the 2
    # symmetric kernels at the decode shape (its dispatch's one-block paths)
    assert len(lines) == 3 * 10 + 5 + 2, run.stdout
    for line in lines:
        if line.startswith("decode "):
            assert " 0 spill bytes" in line and ", 0 program(s)" not in line, line
        if not line.startswith("dsv3 "):
            continue
        # (the FP8 receive copies 8 bytes a thread: 1,024 bytes a program on 128 threads)
        if not line.startswith(("dsv3 count_kernel", "dsv3 header_kernel",
                                "dsv3 expert_prefix_kernel", "dsv3 ll_dispatch_recv")):
            # every row copy of the DeepSeek-V3 shape is vectorized
            assert int(re.search(r"v4 accesses (\d+)", line).group(1)) > 0, line
        assert ", 0 program(s)" not in line, line
        if line.startswith(("dsv3 dispatch_kernel", "dsv3 combine_kernel")):
            # the grid-barrier kernels fit in registers with one program per SM
            assert " 0 spill bytes" in line, line


TRACED = """
import importlib
import sys
import torch
sys.path.insert(0, sys.argv[1])
import compile_sm90, gpu_phases
def timer_reads(fn, shape):
    return compile_sm90.compile_kernel(fn, compile_sm90.SHAPES[shape]).asm["ptx"].count(
        "%globaltimer")
for target in gpu_phases.TARGETS.values():
    product = getattr(importlib.import_module(f"epcomm.kernels.{target.module}"),
                      target.kernel)
    kernel = getattr(gpu_phases.traced_module(target, torch.zeros(16, dtype=torch.int64)),
                     target.kernel)
    compile_sm90.POINTERS[kernel] = compile_sm90.POINTERS[product]
    # (shapes compiled already; the dispatch's one-block paths at "test", its grid-barrier
    # paths at "odd")
    for shape in ("test", "odd") if target.module == "dispatch" else ("dsv3",):
        print(target.kernel, shape, timer_reads(kernel, shape) - timer_reads(product, shape),
              len(target.marks))
"""
# Marks of the dispatch kernel outside its paths' branches (send-start, send-peers-freed,
# send-records-pushed, receive-ready, receive-done): each of its two builds stamps them.
SHARED_DISPATCH_MARKS = 5


def test_phase_trace_finds_every_mark_and_compiles():
    """`scripts/gpu_phases.py` inserts its time stamps by the text of each traced kernel's
    lines: an edit of the kernel that loses an anchor, or a stamp that does not compile, fails
    here rather than on the GPU machine."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError as error:
        pytest.skip(f"Triton's NVIDIA backend is not installed: {error}")
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", TRACED, str(ROOT / "scripts")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 8, run.stdout  # the dispatch kernel twice, the combine, the 5
    # low-latency kernels
    # one timer read per mark beyond the kernel's own (timeouts); the dispatch's two builds
    # between them read it at every mark
    stamps, marks = {}, {}
    for line in lines:
        kernel, _, count, marks[kernel] = line.split()
        assert 0 <= int(count) <= int(marks[kernel]), line
        stamps[kernel] = stamps.get(kernel, 0) + int(count)
    for kernel, count in stamps.items():
        shared = SHARED_DISPATCH_MARKS if kernel == "dispatch_kernel" else 0
        assert count == int(marks[kernel]) + shared, (kernel, run.stdout)
