"""`evidence run --agent SOCKET -- COMMAND...`: record a command through a running agent.

No probes are loaded here and no privilege is needed: the agent (typically a privileged sidecar)
records, this client only runs the command.

1. The command is forked; the child waits on a pipe before it execs.
2. The agent is asked to isolate that child (POST /runs {"isolate_pid": N}): it makes a cgroup for
   the run, starts tracking it, then moves the waiting child in (agent/daemon/api.py, agent/daemon/backend.py).
3. The child is released and execs: the run holds the command from its first instruction, in a
   cgroup of its own, and nothing of this client's (which stays where it was, with the job's other
   processes).
4. stdin, stdout and stderr are the client's own. SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to the
   client are forwarded to the command (a terminal's Ctrl-C already reaches it: not sent twice).
5. When the command exits (and this client has reaped it), the run is finished with its exit code
   (the agent records the status it reads through its own pidfd of the command, not this claim;
   it kills what the command left behind and removes the cgroup), the bundle is downloaded to --bundle with the client's own
   credentials (as `evidence finish --bundle` does), and the summary line of `evidence run` is
   printed on stderr. The exit code is the command's, 128+N when signal N killed it.

When the agent cannot be reached, refuses, or is not ready, nothing is started: one line on stderr,
exit 70 (2 for bad input, such as a label the agent rejects).

With --policy (`ClientPolicy`), what needs no privilege is done here, as the standalone run does it
(agent/recorder/enforce.py): the policy is loaded and planned, the command gets a private tmp, a
scrubbed environment and the policy's Landlock domain before it execs. The policy's text and
variables go to the agent with the isolate request: it attaches the connect guard to the run's
cgroup before the command is moved in, matches denials, and puts the policy in the manifest.
--dry-run exits 4 when anything would have been blocked; --fail-closed refuses to start when
anything cannot be enforced.

With --net none|loopback, the forked child moves itself into a network namespace of its own before
the agent takes it (policy/landlock_syscalls.py: private_network; a client that is not root does so
inside a user namespace that maps only its own uid and gid), so that set-up is not part of the run;
the agent puts the mode in the manifest (`network`).

The forked child gives the command System V IPC and a /dev/shm of its own (exec_helper.private_ipc)
when it can: as root, or inside the user namespace of --net; a client that is neither leaves them
the host's. The agent reads back which (launch.py ipc_isolation: `capabilities.ipc`, a degradation
when shared, a refusal with --fail-closed), and its exec supervisor decides in the command's mount
namespace only when root made it (launch.py joinable_mount_namespace).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NoReturn

from evidence.agent.commands.client import AgentClient
from evidence.agent.commands.finish import check_target, fetch_bundle
from evidence.agent.commands.summary import signal_name, subjects_written, summary_line
from evidence.agent.recorder.exec_filter import install_exec_filter
from evidence.agent.recorder.exec_helper import private_ipc
from evidence.agent.recorder.launch import Landlock, inherited_fds, isolation
from evidence.errors import (
    EXIT_ERROR,
    EXIT_SETUP,
    EXIT_WOULD_BLOCK,
    Error,
    PolicyError,
    SetupError,
    UsageError,
)
from evidence.policy import landlock_syscalls as ll

if TYPE_CHECKING:
    from evidence.agent.daemon.models import FinishAnswer, PolicyBody

logger = logging.getLogger(__name__)

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_SI_KERNEL = 0x80  # si_code of a signal the terminal generated
_GO = b"g"


class _CannotRun(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def _resolve(name: str) -> str:
    """The file execve() will run, found the way a shell would (PATH), before anything starts."""
    path = name if "/" in name else shutil.which(name)
    if path is None or not os.path.exists(path):
        raise _CannotRun(127, os.strerror(errno.ENOENT))
    if os.path.isdir(path) or not os.access(path, os.X_OK):
        raise _CannotRun(126, os.strerror(errno.EACCES))
    return path


class ClientPolicy:
    """A policy's client side: loaded, planned, its tmp and environment made; `request` is what the
    agent is sent (it matches denials and attaches the connect guard)."""

    def __init__(self, path: str, workspace: str, *, dry_run: bool, fail_closed: bool) -> None:
        from evidence.policy import env as penv
        from evidence.policy import landlock
        from evidence.policy import tmp as ptmp
        from evidence.policy.model import load_policy

        self.mode: Literal["enforce", "dry-run"] = "dry-run" if dry_run else "enforce"
        self.workspace = os.path.realpath(workspace)
        self.tmpdir = ptmp.create_private_tmp()
        try:
            try:
                with open(path, encoding="utf-8") as f:
                    self.text = f.read()
            except OSError as e:
                raise PolicyError(f"cannot read policy {path}: {e.strerror}") from None
            self.policy = load_policy(path, workspace=self.workspace, tmpdir=self.tmpdir)
            self.plan = landlock.plan(self.policy, landlock.abi_version())
            env, self.env_removed = penv.scrub(os.environ, self.policy.env)
            self.environ = ptmp.tmp_environ(env, self.tmpdir)
            cannot = [dict(d) for d in self.plan.degradations]
            if self.policy.fs is not None and not self.plan.enforced:
                cannot.append({"component": "landlock", "reason": "Landlock is not available on this kernel"})
            if fail_closed and cannot:
                raise PolicyError(
                    f"the policy cannot be fully enforced here: {cannot[0]['component']}: {cannot[0]['reason']}",
                    "drop --fail-closed to run with it recorded",
                )
        except BaseException:
            self.close()
            raise

    @property
    def exec_rules(self) -> bool:
        """The policy has command rules and this host can have them decided (seccomp user
        notification): the command's process loads the exec filter and the agent takes its listener.
        Otherwise the agent records a degradation (or refuses the run with --fail-closed)."""
        from evidence.agent.recorder.command_rules import user_notification

        return self.policy.commands is not None and user_notification() is None

    def domain(self) -> Landlock | None:
        """The policy's Landlock domain for the command (None: dry run, or no Landlock here)."""
        return Landlock.of_plan(self.plan) if self.mode == "enforce" else None

    def request(self, fail_closed: bool, listener: int | None = None, quiet: bool = False) -> PolicyBody:
        """`listener`: the exec filter's listener's number in the command's process."""
        body: PolicyBody = {
            "text": self.text,
            "name": self.policy.source,
            "variables": dict(self.policy.variables),
            "mode": self.mode,
            "fail_closed": fail_closed,
            "env_removed": list(self.env_removed),
        }
        if listener is not None:
            body["exec_listener_fd"] = listener
        if quiet:
            body["quiet_denials"] = True
        return body

    def close(self) -> None:
        from evidence.policy import tmp as ptmp

        ptmp.remove_private_tmp(self.tmpdir)


