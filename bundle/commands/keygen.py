"""`evidence keygen --out KEY`: a new ed25519 signing key, KEY (0600) and KEY.pub."""

from __future__ import annotations

import argparse
import logging

from evidence.bundle import signing
from evidence.errors import EXIT_OK

logger = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        "-o",
        required=True,
        metavar="KEY",
        help="where to write the private key (PEM, mode 0600); the public key goes to KEY.pub",
    )


def run(args: argparse.Namespace) -> int:
    private, public, keyid = signing.generate(args.out)
    print(f"{private}: private key (keep it from the jobs you record)")
    print(f"{public}: public key, keyid {keyid}")
    return EXIT_OK
