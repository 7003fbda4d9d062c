"""The asynchronous load engine: closed loop (concurrency) and open loop (request rate), measured in
windows until perf_analyzer's stability rule holds.

Each request's scheduled time, send time, completion time and outcome is recorded rather than
raised; statistics come from those records afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from client.choices import Choice
from client.errors import PerfClientError
from client.power import Meter, PowerFigures, PowerSource, Reading, window_power
from client.protocol import Connection, Prepared, error_kind
from client.server_stats import ServerBreakdown, ServerStats, server_breakdown
from client.stats import Records, Window, is_stable, summarize
from client.validate import MISMATCH, outputs_match

log = logging.getLogger(__name__)

# How long a closed-loop worker waits after its request found the server unavailable: no spinning.
_BACKOFF_S = 0.01
# Limits on waits that would otherwise hang on a stalled server.
_WARMUP_LIMIT_S = 60.0
_REQUEST_COUNT_LIMIT_S = 600.0


class Distribution(Choice):
    """Open-loop inter-arrival times."""

    CONSTANT = "constant"
    POISSON = "poisson"


@dataclass(frozen=True)
class LoadLevel:
    """One load: `concurrency` requests in flight (closed loop) or `request_rate` per second (open loop)."""

    concurrency: int | None = None
    request_rate: float | None = None
    distribution: Distribution = Distribution.CONSTANT

    def __post_init__(self) -> None:
        # A plain string works too ("poisson"): the engine compares members.
        object.__setattr__(self, "distribution",
                           Distribution.parse(self.distribution, "--distribution", error=PerfClientError))
        self.check()

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return f"{self.request_rate:g} req/s ({self.distribution})"

    def check(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise PerfClientError("a load level needs exactly one of --concurrency and --request-rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise PerfClientError(f"--concurrency {self.concurrency}: expected a positive integer")
        if self.request_rate is not None and not self.request_rate > 0:
            raise PerfClientError(f"--request-rate {self.request_rate}: expected a positive rate")


@dataclass(frozen=True)
class Measurement:
    """How each load level is measured: perf_analyzer's windows and stability rule."""

    measurement_ms: int = 5000
    stability_percentage: float = 10.0
    max_trials: int = 10
    warmup_requests: int = 0
    request_count: int = 0  # > 0: a window closes after this many completed requests, not after a time

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        for flag, value, low in (("--measurement-interval", self.measurement_ms, 1),
                                 ("--max-trials", self.max_trials, 1), ("--warmup", self.warmup_requests, 0),
                                 ("--request-count", self.request_count, 0)):
            if value < low:
                raise PerfClientError(f"{flag} {value}: expected an integer >= {low}")
        if not 0 < self.stability_percentage <= 100:
            raise PerfClientError(f"--stability-percentage {self.stability_percentage}: expected 0 < P <= 100")


@dataclass(frozen=True)
class LevelResult:
    """One load level on one model.

    `summary` covers the last three windows (perf_analyzer's report), `server` and `power` the same
    interval. `complete` is False for a level cut short (the server stopped): its figures cover the
    windows measured before that.
    """

    level: LoadLevel
    windows: tuple[Window, ...]
    summary: Window
    stable: bool
    server: ServerBreakdown
    power: PowerFigures
    power_trace: tuple[tuple[float, float], ...] = ()  # (monotonic s, W) instant-power samples
    complete: bool = True


class ServerStopped(PerfClientError):
    """The server stopped answering during a level; `result` holds the windows measured before."""

    def __init__(self, message: str, result: LevelResult) -> None:
        super().__init__(message)
        self.result = result


WindowFn = Callable[[int, Window], None]  # (1-based window index, window) as each window closes

# One snapshot per window boundary: the server's counters and every meter's reading.
_Snapshot = tuple[ServerStats | None, list[Reading]]


