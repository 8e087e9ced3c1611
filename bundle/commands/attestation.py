"""`evidence attestation BUNDLE`: the bundle's DSSE envelope alone (for in-toto, DSSE and policy tools)."""

from __future__ import annotations

import argparse
import logging
import sys

from evidence.bundle import reader
from evidence.bundle.format import ATTESTATION_NAME
from evidence.errors import EXIT_OK, BundleError

logger = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", help="the bundle (.tar.gz)")


def run(args: argparse.Namespace) -> int:
    bundle = reader.open_bundle(args.bundle)
    bundle.verify()  # the envelope is printed only from a bundle that is whole and consistent
    att = bundle.attestation
    if att is None:
        raise BundleError(f"{args.bundle} is not signed (it has no {ATTESTATION_NAME})")
    sys.stdout.buffer.write(att.raw + b"\n")
    sys.stdout.flush()
    return EXIT_OK
