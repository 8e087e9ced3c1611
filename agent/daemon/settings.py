"""Settings of `evidence agent`: command-line flags, then EVIDENCE_* environment variables, then a YAML
config file (--config), then the defaults below. docs/deploy.md has the table.

Lists (allowed uids/gids) are given in the environment either as JSON (`[1000, 1001]`) or comma
separated (`1000,1001`). Durations are seconds, sizes bytes.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from evidence.errors import UsageError

logger = logging.getLogger(__name__)

DEFAULT_SOCKET = Path("/run/evidence/agent.sock")
DEFAULT_BUNDLE_DIR = Path("/var/lib/evidence/bundles")

_config_data: contextvars.ContextVar[Mapping[str, Any] | None] = contextvars.ContextVar(
    "evidence_config_data", default=None
)


def _int_list(value: Any) -> Any:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return yaml.safe_load(text)
        return [int(part) for part in text.split(",") if part.strip()]
    if isinstance(value, int):
        return [value]
    return value


IdList = Annotated[list[int], NoDecode]


class NatsSink(BaseModel):
    """`sink.nats`: the fleet's NATS JetStream (docs/deploy.md, "A fleet"). The agent publishes every
    live event, every bundle and each run's index entry there, through an outbox on disk."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    servers: list[str] = Field(min_length=1, description="nats:// or tls:// URLs of the cluster's servers")
    node: str = Field(default_factory=lambda: _hostname(), description="this node's name (one subject token)")
    creds: Path | None = Field(None, description="a NATS credentials file (user JWT and NKey seed)")
    nkey_seed: Path | None = Field(None, description="a file holding the node user's NKey seed")
    tls_ca: Path | None = Field(None, description="CA bundle the servers' certificates are checked with")
    outbox_dir: Path | None = Field(
        None, description="bundles and events not yet acknowledged; default <bundle_dir>/../fleet-outbox"
    )
    outbox_max_bytes: int = Field(
        1024 * 1024 * 1024, ge=0, description="events past this are dropped and counted (bundles never)"
    )
    batch_size: int = Field(
        5_000, ge=1, le=100_000, description="events written to the outbox and published at once"
    )
    # a second, as the HTTP sink's: larger segments, less of the agent's CPU (bench/fleet.py)
    batch_interval: float = Field(1.0, gt=0, description="longest wait before a partial batch is sent")
    ack_timeout: float = Field(10.0, gt=0, description="seconds to wait for JetStream's acknowledgements")
    ack_window: int = Field(
        2_000, ge=1, le=100_000, description="events published and not yet acknowledged, at most"
    )

    @field_validator("servers")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith(("nats://", "tls://")):
                raise ValueError(f"{url!r} is not a nats:// or tls:// URL")
        return value

    @field_validator("node")
    @classmethod
    def _node(cls, value: str) -> str:
        from evidence.bundle.fleet.names import check_node

        try:
            return check_node(value)
        except UsageError as e:
            raise ValueError(e.message) from None

    @model_validator(mode="after")
    def _one_credential(self) -> NatsSink:
        if self.creds is not None and self.nkey_seed is not None:
            raise ValueError("give creds or nkey_seed, not both")
        return self


class SinkSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    nats: NatsSink | None = None


def _hostname() -> str:
    import re
    import socket

    return re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0])[:64] or "node"


