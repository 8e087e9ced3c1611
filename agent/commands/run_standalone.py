"""`evidence run` with probes of its own (root): prepare, launch, wait, finish. agent/commands/run.py
parses the command line and chooses between this and an agent (agent/commands/run_agent.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from evidence.agent.commands.run import RUN_SPOOL_DIR
from evidence.agent.commands.summary import signal_name, summary_line
from evidence.errors import EXIT_WALL, EXIT_WOULD_BLOCK, PolicyError, SetupError, UsageError

if TYPE_CHECKING:
    from evidence.agent.recorder.cgroups import RunCgroup
    from evidence.agent.recorder.description import Detail, Network
    from evidence.agent.recorder.enforce import Enforcement
    from evidence.agent.recorder.launch import Landlock, Launcher, Watchdog
    from evidence.agent.recorder.recording import Recorder
    from evidence.agent.recorder.run import Run
    from evidence.agent.recorder.tty_approver import TtyApprover
    from evidence.bundle.attestation import Signer
    from evidence.bundle.format import Degradation
    from evidence.policy.netns import PrivateNetns
    from evidence.probes.loader import RecorderProbes

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _load_probes(rendered: threading.Event) -> RecorderProbes:
    """The probes, loaded beside the rest of the start (imports, the launcher, the policy): the GIL
    is handed over every 0.5 ms meanwhile, not every 5, since the load needs it at the start and end
    of each program's load and would otherwise wait for it, again and again. `rendered` is set once
    the load's own Python is done (its imports, the source rendered), or it failed."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, 0.0005))
    try:
        from evidence.probes.loader import load_probes

        return load_probes(rendered=rendered.set)
    finally:
        rendered.set()
        sys.setswitchinterval(before)


class _InThread(Generic[T]):
    """Runs a function in a thread; result() joins it and returns its value or raises its error."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._value: T | None = None
        self._error: BaseException | None = None
        self._t = threading.Thread(target=self._run, args=(fn,), name="evidence-load", daemon=True)
        self._t.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # noqa: BLE001 - handed to result()
            self._error = e

    def result(self) -> T:
        self._t.join()
        if self._error is not None:
            raise self._error
        return cast(T, self._value)

    def discard(self, cleanup: Callable[[T], None]) -> None:
        self._t.join()
        if self._error is None and self._value is not None:
            cleanup(self._value)


def _names_commands(policy: str) -> bool:
    """Whether the policy file `policy` (a path; `default` has no command rules) has a top-level
    `commands:` line: a guess made before it is parsed, to start what its rules need early."""
    if policy == "default":
        return False
    try:  # a regular file only: a pipe (`--policy <(...)`) read here would be read once, by this
        fd = os.open(policy, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return False
            return re.search(rb"(?m)^commands\s*:", f.read(1 << 20)) is not None
    except OSError:
        return False


def _prepare_execs(loading: _InThread[RecorderProbes]) -> None:
    """The exec check's programs loaded and attached once the probes are (a refusal is left to
    the run's enforce, which tries again and says so)."""
    from evidence.probes.bpfsys import ObjectError

    try:
        loading.result().prepare_execs()
    except (ObjectError, OSError) as e:
        logger.debug("the exec check's programs were not loaded ahead: %s", e)


