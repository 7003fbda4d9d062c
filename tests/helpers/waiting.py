"""Waiting in tests for a condition, polled, with a deadline: never a fixed sleep that a loaded machine
outruns (the test fails) or an idle one wastes (the test is slow)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], *, what: str, timeout_s: float = 60.0, interval_s: float = 0.01) -> T:
    """Poll `condition` until it returns a true value, and return that value; fail the test, saying `what`
    was awaited, after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not {what} within {timeout_s:g} s")
        time.sleep(interval_s)


async def wait_until_async(condition: Callable[[], T], *, what: str, timeout_s: float = 30.0,
                           interval_s: float = 0.002) -> T:
    """`wait_until` on an event loop: the loop runs (the condition's other tasks progress) between polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not {what} within {timeout_s:g} s")
        await asyncio.sleep(interval_s)
