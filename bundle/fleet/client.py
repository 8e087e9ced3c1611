"""The I/O half of bundle/fleet: connecting to a fleet's NATS servers, the JetStream layout, and
the reads `evidence fleet` makes (index entries, bundles). nats-py (the `fleet` extra) is imported
here and nowhere else on the reader's side.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import hashlib
import json
import logging
import re
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext, api
from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError
from nats.js.kv import MSG_ROLLUP_SUBJECT
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_DEFAULT_CHUNK_SIZE, OBJ_META_PRE_TEMPLATE
from nats.nuid import NUID

from evidence.bundle.fleet import names
from evidence.bundle.fleet.models import IndexEntry
from evidence.errors import BundleError, SetupError, UsageError

logger = logging.getLogger(__name__)

EVENTS_DUPLICATE_WINDOW = 600.0  # seconds in which a retried event (same Nats-Msg-Id) is dropped


class Unreachable(SetupError):
    """The fleet's servers cannot be reached, or refused the credentials (exit 70)."""


def tls_context(ca: Path | None) -> ssl.SSLContext | None:
    if ca is None:
        return None
    try:
        return ssl.create_default_context(cafile=str(ca))
    except (OSError, ssl.SSLError) as e:
        raise UsageError(f"cannot use the TLS CA {ca}: {e}") from None


def auth_options(creds: Path | None, nkey_seed: Path | None) -> dict[str, Any]:
    """nats-py's connect options for a credentials file or an NKey seed file (read here, so that a
    missing or unreadable one is one line)."""
    opts: dict[str, Any] = {}
    for label, path in (("credentials file", creds), ("NKey seed file", nkey_seed)):
        if path is None:
            continue
        try:
            text = Path(path).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read the {label} {path}: {getattr(e, 'strerror', None) or e}") from None
        if label == "NKey seed file":
            seed = text.strip()
            if not seed.startswith("SU"):
                raise UsageError(f"{path} holds no user NKey seed (SU...)")
            opts["nkeys_seed_str"] = seed
        else:
            if "-----BEGIN USER NKEY SEED-----" not in text:
                raise UsageError(f"{path} is not a NATS credentials file")
            opts["user_credentials"] = str(path)
    return opts


_CREDS_BLOCK = re.compile(rb"-{3,}[^\n]*-{3,}\r?\n([\w\-.=]+)\r?\n-{3,}[^\n]*-{3,}")


def signer(creds: Path | None, nkey_seed: Path | None) -> Callable[[str], dict[str, str]]:
    """The CONNECT fields that answer a server's nonce, for a connection of our own (the agent's
    events, agent/daemon/fleet_wire.py): `{"nkey", "sig"}` for an NKey seed file,
    `{"jwt", "sig"}` for a credentials file (its user JWT, then its seed); read at each connect,
    so a rotated file is used. UsageError (one line) when the file is not one."""
    import nkeys

    def read(path: Path) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise UsageError(f"cannot read {path}: {e.strerror or e}") from None

    def sign(seed: bytes, nonce: str) -> str:
        try:
            kp = nkeys.from_seed(bytearray(seed.strip()))
        except Exception as e:
            raise UsageError(f"not a user NKey seed: {e}") from None
        try:
            return base64.urlsafe_b64encode(kp.sign(nonce.encode())).rstrip(b"=").decode()
        finally:
            kp.wipe()

    if nkey_seed is not None:
        path = nkey_seed

        def by_seed(nonce: str) -> dict[str, str]:
            seed = read(path)
            try:
                kp = nkeys.from_seed(bytearray(seed.strip()))
                public = kp.public_key.decode()
                kp.wipe()
            except Exception as e:
                raise UsageError(f"{path} holds no user NKey seed: {e}") from None
            return {"nkey": public, "sig": sign(seed, nonce)}

        return by_seed
    if creds is not None:
        cpath = creds

        def by_creds(nonce: str) -> dict[str, str]:
            blocks = _CREDS_BLOCK.findall(read(cpath))
            if len(blocks) < 2:
                raise UsageError(f"{cpath} is not a NATS credentials file (a user JWT and a seed)")
            return {"jwt": blocks[0].decode(), "sig": sign(blocks[1], nonce)}

        return by_creds
    return lambda nonce: {}


