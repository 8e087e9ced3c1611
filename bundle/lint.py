"""`evidence lint BUNDLE`: verify a bundle, then report what in the run deserves a look.

Verification comes first (bundle/reader.py); a bundle that fails it exits 2 with the first reason
(every reason with --format json). Then every rule sees every event, findings are collected (the same
finding on many events is reported once, with a count), and only then reported: text, JSON or
SARIF 2.1.0 for GitHub code scanning. Exit 1 when a finding reaches --fail-on, else 0. It says
whether the bundle is signed and by which keyid; `--key KEY.pub` checks the signature (exit 2 unless
signed by that key), `--require-signature` refuses an unsigned bundle.

This module is the visitor: it applies the rules (bundle/lint_rules.py: their table, texts and the
patterns they judge by) to a bundle's events and returns the findings; the command, its options and
its output formats are bundle/commands/lint.py's.

(Over 600 lines on purpose: one visitor pass holds the per-run state every rule reads, such as
which programs the run wrote before it ran them; split, the rules would share that state through
an interface as wide as the state.)
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Iterable
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from evidence.bundle import command as claims
from evidence.bundle import format as fmt
from evidence.bundle import provenance, reader
from evidence.bundle.lint_output import SEVERITIES
from evidence.bundle.lint_rules import (
    FAIL_ON,
    FD_PATH,
    RULES,
    SECRETS,
    TEMP_DIRS,
    THROUGH_FD,
    WRITE_OK,
    Finding,
    Signature,
    changes_paths,
    maybe_secret,
    redact,
)
from evidence.bundle.normalize import Normalizer
from evidence.bundle.read_types import EventJSON, ManifestJSON
from evidence.errors import EXIT_FINDINGS, EXIT_OK

logger = logging.getLogger(__name__)

_TIED = frozenset((fmt.PROCESS_EXEC, fmt.PROCESS_EXIT, fmt.FILE_OPEN, fmt.FILE_CHANGE))
MAX_FINDINGS = 1000  # distinct findings kept; more are counted, not listed
MAX_PLAIN = 50_000  # strings remembered to hold no secret, each at most MAX_PLAIN_LEN long
MAX_PLAIN_LEN = 4096
CLOCK_TOLERANCE_NS = 1_000_000_000


class _Roots:
    """Whether a path is one of some roots or under one (an empty root stands for none)."""

    def __init__(self, roots: Iterable[str]) -> None:
        kept = tuple(r for r in roots if r)
        self.exact = frozenset(kept)
        self.prefixes = tuple(r + "/" for r in kept)

    def holds(self, path: str) -> bool:
        return path in self.exact or path.startswith(self.prefixes)


def _endpoint(address: str, port: Any) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{host}:{port}" if port is not None else address


class Linter:
    """Lints a verified bundle: `start` makes the fold of a piece of its events (what
    reader.Bundle.fold needs), `take` takes the folds in order, `findings()` when done.

    The per-event rules run in the folds (_Part), on whichever CPU verifies the piece; what depends
    on the events before a piece is settled in `take`: a finding seen before only gains a count, and
    the clock rule compares each event's time with the latest time before it in the whole run."""

    def __init__(self, manifest: ManifestJSON) -> None:
        self.manifest = manifest
        self.rules = _Rules(manifest)
        self.start: Callable[[int], _Part] = self.rules.part
        self._found: dict[tuple[str, str], Finding] = {}
        self.dropped = 0
        self.finished = False
        self.lost_events = 0
        self.max_time = ""
        self.backwards: list[tuple[int, int]] = []  # (how far back in ns, seq)
        # the run's subjects (`--subject`): what ties them to the run's writes (EV017)
        self.tracker = provenance.Tracker() if manifest.get("artifacts") else None

    def take(self, part: _Part) -> None:
        """Folds in the part that comes next."""
        found = self._found
        for k, f in part.found.items():
            mine = found.get(k)
            if mine is not None:
                mine.count += f.count
            elif len(found) >= MAX_FINDINGS:
                self.dropped += f.count
            else:
                found[k] = f
        low, last, ordered, times = part.clock()
        if ordered and low >= self.max_time:  # the common case: nothing in it goes back
            self.max_time = max(self.max_time, last)
        else:
            high = self.max_time
            for i, t in enumerate(times()):
                if t >= high:  # canonical times are fixed width: text order is time order
                    high = t
                else:
                    self._clock(part.seq + i, high, t)
            self.max_time = high
        self.finished = self.finished or part.finished
        self.lost_events += part.lost_events
        if self.tracker is not None:
            for etype, t, data in part.tied:
                self.tracker.feed(etype, t, data)
        if part.cut_short:
            self.manifest = {**self.manifest, "cut_short": True}

    def add(self, code: str, message: str, key: str, seq: int | None) -> None:
        """A finding about the whole run: never dropped by the cap on findings."""
        k = (code, key)
        if k in self._found:
            self._found[k].count += 1
        else:
            event_id = None if seq is None else fmt.event_id(self.manifest["run_id"], seq)
            self._found[k] = Finding(RULES[code], message, key, event_id, seq)

    def findings(self) -> list[Finding]:
        """Every finding, worst first; call once, when every part was taken."""
        m = self.manifest
        if m["lost"]["total"] > 0 or self.lost_events:
            total = max(m["lost"]["total"], self.lost_events)
            kinds = ", ".join(f"{k}: {v}" for k, v in m["lost"]["by_kind"].items() if v) or "see loss events"
            self.add(
                "EV001",
                f"{total} events were lost ({kinds}); absence of an operation proves nothing",
                "lost",
                None,
            )
        if not self.finished or m.get("cut_short"):
            why = (
                "the manifest says cut_short"
                if m.get("cut_short")
                else f"there is no {fmt.RUN_FINISHED} event"
            )
            self.add("EV007", f"the run was not recorded to its end: {why}", "not-finished", None)
        if self.backwards:
            n = len(self.backwards)
            delta, seq = max(self.backwards, key=lambda b: b[0])
            self.add(
                "EV008",
                f"event times go backwards {n} time(s), by up to {delta / 1e9:.3f} s (first at event {seq})",
                "clock",
                seq,
            )
        self._subjects()
        order = {s: i for i, s in enumerate(SEVERITIES)}
        return sorted(self._found.values(), key=lambda f: (order[f.rule.severity], f.rule.code, f.seq or 0))

    def _subjects(self) -> None:
        """EV017 for each subject the run did not write, EV018 for what was refused as one."""
        m = self.manifest
        artifacts = m.get("artifacts")
        if not artifacts or self.tracker is None:
            return
        for tie in self.tracker.ties(artifacts["files"], m["started_at"], m["finished_at"]):
            if not tie.written:
                self.add("EV017", f"subject {tie.name}: {tie.reason}", "subject:" + tie.name, None)
        refused = artifacts["refused"]
        if refused:
            n = len(refused) + artifacts.get("refused_more", 0)
            first = "; ".join(f"{r['name']}: {r['reason']}" for r in refused[:3])
            self.add("EV018", f"{n} --subject match(es) refused: {first}", "refused", None)

    def _clock(self, seq: int, high: str, t: str) -> None:
        try:
            delta = reader.time_ns(high) - reader.time_ns(t)
        except ValueError:
            return
        if delta > CLOCK_TOLERANCE_NS and len(self.backwards) < 10_000:
            self.backwards.append((delta, seq))