def _child(
    go: int,
    go_w: int,
    err_r: int,
    err_w: int,
    path: str,
    argv: list[str],
    drop_fds: list[int],
    domain: Landlock | None = None,
    environ: dict[str, str] | None = None,
    net: str | None = None,
    ready: int = -1,
    exec_rules: bool = False,
) -> NoReturn:
    """In the forked child: make the private network (`net`: its mode), give itself evidence's
    seccomp filters, say so on `ready` (or why not), wait for the agent to have moved us, then exec.
    Never returns."""
    code = 127
    try:
        os.close(go_w)
        os.close(err_r)
        try:
            if net is not None:  # before the run holds this process: the set-up is not the job's doing
                ll.private_network(loopback=net == "loopback")
            if os.geteuid() == 0 or net is not None:  # root, or in a user namespace of its own (--net)
                with contextlib.suppress(OSError):  # its own IPC and /dev/shm, else (a root without
                    private_ipc()  # CAP_SYS_ADMIN) the agent reads back that they are the host's
            # before the agent is asked to take this process: it reads the filters back (it does
            # not take a client's word for them), and they stay for good
            ll.no_new_privs()
            ll.deny_tty_injection()  # the job cannot type into the terminal it shares with this client
            ll.deny_io_uring()  # nor act through io_uring, which no system call tracepoint sees
            ll.deny_compat_syscalls()  # nor through a 32-bit entry, which they skip (SIGSYS, recorded)
            # the policy's command rules: every exec from here on (the command's too) waits for the
            # agent, which takes the listener from this process (its number follows the go)
            listener = install_exec_filter() if exec_rules else -1
        except OSError as e:
            os.write(ready, f"{e.strerror or e}".encode(errors="replace")[:500])
            os._exit(EXIT_SETUP)
        os.write(ready, _GO + (str(listener).encode() if listener >= 0 else b""))
        os.close(ready)
        for fd in drop_fds:  # inherited by the client but not named with --pass-fd: not the job's
            with contextlib.suppress(OSError):
                os.set_inheritable(fd, False)
        # what the command inherits: default dispositions (Python ignores SIGPIPE), no blocked signals
        for s in (*FORWARDED, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(s, signal.SIG_DFL)
        if os.read(go, 1) != _GO:  # the client gave up (the agent refused): run nothing
            os._exit(EXIT_SETUP)
        os.close(go)
        if listener >= 0:  # the agent has its own: a copy kept here could answer for the job
            os.close(listener)
        if domain is not None:  # the policy's (it is scoped as the isolation domain is)
            ll.restrict(domain.abi, domain.handled_fs, domain.scoped, domain.rules, domain.file_rights)
        else:
            _isolate_self()
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.execve(path, argv, environ if environ is not None else os.environ)
    except OSError as e:
        code = 126 if e.errno in (errno.EACCES, errno.ENOEXEC, errno.EPERM) else 127
        with contextlib.suppress(OSError):
            os.write(err_w, str(e.errno or 0).encode())
    except BaseException:  # noqa: BLE001 - nothing may escape a forked child
        pass
    os._exit(code)


def _wait_for_child(ready_r: int, ready_w: int, net: str | None) -> int | None:
    """The child has made its private network (if asked) and given itself evidence's filters, or
    SetupError with why not (the child has exited); the exec filter's listener's number in the
    child, when it loaded one."""
    os.close(ready_w)
    answer = b""
    while chunk := os.read(ready_r, 512):
        answer += chunk
    os.close(ready_r)
    if answer[:1] == _GO and answer[1:].isdigit():
        return int(answer[1:])
    if answer != _GO:
        why = answer.decode(errors="replace") or "the command's process died"
        if net is None:
            raise SetupError(f"cannot prepare the command's process: {why}")
        raise SetupError(
            f"cannot give the command a private network (--net {net}): {why}",
            "unprivileged user namespaces may be disabled here (sysctl user.max_user_namespaces)",
        )
    return None


def _isolate_self() -> None:
    """In the child, before exec: the same domain `evidence run` gives its commands (no_new_privs and
    a Landlock domain, scoped where the ABI allows), so the job cannot make a process of its uid
    outside the run, this client included, act for it unrecorded."""
    domain, nnp, _ = isolation(ll.abi_version())
    if domain is not None:
        ll.restrict(domain.abi, domain.handled_fs, domain.scoped, domain.rules, domain.file_rights)
    elif nnp:
        ll.no_new_privs()


class _Forwarder:
    """Forwards FORWARDED signals sent to the client to the command, through a pidfd (never to a
    recycled pid). Once the command has exited, a signal stops the client: the agent finishes the
    run on its own and keeps the bundle in its bundle directory."""

    def __init__(self, pidfd: int, session: list[str]) -> None:
        self._pidfd = pidfd
        self._session = session
        self._lock = threading.Lock()
        self._done = False
        self.received: list[int] = []
        threading.Thread(target=self._loop, name="evidence-signals", daemon=True).start()

    def _loop(self) -> None:
        while True:
            info = signal.sigwaitinfo(FORWARDED)
            self.received.append(info.si_signo)
            with self._lock:
                if self._done:
                    sid = self._session[0] if self._session else "?"
                    print(
                        f"evidence: interrupted while finishing run {sid}; the agent keeps its bundle",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(128 + info.si_signo)
                if info.si_code == _SI_KERNEL:  # the terminal sent it to the command too
                    continue
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(self._pidfd, info.si_signo)

    def close(self) -> None:
        with self._lock:
            self._done = True
            os.close(self._pidfd)


def _as_setup(e: Error) -> Error:
    """An agent that cannot be reached or refuses: nothing was run (70); bad input stays 2."""
    if isinstance(e, UsageError) or e.exit_code == EXIT_SETUP:
        return e
    return SetupError(e.message, e.hint)


def _bundle_target(args: argparse.Namespace) -> Path | None:
    if args.bundle:
        target = Path(args.bundle).absolute()
        check_target(target, force=True)
        return target
    if not os.access(".", os.W_OK):
        raise UsageError("cannot write the bundle into the current directory", hint="give --bundle")
    return None


def run_via_agent(args: argparse.Namespace, command: list[str], labels: dict[str, str]) -> int:
    if args.allow_setuid:
        raise UsageError("--allow-setuid is not available with --agent yet", "run evidence run as root")
    if args.allow_32bit:
        raise UsageError("--allow-32bit is not available with --agent yet", "run evidence run as root")
    policy: ClientPolicy | None = None
    if args.policy:
        from evidence.policy.model import policy_file

        policy = ClientPolicy(
            policy_file(args.policy),
            args.workspace or os.getcwd(),
            dry_run=args.dry_run,
            fail_closed=args.fail_closed,
        )
    try:
        rc = _run_via_agent(args, command, labels, policy)
    finally:
        if policy is not None:
            policy.close()
    return rc


def _run_via_agent(
    args: argparse.Namespace, command: list[str], labels: dict[str, str], policy: ClientPolicy | None
) -> int:
    # a job of the same uid must not ptrace this client (it holds the pidfd, finishes the run)
    ll.not_dumpable()
    target = _bundle_target(args)
    try:
        path = _resolve(command[0])
    except _CannotRun as e:
        print(f"evidence: cannot run {command[0]!r}: {e.reason}; nothing was recorded", file=sys.stderr)
        return e.code
    # an agent is root's: when it was chosen without being named, or when this client is root (a
    # fake agent of a job's uid must not take root's run), every connection checks who answers
    auto = getattr(args, "agent_chosen", False)
    # one connection for the start, the finish and the download, made before the command runs: the
    # agent keeps it for the run, so the command (of this uid) cannot fill the uid's connections or
    # the agent's backlog and leave its run unfinished (agent/daemon/transport.py)
    client = AgentClient(args.agent, peer_uid=0 if auto or os.geteuid() == 0 else None, keep_alive=True)
    try:
        return _isolated_run(args, command, labels, policy, client, path, target)
    finally:
        client.close()


def _isolated_run(
    args: argparse.Namespace,
    command: list[str],
    labels: dict[str, str],
    policy: ClientPolicy | None,
    client: AgentClient,
    path: str,
    target: Path | None,
) -> int:
    inherited = inherited_fds()
    missing = sorted(set(args.pass_fd) - set(inherited))
    if missing:
        raise UsageError(f"--pass-fd {missing[0]}: not an open descriptor evidence inherited")
    drop = [fd for fd in inherited if fd not in args.pass_fd]

    go_r, go_w = os.pipe()
    err_r, err_w = os.pipe()
    ready_r, ready_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    # inherited by the child until it execs; SIGTTOU/SIGTTIN: a job keeping our terminal's
    # foreground (TOSTOP set) would stop this client at its next write there (or fail it, EIO)
    signal.pthread_sigmask(signal.SIG_BLOCK, (*FORWARDED, signal.SIGTTOU, signal.SIGTTIN))
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        if policy is not None:
            _child(
                go_r,
                go_w,
                err_r,
                err_w,
                path,
                command,
                drop,
                policy.domain(),
                policy.environ,
                args.net,
                ready_w,
                policy.exec_rules,
            )
        _child(go_r, go_w, err_r, err_w, path, command, drop, net=args.net, ready=ready_w)
    os.close(go_r)
    os.close(err_w)
    session: list[str] = []
    forwarder = _Forwarder(os.pidfd_open(pid), session)
    try:
        listener = _wait_for_child(ready_r, ready_w, args.net)
        started = client.isolate(
            pid,
            labels=labels,
            command=command,
            detail=args.detail,
            policy=policy.request(args.fail_closed, listener, args.quiet_denials)
            if policy is not None
            else None,
            net=args.net,
            subjects=list(args.subject) or None,
        )
    except Error as e:
        os.close(go_w)  # the child reads EOF and exits without running anything
        os.close(err_r)
        os.waitpid(pid, 0)
        forwarder.close()
        raise _as_setup(e) from None
    sid = str(started["session_id"])
    session.append(sid)
    logger.info("run %s: the agent moved process %d into %s", sid, pid, started.get("cgroup"))
    os.write(go_w, _GO)
    os.close(go_w)
    failed = b""
    while chunk := os.read(err_r, 64):  # EOF when execve succeeded (the pipe is close-on-exec)
        failed += chunk
    os.close(err_r)
    _, status = os.waitpid(pid, 0)
    forwarder.close()
    rc = os.waitstatus_to_exitcode(status)
    exit_code: int | None = rc
    sig_name: str | None = None
    if failed:
        print(f"evidence: cannot run {command[0]!r}: {os.strerror(int(failed))}", file=sys.stderr)
    if rc < 0:
        sig_name = signal_name(-rc)
        exit_code = None
        rc = 128 - rc
    bundle = target or Path(f"evidence-{sid[:12]}.tar.gz").absolute()
    try:
        result = client.finish(sid, exit_code=exit_code, signal=sig_name)
        fetch_bundle(client, result, bundle)
    except Error as e:
        raise SetupError(
            f"the command ran (exit {rc}) but its recording failed: {e.message}", e.hint
        ) from None
    _summary(result, bundle)
    if args.subject_must_be_written and not subjects_written(bundle):
        return EXIT_ERROR
    if result.get("lost"):
        logger.warning("%d events were lost: the bundle says which kinds", result["lost"])
    denials = (result.get("counts") or {}).get("dev.evidence.policy.denial", 0)
    if policy is not None and policy.mode == "dry-run" and denials:
        print(f"evidence: dry run: {denials} operation(s) would have been blocked", file=sys.stderr)
        return EXIT_WOULD_BLOCK
    return rc


def _summary(result: FinishAnswer, bundle: Path) -> None:
    """The line `evidence run` prints, from the agent's finish answer."""
    counts: dict[str, int] = result.get("counts") or {}
    print(
        summary_line(result.get("events"), counts, result.get("lost") or 0, result.get("run_id"), bundle),
        file=sys.stderr,
    )
