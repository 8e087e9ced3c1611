"""`evidence fleet`: a fleet's runs, bundles and live events on NATS JetStream, for people.

    evidence fleet [--server URL]... [--creds FILE | --nkey FILE] [--tls-ca FILE] ACTION
      ls [--node N] [--label K=V]... [--since 24h] [--failed] [--format text|json]
      get RUN -o FILE [--key KEY.pub]
      follow [--node N] [--run SESSION] [--since 10m] [--count N] [--format text|json]
      baseline build --label job=X [--node N] [--last 50] [--ignore RE]... [--key KEY.pub] > b.json
      diff --baseline b.json RUN [--min-runs N] [--format ...] [--fail-on ...] [--ignore RE]...
      init [--replicas 3]

RUN is an index key (`<node>.<session>`), a session id, or a run id (which the same behaviour
shares: when several runs have it, the command lists their keys and asks for one). Every bundle
fetched is checked three ways before it is used: the object store's SHA-256 as it is read, the
digest and size the run's index entry names, and the bundle's own verification (`evidence verify`'s;
with `--key`, its signature too). Needs the `fleet` extra (nats-py); no BCC, no root.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import importlib.util
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from evidence.bundle import format as fmt
from evidence.bundle.text import printable as escape
from evidence.errors import EXIT_OK, BundleError, SetupError, UsageError

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from evidence.bundle.fleet.models import IndexEntry
    from evidence.bundle.read_types import ManifestJSON

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}


# --- pure helpers -----------------------------------------------------------------------------------


def parse_since(text: str, now_ns: int) -> int:
    """`--since`: a duration back from now (90s, 30m, 24h, 7d) or an RFC 3339 UTC time -> ns."""
    m = _DURATION.fullmatch(text.strip())
    if m:
        return now_ns - int(float(m.group(1)) * _UNIT[m.group(2)] * 1_000_000_000)
    try:
        return fmt.parse_time(text)
    except ValueError:
        raise UsageError(
            f"--since {text!r}: give a duration (30m, 24h, 7d) or an RFC 3339 UTC time"
        ) from None


def parse_labels(pairs: Sequence[str]) -> dict[str, str]:
    out = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k:
            raise UsageError(f"--label {p!r}: give KEY=VALUE")
        out[k] = v
    return out


def select(
    entries: Sequence[IndexEntry],
    *,
    labels: dict[str, str] | None = None,
    since_ns: int | None = None,
    failed: bool = False,
) -> list[IndexEntry]:
    """The entries that match, newest first."""
    out = [
        e
        for e in entries
        if all(e.labels.get(k) == v for k, v in (labels or {}).items())
        and (since_ns is None or e.finished_ns >= since_ns)
        and (not failed or e.failed)
    ]
    return sorted(out, key=lambda e: (e.finished_ns, e.key), reverse=True)


def resolve(entries: Sequence[IndexEntry], run: str) -> IndexEntry:
    """The one entry RUN names (key, session id or run id); UsageError when none or several."""
    if "." in run:
        found = [e for e in entries if e.key == run]
    elif run.startswith("run-"):
        found = [e for e in entries if e.run_id == run]
    else:
        found = [e for e in entries if e.session_id == run]
    if not found:
        raise UsageError(f"no run {run!r} in the fleet's index")
    if len(found) > 1:
        keys = ", ".join(sorted(e.key for e in found)[:10])
        raise UsageError(f"{run!r} names {len(found)} runs: give one of their keys ({keys})")
    return found[0]


def _exit(e: IndexEntry) -> str:
    if e.cut_short:
        return "cut short"
    if e.signal:
        return e.signal
    return str(e.exit_code)


def render_ls(entries: Sequence[IndexEntry]) -> str:
    rows = [("FINISHED", "NODE", "SESSION", "RUN", "EXIT", "LINT E/W/N", "LOST", "LABELS", "COMMAND")]
    for e in entries:
        lint = f"{e.lint.error}/{e.lint.warning}/{e.lint.note}" if e.lint else "unread"
        labels = ",".join(f"{k}={v}" for k, v in sorted(e.labels.items()))
        rows.append(
            (e.finished_at[:19] + "Z", e.node, e.session_id, e.run_id[:16], _exit(e), lint, str(e.lost), labels,
             " ".join(e.command))
        )  # fmt: skip
    widths = [max(len(escape(r[i])) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        "  ".join(escape(c).ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + escape(r[-1])
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def render_event(event: dict[str, Any], node: str) -> str:
    return (
        escape(
            f"{event.get('time', '')}  {node}  {event.get('sessionid', '')}  {event.get('type', '')}  {event.get('subject', '')}"
        )
        + "\n"
    )


# --- I/O --------------------------------------------------------------------------------------------


def _require_fleet_extra() -> None:
    if importlib.util.find_spec("nats") is None:
        raise SetupError(
            "evidence fleet needs the fleet extra (nats-py is not installed): pip install 'evidence[fleet]'"
        )


async def _with_js(args: argparse.Namespace, body: Callable[[JetStreamContext], Awaitable[T]]) -> T:
    from evidence.bundle.fleet import client

    servers = args.server or [s for s in os.environ.get("EVIDENCE_FLEET_SERVERS", "").split(",") if s]
    if not servers:
        raise UsageError("no servers: give --server nats://HOST:4222 or set EVIDENCE_FLEET_SERVERS")
    nc = await client.connect(
        servers,
        creds=_path(args.creds or os.environ.get("EVIDENCE_FLEET_CREDS")),
        nkey_seed=_path(args.nkey or os.environ.get("EVIDENCE_FLEET_NKEY")),
        tls_ca=_path(args.tls_ca or os.environ.get("EVIDENCE_FLEET_TLS_CA")),
        name="evidence fleet",
    )
    try:
        return await body(nc.jetstream(timeout=10))
    except (TimeoutError, OSError) as e:
        raise client.Unreachable(f"the fleet's servers stopped answering: {e or type(e).__name__}") from None
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 2)


def _path(text: str | None) -> Path | None:
    return Path(text) if text else None


def _run(args: argparse.Namespace, body: Callable[[JetStreamContext], Awaitable[T]]) -> T:
    _require_fleet_extra()
    import nats.errors

    try:
        return asyncio.run(_with_js(args, body))
    except nats.errors.Error as e:
        from evidence.bundle.fleet.client import Unreachable

        raise Unreachable(f"the fleet's servers refused: {e}") from None


async def _fetch(
    js: JetStreamContext, entry: IndexEntry, target: Path, key: Any
) -> tuple[ManifestJSON, str | None]:
    """Fetch and verify a run's bundle into `target` (0600, whole or not at all): (manifest, the
    keyid checked with `key`)."""
    from evidence.bundle import reader
    from evidence.bundle.fleet import client

    fd, tmp = tempfile.mkstemp(prefix=".evidence-", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            await client.fetch_bundle(js, entry, out)
            out.flush()
            os.fsync(out.fileno())
        bundle = reader.open_bundle(tmp)
        bundle.verify()
        keyid = bundle.check_signature(key) if key is not None else None
        manifest = bundle.manifest
        if manifest.get("session_id") != entry.session_id or manifest.get("run_id") != entry.run_id:
            raise BundleError(
                f"run {entry.key}: the bundle is of session {manifest.get('session_id')}, run "
                f"{manifest.get('run_id')}: not the run the index names"
            )
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return manifest, keyid


def _key(args: argparse.Namespace) -> Any:
    if not getattr(args, "key", None):
        return None
    from evidence.bundle import signing

    return signing.load_public_key(args.key)


def cmd_ls(args: argparse.Namespace) -> int:
    from evidence.bundle.fleet import client

    labels = parse_labels(args.label)
    since = parse_since(args.since, time.time_ns()) if args.since else None
    entries = _run(args, lambda js: client.index_entries(js, args.node))
    chosen = select(entries, labels=labels, since_ns=since, failed=args.failed)
    if args.format == "json":
        sys.stdout.write(
            orjson.dumps([e.model_dump() for e in chosen], option=orjson.OPT_SORT_KEYS).decode() + "\n"
        )
    else:
        sys.stdout.write(render_ls(chosen))
    return EXIT_OK


def cmd_get(args: argparse.Namespace) -> int:
    from evidence.bundle.fleet import client, names

    key = _key(args)
    target = Path(args.output)

    async def body(js: JetStreamContext) -> str:
        node = args.run.split(".")[0] if "." in args.run else None
        if node is not None:
            names.split_key(args.run)
        entry = resolve(await client.index_entries(js, node), args.run)
        manifest, keyid = await _fetch(js, entry, target, key)
        signed = (
            f", signed by keyid {keyid}"
            if keyid
            else (", signed (not checked: give --key)" if entry.signer_keyid else "")
        )
        return (
            f"{target}: run {entry.key} ({manifest['run_id']}), {manifest['events']} events, verified{signed}"
        )

    print(f"evidence: {_run(args, body)}", file=sys.stderr)
    return EXIT_OK


def cmd_follow(args: argparse.Namespace) -> int:
    from evidence.bundle.fleet import binding, names

    subject = names.events_filter(args.node, args.run)
    since = parse_since(args.since, time.time_ns()) if args.since else None

    async def body(js: JetStreamContext) -> int:
        from nats.js import api
        from nats.js.errors import NotFoundError

        try:
            await js.stream_info(names.EVENTS_STREAM)
        except NotFoundError:
            raise UsageError(f"the fleet has no stream {names.EVENTS_STREAM} yet") from None
        if since is not None:
            cfg = api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_TIME,
                opt_start_time=_dt.datetime.fromtimestamp(since / 1e9, _dt.UTC),
            )
        else:
            cfg = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.NEW)
        sub = await js.subscribe(subject, ordered_consumer=True, config=cfg, stream=names.EVENTS_STREAM)
        seen = 0
        behind = False
        last_progress = time.monotonic()
        try:
            while args.count is None or seen < args.count:
                try:
                    msg = await sub.next_msg(timeout=args.idle if args.idle else 3600)
                except TimeoutError:
                    if args.idle:
                        break
                    continue
                seen += 1
                pending = msg.metadata.num_pending
                if pending > args.behind and not behind:
                    behind = True
                    print(f"evidence: behind the stream by {pending} events; catching up", file=sys.stderr)
                elif behind and pending == 0:
                    behind = False
                    print(f"evidence: caught up ({seen} events so far)", file=sys.stderr)
                elif time.monotonic() - last_progress >= 10:
                    print(f"evidence: {seen} events, {pending} to come", file=sys.stderr)
                    last_progress = time.monotonic()
                try:
                    event = binding.from_message(msg.headers, msg.data)
                except ValueError as e:
                    print(f"evidence: {msg.subject}: skipped: {e}", file=sys.stderr)
                    continue
                node = names.node_of_subject(msg.subject) or "?"
                if args.format == "json":
                    out = orjson.dumps({**event, "node": node}, option=orjson.OPT_SORT_KEYS).decode() + "\n"
                else:
                    out = render_event(event, node)
                sys.stdout.write(out)
                sys.stdout.flush()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return seen

    _run(args, body)
    return EXIT_OK


def _fetch_many(args: argparse.Namespace, directory: Path) -> list[str]:
    from evidence.bundle.fleet import client

    labels = parse_labels(args.label)
    key = _key(args)

    async def body(js: JetStreamContext) -> list[str]:
        chosen = select(await client.index_entries(js, args.node), labels=labels)[: args.last]
        if not chosen:
            raise UsageError("no run in the fleet's index matches")
        paths = []
        for entry in reversed(chosen):  # oldest first, as `baseline build` lists them
            path = directory / f"{entry.key}.tar.gz"
            await _fetch(js, entry, path, key)
            paths.append(str(path))
        return paths

    return _run(args, body)


def cmd_baseline(args: argparse.Namespace) -> int:
    from evidence.bundle import baseline, diff

    diff.check_patterns(args.ignore)
    if not args.label and not args.node:
        raise UsageError("fleet baseline build needs --label K=V (or --node): the runs of one job")
    with tempfile.TemporaryDirectory(prefix="evidence-fleet-") as tmp:
        paths = _fetch_many(args, Path(tmp))
        sys.stdout.writelines(baseline.chunks(baseline.build(paths, args.ignore)))
    print(f"evidence: baseline of {len(paths)} runs", file=sys.stderr)
    return EXIT_OK


def cmd_diff(args: argparse.Namespace) -> int:
    from evidence.bundle import baseline, diff
    from evidence.bundle.fleet import client

    diff.check_patterns(args.ignore)
    baseline.load(args.baseline)  # a bad baseline is bad input before anything is fetched
    key = _key(args)
    with tempfile.TemporaryDirectory(prefix="evidence-fleet-") as tmp:

        async def body(js: JetStreamContext) -> Path:
            node = args.run.split(".")[0] if "." in args.run else None
            entry = resolve(await client.index_entries(js, node), args.run)
            path = Path(tmp) / f"{entry.key}.tar.gz"
            await _fetch(js, entry, path, key)
            return path

        path = _run(args, body)
        found = baseline.diff_against(args.baseline, str(path), args.min_runs, args.ignore)
        code = diff.exit_code(found.changes, args.fail_on)
        sys.stdout.write(
            diff.render(found.baseline, found.new, found.changes, args.format, code, found.ignore)
        )
        return code


def cmd_init(args: argparse.Namespace) -> int:
    from evidence.bundle.fleet import client

    _run(args, lambda js: client.ensure_layout(js, args.replicas))
    print(
        f"evidence: stream, index and bundle bucket ready (replicas {args.replicas} where made)",
        file=sys.stderr,
    )
    return EXIT_OK


# --- command ----------------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="URL",
        help="a NATS server (repeatable; default $EVIDENCE_FLEET_SERVERS, comma separated)",
    )
    cred = parser.add_mutually_exclusive_group()
    cred.add_argument("--creds", metavar="FILE", help="NATS credentials file (default $EVIDENCE_FLEET_CREDS)")
    cred.add_argument(
        "--nkey", metavar="FILE", help="file with a user NKey seed (default $EVIDENCE_FLEET_NKEY)"
    )
    parser.add_argument("--tls-ca", metavar="FILE", help="CA for the servers' TLS certificates")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    ls = sub.add_parser("ls", help="list the fleet's runs from the index (no bundle is read)")
    ls.add_argument("--node", help="only this node's runs")
    ls.add_argument(
        "--label", action="append", default=[], metavar="K=V", help="only runs with this label (repeatable)"
    )
    ls.add_argument(
        "--since", metavar="AGE|TIME", help="only runs finished since (30m, 24h, 7d, or RFC 3339)"
    )
    ls.add_argument("--failed", action="store_true", help="only runs that did not exit 0 (or were cut short)")
    ls.add_argument("--format", choices=("text", "json"), default="text")
    ls.set_defaults(_run=cmd_ls)

    get = sub.add_parser("get", help="fetch a run's bundle, verified")
    get.add_argument("run", metavar="RUN", help="<node>.<session>, a session id, or a run id")
    get.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the bundle")
    get.add_argument("--key", metavar="KEY.pub", help="exit 2 unless the bundle is signed by this key")
    get.set_defaults(_run=cmd_get)

    fol = sub.add_parser("follow", help="print live events as they arrive")
    fol.add_argument("--node", help="only this node's events")
    fol.add_argument("--run", metavar="SESSION", help="only this session's events")
    fol.add_argument("--since", metavar="AGE|TIME", help="start that far back (default: new events only)")
    fol.add_argument("--count", type=int, metavar="N", help="stop after N events")
    fol.add_argument("--idle", type=float, metavar="SECONDS", help="stop after this long without an event")
    fol.add_argument(
        "--behind",
        type=int,
        default=1000,
        metavar="N",
        help="say so when more than N events are still to come (default 1000)",
    )
    fol.add_argument("--format", choices=("text", "json"), default="text")
    fol.set_defaults(_run=cmd_follow)

    bl = sub.add_parser("baseline", help="build a baseline from the fleet's last runs of a job")
    blsub = bl.add_subparsers(dest="baseline_action", metavar="ACTION", required=True)
    build = blsub.add_parser("build", help="write a baseline (JSON, on stdout) of the last runs that match")
    build.add_argument("--label", action="append", default=[], metavar="K=V", help="the job's label(s)")
    build.add_argument("--node", help="only this node's runs")
    build.add_argument("--last", type=int, default=50, metavar="N", help="the N newest runs (default 50)")
    build.add_argument("--ignore", action="append", default=[], metavar="PATTERN", help="as baseline build's")
    build.add_argument("--key", metavar="KEY.pub", help="every bundle must be signed by this key")
    build.set_defaults(_run=cmd_baseline)

    df = sub.add_parser("diff", help="what a run did that a baseline has not seen")
    df.add_argument("--baseline", required=True, metavar="FILE", help="a baseline (fleet baseline build)")
    df.add_argument("run", metavar="RUN", help="<node>.<session>, a session id, or a run id")
    df.add_argument("--min-runs", type=int, metavar="N", help="known means seen in at least N of its runs")
    df.add_argument("--format", choices=("text", "json", "markdown"), default="text")
    df.add_argument("--fail-on", choices=("added", "removed", "changed", "any", "none"), default="added")
    df.add_argument("--ignore", action="append", default=[], metavar="PATTERN")
    df.add_argument("--key", metavar="KEY.pub", help="exit 2 unless the bundle is signed by this key")
    df.set_defaults(_run=cmd_diff)

    init = sub.add_parser("init", help="make the stream and buckets (an operator's credentials)")
    init.add_argument("--replicas", type=int, default=1, choices=(1, 3, 5))
    init.set_defaults(_run=cmd_init)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "last", None) is not None and args.last < 1:
        raise UsageError("--last must be at least 1")
    return int(args._run(args))
