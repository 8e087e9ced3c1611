"""lint's rules: each rule's code, name, severity and text (`RULES`, what `--explain` prints and
SARIF carries), the places and patterns they judge by (the scratch places a write may go, the shapes
of secrets, descriptor paths, which namespace calls change what paths name), and what lint found
(`Finding`, `Signature`). bundle/lint.py is the visitor that applies them to a bundle's events;
the command is bundle/commands/lint.py."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from typing import TypedDict

from evidence.errors import UsageError

logger = logging.getLogger(__name__)

# --fail-on: the index into lint_output.SEVERITIES a finding must reach (none: never)
FAIL_ON = {"error": 0, "warn": 1, "info": 2, "none": -1}
TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
WRITE_OK = (
    "/tmp", "/var/tmp", "/dev/shm", "/dev/null", "/dev/zero", "/dev/full", "/dev/tty", "/dev/ptmx",
    "/dev/pts", "/dev/stdout", "/dev/stderr", "/dev/fd", "/proc/self/fd", "/proc/thread-self/fd",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Rule:
    code: str
    name: str
    severity: str  # error | warning | note
    short: str
    explain: str


RULES: dict[str, Rule] = {
    r.code: r
    for r in (
        Rule("EV001", "events-lost", "warning", "The recorder lost events",
             "The kernel ring buffer or the agent dropped events (manifest lost.total > 0, or "
             "dev.evidence.loss events). The bundle is then a lower bound of what the run did: an "
             "operation that is absent may simply not have been recorded, and a job can cause "
             "loss on purpose (a flood of system calls) to hide something in it. Gates that need "
             "complete evidence should use --fail-on warn. Re-run with a larger buffer or less "
             "detail (--detail summary) if you need complete evidence."),
        Rule("EV002", "enforcement-degraded", "warning", "Recording or enforcement was degraded",
             "A dev.evidence.degradation event says that a component (a probe, Landlock, the "
             "connect filter) could not do all it should, e.g. because the kernel lacks a feature. "
             "What the event's 'impact' names was not recorded or not enforced."),
        Rule("EV003", "secret-exposed", "error", "A secret or token appears in argv, a path or a subject",
             "A string that looks like a credential (GitHub token ghp_/github_pat_, AWS key AKIA, "
             "API key sk-, Slack token xox[bp]-, 'Bearer ...', a PEM private key header, or "
             "password=/token=/secret=...) appears in a command line, a path or an event subject. "
             "Command lines are visible to every process on the host and now sit in this bundle: "
             "rotate the secret and pass it through a file or the environment instead. The finding "
             "shows only the kind of secret and its first characters."),
        Rule("EV004", "write-outside-workspace", "warning", "A file was written outside the workspace",
             "A file.open that succeeded with write or create access, or a file.change that "
             "succeeded (rename, unlink, link, truncate, chmod, ...), names a path outside the "
             "workspace (manifest.policy.workspace, else the run's cwd), outside the run's TMPDIR "
             "and outside the usual scratch places (/tmp, /var/tmp, /dev/shm, /dev/null, ttys, "
             "/proc/self/fd). Builds that write elsewhere (home directory caches, /etc, /usr) are "
             "not hermetic and may tamper with the machine. A path that keeps a '..' after a "
             "component (the recorder had no kernel name for it; that component may be a symlink) "
             "may lead anywhere and is judged outside. A change through a descriptor's magic link "
             "(/proc/self/fd/N, /dev/fd/N, /dev/stdout, ...) is named after the file the descriptor "
             "held; one the recorder could not name so (a descriptor it never saw opened) may have "
             "changed any file and is judged outside. A write or change of a file with other names "
             "(nlink, its link count: a hard link, made in an earlier run, say) is flagged wherever "
             "it is named: the other names may be outside the workspace. Relative paths are not "
             "judged."),
        Rule("EV005", "egress-unenforced", "warning", "Network connection to a non-loopback address in an observe-only run",
             "The run had no policy (manifest.policy is null), and a process connected (or tried "
             "to connect) to an address that is not loopback. Nothing restricted this traffic; if "
             "the run should be offline, record it with a policy that denies connects."),
        Rule("EV006", "exec-from-temp", "warning", "A program was executed from a writable temp directory or a file descriptor",
             "A process.exec that succeeded ran a binary (or a #! script's interpreter) under "
             "/tmp, /var/tmp, /dev/shm or the "
             "run's TMPDIR (but not inside the workspace), or from a file descriptor the recorder "
             "did not see opened (/dev/fd/N: a memfd, or a descriptor passed in), which leaves no "
             "file to inspect; or through a name that keeps a '..' after a component (that "
             "component may be a symlink: the program may be from anywhere). Droppers and "
             "downloaded tools run from there; check where the binary came from."),
        Rule("EV007", "run-not-finished", "error", "The run was not recorded to its end",
             "There is no dev.evidence.run.finished event, or the manifest says cut_short: the "
             "recorder stopped before the run ended (killed, timeout, agent restart). Anything the "
             "run did afterwards is missing from the bundle."),
        Rule("EV008", "clock-backwards", "note", "Event times go backwards",
             "An event's time (for summary-mode opens and connects, its first_time) is earlier "
             "than an earlier event's by more than one second. Events from different CPUs can be "
             "slightly out of order; more than a second suggests a clock jump (NTP step, VM "
             "migration) and makes durations in this bundle unreliable."),
        Rule("EV009", "program-from-writable-place", "note", "A program ran from a place the job can write",
             "A process.exec that succeeded ran a program (or a #! script, or a script whose #! "
             "interpreter is there) from the workspace, "
             "/tmp, /var/tmp, /dev/shm or the run's TMPDIR: places the job itself, or anything it "
             "ran, could have written. The finding names the program with its sha256 (as read "
             "when it ran; an interpreter's, interpreter_sha256), so that what ran can be compared "
             "with what was built or reviewed; the "
             "same path with another content is another finding (and `evidence diff` reports it "
             "as changed between runs)."),
        Rule("EV010", "other-mount-namespace", "warning", "A process left the run's mount namespace, mounted or chrooted",
             "A dev.evidence.process.namespace event says that a process of the run made a new "
             "mount or user namespace (unshare, clone), entered a namespace (setns), mounted "
             "(mount, move_mount, open_tree, fsmount), or changed its root (chroot, pivot_root), "
             "and it succeeded; or events carry mntns: \"other\" (by such a process, or a child "
             "of one). From then on the paths that process names may name other files than the "
             "same paths in the run's own namespace: a job can bind-mount a file of its own over "
             "/etc/hostname or /usr/bin/true, and the bundle then says that /etc/hostname was "
             "read and /usr/bin/true ran. Read those events' paths as names the process used, "
             "not as the files of the machine. The finding names the processes and what they did."),
        Rule("EV011", "tampered-outside-run", "error", "A process of the run traced or wrote the memory of a process outside it",
             "A ptrace (attach, seize, poketext, pokedata, pokeuser) or process_vm_writev by a "
             "process of the run succeeded on a process that is not one of the run's. Such a "
             "process can be made to do anything on the job's behalf, and what it does is not "
             "recorded. By default the job's Landlock domain forbids it; a run with "
             "--allow-setuid runs without that domain."),
        Rule("EV012", "tamper-attempt-outside-run", "note", "A process of the run tried to trace or write the memory of a process outside it",
             "A ptrace (attach, seize, poke) or process_vm_writev by a process of the run on a "
             "process that is not one of the run's failed (the event's result says why, e.g. "
             "EPERM from the job's Landlock domain). Nothing was done to that process, but the job "
             "tried: a note, since the default confinement is doing its work."),
        Rule("EV013", "32bit-syscall-refused", "warning", "A process made a system call through a 32-bit entry, which was refused",
             "A dev.evidence.policy.denial with operation 'syscall' and rule 'isolation: 32-bit "
             "system calls': a process called the kernel through the i386 entry (int $0x80, "
             "sysenter, or syscall from 32-bit code) or as x32. The kernel's syscall tracepoints "
             "do not see such calls, so every command evidence launches runs under a seccomp "
             "filter that refuses them: the call was not made and the thread got SIGSYS (which "
             "kills it unless it handles the signal). A 64-bit program that does this is hiding "
             "what it does; a real 32-bit program cannot run recorded at all: run it with "
             "`evidence run --allow-32bit`, which lets it run unrecorded and says so (EV002)."),
        Rule("EV014", "command-not-as-claimed", "error", "The command the kernel executed is not the one claimed",
             "A dev.evidence.degradation with component 'command': the argv of the run's first "
             "exec, as the kernel copied it (the manifest's command), is not the command the "
             "caller claimed (manifest.claimed_command; for a #! script the kernel's argv is the "
             "interpreter, the script's name and the claim's arguments, which agrees), or no such "
             "exec was recorded (it failed, none was made, or its record was lost). A client of "
             "the agent is not trusted: one that claims `make test` and runs `sh -c 'cat SECRET'` "
             "gets a bundle that says what ran, with its claim beside it and this error. Read the "
             "manifest's command and the run's first process.exec event (filename, sha256) for "
             "what ran; argv[0] alone never names the program."),
        Rule("EV015", "dns-unsolicited", "warning", "A DNS answer was credited to no query of the run",
             "A dev.evidence.network.dns event has 'unsolicited': an answer was received that the "
             "recorder did not credit to a query of the run, so the names in it were given to no "
             "connect. 'other source': it came from another address or port than its query was "
             "sent to, e.g. a job answering its own query from a port of its own to give an "
             "address of its choosing the name github.com; 'unverified': its bytes are not those of a "
             "message the kernel delivered to the socket it was read from (rewritten in the job's "
             "buffer by another thread, read from the middle of a DNS-over-TCP stream, or its "
             "delivery not recorded, which a degradation event says); 'no query': no query with "
             "its id and question was sent on that socket. A resolver's late answer to a query "
             "sent again can be one too. Connects to the addresses in it are compared by address "
             "(evidence diff, baseline, profile), so the finding explains a destination that "
             "looks new rather than hiding one. The finding names the answer and where it came from."),
        Rule("EV016", "dns-other-resolver", "note", "DNS queries went to a server that is not one of the run's configured resolvers",
             "A dev.evidence.network.dns event has 'configured_resolver': false: its query went "
             "to, or its answer came from, a server other than the nameservers of the run's "
             "/etc/resolv.conf (manifest.resolvers), or it was received by a process in another "
             "mount namespace (whose network may be one of its own). Programs that talk to a DNS "
             "server of their own choosing (a public resolver, a server of the job's) do this. "
             "The names such answers give are recorded as a connect's 'other_names' and are "
             "never used to compare connects: those are compared by address. Not reported for "
             "bundles without manifest.resolvers (recorded before the field)."),
        Rule("EV017", "subject-not-written-by-run", "error", "A subject of the attestation was not written by the run",
             "The run was asked to attest files it produced (`evidence run --subject`), and one of "
             "them, as it was when the run ended, is not tied to a write by a process of the run: "
             "the run never wrote, created or renamed anything into its path (it was there before, "
             "or something outside the run made it); or the run removed or moved it away after its "
             "last write; or it was renamed into place from a file the run did not write; or its "
             "ctime, which no process can set, is after the run ended, before it started, or before "
             "the run's last write of it (it was replaced by a process outside the run). The "
             "attestation names it as a subject with 'writtenByRun': false and the reason, and "
             "`evidence verify --artifact` refuses it. What the events cannot show: a process "
             "outside the run writing to the file while a process of the run still held it open "
             "for writing (docs/bundle-format.md \"Artifacts\")."),
        Rule("EV018", "subjects-refused", "warning", "Files the --subject patterns matched were refused as subjects",
             "A match of a `--subject` pattern is not a subject: it leads out of the workspace (a "
             "symlink), is not a regular file (a directory, FIFO, device or socket), has other "
             "names (a hard link), changed while it was hashed, has a path over 512 bytes, or "
             "came past the caps (256 subjects, 4 GiB hashed in all); or a pattern matched "
             "nothing. manifest.artifacts.refused lists each with the reason. Such a file is not attested: a release that "
             "needs it must produce it in the workspace, under the caps."),
        Rule("EV019", "approval-timed-out", "warning", "An exec waiting for a person's approval was decided by the timeout",
             "A dev.evidence.policy.approval event resolved with 'via': 'timeout': a commands rule "
             "with decision approve held the exec, nobody answered within approvals.timeout, and "
             "approvals.on_timeout decided (its 'state' says which). With on_timeout: allow, the "
             "exec ran without anyone's approval; with deny, the job may have failed for want of an "
             "answer. Check that the approvers were reachable (the terminal of evidence run, or "
             "evidence approvals through the agent), or lengthen the timeout."),
        Rule("EV020", "exec-refused", "warning", "An exec was refused by a commands rule",
             "A dev.evidence.policy.denial with operation 'exec': the exec supervisor refused the "
             "exec (EACCES; 'enforced': false in a --dry-run, where it would have been) by the "
             "commands rule its 'rule' names (commands.rules[N] (name), or commands.default), or "
             "a person denied it. The job tried to run a program its policy forbids: a build that "
             "needs it needs the policy changed; one that should not is worth a look. An exec the "
             "supervisor could not read is named <unreadable>."),
        Rule("EV021", "exec-not-as-decided", "error", "An exec ran otherwise than the policy's command rules allowed, and was killed",
             "A dev.evidence.policy.violation: an exec of a run whose command rules are enforced "
             "loaded another file, or copied other arguments, than the exec supervisor allowed "
             "(reasons file, args), or no exec of that thread was allowed at all (no_pin: the "
             "supervisor never saw it). A job does this on purpose: one thread rewrites the path "
             "or argv in memory after the supervisor read them and before the kernel copies them "
             "again. The kernel's check killed the new program before its first instruction "
             "(killed; if the kernel could not, the recorder killed it on reading the event, and "
             "it may have run a little). The finding names the process and what differed."),
        Rule("EV022", "exec-audited", "note", "An exec matched a commands rule with decision audit",
             "A dev.evidence.policy.audit event: the exec ran, and the policy's commands rule its "
             "'rule' names asked for it to be noted (decision: audit). Counted by rule and program; "
             "each event has the argv, the depth and the rule's message. A run keeps the first "
             "1,000 audit events; matches past them are counted in the manifest's lost.by_kind as "
             "audit_past_cap (EV001 says so)."),
    )
}  # fmt: skip
BY_NAME = {r.name: r for r in RULES.values()}

# Secrets: (kind, pattern). Patterns are anchored on the token shape so ordinary words don't match.
SECRETS = [
    ("GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})")),
    ("AWS access key id", re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("API key", re.compile(r"\bsk-[A-Za-z0-9_-]{16,}")),
    ("Slack token", re.compile(r"\bxox[bpas]-[A-Za-z0-9-]{10,}")),
    ("bearer token", re.compile(r"\bBearer\s+[A-Za-z0-9._~+/=-]{8,}")),
    ("private key", re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----")),
    ("password", re.compile(r"(?i)\b(?:password|passwd|pwd|secret|token|api[_-]?key)=[^\s&;]{3,}")),
]


FD_PATH = re.compile(r"/dev/fd/\d|/proc/(?:self|thread-self|\d+)/fd/\d")  # a program run from a descriptor
# a change through a descriptor's magic link that the recorder could not name after the file (one
# it never saw opened, or that named another file by then), or /dev/stdin, stdout, stderr (links
# to /proc/self/fd/0-2): it may have changed any file
THROUGH_FD = re.compile(
    r"/dev/(?:fd/\d|std(?:in|out|err)(?:/|$))|/proc/(?:self|thread-self|\d+)(?:/task/\d+)?/fd/\d"
)


PATH_NS = ("CLONE_NEWNS", "CLONE_NEWUSER")


def changes_paths(op: str, flags: list[str]) -> bool:
    """Whether a successful namespace call changes what the process's paths name (as the kernel
    marks it: record.bpf.c ns_exit and ns_fork)."""
    if op in ("unshare", "clone"):
        return any(f in PATH_NS for f in flags)
    if op == "setns":
        return not flags or any(f in PATH_NS for f in flags)
    return op in ("mount", "move_mount", "open_tree", "fsmount", "pivot_root", "chroot")


def maybe_secret(s: str) -> bool:
    """A cheap pre-check (a regex search per string costs too much at a million events)."""
    return (
        "=" in s
        or "gh" in s
        or "sk-" in s
        or "AKIA" in s
        or "ASIA" in s
        or "xox" in s
        or "earer" in s
        or "PRIVATE" in s
    )


class FindingJSON(TypedDict):
    """A finding in `lint --format json` (docs/bundle-format.md)."""

    rule: str
    name: str
    severity: str
    message: str
    event_id: str | None
    seq: int | None
    count: int
    fingerprint: str


class SignatureJSON(TypedDict):
    """What `lint --format json` says of the signature."""

    signed: bool
    keyids: list[str]
    verified_keyid: str | None


@dataclasses.dataclass
class Finding:
    rule: Rule
    message: str
    key: str  # what makes this finding itself, normalised (stable across runs)
    event_id: str | None = None
    seq: int | None = None
    count: int = 1

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(f"{self.rule.code}\0{self.key}".encode()).hexdigest()

    def as_dict(self) -> FindingJSON:
        return {
            "rule": self.rule.code,
            "name": self.rule.name,
            "severity": self.rule.severity,
            "message": self.message,
            "event_id": self.event_id,
            "seq": self.seq,
            "count": self.count,
            "fingerprint": self.fingerprint,
        }


@dataclasses.dataclass(frozen=True)
class Signature:
    """What lint says about a bundle's signature: the keyids it is signed by (none: unsigned), and
    the keyid of the --key it was checked with (None: not checked)."""

    keyids: tuple[str, ...] = ()
    checked: str | None = None

    def text(self) -> str:
        if not self.keyids:
            return "note: not signed"
        if self.checked is not None:
            return f"signature verified: signed by keyid {self.checked}"
        return f"note: signed by keyid {', '.join(self.keyids)} (signature not checked: give --key KEY.pub)"

    def as_dict(self) -> SignatureJSON:
        return {"signed": bool(self.keyids), "keyids": list(self.keyids), "verified_keyid": self.checked}


def redact(secret: str) -> str:
    return secret[:6] + "..." if len(secret) > 8 else "..."


def explain(which: str) -> str:
    rule = RULES.get(which.upper()) or BY_NAME.get(which.lower())
    if rule is None:
        raise UsageError(
            f"no lint rule {which!r}",
            hint="rules: " + ", ".join(f"{r.code} {r.name}" for r in RULES.values()),
        )
    return f"{rule.code} {rule.name} (default severity: {rule.severity})\n{rule.short}.\n\n{rule.explain}\n"
