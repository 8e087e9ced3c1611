"""Signed bundles: keygen, the writer's attestation, `verify`, `lint --key`, `attestation`; the
envelope checked by an independent DSSE implementation (securesystemslib); forgeries and hostile
attestations refused with one line."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import jsonschema
import orjson
import pytest
from cryptography.hazmat.primitives import serialization
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from securesystemslib.dsse import Envelope
from securesystemslib.exceptions import VerificationError as SSlibVerificationError
from securesystemslib.signer import CryptoSigner, SSlibKey

from evidence.bundle import attestation, canonical, reader, schemas, signing
from evidence.bundle import format as fmt
from evidence.bundle.writer import write_bundle
from evidence.cli import main
from tests.unit.conftest_bundles import meta, open_, records, tar_bytes, tarinfo


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("keys")
    private, public, _ = signing.generate(d / "key")
    return private, public


@pytest.fixture(scope="module")
def other_keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("other")
    private, public, _ = signing.generate(d / "key")
    return private, public


def signed(path: Path, key: Path, recs: list[dict[str, Any]] | None = None, **over: Any) -> Path:
    rs = records() if recs is None else recs
    write_bundle(path, meta(**over), lambda: iter(rs), signer=signing.load_signer(key))
    return path


def unpack(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]


def repack(path: Path, members: list[tuple[str, bytes]]) -> Path:
    path.write_bytes(gzip.compress(tar_bytes([(tarinfo(n, len(d)), d) for n, d in members]), mtime=0))
    return path


def envelope_of(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = orjson.loads(unpack(path)[fmt.ATTESTATION_NAME])
    return doc


def statement_of(env: dict[str, Any]) -> dict[str, Any]:
    st: dict[str, Any] = orjson.loads(base64.b64decode(env["payload"]))
    return st


def resign(st: dict[str, Any], key: Path) -> bytes:
    return attestation.envelope(canonical.dumps(st), [signing.load_signer(key)])


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_2(code: int, err: str, pattern: str) -> None:
    assert code == 2, err
    assert err.startswith("evidence: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert re.search(pattern, err), err


# --- keys ------------------------------------------------------------------------------------------


def test_keygen_writes_a_private_key_0600_and_the_public_key_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "keygen", "--out", str(tmp_path / "evidence-key"))
    assert code == 0, err
    private, public = tmp_path / "evidence-key", tmp_path / "evidence-key.pub"
    assert os.stat(private).st_mode & 0o777 == 0o600
    assert private.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    assert public.read_bytes().startswith(b"-----BEGIN PUBLIC KEY-----")
    # keyid: sha256 of the DER SubjectPublicKeyInfo, i.e. of the base64 body of the .pub PEM file
    der = base64.b64decode("".join(public.read_text().splitlines()[1:-1]))
    keyid = hashlib.sha256(der).hexdigest()
    assert keyid in out
    assert signing.load_signer(private).keyid == keyid == signing.keyid(signing.load_public_key(public))
    # never overwrites a key
    code, _, err = run_cli(capsys, "keygen", "--out", str(private))
    one_line_2(code, err, "exists")


def test_keyid_is_what_openssl_prints(keys: tuple[Path, Path]) -> None:
    openssl = subprocess.run(
        ["openssl", "pkey", "-pubin", "-in", str(keys[1]), "-outform", "DER"], capture_output=True
    )
    if openssl.returncode != 0:
        pytest.skip("no openssl")
    assert hashlib.sha256(openssl.stdout).hexdigest() == signing.load_signer(keys[0]).keyid


def test_bad_key_files_are_one_line_errors(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    bundle = write_bundle(tmp_path / "a.tar.gz", meta(), lambda: iter(records()))
    assert bundle
    loose = tmp_path / "loose"
    loose.write_bytes(keys[0].read_bytes())
    loose.chmod(0o644)
    with pytest.raises(Exception, match="accessible by others"):
        signing.load_signer(loose)
    code, _, err = run_cli(capsys, "verify", str(tmp_path / "a.tar.gz"), "--key", str(keys[0]))
    one_line_2(code, err, "not a PEM public key.*\\.pub")
    code, _, err = run_cli(capsys, "verify", str(tmp_path / "a.tar.gz"), "--key", str(tmp_path / "nope"))
    one_line_2(code, err, "cannot read public key")
    rsa = tmp_path / "rsa.pub"
    from cryptography.hazmat.primitives.asymmetric import rsa as rsa_

    rsa.write_bytes(
        rsa_.generate_private_key(public_exponent=65537, key_size=2048)
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    code, _, err = run_cli(capsys, "verify", str(tmp_path / "a.tar.gz"), "--key", str(rsa))
    one_line_2(code, err, "not an ed25519 key")


# --- round trip ------------------------------------------------------------------------------------


def test_round_trip_verify_lint_and_attestation(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = signed(tmp_path / "run.tar.gz", keys[0])
    keyid = signing.load_signer(keys[0]).keyid
    code, out, err = run_cli(capsys, "verify", str(path), "--key", str(keys[1]))
    assert code == 0, err
    assert f"keyid {keyid}" in out and "verified and signed" in out
    code, out, err = run_cli(capsys, "lint", str(path), "--key", str(keys[1]))
    assert code == 0, err
    assert f"signature verified: signed by keyid {keyid}" in out
    code, out, err = run_cli(capsys, "lint", str(path))
    assert code == 0, err
    assert f"note: signed by keyid {keyid} (signature not checked" in out
    code, out, err = run_cli(capsys, "lint", str(path), "--format", "json", "--key", str(keys[1]))
    assert json.loads(out)["signature"] == {"signed": True, "keyids": [keyid], "verified_keyid": keyid}
    code, out, err = run_cli(capsys, "attestation", str(path))
    assert code == 0, err
    assert out.encode() == unpack(path)[fmt.ATTESTATION_NAME] + b"\n"


def test_signed_bundle_is_the_unsigned_one_plus_the_attestation_and_deterministic(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    a = unpack(signed(tmp_path / "a.tar.gz", keys[0]))
    b = signed(tmp_path / "b.tar.gz", keys[0]).read_bytes()
    assert (tmp_path / "a.tar.gz").read_bytes() == b  # ed25519 signatures are deterministic
    plain = tmp_path / "plain.tar.gz"
    write_bundle(plain, meta(), lambda: iter(records()))
    p = unpack(plain)
    assert list(a) == [fmt.MANIFEST_NAME, fmt.EVENTS_NAME, fmt.ATTESTATION_NAME]
    assert list(p) == [fmt.MANIFEST_NAME, fmt.EVENTS_NAME]
    assert a[fmt.MANIFEST_NAME] == p[fmt.MANIFEST_NAME] and a[fmt.EVENTS_NAME] == p[fmt.EVENTS_NAME]


def test_the_statement_names_the_members_and_the_run_and_its_predicate_follows_the_schema(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    path = signed(
        tmp_path / "a.tar.gz", keys[0], labels={"job": "7"}, policy={"mode": "enforce", "workspace": "/w"}
    )
    members = unpack(path)
    env = envelope_of(path)
    assert env["payloadType"] == "application/vnd.in-toto+json"
    st = statement_of(env)
    manifest = orjson.loads(members[fmt.MANIFEST_NAME])
    assert st["_type"] == "https://in-toto.io/Statement/v1"
    assert st["predicateType"] == attestation.RUNTIME_TRACE_TYPE
    assert st["subject"] == [
        {
            "name": "manifest.json",
            "digest": {"sha256": hashlib.sha256(members[fmt.MANIFEST_NAME]).hexdigest()},
        },
        {"name": "events.ndjson", "digest": {"sha256": hashlib.sha256(members[fmt.EVENTS_NAME]).hexdigest()}},
        {"name": manifest["run_id"], "digest": {"sha256": manifest["root_hash"]}},
    ]
    trace = st["predicate"]
    assert trace["metadata"]["buildStartedOn"] == manifest["started_at"]
    p = trace["evidenceRun"]  # the run predicate, an extension field of the runtime trace
    assert p["runId"] == manifest["run_id"] and p["rootHash"] == manifest["root_hash"]
    assert p["command"] == ["make", "test"] and p["exitCode"] == 0 and p["labels"] == {"job": "7"}
    assert p["kernel"] == "6.1.0" and p["policy"]["mode"] == "enforce"
    jsonschema.validate(p, schemas.load("run-predicate.schema.json"), cls=jsonschema.Draft202012Validator)
    attestation.RunPredicate.model_validate(p, strict=True)


# --- an independent DSSE implementation ------------------------------------------------------------


def test_securesystemslib_verifies_our_envelope(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    path = signed(tmp_path / "a.tar.gz", keys[0])
    public = signing.load_public_key(keys[1])
    key = SSlibKey.from_crypto(public, keyid=signing.keyid(public))
    env = Envelope.from_dict(envelope_of(path))
    accepted = env.verify([key], 1)
    assert list(accepted) == [signing.keyid(public)]
    assert env.pae() == attestation.pae(env.payload_type, env.payload)
    # and refuses it with another key, or a changed payload
    other = signing.generate(tmp_path / "other")[1]
    other_key = signing.load_public_key(other)
    with pytest.raises(SSlibVerificationError, match="threshold"):
        Envelope.from_dict(envelope_of(path)).verify([SSlibKey.from_crypto(other_key, keyid=key.keyid)], 1)
    changed = envelope_of(path)
    changed["payload"] = base64.b64encode(base64.b64decode(changed["payload"]) + b" ").decode()
    with pytest.raises(SSlibVerificationError, match="threshold"):
        Envelope.from_dict(changed).verify([key], 1)


def test_we_verify_an_envelope_signed_by_securesystemslib(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    path = signed(tmp_path / "a.tar.gz", keys[0])
    private = serialization.load_pem_private_key(keys[0].read_bytes(), password=None)
    public = signing.load_public_key(keys[1])
    theirs = CryptoSigner(private, SSlibKey.from_crypto(public, keyid=signing.keyid(public)))  # type: ignore[arg-type]
    st = statement_of(envelope_of(path))
    env = Envelope(canonical.dumps(st), attestation.PAYLOAD_TYPE, {})
    env.sign(theirs)
    raw = canonical.dumps(env.to_dict())
    members = unpack(path)
    repack(path, [*[(n, members[n]) for n in fmt.MEMBERS], (fmt.ATTESTATION_NAME, raw)])
    bundle = reader.open_bundle(path)
    bundle.verify()
    assert bundle.check_signature(public) == signing.keyid(public)


# --- refusals ----------------------------------------------------------------------------------


def test_unsigned_bundles_still_verify_but_are_not_signed(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "plain.tar.gz"
    write_bundle(path, meta(), lambda: iter(records()))
    code, out, err = run_cli(capsys, "lint", str(path))
    assert code == 0 and "note: not signed" in out, err
    code, _, err = run_cli(capsys, "lint", str(path), "--require-signature")
    one_line_2(code, err, "not signed")
    code, _, err = run_cli(capsys, "verify", str(path), "--key", str(keys[1]))
    one_line_2(code, err, "not signed")
    code, _, err = run_cli(capsys, "attestation", str(path))
    one_line_2(code, err, "not signed")


def test_another_key_is_refused(
    tmp_path: Path, keys: tuple[Path, Path], other_keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = signed(tmp_path / "a.tar.gz", other_keys[0])
    for cmd in ("verify", "lint"):
        code, _, err = run_cli(capsys, cmd, str(path), "--key", str(keys[1]))
        one_line_2(code, err, r"not signed by key [0-9a-f]{64} \(signed by keyid")


def _forge(path: Path) -> tuple[bytes, bytes, dict[str, bytes]]:
    """The forgery of issue 11: drop the /etc/passwd open and the loss events (and the manifest's
    loss), renumber, recompute every hash and count, keep the run id. Returns the forged (manifest,
    events) and the original members."""
    members = unpack(path)
    manifest = orjson.loads(members[fmt.MANIFEST_NAME])
    events = [orjson.loads(x) for x in members[fmt.EVENTS_NAME].splitlines()]
    kept = [e for e in events if e["subject"] != "/etc/passwd" and e["type"] != fmt.LOSS]
    assert len(kept) == len(events) - 2
    lines = []
    counts: dict[str, int] = {}
    for seq, e in enumerate(kept):
        e["seq"], e["id"] = seq, fmt.event_id(manifest["run_id"], seq)
        counts[e["type"]] = counts.get(e["type"], 0) + 1
        lines.append(canonical.dumps(e) + b"\n")
    body = b"".join(lines)
    manifest.update(
        events=len(kept),
        counts=dict(sorted(counts.items())),
        lost={"total": 0, "by_kind": {}},
        files={fmt.EVENTS_NAME: {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}},
        root_hash=fmt.root_hash(fmt.content_hash(e) for e in kept),
    )
    return canonical.dumps(manifest), body, members


def test_the_forgery_of_issue_11_is_refused(
    tmp_path: Path, keys: tuple[Path, Path], other_keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    recs = [*records(), open_(7500, "/etc/passwd", ["read"])]
    original = signed(tmp_path / "a.tar.gz", keys[0], recs, lost={"ringbuf": 3})
    m, body, members = _forge(original)
    # the forged members alone: a consistent bundle (lint without a key verifies it) but not signed
    stripped = repack(tmp_path / "stripped.tar.gz", [(fmt.MANIFEST_NAME, m), (fmt.EVENTS_NAME, body)])
    assert run_cli(capsys, "lint", str(stripped))[0] == 0
    code, _, err = run_cli(capsys, "verify", str(stripped), "--key", str(keys[1]))
    one_line_2(code, err, "not signed")
    one_line_2(*run_cli(capsys, "lint", str(stripped), "--key", str(keys[1]))[::2], "not signed")
    one_line_2(*run_cli(capsys, "lint", str(stripped), "--require-signature")[::2], "not signed")
    # the original attestation kept: its subjects give the forgery away, key or not
    kept = repack(
        tmp_path / "kept.tar.gz",
        [
            (fmt.MANIFEST_NAME, m),
            (fmt.EVENTS_NAME, body),
            (fmt.ATTESTATION_NAME, members[fmt.ATTESTATION_NAME]),
        ],
    )
    for argv in (["lint", str(kept)], ["verify", str(kept), "--key", str(keys[1])]):
        one_line_2(*run_cli(capsys, *argv)[::2], 'subject "manifest.json": digest does not match')
    # a new statement for the forgery, with the forger's own key: not signed by ours
    st = attestation.statement(
        orjson.loads(m), hashlib.sha256(m).hexdigest(), hashlib.sha256(body).hexdigest()
    )
    resigned = repack(
        tmp_path / "resigned.tar.gz",
        [(fmt.MANIFEST_NAME, m), (fmt.EVENTS_NAME, body), (fmt.ATTESTATION_NAME, resign(st, other_keys[0]))],
    )
    one_line_2(*run_cli(capsys, "verify", str(resigned), "--key", str(keys[1]))[::2], "not signed by key")
    # the new statement under the old signature: the signature does not verify
    env = envelope_of(original)
    env["payload"] = base64.b64encode(canonical.dumps(st)).decode()
    swapped = repack(
        tmp_path / "swapped.tar.gz",
        [(fmt.MANIFEST_NAME, m), (fmt.EVENTS_NAME, body), (fmt.ATTESTATION_NAME, canonical.dumps(env))],
    )
    assert run_cli(capsys, "lint", str(swapped))[0] == 0  # consistent, signature unchecked (said so)
    one_line_2(*run_cli(capsys, "verify", str(swapped), "--key", str(keys[1]))[::2], "does not verify")


def _hostile(members: dict[str, bytes], key: Path) -> dict[str, tuple[list[tuple[str, bytes]], str, bool]]:
    """name -> (members, expected reason, whether lint without a key refuses it too)."""
    m, ev, att = members[fmt.MANIFEST_NAME], members[fmt.EVENTS_NAME], members[fmt.ATTESTATION_NAME]
    env = orjson.loads(att)
    st = statement_of(env)
    manifest = orjson.loads(m)

    def with_env(**changes: Any) -> list[tuple[str, bytes]]:
        return [
            (fmt.MANIFEST_NAME, m),
            (fmt.EVENTS_NAME, ev),
            (fmt.ATTESTATION_NAME, canonical.dumps({**env, **changes})),
        ]

    def with_st(new: dict[str, Any]) -> list[tuple[str, bytes]]:  # re-signed with the right key
        return [(fmt.MANIFEST_NAME, m), (fmt.EVENTS_NAME, ev), (fmt.ATTESTATION_NAME, resign(new, key))]

    sig = env["signatures"][0]
    flipped = bytearray(base64.b64decode(sig["sig"]))
    flipped[0] ^= 1
    new_manifest = canonical.dumps({**manifest, "headers": {"x": "y"}})
    return {
        "wrong-payload-type": (with_env(payloadType="application/json"), "payloadType \"application/json\"", True),
        "duplicate-signatures": (with_env(signatures=[sig, sig]), "two signatures by keyid", True),
        "no-signatures": (with_env(signatures=[]), "no signatures", True),
        "bad-signature": (with_env(signatures=[{**sig, "sig": base64.b64encode(bytes(flipped)).decode()}]), "does not verify", False),
        "short-signature": (with_env(signatures=[{**sig, "sig": base64.b64encode(b"x" * 10).decode()}]), "not an ed25519 signature", True),
        "payload-not-base64": (with_env(payload="%%%"), "payload is not base64", True),
        "unknown-envelope-field": (with_env(extra=1), "unknown field", True),
        "not-canonical": ([(fmt.MANIFEST_NAME, m), (fmt.EVENTS_NAME, ev), (fmt.ATTESTATION_NAME, att + b" ")], "not canonical", True),
        "huge-envelope": ([(fmt.MANIFEST_NAME, m), (fmt.EVENTS_NAME, ev), (fmt.ATTESTATION_NAME, b" " * (fmt.MAX_ATTESTATION + 1))], "larger than the limit", True),
        "subject-named-twice": (with_st({**st, "subject": [st["subject"][0], *st["subject"]]}), "subject \"manifest.json\" is named twice", True),
        "subject-missing": (with_st({**st, "subject": st["subject"][:2]}), "no subject for", True),
        "subject-extra": (with_st({**st, "subject": [*st["subject"], {"name": "x", "digest": {"sha256": "0" * 64}}]}), "subject \"x\" is not a member", True),
        "subject-digest": (with_st({**st, "subject": [st["subject"][0], {**st["subject"][1], "digest": {"sha256": "0" * 64}}, st["subject"][2]]}), "subject \"events.ndjson\": digest does not match the member", True),
        "root-hash-subject": (with_st({**st, "subject": [*st["subject"][:2], {**st["subject"][2], "digest": {"sha256": "0" * 64}}]}), "does not match the run's root hash", True),
        "predicate-disagrees": (with_st({**st, "predicate": {**st["predicate"], "evidenceRun": {**st["predicate"]["evidenceRun"], "exitCode": 1}}}), "predicate's evidenceRun.exitCode disagrees with the manifest", True),
        "predicate-type": (with_st({**st, "predicateType": "https://slsa.dev/provenance/v1"}), "predicateType", True),
        "statement-type": (with_st({**st, "_type": "https://in-toto.io/Statement/v0.1"}), "statement _type", True),
        "manifest-changed": ([(fmt.MANIFEST_NAME, new_manifest), (fmt.EVENTS_NAME, ev), (fmt.ATTESTATION_NAME, att)], "subject \"manifest.json\": digest does not match", True),
        "second-attestation": ([(fmt.MANIFEST_NAME, m), (fmt.EVENTS_NAME, ev), (fmt.ATTESTATION_NAME, att), (fmt.ATTESTATION_NAME, att)], "duplicate member \"attestation.intoto.json\"", True),
        "extra-member": ([(fmt.MANIFEST_NAME, m), (fmt.EVENTS_NAME, ev), (fmt.ATTESTATION_NAME, att), ("x.json", b"{}")], "unexpected member \"x.json\"", True),
        "other-third-member": ([(fmt.MANIFEST_NAME, m), (fmt.EVENTS_NAME, ev), ("sig.json", att)], "unexpected member \"sig.json\"", True),
        "attestation-first": ([(fmt.ATTESTATION_NAME, att), (fmt.MANIFEST_NAME, m), (fmt.EVENTS_NAME, ev)], "\"attestation.intoto.json\" must be the last member", True),
    }  # fmt: skip


HOSTILE_NAMES = [
    "wrong-payload-type", "duplicate-signatures", "no-signatures", "bad-signature", "short-signature",
    "payload-not-base64", "unknown-envelope-field", "not-canonical", "huge-envelope", "subject-named-twice",
    "subject-missing", "subject-extra", "subject-digest", "root-hash-subject", "predicate-disagrees",
    "predicate-type", "statement-type", "manifest-changed", "second-attestation", "extra-member",
    "other-third-member", "attestation-first",
]  # fmt: skip


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory, keys: tuple[Path, Path]) -> dict[str, bytes]:
    return unpack(signed(tmp_path_factory.mktemp("pristine") / "a.tar.gz", keys[0]))


def test_hostile_names_cover_the_corpus(pristine: dict[str, bytes], keys: tuple[Path, Path]) -> None:
    assert sorted(_hostile(pristine, keys[0])) == sorted(HOSTILE_NAMES)


@pytest.mark.parametrize("case", HOSTILE_NAMES)
def test_hostile_attestation_is_refused_with_one_line(
    case: str,
    pristine: dict[str, bytes],
    keys: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    entries, expected, without_key = _hostile(pristine, keys[0])[case]
    path = repack(tmp_path / f"{case}.tar.gz", entries)
    one_line_2(*run_cli(capsys, "verify", str(path), "--key", str(keys[1]))[::2], expected)
    one_line_2(*run_cli(capsys, "lint", str(path), "--key", str(keys[1]))[::2], expected)
    code, _, err = run_cli(capsys, "lint", str(path))
    if without_key:
        one_line_2(code, err, expected)
    else:
        assert code == 0, err


def test_a_huge_envelope_is_refused_before_it_is_read(tmp_path: Path, pristine: dict[str, bytes]) -> None:
    """The size in the tar header is enough: a 64 MiB member is never read."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in fmt.MEMBERS:
            tar.addfile(tarinfo(name, len(pristine[name])), io.BytesIO(pristine[name]))
        tar.addfile(tarinfo(fmt.ATTESTATION_NAME, 64 << 20), io.BytesIO(b"\0" * (64 << 20)))
    path = tmp_path / "huge.tar.gz"
    path.write_bytes(gzip.compress(raw.getvalue(), compresslevel=1, mtime=0))
    bundle = reader.open_bundle(path)
    with pytest.raises(reader.VerificationError, match="larger than the limit of 8388608 bytes"):
        bundle.verify()


