"""`evidence run [options] -- COMMAND...`: run a command in a cgroup of its own and record it."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from evidence.errors import EXIT_ERROR, Error, SetupError, UsageError

logger = logging.getLogger(__name__)

# where a standalone run's records wait for the bundle: root's alone (0700), out of the recorded
# job's reach. Here, not in run_standalone.py: `run --agent` imports nothing it does not use.
RUN_SPOOL_DIR = Path("/var/lib/evidence/run-spool")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bundle", "-o", help="where to write the bundle (default: evidence-<session>.tar.gz)")
    p.add_argument(
        "--detail",
        choices=("summary", "full"),
        default="summary",
        help="one event per distinct operation (default) or every operation",
    )
    p.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label carried into the manifest and run events",
    )
    p.add_argument(
        "--policy",
        metavar="FILE",
        help="enforce this policy (docs/policy-format.md); 'default' is the shipped CI policy",
    )
    p.add_argument(
        "--workspace", metavar="DIR", help="the policy's ${WORKSPACE} (default: the current directory)"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="with --policy: enforce nothing, record what would be blocked; exit 4 if anything would",
    )
    p.add_argument(
        "--fail-closed",
        action="store_true",
        help="with --policy: exit 2 before starting if anything in it cannot be enforced here",
    )
    p.add_argument(
        "--net",
        choices=("none", "loopback"),
        help="run the command in a network namespace of its own: empty, or loopback only",
    )
    p.add_argument(
        "--pass-fd",
        action="append",
        type=int,
        default=[],
        metavar="N",
        help="pass this inherited descriptor on to the command (e.g. a make jobserver's); by default the "
        "command gets stdin, stdout and stderr only",
    )
    p.add_argument(
        "--allow-setuid",
        action="store_true",
        help="run without no_new_privs and the Landlock domain that keeps the job from acting through "
        "processes outside the run (for jobs that need sudo); recorded as a degradation",
    )
    p.add_argument(
        "--quiet-denials",
        action="store_true",
        help="do not tell the job (one line on its stderr) when a policy's command rule refuses an exec "
        "or holds it for approval",
    )
    p.add_argument(
        "--allow-32bit",
        action="store_true",
        help="let the command make 32-bit (i386, x32) system calls, which the kernel's syscall tracepoints "
        "do not see: refused by default (SIGSYS, recorded); allowed, they go unrecorded (a degradation)",
    )
    p.add_argument(
        "--agent",
        metavar="SOCKET",
        help="record through the `evidence agent` at SOCKET (default: one that answers at "
        "$EVIDENCE_AGENT_SOCKET or /run/evidence/agent.sock, when the run needs no --policy or --net)",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="load the probes here even when an agent answers (needs root)",
    )
    p.add_argument(
        "--sign-key",
        metavar="KEY",
        help="sign the bundle with this ed25519 private key (evidence keygen); checked before the command starts",
    )
    p.add_argument(
        "--subject",
        action="append",
        default=[],
        metavar="GLOB",
        help="attest the files this glob matches in the workspace once the command exits (repeatable; "
        "at most 256 files, 4 GiB): subjects of the signed attestation, each tied to the run's writes",
    )
    p.add_argument(
        "--subject-must-be-written",
        action="store_true",
        help="exit 2 when a --subject file was not written by the run (lint's EV017)",
    )
    p.add_argument("--ebpf", action="store_true", help="print the rendered BPF C and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")


def _labels(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"bad --label {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _roots_socket(path: str) -> bool:
    """A socket only root can have made: root's, in a directory of root's that nobody else can
    write. The variable naming it may come from a job's environment; a fake agent must not be
    chosen without being asked for by name (--agent)."""
    import stat

    try:
        st = os.stat(path)
        parent = os.stat(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return False
    return (
        stat.S_ISSOCK(st.st_mode)
        and st.st_uid == 0
        and parent.st_uid == 0
        and not parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _running_agent(args: argparse.Namespace) -> str | None:
    """The socket of an agent that answers ($EVIDENCE_AGENT_SOCKET, else the default socket), when
    the run needs nothing only a standalone run offers: its probes are loaded already, so the run
    starts at once. Says so on stderr; `--standalone` loads probes here instead."""
    if args.policy or args.net or args.allow_setuid or args.allow_32bit or args.sign_key:
        return None
    from evidence.agent.commands.client import DEFAULT_SOCKET, SOCKET_ENV, AgentClient, AgentError

    sock = os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
    if not _roots_socket(sock):
        return None
    try:
        AgentClient(sock, timeout=2.0, peer_uid=0).health()
    except AgentError:
        return None
    print(
        f"evidence: recording through the agent at {sock} (--standalone loads probes here)", file=sys.stderr
    )
    return sock


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if args.ebpf:
        from evidence.agent.recorder.kernel import mount_tracefs
        from evidence.probes.loader import detect_config
        from evidence.probes.render import render

        mount_tracefs()
        sys.stdout.write(render(detect_config()))
        return 0
    if not command:
        raise UsageError("no command given", "usage: evidence run [options] -- COMMAND [ARGS...]")
    if (args.dry_run or args.fail_closed) and not args.policy:
        raise UsageError("--dry-run and --fail-closed need --policy")
    if args.dry_run and args.fail_closed:
        raise UsageError("--dry-run and --fail-closed exclude each other")
    labels = _labels(args.label)
    if args.subject or args.subject_must_be_written:
        from evidence.bundle.subjects import SubjectError, check_pattern

        if not args.subject:
            raise UsageError("--subject-must-be-written needs --subject")
        try:
            for pattern in args.subject:
                check_pattern(pattern)
        except SubjectError as e:
            raise UsageError(str(e)) from None

    if not args.agent and not args.standalone:
        args.agent = _running_agent(args)
        args.agent_chosen = bool(args.agent)
    if args.agent:
        if args.sign_key:
            raise UsageError("--sign-key is not available with --agent", "sign with the agent's own key")
        from evidence.agent.commands.run_agent import run_via_agent

        return run_via_agent(args, command, labels)
    from evidence.errors import require_agent_extra

    require_agent_extra("run")
    from evidence.agent.commands.run_standalone import RunOptions, StandaloneRun

    standalone = StandaloneRun(
        RunOptions(
            command=command,
            labels=labels,
            bundle=args.bundle,
            detail=args.detail,
            policy=args.policy,
            workspace=args.workspace,
            dry_run=args.dry_run,
            fail_closed=args.fail_closed,
            net=args.net,
            allow_setuid=args.allow_setuid,
            allow_32bit=args.allow_32bit,
            sign_key=args.sign_key,
            pass_fd=tuple(args.pass_fd),
            quiet_denials=args.quiet_denials,
            subjects=tuple(args.subject),
        )
    )
    standalone.prepare()
    try:
        standalone.launch()
        standalone.wait()
        manifest = standalone.finish()
    except OSError as e:
        raise SetupError(f"recording failed: {e}") from e
    except (Error, KeyboardInterrupt):
        raise
    except Exception as e:  # a bug must not print a traceback nor leave the job running: one line
        logger.debug("recording failed", exc_info=True)
        raise SetupError(f"recording failed: {type(e).__name__}: {e}", "run with -vv for details") from e
    finally:
        standalone.close()
    rc = standalone.report(manifest)
    if args.subject_must_be_written:
        from evidence.agent.commands.summary import subjects_written

        if not subjects_written(Path(standalone.bundle)):
            return EXIT_ERROR
    return rc
