"""`evidence show BUNDLE`: a readable summary of a bundle (bundle/show.py), as text, Markdown (for a
job's page) or one self-contained HTML page (bundle/show_markdown.py, bundle/show_html.py)."""

from __future__ import annotations

import argparse
import logging
import sys

from evidence.bundle import show

logger = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", help="the bundle (.tar.gz) to summarise")
    parser.add_argument("--limit", type=int, default=50, help="entries per section (default 50, 0: all)")
    parser.add_argument(
        "--format",
        choices=("text", "markdown", "html"),
        default="text",
        help="text (default); markdown (for $GITHUB_STEP_SUMMARY); html (one self-contained page, "
        "with lint's findings)",
    )


def run(args: argparse.Namespace) -> int:
    limit = max(0, args.limit)
    path: str = args.bundle
    if args.format == "text":
        sys.stdout.write(show.render(show.summarise(path), limit))
        return 0
    summary, linted = show.summarise_and_lint(path)
    if args.format == "markdown":
        from evidence.bundle import show_markdown

        sys.stdout.write(show_markdown.render(summary, linted, limit))
    else:
        from evidence.bundle import show_html

        sys.stdout.write(show_html.render(summary, linted, limit, path=path))
    return 0
