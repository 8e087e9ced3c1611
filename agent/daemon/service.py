"""The daemon behind `evidence agent`: the long-lived recorder behind `evidence start` / `evidence finish` and pods.

    evidence agent --socket /run/evidence/agent.sock [--bundle-dir DIR] [--kubernetes] [--config FILE]

Start-up, in order: settings; spools left by an agent that died become bundles marked cut short
(agent/recorder/recovery.py: recover_spools); uploader and live stream; the API (so /healthz answers and
/readyz says "loading" while BCC compiles); the probes, loaded once; housekeeping (spool flushes,
consumer lag); in Kubernetes mode, the pod watcher.

SIGTERM or SIGINT: the pod watcher stops, every open run is finished and marked cut short (its
bundle written into the bundle directory, atomically, and queued for upload), then the uploader,
the stream and the API stop, the probes are unloaded, and the agent exits 0.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from evidence.errors import Error, SetupError

if TYPE_CHECKING:
    from evidence.agent.daemon.backend import RecorderBackend
    from evidence.agent.daemon.settings import AgentSettings
    from evidence.agent.recorder.launch import Watchdog
    from evidence.agent.recorder.recording import Recorder

logger = logging.getLogger(__name__)

HOUSEKEEPING_SECONDS = 1.0


def _cgroup_root(settings: AgentSettings) -> Path:
    from evidence.agent.recorder.cgroups import find_cgroup2_mount

    if "cgroup_root" in settings.model_fields_set:
        root = Path(settings.cgroup_root)
        if not (root / "cgroup.procs").is_file():
            raise SetupError(f"cgroup_root {root} is not a cgroup v2 directory (no cgroup.procs)")
        return root
    return find_cgroup2_mount()


class Daemon:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        logger.info("%s: finishing open runs and stopping", signal.Signals(signum).name)
        self.stop.set()

    def run(self) -> int:
        from evidence.agent.daemon import metrics as m
        from evidence.agent.daemon.api import AgentAPI
        from evidence.agent.daemon.authz import PeerPolicy
        from evidence.agent.daemon.backend import RecorderBackend
        from evidence.agent.daemon.delivery import Backoff, BundleUploader, EventStreamer
        from evidence.agent.daemon.pods import PodRuns
        from evidence.agent.daemon.settings import parse_host_port
        from evidence.agent.recorder.recovery import recover_spools
        from evidence.files import private_dir

        s = self.settings
        cgroup_root = _cgroup_root(s)
        bundle_dir = Path(s.bundle_dir)
        spool_dir = s.run_spool_dir
        try:
            # the recorded jobs must not reach their spools, nor anyone read another's bundle or
            # events (a bundle has argv and file names): 0700 whatever the umask, an older agent's
            # readable directory made so; one that others can write is refused
            private_dir(bundle_dir)
            private_dir(spool_dir)
            if s.stream_url:
                private_dir(s.stream_spill_dir)
            if s.fleet_outbox_dir is not None:
                private_dir(s.fleet_outbox_dir)
        except OSError as e:
            raise SetupError(f"cannot use {e.filename}: {e.strerror}") from None
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

        from evidence.bundle.signing import load_signer

        # a bad key stops the agent before it records anything unsigned (one line, exit 2)
        signer = load_signer(s.signing_key) if s.signing_key else None
        recovered = recover_spools(spool_dir, bundle_dir, signer=signer)
        registry = m.Registry()
        backoff = Backoff(s.retry_initial, s.retry_max)
        uploader = (
            BundleUploader(
                bundle_dir,
                s.upload_url,
                method=s.upload_method,
                backoff=backoff,
                timeout=s.upload_timeout,
                headers=s.delivery_headers,
                registry=registry,
            )
            if s.upload_url
            else None
        )
        streamer = (
            EventStreamer(
                s.stream_url,
                s.stream_spill_dir,
                mode=s.stream_mode,
                batch_size=s.batch_size,
                batch_interval=s.batch_interval,
                queue_size=s.stream_queue,
                spill_max_bytes=s.spill_max_bytes,
                backoff=backoff,
                registry=registry,
                headers=s.delivery_headers,
            )
            if s.stream_url
            else None
        )
        fleet = None
        if s.sink.nats is not None and s.fleet_outbox_dir is not None:
            from evidence.agent.daemon.fleet import FleetPublisher

            fleet = FleetPublisher(s.sink.nats, s.fleet_outbox_dir, registry=registry)
            for path in recovered:
                fleet.bundle_written(path)
        watchdog = self._watchdog()
        backend = RecorderBackend(
            bundle_dir,
            spool_dir,
            uploader=uploader,
            streamer=streamer,
            registry=registry,
            watchdog=watchdog,
            signer=signer,
            fleet=fleet,
        )
        api = AgentAPI(
            backend,
            s.socket,
            bundle_dir,
            policy=PeerPolicy(frozenset(s.allowed_uids), frozenset(s.allowed_gids), s.allow_root),
            socket_gid=s.socket_gid,
            cgroup_root=cgroup_root,
            metrics_enabled=s.metrics,
            registry=registry,
            tcp_listen=parse_host_port(s.tcp_listen) if s.tcp_listen else None,
            max_connections=s.max_connections,
            max_connections_per_uid=s.max_connections_per_uid,
        )
        if uploader is not None:
            uploader.start()
            for path in recovered:
                uploader.enqueue(path)
        if streamer is not None:
            streamer.start()
        if fleet is not None:
            fleet.start()
        try:
            api.start()
        except (OSError, Error) as e:
            if uploader is not None:
                uploader.stop()
            if streamer is not None:
                streamer.close()
            if watchdog is not None:
                watchdog.done()
            if isinstance(e, Error):
                raise
            raise SetupError(f"cannot listen on {s.socket}: {e.strerror}") from None
        recorder = None
        try:
            recorder = self._load_recorder(backend, spool_dir)
            if recorder is not None and not self.stop.is_set():
                self._thread("evidence-housekeeping", self._housekeeping, backend)
                if s.kubernetes:
                    pods = PodRuns(
                        backend,
                        cgroup_root,
                        s.pod_logs,
                        window_seconds=s.window_seconds,
                        window_bytes=s.window_bytes,
                        poll_interval=s.poll_interval,
                    )
                    self._thread("evidence-kubernetes", pods.loop, self.stop)
                    logger.info("kubernetes mode: watching pods under %s", cgroup_root)
            logger.info("agent ready on %s; bundles in %s", s.socket, bundle_dir)
            while not self.stop.wait(1.0):
                pass
        finally:
            self.stop.set()
            for t in self.threads:
                t.join(timeout=30)
            backend.set_not_ready("the agent is shutting down")
            if recorder is not None:
                written = backend.finish_all(cut_short=True)
                if written:
                    logger.info("wrote %d bundle(s) of runs cut short", len(written))
                if not backend.wait_idle(60):
                    logger.warning("a run was still being finished when the agent stopped")
            if uploader is not None:
                uploader.stop()
            if streamer is not None:
                streamer.close()
            if fleet is not None:
                fleet.close()
            api.stop()
            if recorder is not None:
                recorder.close()
            if watchdog is not None:
                watchdog.done()  # stopped on purpose: what runs on was cut short and said so
        logger.info("agent stopped")
        return 0

    def _watchdog(self) -> Watchdog | None:
        """A watchdog outside the runs (agent/recorder/watchdog.py) that kills the isolated runs'
        cgroups if this agent dies (kill -9, OOM): their jobs must not run on unrecorded."""
        from evidence.agent.recorder.launch import Watchdog

        try:
            return Watchdog(parent_death=True)
        except OSError as e:
            logger.warning("no watchdog (%s): if the agent dies, isolated runs go on unrecorded", e)
            return None

    def _thread(self, name: str, target: Callable[..., object], *args: object) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self.threads.append(t)

    def _load_recorder(self, backend: RecorderBackend, spool_dir: Path) -> Recorder | None:
        """Load the probes. A failure keeps the agent up with /readyz at 503 and the reason."""
        from evidence.agent.recorder.kernel import kernel_ready
        from evidence.agent.recorder.run import open_recorder

        try:
            # what a run's command runs under (isolation, 32-bit system calls) is said per run
            # (backend.start_run): a process the agent adopted is not one `run --agent` launched
            recorder = open_recorder(spool_dir, kernel_ready(hints=False))
        except Error as e:
            logger.error("the recorder cannot start: %s", e.diagnostics())
            backend.set_not_ready(e.message)
            return None
        backend.attach(recorder)
        return recorder

    def _housekeeping(self, backend: RecorderBackend) -> None:
        from evidence.agent.daemon.backend import FLUSH_SECONDS

        last_flush = 0.0
        while not self.stop.wait(HOUSEKEEPING_SECONDS):
            try:
                backend.probe_lag()
                backend.poll_denials()
                if time.monotonic() - last_flush >= FLUSH_SECONDS:
                    backend.flush_spools()
                    last_flush = time.monotonic()
            except Exception:
                logger.exception("housekeeping failed")
