"""Make the fleet's NATS users: an NKey seed file a node, one for readers, one for the operator, and
the `users.conf` the servers include (permissions from bundle/fleet/permissions.py).

    python deploy/nats/make-users.py DIR NODE...   # DIR/users.conf, DIR/<name>.nk (0600)

Give each node its own seed (`sink.nats.nkey_seed`), readers `reader.nk` (`evidence fleet --nkey`),
and keep `operator.nk` for `evidence fleet init`. Adding a node: run again with every node (the
seeds already in DIR are kept), then reload the servers (`nats-server --signal reload`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nkeys

from evidence.bundle.fleet import permissions


def seed_file(directory: Path, name: str) -> str:
    path = directory / f"{name}.nk"
    if not path.exists():
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(seed + b"\n")
    return str(nkeys.from_seed(path.read_bytes().strip()).public_key.decode())


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    directory = Path(argv[0])
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    users = [(seed_file(directory, "operator"), None), (seed_file(directory, "reader"), permissions.reader())]
    users += [(seed_file(directory, node), permissions.node(node)) for node in argv[1:]]
    (directory / "users.conf").write_text(permissions.server_users(users))
    print(f"{directory}/users.conf: operator, reader and {len(argv) - 1} node(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
