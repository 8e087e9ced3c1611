"""The safe, streaming bundle reader: every byte of a bundle is untrusted until verified.

Nothing is extracted to disk and nothing is held whole in memory except the manifest: the gzip
stream is inflated chunk by chunk (counting decompressed bytes, so a gzip bomb stops at the limit),
tar headers are parsed by hand (only regular files, only `manifest.json` then `events.ndjson`, then
`attestation.intoto.json` in a signed bundle), and
events are checked line by line as they stream past.

API:
- `open_bundle(path) -> Bundle`: reads and checks the manifest; `Bundle.events()` streams the
  events, verifying as it goes (structure, limits, every event's envelope and data, sequence, run
  id, hashes, counts). An integrity problem that can only be known at the end (a file hash, the
  root hash, the counts) raises when the iterator is exhausted, so a consumer that acts on events
  before that must be ready to throw its work away. `Bundle.verify()` runs the same pass, yielding
  nothing.
  `Bundle.fold(start)` makes the same pass, folding each piece's events into a fresh start(seq) in
  whichever process checks the piece (lint's rules run on both CPUs that way).
- A signed bundle's third member, its attestation (bundle/attestation.py), is checked by the same
  pass: within its size limit, a DSSE envelope whose in-toto statement names the other members with
  their digests and whose predicate agrees with the manifest. After the pass, `Bundle.attestation`
  holds it (None for an unsigned bundle), and `Bundle.check_signature(public_key)` checks that it is
  signed by that key.
- `read_manifest(path) -> dict` and `read_events(path) -> Iterator[dict]`: verify the whole bundle
  first, then return the manifest / stream the events (in a second verifying pass).

Every failure is a `VerificationError` (a `BundleError`, exit code 2) whose message is one line;
`.problems` lists every reason found before the reader gave up (at most MAX_PROBLEMS).

This module is the API; the work is done in `container` (gzip, tar and JSON parsing within the
limits), `verify` (the pass that checks the manifest and every event, and says what is wrong) and
`fastpath` (the fast path over pieces of events, and the helper process that runs it on a second
CPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from evidence.bundle import signing
from evidence.bundle.attestation import Attestation
from evidence.bundle.container import MAX_MANIFEST, Limits
from evidence.bundle.fastpath import Fold
from evidence.bundle.format import ATTESTATION_NAME
from evidence.bundle.read_types import EventJSON, ManifestJSON
from evidence.bundle.verify import MAX_PROBLEMS, VerificationError, Verifier, time_ns

__all__ = [
    "MAX_MANIFEST",
    "MAX_PROBLEMS",
    "Attestation",
    "Bundle",
    "Fold",
    "Limits",
    "VerificationError",
    "open_bundle",
    "read_events",
    "read_manifest",
    "time_ns",
]

F = TypeVar("F", bound=Fold)


class Bundle:
    """An opened bundle: its checked manifest, and a verifying event stream.

    `parallel`: the events may be checked on two CPUs, by a helper process forked for each pass
    (only for bundles of at least verify.PARALLEL_MIN compressed bytes, with a second CPU, and when
    this process runs no other thread). Pass False when the caller keeps the CPUs busy itself.
    `ahead`: the bundle is inflated in a thread of its own, ahead of the checks (less time, a little
    more CPU: ~1.5 ms a 2,000-event bundle); False inflates in the caller's thread."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        limits: Limits | None = None,
        *,
        parallel: bool = True,
        ahead: bool = True,
    ) -> None:
        self.path = str(path)
        self.limits = limits or Limits()
        self.parallel = parallel
        self.ahead = ahead
        v = Verifier(self.path, self.limits)
        for _ in v.run(manifest_only=True):
            pass
        self.manifest: ManifestJSON = v.manifest
        self._last: Verifier | None = None  # the latest pass over the events

    def _pass(self, start: Callable[[int], Any] | None = None) -> Generator[Any, None, None]:
        v = Verifier(self.path, self.limits, parallel=self.parallel, start=start, ahead=self.ahead)
        self._last = v
        return v.run()

    def events(self) -> Generator[EventJSON, None, None]:
        """Every event, in sequence order, verifying as it goes; raises VerificationError (at the
        latest when exhausted) if anything is wrong. Close it to stop early."""
        return self._pass()

    def fold(self, start: Callable[[int], F]) -> Generator[F, None, None]:
        """The events, verified as by events(), folded a piece at a time: each piece's events go,
        in order, to the `feed` of a fresh start(seq) (seq: the piece's first event), which is then
        yielded; the folds come in order and together cover every event once. The pieces may be
        folded in a helper process (when `start` pickles and the pass is parallel): `start` and the
        folds it makes must then pickle, and must not depend on anything but the events they are
        fed. Raises VerificationError as events() does: a fold that came before it is worthless."""
        return self._pass(start)

    def verify(self) -> None:
        for _ in self.events():
            pass

    @property
    def attestation(self) -> Attestation | None:
        """The bundle's attestation (None: not signed), its envelope and statement checked against
        the members; known once a pass (verify, events, fold) has read the whole bundle without a
        problem. Its signature is checked by check_signature."""
        if self._last is None or not self._last.complete:
            raise RuntimeError("the attestation is known after a whole verifying pass")
        return self._last.attestation

    def check_signature(self, key: Ed25519PublicKey) -> str:
        """After a whole pass: the keyid of `key` if the bundle is signed by it; else a
        VerificationError (exit 2) saying why (not signed, signed by another key, bad signature)."""
        att = self.attestation
        if att is None:
            raise VerificationError(self.path, [f"not signed (the bundle has no {ATTESTATION_NAME})"])
        try:
            return signing.check(att, key)
        except signing.SignatureError as e:
            raise VerificationError(self.path, [str(e)]) from None

    @property
    def run_id(self) -> str:
        return str(self.manifest["run_id"])


def open_bundle(
    path: str | os.PathLike[str], limits: Limits | None = None, *, parallel: bool = True, ahead: bool = True
) -> Bundle:
    return Bundle(path, limits, parallel=parallel, ahead=ahead)


def read_manifest(path: str | os.PathLike[str], limits: Limits | None = None) -> ManifestJSON:
    """The manifest of a bundle that passes full verification."""
    b = Bundle(path, limits)
    b.verify()
    return b.manifest


def read_events(path: str | os.PathLike[str], limits: Limits | None = None) -> Iterator[EventJSON]:
    """The events of a bundle that passes full verification (checked in a first pass, then streamed
    in a second pass that verifies again, so a file changed in between is caught too)."""
    b = Bundle(path, limits)
    b.verify()
    return b.events()
