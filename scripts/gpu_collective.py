"""The collective backend at EP=1 over NCCL on one GPU: checks, then time against its floor.

    PYTHONPATH=src python3 scripts/gpu_collective.py [--tokens 128 4096] [--iters 20]

1. For each token count, layout and sync mode (hidden 7168, top-8, 256 experts, bf16): one
   dispatch + combine checked bitwise against the reference, twice on fresh data (the second
   dispatch is a prepared call; synchronizing ones also over exact blocks, as calls with too
   much padding take them: `collective_kernels.padded_sync`); the sync-free dispatch, cached
   dispatch and combine run again under `torch.cuda.set_sync_debug_mode("error")`; then
   dispatch + combine are captured in a CUDA graph and replayed on new routing, checked again;
   a synchronizing dispatch with an expert id of E raises `EPInputError`, and the next call is
   correct.
2. Timing, calls queued back to back between two CUDA events: dispatch and combine beside their
   floor from the same run, NCCL `all_to_all_single` of the bytes the call sends plus a fresh
   copy of the bytes it writes to its outputs (valid rows), and the ratio; and the host time of
   the same loop (the time for the calls to return): where it is about the call's time, the
   host bounds the call.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

os.environ.setdefault("EP_AVOID_RECORD_STREAM", "1")  # graph capture must not record_stream

from epcomm import Buffer  # noqa: E402
from epcomm.errors import EPInputError  # noqa: E402
from epcomm.bench_paths import time_calls, time_us  # noqa: E402
from epcomm.testing.launch import capture_graph, run_local_ranks  # noqa: E402
from epcomm.testing.reference import reference_combine, reference_dispatch  # noqa: E402
from epcomm.testing.verify import assert_equal, make_routing  # noqa: E402

H, K, E = 7168, 8, 256


def _time_us(fn, iters: int) -> float:
    return time_us(fn, torch.device("cuda"), iters)


def _inputs(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    idx = make_routing("balanced", tokens, K, E, 1, gen).cuda()
    x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16).cuda()
    return x, idx, torch.rand(tokens, K, generator=gen).cuda()


def _check(buffer, x, idx, w, expand: bool, sync: bool, label: str) -> None:
    group = dist.group.WORLD
    recv_x, _, recv_w, handle, _ = buffer.dispatch(x, idx, w, num_experts=E, do_expand=expand,
                                                   do_cpu_sync=sync)
    ref = reference_dispatch(x, idx, w, E, x.shape[0], group, 1, expand)
    rows = ref.recv_x.shape[0]
    valid = ref.expand_valid if expand else slice(None)
    assert_equal(f"{label}: recv_x", recv_x[:rows][valid], ref.recv_x[valid])
    y = (recv_x.float() * 2).to(torch.bfloat16)
    combined, _, _ = buffer.combine(y, handle)
    want, _ = reference_combine(y[:rows], ref, idx, E, group)
    assert_equal(f"{label}: combined_x", combined, want)


def _time_row(buffer, x, idx, w, expand: bool, sync: bool, label: str, iters: int) -> str:
    """The table row of one call: dispatch and combine beside their floors."""
    tokens = x.shape[0]
    out = buffer.dispatch(x, idx, w, num_experts=E, do_expand=expand, do_cpu_sync=sync)
    handle = out[3]
    y = torch.ones(handle.num_output_rows, H, dtype=torch.bfloat16, device="cuda")

    def dispatch():
        buffer.dispatch(x, idx, w, num_experts=E, do_expand=expand, do_cpu_sync=sync)

    def combine():
        buffer.combine(y, handle)

    cuda = torch.device("cuda")
    (disp, disp_host), (comb, comb_host) = (time_calls(fn, cuda, iters)
                                            for fn in (dispatch, combine))
    sent = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1]) * 2 * H
    written = (int(handle.num_unaligned_recv_tokens_per_expert.sum()) if expand
               else int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])) * 2 * H
    floors = []
    for a2a_bytes, out_bytes in ((sent, written), (sent, tokens * 2 * H)):
        src = torch.empty(a2a_bytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        a2a = _time_us(lambda: dist.all_to_all_single(dst, src), iters)
        copy_src = torch.empty(out_bytes, dtype=torch.uint8, device="cuda")
        floors.append(a2a + _time_us(copy_src.clone, iters))
    return f"| {label} | {disp:.1f} | {floors[0]:.1f} | {disp / floors[0]:.2f} | " \
        f"{comb:.1f} | {floors[1]:.1f} | {comb / floors[1]:.2f} | {disp_host:.1f} | " \
        f"{comb_host:.1f} |"


def run(tokens_list: list[int], iters: int) -> list[str]:
    from epcomm.backends import collective_kernels
    lines = []
    for tokens in tokens_list:
        x, idx, w = _inputs(tokens, tokens)
        # Synchronizing calls over exact blocks (a count exchange first), as a call whose
        # padding would be too large takes them (several ranks, large blocks), on a buffer of
        # their own (a buffer keeps one prepared call per call shape).
        threshold = collective_kernels.PADDED_SYNC_BYTES
        collective_kernels.PADDED_SYNC_BYTES = -1
        try:
            buffer = Buffer(dist.group.WORLD, tokens, H, K, backend="collective")
            for expand in (False, True):
                label = f"{tokens} {'expand' if expand else 'compact'} sync, exact blocks"
                _check(buffer, x, idx, w, expand, True, label)
                _check(buffer, *_inputs(tokens, tokens + 1), expand, True, label + " again")
                lines.append(_time_row(buffer, x, idx, w, expand, True, label, iters))
            buffer.destroy()
        finally:
            collective_kernels.PADDED_SYNC_BYTES = threshold
        buffer = Buffer(dist.group.WORLD, tokens, H, K, backend="collective")
        for expand in (False, True):
            for sync in (True, False):
                label = f"{tokens} {'expand' if expand else 'compact'} " \
                        f"{'sync' if sync else 'sync-free'}"
                _check(buffer, x, idx, w, expand, sync, label)
                # the same call shape again on new data: a prepared call
                _check(buffer, *_inputs(tokens, tokens + 1), expand, sync, label + " again")
                if not sync:  # no host sync anywhere on the sync-free path
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        again = buffer.dispatch(x, idx, w, num_experts=E, do_expand=expand,
                                                do_cpu_sync=False)
                        buffer.dispatch(x, topk_weights=w, handle=again[3])
                        buffer.combine(again[0], again[3], topk_weights=again[2])
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                lines.append(_time_row(buffer, x, idx, w, expand, sync, label, iters))
        # CUDA graph of the sync-free dispatch + combine, replayed on new routing.
        static_x, static_idx, static_w = _inputs(tokens, 1)

        def step():
            recv_x, _, recv_w, handle, _ = buffer.dispatch(static_x, static_idx, static_w,
                                                           num_experts=E, do_expand=True,
                                                           do_cpu_sync=False)
            return recv_x, buffer.combine(recv_x, handle, topk_weights=recv_w)[0]
        graph, (recv_x, combined) = capture_graph(step)
        x2, idx2, w2 = _inputs(tokens, 2)
        static_x.copy_(x2), static_idx.copy_(idx2), static_w.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_dispatch(x2, idx2, w2, E, tokens, dist.group.WORLD, 1, True)
        valid = ref.expand_valid
        assert_equal("graph replay: recv_x", recv_x[:valid.numel()][valid], ref.recv_x[valid])
        want, _ = reference_combine(recv_x[:valid.numel()], ref, idx2, E, dist.group.WORLD)
        assert_equal("graph replay: combined_x", combined, want)
        lines.append(f"| {tokens}: sync-debug and CUDA graph replay | ok | | | | | | | |")
        # An id outside [-1, E) in a synchronizing dispatch: its one host read raises it.
        bad = idx.clone()
        bad[0, 0] = E
        try:
            buffer.dispatch(x, bad, w, num_experts=E, do_cpu_sync=True)
        except EPInputError as exc:
            assert "outside" in str(exc), exc
        else:
            raise AssertionError("a synchronizing dispatch with an invalid expert id did not raise")
        _check(buffer, x, idx, w, False, True, f"{tokens} after an invalid id")
        lines.append(f"| {tokens}: invalid id raised, next call correct | ok | | | | | | | |")
        buffer.destroy()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    [lines] = run_local_ranks(run, 1, args.tokens, args.iters, pg_backend="nccl",
                              deadline_s=600)
    print("| call | disp us | disp floor us | disp x floor | comb us | comb floor us | "
          "comb x floor | disp host us | comb host us |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