class AgentSettings(BaseSettings):
    """Everything `evidence agent` can be told. Frozen: the daemon reads it once."""

    model_config = SettingsConfigDict(env_prefix="EVIDENCE_", extra="forbid", frozen=True)

    # The control API (Unix socket, HTTP+JSON)
    socket: Path = Field(DEFAULT_SOCKET, description="Unix socket of the control API (mode 0660)")
    socket_gid: int | None = Field(
        None, ge=0, description="group that owns the socket (its members may connect)"
    )
    allowed_uids: IdList = Field(default_factory=list, description="peer uids allowed on the socket")
    allowed_gids: IdList = Field(
        default_factory=list, description="peer gids (primary or supplementary) allowed"
    )
    allow_root: bool = Field(
        True, description="peers with uid 0 are allowed (they could read the bundles anyway)"
    )
    max_connections: int = Field(
        64, ge=1, le=4096, description="open API connections at most; past it, 503 and close"
    )
    max_connections_per_uid: int = Field(
        16, ge=1, le=4096, description="open API connections at most per peer uid (root: only the total)"
    )

    # Bundles and their delivery
    bundle_dir: Path = Field(
        DEFAULT_BUNDLE_DIR, description="where bundles are written (and kept until delivered)"
    )
    upload_url: str | None = Field(
        None, description="HTTP(S) endpoint bundles are uploaded to; none: keep on disk"
    )
    upload_method: Literal["PUT", "POST"] = Field("PUT", description="PUT to <url>/<name>, or POST to <url>")
    upload_timeout: float = Field(30.0, gt=0)
    delivery_token: SecretStr | None = Field(
        None, description="sent as 'Authorization: Bearer <token>' to the upload and stream endpoints"
    )
    retry_initial: float = Field(
        1.0, gt=0, description="first delay after a failed delivery (doubles each time)"
    )
    retry_max: float = Field(300.0, gt=0, description="longest delay between delivery attempts")

    # Live stream of events (CloudEvents over HTTP)
    stream_url: str | None = Field(None, description="HTTP(S) endpoint for live CloudEvents; none: no stream")
    stream_mode: Literal["batch", "structured"] = Field(
        "batch", description="one request per batch or per event"
    )
    batch_size: int = Field(100, ge=1, le=10_000)
    batch_interval: float = Field(1.0, gt=0, description="longest wait before a partial batch is sent")
    stream_queue: int = Field(10_000, ge=1, description="events held in memory before they spill to disk")
    spill_dir: Path | None = Field(
        None, description="undelivered live events; default <bundle_dir>/../stream-spill"
    )
    spill_max_bytes: int = Field(
        64 * 1024 * 1024, ge=0, description="past this, events are dropped and counted"
    )

    sink: SinkSettings = Field(
        default_factory=SinkSettings,
        description="where else the agent sends what it records: `nats` (a fleet's JetStream)",
    )

    spool_dir: Path | None = Field(
        None,
        description="spools of runs being recorded (recovered into cut-short bundles after a crash); "
        "default <bundle_dir>/../spool",
    )

    signing_key: Path | None = Field(
        None,
        description="sign every bundle with this ed25519 key (PEM, `evidence keygen`; readable by the "
        "agent only): jobs never hold the key",
    )

    # Long-lived pods are cut into bundles, each naming the previous one's hash
    window_seconds: float = Field(3600.0, gt=0)
    window_bytes: int = Field(256 * 1024 * 1024, gt=0, description="spooled bytes that close a window early")

    # Kubernetes mode
    kubernetes: bool = Field(False, description="discover pods under the kubepods cgroups, one run per pod")
    cgroup_root: Path = Field(
        Path("/sys/fs/cgroup"), description="the cgroup2 mount (host's, in a DaemonSet)"
    )
    pod_logs: Path = Field(Path("/var/log/pods"), description="kubelet pod log dirs: namespace and pod name")
    poll_interval: float = Field(2.0, gt=0, description="seconds between scans of the kubepods tree")

    # Observability
    metrics: bool = Field(True, description="serve /metrics (Prometheus text format)")
    tcp_listen: str | None = Field(
        None,
        description="HOST:PORT for a read-only listener: /healthz, /readyz, /metrics only; off by default",
    )

    @field_validator("allowed_uids", "allowed_gids", mode="before")
    @classmethod
    def _split_ids(cls, value: Any) -> Any:
        return _int_list(value)

    @field_validator("allowed_uids", "allowed_gids")
    @classmethod
    def _non_negative(cls, value: list[int]) -> list[int]:
        if any(v < 0 for v in value):
            raise ValueError("ids must be >= 0")
        return sorted(set(value))

    @field_validator("upload_url", "stream_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value or None

    @field_validator("tcp_listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value:
            parse_host_port(value)
        return value or None

    @model_validator(mode="after")
    def _retry_order(self) -> AgentSettings:
        if self.retry_max < self.retry_initial:
            raise ValueError("retry_max must be >= retry_initial")
        return self

    @property
    def delivery_headers(self) -> dict[str, str]:
        if self.delivery_token is None:
            return {}
        return {"Authorization": f"Bearer {self.delivery_token.get_secret_value()}"}

    @property
    def run_spool_dir(self) -> Path:
        return self.spool_dir or self.bundle_dir.parent / "spool"

    @property
    def stream_spill_dir(self) -> Path:
        return self.spill_dir or self.bundle_dir.parent / "stream-spill"

    @property
    def fleet_outbox_dir(self) -> Path | None:
        nats = self.sink.nats
        if nats is None:
            return None
        return nats.outbox_dir or self.bundle_dir.parent / "fleet-outbox"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _ConfigFileSource(settings_cls))


class _ConfigFileSource(PydanticBaseSettingsSource):
    """The YAML config file's values (already read by load_settings), below the environment."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        data = _config_data.get() or {}
        return data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_config_data.get() or {})


def parse_host_port(text: str) -> tuple[str, int]:
    """'127.0.0.1:9464', '[::1]:9464' or ':9464' (all addresses) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise UsageError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must hold a mapping of setting: value")
    known = AgentSettings.model_fields
    unknown = sorted(str(k) for k in data if str(k).replace("-", "_") not in known)
    if unknown:
        raise UsageError(
            f"config file {path}: unknown setting(s) {', '.join(unknown)}", hint="see docs/deploy.md"
        )
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def load_settings(
    config_file: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> AgentSettings:
    """Settings from (highest first) overrides (command-line flags; None values are ignored), the
    environment, the config file. Invalid values raise one UsageError naming every bad setting."""
    data = read_config_file(Path(config_file)) if config_file else {}
    init = {k: v for k, v in (overrides or {}).items() if v is not None}
    token = _config_data.set(data)
    try:
        return AgentSettings(**init)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}" for err in e.errors()
        )
        raise UsageError(
            f"invalid agent settings: {problems}", hint="flags, EVIDENCE_* variables or --config"
        ) from None
    finally:
        _config_data.reset(token)
