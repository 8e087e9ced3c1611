"""What a run is, as its recorder knows it: one typed, frozen record.

`RunDescription` holds everything a bundle's manifest says about a run that the recorder knew
before the run ended (command, cwd, labels, detail, policy, network, roots, capabilities, the run's
degradations, its pid and cgroup), and, once it is known, how the command ended. It is written
whole, beside the run's spool, as `<session>.run.json` (agent/recorder/recovery.py), rewritten
atomically whenever it changes, and read back whole by recovery: a bundle that `evidence recover`
writes after the recorder died says what was in force and what was degraded, as the run's own
bundle would have. A field added here is carried by construction, not by a second list.

Pure: pydantic, the standard library and bundle/format.py.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from evidence.bundle.format import Degradation

RECORD_VERSION = 2  # 1: the hand-picked subset written before this module (read all the same)

Detail = Literal["summary", "full"]
Network = Literal["none", "loopback"] | None  # the command's private network (`--net`); None: the host's
# what the recorder could use and what the run's command ran under (agent/recorder/kernel.py
# capabilities_in_force, isolation, 32-bit calls): the manifest's `capabilities`
Capabilities = dict[str, str | int | bool]
HeaderFacts = dict[str, str | bool | None]  # the kernel headers BCC compiled against (probes/headers.py)
# the manifest's `policy`: the summary of the run's policy (agent/recorder/enforce.py manifest_policy),
# JSON values all the way down
ManifestPolicy = dict[str, object]


class RunDescription(BaseModel):
    # unknown fields are ignored: a record written by a newer evidence is still recovered
    model_config = ConfigDict(frozen=True, extra="ignore")

    version: int = RECORD_VERSION
    session_id: str
    cgroup: str = ""
    # as the caller gave it; with `claimed`, a claim judged against the kernel's (bundle/command.py)
    command: list[str] = Field(default_factory=list)
    claimed: bool = False
    cwd: str = ""
    pid: int = 0
    started_ns: int = 0
    attached_late: bool = True  # (unknown: a run that attached late says less)
    detail: Detail = "summary"
    labels: dict[str, str] = Field(default_factory=dict)
    policy: ManifestPolicy | None = None
    network: Network = None
    resolvers: list[str] | None = None  # its /etc/resolv.conf's nameservers; None: not known
    roots: dict[str, str] = Field(default_factory=dict)  # placeholder -> path: the run id's
    capabilities: Capabilities = Field(default_factory=dict)
    headers: HeaderFacts = Field(default_factory=dict)
    degradations: list[Degradation] = Field(default_factory=list)  # the run's own, so far
    # where its bundle goes: the agent's name for it, or `evidence run --bundle`'s path and key
    bundle_name: str | None = None
    bundle_path: str | None = None
    sign_key: str | None = None
    # how the command ended, once seen (finished_ns set: only the bundle's writing failed)
    exit_code: int | None = None
    signal: str | None = None
    finished_ns: int | None = None

    @property
    def ended(self) -> bool:
        return self.finished_ns is not None

    def to_json(self) -> bytes:
        """JSON with every non-ASCII character escaped: a name that is not UTF-8 (a cwd, a
        workspace) holds lone surrogates, which round-trip as \\udcXX escapes (pydantic's own
        JSON refuses them)."""
        return json.dumps(self.model_dump(), sort_keys=True).encode()

    def degradation_dicts(self) -> list[dict[str, str]]:
        """The run's degradations as the bundle writer takes them (writer.RunMeta)."""
        return [d.model_dump() for d in self.degradations]

    @classmethod
    def from_json(cls, raw: bytes | str, session_id: str) -> RunDescription:
        """The record, or DescriptionError naming what is wrong with it."""
        try:
            return cls.model_validate(json.loads(raw))
        except ValueError as e:  # not JSON (json.JSONDecodeError), or not a run record
            if not isinstance(e, ValidationError):
                raise DescriptionError(f"run record of {session_id}: not JSON: {e}") from None
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "the record"
            raise DescriptionError(f"run record of {session_id}: {where}: {first['msg']}") from None


class DescriptionError(ValueError):
    pass