class _Rules:
    """What the per-event rules need to know of the run (it pickles: the reader may send it to its
    helper process)."""

    def __init__(self, manifest: ManifestJSON) -> None:
        policy = manifest.get("policy") or {}
        self.observe_only = manifest.get("policy") is None
        self.workspace = str(policy.get("workspace") or manifest["cwd"]).rstrip("/") or "/"
        self.tmpdir = str(policy.get("tmpdir") or "").rstrip("/")
        roots = {"${WORKSPACE}": self.workspace}
        if self.tmpdir:
            roots["${TMPDIR}"] = self.tmpdir
        self.norm = Normalizer(roots)
        self.ips: dict[str, bool] = {}  # address -> not loopback
        self.resolvers: list[str] | None = manifest.get("resolvers")  # EV016 (None: not recorded)
        self.ties = bool(manifest.get("artifacts"))  # EV017: the events a tie needs are kept
        # strings seen to hold nothing that looks like a secret (paths and subjects repeat: a
        # lookup costs less than maybe_secret), bounded: a hostile bundle may show any number
        self.plain: set[str] = set()
        self.write_ok = _Roots((self.workspace, self.tmpdir, *WRITE_OK))  # EV004 does not judge these
        self.temp = _Roots((*TEMP_DIRS, self.tmpdir))  # EV006
        self.in_workspace = _Roots((self.workspace,))
        # EV009: places the job can write
        self.writable = _Roots((*TEMP_DIRS, self.tmpdir, self.workspace if self.workspace != "/" else ""))

    def part(self, seq: int) -> _Part:
        return _Part(self, seq)


