"""The control API's request bodies as frozen pydantic models, and the names its paths carry.

`parse` validates a JSON body against one model and turns any failure into the one-line UsageError
(HTTP 400) the API has always answered with: unknown fields first, then the first field that fails,
in the order the fields are declared (the order the checks always ran in). Each check raises its own
message, so a client sees `label name 'bad key' is not valid ...`, never pydantic's wording.

What is checked here is the shape of a request; whether the peer may have it done (its process,
its cgroup, an absolute bundle path) is agent/daemon/authz.py's business.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, NotRequired, TypedDict, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from evidence.errors import UsageError

MAX_LABELS = 64
MAX_LABEL_VALUE = 1024
MAX_COMMAND_BYTES = 128 * 1024
LABEL_KEY = re.compile(
    r"[A-Za-z0-9]([A-Za-z0-9._/-]{0,126}[A-Za-z0-9])?"
)  # every name: fullmatch (`$` takes a trailing newline)
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
SIGNAL_NAME = re.compile(r"SIG[A-Z0-9+-]{2,12}")
BUNDLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,200}\.tar\.gz")  # k8s: <ns>_<pod>_<uid>-<n>

_INVALID = "invalid"  # the pydantic error type of every check below: its message is the client's


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError(_INVALID, message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --- field checks (before pydantic's own: they see the raw JSON value) -------------------------------


def _labels(raw: Any) -> dict[str, str]:
    """Labels sorted by name; null is none."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _invalid('"labels" must be an object of string: string')
    if len(raw) > MAX_LABELS:
        raise _invalid(f"at most {MAX_LABELS} labels")
    for k, v in raw.items():
        if not isinstance(k, str) or not LABEL_KEY.fullmatch(k):
            raise _invalid(f"label name {k!r} is not valid (letters, digits, '._/-', at most 128)")
        if not isinstance(v, str) or len(v) > MAX_LABEL_VALUE or any(ord(c) < 32 for c in v):
            raise _invalid(
                f"label {k!r}: the value must be a string of printable characters, at most {MAX_LABEL_VALUE}"
            )
    return dict(sorted(raw.items()))


def _command(raw: Any) -> list[str]:
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(a, str) and "\x00" not in a for a in raw):
        raise _invalid('"command" must be a list of strings')
    if sum(len(a.encode("utf-8", "surrogatepass")) + 1 for a in raw) > MAX_COMMAND_BYTES:
        raise _invalid(f'"command" is over {MAX_COMMAND_BYTES} bytes')
    return raw


def _subjects(raw: Any) -> list[str]:
    """`evidence run --agent --subject`: globs relative to the run's cwd (bundle/subjects.py)."""
    from evidence.bundle.subjects import MAX_PATTERNS, SubjectError, check_pattern

    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_PATTERNS or not all(isinstance(p, str) for p in raw):
        raise _invalid(f'"subjects" must be a list of at most {MAX_PATTERNS} strings')
    try:
        return [check_pattern(p) for p in raw]
    except SubjectError as e:
        raise _invalid(str(e)) from None


def _detail(raw: Any) -> Any:
    if raw not in ("summary", "full"):
        raise _invalid('"detail" must be "summary" or "full"')
    return raw


def _isolate_pid(raw: Any) -> int:
    if not _is_int(raw) or raw <= 0:
        raise _invalid('"isolate_pid" must be a positive integer')
    return int(raw)


def _pid_type(raw: Any) -> Any:
    # only the type here: whether it is positive is checked after "exactly one of cgroup and pid"
    if raw is not None and not _is_int(raw):
        raise _invalid('"pid" must be a positive integer')
    return raw


def _bundle(raw: Any) -> Any:
    if raw is not None and (not isinstance(raw, str) or not raw):
        raise _invalid('"bundle" must be a file name')
    return raw


def _exit_code(raw: Any) -> Any:
    if raw is not None and (not _is_int(raw) or not 0 <= raw <= 255):
        raise _invalid('"exit_code" must be an integer from 0 to 255')
    return raw


