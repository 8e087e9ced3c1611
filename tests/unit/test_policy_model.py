"""The policy model: loading, errors with file and line, variables, canonical paths, evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evidence.cli import main
from evidence.errors import PolicyError
from evidence.policy.model import Decision, default_policy_path, load_policy, parse_policy
from evidence.policy.paths import glob_regex

ISSUE_POLICY = """\
version: 1
fs:
  read:  ["/usr", "/lib", "/etc", "${WORKSPACE}"]
  write: ["${WORKSPACE}", "${TMPDIR}"]
  exec:  ["/usr", "/bin", "/lib"]
  deny:  ["${HOME}/.ssh", "/etc/shadow"]
net:
  default: deny            # or allow
  allow: ["127.0.0.1/32:8080", "::1/128"]
  deny:  []
env:
  strip_exec_influence: true
  allow: ["CI", "GITHUB_SHA"]
"""


def _resolver(table: dict[str, list[str]]):  # noqa: ANN202
    def resolve(host: str) -> list[str]:
        if host not in table:
            raise OSError(f"unknown host {host}")
        return table[host]

    return resolve


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, Path]:
    ws, tmp, home = tmp_path / "ws", tmp_path / "tmp", tmp_path / "home"
    for d in (ws, tmp, home / ".ssh"):
        d.mkdir(parents=True)
    return {"root": tmp_path, "ws": ws, "tmp": tmp, "home": home}


def _load(dirs: dict[str, Path], text: str, **kw):  # noqa: ANN003, ANN202
    p = dirs["root"] / "policy.yaml"
    p.write_text(text)
    return load_policy(p, workspace=str(dirs["ws"]), tmpdir=str(dirs["tmp"]), home=str(dirs["home"]), **kw)


def _error(dirs: dict[str, Path], text: str) -> str:
    with pytest.raises(PolicyError) as exc:
        _load(dirs, text, resolve=_resolver({}))
    msg = exc.value.message
    assert "\n" not in msg
    return msg.replace(str(dirs["root"]) + "/", "")


def test_issue_example_loads_and_expands(dirs: dict[str, Path]) -> None:
    p = _load(dirs, ISSUE_POLICY)
    assert p.fs is not None and p.net is not None
    assert p.fs.read[3].text == "${WORKSPACE}" and p.fs.read[3].path == str(dirs["ws"])
    assert p.fs.deny[0].path == str(dirs["home"] / ".ssh")
    assert p.variables == {
        "WORKSPACE": str(dirs["ws"]),
        "TMPDIR": str(dirs["tmp"]),
        "HOME": str(dirs["home"]),
    }
    assert p.env.strip_exec_influence and p.env.allow == ("CI", "GITHUB_SHA")
    assert len(p.sha256) == 64


def test_paths_are_canonicalised_through_symlinks(dirs: dict[str, Path]) -> None:
    (dirs["root"] / "ws-link").symlink_to(dirs["ws"])
    p = _load(dirs, 'version: 1\nfs:\n  write: ["' + str(dirs["root"] / "ws-link") + '/sub"]\n')
    assert p.fs is not None
    assert p.fs.write[0].path == str(dirs["ws"] / "sub")
    # both spellings are matched
    assert p.check_file(str(dirs["ws"] / "sub" / "a"), "write") is None
    assert p.check_file(str(dirs["root"] / "ws-link" / "sub" / "a"), "write") is None


def test_workspace_is_canonical_too(dirs: dict[str, Path]) -> None:
    (dirs["root"] / "wsl").symlink_to(dirs["ws"])
    p = load_policy(
        _write(dirs, ISSUE_POLICY),
        workspace=str(dirs["root"] / "wsl"),
        tmpdir=str(dirs["tmp"]),
        home=str(dirs["home"]),
    )
    assert p.variables["WORKSPACE"] == str(dirs["ws"])


def _write(dirs: dict[str, Path], text: str) -> Path:
    p = dirs["root"] / "policy.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            'version: 1\nnet:\n  default: deny\n  allow: ["10.0.0.0/8", "10.0.0.1/33"]\n',
            "policy.yaml:4: net.allow[1]: '10.0.0.1/33': not a CIDR",
        ),
        ("version: 2\n", "policy.yaml:1: version: 2: Input should be 1"),
        ('version: 1\nfs:\n  read: ["/usr"]\n  raed: ["/etc"]\n', "policy.yaml:4: fs.raed: unknown field"),
        (
            "version: 1\nfs:\n  read:\n    - /usr\n    - relative/path\n",
            "policy.yaml:5: fs.read[1]: 'relative/path': paths must be absolute",
        ),
        ('version: 1\nfs:\n  read: ["${NOPE}/x"]\n', "policy.yaml:3: fs.read[0]: unknown variable ${NOPE}"),
        ("version: 1\nnet:\n  allow: []\n", "policy.yaml:3: net.default: required field missing"),
        (
            "version: 1\nnet:\n  default: maybe\n",
            "policy.yaml:3: net.default: 'maybe': Input should be 'allow' or 'deny'",
        ),
        (
            'version: 1\nnet:\n  default: deny\n  allow: ["10.0.0.1:99999"]\n',
            "policy.yaml:4: net.allow[0]: '99999' is not a port",
        ),
        (
            "version: 1\nnet:\n  default: deny\n  deny:\n    - no.such.host.invalid:443\n",
            "policy.yaml:5: net.deny[0]: 'no.such.host.invalid:443': cannot resolve host",
        ),
        ("version: 1\nfs:\n  read: [1, 2]\n", "policy.yaml:3: fs.read[0]: must be a path"),
        ("version: 1\nversion: 1\n", "policy.yaml:2: version: duplicate key"),
        ("version: 1\nfs: [\n", "policy.yaml:3: not valid YAML"),
        ("", "policy.yaml:1: empty policy file"),
        ("- a\n- b\n", "policy.yaml:1: a policy is a mapping"),
        ("version: 1\nsource: x\n", "policy.yaml:2: source: unknown field"),
    ],
)
def test_bad_files_give_one_line_with_file_line_and_field(
    dirs: dict[str, Path], text: str, expected: str
) -> None:
    assert _error(dirs, text).startswith(expected)


def test_missing_file_is_a_policy_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read policy"):
        load_policy(tmp_path / "nope.yaml", workspace=str(tmp_path), tmpdir=str(tmp_path))


def test_check_file_most_specific_wins(dirs: dict[str, Path]) -> None:
    p = _load(dirs, ISSUE_POLICY)
    ws, home = str(dirs["ws"]), str(dirs["home"])
    assert p.check_file("/etc/shadow", "read") == Decision(rule="fs.deny[1]: /etc/shadow")
    assert p.check_file("/etc/passwd", "read") is None
    assert p.check_file("/etc/passwd", "write") == Decision(rule="fs.write: not allowed")
    assert p.check_file("/etc/passwd", "create") == Decision(rule="fs.write: not allowed")
    assert p.check_file(f"{home}/.ssh/id_rsa", "read") == Decision(rule="fs.deny[0]: ${HOME}/.ssh")
    assert p.check_file(f"{home}/notes", "read") == Decision(rule="fs.read: not allowed")
    assert p.check_file(f"{ws}/src/a.py", "write") is None
    assert p.check_file(f"{ws}/./a.py", "write") is None  # normalised
    # a '..' after a component the recorder keeps (it may follow a symlink): where it leads is not known
    assert p.check_file(f"{ws}/l/../a.py", "write") == Decision(
        rule="fs.write: '..' after a component: where the name leads is not known"
    )
    assert p.check_file(f"{ws}x/a.py", "write") == Decision(
        rule="fs.write: not allowed"
    )  # component boundary
    assert p.check_file(f"{ws}/tool", "exec") == Decision(rule="fs.exec: not allowed")
    assert p.check_file("/usr/bin/python3", "exec") is None
    # write and exec imply read
    assert p.check_file(f"{dirs['tmp']}/x", "read") is None
    with pytest.raises(ValueError):
        p.check_file("/x", "delete")


def test_allow_inside_deny_wins_when_more_specific(dirs: dict[str, Path]) -> None:
    p = _load(dirs, 'version: 1\nfs:\n  write: ["${HOME}/work"]\n  deny: ["${HOME}"]\n')
    home = str(dirs["home"])
    assert p.check_file(f"{home}/work/a", "write") is None
    assert p.check_file(f"{home}/other", "read") == Decision(rule="fs.deny[0]: ${HOME}")
    # the same path in both lists: deny wins
    p = _load(dirs, 'version: 1\nfs:\n  read: ["/etc"]\n  deny: ["/etc"]\n')
    assert p.check_file("/etc/hosts", "read") == Decision(rule="fs.deny[0]: /etc")


def test_globs(dirs: dict[str, Path]) -> None:
    p = _load(dirs, 'version: 1\nfs:\n  read: ["/srv/**"]\n  deny: ["/srv/*/secrets", "/srv/**/*.pem"]\n')
    assert p.check_file("/srv/a/b.txt", "read") is None
    assert p.check_file("/srv/app/secrets/db", "read") == Decision(rule="fs.deny[0]: /srv/*/secrets")
    assert p.check_file("/srv/a/b/c/key.pem", "read") == Decision(rule="fs.deny[1]: /srv/**/*.pem")
    assert glob_regex("/a/*/c").match("/a/b/c/d")
    assert not glob_regex("/a/*/c").match("/a/b/x/c")
    assert glob_regex("/a/[bc]x").match("/a/cx") and not glob_regex("/a/[!bc]x").match("/a/cx")


def test_no_fs_or_net_section_allows(dirs: dict[str, Path]) -> None:
    p = _load(dirs, "version: 1\n")
    assert p.check_file("/anything", "write") is None
    assert p.check_connect("AF_INET", "1.2.3.4", 443) is None
    assert "fs" not in p.summary() and "net" not in p.summary()


NET = """\
version: 1
net:
  default: deny
  allow:
    - 10.0.0.0/8
    - "[2001:db8::/32]:443"
    - udp://10.1.0.53:53
    - 192.168.1.10:8080/tcp
    - build.example:443
    - "::ffff:172.16.0.0/108"
  deny:
    - 10.9.0.0/16
    - 10.9.1.1/32:443
    - "2001:db8:bad::/48"
