"""The transports' retries (client.grpc_h2: refused streams, the idle-close race; client.http1: the idle-close
race) reach each window, the merged summary and worker tallies as a count of their own, not as errors."""

from __future__ import annotations

import asyncio
import types

from client.engine import LoadRun, Measurement
from client.power import NoMeter
from client.stats import close, merge
from client.workers import merge_tallies


def test_transport_retries_are_counted_per_window_and_summed() -> None:
    async def go() -> None:
        conn = types.SimpleNamespace(retries=3)  # retries the connection made before this level
        run = LoadRun(conn, model="m", payloads=[], batch=1,  # type: ignore[arg-type]
                      meter=NoMeter("not measured here"), measurement=Measurement())
        conn.retries = 5
        first = run.swap()
        conn.retries = 6
        second = run.swap()
        assert (first.retries, second.retries) == (2, 1)
        assert merge_tallies([first, second]).retries == 3
        windows = [close(first, 0, 10**9, 1), close(second, 10**9, 2 * 10**9, 1)]
        assert [w.retries for w in windows] == [2, 1]
        assert merge(windows, 1).retries == 3 and merge(windows, 1).errors == {}

    asyncio.run(go())