def _signal(raw: Any) -> Any:
    if raw is not None and (not isinstance(raw, str) or not SIGNAL_NAME.fullmatch(raw)):
        raise _invalid('"signal" must be a signal name such as SIGTERM')
    return raw


Labels = Annotated[dict[str, str], BeforeValidator(_labels)]


# --- bodies ------------------------------------------------------------------------------------------


class Request(BaseModel):
    """A request body: a JSON object with no fields but the declared ones, immutable once parsed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    unknown_note: ClassVar[str] = ""  # added to "unknown field(s) ..."


class StartRequest(Request):
    """POST /runs: record an existing cgroup, named by its path or by a process in it."""

    labels: Labels = Field(default_factory=dict)
    pid: Annotated[int | None, BeforeValidator(_pid_type)] = None
    cgroup: str | None = Field(default=None, validate_default=True)

    @field_validator("cgroup", mode="before")
    @classmethod
    def _one_of_cgroup_and_pid(cls, raw: Any, info: ValidationInfo) -> Any:
        if "pid" not in info.data:  # the pid is wrong already, and that is what is reported
            return raw
        pid = info.data["pid"]
        if (raw is None) == (pid is None):
            raise _invalid('give exactly one of "cgroup" and "pid"')
        if pid is not None and pid <= 0:
            raise _invalid('"pid" must be a positive integer')
        if raw is not None and (not isinstance(raw, str) or not raw or "\x00" in raw):
            raise _invalid('"cgroup" must be a non-empty path')
        return raw


MAX_POLICY_BYTES = 256 * 1024


def _policy_text(raw: Any) -> Any:
    if not isinstance(raw, str) or len(raw.encode("utf-8", "surrogatepass")) > MAX_POLICY_BYTES:
        raise _invalid(f'"policy.text" must be the policy file\'s text, at most {MAX_POLICY_BYTES} bytes')
    return raw


def _policy_variables(raw: Any) -> Any:
    names = ("HOME", "TMPDIR", "WORKSPACE")
    if (
        not isinstance(raw, dict)
        or sorted(raw) != sorted(names)
        or not all(isinstance(v, str) and v.startswith("/") and "\x00" not in v for v in raw.values())
    ):
        raise _invalid('"policy.variables" must give HOME, TMPDIR and WORKSPACE as absolute paths')
    return raw


class PolicySpec(Request):
    """The policy of an isolated run (`evidence run --agent --policy`): the client enforced its file
    rules (Landlock) and environment itself; the agent guards connects and matches denials."""

    text: Annotated[str, BeforeValidator(_policy_text)]
    name: str = Field(default="policy", max_length=4096)
    variables: Annotated[dict[str, str], BeforeValidator(_policy_variables)]
    mode: Literal["enforce", "dry-run"] = "enforce"
    fail_closed: bool = False
    env_removed: tuple[str, ...] = ()
    # the policy's command rules: the descriptor number, in the process to isolate, of the exec
    # filter's listener (the agent takes it with pidfd_getfd and checks the filter is installed)
    exec_listener_fd: int | None = Field(default=None, ge=3, le=1 << 20)
    quiet_denials: bool = False  # tell the job nothing of the policy's refusals (--quiet-denials)


class IsolateRequest(Request):
    """POST /runs with isolate_pid: a run in a cgroup of its own for a process the peer forked
    (`evidence run --agent`); `command` is the argv it will exec, for the manifest."""

    unknown_note: ClassVar[str] = " (with isolate_pid)"

    labels: Labels = Field(default_factory=dict)
    command: Annotated[tuple[str, ...], BeforeValidator(_command)] = ()
    detail: Annotated[Literal["summary", "full"], BeforeValidator(_detail)] = "summary"
    isolate_pid: Annotated[int, BeforeValidator(_isolate_pid)]
    policy: PolicySpec | None = None
    net: Literal["none", "loopback"] | None = None  # the private network the process made itself
    # files the command produces, hashed once it exited, as the peer (never as root)
    subjects: Annotated[tuple[str, ...], BeforeValidator(_subjects)] = ()


class FinishRequest(Request):
    """POST /runs/<session>/finish: the bundle's name (or, for root, path) and, for an isolated
    run, how its command ended. The exit status is checked (`exit_status`) only once the run is
    known to be isolated: before that, its being there at all is the error."""

    bundle: Annotated[str | None, BeforeValidator(_bundle)] = None
    exit_code: Any = None
    signal: Any = None

    @property
    def reports_exit(self) -> bool:
        return self.exit_code is not None or self.signal is not None

    def exit_status(self) -> ExitStatus:
        """The exit code and signal, checked; UsageError when one is not valid."""
        return parse(ExitStatus, {"exit_code": self.exit_code, "signal": self.signal})


class ExitStatus(Request):
    """How an isolated run's command ended, as its client reports it (both None: not reported)."""

    exit_code: Annotated[int | None, BeforeValidator(_exit_code)] = None
    signal: Annotated[str | None, BeforeValidator(_signal)] = None


