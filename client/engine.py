"""The asynchronous load engine: closed loop (concurrency) and open loop (request rate), measured in
windows until perf_analyzer's stability rule holds.

Each request's outcome is counted (never raised) in the open window's tally as it completes;
statistics are computed once per window from that tally (client.stats).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from client.errors import PerfClientError
from client.intervals import RequestIntervals
from client.power import Meter, PowerFigures, PowerSource, Reading, window_power
from client.protocol import TRANSPORT_ERRORS, Connection, Prepared, error_kind
from client.sequences import Sequences, Slot
from client.server_stats import ServerBreakdown, ServerStats, server_breakdown
from client.stats import Records, Tally, Window, close, is_stable, merge
from client.streaming import RESPONSE_ERROR, Stream
from client.validate import MISMATCH
from common.choices import Choice

log = logging.getLogger(__name__)

# After a failed request a worker waits, doubling from the first to the last figure while failures
# repeat (a dead or overloaded server is not hammered), and resets on success.
_BACKOFF_FIRST_S = 0.01
_BACKOFF_MAX_S = 0.5
# Limits on waits that would otherwise hang on a stalled server.
_WARMUP_LIMIT_S = 60.0
_REQUEST_COUNT_LIMIT_S = 600.0
# When a level ends, the requests in flight are left this long to finish before they are cancelled. A
# request cancelled in flight (gRPC: RST_STREAM) just as the server completes it crashes Triton 2.51's
# gRPC front end (SIGSEGV in ModelInferHandler::Process; upstream issues 7368/8034, fixed after 2.51):
# ending every level with cancellations brought the bundled server down mid-tune (docs/triton-crash.md).
DRAIN_S = 2.0
# Open loop: at most this many requests in flight unless --max-inflight says otherwise; a send due
# while the cap is reached is dropped and counted.
DEFAULT_MAX_INFLIGHT = 1024
# Error kinds that mean the server is gone (or going): windows that end a stopped level with them
# are left out of its summary.
_SERVER_GONE = frozenset({"unavailable", "unknown_model", "timeout", "cancelled"})


class Distribution(Choice):
    """Open-loop inter-arrival times."""

    CONSTANT = "constant"
    POISSON = "poisson"


@dataclass(frozen=True)
class LoadLevel:
    """One load: `concurrency` requests in flight (closed loop) or `request_rate` per second (open
    loop, at most `max_inflight` requests in flight: a send due beyond that is dropped and counted)."""

    concurrency: int | None = None
    request_rate: float | None = None
    distribution: Distribution = Distribution.CONSTANT
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    # --request-intervals: the file's gaps replace `distribution`; `request_rate` is their mean rate.
    intervals: RequestIntervals | None = None

    def __post_init__(self) -> None:
        # A plain string works too ("poisson"): the engine compares members.
        object.__setattr__(self, "distribution",
                           Distribution.parse(self.distribution, "--distribution", error=PerfClientError))
        self.check()

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        if self.intervals is not None:
            return f"{self.intervals} ({self.request_rate:g} req/s)"
        return f"{self.request_rate:g} req/s ({self.distribution})"

    def check(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise PerfClientError("a load level needs exactly one of --concurrency and --request-rate")
        if self.concurrency is not None and self.concurrency < 1:
            raise PerfClientError(f"--concurrency {self.concurrency}: expected a positive integer")
        if self.request_rate is not None and not self.request_rate > 0:
            raise PerfClientError(f"--request-rate {self.request_rate}: expected a positive rate")
        if self.max_inflight < 1:
            raise PerfClientError(f"--max-inflight {self.max_inflight}: expected a positive integer")


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

    `summary` merges the last three windows (perf_analyzer's report), `server` and `power` cover the
    same interval. A level cut short (`complete` False: the server stopped, Ctrl-C, the run's
    deadline; `stop_reason` says which) keeps the windows that completed before: its summary covers
    the last three of those, and it is never `stable`.
    """

    level: LoadLevel
    windows: tuple[Window, ...]
    summary: Window
    stable: bool
    server: ServerBreakdown
    power: PowerFigures
    power_trace: tuple[tuple[float, float], ...] = ()  # (monotonic s, W) instant-power samples
    complete: bool = True
    stop_reason: str | None = None

    @property
    def failed(self) -> bool:
        """No request completed successfully in the reported windows: a level to rank as failed, whatever
        its other figures (its latencies are None)."""
        return self.summary.requests == 0


