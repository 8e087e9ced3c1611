"""`evidence approvals`: list the execs waiting for a person's answer, and answer them, through the
agent (issue 24: a `commands` rule with decision `approve`).

    evidence approvals list [--format text|json]
    evidence approvals allow ID --reason TEXT
    evidence approvals deny ID --reason TEXT

Root sees and answers every run's requests; anyone else only those of the runs it started. The
answer is recorded in the run's bundle (a dev.evidence.policy.approval event) with the caller's uid
(from the socket's credentials), `via: api`, the time and the reason. Every string the job chose
(program, argv, rule message) is escaped in the text listing: the job cannot draw on the terminal.

Exit codes: 0 done; 2 a bad request, an unknown id (or another user's request), a request already
resolved (answered, timed out, withdrawn); 70 no agent answers at the socket.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import TYPE_CHECKING

from evidence.agent.commands.client import AgentClient, add_agent_argument
from evidence.bundle.text import printable
from evidence.errors import UsageError

if TYPE_CHECKING:
    from evidence.agent.daemon.models import ApprovalView

ARG_MAX_SHOWN = 200
ARGS_SHOWN = 64


def configure(parser: argparse.ArgumentParser) -> None:
    add_agent_argument(parser)
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = sub.add_parser("list", help="the execs waiting for your answer", allow_abbrev=False)
    listing.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    for action, what in (("allow", "let the exec run"), ("deny", "refuse the exec (EACCES)")):
        p = sub.add_parser(action, help=what, description=what, allow_abbrev=False)
        p.add_argument("id", metavar="ID", help="the request's id (from `evidence approvals list`)")
        p.add_argument("--reason", required=True, metavar="TEXT", help="why: recorded in the bundle")


def describe(r: ApprovalView) -> str:
    """One request as text lines, every string escaped."""

    def arg(a: str) -> str:
        shown = printable(a)
        return shlex.quote(shown if len(shown) <= ARG_MAX_SHOWN else shown[: ARG_MAX_SHOWN - 3] + "...")

    argv = " ".join(arg(a) for a in r["argv"][:ARGS_SHOWN])
    if len(r["argv"]) > ARGS_SHOWN or r["argv_truncated"]:
        argv += " [more arguments not shown]"
    rule = printable(r["rule"])
    if r["message"]:
        rule += f": {printable(r['message'])}"
    return (
        f"{r['id']}  run {printable(r['session_id'])} (uid {r['owner_uid']}), requested {r['requested_at']}\n"
        f"  exec of {printable(r['program'])} (pid {r['pid']}, depth {r['depth']})\n"
        f"  argv: {argv}\n"
        f"  rule: {rule}\n"
        f"  unanswered at {r['expires_at']}: {r['on_timeout']}"
    )


def run(args: argparse.Namespace) -> int:
    client = AgentClient(args.agent, timeout=30.0)
    if args.action == "list":
        pending = client.approvals()
        if args.format == "json":
            print(json.dumps({"approvals": pending}, sort_keys=True))
        elif not pending:
            print("no exec waits for your answer")
        else:
            print("\n\n".join(describe(r) for r in pending))
        return 0
    if not args.reason.strip():
        raise UsageError("--reason must say why: it is recorded in the bundle")
    answer = client.answer(args.id, args.action, args.reason)
    print(f"{answer['id']}: {answer['decision']} (uid {answer['by_uid']}, {answer['at']})")
    sys.stdout.flush()
    return 0
