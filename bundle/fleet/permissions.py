"""The NATS permissions of a fleet's users, written once: a node's, a reader's (docs/deploy.md, "A
fleet"; deploy/nats/ renders them into a server's configuration).

A node may publish its own events (`evidence.events.<node>.*`), its own index entries
(`$KV.evidence-index.<node>.*`: the key's first token is the node, which is how a reader knows which
node's credentials wrote an entry) and into its own bundle bucket (`$O.evidence-bundles-<node>.>`),
make that bucket, read its own bucket back (the digest check), and receive replies on its own inbox
prefix only. It may not purge or delete anything: not another node's, not even its own. A reader
may look (stream and consumer info, message gets, ordered consumers) and publish nothing else.
"""

from __future__ import annotations

from typing import Any

from evidence.bundle.fleet import names


def node(name: str) -> dict[str, Any]:
    bucket_stream = f"OBJ_{names.bundle_bucket(name)}"
    return {
        "publish": {
            "allow": [
                f"{names.EVENTS_PREFIX}.{names.check_node(name)}.*",
                f"$KV.{names.INDEX_BUCKET}.{name}.*",
                f"$O.{names.bundle_bucket(name)}.>",
                "$JS.API.INFO",
                f"$JS.API.STREAM.INFO.{names.EVENTS_STREAM}",
                f"$JS.API.STREAM.INFO.KV_{names.INDEX_BUCKET}",
                f"$JS.API.STREAM.INFO.{bucket_stream}",
                f"$JS.API.STREAM.CREATE.{bucket_stream}",
                f"$JS.API.STREAM.MSG.GET.{bucket_stream}",
                f"$JS.API.DIRECT.GET.{bucket_stream}.>",
            ]
        },
        "subscribe": {"allow": [f"{names.inbox_prefix(name)}.>"]},
    }


def reader() -> dict[str, Any]:
    return {
        "publish": {
            "allow": [
                "$JS.API.INFO",
                "$JS.API.STREAM.INFO.>",
                "$JS.API.STREAM.NAMES",
                "$JS.API.STREAM.MSG.GET.>",
                "$JS.API.DIRECT.GET.>",
                "$JS.API.CONSUMER.CREATE.>",
                "$JS.API.CONSUMER.INFO.>",
                "$JS.API.CONSUMER.DELETE.>",
                "$JS.API.CONSUMER.MSG.NEXT.>",  # `fleet ls` reads the index with a pull consumer
                "$JS.FC.>",
            ]
        },
        "subscribe": {"allow": ["_INBOX.>"]},
    }


def server_users(users: list[tuple[str, dict[str, Any] | None]]) -> str:
    """An `authorization { users = [...] }` block for a server's configuration: (NKey public key,
    permissions; None: every permission, for an operator) each. JSON is valid NATS configuration."""
    import json

    entries = [{"nkey": pub, **({"permissions": perms} if perms is not None else {})} for pub, perms in users]
    return "authorization {\n  users = " + json.dumps(entries, indent=2) + "\n}\n"