def test_run_through_an_agent_refuses_a_key(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["run", "--agent", str(tmp_path / "sock"), "--sign-key", str(keys[0]), "--", "true"]
    one_line_2(*run_cli(capsys, *argv)[::2], "--sign-key is not available with --agent")


def test_show_diff_and_profile_read_signed_bundles(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a = signed(tmp_path / "a.tar.gz", keys[0])
    b = tmp_path / "b.tar.gz"
    write_bundle(b, meta(), lambda: iter(records()))
    assert run_cli(capsys, "show", str(a))[0] == 0
    assert run_cli(capsys, "diff", str(a), str(b))[0] == 0
    assert run_cli(capsys, "profile", str(a))[0] == 0


_TAR_MUTATION = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_TAR_MUTATION
@given(st.data())
def test_a_bundle_that_verifies_after_any_tar_mutation_is_unchanged(
    pristine: dict[str, bytes], keys: tuple[Path, Path], tmp_path: Path, data: st.DataObject
) -> None:
    """Flip, cut or insert bytes anywhere in a signed bundle's tar: `verify --key` exits 0 only when
    every member is byte for byte the original (a change in tar padding, say), else 2."""
    names = [*fmt.MEMBERS, fmt.ATTESTATION_NAME]
    tar = bytearray(tar_bytes([(tarinfo(n, len(pristine[n])), pristine[n]) for n in names]))
    op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
    i = data.draw(st.integers(0, len(tar) - 1))
    if op == "flip":
        tar[i] ^= data.draw(st.integers(1, 255))
    elif op == "cut":
        del tar[i : i + data.draw(st.integers(1, 600))]
    else:
        tar[i:i] = data.draw(st.binary(min_size=1, max_size=64))
    path = tmp_path / "m.tar.gz"
    path.write_bytes(gzip.compress(bytes(tar), mtime=0))
    code = main(["verify", str(path), "--key", str(keys[1])])
    assert code in (0, 2)
    if code == 0:
        assert unpack(path) == pristine


def test_a_fifo_as_a_key_does_not_hang(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "key.pub"
    os.mkfifo(fifo)
    bundle = tmp_path / "a.tar.gz"
    write_bundle(bundle, meta(), lambda: iter(records()))
    one_line_2(*run_cli(capsys, "verify", str(bundle), "--key", str(fifo))[::2], "not a regular file")


def test_an_attestation_after_a_zero_block_is_refused(tmp_path: Path, pristine: dict[str, bytes]) -> None:
    def member(name: str) -> bytes:
        data = pristine[name]
        return tar_bytes([(tarinfo(name, len(data)), data)])[: 512 + -(-len(data) // 512) * 512]

    raw = member(fmt.MANIFEST_NAME) + member(fmt.EVENTS_NAME) + bytes(512) + member(fmt.ATTESTATION_NAME)
    path = tmp_path / "late.tar.gz"
    path.write_bytes(gzip.compress(raw + bytes(10240), mtime=0))
    with pytest.raises(reader.VerificationError, match="must be the last member, right after events.ndjson"):
        reader.open_bundle(path).verify()


def test_pae_is_the_dsse_spec_test_vector() -> None:
    assert (
        attestation.pae("http://example.com/HelloWorld", b"hello world")
        == b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )
    assert attestation.pae("t\u00e9", b"") == b"DSSEv1 3 t\xc3\xa9 0 "  # lengths in bytes, not characters


def test_keyid_is_the_sha256_of_the_der_subject_public_key_info() -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    # RFC 8032, section 7.1, test 1
    seed = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
    public = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
    signer = signing.KeySigner(Ed25519PrivateKey.from_private_bytes(seed))
    spki = bytes.fromhex("302a300506032b6570032100") + public  # the fixed DER prefix of an ed25519 key
    assert signer.keyid == hashlib.sha256(spki).hexdigest()
    assert signer.sign(b"").hex() == (
        "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e06522490155"
        "5fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
    )


def test_base64_in_the_envelope_is_canonical_standard_base64() -> None:
    assert attestation.b64decode("QQ==", "x") == b"A"
    for bad, why in (
        ("QR==", "not canonical"),
        ("QQ", "not base64"),
        ("-_8=", "not base64"),
        ("Q Q=", "not base64"),
    ):
        with pytest.raises(attestation.AttestationError, match=why):
            attestation.b64decode(bad, "x")


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8,
)


@_TAR_MUTATION
@given(st.data())
def test_any_mutation_of_the_statement_or_envelope_is_handled(
    pristine: dict[str, bytes], keys: tuple[Path, Path], tmp_path: Path, data: st.DataObject
) -> None:
    """Any value anywhere in the envelope or (re-signed with the right key) the statement: one line,
    exit 2, unless nothing changed."""
    env = orjson.loads(pristine[fmt.ATTESTATION_NAME])
    st_ = statement_of(env)
    where = data.draw(st.sampled_from(["envelope", "signature", "statement", "subject", "predicate"]))
    target = {
        "envelope": env,
        "signature": env["signatures"][0],
        "statement": st_,
        "subject": st_["subject"][data.draw(st.integers(0, 2))],
        "predicate": st_["predicate"],
    }[where]
    key = data.draw(st.sampled_from(sorted(target)) | st.text(max_size=6))
    if data.draw(st.booleans()):
        target[key] = data.draw(_json)
    else:
        target.pop(key, None)
    if where in ("envelope", "signature"):
        raw = canonical.dumps(env, check=False)
    else:
        raw = attestation.envelope(canonical.dumps(st_, check=False), [signing.load_signer(keys[0])])
    path = repack(
        tmp_path / "m.tar.gz",
        [
            (fmt.MANIFEST_NAME, pristine[fmt.MANIFEST_NAME]),
            (fmt.EVENTS_NAME, pristine[fmt.EVENTS_NAME]),
            (fmt.ATTESTATION_NAME, raw),
        ],
    )
    code = main(["verify", str(path), "--key", str(keys[1])])
    assert code in (0, 2)
    assert (code == 0) == (raw == pristine[fmt.ATTESTATION_NAME])


def test_a_bundle_signed_before_the_runtime_trace_still_verifies(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A bundle whose statement is the run predicate itself (PREDICATE_TYPE, as signed before the
    runtime trace) verifies, and its predicate is still held to the manifest."""
    members = unpack(signed(tmp_path / "new.tar.gz", keys[0]))
    m, ev = members[fmt.MANIFEST_NAME], members[fmt.EVENTS_NAME]
    old = attestation.run_statement(
        orjson.loads(m), hashlib.sha256(m).hexdigest(), hashlib.sha256(ev).hexdigest()
    )
    assert old["predicateType"] == attestation.PREDICATE_TYPE == "https://evidence.dev/attestation/run/v1"
    path = repack(
        tmp_path / "old.tar.gz",
        [(fmt.MANIFEST_NAME, m), (fmt.EVENTS_NAME, ev), (fmt.ATTESTATION_NAME, resign(old, keys[0]))],
    )
    code, out, _ = run_cli(capsys, "verify", str(path), "--key", str(keys[1]))
    assert code == 0 and "verified and signed" in out
    bad = {**old, "predicate": {**old["predicate"], "exitCode": 9}}
    path = repack(
        tmp_path / "bad.tar.gz",
        [(fmt.MANIFEST_NAME, m), (fmt.EVENTS_NAME, ev), (fmt.ATTESTATION_NAME, resign(bad, keys[0]))],
    )
    one_line_2(
        *run_cli(capsys, "verify", str(path), "--key", str(keys[1]))[::2], "predicate's exitCode disagrees"
    )


def test_the_run_predicate_json_has_the_models_fields() -> None:
    """attestation.RunPredicateJSON (what predicate() returns, typed) names RunPredicate's fields."""
    td = attestation.RunPredicateJSON
    assert td.__required_keys__ | td.__optional_keys__ == set(attestation.RunPredicate.model_fields)


def test_a_relabelled_signature_does_not_verify(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    """DSSE signs the payload, not the keyid beside the signature: an envelope whose keyid was changed
    (hypothesis found one hex digit flipped) is altered, and `verify --key` must say so (exit 2)."""
    bundle = signed(tmp_path / "a.tar.gz", keys[0])
    members = unpack(bundle)
    envelope = json.loads(members[fmt.ATTESTATION_NAME])
    label = envelope["signatures"][0]["keyid"]
    envelope["signatures"][0]["keyid"] = ("0" if label[0] != "0" else "1") + label[1:]
    members[fmt.ATTESTATION_NAME] = json.dumps(envelope, separators=(",", ":"), sort_keys=True).encode()
    names = [*fmt.MEMBERS, fmt.ATTESTATION_NAME]
    tar = tar_bytes([(tarinfo(n, len(members[n])), members[n]) for n in names])
    path = tmp_path / "relabelled.tar.gz"
    path.write_bytes(gzip.compress(tar, mtime=0))
    assert main(["verify", str(path), "--key", str(keys[1])]) == 2
