"""Command line: `epcomm bench ...` or `python -m epcomm bench ...` (see `epcomm.bench`)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _parser() -> argparse.ArgumentParser:
    from . import bench

    parser = argparse.ArgumentParser(prog="epcomm", description="epcomm command-line tools")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench_parser = commands.add_parser(
        "bench", help="check and time dispatch / combine against all_to_all_single",
        description="Check one dispatch + combine per case against epcomm.testing.reference, then "
                    "time dispatch and combine next to an all_to_all_single baseline.")
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(run=bench.main)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the `epcomm` script; returns the exit status."""
    args = _parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
