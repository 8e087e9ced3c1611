"""`evidence finish`: finish a run started with `evidence start`; the agent writes the bundle.

    evidence finish --agent /run/evidence/agent.sock SESSION --bundle out.tar.gz

The agent writes the bundle into its bundle directory (it stays there until it is delivered). With
--bundle, the client then downloads it over the socket, checks its sha256 against the agent's
answer, and writes it with the caller's own credentials, atomically (temp file + rename): that works
from a sidecar's job container, which cannot see the agent's files. Prints `RUN_ID<TAB>PATH`
(the local path with --bundle, else the path on the agent's side), or the whole answer with --json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import IO, TYPE_CHECKING
from urllib.parse import quote

from evidence.agent.commands.client import AgentClient, AgentError, add_agent_argument
from evidence.errors import UsageError
from evidence.files import atomic_write

if TYPE_CHECKING:
    from evidence.agent.daemon.models import FinishAnswer

logger = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    add_agent_argument(parser)
    parser.add_argument("session", metavar="RUN", help="the session id `evidence start` printed")
    parser.add_argument("--bundle", metavar="PATH", help="also download the bundle to this path (.tar.gz)")
    parser.add_argument(
        "--name", metavar="NAME", help="file name of the bundle in the agent's bundle directory"
    )
    parser.add_argument("--force", action="store_true", help="overwrite --bundle if it exists")
    parser.add_argument("--json", action="store_true", help="print the agent's whole answer as JSON")


class _HashingWriter:
    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.sha = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        return self.out.write(data)


def check_target(path: Path, force: bool) -> None:
    """Fail before anything is recorded when the bundle could not be written to path."""
    if path.exists() and not force:
        raise UsageError(f"{path} exists", hint="choose another --bundle or pass --force")
    if not path.parent.is_dir():
        raise UsageError(f"directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK):
        raise UsageError(f"cannot write into {path.parent}")


def download_bundle(client: AgentClient, name: str, sha256: str, target: Path) -> int:
    with atomic_write(target, mode=0o600) as raw:  # as the agent keeps it: the caller's alone
        writer = _HashingWriter(raw)
        size = client.download(f"/bundles/{quote(name, safe='')}", writer)  # type: ignore[arg-type]
        if writer.sha.hexdigest() != sha256:
            raise AgentError(
                f"the downloaded bundle's sha256 {writer.sha.hexdigest()} is not the agent's {sha256}"
            )
    return size


def fetch_bundle(client: AgentClient, result: FinishAnswer, target: Path) -> int:
    """Download the bundle a finish answer names to target (also used by `evidence run --agent`)."""
    name = result.get("name")
    if not name:
        raise AgentError(
            f"the agent wrote {result.get('path')} outside its bundle directory; it cannot be downloaded"
        )
    size = download_bundle(client, name, result["sha256"], target)
    logger.info("downloaded %s (%d bytes) to %s", name, size, target)
    return size


def run(args: argparse.Namespace) -> int:
    target = Path(args.bundle) if args.bundle else None
    if target is not None:
        if not target.name.endswith(".tar.gz"):
            raise UsageError(f"--bundle {target} should end in .tar.gz")
        check_target(target, args.force)
    client = AgentClient(args.agent)
    result = client.finish(args.session, args.name)
    path = result["path"]
    if target is not None:
        fetch_bundle(client, result, target)
        path = str(target)
    if result.get("lost"):
        logger.warning(
            "run %s lost %s events: the bundle says which kinds", result.get("run_id"), result["lost"]
        )
    if args.json:
        print(json.dumps({**result, "local_path": path} if target is not None else result, sort_keys=True))
    else:
        print(f"{result['run_id']}\t{path}")
    return 0