class _Part:
    """The per-event rules over consecutive events, from event `seq` on: what they found, and what
    Linter.take needs to settle the rest (each event's time, for the clock rule)."""

    def __init__(self, rules: _Rules, seq: int) -> None:
        self.rules = rules
        self.seq = seq
        self.found: dict[tuple[str, str], Finding] = {}  # in the order first seen
        self.times: list[str] = []  # each event's time (first_time if it has one), in order
        self.finished = False
        self.cut_short = False
        self.lost_events = 0
        self.plain = rules.plain
        # EV017: the execs, exits, write opens and changes, for Linter.take to tie the subjects in order
        self.tied: list[tuple[str, str, dict[str, Any]]] = []
        self._dispatch: dict[str, Callable[[EventJSON], None]] = {
            fmt.RUN_STARTED: self._started,
            fmt.RUN_FINISHED: self._finished,
            fmt.PROCESS_EXEC: self._exec,
            fmt.FILE_OPEN: self._open,
            fmt.FILE_CHANGE: self._change,
            fmt.NETWORK_CONNECT: self._connect,
            fmt.LOSS: self._loss,
            fmt.DEGRADATION: self._degradation,
            fmt.POLICY_DENIAL: self._denial,
            fmt.POLICY_APPROVAL: self._approval,
            fmt.POLICY_VIOLATION: self._violation,
            fmt.POLICY_AUDIT: self._audit,
            fmt.INVENTORY: self._inventory,
            fmt.PROCESS_NAMESPACE: self._namespace,
            fmt.NETWORK_DNS: self._dns,
        }

    def __getstate__(self) -> dict[str, Any]:  # what goes back from the helper: the results
        state = {k: v for k, v in self.__dict__.items() if k not in ("rules", "plain", "_dispatch", "times")}
        low, last, ordered, _ = self.clock()
        state["times"] = []
        state["_clock"] = (low, last, ordered, "\n".join(self.times))  # one string pickles fast
        return state

    def clock(self) -> tuple[str, str, bool, Callable[[], list[str]]]:
        """(earliest time, latest time, whether the times are in order, the times): what the clock
        rule needs. Only a part whose times are out of order, or that starts before the parts
        before it ended, needs its times one by one."""
        known = self.__dict__.get("_clock")
        if known is not None:
            low, last, ordered, joined = known
            return low, last, ordered, lambda: joined.split("\n") if joined else []
        times = self.times
        if not times:
            return "", "", True, lambda: times
        in_order = sorted(times)
        return in_order[0], in_order[-1], times == in_order, lambda: times

    def add(self, code: str, message: str, key: str, ev: EventJSON) -> None:
        k = (code, key)
        f = self.found.get(k)
        if f is not None:
            f.count += 1
        else:
            self.found[k] = Finding(RULES[code], message, key, ev["id"], ev["seq"])

    def feed(self, ev: EventJSON) -> None:
        data = ev["data"]
        self.times.append(data.get("first_time", ev["time"]) if type(data) is dict else ev["time"])
        subject = ev["subject"]
        if subject not in self.plain:
            self._text(subject, "subject", ev)
        etype = ev["type"]
        handler = self._dispatch.get(etype)
        if handler is not None:
            handler(ev)
        if (
            self.rules.ties
            and etype in _TIED
            and type(data) is dict
            and (etype != fmt.FILE_OPEN or "write" in data["access"] or "create" in data["access"])
        ):
            self.tied.append((etype, ev["time"], data))
        if type(data) is dict and data.get("mntns") == "other":
            self._other_ns(ev)

    # -- rules

    def _text(self, text: str, where: str, ev: EventJSON) -> None:
        """Looks for a secret in `text` (a subject, a path), unless it is known to hold none."""
        plain = self.plain
        if text in plain:
            return
        if maybe_secret(text):
            self._secrets(text, where, ev)
        elif len(plain) < MAX_PLAIN and len(text) <= MAX_PLAIN_LEN:
            plain.add(text)

    def _secrets(self, text: str, where: str, ev: EventJSON) -> None:
        for kind, rx in SECRETS:
            m = rx.search(text)
            if m:
                shown = redact(m.group())
                normal = self.rules.norm.text(text.replace(m.group(), "<secret>"))[:200]
                self.add(
                    "EV003",
                    f"{kind} in {where} of {ev['type'].removeprefix(fmt.TYPE_PREFIX)} ({shown})",
                    f"{kind}\0{where}\0{ev['type']}\0{normal}",
                    ev,
                )
                return

    def _argv(self, argv: list[str], where: str, ev: EventJSON) -> None:
        joined = " ".join(argv)
        if maybe_secret(joined):
            self._secrets(joined, where, ev)

    def _started(self, ev: EventJSON) -> None:
        self._argv(ev["data"]["command"], "the run's command", ev)

    def _finished(self, ev: EventJSON) -> None:
        self.finished = True
        if ev["data"].get("cut_short"):
            self.cut_short = True

    def _exec(self, ev: EventJSON) -> None:
        d = ev["data"]
        self._argv(d["argv"], "argv", ev)
        filename = d["filename"]
        if filename != ev["subject"]:
            self._text(filename, "path", ev)
        if d["result"] != 0:
            return
        if filename.startswith("/"):
            self._program(filename, "", d.get("sha256"), d.get("not_hashed"), ev)
        interp = d.get("interpreter")
        if interp:  # a #! script: the kernel ran its interpreter, which may come from anywhere
            self._text(interp, "path", ev)
            cwd = d.get("cwd")
            if not interp.startswith("/") and cwd and cwd.startswith("/"):
                interp = cwd.rstrip("/") + "/" + interp  # the kernel resolves it against the cwd
            if interp.startswith("/"):
                how = f" (the interpreter of {filename})"
                self._program(interp, how, d.get("interpreter_sha256"), d.get("interpreter_not_hashed"), ev)

    def _program(self, filename: str, how: str, digest: Any, not_hashed: Any, ev: EventJSON) -> None:
        """EV006 and EV009 for a program that ran (`filename`, absolute: the exec's file, or a #!
        script's interpreter, said in `how`)."""
        rules = self.rules
        if FD_PATH.match(filename):
            self.add(
                "EV006",
                f"executed {filename}{how}: a program from a file descriptor (a memfd?), with no file behind it",
                rules.norm.text(filename),
                ev,
            )
        elif fmt.has_dotdot(filename):  # where it leads is not known: a temp directory, maybe
            self.add(
                "EV006",
                f"executed {filename}{how}: a '..' after a component that may be a symlink, so from anywhere",
                rules.norm.text(filename),
                ev,
            )
        elif rules.temp.holds(filename) and not rules.in_workspace.holds(filename):
            self.add(
                "EV006", f"executed {filename}{how} from a temp directory", rules.norm.text(filename), ev
            )
        if rules.writable.holds(filename):
            what = f"sha256 {digest}" if digest else f"not hashed: {not_hashed or 'no hash recorded'}"
            self.add(
                "EV009",
                f"ran {filename}{how} from a writable place ({what})",
                f"{rules.norm.text(filename)}@{digest or ''}",
                ev,
            )

    def _open(self, ev: EventJSON) -> None:
        d = ev["data"]
        path = d["path"]
        plain = self.plain
        if path != ev["subject"] and path not in plain:
            self._text(path, "path", ev)
        raw = d["raw_path"]
        if raw != path and raw not in plain:
            self._text(raw, "path", ev)
        if d["result"] != 0 or not path.startswith("/"):
            return
        access = d["access"]
        rules = self.rules
        if "write" not in access and "create" not in access:
            return
        if not rules.write_ok.holds(path) or fmt.has_dotdot(path):
            exe = d.get("exe") or "?"
            self.add(
                "EV004",
                f"{exe} wrote {path} ({'+'.join(access)}) outside the workspace {rules.workspace}",
                rules.norm.text(path),
                ev,
            )
        elif d.get("nlink"):
            self._other_names(path, f"wrote {path} ({'+'.join(access)})", ev)

    def _other_names(self, path: str, what: str, ev: EventJSON) -> None:
        """EV004 for a write to a file that has other names (its link count, `nlink`): a hard link
        (made in an earlier run, say, in /tmp or the workspace) writes what the other names name,
        and they may be outside the workspace."""
        d = ev["data"]
        self.add(
            "EV004",
            f"{d.get('exe') or '?'} {what}, a file with {d['nlink']} names: the others may be outside "
            f"the workspace {self.rules.workspace}",
            self.rules.norm.text(path) + "\0nlink",
            ev,
        )

    def _change(self, ev: EventJSON) -> None:
        d = ev["data"]
        op = d["operation"]
        names = [d["path"]] + ([d["target"]] if d.get("target") is not None and op != "symlink" else [])
        for name in (*names, d.get("raw_path"), d.get("target")):
            if name and name != ev["subject"]:
                self._text(name, "path", ev)
        if d["result"] != 0:
            return
        rules = self.rules
        for path in names:
            if not path.startswith("/"):
                continue
            exe = d.get("exe") or "?"
            if THROUGH_FD.match(path):
                self.add(
                    "EV004",
                    f"{exe} changed {path} ({op}): through a descriptor the recorder could not name, "
                    f"so any file, maybe outside the workspace {rules.workspace}",
                    rules.norm.text(path),
                    ev,
                )
            elif not rules.write_ok.holds(path) or fmt.has_dotdot(path):
                self.add(
                    "EV004",
                    f"{exe} changed {path} ({op}) outside the workspace {rules.workspace}",
                    rules.norm.text(path),
                    ev,
                )
            elif d.get("nlink"):  # the file changed (truncate, chmod, chown) has other names
                self._other_names(path, f"changed {path} ({op})", ev)

    def _connect(self, ev: EventJSON) -> None:
        rules = self.rules
        if not rules.observe_only:
            return
        d = ev["data"]
        if d["family"] not in ("AF_INET", "AF_INET6"):
            return
        addr = d["address"]
        remote = rules.ips.get(addr)
        if remote is None:
            try:
                ip = ipaddress.ip_address(addr)
                if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
                    ip = ip.ipv4_mapped
                remote = not (ip.is_loopback or ip.is_unspecified)
            except ValueError:
                remote = True
            if len(rules.ips) < 100_000:
                rules.ips[addr] = remote
        if remote:
            dest = ev["subject"]
            result = "" if d["result"] == 0 else f", {d['result']}"
            self.add(
                "EV005",
                f"{d.get('exe') or '?'} connected to {dest}{result} with no policy in force",
                f"{d['family']}\0{dest}",
                ev,
            )

    def _loss(self, ev: EventJSON) -> None:
        self.lost_events += ev["data"]["count"]

    def _degradation(self, ev: EventJSON) -> None:
        d = ev["data"]
        if d["component"] == claims.COMPONENT:  # the recorder compared the claim with the kernel's
            self.add("EV014", f"the run's command is not as claimed: {d['reason']}", "command", ev)
            return
        self.add(
            "EV002",
            f"{d['component']} degraded: {d['reason']} (impact: {d['impact']})",
            f"{d['component']}\0{d['reason']}",
            ev,
        )

    def _denial(self, ev: EventJSON) -> None:
        d = ev["data"]
        target = d["target"]
        if d["operation"] == "syscall" and d["rule"] == fmt.COMPAT_RULE:
            exe = d.get("exe") or "?"
            self.add("EV013", f"{exe} (pid {d['pid']}) made a 32-bit system call: {target}, refused", exe, ev)
            return
        if d["operation"] == "exec":
            how = "refused" if d["enforced"] else "would be refused (dry run)"
            self.add("EV020", f"exec of {target} {how} by {d['rule']}", f"{d['rule']}\0{target}", ev)
        if target != ev["subject"]:
            self._text(target, "path", ev)

    def _approval(self, ev: EventJSON) -> None:
        d = ev["data"]
        self._argv(d["argv"], "argv", ev)
        if d.get("via") == "timeout":
            state = "allowed" if d["state"] == "allowed" else "denied"
            self.add(
                "EV019",
                f"exec of {d['program']} waited for approval by {d['rule']}: nobody answered, {state} by the timeout",
                f"{d['rule']}\0{d['program']}\0{state}",
                ev,
            )

    def _audit(self, ev: EventJSON) -> None:
        d = ev["data"]
        self._argv(d["argv"], "argv", ev)
        self.add(
            "EV022", f"exec of {d['program']} audited by {d['rule']}", f"{d['rule']}\0{d['program']}", ev
        )

    def _violation(self, ev: EventJSON) -> None:
        d = ev["data"]
        exe = d.get("exe") or "?"
        how = "killed" if d["killed"] else f"not killed ({d['result']})"
        what = ", ".join(d["reasons"])
        self.add("EV021", f"{exe} (pid {d['pid']}) was not the exec decided ({what}): {how}", exe, ev)

    def _namespace(self, ev: EventJSON) -> None:
        d = ev["data"]
        op = d["operation"]
        exe = d.get("exe") or "?"
        who = f"{exe} (pid {d['pid']})"
        if op in ("ptrace", "process_vm_writev"):
            if d.get("target_in_run") is not False:
                return
            what = f"{op} {' '.join(d['flags'])}".strip()
            if d["result"] == 0 and d.get("written") != 0:  # process_vm_writev of 0 bytes wrote nothing
                self.add(
                    "EV011",
                    f"{who} did {what} on pid {d['target_pid']}, a process outside the run",
                    f"{exe}\0{op}",
                    ev,
                )
            else:
                self.add(
                    "EV012",
                    f"{who} tried {what} on pid {d['target_pid']}, a process outside the run ({d['result']})",
                    f"{exe}\0{op}",
                    ev,
                )
            return
        if d["result"] != 0 or not changes_paths(op, d["flags"]):
            return
        flags = ",".join(d["flags"])
        paths = " ".join(d["paths"])
        what = " ".join(x for x in (op, flags, paths) if x)
        norm = self.rules.norm
        self.add(
            "EV010",
            f"{who} did {what}: its later paths (and its children's) may name other files",
            f"{norm.text(exe)}\0{op}\0{flags}\0{norm.text(paths)}",
            ev,
        )

    def _dns(self, ev: EventJSON) -> None:
        d = ev["data"]
        if d.get("malformed"):
            return
        asked = f"{d.get('name') or '?'} {d.get('type') or '?'}"
        why = d.get("unsolicited")
        if why:
            source = d.get("source")
            where = "an unknown source" if source is None else _endpoint(source, d.get("source_port"))
            got = " ".join(d.get("addresses") or []) or "no address"
            self.add(
                "EV015",
                f"a DNS answer for {asked} -> {got} from {where} was credited to no query ({why}): "
                "it names no connect",
                f"{why}\0{asked}",
                ev,
            )
            return
        resolvers = self.rules.resolvers
        if resolvers is None or d.get("configured_resolver"):
            return
        server = d.get("source") or d["server"]
        self.add(
            "EV016",
            f"DNS {asked} went to {_endpoint(server, d.get('source_port') or d.get('port'))}, not one of "
            f"the run's resolvers ({', '.join(resolvers) or 'none'}): its answers name connects only as other_names",
            server,
            ev,
        )

    def _other_ns(self, ev: EventJSON) -> None:
        d = ev["data"]
        kind = ev["type"].removeprefix(fmt.TYPE_PREFIX)
        exe = d.get("exe") or d.get("filename") or "?"
        self.add(
            "EV010",
            f"{exe} (pid {d['pid']}) and others: {kind} events in another mount namespace "
            f"(first: {ev['subject']}); their paths may not name the files they name in the run's",
            f"mntns\0{kind}",
            ev,
        )

    def _inventory(self, ev: EventJSON) -> None:
        self._argv(ev["data"]["argv"], "argv", ev)


