"""`evidence lint BUNDLE`: verify a bundle and report its findings (bundle/lint.py) as text, JSON,
SARIF or GitHub workflow commands; `--explain RULE` prints a rule's text (bundle/lint_rules.py)."""

from __future__ import annotations

import argparse
import logging
import sys

from evidence.bundle import lint, reader, signing, workflow
from evidence.bundle.lint_output import render_json, render_sarif, render_text
from evidence.bundle.lint_rules import FAIL_ON, RULES, explain
from evidence.errors import EXIT_ERROR, EXIT_OK, UsageError

logger = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", nargs="?", help="the bundle (.tar.gz) to verify and lint")
    parser.add_argument(
        "--format",
        choices=("text", "json", "sarif", "github"),
        default="text",
        help="output format (default: text; github: workflow commands, annotations in the Actions page)",
    )
    parser.add_argument(
        "--fail-on",
        choices=tuple(FAIL_ON),
        default="error",
        help="exit 1 when a finding of this severity or worse is found (default: error; warn, info, none)",
    )
    parser.add_argument("--explain", metavar="RULE", help="explain a rule (code like EV003 or name) and exit")
    parser.add_argument(
        "--key", metavar="KEY.pub", help="exit 2 unless the bundle is signed by this (ed25519 PEM) public key"
    )
    parser.add_argument(
        "--require-signature", action="store_true", help="exit 2 if the bundle is not signed (by any key)"
    )


def run(args: argparse.Namespace) -> int:
    if args.explain:
        sys.stdout.write(explain(args.explain))
        return EXIT_OK
    if not args.bundle:
        raise UsageError("lint needs a BUNDLE (or --explain RULE)")
    path: str = args.bundle
    output: str = args.format
    key = signing.load_public_key(args.key) if args.key else None
    try:
        manifest, findings, dropped, signature = lint.lint_signed(
            path, key, require_signature=args.require_signature
        )
    except reader.VerificationError as e:
        if output == "json":
            sys.stdout.write(render_json(path, None, [], 0, e.problems, EXIT_ERROR))
        elif output == "sarif":
            sys.stdout.write(render_sarif(path, [], e.problems, RULES))
        elif output == "github":
            sys.stdout.write(workflow.render_problems(path, e.problems))
        raise
    code = lint.exit_code(findings, args.fail_on)
    if output == "json":
        sys.stdout.write(render_json(path, manifest, findings, dropped, [], code, signature))
    elif output == "sarif":
        sys.stdout.write(render_sarif(path, findings, [], RULES))
    elif output == "github":
        sys.stdout.write(workflow.render_lint(path, findings, dropped, signature.text()))
    else:
        sys.stdout.write(render_text(path, manifest, findings, dropped, signature))
    return code
