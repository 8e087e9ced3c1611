"""The exec supervisor's per-exec timing (agent/recorder/exec_supervisor.py: RoundTrips): all execs
counted, the last `keep` kept for the median and p99, the line bench/bench.py reads."""

from __future__ import annotations

from evidence.agent.recorder.exec_supervisor import RoundTrips


def test_counts_all_keeps_the_last_and_summarises_them() -> None:
    rt = RoundTrips(keep=100)
    assert rt.summary() == {"count": 0} and rt.line() == "exec supervisor: no exec decided"
    for ns in range(1, 1001):  # 1..1000 ns; only 901..1000 kept
        rt.add(ns * 1000)
    s = rt.summary()
    assert s["count"] == 1000 and len(rt.recent) == 100
    assert s["median_us"] == 951 and s["p99_us"] == 1000 and s["max_us"] == 1000
    assert s["mean_us"] == 500.5
    assert rt.line() == (
        "exec supervisor: 1000 execs decided, notification read to response sent: median 951.0 us, "
        "p99 1000.0 us, "
        "mean 500.5 us, max 1000.0 us"
    )
