"""`evidence profile BUNDLE > policy.yaml`: a policy that allows exactly what a recorded run did
(policy/profile.py builds it from the bundle's manifest and events)."""

from __future__ import annotations

import argparse
import logging
import sys

from evidence.bundle.reader import read_events, read_manifest
from evidence.errors import EXIT_OK, UsageError
from evidence.policy.profile import build_profile

logger = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", help="the bundle of a recorded run")
    parser.add_argument(
        "--workspace", help="the run's workspace (default: from the bundle's policy, else its cwd)"
    )
    parser.add_argument("--tmpdir", help="the run's private tmp (default: from the bundle's policy)")
    parser.add_argument("--home", help="the home directory of the run (default: from the bundle's policy)")
    parser.add_argument("-o", "--output", help="write the policy here instead of standard output")


def run(args: argparse.Namespace) -> int:
    path: str = args.bundle
    try:
        manifest = read_manifest(path)
    except OSError as e:
        raise UsageError(f"{path}: {e.strerror or e}") from None
    text, _ = build_profile(
        manifest, read_events(path), workspace=args.workspace, tmpdir=args.tmpdir, home=args.home
    )
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return EXIT_OK
