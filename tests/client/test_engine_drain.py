"""A level ends without cancelling the requests in flight: they are left to be answered (client.engine.DRAIN_S).

A gRPC request cancelled in flight just as Triton 2.51 completes it crashes the server (SIGSEGV in its gRPC
front end, docs/triton-crash.md); perfclient used to cancel every request in flight at the end of each
level, and so brought the bundled server down now and then mid-tune (bench/triton_crash_repro.py --levels
reproduces that in about a minute with the drain set to 0)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from client.engine import Distribution, LoadLevel, LoadRun, Measurement
from client.inputs import InputData, build_payloads
from client.power import NoMeter
from client.protocol import Connection, Prepared, Protocol
from tests.helpers.servers import Endpoints
from tests.helpers.waiting import wait_until_async

MODEL = "mlp_fp32"


async def _recorded_and_served(url: str, concurrency: int) -> tuple[int, int]:
    """One short level: the requests the client recorded an outcome for, and those the server completed."""
    async with await Connection.open(Protocol.GRPC, url) as conn:
        meta = await conn.model(MODEL)
        payloads = [await conn.prepare(MODEL, arrays) for arrays in build_payloads(meta, 1, InputData(), {})]
        before = await conn.statistics(MODEL)
        assert before is not None
        run = LoadRun(conn, model=MODEL, payloads=payloads, batch=1, meter=NoMeter("not measured here"),
                      measurement=Measurement(measurement_ms=100, max_trials=1, warmup_requests=5),
                      keep_records=True)
        await run.run(LoadLevel(concurrency=concurrency))
        assert run.records is not None
        recorded = len(run.records.done)
        # The server counts a request once it has run it; poll until it has counted as many as were recorded
        # (a cancelled request it ran anyway counts there and nowhere here, so it would only add).
        deadline = time.monotonic() + 30
        while True:
            after = await conn.statistics(MODEL)
            assert after is not None
            served = after.success_count - before.success_count
            if served >= recorded or time.monotonic() > deadline:
                return recorded, served
            await asyncio.sleep(0.05)


def test_the_requests_in_flight_when_a_level_ends_are_answered_not_cancelled(endpoints: Endpoints) -> None:
    recorded, served = asyncio.run(_recorded_and_served(endpoints.grpc, concurrency=8))
    # Each request the server completed has its outcome recorded: none was abandoned (cancelled) at the end.
    assert recorded == served, (recorded, served)


class _SlowConnection:
    """Answers every request after `latency_s`, noting when each was sent and whether any was cancelled."""

    url = "fake:0"

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.sent: list[float] = []
        self.cancelled = 0

    async def send(self, prepared: Prepared) -> None:
        self.sent.append(time.monotonic())
        try:
            await asyncio.sleep(self.latency_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def live(self) -> bool:
        return True


def test_an_open_loop_sends_nothing_once_the_level_has_ended() -> None:
    """The open loop's next send falls due while the drain waits for the requests in flight: it is not sent
    (a request sent then would be cancelled in flight at the drain's end, the trigger of the crash)."""

    async def go() -> tuple[list[float], float, int]:
        # In flight 0.3 s; a send due every 10 ms, so several fall due during the drain.
        conn: Any = _SlowConnection(0.3)
        run = LoadRun(conn, model="m", payloads=[Prepared("m", b"x")], batch=1, meter=NoMeter("not measured"),
                      measurement=Measurement())
        drivers = run.start_drivers(LoadLevel(request_rate=100.0, distribution=Distribution.CONSTANT))
        await wait_until_async(lambda: len(conn.sent) >= 3, what="three requests sent")
        stopped = time.monotonic()
        await run.stop_drivers(drivers)
        return conn.sent, stopped, conn.cancelled

    sent, stopped, cancelled = asyncio.run(go())
    assert [t for t in sent if t > stopped] == []
    assert cancelled == 0
