"""`evidence verify BUNDLE --key KEY.pub`: exit 0 when the bundle is valid and signed by that key.

`evidence verify --artifact FILE BUNDLE --key KEY.pub`: exit 0 only when, besides, FILE's sha256 is
a subject of the bundle's signed attestation and the run wrote it (bundle/provenance.py, from the
bundle's own events); then prints what the run did (`evidence show`'s summary). Each failure is one
line: the bundle does not verify or is not signed by the key (exit 2: tampered bundle), FILE's
digest is no subject (exit 2: tampered or other artifact), the run did not write it (exit 1)."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import stat
import sys
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from evidence.bundle import attestation, provenance, reader, show, signing
from evidence.bundle.read_types import ManifestJSON
from evidence.errors import EXIT_FINDINGS, EXIT_OK, BundleError, Error, UsageError

logger = logging.getLogger(__name__)


class NotWrittenError(Error):
    """The artifact is a subject of the bundle, which is valid, but the run did not write it."""

    exit_code = EXIT_FINDINGS


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", help="the bundle (.tar.gz)")
    parser.add_argument(
        "--key", required=True, metavar="KEY.pub", help="the public key the bundle must be signed by"
    )
    parser.add_argument(
        "--artifact",
        metavar="FILE",
        help="also require FILE to be a subject of the bundle's attestation that the run wrote "
        "(exit 1 if the run did not write it, 2 if its digest is no subject); prints what the run did",
    )


def verify(path: str, key: Ed25519PublicKey) -> tuple[ManifestJSON, str]:
    """(manifest, keyid) of a bundle that passes verification and is signed by `key`; else
    VerificationError (exit 2) with the reason."""
    bundle = reader.open_bundle(path)
    bundle.verify()
    return bundle.manifest, bundle.check_signature(key)


def sha256_of(path: str) -> str:
    """The sha256 of the regular file at `path` (UsageError, exit 2, when it is not one)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        raise UsageError(f"cannot read artifact {path}: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(f"cannot read artifact {path}: not a regular file")
        h = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
    except OSError as e:
        raise UsageError(f"cannot read artifact {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    return h.hexdigest()


def verify_artifact(artifact: str, path: str, key: Ed25519PublicKey) -> tuple[provenance.Tie, str]:
    """(the artifact's tie to the run, keyid) when the bundle verifies, is signed by `key`, and
    names the artifact's digest as a subject the run wrote; else an Error saying which failed."""
    digest = sha256_of(artifact)
    bundle = reader.open_bundle(path)
    tracker = provenance.Tracker()
    tracker.feed_events(bundle.events())  # verifying as it goes: a tampered bundle stops here
    keyid = bundle.check_signature(key)
    m = bundle.manifest
    att = bundle.attestation
    assert att is not None  # check_signature passed
    artifacts = m.get("artifacts")
    if att.statement["predicateType"] != attestation.RUNTIME_TRACE_TYPE or not artifacts:
        raise BundleError(f"{artifact}: not attested: {path} has no artifact subjects")
    mine = [f for f in artifacts["files"] if f["sha256"] == digest]
    if not mine:
        raise BundleError(
            f"{artifact}: its sha256 {digest} is not a subject of {path} (the artifact was changed "
            "since, or is not one this run attested)"
        )
    ties = tracker.ties(mine, m["started_at"], m["finished_at"])
    signed = _signed_ties(att.statement)
    for t in ties:  # what was signed says the same as the events (it was made from them)
        said = signed.get(t.path)
        if said is None or said.get("writtenByRun") is not t.written:
            raise BundleError(f"{path}: the attestation's tie of subject {t.name} disagrees with its events")
    written = [t for t in ties if t.written]
    if not written:
        raise NotWrittenError(
            f"{artifact}: subject {ties[0].name} was not written by the run: {ties[0].reason}"
        )
    return written[0], keyid


def _signed_ties(st: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The statement's subject entries of monitorLog.fileAccess, by path: their annotations."""
    out: dict[str, dict[str, Any]] = {}
    log = st["predicate"].get("monitorLog") if isinstance(st["predicate"], dict) else None
    for rd in (log or {}).get("fileAccess") or ():
        notes = rd.get("annotations") if isinstance(rd, dict) else None
        if isinstance(notes, dict) and notes.get("access") == ["subject"] and isinstance(rd.get("name"), str):
            out.setdefault(rd["name"], notes)
    return out


def run(args: argparse.Namespace) -> int:
    key = signing.load_public_key(args.key)  # a bad key file is bad input, before the bundle is read
    if args.artifact is None:
        manifest, keyid = verify(args.bundle, key)
        print(
            f"{args.bundle}: verified and signed: run {manifest['run_id']}, {manifest['events']} events, "
            f"keyid {keyid}"
        )
        return EXIT_OK
    tie, keyid = verify_artifact(args.artifact, args.bundle, key)
    by = tie.writer or {"pid": None, "program": None, "sha256": None}
    how = (
        f"renamed into place from {tie.renamed_from} by pid {tie.renamed_by}, "
        if tie.how == "renamed"
        else ""
    )
    print(
        f"{args.artifact}: subject {tie.name} (sha256 {tie.sha256}), {how}written by the run: pid "
        f"{by['pid']} {by['program']} (sha256 {by['sha256'] or 'not hashed'}) at {tie.at}; bundle "
        f"{args.bundle} verified and signed, keyid {keyid}"
    )
    sys.stdout.write(show.render(show.summarise(args.bundle)))
    return EXIT_OK
