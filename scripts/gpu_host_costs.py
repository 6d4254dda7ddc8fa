"""Host cost of the pieces a dispatch or combine call is made of (GPU machine, one process).

    PYTHONPATH=src python3 scripts/gpu_host_costs.py

Prints the median host microseconds of each piece (torch stream and allocation calls, Triton
launch styles on a 40-argument kernel), the numbers behind the host path's design
(docs/perf-notes.md).
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from host_timing import median_host_us


@triton.jit(do_not_specialize=["i0", "i1", "i2", "i3", "i4", "i5", "i6", "i7", "i8", "i9",
                               "i10", "i11", "i12", "i13", "i14"])
def forty(t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15, t16, t17, t18,
          t19, t20, t21, t22, t23, t24, i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12,
          i13, i14, K: tl.constexpr, R: tl.constexpr):
    pass


def main():
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    comm = torch.cuda.Stream()
    compute = torch.cuda.current_stream()
    tensors = [torch.empty(64, device=dev) for _ in range(25)]
    ints = [1000 + i for i in range(15)]
    ptrs = [t.data_ptr() for t in tensors]
    compiled = forty[(132,)](*tensors, *ints, K=8, R=1)
    tail = (8, 1)
    compiled._init_handles()
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    stream = comm.cuda_stream
    grid = (132, 1, 1)
    x = torch.empty(4096, 7168, dtype=torch.bfloat16, device=dev)
    blob = torch.empty(1 << 20, dtype=torch.int32, device=dev)
    event = torch.cuda.Event()

    def set_both():
        torch.cuda.set_stream(comm)
        torch.cuda.set_stream(compute)

    pieces = [
        ("Triton generic launch kernel[grid](...)",
         lambda: forty[(132,)](*tensors, *ints, K=8, R=1)),
        ("compiled[grid](*args, *tail)", lambda: compiled[grid](*tensors, *ints, *tail)),
        ("compiled.run(...) tensors", lambda: run(132, 1, 1, stream, function, packed, None, None,
                                                   None, *tensors, *ints, *tail)),
        ("compiled.run(...) int pointers", lambda: run(132, 1, 1, stream, function, packed, None,
                                                        None, None, *ptrs, *ints, *tail)),
        ("25 x data_ptr()", lambda: [t.data_ptr() for t in tensors]),
        ("torch.empty 4096 x 7168 bf16",
         lambda: torch.empty(4096, 7168, dtype=torch.bfloat16, device=dev)),
        ("torch.empty((32768, 10), int32)",
         lambda: torch.empty((32768, 10), dtype=torch.int32, device=dev)),
        ("torch.empty((4096, 8), float32)",
         lambda: torch.empty((4096, 8), dtype=torch.float32, device=dev)),
        ("blob[a:b].view(n, 8)", lambda: blob[1024:1024 + 4096 * 8].view(4096, 8)),
        ("blob.narrow(0,a,n).view(n, 8)", lambda: blob.narrow(0, 1024, 4096 * 8).view(4096, 8)),
        ("torch.cuda.current_stream()", lambda: torch.cuda.current_stream()),
        ("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev)),
        ("torch.cuda.current_device()", torch.cuda.current_device),
        ("set_stream(comm) + set_stream(compute)", set_both),
        ("comm.wait_stream(compute)", lambda: comm.wait_stream(compute)),
        ("torch.cuda.Event()", torch.cuda.Event),
        ("event.record(comm)", lambda: event.record(comm)),
        ("comm.wait_event(event)", lambda: comm.wait_event(event)),
        ("x.record_stream(comm)", lambda: x.record_stream(comm)),
        ("x.contiguous()", x.contiguous),
        ("x.is_contiguous()", x.is_contiguous),
        ("x.dtype, x.shape, x.dim()", lambda: (x.dtype, x.shape, x.dim())),
        ("x.device == dev", lambda: x.device == dev),
        ("x.shape[0], x.shape[1]", lambda: (x.shape[0], x.shape[1])),
        ("x.view(torch.int32)", lambda: x.view(torch.int32)),
        ("torch.cuda.is_current_stream_capturing()", torch.cuda.is_current_stream_capturing),
        ("triton.knobs.runtime.launch_enter_hook",
         lambda: triton.knobs.runtime.launch_enter_hook),
    ]
    print("torch", torch.__version__, "triton", triton.__version__)
    print("| host piece | median us |\n|---|---|")
    for name, fn in pieces:
        print(f"| {name} | {median_host_us(fn, 200, warmup=10, idle=False):.2f} |")


if __name__ == "__main__":
    main()
