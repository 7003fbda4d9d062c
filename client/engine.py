"""The asynchronous load engine: closed loop (concurrency) and open loop (request rate), measured in
windows until perf_analyzer's stability rule holds.

Each request's scheduled time, send time, completion time and outcome is recorded rather than
raised; statistics come from those records afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from client.errors import PerfClientError, RunAborted
from client.power import Meter, Reading, window_power
from client.protocol import Connection, Prepared, ServerStats, error_kind
from client.stats import Records, Window, is_stable, server_breakdown, summarize

log = logging.getLogger(__name__)

DISTRIBUTIONS = ("constant", "poisson")


@dataclass(frozen=True)
class LoadLevel:
    concurrency: int | None = None
    request_rate: float | None = None
    distribution: str = "constant"

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return f"{self.request_rate:g} req/s ({self.distribution})"


@dataclass(frozen=True)
class Measurement:
    measurement_ms: int = 5000
    stability_percentage: float = 10.0
    max_trials: int = 10
    warmup_requests: int = 0
    request_count: int = 0  # > 0: a window closes after this many completed requests, not after a time


@dataclass
class LevelResult:
    level: LoadLevel
    windows: list[Window] = field(default_factory=list)
    summary: Window | None = None
    stable: bool = False
    server: dict[str, float] = field(default_factory=dict)
    power: dict[str, object] = field(default_factory=dict)
    power_trace: list[tuple[float, float]] = field(default_factory=list)


ProgressFn = Callable[[LoadLevel, int, Window], None]


class LoadRun:
    """Drives one load level on an open connection."""

    def __init__(self, conn: Connection, model: str, payloads: list[Prepared], batch: int,
                 meter: Meter, measurement: Measurement, progress: ProgressFn | None = None,
                 cross_checks: list[Meter] | None = None) -> None:
        self.conn = conn
        self.model = model
        self.payloads = payloads
        self.batch = batch
        self.meter = meter
        self.cross_checks = cross_checks or []
        self.m = measurement
        self.progress = progress
        self.records = Records()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[str | None]] = set()
        self._count = 0

    async def _send(self, scheduled: int) -> str | None:
        request = self.payloads[self._count % len(self.payloads)]
        self._count += 1
        sent = time.monotonic_ns()
        error = None
        try:
            await self.conn.send(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every outcome is recorded, none raised
            error = error_kind(exc)
        self.records.add(scheduled, sent, time.monotonic_ns(), error)
        return error

    async def _closed_loop_worker(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic_ns()
            if await self._send(now) == "unavailable":
                await asyncio.sleep(0.01)  # do not spin on a dead server

    async def _open_loop(self, rate: float, distribution: str) -> None:
        rng = np.random.default_rng(0)
        mean_ns = 1e9 / rate
        next_t = float(time.monotonic_ns())
        while not self._stop.is_set():
            wait = (next_t - time.monotonic_ns()) / 1e9
            if wait > 0:
                await asyncio.sleep(wait)
            task = asyncio.create_task(self._send(int(next_t)))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            next_t += rng.exponential(mean_ns) if distribution == "poisson" else mean_ns

    async def run(self, level: LoadLevel) -> LevelResult:
        result = LevelResult(level)
        if level.concurrency is not None:
            drivers = [asyncio.create_task(self._closed_loop_worker()) for _ in range(level.concurrency)]
        else:
            assert level.request_rate is not None
            drivers = [asyncio.create_task(self._open_loop(level.request_rate, level.distribution))]
        trace = getattr(self.meter, "trace", None)
        trace_start = len(trace.samples) if trace is not None else 0
        try:
            await self._warm_up()
            snapshots: list[tuple[ServerStats, list[Reading]]] = [
                (await self.conn.statistics(self.model), self._read_meters())
            ]
            while len(result.windows) < self.m.max_trials:
                window = await self._window(snapshots)
                result.windows.append(window)
                if self.progress:
                    self.progress(level, len(result.windows), window)
                if window.requests == 0 and window.errors and not await self.conn.live():
                    raise RunAborted(f"-u {self.conn.url}: the server stopped answering during {level.label}",
                                     [result])
                if is_stable(result.windows, self.m.stability_percentage):
                    result.stable = True
                    break
            self._finish(result, snapshots)
        finally:
            self._stop.set()
            for task in [*drivers, *self._tasks]:
                task.cancel()
            await asyncio.gather(*drivers, *self._tasks, return_exceptions=True)
            if trace is not None:
                result.power_trace = list(trace.samples[trace_start:])
        return result

    async def _warm_up(self) -> None:
        deadline = time.monotonic() + 60
        while len(self.records) < self.m.warmup_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def _read_meters(self) -> list[Reading]:
        return [self.meter.read(), *(m.read() for m in self.cross_checks)]

    def _power(self, before: list[Reading], after: list[Reading], inferences: int) -> dict[str, object]:
        cross = [(m.source, b, a) for m, b, a in zip(self.cross_checks, before[1:], after[1:], strict=True)]
        return window_power(self.meter, before[0], after[0], inferences, cross)

    async def _window(self, snapshots: list[tuple[ServerStats, list[Reading]]]) -> Window:
        start = time.monotonic_ns()
        first = len(self.records)
        if self.m.request_count > 0:
            limit = time.monotonic() + 600
            while len(self.records) - first < self.m.request_count and time.monotonic() < limit:
                await asyncio.sleep(0.005)
        else:
            await asyncio.sleep(self.m.measurement_ms / 1000)
        end = time.monotonic_ns()
        snapshots.append((await self.conn.statistics(self.model), self._read_meters()))
        window = summarize(self.records, start, end, self.batch)
        (stats0, power0), (stats1, power1) = snapshots[-2], snapshots[-1]
        return Window(**{**window.__dict__,
                         "server": server_breakdown(stats0, stats1),
                         "power": self._power(power0, power1, window.inferences)})

    def _finish(self, result: LevelResult, snapshots: list[tuple[ServerStats, list[Reading]]]) -> None:
        # Like perf_analyzer, report the last three windows (the stable ones when stable).
        chosen = result.windows[-3:]
        first_index = len(result.windows) - len(chosen)
        summary = summarize(self.records, chosen[0].start_ns, chosen[-1].end_ns, self.batch)
        (stats0, power0), (stats1, power1) = snapshots[first_index], snapshots[-1]
        result.server = server_breakdown(stats0, stats1)
        result.power = self._power(power0, power1, summary.inferences)
        result.summary = summary


def validate_levels(levels: list[LoadLevel]) -> None:
    for level in levels:
        if level.concurrency is not None and level.concurrency < 1:
            raise PerfClientError(f"--concurrency {level.concurrency}: expected a positive integer")
        if level.request_rate is not None and level.request_rate <= 0:
            raise PerfClientError(f"--request-rate {level.request_rate}: expected a positive rate")
        if level.distribution not in DISTRIBUTIONS:
            raise PerfClientError(f"--distribution {level.distribution!r}: expected one of {', '.join(DISTRIBUTIONS)}")