class _SignalForwarder:
    """Forwards SIGINT/SIGTERM/SIGHUP/SIGQUIT sent to evidence (kill, a supervisor) to the command.
    A terminal's Ctrl-C already reaches the command (same process group), so signals that come from
    the kernel's tty layer are not sent twice."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.received: list[int] = []
        # SIGTTOU/SIGTTIN blocked too: a job on evidence's terminal can take its foreground (TOSTOP
        # set), and a write or read of ours would then stop evidence (or fail, EIO) instead of going
        # through (a read fails with EIO: the terminal approver reads again). The launcher clears
        # the mask before the command's exec.
        signal.pthread_sigmask(signal.SIG_BLOCK, (*self.SIGNALS, signal.SIGTTOU, signal.SIGTTIN))
        self._t = threading.Thread(target=self._loop, name="evidence-signals", daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while True:
            info = signal.sigwaitinfo(self.SIGNALS)
            self.received.append(info.si_signo)
            from_tty = info.si_code == 0x80  # SI_KERNEL: generated by the terminal
            if self.child is not None and self.child.poll() is None and not from_tty:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.child.pid, info.si_signo)


def _hint_leftovers() -> None:
    from evidence.agent.recorder.recovery import leftovers

    left = leftovers(RUN_SPOOL_DIR)
    if left:
        print(
            f"evidence: {len(left)} earlier run(s) left records in {RUN_SPOOL_DIR}: `evidence recover` writes their bundles",
            file=sys.stderr,
        )


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """What `evidence run` was asked for (agent/commands/run.py makes it from the command line)."""

    command: list[str]
    labels: dict[str, str]
    bundle: str | None = None
    detail: Detail = "summary"
    policy: str | None = None
    workspace: str | None = None
    dry_run: bool = False
    fail_closed: bool = False
    net: Network = None
    allow_setuid: bool = False
    allow_32bit: bool = False
    sign_key: str | None = None
    pass_fd: tuple[int, ...] = ()
    quiet_denials: bool = False
    subjects: tuple[str, ...] = ()  # --subject


class StandaloneRun:
    """`evidence run` with probes of its own: prepare (checks, probes, policy), launch (the command
    in the run's cgroup), wait (forwarding signals, collecting denials), finish (the bundle). The
    run itself is a `Run` (agent/recorder/run.py); this holds what is the command line's alone: the
    launcher, the cgroup, the watchdog, signals, the bundle's directory."""

    def __init__(self, options: RunOptions) -> None:
        args = self.args = options
        self.command = options.command
        self.labels = options.labels
        self.session_id = uuid.uuid4().hex
        self.bundle = Path(args.bundle or f"evidence-{self.session_id[:12]}.tar.gz").absolute()
        self.signer: Signer | None = None  # loaded in prepare(), while the probes load
        self.cwd = os.getcwd()
        from evidence.agent.recorder.launch import inherited_fds

        # what the caller gave evidence, before the recorder opens anything: only what --pass-fd names
        # goes on to the command
        inherited = inherited_fds()
        missing = sorted(set(args.pass_fd) - set(inherited))
        if missing:
            raise UsageError(f"--pass-fd {missing[0]}: not an open descriptor evidence inherited")
        self.inherited = sorted(set(args.pass_fd))
        self.enforcement: Enforcement | None = None
        self.netns: PrivateNetns | None = None
        self.recorder: Recorder | None = None
        self.cgroup: RunCgroup | None = None
        self.run: Run | None = None
        self.child: subprocess.Popen[bytes] | None = None
        self.launcher: Launcher | None = None
        self.watchdog: Watchdog | None = None
        self._bundle_dir_fd = -1
        self.oom_score_adj: int | None = None
        self.domain: Landlock | None = None
        self.no_new_privs = True
        self.degradations: list[Degradation] = []
        self.capabilities: dict[str, str] = {}
        self.exit_code: int | None = None
        self.signal: str | None = None
        self.rc = 0
        self._closed = False
        # the policy's command rules: the job's stderr (dup'ed before anything else is opened),
        # the run's approvals and the terminal that answers them
        self._job_stderr = -1
        self.exec_rules = False
        self._exec_check: _InThread[None] | None = None  # its programs loaded while the run is set up
        self.approver: TtyApprover | None = None
        self.ipc_why_not: str | None = None  # why the command shares the host's IPC and /dev/shm
        self.ipc_degradations: list[Degradation] = []

    # -- prepare -------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Everything that can fail before the command starts: a failure here runs nothing."""
        args = self.args
        if os.geteuid() != 0:
            raise SetupError(
                "evidence run needs root (BPF and cgroups)", "run it with sudo, or through an agent"
            )
        if not self.bundle.parent.is_dir():
            raise UsageError(f"cannot write the bundle: {self.bundle.parent} is not a directory")
        # the directory is held from now on: a job that can write its parent (a workspace) cannot
        # swap it for a symlink and have root write the bundle elsewhere (/etc)
        self._bundle_dir_fd = os.open(self.bundle.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        if args.workspace and not os.path.isdir(args.workspace):
            raise UsageError(f"--workspace {args.workspace}: not a directory")

        from evidence.agent.recorder.kernel import kernel_ready

        headers = kernel_ready()
        self.forwarder = _SignalForwarder()  # first: every thread started later inherits the blocked mask
        # the probes load (from the compiled-probe cache: the kernel's verifier, on two threads; on a
        # first start BCC compiles them) in a thread from here on, while the rest of the recorder is
        # imported, the launcher and the watchdog started and the policy loaded and planned here
        # (BCC itself is not thread-safe: the policy's own programs are loaded afterwards)
        rendered = threading.Event()
        loading = _InThread(lambda: _load_probes(rendered))
        try:
            from evidence.agent.recorder.launch import Watchdog, protect

            # the OOM killer takes the job before its recorder (and its watchdog, started next); the
            # command gets back what we had
            self.oom_score_adj = protect("self", -900)
            # first: if this process dies from here on, the run's processes die with it. It and the
            # command's launcher (when no policy or --net decides the command's environment) start
            # now and wait: their interpreters start while the probes load
            self.watchdog = Watchdog(parent_death=True)
            if not args.policy and not args.net:
                self.launcher = self._launcher()
            elif args.policy and _names_commands(args.policy):
                # the exec supervisor's process, when the policy will likely need one: its imports
                # run beside the load (unused, it exits with this process)
                from evidence.agent.recorder.exec_process import prespawn

                prespawn()
            # the load's Python first (a few tens of ms), alone: from then on it is the kernel's work
            # (the verifier, on two threads) and this thread's imports run beside it, not against it
            rendered.wait(timeout=2.0)
            from evidence.agent.recorder.run import open_recorder
            from evidence.files import private_dir

            if args.sign_key:  # a bad key runs nothing
                from evidence.bundle.signing import load_signer

                self.signer = load_signer(args.sign_key)
            self._prepare_policy()
            if self.exec_rules and not args.dry_run:
                self._exec_check = _InThread(lambda: _prepare_execs(loading))
            if self.launcher is None:
                self.launcher = self._launcher()
            from evidence.agent.recorder.launch import COMPAT_REFUSED, IPC_PRIVATE, IPC_SHARED, ipc_shared

            if self.ipc_why_not is not None:  # not root in full (a container without CAP_SYS_ADMIN)
                if self.args.fail_closed:
                    raise PolicyError(f"the command cannot be isolated: {self.ipc_why_not}")
                self.ipc_degradations = [ipc_shared(self.ipc_why_not)]
            self.capabilities = {
                "ipc": IPC_SHARED if self.ipc_why_not else IPC_PRIVATE,
                "isolation": self._isolation(),  # may refuse the options (UsageError)
                "32bit_syscalls": "allowed, not recorded (--allow-32bit)"
                if self.args.allow_32bit
                else COMPAT_REFUSED,
            }
        except BaseException:
            self._join_exec_check()
            loading.discard(lambda probes: probes.close(background=True))
            self.close()
            raise
        try:
            self.recorder = open_recorder(
                private_dir(RUN_SPOOL_DIR),
                headers,
                enforcement="none (observe only)" if self.enforcement is None else self.enforcement.mode,
                probes=loading.result(),
            )
            if self.enforcement is not None:
                self.enforcement.load_programs()
        except BaseException:
            self.close()
            raise

    def _join_exec_check(self) -> None:
        """Wait for the exec check's programs (before the probes are used for it, or closed)."""
        if self._exec_check is not None:
            self._exec_check.discard(lambda _none: None)
            self._exec_check = None

    def _launcher(self) -> Launcher:
        """The command's launcher, started now: it waits for the run's set-up (launch)."""
        from evidence.agent.recorder.launch import Launcher, private_ipc_unavailable

        netns = self.enforcement.netns if self.enforcement is not None else self.netns
        self.ipc_why_not = private_ipc_unavailable()
        return Launcher(
            self.enforcement.environ if self.enforcement is not None else os.environ,
            self.cwd,
            self.inherited,
            netns.fd if netns is not None else None,
            exec_rules=self.exec_rules,
            private_ipc=self.ipc_why_not is None,  # the run's own System V IPC and /dev/shm
        )

    def _isolation(self) -> str:
        """Decide the command's Landlock domain: the policy's when it enforces one, else a domain of
        its own (agent/recorder/launch.py: isolation); says which, for the manifest."""
        from evidence.agent.recorder.launch import COMPAT_ALLOWED, isolation
        from evidence.policy.landlock_syscalls import abi_version

        policy_domain = self.enforcement.landlock() if self.enforcement is not None else None
        if policy_domain is not None and self.args.allow_setuid:
            raise UsageError(
                "--allow-setuid cannot run with a policy's file rules: Landlock needs no_new_privs",
                "drop --allow-setuid, or use --dry-run",
            )
        abi = abi_version()
        domain, self.no_new_privs, self.degradations = isolation(abi, self.args.allow_setuid)
        self.domain = policy_domain or domain
        if policy_domain is not None and not policy_domain.scoped:
            self.degradations = isolation(abi)[2]  # a policy's domain before ABI 6: signals not scoped
        if self.args.allow_32bit:
            self.degradations = [*self.degradations, COMPAT_ALLOWED]
        self.degradations = [*self.degradations, *self.ipc_degradations]
        if self.domain is None:
            return "none (--allow-setuid)" if self.args.allow_setuid else "no_new_privs only (no Landlock)"
        return f"no_new_privs, Landlock ABI {abi}" + (
            " scoped (signals, abstract unix sockets)" if self.domain.scoped else " (ptrace confined)"
        )

    def _prepare_policy(self) -> None:
        """The policy is loaded, planned and checked before anything runs: a bad policy never starts
        the command unprotected."""
        args = self.args
        if args.policy:
            from evidence.agent.recorder.command_rules import user_notification
            from evidence.agent.recorder.enforce import Enforcement
            from evidence.policy.model import policy_file

            why_not = user_notification()  # command rules need it; without: a degradation (or exit 2)
            if why_not is not None:
                logger.info("command rules cannot be enforced here: %s", why_not)
            self.enforcement = Enforcement.for_run(
                policy_file(args.policy),
                workspace=args.workspace or self.cwd,
                dry_run=args.dry_run,
                fail_closed=args.fail_closed,
                net_mode=args.net,
                environ=os.environ,
                applies=("limits",) if why_not else ("limits", "commands"),
            )
            self.exec_rules = self.enforcement.policy.commands is not None and why_not is None
            if self.exec_rules and args.allow_setuid and not args.dry_run:
                raise UsageError(
                    "--allow-setuid cannot run with a policy's command rules: their filter needs no_new_privs",
                    "drop --allow-setuid, or use --dry-run",
                )
            if self.exec_rules:  # the supervisor's process starts while the probes load
                from evidence.agent.recorder.exec_process import prespawn

                prespawn()
            if not args.quiet_denials:  # the job is told of refusals on its own stderr
                self._job_stderr = os.dup(2)
        elif args.net:
            from evidence.policy.netns import PrivateNetns

            self.netns = PrivateNetns(args.net)
            self.netns.create()

    # -- launch --------------------------------------------------------------------------------------
    def launch(self) -> None:
        from evidence.agent.recorder.cgroups import RunCgroup
        from evidence.agent.recorder.decode import path_text
        from evidence.agent.recorder.launch import LaunchError, LaunchSpec
        from evidence.agent.recorder.run import Run, RunPlan

        assert self.recorder is not None and self.launcher is not None and self.watchdog is not None
        self.cgroup = RunCgroup.create(self.session_id)
        key = str(Path(self.args.sign_key).absolute()) if self.args.sign_key else None
        self.run = run = Run(
            self.recorder,
            RunPlan(
                command=self.command,
                cwd=path_text(self.cwd),
                labels=self.labels,
                detail=self.args.detail,
                network=self.args.net,
                roots=RunPlan.roots_of(self.enforcement),
                capabilities=self.capabilities,
                degradations=self.degradations,
                session_id=self.session_id,
                subjects=self.args.subjects,
            ),
            record_dir=RUN_SPOOL_DIR,
            enforcement=self.enforcement,
            where={"bundle_name": self.bundle.name, "bundle_path": str(self.bundle), "sign_key": key},
            held=True,  # locked while this run lives: `evidence recover` never takes its spool
        )
        if self._job_stderr >= 0:
            from evidence.agent.recorder.notices import NoticeWriter

            run.notices = NoticeWriter(self._job_stderr)
            self._job_stderr = -1  # the writer's now
            run.notices.start()
        # with its policy, and its run record written
        run.start(self.cgroup.path, signed=self.signer is not None)
        self.watchdog.watch(self.cgroup.path, self.session_id)
        # the helper becomes the command (same pid): known as the run's root before it can exec, so
        # its exec record, however soon the consumer thread reads it, is the root's (depth 0), and
        # the manifest's command is what that exec ran; its /etc/resolv.conf is the command's (the
        # helper becomes the command, in the same mounts). The run record says so before the
        # command can run: what recovery needs, whole (its pid, policy, degradations)
        self.launcher.ready()  # its own IPC and /dev/shm made: its root is the run's from now on
        run.session.correlator.add_root(self.launcher.process.pid, os.getpid(), path_text(self.cwd))
        run.launched(self.launcher.process.pid)
        root = self.launcher.process.pid
        spec = LaunchSpec(
            argv=self.command,
            cgroup_procs=Path(self.cgroup.procs_file()),
            landlock=self.domain,
            no_new_privs=self.no_new_privs,
            oom_score_adj=self.oom_score_adj,
            allow_32bit=self.args.allow_32bit,
            supervise=self._command_rules(run, root) if self.exec_rules else None,
        )
        launcher, self.launcher = self.launcher, None
        assert launcher is not None
        try:
            launched = launcher.go(spec)
        except LaunchError as e:
            raise PolicyError(f"the policy could not be applied, the command was not started: {e}") from e
        self.child = launched.process
        self.forwarder.child = launched.process
        if launched.exec_errno is not None:
            print(
                f"evidence: cannot run {self.command[0]!r}: {os.strerror(launched.exec_errno)}",
                file=sys.stderr,
            )

    def _command_rules(self, run: Run, root: int) -> Callable[[int], None]:
        """The run's command rules (agent/recorder/command_rules.py): its approvals broker, the
        terminal that answers them (when `evidence run` has one), notices to the job's stderr;
        returns what starts the supervisor on the listener the launcher hands over."""
        from evidence.agent.recorder.approvals import ApprovalBroker
        from evidence.agent.recorder.command_rules import CommandRules
        from evidence.agent.recorder.tty_approver import TtyApprover

        assert self.enforcement is not None and self.recorder is not None
        wall_offset = self.recorder.wall_offset_ns

        def clock_ns() -> int:
            return time.monotonic_ns() + wall_offset

        session = run.session
        broker = ApprovalBroker(record=lambda rec: session.add_records([rec]), clock_ns=clock_ns)
        dry_run = self.enforcement.mode == "dry-run"
        self.approver = None if dry_run else TtyApprover.open(broker, run=self.session_id)
        owner = os.getuid()
        if self.approver is not None:
            owner = self.approver.terminal_uid
            self.approver.start()
        notices = run.notices
        run.commands = CommandRules(
            self.session_id,
            self.enforcement.policy,
            add_records=session.add_records,
            broker=broker,
            owner_uid=owner,
            tell=notices.tell if notices is not None else lambda _line: None,
            dry_run=dry_run,
            clock_ns=clock_ns,
            pins=self.recorder.probes,
            slot=session.slot,
            degrade=run.degrade,
            past_cap=session.past_cap,  # audited execs past the cap: counted in the manifest's lost
        )
        rules = run.commands
        return lambda listener: rules.supervise(listener, root)

    # -- wait ----------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Wait for the command (collecting connect-guard denials meanwhile), then kill what it left
        behind in its cgroup and wait until the cgroup is empty."""
        assert self.child is not None
        try:
            assert self.run is not None and self.cgroup is not None
            status = _wait(self.child, self.run, self.cgroup)
            if self.run.wall_reached:
                self.signal = signal_name(-status) if status < 0 else None
                self.exit_code = None if status < 0 else status
                self.rc = EXIT_WALL
            elif status < 0:
                self.signal = signal_name(-status)
                self.exit_code = None
                self.rc = 128 - status
            else:
                self.exit_code = self.rc = status
        finally:  # whatever happened above, nothing of the run outlives it
            self._empty_cgroup()

    def _empty_cgroup(self) -> None:
        if self.cgroup is None:
            return
        left = self.cgroup.kill()
        if left:
            logger.warning("killed %d process(es) the command left behind", left)
        self.cgroup.wait_empty()

    # -- finish --------------------------------------------------------------------------------------
    def finish(self) -> dict[str, Any]:
        run = self.run
        assert run is not None
        try:
            manifest = run.finish(
                self._held_bundle(), exit_code=self.exit_code, signal=self.signal, signer=self.signer
            )
        except OSError as e:
            # the job's outcome must not be lost with the bundle: say it, keep the records
            with contextlib.suppress(OSError):
                run.save(exit_code=self.exit_code, signal=self.signal, finished_ns=time.time_ns())
            raise SetupError(
                f"the command exited {self.rc}, but its bundle could not be written: {e.strerror or e}",
                f"its records are kept in {RUN_SPOOL_DIR}; `evidence recover` writes the bundle once there is room",
            ) from e
        with contextlib.suppress(OSError):  # where the directory is now, if the job moved it
            self.bundle = Path(os.readlink(f"/proc/self/fd/{self._bundle_dir_fd}")) / self.bundle.name
        return manifest

    def close(self) -> None:
        _blocking(1, 2)  # a job can make the shared stdout/stderr non-blocking to lose these lines
        # first: the recorder's close forks a child that would keep these open for as long as it
        # lives (the lock: the run's records from `evidence recover`; the directory: its mount busy)
        if self.run is not None:
            self.run.release()
        if self._bundle_dir_fd >= 0:
            os.close(self._bundle_dir_fd)
        self._bundle_dir_fd = -1
        if self.launcher is not None:  # prepared, never launched: the helper exits, nothing runs
            self.launcher.abort()
            self.launcher = None
        if self.approver is not None:
            self.approver.stop()
            self.approver = None
        if self._job_stderr >= 0:
            os.close(self._job_stderr)
            self._job_stderr = -1
        if self.run is not None:
            self.run.close_enforcement()  # (if finish has not)
        elif self.enforcement is not None and not self._closed:
            self.enforcement.close()
        self._closed = True
        if self.netns is not None:
            self.netns.remove()
            self.netns = None
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self._empty_cgroup()  # on an error path: the job must not run on unrecorded
            self.cgroup.remove()
            if self.cgroup.path.exists():
                # still there: leave the watchdog to kill it, rather than telling it all is done
                logger.warning("cannot remove %s: its watchdog will kill what is left", self.cgroup.path)
                self.watchdog = None
            self.cgroup = None
        self._join_exec_check()
        if self.recorder is not None:
            self.recorder.close(background=True)  # the process exits next: let a child pay for detaching
            self.recorder = None
        if self.watchdog is not None:
            self.watchdog.done()
            self.watchdog = None

    def _held_bundle(self) -> Path:
        """The bundle's path through the directory opened at the start (/proc/self/fd/N/NAME)."""
        return Path(f"/proc/self/fd/{self._bundle_dir_fd}") / self.bundle.name

    def report(self, manifest: dict[str, Any]) -> int:
        _summary(manifest, self.bundle)
        _hint_leftovers()
        if manifest["lost"]["total"]:
            logger.warning("%d events were lost: the bundle says which kinds", manifest["lost"]["total"])
        denials = manifest["counts"].get("dev.evidence.policy.denial", 0)
        if self.enforcement is not None and self.enforcement.mode == "dry-run" and denials:
            print(f"evidence: dry run: {denials} operation(s) would have been blocked", file=sys.stderr)
            return EXIT_WOULD_BLOCK
        return self.rc


def _blocking(*fds: int) -> None:
    import fcntl

    for fd in fds:
        with contextlib.suppress(OSError):
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if flags & os.O_NONBLOCK:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)


def _wait(child: subprocess.Popen[bytes], run: Run, cgroup: RunCgroup) -> int:
    """Wait for the command, collecting connect-guard denials and reading the policy's limits
    meanwhile; the wall limit kills the run's cgroup, saying so."""
    guard = run.enforcement is not None and run.enforcement.guard is not None
    if not guard and run.limits is None:
        return child.wait()
    while True:
        try:
            return child.wait(timeout=0.1 if guard else 1.0)
        except subprocess.TimeoutExpired:
            if guard:
                run.poll_denials()
            if run.poll_limits():
                assert run.limits is not None
                print(
                    f"evidence: the run reached limits.wall ({(run.limits.limits.wall_ms or 0) / 1000:g} s): killing it",
                    file=sys.stderr,
                )
                cgroup.kill()


def _summary(manifest: dict[str, Any], bundle: Path) -> None:
    print(
        summary_line(
            manifest["events"], manifest["counts"], manifest["lost"]["total"], manifest["run_id"], bundle
        ),
        file=sys.stderr,
    )
