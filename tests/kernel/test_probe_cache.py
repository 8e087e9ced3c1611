"""The probes loaded from the compiled-probe cache record exactly what freshly compiled ones do: a
cold start compiles and stores, a warm one compiles nothing, and both see the same exec of a job
run as nobody; an entry the kernel refuses is dropped so that the next start compiles afresh."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from evidence.agent.recorder.cgroups import RunCgroup
from evidence.agent.recorder.decode import decode
from evidence.agent.recorder.kernel import mount_tracefs
from evidence.probes import objcache
from evidence.probes.headers import ensure_headers
from evidence.probes.loader import RecorderProbes
from tests.kernel.util import in_cgroup

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


def _execs_seen(probes: RecorderProbes, tag: str) -> list[list[str]]:
    cg = RunCgroup.create(f"test-probe-cache-{os.getpid()}-{tag}")
    try:
        ring = probes.ring()
        probes.reset_lost(3)
        probes.track(cg.id, 3)
        subprocess.run(
            in_cgroup(cg.procs_file(), *NOBODY, "/bin/echo", tag), check=True, stdout=subprocess.DEVNULL
        )
        recs = [decode(r) for r in ring.read()]
        assert probes.read_lost(3) == {}
        return [r["argv"] for r in recs if r["kind"] in ("exec", "exec_ok") and r.get("argv")]
    finally:
        probes.untrack(cg.id)
        cg.kill()
        cg.wait_empty()
        cg.remove()


def test_cold_and_warm_starts_record_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mount_tracefs()
    ensure_headers()
    monkeypatch.setattr(objcache, "CACHE_DIR", tmp_path / "probes")
    monkeypatch.delenv(objcache.CACHE_ENV, raising=False)
    real_compile = objcache.compile_object
    compiled: list[str] = []

    def counting(source: str) -> objcache.CompiledObject:
        compiled.append(source)
        return real_compile(source)

    monkeypatch.setattr(objcache, "compile_object", counting)
    cold = RecorderProbes()
    try:
        cold_execs = _execs_seen(cold, "cold")
    finally:
        cold.close()
    assert len(compiled) == 1 and len(list((tmp_path / "probes").glob("*.json"))) == 1
    warm = RecorderProbes()
    try:
        warm_execs = _execs_seen(warm, "warm")
        assert len(compiled) == 1  # nothing compiled: loaded from the cache
        # the programs BCC attaches by name (sched tracepoints, the fork raw tracepoint) are attached too
        assert any(b"sched_process_exit" in tp for tp in warm.bpf.tracepoint_fds)
        assert warm.bpf.raw_tracepoint_fds
        # every map reads and writes through bpf(2) with the kernel's key and value sizes
        for m in warm.bpf._obj.maps:
            if m.type == 27:  # the ring buffer: no keys nor values
                continue
            t = warm.bpf[m.name.encode()]
            assert t.key_size == m.key_size and t.cpu_value_size >= m.value_size, m
            t.items()  # a batch or a walk, whichever the map offers
        counters = warm.bpf[b"wake_ctr"]  # a per-CPU array: one value per possible CPU
        assert len(counters.per_cpu(counters[struct.pack("<I", 0)])) == objcache.possible_cpus() >= 1
        lost = warm.bpf[b"lost"]
        lost[struct.pack("<I", 5)] = struct.pack("<Q", 77)
        assert lost[struct.pack("<I", 5)] == struct.pack("<Q", 77)
    finally:
        warm.close()
    assert ["/bin/echo", "cold"] in cold_execs
    assert ["/bin/echo", "warm"] in warm_execs


def test_an_entry_the_kernel_refuses_is_forgotten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mount_tracefs()
    headers = ensure_headers().path
    root = tmp_path / "probes"
    # a cached program the verifier refuses (it returns without setting r0)
    bad = objcache.CompiledObject(
        license="GPL", maps=(), functions={"on_bad": bytes.fromhex("9500000000000000")}
    )
    monkeypatch.setattr(objcache, "compile_object", lambda source: bad)
    objcache.cached_object("SOURCE", headers, root)
    assert len(list(root.glob("*.json"))) == 1
    loaded = objcache.load("SOURCE", headers, root)
    try:
        with pytest.raises(objcache.ObjectError, match="cannot load on_bad"):
            loaded.load_func(b"on_bad", loaded.TRACEPOINT)
    finally:
        loaded.cleanup()
    assert not list(root.glob("*.json"))


def test_a_warm_start_does_not_load_bcc() -> None:
    """From the cache, the probes load with bpf(2) alone: neither BCC's module nor libbcc (which
    maps LLVM, ~60 MB of RSS) is loaded."""
    mount_tracefs()
    ensure_headers()
    probe = (
        "import sys\n"
        "from evidence.probes.loader import RecorderProbes\n"
        "p = RecorderProbes()\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('bcc' in sys.modules, 'libbcc' in maps, 'libLLVM' in maps)\n"
        "p.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != objcache.CACHE_ENV}
    subprocess.run([sys.executable, "-c", probe], check=True, env=env, capture_output=True)  # fills the cache
    out = subprocess.run([sys.executable, "-c", probe], check=True, env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["False", "False", "False"], out.stderr


def test_signals_while_the_programs_load_do_not_fail_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The verifier stops with EAGAIN when a signal is pending for the loading thread; stray signals
    (a child exiting, a terminal resized) must neither fail the start nor make the cache forget its
    entry. This thread loads half the programs (the other half on a thread of its own): eight
    signals 10 ms apart, from the load's start, land in its loads (one program takes up to ~25 ms to
    verify here: some twice; a program is tried again up to ten times)."""
    mount_tracefs()
    ensure_headers()
    monkeypatch.setattr(objcache, "CACHE_DIR", tmp_path / "probes")
    monkeypatch.delenv(objcache.CACHE_ENV, raising=False)
    RecorderProbes().close()  # compiled once: the loads below come from the cache
    assert len(list((tmp_path / "probes").glob("*.json"))) == 1
    received: list[float] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: received.append(time.monotonic()))
    loader = threading.get_ident()
    started, done = threading.Event(), threading.Event()

    def interrupt() -> None:
        started.wait()
        for _ in range(8):
            time.sleep(0.01)
            if done.is_set():
                return
            signal.pthread_kill(loader, signal.SIGUSR1)

    sender = threading.Thread(target=interrupt)
    sender.start()
    try:
        started.set()
        try:
            probes = RecorderProbes()
        finally:
            loaded = time.monotonic()
            done.set()
        try:
            assert ["/bin/echo", "signalled"] in _execs_seen(probes, "signalled")
        finally:
            probes.close()
    finally:
        sender.join()
        signal.signal(signal.SIGUSR1, old)
    assert sum(1 for t in received if t < loaded) >= 4  # signalled while it loaded
    assert len(list((tmp_path / "probes").glob("*.json"))) == 1
