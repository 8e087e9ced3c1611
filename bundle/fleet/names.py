"""Where a fleet's evidence lives in JetStream, named once.

- Live events: stream EVIDENCE_EVENTS, subjects `evidence.events.<node>.<session>` (the session id:
  a run's run id is known only once its bundle is written; the run id is made of the run's
  behaviour, so two runs that did the same get the same one, and cannot name a run in a fleet).
- Bundles: one object store bucket a node, `evidence-bundles-<node>`, object `<node>.<session>`. Not
  one shared bucket: an object's name is base64 in one subject token (`$O.<bucket>.M.<base64>`), so
  no subject permission can give a node the names it created and refuse it the others'; a bucket
  of its own can (`$O.evidence-bundles-<node>.>`), and the server then refuses node A a write into
  node B's bucket.
- The run index: key-value bucket `evidence-index`, key `<node>.<session>`: the key's first token is
  the node, so a node's credentials can be allowed `$KV.evidence-index.<node>.>` and no other key.

A node name is one subject token: letters, digits, `_` and `-` (no `.`, `*`, `>` or space).
"""

from __future__ import annotations

import re

from evidence.errors import UsageError

EVENTS_STREAM = "EVIDENCE_EVENTS"
EVENTS_PREFIX = "evidence.events"
BUNDLE_BUCKET_PREFIX = "evidence-bundles-"
INDEX_BUCKET = "evidence-index"

_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_node(node: str) -> str:
    """The node name if it can be one subject token, else UsageError."""
    if not _TOKEN.fullmatch(node):
        raise UsageError(
            f"node name {node!r} must be 1-64 letters, digits, '_' or '-' (one NATS subject token)"
        )
    return node


def check_session(session_id: str) -> str:
    if not _TOKEN.fullmatch(session_id):
        raise UsageError(f"session id {session_id!r} is not one NATS subject token")
    return session_id


def event_subject(node: str, session_id: str) -> str:
    return f"{EVENTS_PREFIX}.{check_node(node)}.{check_session(session_id)}"


def events_filter(node: str | None = None, session_id: str | None = None) -> str:
    """The subject filter of a node's (or every node's) events, of one session or all."""
    n = check_node(node) if node else "*"
    s = check_session(session_id) if session_id else "*"
    return f"{EVENTS_PREFIX}.{n}.{s}"


def bundle_bucket(node: str) -> str:
    """The object store bucket of a node's bundles."""
    return BUNDLE_BUCKET_PREFIX + check_node(node)


def inbox_prefix(node: str) -> str:
    """A node's reply subjects: its credentials may subscribe there and nowhere else, so it reads no
    one else's replies (a reader's fetched bundle arrives on an inbox too)."""
    return f"_INBOX_{check_node(node)}"


def run_key(node: str, session_id: str) -> str:
    """A run's key in the index and its object's name in the bundle bucket."""
    return f"{check_node(node)}.{check_session(session_id)}"


def split_key(key: str) -> tuple[str, str]:
    """(node, session) of an index key; UsageError if it is not one."""
    node, sep, session = key.partition(".")
    if not sep:
        raise UsageError(f"{key!r} is not an index key (<node>.<session>)")
    return check_node(node), check_session(session)


def node_of_subject(subject: str) -> str | None:
    """The node token of an event subject or an index entry's subject, None if it has none."""
    parts = subject.split(".")
    if subject.startswith(EVENTS_PREFIX + ".") and len(parts) == 4:
        return parts[2]
    if subject.startswith(f"$KV.{INDEX_BUCKET}.") and len(parts) == 4:
        return parts[2]
    return None
