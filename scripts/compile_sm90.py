"""Compile the symmetric and collective backends' kernels for sm_90 (H100/H200) on a machine without a GPU.

    TRITON_INTERPRET=0 PYTHONPATH=src python3 scripts/compile_sm90.py [--ptx DIR]

Triton's NVIDIA backend compiles to PTX and cubin without a driver, so compile errors of the GPU
path (and codegen properties such as vector width) show here instead of costing device time.
For each shape (the DeepSeek-V3 one and small test ones, 16-byte-aligned pointers as the
runtime specializes them) prints one line per kernel: the 16-byte (`.v4`) and 4-byte global
accesses in its PTX and, for the DeepSeek-V3 shape, what `ptxas -v` reports (registers per
thread, spill bytes) with the programs that fit on one SM at that register count (grid barriers
need every program resident: P <= SMs x that). Exit status 1 if a kernel fails to compile.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from itertools import repeat
from typing import Optional

os.environ["TRITON_INTERPRET"] = "0"  # before epcomm.kernels: compile, do not interpret

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from epcomm.backends import collective_kernels as CK  # noqa: E402
from epcomm.backends.symmetric.backend import _GPU_DECODE_TILE as DECODE  # noqa: E402
from epcomm.backends.symmetric.backend import _GPU_TILE as TILE  # noqa: E402
from epcomm import low_latency as LL  # noqa: E402
from epcomm.kernels import collective, combine, dispatch, low_latency  # noqa: E402
from epcomm.kernels.launcher import KernelShape  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
REGISTERS_PER_SM = 65536  # sm_90
# (K, R, words per dispatch copy step, bf16 per combine step, VEC (dispatch), VEC (combine),
# the symmetric backend's tile, tokens per rank S); the DeepSeek-V3 ones with the GPU tiles of
# backends/symmetric/backend.py (4096 tokens: the dispatch's grid-barrier paths, 128: its
# one-block paths, `dispatch.one_block`)
SHAPES = {"dsv3": (8, 8, TILE["block_w"], TILE["block_h"], 4, 8, TILE, 4096),
          "decode": (8, 8, DECODE["block_w"], DECODE["block_h"], 4, 8, DECODE, 128),
          "test": (4, 1, 128, 256, 4, 8, TILE, 64), "odd": (3, 3, 32, 64, 1, 8, TILE, 4096)}
REPORTED = ("dsv3", "decode")  # shapes whose registers are reported
SYMMETRIC_ONLY = ("decode",)  # shapes of the symmetric kernels' tiles alone
POINTERS = {  # pointer arguments and their element types; every other argument is i32/i64
    dispatch.dispatch_kernel: dict(
        bases_ptr="i64", sync_ptr="i64", error_ptr="i32", counts_scratch="i32",
        pos_scratch="i32", idx_ptr="i64", idx_copy="i64", weights_ptr="i32", p0_ptr="i32",
        p1_ptr="i32", slot_out="i32", hist_ptr="i32", idx_out="i64", w_out="i32",
        meta_out="i32", rank_psum_out="i32", expert_count_out="i32", expert_psum_out="i32",
        q0_out="i32", q1_out="i32", counts_host="i32"),
    combine.combine_kernel: dict(
        bases_ptr="i64", sync_ptr="i64", rank_psum_ptr="i32", meta_ptr="i32", x_ptr="i16",
        weights_ptr="i32", slot_ptr="i32", bias0_ptr="i16", bias1_ptr="i16", out_ptr="i16",
        w_out="i32", error_ptr="i32"),
    collective.count_kernel: dict(idx_ptr="i64", counts_ptr="i32", flags_ptr="i32",
                                  experts_ptr="i64"),
    collective.header_kernel: dict(counts_ptr="i32", flags_ptr="i32", experts_ptr="i64",
                                   fields_ptr="i64", seq_ptr="i64", rows_ptr="i64"),
    collective.pack_kernel: dict(
        idx_ptr="i64", weights_ptr="fp32", counts_ptr="i32", pos_ptr="i32", slot_ptr="i32",
        send_counts_ptr="i32", idx_copy="i64", fields_ptr="i64", seq_ptr="i64"),
    collective.unpack_kernel: dict(
        counts_ptr="i64", rank_psum_out="i32", idx_out="i64", w_out="fp32", meta_out="i32",
        hist_ptr="i32", fields_ptr="i64", seq_ptr="i64", flags_ptr="i32"),
    collective.expert_prefix_kernel: dict(hist_ptr="i32", expert_counts_out="i32"),
    collective.expand_kernel: dict(
        rank_psum="i32", expert_counts="i32", expert_psum_out="i32", w_out="fp32",
        meta_out="i32", hist_ptr="i32", flags_ptr="i32", counts_host="i32"),
    collective.combine_pack_kernel: dict(
        rank_psum="i32", metadata="i32", w_ptr="fp32", fields_ptr="i64", seq_ptr="i64"),
    collective.combine_reduce_kernel: dict(
        send_counts="i32", rank_psum="i32", idx_ptr="i64", pos_ptr="i32", bias0="bf16",
        bias1="bf16", out_ptr="bf16", w_out="fp32", fields_ptr="i64", seq_ptr="i64",
        flags_ptr="i32"),
    # V1's low-latency mode: FP8 dispatch, bf16 combine (as `epcomm.low_latency` launches them)
    low_latency.ll_dispatch_send: dict(
        bases_ptr="i64", x_ptr="i16", idx_ptr="i64", mask_ptr="i32", epoch_ptr="i64",
        error_ptr="i32"),
    low_latency.ll_dispatch_recv: dict(
        bases_ptr="i64", mask_ptr="i32", epoch_ptr="i64", done_ptr="i64", error_ptr="i32",
        recv_x_ptr="u8", scales_ptr="fp32", src_info_ptr="i32", slot_ptr="i32",
        count_ptr="i32", range_ptr="i64", stats_ptr="i32", wait_ptr="i64"),
    low_latency.ll_dispatch_local: dict(
        bases_ptr="i64", x_ptr="i16", idx_ptr="i64", mask_ptr="i32", recv_x_ptr="u8",
        scales_ptr="fp32", src_info_ptr="i32", slot_ptr="i32", count_ptr="i32",
        range_ptr="i64", stats_ptr="i32"),
    low_latency.ll_combine_send: dict(
        bases_ptr="i64", mask_ptr="i32", epoch_ptr="i64", error_ptr="i32", x_ptr="i16",
        src_info_ptr="i32", slot_ptr="i32", range_ptr="i64"),
    low_latency.ll_combine_reduce: dict(
        bases_ptr="i64", mask_ptr="i32", epoch_ptr="i64", done_ptr="i64", error_ptr="i32",
        x_ptr="i16", idx_ptr="i64", weights_ptr="fp32", out_ptr="i16", wait_ptr="i64"),
}


def _constants(fn, shape) -> tuple[dict, int]:
    K, R, block_w, block_h, vec, vec_h, tile, tokens = shape
    base = dict(K=K, BLOCK_K=triton.next_power_of_2(K), BLOCK_R=triton.next_power_of_2(R))
    if fn.__module__ == collective.__name__:
        return _collective_constants(fn, base, K, vec)
    base["SCOPE"] = "sys"  # the heap kernels' signals as between GPUs (`SymmetricHeap.scope`)
    if fn.__name__.startswith("ll_"):  # (a low-latency kernel, or a traced copy of one)
        tile = LL.GPU_TILES[fn.__name__]
        return _low_latency_constants(fn, base, R, tile), tile.num_warps
    if fn.__name__ == "combine_kernel":  # (the kernel, or a traced copy of it)
        in_flight = combine.slots_in_flight(KernelShape(R, K, vec_h, block_h,
                                                        tile["combine_rows"], 132,
                                                        tile["combine_warps"]))
        return dict(base, ROWS=tile["combine_rows"], VEC=vec_h, BLOCK_H=block_h,
                    IN_FLIGHT=in_flight), tile["combine_warps"]
    all_tokens, all_rows = dispatch.one_block(
        KernelShape(R, K, vec, block_w, tile["rows"], 132, tile["num_warps"]), R * tokens)
    extra = dict(BLOCK_M=16, BLOCK_E=dispatch._BLOCK_E, BLOCK_T=dispatch._BLOCK_T, BLOCK_O=1,
                 GROUP=dispatch.rank_group(tile["rows"]), ALL_TOKENS=all_tokens,
                 ALL_ROWS=all_rows)
    return dict(base, ROWS=tile["rows"], VEC=vec, BLOCK_W=block_w, BLOCK_P=256, **extra), \
        tile["num_warps"]


def _low_latency_constants(fn, base: dict, R: int, tile) -> dict:
    """The low-latency kernels' constants as `epcomm.low_latency` launches them (M = 128 tokens
    per rank, 256 experts over R ranks, FP8 dispatch without rounded scales)."""
    constants = dict(BLOCK_R=base["BLOCK_R"], BLOCK_C=tile.block_c, ALIGN=16,
                     SCOPE=base["SCOPE"])
    if fn.__name__ == "ll_dispatch_send":
        return dict(constants, USE_FP8=True, ROUND_SCALE=False, BLOCK_T=128,
                    BLOCK_K=base["BLOCK_K"])
    if fn.__name__ == "ll_dispatch_recv":
        return dict(constants, USE_FP8=True, USE_UE8M0=False, BLOCK_K=base["BLOCK_K"],
                    BLOCK_E=triton.next_power_of_2(256 // R))
    if fn.__name__ == "ll_dispatch_local":
        return dict(BLOCK_C=tile.block_c, USE_FP8=True, ROUND_SCALE=False, USE_UE8M0=False,
                    BLOCK_T=128, BLOCK_K=base["BLOCK_K"], BLOCK_E=8)
    if fn.__name__ == "ll_combine_send":
        return dict(constants, ROWS=tile.rows, LOGFMT=False)
    return dict(constants, BLOCK_K=base["BLOCK_K"], LOGFMT=False)


def _collective_constants(fn, base: dict, K: int, vec: int) -> tuple[dict, int]:
    """The collective kernels' constants as `backends.collective_kernels` launches them (256
    local experts' block at most, 256 programs' block)."""
    block_p = dict(BLOCK_P=256)
    if fn is collective.expert_prefix_kernel:
        return block_p, CK.NUM_WARPS
    if fn is collective.header_kernel:
        return dict(block_p, BLOCK_R=base["BLOCK_R"], BLOCK_E=256,
                    BLOCK_F=triton.next_power_of_2(CK._HEADER_WORDS + 1)), CK.NUM_WARPS
    if fn in (collective.combine_pack_kernel, collective.combine_reduce_kernel):
        return dict(base, BLOCK_F=collective.BLOCK_F, ROWS=CK.COMBINE_ROWS, VEC=8,
                    BLOCK_H=CK.BLOCK_H), CK.COMBINE_WARPS
    rows = dict(base, ROWS=CK.ROWS)
    if fn is collective.count_kernel:
        return rows, CK.NUM_WARPS
    rows.update(VEC=vec, BLOCK_W=CK.BLOCK_W)
    if fn is collective.pack_kernel:
        rows.update(block_p, BLOCK_F=collective.BLOCK_F)
    elif fn is collective.unpack_kernel:
        rows.update(BLOCK_M=triton.next_power_of_2(K + 2), BLOCK_E=32, BLOCK_F=collective.BLOCK_F)
    else:
        rows.update(BLOCK_E=32, GROUP=CK.GROUP)
    return rows, CK.NUM_WARPS


def compile_kernel(fn, shape):
    """The compiled kernel (PTX in `.asm["ptx"]`) of `fn` at `shape`."""
    constants, num_warps = _constants(fn, shape)
    pointers = POINTERS[fn]
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "i64" if name == "timeout" or name.endswith("_addr") \
                or name in ("p0_out", "p1_out") else "i32"
    # Pointers are 16-byte aligned; the low-latency kernels specialize on `hidden` (7168 and
    # the test shapes' hidden sizes are multiples of 16), as Triton does at run time.
    specialized = set(pointers) | ({"hidden"} if fn.__name__.startswith("ll_") else set())
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name in specialized}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=TARGET, options=dict(num_warps=num_warps))


def register_report(kernel, num_warps: int) -> str:
    """`ptxas -v` of the kernel's PTX for sm_90a: registers, spills, programs per SM."""
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as folder:
        ptx = os.path.join(folder, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        run = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", ptx, "-o",
                              os.path.join(folder, "kernel.cubin")],
                             capture_output=True, text=True, check=True)
    report = run.stdout + run.stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    per_sm = REGISTERS_PER_SM // (registers * 32 * num_warps)
    return f", {registers} registers, {spills} spill bytes, {per_sm} program(s) per SM"