"""


def test_check_connect(dirs: dict[str, Path]) -> None:
    p = _load(dirs, NET, resolve=_resolver({"build.example": ["198.51.100.7", "2001:db8:1::7"]}))
    assert p.check_connect("AF_INET", "10.2.3.4", 22) is None
    assert p.check_connect("AF_INET", "10.9.3.4", 22) == Decision(rule="net.deny[0]: 10.9.0.0/16")
    assert p.check_connect("AF_INET", "10.9.1.1", 443) == Decision(rule="net.deny[1]: 10.9.1.1/32:443")
    # IPv4-mapped IPv6 is checked as IPv4
    assert p.check_connect("AF_INET6", "::ffff:10.9.3.4", 22) == Decision(rule="net.deny[0]: 10.9.0.0/16")
    assert p.check_connect("AF_INET6", "::ffff:10.2.3.4", 22) is None
    assert p.check_connect("AF_INET6", "2001:db8::1", 443) is None
    assert p.check_connect("AF_INET6", "2001:db8::1", 80) == Decision(rule="net.default: deny")
    assert p.check_connect("AF_INET6", "[2001:db8:bad::1]", 443) == Decision(
        rule="net.deny[2]: 2001:db8:bad::/48"
    )
    # protocol
    assert p.check_connect("AF_INET", "10.1.0.53", 53, "udp") is None
    assert p.check_connect("AF_INET", "192.168.1.10", 8080, "udp") == Decision(rule="net.default: deny")
    assert p.check_connect("AF_INET", "192.168.1.10", 8080, "tcp") is None
    # host names resolved at load time
    assert p.check_connect("AF_INET", "198.51.100.7", 443) is None
    assert p.check_connect("AF_INET6", "2001:db8:1::7", 443) is None
    assert p.check_connect("AF_INET", "198.51.100.7", 80) == Decision(rule="net.default: deny")
    # an IPv4-mapped CIDR in the file is an IPv4 rule
    assert p.net is not None and p.net.allow[5].networks == ("172.16.0.0/12",)
    assert p.check_connect("AF_INET", "172.16.5.5", 1) is None


def test_default_allow(dirs: dict[str, Path]) -> None:
    p = _load(dirs, 'version: 1\nnet:\n  default: allow\n  deny: ["::1/128", "127.0.0.0/8:22"]\n')
    assert p.check_connect("AF_INET", "127.0.0.1", 80) is None
    assert p.check_connect("AF_INET", "127.0.0.1", 22) == Decision(rule="net.deny[1]: 127.0.0.0/8:22")
    assert p.check_connect("AF_INET6", "::1", 80) == Decision(rule="net.deny[0]: ::1/128")


def test_summary_is_canonical_json_with_resolved_addresses(dirs: dict[str, Path]) -> None:
    from evidence.bundle import canonical

    p = _load(dirs, NET, resolve=_resolver({"build.example": ["198.51.100.7", "2001:db8:1::7"]}))
    s = p.summary()
    canonical.dumps(s)  # no floats, string keys
    host = s["net"]["allow"][4]
    assert host == {
        "rule": "build.example:443",
        "host": "build.example",
        "networks": ["198.51.100.7/32", "2001:db8:1::7/128"],
        "port": 443,
    }
    assert s["variables"]["WORKSPACE"] == str(dirs["ws"])
    assert json.loads(json.dumps(s)) == s


def test_shipped_default_policy(dirs: dict[str, Path]) -> None:
    home = str(dirs["home"])
    p = load_policy(default_policy_path(), workspace=str(dirs["ws"]), tmpdir=str(dirs["tmp"]), home=home)
    for secret in (
        ".ssh/id_rsa",
        ".aws/credentials",
        ".config/gcloud/x",
        ".kube/config",
        ".docker/config.json",
    ):
        assert p.check_file(f"{home}/{secret}", "read") is not None, secret
    assert p.check_file("/etc/shadow", "read") is not None
    assert p.check_file("/root/.bashrc", "read") is not None
    assert p.check_file("/home/someone/.bashrc", "read") is not None
    assert p.check_file("/etc/passwd", "read") is None
    assert p.check_file("/usr/bin/python3", "exec") is None
    assert p.check_file(str(dirs["ws"] / "build" / "x.o"), "create") is None
    assert p.check_file(str(dirs["tmp"] / "x"), "write") is None
    assert p.check_file("/etc/hosts", "write") is not None
    assert p.check_file("/usr/lib/x", "write") is not None
    # a workspace under /root still works: the more specific allow wins
    rws = "/root/ci-workspace-for-test"
    p = load_policy(default_policy_path(), workspace=rws, tmpdir=str(dirs["tmp"]), home="/root")
    assert p.check_file(f"{rws}/a", "write") is None
    assert p.check_file("/root/.ssh/id_rsa", "read") is not None


@given(st.lists(st.sampled_from(["a", "b", "..", ".", "c"]), max_size=6))
def test_check_file_never_escapes_the_workspace_by_dots(parts: list[str]) -> None:
    p = parse_policy('version: 1\nfs:\n  write: ["/ws"]\n', name="p.yaml", variables={})
    path = "/ws/" + "/".join(parts)
    import os

    inside = os.path.normpath(path) == "/ws" or os.path.normpath(path).startswith("/ws/")
    # a '..' after a component (the recorder keeps one only where it may follow a symlink) is never
    # allowed: where it leads is not known
    assert (p.check_file(path, "write") is None) == (inside and ".." not in parts)


def test_cli_profile_command_is_registered() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--help"])
    assert exc.value.code == 0