async def connect(
    servers: list[str],
    *,
    creds: Path | None = None,
    nkey_seed: Path | None = None,
    tls_ca: Path | None = None,
    name: str = "evidence",
    forever: bool = False,
    inbox_prefix: str | None = None,
    timeout: float = 5.0,
    **callbacks: Callable[..., Awaitable[None]],
) -> NATS:
    """A connection. `forever` (the agent): keep trying and reconnecting for good; otherwise (the
    CLI) one try, Unreachable when it fails."""
    opts = auth_options(creds, nkey_seed)
    tls = tls_context(tls_ca)
    if tls is not None:
        opts["tls"] = tls
    if inbox_prefix is not None:
        opts["inbox_prefix"] = inbox_prefix

    last: list[Exception] = []
    error_cb = callbacks.pop("error_cb", None)

    async def on_error(e: Exception) -> None:  # the CLI reports the last error itself, once
        last.append(e)
        logger.debug("nats: %s", e)
        if error_cb is not None:
            await error_cb(e)

    options: dict[str, Any] = dict(
        name=name,
        connect_timeout=int(max(1, timeout)),
        # one try a server (nats-py 2.16 loops for good on a refused first connect with
        # allow_reconnect off: measured; with it on and one attempt, it gives up)
        reconnect_time_wait=1 if forever else 0.2,
        max_reconnect_attempts=-1 if forever else 1,
        allow_reconnect=True,
        error_cb=on_error,
        **callbacks,
        **opts,
    )
    # each first connect bounded: nats-py 2.16 waits for good after a refused TLS handshake (the
    # agent then tries again; the CLI says why it could not)
    limit = timeout * max(1, len(servers)) + 1
    while True:
        nc = NATS()
        try:
            await asyncio.wait_for(nc.connect(servers, **options), limit)
            return nc
        except (TimeoutError, OSError, nats.errors.Error) as e:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2)
            why: Exception = (
                last[-1] if isinstance(e, nats.errors.NoServersError | TimeoutError) and last else e
            )
            if not forever:
                raise Unreachable(
                    f"cannot connect to {', '.join(servers)}: {str(why) or type(why).__name__}",
                    hint="check the servers, the credentials and that the cluster is up",
                ) from None
            if isinstance(e, TimeoutError) and error_cb is not None:
                await error_cb(why)
            await asyncio.sleep(1.0)


async def ensure_layout(js: JetStreamContext, replicas: int = 1, node: str | None = None) -> None:
    """The events stream and the index, or (with `node`) that node's bundle bucket, made when
    missing (a node's bucket with as many replicas as the events stream has, if more); an existing
    one is left as its operator configured it."""
    if node is not None:
        bucket = names.bundle_bucket(node)
        try:
            await js.object_store(bucket)
        except BucketNotFoundError:
            # as many copies as the events stream the operator made (a node's bucket at R1 in a
            # cluster would be lost with the one server holding it)
            with contextlib.suppress(NotFoundError):
                replicas = max(replicas, (await js.stream_info(names.EVENTS_STREAM)).config.num_replicas or 1)
            await js.create_object_store(
                bucket=bucket,
                config=api.ObjectStoreConfig(bucket=bucket, replicas=replicas, storage=api.StorageType.FILE),
            )
            logger.info("made object store %s (replicas %d)", bucket, replicas)
        return
    try:
        await js.stream_info(names.EVENTS_STREAM)
    except NotFoundError:
        await js.add_stream(
            name=names.EVENTS_STREAM,
            subjects=[f"{names.EVENTS_PREFIX}.>"],
            storage=api.StorageType.FILE,
            num_replicas=replicas,
            duplicate_window=EVENTS_DUPLICATE_WINDOW,
            allow_direct=True,
        )
        logger.info("made stream %s (replicas %d)", names.EVENTS_STREAM, replicas)
    try:
        await js.key_value(names.INDEX_BUCKET)
    except BucketNotFoundError:
        await js.create_key_value(
            bucket=names.INDEX_BUCKET, history=1, replicas=replicas, storage=api.StorageType.FILE
        )
        logger.info("made key-value bucket %s (replicas %d)", names.INDEX_BUCKET, replicas)


