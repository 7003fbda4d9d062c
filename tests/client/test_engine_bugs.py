"""client.engine without a server: a request's failure is counted by kind, a bug of ours in the send path
is never a request's outcome, and it comes out of stop_drivers with its own type, closed loop and open."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from client.engine import LoadLevel, LoadRun, Measurement
from client.power import NoMeter
from client.protocol import Prepared
from tests.helpers.waiting import wait_until_async


class _BuggyConnection:
    """Answers every request but the one marked b"bug", on which our own code would raise a KeyError."""

    url = "fake:0"

    def __init__(self) -> None:
        self.sent = 0

    async def send(self, prepared: Prepared) -> None:
        self.sent += 1
        if prepared.body == b"bug":  # at once: no request with the bug is still in flight at stop
            raise KeyError("a bug of ours, not the server's")
        await asyncio.sleep(0.001)

    async def live(self) -> bool:
        return True


@pytest.mark.parametrize("level", [LoadLevel(concurrency=2), LoadLevel(request_rate=500.0)],
                         ids=["closed-loop", "open-loop"])
def test_a_bug_in_the_send_path_is_raised_at_stop_not_lost(level: LoadLevel) -> None:
    async def go() -> None:
        conn: Any = _BuggyConnection()
        payloads = [Prepared("m", b"fine"), Prepared("m", b"bug")]
        run = LoadRun(conn, model="m", payloads=payloads, batch=1, meter=NoMeter("not measured here"),
                      measurement=Measurement())
        drivers = run.start_drivers(level)
        # The buggy payload is every other request: sent once two were (a loaded machine's loop may take a
        # while to get there, an open loop that fell behind sending one per loop step).
        await wait_until_async(lambda: conn.sent >= 2, what="the buggy payload sent")
        with pytest.raises(KeyError, match="a bug of ours"):
            await run.stop_drivers(drivers)
        assert "KeyError" not in run.swap().errors  # never counted as a request's error kind

    asyncio.run(go())
