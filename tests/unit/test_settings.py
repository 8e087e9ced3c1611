"""agent.settings: defaults, env vars, YAML config file and their precedence; bad input is one error."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from evidence.agent.daemon.settings import AgentSettings, load_settings, parse_host_port
from evidence.errors import UsageError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("EVIDENCE_"):
            monkeypatch.delenv(name)


def test_defaults_are_safe() -> None:
    s = load_settings()
    assert s.socket == Path("/run/evidence/agent.sock")
    assert s.bundle_dir == Path("/var/lib/evidence/bundles")
    assert s.tcp_listen is None  # no TCP unless asked
    assert s.upload_url is None and s.stream_url is None
    assert s.allowed_uids == [] and s.allowed_gids == [] and s.allow_root is True
    assert s.kubernetes is False and s.metrics is True
    assert s.stream_spill_dir == Path("/var/lib/evidence/stream-spill")


def test_env_vars_with_comma_or_json_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVIDENCE_ALLOWED_UIDS", "1001, 1000,1001")
    monkeypatch.setenv("EVIDENCE_ALLOWED_GIDS", "[42]")
    monkeypatch.setenv("EVIDENCE_KUBERNETES", "true")
    monkeypatch.setenv("EVIDENCE_UPLOAD_URL", "https://bundles.example.test/in")
    monkeypatch.setenv("EVIDENCE_BATCH_SIZE", "7")
    monkeypatch.setenv("EVIDENCE_DELIVERY_TOKEN", "s3cret")
    s = load_settings()
    assert s.delivery_headers == {"Authorization": "Bearer s3cret"}
    assert "s3cret" not in repr(s)  # a secret is never logged with the settings
    assert s.allowed_uids == [1000, 1001]
    assert s.allowed_gids == [42]
    assert s.kubernetes is True
    assert s.upload_url == "https://bundles.example.test/in"
    assert s.batch_size == 7


def test_precedence_flags_over_env_over_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        "socket: /tmp/from-file.sock\nbundle-dir: /srv/bundles\nallowed_uids: [5, 6]\nwindow_seconds: 60\n"
        "tcp_listen: '127.0.0.1:9464'\n"
    )
    monkeypatch.setenv("EVIDENCE_SOCKET", "/tmp/from-env.sock")
    monkeypatch.setenv("EVIDENCE_WINDOW_SECONDS", "120")
    s = load_settings(cfg, overrides={"window_seconds": 30, "bundle_dir": None})
    assert s.socket == Path("/tmp/from-env.sock")  # env beats file
    assert s.window_seconds == 30  # flag beats env
    assert s.bundle_dir == Path("/srv/bundles")  # file beats default; a None flag is "not given"
    assert s.allowed_uids == [5, 6]
    assert s.tcp_listen == "127.0.0.1:9464"


def test_every_bad_setting_is_named_in_one_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVIDENCE_BATCH_SIZE", "0")
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("upload_url: ftp://nope\ntcp_listen: nowhere\n")
    with pytest.raises(UsageError) as e:
        load_settings(cfg)
    msg = e.value.diagnostics()
    assert "batch_size" in msg and "upload_url" in msg and "tcp_listen" in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("- a\n- b\n", "mapping"),
        ("socket: [unclosed\n", "not valid YAML"),
        ("sockett: /x\n", "unknown setting(s) sockett"),
    ],
)
def test_bad_config_files(tmp_path: Path, text: str, fragment: str) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(text)
    with pytest.raises(UsageError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        load_settings(cfg)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read config file"):
        load_settings(tmp_path / "nope.yaml")


def test_empty_config_file_is_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("")
    assert load_settings(cfg) == AgentSettings()


def test_settings_are_frozen() -> None:
    s = load_settings()
    with pytest.raises(Exception):  # noqa: B017 - pydantic's ValidationError for frozen models
        s.socket = Path("/x")  # type: ignore[misc]


def test_parse_host_port() -> None:
    assert parse_host_port("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert parse_host_port("[::1]:80") == ("::1", 80)
    assert parse_host_port(":9464") == ("", 9464)
    for bad in ("9464", "host:", "host:0", "host:70000"):
        with pytest.raises(ValueError):
            parse_host_port(bad)