def object_digest(sha256_hex: str) -> str:
    """The object store's digest string of a sha256 (nats: `SHA-256=<base64url>`)."""
    return "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(sha256_hex)).decode()


_NUID = NUID()


async def put_new(
    js: JetStreamContext, bucket: str, name: str, data: bytes | BinaryIO, sha256_hex: str, size: int
) -> None:
    """Store an object the bucket does not hold yet (the caller looked: nothing is overwritten), as
    nats-py's `ObjectStore.put` writes one: its chunks under a new NUID, then its meta (the same
    subject, fields and roll-up header; `fleet get` reads it with nats-py), each publish
    acknowledged by JetStream or raising. Without what `put` adds around that: a look-up of the
    name before (the caller's own is the one that counts) and, in the agent, a read back after (the
    meta JetStream acknowledged is the one written here, naming the digest of the bytes sent).
    Those bytes must be `size` bytes of SHA-256 `sha256_hex`, else ValueError before the meta is
    written: chunks that no meta names are never an object."""
    nuid = _NUID.next().decode()
    chunk_subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid)
    meta_subject = OBJ_META_PRE_TEMPLATE.format(
        bucket=bucket, obj=base64.urlsafe_b64encode(name.encode()).decode()
    )
    h = hashlib.sha256()
    total = chunks = 0
    loop = asyncio.get_running_loop()
    whole = data if isinstance(data, bytes) else None
    while True:
        if whole is not None:
            chunk = whole[total : total + OBJ_DEFAULT_CHUNK_SIZE]
        else:
            assert not isinstance(data, bytes)
            chunk = await loop.run_in_executor(None, data.read, OBJ_DEFAULT_CHUNK_SIZE)
        if not chunk:
            break
        h.update(chunk)
        await js.publish(chunk_subject, chunk)
        total += len(chunk)
        chunks += 1
    if total != size or h.hexdigest() != sha256_hex:
        raise ValueError(
            f"the bundle read ({total} bytes, sha256 {h.hexdigest()}) is not the one queued "
            f"({size} bytes, sha256 {sha256_hex}): changed since"
        )
    info = api.ObjectInfo(
        name=name,
        bucket=bucket,
        nuid=nuid,
        size=total,
        chunks=chunks,
        mtime=datetime.datetime.now(datetime.UTC).isoformat(),
        digest=object_digest(sha256_hex),
        options=api.ObjectMetaOptions(max_chunk_size=OBJ_DEFAULT_CHUNK_SIZE),
    )
    await js.publish(
        meta_subject, json.dumps(info.as_dict()).encode(), headers={api.Header.ROLLUP: MSG_ROLLUP_SUBJECT}
    )


# --- reading ---------------------------------------------------------------------------------------


