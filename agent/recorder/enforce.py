"""Enforcement of a policy on one run: Landlock for files, the connect guard for the network, a
private tmp, a scrubbed environment, an optional network namespace, and the denial records.

Landlock refusals reach the recorder as EACCES results of opens and execs; the policy model says
which rule refused them. Under --dry-run nothing is enforced and every operation the policy would
refuse is recorded as a would-block denial.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

from evidence.agent.recorder.connect_guard import ConnectGuard
from evidence.agent.recorder.decode import path_text
from evidence.agent.recorder.description import ManifestPolicy
from evidence.agent.recorder.exe_hash import SHEBANG_MAX, read_head, shebang_interpreter
from evidence.agent.recorder.launch import Landlock
from evidence.bundle.format import Degradation
from evidence.bundle.record_types import ConnectRecord, DenialRecord, SpoolRecord
from evidence.errors import PolicyError, SetupError
from evidence.policy import env as penv
from evidence.policy import landlock
from evidence.policy import tmp as ptmp
from evidence.policy.model import Policy, load_policy
from evidence.policy.netns import PrivateNetns

if TYPE_CHECKING:
    from evidence.agent.recorder.recording import Session

logger = logging.getLogger(__name__)

_REFUSED = ("EACCES", "EPERM")
_INTERPRETERS = 4  # the kernel follows at most this many `#!` levels (BINPRM_MAX_RECURSION)


def exec_chain(filename: str, cwd: str | None) -> list[str]:
    """The files the kernel needs the exec right on to run `filename` (absolute), beyond its name:
    the file it names with its symlinks resolved, then, for a `#!` script, its interpreter (resolved
    against `cwd` when relative, and so on while that is a script). Landlock checks the files, not
    the names: an exec of an allowed name refused all the same reached one of these (a symlink into
    a directory the exec rules do not allow, a script whose interpreter is there). Read now, by path
    (a file changed since says what it is now); a name that cannot be read ends the chain."""
    out: list[str] = []
    name = filename
    for _ in range(_INTERPRETERS + 1):
        real = os.path.realpath(name)
        if real != name:
            out.append(real)
        head = read_head(real, SHEBANG_MAX)  # without blocking: the job can put a FIFO there
        interp = shebang_interpreter(head[0]) if head is not None else None
        if interp is None:
            break
        if not interp.startswith("/"):
            if not cwd or not cwd.startswith("/"):
                break
            interp = os.path.join(cwd, interp)
        out.append(os.path.normpath(interp))
        name = out[-1]
    return out


def _as_text(value: Any) -> Any:
    """`value` (JSON-able) with every str as text: lone surrogates (bytes os.getcwd() and friends
    could not decode) as \\xNN, so that the manifest can be written at all."""
    if isinstance(value, str):
        return path_text(value)
    if isinstance(value, dict):
        return {_as_text(k): _as_text(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_as_text(v) for v in value]
    return value


Section = Literal["commands", "limits"]
SECTIONS: tuple[Section, ...] = ("commands", "limits")
_UNAPPLIED: dict[Section, str] = {
    "commands": "every program runs, whatever its rules say",
    "limits": "the run may use more than the policy allows",
}

_COMPILE = threading.Lock()  # BCC compiles one program at a time in a process


class Enforcement:
    """A policy in force on one run: what it refuses, how it is enforced, what it refused.

    `for_run` makes one for `evidence run` (its private tmp, scrubbed environment and network
    namespace are made here and removed by `close`); the agent builds one from what its client made
    and sent (agent/daemon/policy.py: the tmp and the environment are the client's)."""

    def __init__(
        self,
        policy: Policy,
        *,
        workspace: str,
        tmpdir: str,
        dry_run: bool,
        fail_closed: bool,
        environ: Mapping[str, str] | None = None,
        env_removed: Sequence[str] = (),
        net_mode: str | None = None,
        owns_tmp: bool = False,
        applies: Collection[str] = (),
    ) -> None:
        """`applies`: the sections of issue 24 (commands, limits) that the caller puts in force on
        the run; a section of the policy it does not apply is a degradation, never a claim."""
        self.policy = policy
        self.mode = "dry-run" if dry_run else "enforce"
        self.workspace = workspace
        self.tmpdir = tmpdir
        self.environ = dict(environ) if environ is not None else {}
        self.env_removed = list(env_removed)
        self.net_mode = net_mode
        self.guard: ConnectGuard | None = None
        self.netns: PrivateNetns | None = None
        self._owns_tmp = owns_tmp
        self._dry_run = dry_run
        self._fail_closed = fail_closed
        self._rules: dict[tuple[str, str], str | None] = {}
        self.abi = landlock.abi_version()
        self.plan = landlock.plan(policy, self.abi)
        self.degradations = [Degradation.model_validate(d) for d in self.plan.degradations]
        if policy.fs is not None and not self.plan.enforced and not dry_run:
            self.degradations.append(
                Degradation(
                    component="landlock",
                    reason="Landlock is not available on this kernel",
                    impact="file rules are recorded but not enforced",
                )
            )
        for section in SECTIONS:
            if getattr(policy, section) is not None and section not in applies:
                self.degradations.append(
                    Degradation(
                        component=section,
                        reason=f"this run cannot apply the policy's {section} section",
                        impact=f"{section} is in the policy but not in force: {_UNAPPLIED[section]}",
                    )
                )

    @classmethod
    def for_run(
        cls,
        policy_path: str,
        *,
        workspace: str,
        dry_run: bool,
        fail_closed: bool,
        net_mode: str | None,
        environ: Mapping[str, str],
        applies: Collection[str] = (),
    ) -> Enforcement:
        """The policy at `policy_path` on a run of this process's: a private tmp, the environment
        scrubbed, and the network namespace (`net_mode`) made now."""
        workspace = os.path.realpath(workspace)
        tmpdir = ptmp.create_private_tmp()
        try:
            policy = load_policy(policy_path, workspace=workspace, tmpdir=tmpdir)
            env, removed = penv.scrub(environ, policy.env)
            self = cls(
                policy,
                workspace=workspace,
                tmpdir=tmpdir,
                dry_run=dry_run,
                fail_closed=fail_closed,
                environ=ptmp.tmp_environ(env, tmpdir),
                env_removed=removed,
                net_mode=net_mode,
                owns_tmp=True,
                applies=applies,
            )
        except BaseException:
            ptmp.remove_private_tmp(tmpdir)
            raise
        try:
            if net_mode:
                self.netns = PrivateNetns(net_mode)  # type: ignore[arg-type]
                self.netns.create()
        except BaseException:
            self.close()
            raise
        return self

    def load_programs(self) -> None:
        """Compile the connect guard (BCC: never while another BPF compile runs in this process),
        then refuse to go on under --fail-closed if anything cannot be enforced."""
        try:
            if self.policy.net is not None:
                self._load_guard()
            if self._fail_closed and self.degradations and not self._dry_run:
                first = self.degradations[0]
                raise PolicyError(
                    f"the policy cannot be fully enforced here: {first.component}: {first.reason} ({first.impact})",
                    f"{len(self.degradations)} problem(s); drop --fail-closed to run with them recorded",
                )
        except BaseException:
            self.close()
            raise

    def _load_guard(self) -> None:
        assert self.policy.net is not None
        try:
            self.guard = ConnectGuard(self.policy.net, dry_run=self._dry_run)
            with _COMPILE:
                self.guard.load()
        except SetupError as e:
            self.guard = None
            self.degradations.append(
                Degradation(
                    component="connect_guard",
                    reason=e.message,
                    impact="network rules are recorded but not enforced",
                )
            )

    # ---- around the child ----------------------------------------------------------------------
    def enforce_on(
        self,
        session: Session,
        *,
        watch: Callable[[Sequence[SpoolRecord]], None] | None = None,
        tell: Callable[[DenialRecord], None] | None = None,
    ) -> None:
        """Make `session` this policy's run (standalone and through the agent alike): the manifest's
        policy, the policy's degradations, denials of what it records, and the connect guard on its
        cgroup, attached before the command is in it. `watch`: shown the run's records too;
        `tell`: given each denial of its records (the job is told of refusals)."""
        observe = self.observe
        if watch is not None or tell is not None:

            def observe(records: Sequence[SpoolRecord]) -> list[DenialRecord]:
                if watch is not None:
                    watch(records)
                out = self.observe(records)
                if tell is not None:
                    for rec in out:
                        tell(rec)
                return out

        session.enforce(self.manifest_policy(), self.degradations, observe)
        self.attach(str(session.cgroup_path))

    @property
    def fail_closed(self) -> bool:
        return self._fail_closed

    def attach(self, cgroup_path: str) -> None:
        if self.guard is not None:
            self.guard.attach(cgroup_path)

    def landlock(self) -> Landlock | None:
        """The Landlock domain the command's launcher applies before it execs (None: dry run, or no
        Landlock here). The network namespace, if any, is `self.netns`."""
        return Landlock.of_plan(self.plan) if self.mode == "enforce" else None

    def poll_denials(self, exe_of: Callable[[int], str | None], timeout_ms: int = 0) -> list[DenialRecord]:
        if self.guard is None:
            return []
        # policy/connect.py's to_denial makes them (a DenialRecord: PolicyDenial's shape, k and t);
        # the guard (agent/recorder/connect_guard.py) hands them on as plain dicts
        out = cast("list[DenialRecord]", self.guard.poll(timeout_ms))
        for rec in out:
            rec["exe"] = exe_of(rec["pid"])
        return out

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()
            self.guard = None
        if self.netns is not None:
            self.netns.remove()
            self.netns = None
        if self._owns_tmp and self.tmpdir:
            ptmp.remove_private_tmp(self.tmpdir)

    # ---- what the policy says about recorded operations ----------------------------------------
    def observe(self, records: Sequence[SpoolRecord]) -> list[DenialRecord]:
        """Denial records for opens and execs the policy refuses (enforced, or would-block)."""
        if self.policy.fs is None:
            return []
        out: list[DenialRecord] = []
        for rec in records:
            accesses: Sequence[str]
            if rec["k"] == "connect":
                denial = self._unix_connect(rec)
                if denial is not None:
                    out.append(denial)
                continue
            if rec["k"] == "open":
                target, accesses, exe = rec["path"], rec["access"], rec.get("exe")
            elif rec["k"] == "exec":
                target, accesses = rec["filename"], ["exec"]
                exe = target
            else:
                continue
            result = rec["result"]
            if target.startswith("<") or (result != 0 and result not in _REFUSED):
                continue
            for access in accesses:
                rule = self._file_rule(target, access)
                if rule is None and result in _REFUSED and self.mode == "enforce":
                    rule = self.plan.explain(target, access)
                if rule is None and rec["k"] == "exec" and result in _REFUSED and self.mode == "enforce":
                    # an allowed name, refused: the file it reached, or its #! interpreter, is not
                    # (the run's own command too: it exits 126 and said nothing of why)
                    target, rule = self._exec_refused(rec["filename"], rec["cwd"], rec.get("mntns"))
                if rule is None:
                    continue
                enforced = self.mode == "enforce" and result in _REFUSED
                out.append(
                    {
                        "k": "denial",
                        "t": rec["t"],
                        "pid": rec["pid"],
                        "exe": exe,
                        "operation": access,
                        "target": target,
                        "rule": rule,
                        "enforced": enforced,
                        "result": result,
                    }
                )
                break
        return out

    def _exec_refused(self, filename: str, cwd: str | None, mntns: str | None) -> tuple[str, str | None]:
        """(the file, the rule) that refused an exec of the allowed name `filename`: the first of
        what the kernel opened to run it (exec_chain) that the exec rules do not allow; (filename,
        None) when none is found (or the process's paths name other files than the recorder's, as
        in its own /dev/shm: exec_helper.private_ipc)."""
        if (
            mntns is None
            and filename.startswith("/")
            and not filename.startswith(("/dev/shm/", "/dev/mqueue/"))
        ):
            for path in exec_chain(filename, cwd):
                rule = self._file_rule(path, "exec")
                if rule is not None:
                    return path, rule
        return filename, None

    def _unix_connect(self, rec: ConnectRecord) -> DenialRecord | None:
        """A connect (or send) to a pathname unix socket the file rules give no access at all: Landlock
        does not check connects to pathname sockets (only their creation), so it went through. Recorded
        as a denial that was not enforced, whatever the mode (a server of another uid, such as the
        system bus or a container runtime's socket, answers a job the policy keeps out of /run)."""
        path = rec["address"]
        if rec["family"] != "AF_UNIX" or rec["result"] != 0 or not path.startswith("/"):
            return None
        rule = self._file_rule(path, "read")  # write implies read: no access at all
        if rule is None:
            return None
        return {
            "k": "denial",
            "t": rec["t"],
            "pid": rec["pid"],
            "exe": rec.get("exe"),
            "operation": "connect",
            "target": path,
            "rule": rule,
            "enforced": False,
            "result": rec["result"],
        }

    def _file_rule(self, path: str, access: str) -> str | None:
        key = (path, access)
        try:
            return self._rules[key]
        except KeyError:
            pass
        decision = self.policy.check_file(path, access)
        rule = decision.rule if decision else None
        if len(self._rules) < 65536:  # a build opens the same files again and again
            self._rules[key] = rule
        return rule

    def manifest_policy(self) -> ManifestPolicy:
        """What the manifest says of the policy. Its paths (the workspace, ${WORKSPACE}, Landlock's
        rules) come from the file system as str: a name that is not UTF-8 is written as \\xNN."""
        return cast(ManifestPolicy, _as_text(self._manifest_policy()))

    def _manifest_policy(self) -> ManifestPolicy:
        return {
            **self.policy.summary(),
            "mode": self.mode,
            "workspace": self.workspace,
            "tmpdir": self.tmpdir,
            "landlock": self.plan.summary(),
            "connect_guard": self.guard is not None,
            "env_removed": list(self.env_removed),
            "net_namespace": self.net_mode,
        }
