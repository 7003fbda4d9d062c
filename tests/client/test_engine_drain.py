"""A level ends without cancelling the requests in flight: they are left to be answered (client.engine.DRAIN_S).

A gRPC request cancelled in flight just as Triton 2.51 completes it crashes the server (SIGSEGV in its gRPC
front end, docs/triton-crash.md); perfclient used to cancel every request in flight at the end of each
level, and so brought the bundled server down now and then mid-tune (bench/triton_crash_repro.py --levels
reproduces that in about a minute with the drain set to 0)."""

from __future__ import annotations

import asyncio
import time

from client.engine import LoadLevel, LoadRun, Measurement
from client.inputs import InputData, build_payloads
from client.power import NoMeter
from client.protocol import Connection, Protocol
from tests.helpers.servers import Endpoints

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