class LoadRun:
    """Drives one load level on an open connection."""

    def __init__(self, conn: Connection, *, model: str, payloads: Sequence[Prepared], batch: int, meter: Meter,
                 measurement: Measurement, on_window: WindowFn | None = None,
                 cross_checks: Sequence[Meter] = ()) -> None:
        self.conn = conn
        self.model = model
        self.payloads = list(payloads)
        self.batch = batch
        self.meter = meter
        self.cross_checks = list(cross_checks)
        self.m = measurement
        self.on_window = on_window
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
            if request.expected is None:
                await self.conn.send(request)  # the load path: sent as bytes, the answer never decoded
            elif not outputs_match(await self.conn.infer(request), request.expected):
                error = MISMATCH
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every outcome is recorded, none raised
            error = error_kind(exc)
        self.records.add(scheduled, sent, time.monotonic_ns(), error)
        return error

    async def _closed_loop_worker(self) -> None:
        while not self._stop.is_set():
            if await self._send(time.monotonic_ns()) == "unavailable":
                await asyncio.sleep(_BACKOFF_S)

    async def _open_loop(self, rate: float, distribution: Distribution) -> None:
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
            next_t += rng.exponential(mean_ns) if distribution is Distribution.POISSON else mean_ns

    async def run(self, level: LoadLevel) -> LevelResult:
        """Measure `level`; ServerStopped (with what was measured) if the server stops answering."""
        if level.concurrency is not None:
            drivers = [asyncio.create_task(self._closed_loop_worker()) for _ in range(level.concurrency)]
        else:
            assert level.request_rate is not None  # LoadLevel holds exactly one of the two
            drivers = [asyncio.create_task(self._open_loop(level.request_rate, level.distribution))]
        trace = self.meter.trace
        trace_start = len(trace.samples) if trace is not None else 0
        windows: list[Window] = []
        snapshots: list[_Snapshot] = []
        stable, stopped = False, False
        try:
            await self._warm_up()
            snapshots.append(await self._snapshot())
            while len(windows) < self.m.max_trials:
                windows.append(await self._window(snapshots))
                log.debug("%s %s window %d: %d requests in %.2f s, errors %s", self.model, level.label,
                          len(windows), windows[-1].requests, windows[-1].seconds, windows[-1].errors or "none")
                if self.on_window:
                    self.on_window(len(windows), windows[-1])
                if windows[-1].requests == 0 and windows[-1].errors and not await self.conn.live():
                    stopped = True
                    break
                if is_stable(windows, self.m.stability_percentage):
                    stable = True
                    break
        finally:
            self._stop.set()
            for task in [*drivers, *self._tasks]:
                task.cancel()
            await asyncio.gather(*drivers, *self._tasks, return_exceptions=True)
        result = self._result(level, windows, snapshots, stable=stable, complete=not stopped,
                              power_trace=tuple(trace.samples[trace_start:]) if trace is not None else ())
        if stopped:
            raise ServerStopped(f"-u {self.conn.url}: the server stopped answering during {level.label}", result)
        return result

    async def _warm_up(self) -> None:
        deadline = time.monotonic() + _WARMUP_LIMIT_S
        while len(self.records) < self.m.warmup_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _snapshot(self) -> _Snapshot:
        return await self.conn.statistics(self.model), [self.meter.read(), *(m.read() for m in self.cross_checks)]

    def _power(self, before: list[Reading], after: list[Reading], inferences: int) -> PowerFigures:
        cross: list[tuple[PowerSource, Reading, Reading]] = [
            (m.source, b, a) for m, b, a in zip(self.cross_checks, before[1:], after[1:], strict=True)]
        return window_power(self.meter, before[0], after[0], inferences, cross)

    async def _window(self, snapshots: list[_Snapshot]) -> Window:
        start = time.monotonic_ns()
        first = len(self.records)
        if self.m.request_count > 0:
            limit = time.monotonic() + _REQUEST_COUNT_LIMIT_S
            while len(self.records) - first < self.m.request_count and time.monotonic() < limit:
                await asyncio.sleep(0.005)
        else:
            await asyncio.sleep(self.m.measurement_ms / 1000)
        end = time.monotonic_ns()
        snapshots.append(await self._snapshot())
        window = summarize(self.records, start, end, self.batch)
        (stats0, power0), (stats1, power1) = snapshots[-2], snapshots[-1]
        return dataclasses.replace(window, server=server_breakdown(stats0, stats1),
                                   power=self._power(power0, power1, window.inferences))

    def _result(self, level: LoadLevel, windows: list[Window], snapshots: list[_Snapshot], *, stable: bool,
                complete: bool, power_trace: tuple[tuple[float, float], ...]) -> LevelResult:
        # Like perf_analyzer, report the last three windows (the stable ones when stable).
        chosen = windows[-3:]
        first_index = len(windows) - len(chosen)
        summary = summarize(self.records, chosen[0].start_ns, chosen[-1].end_ns, self.batch)
        (stats0, power0), (stats1, power1) = snapshots[first_index], snapshots[-1]
        return LevelResult(level=level, windows=tuple(windows), summary=summary, stable=stable,
                           server=server_breakdown(stats0, stats1),
                           power=self._power(power0, power1, summary.inferences), power_trace=power_trace,
                           complete=complete)