async def index_entries(js: JetStreamContext, node: str | None = None) -> list[IndexEntry]:
    """Every entry of the index (one node's: filtered by the server), read through a pull consumer
    of the bucket's last entry per key (no bundle is read). An entry that is not one is logged and
    left out.

    Not nats-py's `KeyValue.watch`: its end-of-initial-values marker may come before values the
    server has already sent (nats.py #842, still open in 2.16), and a listing that drops a run
    without a word is what a user must never get. The end here is the server's own count: the
    consumer has nothing pending."""
    stream = f"KV_{names.INDEX_BUCKET}"
    prefix = f"$KV.{names.INDEX_BUCKET}."
    try:
        psub = await js.pull_subscribe(
            prefix + (f"{names.check_node(node)}.*" if node else ">"),
            stream=stream,
            config=api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
                ack_policy=api.AckPolicy.NONE,
                inactive_threshold=60.0,  # the server drops it if we die before deleting it
                mem_storage=True,
                num_replicas=1,
            ),
        )
    except NotFoundError:
        return []
    out: list[IndexEntry] = []
    consumer: str | None = None
    try:
        info = await psub.consumer_info()
        consumer, pending = info.name, info.num_pending  # (a pull consumer: none in flight)
        empty = 0
        while pending:
            try:
                msgs = await psub.fetch(min(pending, INDEX_BATCH), timeout=INDEX_WAIT)
                empty = 0
            except nats.errors.TimeoutError:
                msgs = []
                empty += 1
                if empty > 1:
                    raise Unreachable(
                        f"the fleet's index counts {pending} entries more but does not send them",
                        "try again; if it persists, check the servers' health (nats server report jetstream)",
                    ) from None
            for msg in msgs:
                entry = _index_entry(msg.subject[len(prefix) :], msg.headers, msg.data)
                if entry is not None:
                    out.append(entry)
            pending = msgs[-1].metadata.num_pending if msgs else 0
            if not pending:  # what the last message said may be stale: the server's count decides
                pending = (await psub.consumer_info()).num_pending
    finally:
        if consumer is not None:
            with contextlib.suppress(Exception):  # best effort: the inactive threshold removes it anyway
                await js.delete_consumer(stream, consumer)
        with contextlib.suppress(Exception):
            await psub.unsubscribe()
    return out


INDEX_BATCH = 512  # index entries fetched at a time
INDEX_WAIT = 5.0  # seconds one fetch may wait for entries the server counts as pending


def _index_entry(key: str, headers: dict[str, str] | None, value: bytes) -> IndexEntry | None:
    """An index entry from its key and message; None for a deleted key or one that is no entry."""
    if headers and headers.get("KV-Operation") in ("DEL", "PURGE"):
        return None
    try:
        written_by, _ = names.split_key(key)
        return IndexEntry.from_json(value, key=key, written_by=written_by)
    except (BundleError, UsageError) as e:
        logger.warning("%s", e.message)
        return None


async def fetch_bundle(js: JetStreamContext, entry: IndexEntry, out: BinaryIO) -> None:
    """Write the run's bundle to `out`: the object store checks the object's own SHA-256 as it
    reads, and this checks it (and the size) against the index entry. BundleError when either
    differs or the bundle is not there."""
    try:
        store = await js.object_store(names.bundle_bucket(entry.node))
        info = await store.get_info(entry.key)
    except BucketNotFoundError:
        raise BundleError(
            f"run {entry.key}: the index lists it, node {entry.node} has no bundle bucket"
        ) from None
    except ObjectNotFoundError:
        raise BundleError(f"run {entry.key}: the index lists it, the bucket has no bundle") from None
    if info.digest != object_digest(entry.bundle_sha256) or info.size != entry.bundle_size:
        raise BundleError(
            f"run {entry.key}: the bucket's bundle ({info.size} bytes, {info.digest}) is not the one the "
            f"index names ({entry.bundle_size} bytes, sha256 {entry.bundle_sha256})"
        )
    h = hashlib.sha256()

    class _Tee:
        def write(self, data: bytes) -> int:
            h.update(data)
            return out.write(data)

    try:
        await store.get(entry.key, writeinto=_Tee())  # type: ignore[arg-type]
    except nats.js.errors.DigestMismatchError:
        raise BundleError(f"run {entry.key}: the bundle read from the bucket fails its SHA-256") from None
    if h.hexdigest() != entry.bundle_sha256:
        raise BundleError(f"run {entry.key}: the bundle read is not the one the index names (sha256)")
