"""`evidence baseline build BUNDLE... > baseline.json`: what many runs did, each item with how many
runs showed it (bundle/baseline.py); `evidence diff --baseline` reads it."""

from __future__ import annotations

import argparse
import logging
import sys

from evidence.bundle import baseline, diff

logger = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    b = sub.add_parser(
        "build",
        help="write a baseline (JSON, on stdout) of what the runs did, each item with how many runs showed it",
    )
    b.add_argument("bundles", nargs="+", metavar="BUNDLE", help="bundles of runs of the same job")
    b.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="PATTERN",
        help="regular expression replaced by <ignored> before counting (repeatable; kept in the baseline)",
    )


def run(args: argparse.Namespace) -> int:
    ignore: list[str] = args.ignore
    diff.check_patterns(ignore)
    sys.stdout.writelines(baseline.chunks(baseline.build(args.bundles, ignore)))
    return 0