def _jobs() -> list[tuple[str, int]]:
    """(shape name, index into POINTERS) of every kernel to compile."""
    kernels = list(POINTERS)
    jobs = []
    for shape_name in SHAPES:
        for index, fn in enumerate(kernels):
            if fn.__name__.startswith("ll_") and shape_name != "dsv3":
                continue  # (the low-latency kernels: the DeepSeek-V3 shape only)
            if shape_name in SYMMETRIC_ONLY and fn not in (dispatch.dispatch_kernel,
                                                           combine.combine_kernel):
                continue
            jobs.append((shape_name, index))
    return jobs


def _report(job: tuple[str, int], ptx_folder: Optional[str]) -> tuple[bool, str]:
    """(compiled, the kernel's line) of one job of `_jobs`."""
    shape_name, index = job
    fn, shape = list(POINTERS)[index], SHAPES[shape_name]
    try:
        kernel = compile_kernel(fn, shape)
        ptx = kernel.asm["ptx"]
    except Exception as error:  # noqa: BLE001 - report every kernel, then fail
        return False, (f"{shape_name} {fn.__name__}: FAILED {type(error).__name__}: "
                       f"{str(error).splitlines()[0] if str(error) else ''}")
    wide = len(re.findall(r"(?:ld|st)\.global(?:\.\w+)*\.v4\.", ptx))
    narrow = len(re.findall(r"(?:ld|st)\.global(?:\.[a-z0-9:_]+)*\.b32\b", ptx))
    registers = register_report(kernel, _constants(fn, shape)[1]) \
        if shape_name in REPORTED else ""
    if ptx_folder:
        os.makedirs(ptx_folder, exist_ok=True)
        with open(os.path.join(ptx_folder, f"{shape_name}-{fn.__name__}.ptx"), "w") as f:
            f.write(ptx)
    return True, f"{shape_name} {fn.__name__}: v4 accesses {wide}, 4-byte accesses {narrow}" \
        f"{registers}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ptx", help="write each kernel's PTX into this folder")
    args = parser.parse_args()
    # One process per CPU core (forked after the imports): the compiles are independent and
    # each one CPU-bound.
    with ProcessPoolExecutor(os.cpu_count(), mp_context=multiprocessing.get_context("fork")) \
            as pool:
        results = list(pool.map(_report, _jobs(), repeat(args.ptx)))
    for _, line in results:
        print(line)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
