"""`evidence profile`: a policy that allows what a recorded run did, and nothing is blocked under it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from evidence.bundle.writer import RunMeta, write_bundle
from evidence.cli import main
from evidence.policy.model import load_policy, parse_policy
from evidence.policy.profile import build_profile, collect
from tests.unit import conftest_bundles as cb

T0 = 1_700_000_000_000_000_000


@pytest.fixture
def dirs(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name in ("ws", "tmp", "home"):
        (tmp_path / name).mkdir()
        out[name] = str(tmp_path / name)
    out["root"] = str(tmp_path)
    return out


def _open(
    t: int, path: str, access: list[str], result: Any = 0, flags: list[str] | None = None
) -> dict[str, Any]:
    flags = flags or (["O_WRONLY", "O_CREAT"] if "write" in access or "create" in access else ["O_RDONLY"])
    return dict(
        k="open",
        t=T0 + t,
        pid=101,
        ppid=100,
        exe="/usr/bin/python3",
        path=path,
        raw_path=path,
        flags=flags,
        access=access,
        result=result,
    )


def _records(d: dict[str, str]) -> list[dict[str, Any]]:
    ws, tmp, home = d["ws"], d["tmp"], d["home"]
    return [
        dict(
            k="exec",
            t=T0,
            pid=101,
            ppid=100,
            depth=1,
            filename="/usr/bin/python3.11",
            argv=["python3", "-m", "compileall", "."],
            cwd=ws,
            result=0,
        ),
        dict(
            k="exec",
            t=T0 + 1,
            pid=102,
            ppid=101,
            depth=2,
            filename=f"{ws}/tools/gen.sh",
            argv=["gen.sh"],
            cwd=ws,
            result=0,
        ),
        dict(
            k="exec",
            t=T0 + 2,
            pid=103,
            ppid=101,
            depth=2,
            filename="/opt/secret/tool",
            argv=["tool"],
            cwd=ws,
            result="EACCES",
        ),
        _open(3, "/usr/lib/python3.11/os.py", ["read"]),
        _open(4, "/etc/ld.so.cache", ["read"]),
        _open(5, "/proc/101/status", ["read"]),
        _open(6, f"{ws}/src/pkg/mod.py", ["read"]),
        _open(7, f"{ws}/src/pkg/__pycache__/mod.cpython-311.pyc", ["write", "create"]),
        _open(8, f"{ws}/src", ["read"], flags=["O_RDONLY", "O_DIRECTORY"]),
        _open(9, f"{tmp}/tmpabc12345", ["write", "create"]),
        _open(10, f"{home}/.cache/pip/http/x", ["read"]),
        _open(11, f"{home}/.gitconfig", ["read"]),
        _open(12, "/dev/null", ["read", "write"]),
        _open(13, "/dev/pts/3", ["read", "write"]),
        _open(14, "/var/lib/thing/db", ["read"], result="ENOENT"),
        _open(15, "/etc/shadow", ["read"], result="EACCES"),  # refused: the run did not do it
        _open(16, "/srv/data/blob", ["read"]),
        dict(
            k="connect",
            t=T0 + 20,
            pid=102,
            ppid=101,
            exe="/usr/bin/curl",
            family="AF_INET",
            address="127.0.0.1",
            port=8080,
            result=0,
        ),
        dict(
            k="connect",
            t=T0 + 21,
            pid=102,
            ppid=101,
            exe="/usr/bin/curl",
            family="AF_INET6",
            address="::1",
            port=9000,
            result="ECONNREFUSED",
        ),
        dict(
            k="connect",
            t=T0 + 22,
            pid=102,
            ppid=101,
            exe="/usr/bin/curl",
            family="AF_INET6",
            address="::ffff:10.0.0.7",
            port=443,
            result=0,
        ),
        dict(
            k="connect",
            t=T0 + 23,
            pid=102,
            ppid=101,
            exe="/usr/bin/curl",
            family="AF_INET",
            address="192.0.2.9",
            port=22,
            result="EPERM",
        ),
        dict(
            k="connect",
            t=T0 + 24,
            pid=102,
            ppid=101,
            exe=None,
            family="AF_UNIX",
            address="/run/x.sock",
            port=None,
            result=0,
        ),
        dict(
            k="denial",
            t=T0 + 25,
            pid=102,
            exe=None,
            operation="sendmsg",
            target="198.51.100.1:53",
            rule="net.default: deny",
            enforced=False,
            result=0,
        ),
        dict(
            k="denial",
            t=T0 + 26,
            pid=102,
            exe=None,
            operation="connect",
            target="[2001:db8::5]:443",
            rule="net.default: deny",
            enforced=True,
            result="EPERM",
        ),
        dict(
            k="denial",
            t=T0 + 27,
            pid=102,
            exe=None,
            operation="write",
            target="/etc/motd",
            rule="fs.write: not allowed",
            enforced=False,
            result=0,
        ),
    ]


def _bundle(d: dict[str, str], records: list[dict[str, Any]], with_policy: bool = True) -> Path:
    summary = None
    if with_policy:
        p = Path(d["root"]) / "first.yaml"
        p.write_text("version: 1\nenv:\n  strip_exec_influence: true\n  allow: [CI]\n")
        summary = load_policy(p, workspace=d["ws"], tmpdir=d["tmp"], home=d["home"]).summary()
    meta = RunMeta(
        session_id="s1",
        command=["python3", "-m", "compileall", "."],
        cwd=d["ws"],
        pid=100,
        cgroup="/evidence/s1",
        started_ns=T0,
        finished_ns=T0 + 10**9,
        exit_code=0,
        detail="summary",
        host={},
        capabilities={},
        headers={},
        policy=summary,
        roots={"${WORKSPACE}": d["ws"], "${TMPDIR}": d["tmp"]},
    )
    out = Path(d["root"]) / "run.tar.gz"
    write_bundle(out, meta, lambda: iter(records))
    return out


def test_profile_cli_output_loads_and_blocks_nothing(
    dirs: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    records = _records(dirs)
    bundle = _bundle(dirs, records)
    assert main(["profile", str(bundle)]) == 0
    text = capsys.readouterr().out
    out = Path(dirs["root"]) / "profile.yaml"
    out.write_text(text)
    policy = load_policy(out, workspace=dirs["ws"], tmpdir=dirs["tmp"], home=dirs["home"], resolve=None)

    # everything the run did is allowed
    for rec in records:
        if rec["k"] == "open" and rec["result"] not in ("EACCES", "EPERM"):
            for access in rec["access"]:
                assert policy.check_file(rec["path"], access) is None, (rec["path"], access)
        if rec["k"] == "exec" and rec["result"] == 0:
            assert policy.check_file(rec["filename"], "exec") is None
        if rec["k"] == "connect" and rec["family"] != "AF_UNIX" and rec["result"] != "EPERM":
            assert policy.check_connect(rec["family"], rec["address"], rec["port"]) is None
    assert policy.check_connect("AF_INET", "198.51.100.1", 53, "udp") is None  # a would-block of the dry run
    assert policy.check_file("/etc/motd", "write") is None

    # and what it did not do is not
    assert policy.check_file("/etc/shadow", "read") is not None
    assert policy.check_file("/opt/secret/tool", "exec") is not None
    assert policy.check_connect("AF_INET", "192.0.2.9", 22) is not None
    assert policy.check_connect("AF_INET6", "2001:db8::5", 443) is not None
    assert policy.check_connect("AF_INET", "127.0.0.1", 8081) is not None
    assert policy.check_file(f"{dirs['home']}/.ssh/id_rsa", "read") is not None
    assert policy.check_file("/srv/other/x", "read") is not None

    # generalised: variables for the run's roots, directories, system trees
    assert '"${WORKSPACE}"' in text and '"${TMPDIR}"' in text
    assert '"${HOME}/.cache/pip/http"' not in text  # covered by ${HOME} (the run read ~/.gitconfig)
    assert '"${HOME}"' in text and '"/etc/motd"' in text  # a write to an existing file: that file only
    assert '"/usr"' in text and '"/etc"' in text and '"/proc"' in text and '"/srv/data"' in text
    assert '"/dev/null"' in text and '"/dev/pts"' in text
    assert '"127.0.0.1/32:8080"' in text and '"10.0.0.7/32:443"' in text and '"[::1]/128:9000"' in text
    assert "default: deny" in text
    # the env section of the recorded run's policy is kept
    assert policy.env.strip_exec_influence and policy.env.allow == ("CI",)


def test_profile_is_deterministic_and_minimal(dirs: dict[str, str]) -> None:
    from evidence.bundle.reader import read_events, read_manifest

    bundle = _bundle(dirs, _records(dirs))
    a, _ = build_profile(read_manifest(bundle), read_events(bundle))
    b, _ = build_profile(read_manifest(bundle), reversed(list(read_events(bundle))))
    assert a == b
    fs_read = a.split("  read:\n")[1].split("  write:")[0]
    # /usr is in exec (exec implies read): not repeated in read
    assert '"/usr"' not in fs_read and '"/etc"' in fs_read


def test_secret_deny_is_dropped_only_when_the_run_used_it(dirs: dict[str, str]) -> None:
    from evidence.bundle.reader import read_events, read_manifest

    records = _records(dirs) + [_open(30, f"{dirs['home']}/.ssh/known_hosts", ["read"])]
    bundle = _bundle(dirs, records)
    text, policy = build_profile(read_manifest(bundle), read_events(bundle))
    assert "${HOME}/.ssh" not in text
    assert '"${HOME}/.aws"' in text
    assert policy.check_file(f"{dirs['home']}/.ssh/known_hosts", "read") is None


def test_without_a_recorded_policy_the_cwd_is_the_workspace(dirs: dict[str, str]) -> None:
    from evidence.bundle.reader import read_events, read_manifest

    bundle = _bundle(dirs, _records(dirs), with_policy=False)
    text, _ = build_profile(read_manifest(bundle), read_events(bundle), tmpdir=dirs["tmp"], home=dirs["home"])
    assert '"${WORKSPACE}"' in text
    assert "strip_exec_influence: false" in text
    parse_policy(
        text, name="p", variables={"WORKSPACE": dirs["ws"], "TMPDIR": dirs["tmp"], "HOME": dirs["home"]}
    )


def test_collect_skips_refusals() -> None:
    act = collect(
        [
            {
                "type": "dev.evidence.file.open",
                "data": {"path": "/a", "access": ["read"], "result": "EACCES", "flags": []},
            },
            {"type": "dev.evidence.process.exec", "data": {"filename": "/b", "result": "EPERM"}},
            {
                "type": "dev.evidence.policy.denial",
                "data": {"operation": "exec", "target": "/c", "enforced": True},
            },
            {
                "type": "dev.evidence.policy.denial",
                "data": {"operation": "exec", "target": "/d", "enforced": False},
            },
        ]
    )
    assert act.read == set() and act.exec == {"/d"}


def test_names_with_a_dotdot_after_a_component_are_left_out_and_said() -> None:
    """The recorder keeps '..' after a component only where it may follow a symlink: no rule can
    be made for where such a name led, so the profile leaves it out (and says how many)."""
    act = collect(
        [
            {
                "type": "dev.evidence.file.open",
                "data": {"path": "/w/l/../x", "access": ["read"], "result": 0},
            },
            {"type": "dev.evidence.file.open", "data": {"path": "/w/y", "access": ["write"], "result": 0}},
            {"type": "dev.evidence.process.exec", "data": {"filename": "/w/l/../tool", "result": 0}},
        ]
    )
    assert act.read == set() and act.write == {("/w/y", False)} and act.exec == set()
    assert act.unplaced == {"/w/l/../x", "/w/l/../tool"}


def test_profile_to_file(dirs: dict[str, str]) -> None:
    bundle = _bundle(dirs, _records(dirs))
    out = Path(dirs["root"]) / "p.yaml"
    assert main(["profile", str(bundle), "-o", str(out)]) == 0
    assert out.read_text().startswith("# Generated by `evidence profile` from run run-")


def test_connects_the_run_resolved_are_allowed_by_name(dirs: dict[str, str]) -> None:
    records = [
        *_records(dirs),
        cb.dns(30, "registry.example", ["192.0.2.7", "2001:db8::7"]),
        cb.dns(31, "evil name", ["192.0.2.66"]),  # not a host name a rule can hold: the address is allowed
        cb.dns(32, "gone.example", [], result="NXDOMAIN"),
        cb.connect(33, "127.0.0.53", 53),
        cb.connect(34, "::ffff:192.0.2.7", 443, family="AF_INET6"),
        cb.connect(35, "2001:db8::7", 443, family="AF_INET6"),
        cb.connect(36, "192.0.2.66", 80),
        # a job answering its own query, and a server that is not the run's resolver: no name
        cb.dns(37, "forged.example", ["192.0.2.88"], unsolicited="other source", source=("127.0.0.1", 40000)),
        cb.dns(38, "elsewhere.example", ["192.0.2.99"], server="198.51.100.53", configured=False),
        cb.connect(39, "192.0.2.88", 443),
        cb.connect(40, "192.0.2.99", 443),
    ]
    bundle = _bundle(dirs, records)
    from evidence.bundle.reader import read_events, read_manifest

    text, policy = build_profile(
        read_manifest(bundle),
        read_events(bundle),
        workspace=dirs["ws"],
        tmpdir=dirs["tmp"],
        home=dirs["home"],
    )
    assert '"registry.example:443"' in text
    assert "192.0.2.7" not in text and "2001:db8::7" not in text
    assert '"192.0.2.66/32:80"' in text and '"127.0.0.53/32:53"' in text
    assert '"192.0.2.88/32:443"' in text and '"192.0.2.99/32:443"' in text
    assert "forged.example" not in text and "elsewhere.example" not in text
    # the policy built (with the run's own answers) allows the run's connects
    assert policy.check_connect("AF_INET", "192.0.2.7", 443) is None
    assert policy.check_connect("AF_INET6", "2001:db8::7", 443) is None
    assert policy.check_connect("AF_INET", "192.0.2.7", 22) is not None
    # loaded for real, the name is resolved then, by the resolver given
    out = Path(dirs["root"]) / "named.yaml"
    out.write_text(text)
    loaded = load_policy(
        out,
        workspace=dirs["ws"],
        tmpdir=dirs["tmp"],
        home=dirs["home"],
        resolve=lambda host: ["198.51.100.20"],
    )
    assert loaded.check_connect("AF_INET", "198.51.100.20", 443) is None
    assert loaded.check_connect("AF_INET", "192.0.2.7", 443) is not None
