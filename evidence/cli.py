"""The `evidence` command line. `main(argv) -> int` is tested in-process.

Commands live in one place per side: `agent/commands/` (recording: root, BCC and the `agent` extra)
and `bundle/commands/` (reading bundles: `show`, `lint`, `diff`, `baseline`, `profile`, `keygen`,
`verify`, `attestation`; no BCC, no root). A command is imported only when used. Each command module
offers `configure(parser)` and `run(args) -> int`; the library modules they drive take typed
arguments, return results and know nothing of argparse.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Sequence

from evidence import __version__
from evidence.errors import AGENT_EXTRA, EXIT_ERROR, Error, extra_error

logger = logging.getLogger("evidence")

# name -> (module, help). bundle/commands/ ones are pure; agent/commands/ ones need root + BCC and
# the `agent` extra.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("evidence.agent.commands.run", "run a command and record what it does into a bundle"),
    "doctor": ("evidence.agent.commands.doctor", "check what this machine offers the recorder"),
    "show": ("evidence.bundle.commands.show", "print a readable summary of a bundle"),
    "lint": ("evidence.bundle.commands.lint", "verify a bundle and report problems"),
    "diff": ("evidence.bundle.commands.diff", "compare the behaviour of two runs"),
    "baseline": (
        "evidence.bundle.commands.baseline",
        "build a baseline of what many runs did, for diff --baseline",
    ),
    "profile": ("evidence.bundle.commands.profile", "write a policy that allows exactly what a run did"),
    "keygen": ("evidence.bundle.commands.keygen", "make an ed25519 key pair for signing bundles"),
    "verify": ("evidence.bundle.commands.verify", "check that a bundle is valid and signed by a key"),
    "attestation": ("evidence.bundle.commands.attestation", "print a signed bundle's DSSE envelope"),
    "fleet": ("evidence.bundle.commands.fleet", "a fleet's runs, bundles and live events on NATS JetStream"),
    "agent": ("evidence.agent.commands.agent", "run the recording daemon (sidecar / DaemonSet)"),
    "start": ("evidence.agent.commands.start", "start recording a cgroup through a running agent"),
    "finish": ("evidence.agent.commands.finish", "finish a run started through a running agent"),
    "recover": ("evidence.agent.commands.recover", "write the bundles of runs whose recorder died"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser. Every command is listed; only `only` is configured, its module alone imported
    (and looked for: one that is missing is not offered). Without `only` none is: argv names no
    command (`evidence --help`, a typo), so no command's options can be parsed, and the list with
    each command's help is all the top-level help shows."""
    parser = argparse.ArgumentParser(prog="evidence", description="An eBPF run recorder.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"evidence {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (mod, help_) in COMMANDS.items():
        if name == only and importlib.util.find_spec(mod) is None:
            continue
        p = sub.add_parser(name, help=help_, description=help_, allow_abbrev=False)
        p.set_defaults(_module=mod)
        if name == only:
            importlib.import_module(mod).configure(p)
    return parser


def _command_of(argv: list[str]) -> str | None:
    for arg in argv:
        if arg in COMMANDS:
            return arg
        if not arg.startswith("-"):
            return None
    return None


def _setup_logging(verbose: int) -> None:
    env = os.environ.get("EVIDENCE_LOG", "").upper()
    level = logging.WARNING
    if verbose == 1 or env == "INFO":
        level = logging.INFO
    if verbose >= 2 or env == "DEBUG":
        level = logging.DEBUG
    pkg_loggers = ["evidence"]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("evidence: %(levelname)s %(name)s: %(message)s"))
    for name in pkg_loggers:
        lg = logging.getLogger(name)
        lg.setLevel(level)
        if not lg.handlers:
            lg.addHandler(handler)
        lg.propagate = False


# what the `agent` extra installs: a command that needs one of them says so in one line
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    command = _command_of(argv)
    try:
        return _main(argv, command)
    except ModuleNotFoundError as e:  # a safety net: commands check with require_agent_extra first
        if (e.name or "").partition(".")[0] in AGENT_EXTRA:
            err = extra_error(command, str(e.name))
            print(f"evidence: {err.diagnostics()}", file=sys.stderr)
            return err.exit_code
        raise


def _main(argv: list[str], command: str | None) -> int:
    parser = build_parser(command)
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    if not getattr(args, "_module", None):
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    try:
        return int(importlib.import_module(args._module).run(args))
    except Error as e:
        print(f"evidence: {e.diagnostics()}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("evidence: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def entry() -> None:
    sys.exit(main())
