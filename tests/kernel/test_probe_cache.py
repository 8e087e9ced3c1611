"""The probes loaded from the compiled-probe cache record exactly what freshly compiled ones do: a
cold start compiles and stores, a warm one compiles nothing, and both see the same exec of a job
run as nobody; an entry the kernel refuses is dropped so that the next start compiles afresh."""

from __future__ import annotations

import ctypes
import os
import subprocess
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
        # every map reads as BCC's own table class would: key and value types of the kernel's sizes
        for m in warm.bpf._obj.maps:
            if m.type == 27:  # the ring buffer: no keys nor values
                continue
            t = warm.bpf[m.name.encode()]
            assert ctypes.sizeof(t.Key) == m.key_size, m
            assert ctypes.sizeof(getattr(t, "sLeaf", t.Leaf)) == m.value_size, m
        from bcc.utils import get_possible_cpus  # here: collecting the tests needs no BCC

        counters = warm.bpf[b"wake_ctr"][ctypes.c_int(0)]  # a per-CPU array: one value per CPU
        assert len(counters) == len(get_possible_cpus())
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
