"""Environment scrubbing, the private tmp, and the pure parts of --net."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from evidence.policy.env import is_exec_influence_name, is_secret_name, scrub
from evidence.policy.model import EnvPolicy
from evidence.policy.netns import PrivateNetns
from evidence.policy.tmp import create_private_tmp, private_tmp, remove_private_tmp, tmp_environ

ENV = {
    "PATH": "/usr/bin",
    "HOME": "/home/ci",
    "CI": "true",
    "GITHUB_TOKEN": "ghp_x",
    "GITHUB_SHA": "abc",
    "GITHUB_WORKSPACE": "/w",
    "NPM_TOKEN": "n",
    "AWS_ACCESS_KEY_ID": "AKIA",
    "AWS_REGION": "eu-west-1",
    "DB_PASSWORD": "p",
    "my_api_key": "k",
    "CLIENT_SECRET_VALUE": "s",
    "SSH_AUTH_SOCK": "/tmp/agent",
    "LD_PRELOAD": "/tmp/evil.so",
    "PYTHONPATH": "/tmp",
    "NODE_OPTIONS": "--require x",
    "BASH_ENV": "/tmp/x",
    "IFS": " ",
    "LANG": "C.UTF-8",
    "KEYBOARD": "us",  # not *_KEY
}


def test_default_strips_secrets_only() -> None:
    env, removed = scrub(ENV, None)
    assert removed == sorted(
        [
            "GITHUB_TOKEN",
            "GITHUB_SHA",
            "GITHUB_WORKSPACE",
            "NPM_TOKEN",
            "AWS_ACCESS_KEY_ID",
            "AWS_REGION",
            "DB_PASSWORD",
            "my_api_key",
            "CLIENT_SECRET_VALUE",
            "SSH_AUTH_SOCK",
        ]
    )
    assert env["LD_PRELOAD"] == "/tmp/evil.so" and env["PATH"] == "/usr/bin" and env["KEYBOARD"] == "us"
    assert all(v not in removed for v in env)


def test_exec_influence_and_allow_list() -> None:
    pe = EnvPolicy(strip_exec_influence=True, allow=("CI", "GITHUB_SHA", "AWS_REG*"))
    env, removed = scrub(ENV, pe)
    assert "GITHUB_SHA" in env and "AWS_REGION" in env and "CI" in env
    for name in ("LD_PRELOAD", "PYTHONPATH", "NODE_OPTIONS", "BASH_ENV", "IFS", "GITHUB_TOKEN"):
        assert name in removed and name not in env
    assert removed == sorted(removed)
    assert set(env) | set(removed) == set(ENV)


def test_names_only_never_values() -> None:
    _, removed = scrub(ENV, None)
    assert not any(v in removed for v in ("ghp_x", "AKIA", "p"))


def test_extra_strip_and_no_secret_stripping() -> None:
    env, removed = scrub(
        {"FOO": "1", "GITHUB_TOKEN": "x", "BAR": "2"}, EnvPolicy(strip_secrets=False, strip=("FOO",))
    )
    assert removed == ["FOO"] and env == {"GITHUB_TOKEN": "x", "BAR": "2"}


@pytest.mark.parametrize(
    "name",
    [
        "ACTIONS_RUNTIME_TOKEN",
        "ACTIONS_ID_TOKEN_REQUEST_URL",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "VAULT_ADDR",
        "gh_pat",
    ],
)
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["PATH", "HOME", "LANG", "TERM", "CI", "MONKEY", "TOKENIZER_MODEL_DIR"])
def test_not_secret_names(name: str) -> None:
    assert not is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "LD_LIBRARY_PATH",
        "PYTHONSTARTUP",
        "PERL5OPT",
        "RUBYOPT",
        "JAVA_TOOL_OPTIONS",
        "GLIBC_TUNABLES",
        "BASH_FUNC_ls%%",
    ],
)
def test_exec_influence_names(name: str) -> None:
    assert is_exec_influence_name(name)


def test_private_tmp_is_0700_and_removed(tmp_path: Path) -> None:
    path = create_private_tmp(str(tmp_path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert os.path.realpath(path) == path
    os.makedirs(os.path.join(path, "a", "b"))
    Path(path, "a", "b", "f").write_text("x")
    os.chmod(os.path.join(path, "a", "b"), 0o500)  # a read-only directory left by the run
    os.symlink("/etc", os.path.join(path, "etc-link"))  # never followed
    remove_private_tmp(path)
    assert not os.path.exists(path)
    assert os.path.exists("/etc/hostname") or os.path.isdir("/etc")
    remove_private_tmp(path)  # idempotent


def test_private_tmp_context_and_environ(tmp_path: Path) -> None:
    with private_tmp(str(tmp_path)) as path:
        env = tmp_environ({"PATH": "/usr/bin", "TMPDIR": "/tmp"}, path)
        assert env == {"PATH": "/usr/bin", "TMPDIR": path, "TMP": path, "TEMP": path}
    assert not os.path.exists(path)


def test_netns_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="--net must be one of none, loopback"):
        PrivateNetns("host")  # type: ignore[arg-type]
    ns = PrivateNetns("loopback", name="evidence-test")
    assert ns.path == "/run/netns/evidence-test" and ns.summary() == {
        "mode": "loopback",
        "name": "evidence-test",
    }
    with pytest.raises(OSError):
        ns.enter()  # not created
