"""`evidence diff A B`: compare what two runs did (bundle/diff.py); `--baseline FILE` compares one
run with a baseline (bundle/baseline.py), `--baseline DIR` with a named bundle kept there (stored on
first use)."""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import sys
from pathlib import Path

from evidence.bundle import diff, diff_keys, reader
from evidence.errors import EXIT_OK, UsageError
from evidence.files import atomic_write

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "bundles", nargs="+", metavar="BUNDLE", help="A B (or, with --baseline, just the new bundle)"
    )
    parser.add_argument("--format", choices=diff.FORMATS, default="text")
    parser.add_argument(
        "--fail-on", choices=diff.FAIL_ON, default="added",
        help="exit 1 when a difference of this kind exists (default: added; any; none)",
    )  # fmt: skip
    parser.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="PATTERN",
        help="regular expression replaced by <ignored> before comparing (repeatable)",
    )
    parser.add_argument(
        "--baseline",
        metavar="FILE|DIR",
        help="a baseline file (evidence baseline build): report only what it has not seen; or a DIR "
        "where a named bundle is kept (stored on first use) to compare against",
    )
    parser.add_argument(
        "--min-runs",
        type=int,
        metavar="N",
        help="with a baseline file: known means seen in at least N of its runs (default 1: ever seen)",
    )
    parser.add_argument("--name", default="default", help="baseline name (default: default)")
    parser.add_argument(
        "--update", action="store_true", help="store the bundle as the baseline (replacing it)"
    )


def _store(bundle: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(target, mode=0o600) as out, open(bundle, "rb") as src:  # as every bundle
        shutil.copyfileobj(src, out)


def _report(
    a: diff_keys.Side,
    b: diff_keys.Side,
    changes: list[diff.Change],
    args: argparse.Namespace,
    ignore: list[str],
) -> int:
    code = diff.exit_code(changes, args.fail_on)
    sys.stdout.write(diff.render(a, b, changes, args.format, code, ignore))
    return code


def run(args: argparse.Namespace) -> int:
    ignore: list[str] = args.ignore
    bundles: list[str] = args.bundles
    diff.check_patterns(ignore)
    if args.baseline and diff.is_baseline_file(Path(args.baseline)):
        if len(bundles) != 1 or args.update:
            raise UsageError("with a baseline file, diff takes one bundle (the new run) and no --update")
        from evidence.bundle import baseline

        found = baseline.diff_against(args.baseline, bundles[0], args.min_runs, ignore)
        return _report(found.baseline, found.new, found.changes, args, found.ignore)
    if args.min_runs is not None:
        raise UsageError("--min-runs needs --baseline FILE (a file made by evidence baseline build)")
    if args.baseline:
        if len(bundles) != 1:
            raise UsageError("with --baseline, diff takes one bundle (the new run)")
        if not _NAME.fullmatch(args.name):
            raise UsageError(f"baseline name {args.name!r} must be letters, digits, '.', '_' or '-'")
        new = bundles[0]
        stored = Path(args.baseline) / (args.name + diff.BASELINE_SUFFIX)
        if args.update or not stored.exists():
            reader.open_bundle(new).verify()
            _store(new, stored)
            print(f"stored {new} as baseline {args.name!r} ({stored})")
            return EXIT_OK
        a_path, b_path = str(stored), new
    else:
        if len(bundles) != 2:
            raise UsageError("diff takes two bundles: A B (or one with --baseline FILE|DIR)")
        a_path, b_path = bundles
    a, b = diff_keys.behaviours(a_path, b_path, ignore)
    return _report(a, b, diff.compare(a, b), args, ignore)