RequestT = TypeVar("RequestT", bound=Request)


def _message(e: ValidationError, unknown_note: str) -> str:
    errors = e.errors(include_url=False)
    unknown = sorted(str(err["loc"][0]) for err in errors if err["type"] == "extra_forbidden")
    if unknown:
        return f"unknown field(s) {', '.join(unknown)}{unknown_note}"
    first = errors[0]
    if first["type"] == _INVALID:
        return str(first["msg"])
    return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"  # not a check of ours: missing


def parse(model: type[RequestT], body: Mapping[str, Any]) -> RequestT:
    """The body as `model`, or UsageError with the one line that says what is wrong."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise UsageError(_message(e, model.unknown_note)) from None


def parse_run_request(body: Mapping[str, Any]) -> StartRequest | IsolateRequest:
    """POST /runs: an isolated run when the body names isolate_pid, else a run on a cgroup."""
    if "isolate_pid" in body:
        return parse(IsolateRequest, body)
    return parse(StartRequest, body)


# --- names in paths ----------------------------------------------------------------------------------


def _session_id(raw: str) -> str:
    if not SESSION_ID.fullmatch(raw):
        raise _invalid(f"{raw!r} is not a session id")
    return raw


def _bundle_name(raw: str) -> str:
    if not BUNDLE_NAME.fullmatch(raw):
        raise _invalid(f"{raw!r} is not a bundle name")
    return raw


_SESSION_ID = TypeAdapter(Annotated[str, BeforeValidator(_session_id)])
_BUNDLE_NAME = TypeAdapter(Annotated[str, BeforeValidator(_bundle_name)])


def session_id(text: str) -> str:
    """A run's session id from a path (/runs/<session>), or UsageError."""
    try:
        return _SESSION_ID.validate_python(text)
    except ValidationError as e:
        raise UsageError(_message(e, "")) from None


def bundle_name(text: str) -> str:
    """A bundle's file name from a path (/bundles/<name>), or UsageError."""
    try:
        return _BUNDLE_NAME.validate_python(text)
    except ValidationError as e:
        raise UsageError(_message(e, "")) from None


# ---- what the API answers (agent/daemon/api.py), and what its client (agent/commands/client.py) reads


class PolicyBody(TypedDict):
    """A policy as `run --agent` sends it (PolicySpec checks it)."""

    text: str
    name: str
    variables: dict[str, str]
    mode: Literal["enforce", "dry-run"]
    fail_closed: bool
    env_removed: list[str]
    exec_listener_fd: NotRequired[int]
    quiet_denials: NotRequired[bool]


class RunAnswer(TypedDict):
    """POST /runs (201) and each of GET /runs' "runs": a run the agent records."""

    session_id: str
    cgroup: str
    labels: dict[str, str]
    started_ns: int
    attached_late: bool
    pid: int | None
    isolated: bool
    owner_uid: NotRequired[int]


class FinishAnswer(TypedDict):
    """POST /runs/{id}/finish (200): the bundle written."""

    session_id: str
    run_id: str | None
    path: str
    name: str | None  # in the agent's bundle directory: GET /bundles/{name} downloads it
    sha256: str
    size: int
    events: int | None
    lost: int
    cut_short: bool
    root_hash: str | None
    counts: dict[str, int]


class ReadyAnswer(TypedDict):
    """GET /readyz (200)."""

    status: str
