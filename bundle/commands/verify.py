"""`evidence verify BUNDLE --key KEY.pub`: exit 0 when the bundle is valid and signed by that key."""

from __future__ import annotations

import argparse
import logging

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from evidence.bundle import reader, signing
from evidence.bundle.read_types import ManifestJSON
from evidence.errors import EXIT_OK

logger = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", help="the bundle (.tar.gz)")
    parser.add_argument(
        "--key", required=True, metavar="KEY.pub", help="the public key the bundle must be signed by"
    )


def verify(path: str, key: Ed25519PublicKey) -> tuple[ManifestJSON, str]:
    """(manifest, keyid) of a bundle that passes verification and is signed by `key`; else
    VerificationError (exit 2) with the reason."""
    bundle = reader.open_bundle(path)
    bundle.verify()
    return bundle.manifest, bundle.check_signature(key)


def run(args: argparse.Namespace) -> int:
    key = signing.load_public_key(args.key)  # a bad key file is bad input, before the bundle is read
    manifest, keyid = verify(args.bundle, key)
    print(
        f"{args.bundle}: verified and signed: run {manifest['run_id']}, {manifest['events']} events, "
        f"keyid {keyid}"
    )
    return EXIT_OK