def lint(path: str) -> tuple[ManifestJSON, list[Finding], int]:
    """Verify and lint a bundle: (manifest, findings, findings dropped over MAX_FINDINGS).
    Raises reader.VerificationError (exit 2) if the bundle fails verification."""
    manifest, findings, dropped, _ = lint_signed(path)
    return manifest, findings, dropped


def lint_signed(
    path: str,
    key: Ed25519PublicKey | None = None,
    *,
    require_signature: bool = False,
    parallel: bool = True,
) -> tuple[ManifestJSON, list[Finding], int, Signature]:
    """Verify and lint a bundle: (manifest, findings, findings dropped over MAX_FINDINGS, signature).
    Raises reader.VerificationError (exit 2) if the bundle fails verification, and, with a `key`,
    if it is not signed by that key; with `require_signature`, if it is not signed.
    `parallel=False`: all of it in the caller's thread (no helper process, no inflating thread),
    the least CPU, for a caller that keeps the CPUs busy itself (the agent's fleet publisher)."""
    bundle = reader.open_bundle(path, parallel=parallel, ahead=parallel)
    linter = Linter(bundle.manifest)
    take = linter.take
    for part in bundle.fold(linter.start):
        take(part)
    att = bundle.attestation
    keyids = tuple(att.keyids) if att is not None else ()
    if att is None and require_signature:
        raise reader.VerificationError(path, [f"not signed (the bundle has no {fmt.ATTESTATION_NAME})"])
    checked = bundle.check_signature(key) if key is not None else None
    return bundle.manifest, linter.findings(), linter.dropped, Signature(keyids, checked)


def exit_code(findings: list[Finding], fail_on: str) -> int:
    reach = FAIL_ON[fail_on]
    if reach < 0:
        return EXIT_OK
    worst = min((SEVERITIES.index(f.rule.severity) for f in findings), default=99)
    return EXIT_FINDINGS if worst <= reach else EXIT_OK
