"""`evidence recover [--bundle-dir DIR]`: turn what a dead `evidence run` left into bundles.

    evidence recover                       # where its run's --bundle named, if only root can write
                                           # there; else /var/lib/evidence/recovered
    evidence recover --bundle-dir /srv/b   # all of them into one directory

A run whose recorder died (kill -9, OOM, reboot) or whose bundle could not be written (disk full)
leaves its spool and run record in /var/lib/evidence/run-spool. Each becomes a bundle: marked cut
short, with a degradation event, when the recorder died during the run; complete, with the
command's exit code, when only the writing failed. Spools of runs that are still going are left
alone. Prints one line per bundle written. Exit 0 (also when there was nothing to recover), 2 for
bad input, 70 without root.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from evidence.errors import SetupError, UsageError

logger = logging.getLogger(__name__)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bundle-dir",
        metavar="DIR",
        help="write every bundle here (default: where its run's --bundle named)",
    )
    p.add_argument("--spool-dir", metavar="DIR", help=argparse.SUPPRESS)  # tests: another spool directory


def run(args: argparse.Namespace) -> int:
    from evidence.agent.commands.run import RUN_SPOOL_DIR
    from evidence.agent.recorder.recovery import recover_spools

    spool_dir = Path(args.spool_dir) if args.spool_dir else RUN_SPOOL_DIR
    bundle_dir = Path(args.bundle_dir).absolute() if args.bundle_dir else None
    if bundle_dir is not None and bundle_dir.exists() and not bundle_dir.is_dir():
        raise UsageError(f"--bundle-dir {bundle_dir}: not a directory")
    if os.geteuid() != 0:
        raise SetupError("evidence recover needs root (the spools are root's)", "run it with sudo")
    if not spool_dir.is_dir():
        return 0
    try:
        written = recover_spools(spool_dir, bundle_dir, recorder="evidence run")
    except OSError as e:
        raise UsageError(f"cannot write the bundles: {e}") from e
    for bundle in written:
        print(bundle)
    return 0
