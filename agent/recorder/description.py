"""What a run is, as its recorder knows it: one typed, frozen record.

`RunDescription` holds everything a bundle's manifest says about a run that the recorder knew
before the run ended (command, cwd, labels, detail, policy, network, roots, capabilities, the run's
degradations, its pid and cgroup), and, once it is known, how the command ended. It is written
whole, beside the run's spool, as `<session>.run.json` (agent/recorder/recovery.py), rewritten
atomically whenever it changes, and read back whole by recovery: a bundle that `evidence recover`
writes after the recorder died says what was in force and what was degraded, as the run's own
bundle would have. A field added here is carried by construction, not by a second list.

Pure: pydantic and the standard library.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

RECORD_VERSION = 2  # 1: the hand-picked subset written before this module (read all the same)


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
    detail: Literal["summary", "full"] = "summary"
    labels: dict[str, str] = Field(default_factory=dict)
    policy: dict[str, Any] | None = None
    network: Literal["none", "loopback"] | None = None
    resolvers: list[str] | None = None  # its /etc/resolv.conf's nameservers; None: not known
    roots: dict[str, str] = Field(default_factory=dict)  # placeholder -> path: the run id's
    capabilities: dict[str, Any] = Field(default_factory=dict)
    headers: dict[str, Any] = Field(default_factory=dict)
    degradations: list[dict[str, str]] = Field(default_factory=list)  # the run's own, so far
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
