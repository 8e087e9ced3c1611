"""The policy model: a YAML file validated into frozen pydantic models, and its pure evaluation.

(Somewhat over 600 lines on purpose: the models, the loader that maps their errors to the file's
lines, and the matching they define are one contract, read and changed together.)

docs/policy-format.md is the prose version of this module. Loading does three things the models
alone cannot: it reports errors with the file's line numbers, it expands `${WORKSPACE}`, `${HOME}` and
`${TMPDIR}` and canonicalises paths (symlinks resolved), and it resolves host names in network rules
once, at start (the addresses are kept in the model and recorded in the bundle through `summary()`).

Matching semantics (the same for files and for the network): the most specific matching entry
decides; on a tie, deny wins. For files, specificity is the number of path components of the entry
(`/home/u/.ssh` beats `/home/u`; `${WORKSPACE}` = `/root/ws` beats a deny of `/root`). For the
network it is the prefix length, then a port, then a protocol.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import re
import socket
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
)

from evidence.bundle.format import has_dotdot
from evidence.errors import PolicyError
from evidence.policy.governance import ApprovalsPolicy, CommandsPolicy, LimitsPolicy, commands_summary
from evidence.policy.paths import (
    canonical_glob,
    canonical_path,
    components,
    expand_variables,
    glob_regex,
    is_glob,
    under,
)

logger = logging.getLogger(__name__)

_FROZEN = ConfigDict(extra="forbid", frozen=True)
ACCESSES = ("read", "write", "create", "exec")

Resolver = Callable[[str], Sequence[str]]


class Decision(BaseModel):
    """Why an access is refused: the rule that denies it, e.g. `fs.deny[0]: /etc/shadow`."""

    model_config = _FROZEN
    rule: str


class PathRule(BaseModel):
    """One entry of an fs list: the text as written and the canonical path (or glob) it stands for."""

    model_config = _FROZEN
    text: str
    path: str
    glob: bool = False
    alias: str | None = None  # the expanded path before symlinks were resolved, when it differs

    @cached_property
    def _regex(self) -> re.Pattern[str]:
        return glob_regex(self.path)

    def matches(self, path: str) -> bool:
        if self.glob:
            return bool(self._regex.match(path))
        return under(path, self.path) or (self.alias is not None and under(path, self.alias))

    @property
    def specificity(self) -> int:
        return components(self.path)


def _path_rule(value: Any, info: ValidationInfo) -> Any:
    if isinstance(value, PathRule):
        return value
    if not isinstance(value, str):
        raise ValueError("must be a path (a string)")
    if not value.strip():
        raise ValueError("empty path")
    variables = (info.context or {}).get("variables", {})
    expanded = expand_variables(value, variables)
    if not expanded.startswith("/"):
        raise ValueError(
            f"{value!r}: paths must be absolute (or start with ${{WORKSPACE}}, ${{HOME}}, ${{TMPDIR}})"
        )
    glob = is_glob(expanded)
    path = canonical_glob(expanded) if glob else canonical_path(expanded)
    plain = os.path.normpath(expanded)
    return {"text": value, "path": path, "glob": glob, "alias": None if glob or plain == path else plain}


PathItem = Annotated[PathRule, BeforeValidator(_path_rule)]


class FsPolicy(BaseModel):
    """Allow lists per access (path prefixes or globs) and a deny list. `write` and `exec` imply read."""

    model_config = _FROZEN
    read: tuple[PathItem, ...] = ()
    write: tuple[PathItem, ...] = ()
    exec: tuple[PathItem, ...] = ()
    deny: tuple[PathItem, ...] = ()

    def allow_lists(self, access: str) -> list[tuple[str, tuple[PathRule, ...]]]:
        """The allow lists that grant an access (read is granted by read, write and exec)."""
        if access == "read":
            return [("read", self.read), ("write", self.write), ("exec", self.exec)]
        if access in ("write", "create"):
            return [("write", self.write)]
        if access == "exec":
            return [("exec", self.exec)]
        raise ValueError(f"unknown access {access!r} (one of {', '.join(ACCESSES)})")

    def check(self, path: str, access: str) -> Decision | None:
        lists = self.allow_lists(access)
        if has_dotdot(path):  # a '..' after what may be a symlink: it may lead anywhere
            return Decision(
                rule=f"fs.{lists[0][0]}: '..' after a component: where the name leads is not known"
            )
        path = os.path.normpath(path) if path.startswith("/") else path
        best: tuple[int, int, str] | None = None  # (specificity, deny=1, rule label)
        for i, rule in enumerate(self.deny):
            if rule.matches(path):
                cand = (rule.specificity, 1, f"fs.deny[{i}]: {rule.text}")
                if best is None or cand[:2] > best[:2]:
                    best = cand
        for name, rules in lists:
            for i, rule in enumerate(rules):
                if rule.matches(path):
                    cand = (rule.specificity, 0, f"fs.{name}[{i}]: {rule.text}")
                    if best is None or cand[:2] > best[:2]:
                        best = cand
        if best is None:
            return Decision(rule=f"fs.{lists[0][0]}: not allowed")
        return Decision(rule=best[2]) if best[1] else None


# ---------------------------------------------------------------------------------------------------
# Network

PROTOCOLS = {"tcp": 6, "udp": 17}
_PROTO_RE = re.compile(r"^(tcp|udp)://(.*)$|^(.*?)/(tcp|udp)$", re.IGNORECASE)
_HOST_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62}))*\.?$"
)


def is_host_name(text: str) -> bool:
    """Whether `text` is a host name a net rule accepts (letters, digits, '-', '_', dots)."""
    return bool(_HOST_RE.match(text)) and not text.replace(".", "").isdigit()


def _network(text: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    net = ipaddress.ip_network(text, strict=False)
    if isinstance(net, ipaddress.IPv6Network) and net.prefixlen >= 96:
        mapped = net.network_address.ipv4_mapped
        if mapped is not None:  # ::ffff:a.b.c.d/n is the IPv4 network a.b.c.d/(n-96)
            return ipaddress.IPv4Network(f"{mapped}/{net.prefixlen - 96}", strict=False)
    return net


def _parse_port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{text!r} is not a port (1-65535)")
    return int(text)


class NetRule(BaseModel):
    """One entry of net.allow / net.deny: a CIDR or a host name, an optional port and protocol.

    `networks` holds the canonical CIDRs the rule stands for: one for a CIDR rule, the addresses a
    host name resolved to at start (as /32 or /128) for a host rule."""

    model_config = _FROZEN
    text: str
    host: str | None = None
    networks: tuple[str, ...]
    port: int | None = None
    protocol: Literal["tcp", "udp"] | None = None

    @cached_property
    def parsed(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        return tuple(ipaddress.ip_network(n) for n in self.networks)


def parse_net_rule(text: str, resolve: Resolver | None = None) -> dict[str, Any]:
    """`CIDR`, `ADDR[/LEN]:PORT`, `[V6[/LEN]]:PORT`, `HOST[:PORT]`; a protocol as `tcp://...` or
    `.../udp`. A bare IPv6 (no brackets) has no port."""
    body = text.strip()
    protocol = None
    m = _PROTO_RE.match(body)
    if m:
        if m.group(1):
            protocol, body = m.group(1).lower(), m.group(2)
        else:
            body, protocol = m.group(3), m.group(4).lower()
    port = None
    if body.startswith("["):
        end = body.find("]")
        if end < 0:
            raise ValueError(f"{text!r}: missing ']'")
        addr, rest = body[1:end], body[end + 1 :]
        if rest.startswith("/") and ":" in rest:  # [::1]/128:80
            plen, _, p = rest[1:].partition(":")
            addr, rest = f"{addr}/{plen}", ":" + p
        elif rest.startswith("/"):
            addr, rest = f"{addr}{rest}", ""
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"{text!r}: expected ':PORT' after ']'")
            port = _parse_port(rest[1:])
    elif body.count(":") == 1:
        addr, p = body.split(":")
        port = _parse_port(p)
    else:
        addr = body
    if not addr:
        raise ValueError(f"{text!r}: no address")
    try:
        return {"text": text, "networks": (str(_network(addr)),), "port": port, "protocol": protocol}
    except ValueError:
        pass
    if "/" in addr or not _HOST_RE.match(addr) or addr.replace(".", "").isdigit():
        raise ValueError(f"{text!r}: not a CIDR, an address or a host name")
    if resolve is None:
        raise ValueError(f"{text!r}: host names need a resolver")
    try:
        addresses = resolve(addr)
    except OSError as e:
        raise ValueError(f"{text!r}: cannot resolve host {addr!r}: {e}") from None
    if not addresses:
        raise ValueError(f"{text!r}: host {addr!r} resolved to no address")
    nets = sorted({str(_network(a)) for a in addresses}, key=lambda n: (":" in n, n))
    return {
        "text": text,
        "host": addr.rstrip(".").lower(),
        "networks": tuple(nets),
        "port": port,
        "protocol": protocol,
    }


def system_resolver(host: str) -> list[str]:
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]).split("%")[0] for info in infos})


def _net_rule(value: Any, info: ValidationInfo) -> Any:
    if isinstance(value, NetRule):
        return value
    if not isinstance(value, str):
        raise ValueError(
            "must be a string such as '10.0.0.0/8', '127.0.0.1:8080', '[::1]:443' or 'example.com:443'"
        )
    return parse_net_rule(value, (info.context or {}).get("resolve"))


NetItem = Annotated[NetRule, BeforeValidator(_net_rule)]


class NetPolicy(BaseModel):
    model_config = _FROZEN
    default: Literal["allow", "deny"]
    allow: tuple[NetItem, ...] = ()
    deny: tuple[NetItem, ...] = ()

    def labels(self) -> list[str]:
        """Rule labels in a fixed order: allow rules first, then deny rules (their index is the rule id)."""
        return [f"net.allow[{i}]: {r.text}" for i, r in enumerate(self.allow)] + [
            f"net.deny[{i}]: {r.text}" for i, r in enumerate(self.deny)
        ]

    def entries(
        self,
    ) -> list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, int | None, int | None, bool, int]]:
        """Flattened rules: (network, port, protocol number, is_deny, rule id into labels())."""
        out = []
        for rid, (rule, deny) in enumerate([(r, False) for r in self.allow] + [(r, True) for r in self.deny]):
            proto = PROTOCOLS[rule.protocol] if rule.protocol else None
            for net in rule.parsed:
                out.append((net, rule.port, proto, deny, rid))
        return out

    def check(self, family: str, address: str, port: int | None, protocol: str = "tcp") -> Decision | None:
        addr = ipaddress.ip_address(address.strip("[]").split("%")[0])
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        proto = PROTOCOLS.get(protocol.lower()) if protocol else None
        labels = self.labels()
        best: tuple[tuple[int, int, int, int], int] | None = None
        for net, rport, rproto, deny, rid in self.entries():
            if net.version != addr.version or addr not in net:
                continue
            if rport is not None and rport != port:
                continue
            if rproto is not None and rproto != proto:
                continue
            key = (net.prefixlen, rport is not None, rproto is not None, int(deny))
            if best is None or key > best[0]:
                best = ((key[0], int(key[1]), int(key[2]), key[3]), rid)
        if best is None:
            return Decision(rule="net.default: deny") if self.default == "deny" else None
        return Decision(rule=labels[best[1]]) if best[0][3] else None


# ---------------------------------------------------------------------------------------------------
# Environment


class EnvPolicy(BaseModel):
    """Secret-looking variables are removed unless `strip_secrets: false`; execution-influence
    variables (LD_*, PYTHON*, ...) too with `strip_exec_influence: true`. `allow` keeps names (or
    globs) whatever they look like; `strip` removes more."""

    model_config = _FROZEN
    strip_secrets: bool = True
    strip_exec_influence: bool = False
    allow: tuple[str, ...] = ()
    strip: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------------
# The policy


class Policy(BaseModel):
    model_config = _FROZEN
    version: Literal[1]
    fs: FsPolicy | None = None
    net: NetPolicy | None = None
    env: EnvPolicy = Field(default_factory=EnvPolicy)
    commands: CommandsPolicy | None = None
    approvals: ApprovalsPolicy = Field(default_factory=ApprovalsPolicy)
    limits: LimitsPolicy | None = None
    # Filled by load_policy, not by the file:
    source: str = ""
    sha256: str = ""
    variables: dict[str, str] = Field(default_factory=dict)

    def check_file(self, path: str, access: str) -> Decision | None:
        """The rule that refuses `access` (read, write, create, exec) to `path`, or None if allowed."""
        if access not in ACCESSES:
            raise ValueError(f"unknown access {access!r} (one of {', '.join(ACCESSES)})")
        if self.fs is None:
            return None
        return self.fs.check(path, access)

    def check_connect(
        self, family: str, address: str, port: int | None, protocol: str = "tcp"
    ) -> Decision | None:
        """The rule that refuses a connect/sendmsg, or None. IPv4-mapped IPv6 is checked as IPv4."""
        if self.net is None:
            return None
        return self.net.check(family, address, port, protocol)

    def summary(self) -> dict[str, Any]:
        """JSON-able (no floats) description for the bundle manifest, with resolved host addresses."""
        out: dict[str, Any] = {
            "version": self.version,
            "source": self.source,
            "sha256": self.sha256,
            "variables": dict(sorted(self.variables.items())),
        }
        if self.fs is not None:
            out["fs"] = {
                name: [{"rule": r.text, "path": r.path} for r in getattr(self.fs, name)]
                for name in ("read", "write", "exec", "deny")
            }
        if self.net is not None:
            net: dict[str, Any] = {"default": self.net.default}
            for name in ("allow", "deny"):
                items = []
                for r in getattr(self.net, name):
                    item: dict[str, Any] = {"rule": r.text, "networks": list(r.networks)}
                    if r.host is not None:
                        item["host"] = r.host
                    if r.port is not None:
                        item["port"] = r.port
                    if r.protocol is not None:
                        item["protocol"] = r.protocol
                    items.append(item)
                net[name] = items
            out["net"] = net
        out["env"] = {
            "strip_secrets": self.env.strip_secrets,
            "strip_exec_influence": self.env.strip_exec_influence,
            "allow": list(self.env.allow),
            "strip": list(self.env.strip),
        }
        if self.commands is not None:
            out["commands"] = commands_summary(self.commands)
            out["approvals"] = {
                "timeout_ms": self.approvals.timeout_ms,
                "on_timeout": self.approvals.on_timeout,
            }
        if self.limits is not None:
            out["limits"] = self.limits.summary()
        return out


# ---------------------------------------------------------------------------------------------------
# Loading


def default_policy_path() -> Path:
    """The shipped default policy for CI jobs (policy/default-ci.yaml)."""
    return Path(__file__).with_name("default-ci.yaml")


def policy_file(value: str) -> str:
    """What `--policy VALUE` names: a file, or `default` for the shipped CI policy."""
    return str(default_policy_path()) if value == "default" else value


class _Located:
    """YAML node tree -> (plain value, {location tuple: line number})."""

    def __init__(self) -> None:
        self.lines: dict[tuple[Any, ...], int] = {}

    def build(self, node: yaml.Node, loc: tuple[Any, ...] = ()) -> Any:
        self.lines[loc] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            out: dict[Any, Any] = {}
            for knode, vnode in node.value:
                key = _LOADER.construct_object(knode) if isinstance(knode, yaml.ScalarNode) else None
                if not isinstance(key, str):
                    raise _FileError(
                        knode.start_mark.line + 1, _fmt_loc(loc) or "top level", "keys must be plain names"
                    )
                if key in out:
                    raise _FileError(knode.start_mark.line + 1, _fmt_loc(loc + (key,)), "duplicate key")
                out[key] = self.build(vnode, loc + (key,))
            return out
        if isinstance(node, yaml.SequenceNode):
            return [self.build(v, loc + (i,)) for i, v in enumerate(node.value)]
        return _LOADER.construct_object(node, deep=True)


class _FileError(Exception):
    def __init__(self, line: int, where: str, message: str) -> None:
        self.line, self.where, self.message = line, where, message


_LOADER = yaml.SafeLoader("")


def _fmt_loc(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _line_for(lines: dict[tuple[Any, ...], int], loc: tuple[Any, ...]) -> int:
    while loc not in lines and loc:
        loc = loc[:-1]
    return lines.get(loc, 1)


def _clean_msg(err: Any) -> str:
    msg = str(err.get("msg", "invalid"))
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    if err.get("type") == "extra_forbidden":
        return "unknown field"
    if err.get("type") == "missing":
        return "required field missing"
    if err.get("type") == "literal_error" and "input" in err:
        return f"{err['input']!r}: {msg}"
    return msg


def parse_policy(
    text: str,
    *,
    name: str,
    variables: dict[str, str],
    resolve: Resolver | None = system_resolver,
) -> Policy:
    """Validate policy text; errors are PolicyError("NAME:LINE: FIELD: what is wrong")."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise PolicyError(
            f"{name}:{line}: not valid YAML: {problem}", hint="see docs/policy-format.md"
        ) from None
    if node is None:
        raise PolicyError(f"{name}:1: empty policy file", hint="a policy starts with 'version: 1'")
    located = _Located()
    try:
        data = located.build(node)
    except _FileError as e:
        raise PolicyError(f"{name}:{e.line}: {e.where}: {e.message}") from None
    except yaml.YAMLError as e:
        raise PolicyError(f"{name}:1: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise PolicyError(f"{name}:{located.lines.get((), 1)}: a policy is a mapping (version, fs, net, env)")
    for key in ("source", "sha256", "variables"):
        if key in data:
            raise PolicyError(f"{name}:{_line_for(located.lines, (key,))}: {key}: unknown field")
    try:
        policy = Policy.model_validate(data, context={"variables": variables, "resolve": resolve})
    except ValidationError as e:
        errors = sorted(e.errors(), key=lambda er: _line_for(located.lines, tuple(er["loc"])))
        first = errors[0]
        loc = tuple(first["loc"])
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise PolicyError(
            f"{name}:{_line_for(located.lines, loc)}: {_fmt_loc(loc) or 'top level'}: {_clean_msg(first)}{more}",
            hint="see docs/policy-format.md",
        ) from None
    return policy.model_copy(
        update={
            "source": name,
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "variables": dict(variables),
        }
    )


def load_policy(
    path: str | os.PathLike[str],
    *,
    workspace: str,
    tmpdir: str,
    home: str | None = None,
    resolve: Resolver | None = system_resolver,
) -> Policy:
    """Load and validate a policy file; ${WORKSPACE}, ${TMPDIR}, ${HOME} expanded, paths canonical,
    host names resolved (with `resolve`, default getaddrinfo). Raises PolicyError on any problem."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError(f"{name}: cannot read policy: {getattr(e, 'strerror', None) or e}") from None
    if home is None:
        home = os.environ.get("HOME") or os.path.expanduser("~")
    variables = {
        "WORKSPACE": canonical_path(os.path.abspath(workspace)),
        "TMPDIR": canonical_path(os.path.abspath(tmpdir)),
        "HOME": canonical_path(os.path.abspath(home)),
    }
    return parse_policy(text, name=name, variables=variables, resolve=resolve)
