"""`evidence start`: ask a running agent to start recording a cgroup; prints the session id alone.

evidence start --agent /run/evidence/agent.sock --cgroup /sys/fs/cgroup/ci/job-42 --label job=42
evidence start --agent /run/evidence/agent.sock --pid $$ --label job=42
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from evidence.agent.commands.client import AgentClient, add_agent_argument, parse_label
from evidence.errors import UsageError

logger = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    add_agent_argument(parser)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--cgroup", metavar="PATH", help="an existing cgroup (absolute, or relative to the cgroup2 mount)"
    )
    which.add_argument("--pid", type=int, metavar="PID", help="record the cgroup this process is in")
    parser.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label recorded in the bundle (repeatable)",
    )
    parser.add_argument("--json", action="store_true", help="print the agent's whole answer as JSON")


def run(args: argparse.Namespace) -> int:
    labels: dict[str, str] = {}
    for text in args.label:
        key, value = parse_label(text)
        if key in labels:
            raise UsageError(f"--label {key} given twice")
        labels[key] = value
    if args.pid is not None and args.pid <= 0:
        raise UsageError("--pid must be a positive process id")
    result = AgentClient(args.agent).start(cgroup=args.cgroup, pid=args.pid, labels=labels)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(result["session_id"])
    logger.info("recording %s as %s", result.get("cgroup"), result["session_id"])
    sys.stdout.flush()
    return 0