class LevelStopped(PerfClientError):
    """A level ended before its measurement did; `result` holds the windows measured before (None when
    no window completed)."""

    def __init__(self, message: str, result: LevelResult | None) -> None:
        super().__init__(message)
        self.result = result


class ServerStopped(LevelStopped):
    """The server stopped answering during a level."""


class Interrupted(LevelStopped):
    """The run was stopped from outside (Ctrl-C, its deadline) during a level."""


class Abort:
    """A stop request from outside a level (a signal handler, a deadline timer), with its reason."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.event.set()

    @property
    def is_set(self) -> bool:
        return self.event.is_set()


class Together:
    """Levels measured at the same time on one loop (--simultaneous): a completion counter they share,
    and a hold that keeps every level's load on until the last of them is measured, so each one's
    windows see the others' load throughout."""

    def __init__(self) -> None:
        self.inferences = 0  # successful inferences of every level, as they complete
        self.release = asyncio.Event()

    async def hold_until_all_measured(self, abort: Abort) -> None:
        released = asyncio.create_task(self.release.wait())
        aborted = asyncio.create_task(abort.event.wait())
        try:
            await asyncio.wait({released, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            released.cancel()
            aborted.cancel()


class WorkerPool(Protocol):
    """Load generated in other processes (client.workers): started, warmed up, tallied, stopped."""

    async def start(self, level: LoadLevel) -> None: ...

    async def warm_up(self, requests: int, limit_s: float) -> None: ...

    async def swap(self) -> Tally: ...

    async def stop(self) -> None: ...


WindowFn = Callable[[int, Window], None]  # (1-based window index, window) as each window closes

# One snapshot per window boundary: the server's counters and every meter's reading.
_Snapshot = tuple[ServerStats | None, list[Reading]]


class LoadRun:
    """Drives one load level on an open connection.

    Requests add their outcome to the open window's Tally as they complete; at a boundary the tally is
    swapped for a new one and the server's counters and the meters are read: the meters in a worker
    thread, the counters asynchronously, so neither delays a send or a completion timestamp. Windows
    are contiguous: the next one starts at the instant the previous one ended, while those reads run.
    """

    def __init__(self, conn: Connection, *, model: str, payloads: Sequence[Prepared], batch: int, meter: Meter,
                 measurement: Measurement, on_window: WindowFn | None = None,
                 cross_checks: Sequence[Meter] = (), abort: Abort | None = None, keep_records: bool = False,
                 together: Together | None = None, pool: WorkerPool | None = None,
                 seed: np.random.SeedSequence | None = None, sequences: Sequences | None = None,
                 streaming: bool = False) -> None:
        """`pool`: worker processes generate the load instead of this loop (--processes); this loop
        only sets the window boundaries, reads the server and the meters, and merges their tallies.
        `seed`: this loop's Poisson arrivals (client.arrivals; None: seed 0).
        `sequences`: a sequence model's: every request is a step of a sequence (client.sequences), one
        sequence per concurrency slot (closed loop) or `num_sequences` taking the sends in turn (open loop);
        a sequence the level's end cuts short is ended by one more request, not counted.
        `streaming`: a decoupled model's: each closed-loop worker sends its requests on one ModelStreamInfer call
        (client.streaming); a request's latency runs to its final response, its response timings go to the
        tally's `stream`."""
        self.conn = conn
        self._retries_seen = getattr(conn, "retries", 0)
        self.model = model
        self.payloads = list(payloads)
        self.batch = batch
        self.meter = meter
        self.cross_checks = list(cross_checks)
        self.m = measurement
        self.on_window = on_window
        self.abort = abort if abort is not None else Abort()
        self.records: Records | None = Records() if keep_records else None
        self._tally = Tally()
        self._stop = asyncio.Event()
        self._enough = asyncio.Event()  # request-count windows: the open tally reached the count
        self._target = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._failed: asyncio.Task[None] | None = None  # the first open-loop send that died of a bug
        self._in_flight = 0  # requests sent and not yet answered (stop_drivers lets them finish)
        self._idle = asyncio.Event()  # set while none is in flight
        self._idle.set()
        self._count = 0
        self.together = together
        self.pool = pool
        self.seed = seed
        self.sequences = sequences
        self._slots: list[Slot] = []
        self.streaming = streaming
        if streaming and (pool is not None or sequences is not None):
            raise PerfClientError("--streaming: not with --processes nor a sequence model")
        if pool is not None and sequences is not None:
            raise PerfClientError("--processes: not with a sequence model (one loop holds its sequences)")
        if pool is not None and measurement.request_count > 0:
            raise PerfClientError("--processes: not with --request-count (windows are timed by the parent)")
        self.started = asyncio.Event()  # the first window opened
        self.measured = asyncio.Event()  # the last window closed (or the level stopped)

    def _done(self, scheduled: int, sent: int, error: str | None, end: int | None = None) -> None:
        """Count one completed request in the open window (same loop step as its timestamp: no race). `end`: when
        its latency ended, if before now (a streamed request's last answer, before the empty final response)."""
        done = time.monotonic_ns() if end is None else end
        tally = self._tally
        if error is None:
            tally.ok(done - scheduled)
            if self.together is not None:
                self.together.inferences += self.batch
        else:
            tally.failed(error)
        if self.records is not None:
            self.records.add(scheduled, sent, done, error)
        if self._target and tally.completed >= self._target:
            self._enough.set()

    async def _request(self, request: Prepared) -> str | None:
        """Send one request; its error kind, or None when it succeeded."""
        self._in_flight += 1
        self._idle.clear()
        try:
            return await self._send(request)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def _send(self, request: Prepared) -> str | None:
        try:
            check = request.expected  # --validate: compare this answer (or not: --validate-fraction)
            if check is None or not check.due():
                await self.conn.send(request)  # the load path: sent as bytes, the answer never decoded
            elif not check.matches(await self.conn.infer(request)):
                return MISMATCH
        except asyncio.CancelledError:
            raise
        except TRANSPORT_ERRORS as exc:  # a bug of ours is no request's outcome: it keeps its traceback
            return error_kind(exc)
        return None

    async def _closed_loop_worker(self, first: int) -> None:
        payloads, n, index, backoff = self.payloads, len(self.payloads), first, 0.0
        while not self._stop.is_set():
            request = payloads[index % n]
            index += 1
            sent = time.monotonic_ns()
            error = await self._request(request)
            self._done(sent, sent, error)
            if error is None or error == MISMATCH:  # the server answered: no back-off
                backoff = 0.0
            else:
                backoff = min(max(2 * backoff, _BACKOFF_FIRST_S), _BACKOFF_MAX_S)
                await asyncio.sleep(backoff)

    async def _stream_request(self, stream: Stream, message: bytes) -> tuple[str | None, int | None]:
        """One streamed request (counted in flight as `_request`'s): its error kind (None with its response
        timings in the open window's tally) and when its last answer came."""
        self._in_flight += 1
        self._idle.clear()
        try:
            timing = await stream.request(message)
        except asyncio.CancelledError:
            raise
        except TRANSPORT_ERRORS as exc:
            return error_kind(exc), None
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()
        if timing.error is None:
            self._tally.streamed(timing.first_ns, timing.gaps_ns, timing.responses)
        return timing.error, timing.last_ns

    async def _stream_worker(self, messages: list[bytes], first: int) -> None:
        """A closed-loop worker of a decoupled model: its requests one after another on one stream."""
        stream, n, index, backoff = self.conn.open_stream(), len(messages), first, 0.0
        try:
            while not self._stop.is_set():
                message = messages[index % n]
                index += 1
                sent = time.monotonic_ns()
                error, end = await self._stream_request(stream, message)
                self._done(sent, sent, error, end)
                backoff = _backoff(backoff, error)
                if backoff:
                    await asyncio.sleep(backoff)
        finally:
            await asyncio.shield(stream.aclose())

    async def _sequence_worker(self, slot: Slot, first: int) -> None:
        """A closed-loop worker of a sequence model: one sequence after another, each step after the last's answer."""
        payloads, n, index, backoff = self.payloads, len(self.payloads), first, 0.0
        while not self._stop.is_set():
            request = self.conn.flagged(payloads[index % n], slot.next())
            index += 1
            sent = time.monotonic_ns()
            error = await self._request(request)
            slot.finish(error is None or error == MISMATCH)
            self._done(sent, sent, error)
            if error is None or error == MISMATCH:
                backoff = 0.0
            else:
                backoff = min(max(2 * backoff, _BACKOFF_FIRST_S), _BACKOFF_MAX_S)
                await asyncio.sleep(backoff)

    async def _scheduled_send(self, scheduled: int, late_ns: float) -> None:
        request = self.payloads[self._count % len(self.payloads)]
        if self._slots:  # a sequence model: the next slot in turn, once its step in flight is answered
            slot = self._slots[self._count % len(self._slots)]
            self._count += 1
            async with slot.lock:
                if self._stop.is_set():  # the level ended while this send waited for its sequence: not sent
                    return
                error = await self._timed_send(self.conn.flagged(request, slot.next()), scheduled, late_ns)
                slot.finish(error is None or error == MISMATCH)
            return
        self._count += 1
        await self._timed_send(request, scheduled, late_ns)

    async def _timed_send(self, request: Prepared, scheduled: int, late_ns: float) -> str | None:
        sent = time.monotonic_ns()
        lag = sent - scheduled
        self._tally.lag(lag, late=lag >= late_ns)
        error = await self._request(request)
        self._done(scheduled, sent, error)
        return error

    async def _open_loop(self, level: LoadLevel, offset_ns: float = 0.0) -> None:
        assert level.request_rate is not None
        # Late: left a whole mean inter-arrival gap after its time, i.e. the client fell a send behind
        # its schedule (sub-millisecond event-loop jitter is not lateness; the lag is in the latency anyway).
        late_ns = 1e9 / level.request_rate
        start = float(time.monotonic_ns())
        for at in send_times_ns(level, self.seed, offset_ns):
            if self._stop.is_set():
                break
            next_t = start + at
            wait = (next_t - time.monotonic_ns()) / 1e9
            # Behind schedule: still yield, so the sends created run, windows close and signals are seen
            # (a rate above what one loop can schedule would otherwise never give the loop back).
            await asyncio.sleep(wait if wait > 0 else 0)
            if self._stop.is_set():  # the level ended while this send waited for its time: not sent
                break
            if len(self._tasks) >= level.max_inflight:
                self._tally.dropped += 1
            else:
                task = asyncio.create_task(self._scheduled_send(int(next_t), late_ns))
                self._tasks.add(task)
                task.add_done_callback(self._send_done)

    def _send_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        # A send that died of a bug of ours (its transport errors are counted inside): kept for stop_drivers
        # to raise, as a closed-loop worker's is, rather than logged at garbage collection and lost.
        if not task.cancelled() and task.exception() is not None and self._failed is None:
            self._failed = task

    def start_drivers(self, level: LoadLevel, *, offset_ns: float = 0.0) -> list[asyncio.Task[None]]:
        """The tasks that generate `level`'s load on this loop (`offset_ns` delays an open loop's schedule)."""
        if self.sequences is not None:
            live = self.sequences.options.live_sequences(level.concurrency)
            self.sequences.options.check_live(live, level.label)
            self._slots = self.sequences.slots(live)
        if self.streaming and level.concurrency is None:
            raise PerfClientError(f"--streaming: not with {level.label} (closed loop only: --concurrency)")
        if level.concurrency is not None:
            step = max(len(self.payloads) // level.concurrency, 1)  # workers start on different payloads
            if self.streaming:
                messages = [self.conn.stream_message(p) for p in self.payloads]  # each built once, for every worker
                return [asyncio.create_task(self._stream_worker(messages, i * step)) for i in range(level.concurrency)]
            if self._slots:
                return [asyncio.create_task(self._sequence_worker(slot, i * step))
                        for i, slot in enumerate(self._slots)]
            return [asyncio.create_task(self._closed_loop_worker(i * step)) for i in range(level.concurrency)]
        return [asyncio.create_task(self._open_loop(level, offset_ns))]

    async def _end_sequences(self, limit_s: float) -> None:
        """End every sequence the level's end cut short, with one request each (in no window; an error is
        only logged: the server drops an idle sequence after its max_sequence_idle_microseconds anyway)."""
        live = [slot for slot in self._slots if slot.live]
        if not live:
            return

        async def end(slot: Slot) -> None:
            try:
                await self.conn.send(self.conn.flagged(self.payloads[0], slot.closing()))
            except TRANSPORT_ERRORS as exc:
                log.debug("%s: ending sequence %s: %s", self.model, slot.sequence_id, error_kind(exc))
            slot.done()

        try:
            await asyncio.wait_for(asyncio.gather(*(end(slot) for slot in live)), limit_s)
        except asyncio.TimeoutError:
            log.debug("%s: %d sequences not ended within %.1f s", self.model, len(live), limit_s)

    @property
    def completed_so_far(self) -> int:
        """Requests completed in the open window (warm-up included before the first)."""
        return self._tally.completed

    def swap(self) -> Tally:
        """The open window's tally, replaced by a fresh one (synchronous: no completion slips in between)."""
        tally, self._tally = self._tally, Tally()
        # The transport's retries since the last swap (fakes in tests may have none to count).
        retries = getattr(self.conn, "retries", 0)
        tally.retries, self._retries_seen = retries - self._retries_seen, retries
        return tally

    async def stop_drivers(self, drivers: list[asyncio.Task[None]], drain_s: float | None = None) -> None:
        """Stop the load: no request is sent after this; those in flight are left up to `drain_s` (DRAIN_S)
        to be answered (their outcomes fall in no window: the last one was taken), and only then cancelled."""
        self._stop.set()
        drain_s = DRAIN_S if drain_s is None else drain_s
        if self._in_flight and drain_s > 0:
            try:
                await asyncio.wait_for(self._idle.wait(), drain_s)
            except asyncio.TimeoutError:
                log.debug("%s: %d requests still in flight %.1f s after the level ended: cancelled", self.model,
                          self._in_flight, drain_s)
        for task in [*drivers, *self._tasks]:
            task.cancel()
        outcomes = await asyncio.gather(*drivers, *self._tasks, return_exceptions=True)
        await self._end_sequences(max(drain_s, DRAIN_S))
        if self._failed is not None:
            outcomes.insert(0, self._failed.exception())
        for outcome in outcomes:
            if isinstance(outcome, Exception):  # a driver died of a bug (CancelledError is no Exception)
                raise outcome

    async def run(self, level: LoadLevel) -> LevelResult:
        """Measure `level`; LevelStopped (with what was measured) if the server stops or the run is aborted."""
        drivers = self.start_drivers(level) if self.pool is None else []
        trace = self.meter.trace
        trace_start = len(trace.samples) if trace is not None else 0
        windows: list[Window] = []
        snapshots: list[asyncio.Task[_Snapshot]] = []
        stable, stop_reason = False, None
        try:
            if self.pool is not None:
                await self.pool.start(level)  # inside: workers that did start are stopped whatever happens
            await self._warm_up()
            start = self._boundary(snapshots)
            await self._take_tally()  # warm-up requests are in no window
            self.started.set()
            while len(windows) < self.m.max_trials and stop_reason is None:
                aborted = await self._wait_window(start)
                end = self._boundary(snapshots)
                tally = await self._take_tally()
                if aborted:  # the open window is incomplete: left out
                    stop_reason = self.abort.reason
                    break
                window = close(tally, start, end, self.batch)
                (stats0, power0), (stats1, power1) = await snapshots[-2], await snapshots[-1]
                window = dataclasses.replace(window, server=server_breakdown(stats0, stats1),
                                             power=self._power(power0, power1, window.inferences))
                windows.append(window)
                log.debug("%s %s window %d: %d requests in %.2f s, errors %s", self.model, level.label,
                          len(windows), window.requests, window.seconds, window.errors or "none")
                if self.on_window:
                    self.on_window(len(windows), window)
                if window.requests == 0 and window.errors and not await self.conn.live():
                    stop_reason = f"-u {self.conn.url}: the server stopped answering during {level.label}"
                elif is_stable(windows, self.m.stability_percentage):
                    stable = True
                    break
                start = end
            self.measured.set()
            if self.together is not None and stop_reason is None:
                await self.together.hold_until_all_measured(self.abort)
        finally:
            self.started.set()  # also when the level ended before its first window: nobody waits forever
            self.measured.set()
            await self.stop_drivers(drivers)
            if self.pool is not None:
                await self.pool.stop()
        power_trace = tuple(trace.samples[trace_start:]) if trace is not None else ()
        if stop_reason is None:
            return await self._result(level, windows, snapshots, stable=stable, power_trace=power_trace)
        for unused in snapshots[len(windows) + 1:]:
            unused.cancel()  # the aborted window's end reading
        if self.abort.is_set:
            kept = windows
        else:
            answered = [(await snapshots[i + 1])[0] is not None for i in range(len(windows))]
            kept = _completed_windows(windows, answered)
        result = (await self._result(level, kept, snapshots, stable=False, power_trace=power_trace,
                                     stop_reason=stop_reason) if kept else None)
        if self.abort.is_set:
            raise Interrupted(f"{stop_reason} during {self.model} {level.label}", result)
        raise ServerStopped(stop_reason, result)

    def _boundary(self, snapshots: list[asyncio.Task[_Snapshot]]) -> int:
        """A window boundary now: start the reads at this instant (they finish in the background)."""
        now = time.monotonic_ns()
        snapshots.append(asyncio.create_task(self._snapshot()))
        return now

    async def _wait_window(self, start: int) -> bool:
        """Until the window starting at `start` closes; True if the run was aborted meanwhile."""
        aborted = asyncio.create_task(self.abort.event.wait())
        try:
            if self.m.request_count > 0:
                self._enough.clear()
                self._target = self.m.request_count
                if self._tally.completed >= self._target:
                    self._enough.set()
                enough = asyncio.create_task(self._enough.wait())
                await asyncio.wait({aborted, enough}, timeout=_REQUEST_COUNT_LIMIT_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                enough.cancel()
            else:
                end_ns = start + self.m.measurement_ms * 1_000_000
                # The loop's timer may fire up to its clock resolution (1 ms) early: wait out the rest, so a
                # window lasts at least --measurement-interval.
                while (remaining := (end_ns - time.monotonic_ns()) / 1e9) > 0 and not aborted.done():
                    await asyncio.wait({aborted}, timeout=remaining)
            return self.abort.is_set
        finally:
            aborted.cancel()

    async def _take_tally(self) -> Tally:
        """The tally of the window that just closed: this loop's own, or every worker process's merged."""
        if self.pool is None:
            return self.swap()  # no await since the boundary: nothing slipped in between
        return await self.pool.swap()

    async def _warm_up(self) -> None:
        if self.pool is not None:
            await self.pool.warm_up(self.m.warmup_requests, _WARMUP_LIMIT_S)
            return
        deadline = time.monotonic() + _WARMUP_LIMIT_S
        while (self._tally.completed < self.m.warmup_requests and time.monotonic() < deadline
               and not self.abort.is_set):
            await asyncio.sleep(0.01)

    def _read_meters(self) -> list[Reading]:
        """Every meter at this instant (runs in a worker thread: a meter may block on I/O)."""
        readings = []
        for meter in (self.meter, *self.cross_checks):
            try:
                readings.append(meter.read())
            except Exception as exc:  # noqa: BLE001 - a failed read leaves this window's energy None
                log.debug("%s reading failed: %s", meter.source, exc)
                readings.append(Reading(time.monotonic(), None))
        return readings

    async def _snapshot(self) -> _Snapshot:
        if self.meter.source is PowerSource.NONE and not self.cross_checks:
            return await self.conn.statistics(self.model), self._read_meters()
        stats, readings = await asyncio.gather(self.conn.statistics(self.model), asyncio.to_thread(self._read_meters))
        return stats, readings

    def _power(self, before: list[Reading], after: list[Reading], inferences: int) -> PowerFigures:
        cross: list[tuple[PowerSource, Reading, Reading]] = [
            (m.source, b, a) for m, b, a in zip(self.cross_checks, before[1:], after[1:], strict=True)]
        return window_power(self.meter, before[0], after[0], inferences, cross)

    async def _result(self, level: LoadLevel, windows: list[Window], snapshots: list[asyncio.Task[_Snapshot]], *,
                      stable: bool, power_trace: tuple[tuple[float, float], ...],
                      stop_reason: str | None = None) -> LevelResult:
        # Like perf_analyzer, report the last three windows merged (the stable ones when stable).
        chosen = windows[-3:]
        first = len(windows) - len(chosen)
        summary = merge(chosen, self.batch)
        stats0, power0 = await snapshots[first]
        stats1, power1 = await snapshots[len(windows)]
        return LevelResult(level=level, windows=tuple(windows), summary=summary, stable=stable,
                           server=server_breakdown(stats0, stats1),
                           power=self._power(power0, power1, summary.inferences), power_trace=power_trace,
                           complete=stop_reason is None, stop_reason=stop_reason)


def send_times_ns(level: LoadLevel, seed: np.random.SeedSequence | int | None,
                  offset_ns: float = 0.0) -> Iterator[float]:
    """Each open-loop send's time in ns after the level's start, without end.

    Constant: `offset_ns`, then one mean gap apart. Poisson: exponential gaps drawn from `seed` (None: 0),
    the first one before the first send too, so the stream is Poisson from time 0 and streams merged from
    independent seeds are one Poisson stream at the summed rate. --request-intervals: the file's gaps,
    repeated, from `offset_ns`.
    """
    assert level.request_rate is not None  # LoadLevel holds exactly one of the two
    t = float(offset_ns)
    if level.intervals is not None:
        for gap in level.intervals.gaps_ns():  # repeats without end
            yield t
            t += gap
    mean_ns = 1e9 / level.request_rate
    if level.distribution is Distribution.POISSON:
        rng = np.random.default_rng(seed if seed is not None else 0)
        while True:
            for gap in rng.exponential(mean_ns, size=256):  # in blocks: the same numbers as drawn one by one
                t += float(gap)
                yield t
    while True:
        yield t
        t += mean_ns


def _backoff(previous: float, error: str | None) -> float:
    """The wait after a request: none when the server answered (OK, a mismatch, an error response), else
    doubling from _BACKOFF_FIRST_S up to _BACKOFF_MAX_S while failures repeat."""
    if error is None or error in (MISMATCH, RESPONSE_ERROR):
        return 0.0
    return min(max(2 * previous, _BACKOFF_FIRST_S), _BACKOFF_MAX_S)


def _completed_windows(windows: list[Window], answered: list[bool]) -> list[Window]:
    """A stopped level's windows without the trailing ones the server's end spoiled: no success, errors
    that say the server was gone, or a server that no longer answered for its counters at their end."""
    kept = len(windows)
    while kept and (windows[kept - 1].requests == 0 or _SERVER_GONE & windows[kept - 1].errors.keys()
                    or not answered[kept - 1]):
        kept -= 1
    return windows[:kept]
