"""`scripts/gpu_host_ab.py` reads the figures it compares from `gpu_tune.py --host`'s log."""
import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "gpu_host_ab", Path(__file__).resolve().parents[1] / "scripts" / "gpu_host_ab.py")
gpu_host_ab = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_host_ab)

# The head of a real log (H200 machine, session 8), then a later table reusing two labels.
LOG = """\
| host piece | median us |
|---|---|
| torch.empty 4096 x 7168 bf16 | 5.1 |
| with torch.cuda.stream(s): pass | 17.8 |
| empty Triton launch, 26 arguments | 26.1 |
| Buffer.dispatch (compact, sync-free) | 76.1 |
| Buffer.combine | 36.7 |
| Buffer.dispatch, back to back | 53.8 |
| Buffer.combine, back to back | 29.8 |

Inclusive host us per dispatch call (10 calls, GPU idle before each):
| piece (nested by indent) | us per call | calls per call |
|---|---|---|
| Buffer.dispatch | 80.7 | 1.0 |
| Buffer.combine | 52.1 | 1.0 |
"""


def test_parse_host_table_reads_the_first_table():
    assert gpu_host_ab.parse_host_table(LOG) == {
        "yardstick": 26.1, "dispatch idle": 76.1, "combine idle": 36.7, "dispatch b2b": 53.8,
        "combine b2b": 29.8}


def test_parse_host_table_names_missing_rows():
    with pytest.raises(ValueError, match="dispatch b2b"):
        gpu_host_ab.parse_host_table(LOG.replace("| Buffer.dispatch, back to back | 53.8 |", ""))
