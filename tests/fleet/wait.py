"""Waiting in the fleet's tests (and bench/fleet.py): a condition polled at a pace until it holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def until(
    check: Callable[[], T], timeout: float = 30.0, what: str | Callable[[], str] = "", pace: float = 0.05
) -> T:
    """The first value of `check()` that is true, polled every `pace` seconds; AssertionError after
    `timeout` seconds, saying `what` (a callable: made then, e.g. with the agent's log)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() >= deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out waiting for {said or check}")
        time.sleep(pace)
