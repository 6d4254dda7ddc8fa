"""LogFMT-10 (`epcomm.logfmt`): its docstring example, the library's encode / decode bitwise
against the reference's round trip on random rows with special values, and the error bound
docs/semantics.md states."""
import doctest
import os
import time

import torch

from epcomm import logfmt
from epcomm.testing.reference_low_latency import reference_logfmt
from epcomm.testing.verify import assert_equal

SEED = int(os.environ.get("EPCOMM_TEST_SEED", time.time_ns() % 1_000_000))


def test_docstring_example():
    assert doctest.testmod(logfmt).failed == 0


def _rows(gen, rows, hidden):
    """bf16 rows: per-row and per-channel magnitudes from 2^-50 to 2^50, zeros of both signs,
    +-Inf and NaN in some groups, a group of NaN only."""
    octaves = torch.randint(-50, 50, (rows, 1), generator=gen) + \
        torch.randint(-20, 20, (rows, hidden), generator=gen)
    x = (torch.randn(rows, hidden, generator=gen) * torch.exp2(octaves.float())).bfloat16()
    x[0, 3], x[0, 4], x[1, 130], x[1, 131] = float("inf"), -float("inf"), float("nan"), -0.0
    x[2, :128] = float("nan")
    x[3, 128:] = 0.0
    return x


def test_round_trip_matches_reference_and_error_bound():
    gen = torch.Generator().manual_seed(SEED)
    hidden = 384
    x = _rows(gen, 12, hidden)
    wire = torch.full((12, logfmt.wire_bytes(hidden)), 0xAB, dtype=torch.uint8)
    logfmt.encode_rows(x, wire)
    got = logfmt.decode_rows(wire, hidden)
    want = torch.stack([reference_logfmt(row) for row in x])
    assert_equal(f"logfmt round trip (EPCOMM_TEST_SEED={SEED})", got, want)

    # The bound: a finite value within 32 octaves of its group's largest moves by at most
    # step // 2 <= 4 magnitude steps; the largest is exact; specials keep their class.
    m = (x.view(torch.int16).int() & 0x7FFF).view(12, -1, 128)
    back = (got.view(torch.int16).int() & 0x7FFF).view(12, -1, 128)
    finite = m < 0x7F80
    top = torch.where(finite, m, 0).amax(2, keepdim=True)
    near = finite & (m >= top - 4096)
    assert ((back - m).abs()[near] <= 4).all()
    at_top = finite & (m == top)
    assert torch.equal(torch.where(at_top, back, 0), torch.where(at_top, m, 0))
    assert torch.equal(got.float().isnan(), x.float().isnan())
    assert torch.equal(got.float().isinf(), x.float().isinf())
    assert torch.equal(got.float().signbit() | got.float().isnan(),
                       x.float().signbit() | x.float().isnan())
