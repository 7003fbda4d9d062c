"""Measuring a point on a target through perfclient's session API; a point that fails is recorded with
its reason, and a private server that dies meanwhile is started again once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from builder.errors import ServerError
from builder.repository.model_folder import load_shapes
from builder.tuning.control import Rejected
from builder.tuning.energy import power_source
from builder.tuning.points import Point, Result
from builder.tuning.targets import LocalTarget, RemoteTarget, ServerDied, Target
from client import session
from client.engine import LoadLevel, Measurement
from client.errors import PerfClientError
from client.session import ModelResult
from common import progress

log = logging.getLogger(__name__)


class Tuner:
    """Measures points on a target; a point that fails is recorded with its reason, not raised."""

    def __init__(self, target: Target, concurrencies: Sequence[int], *, measurement_ms: int = 3000,
                 max_trials: int = 6, point_timeout_s: float | None = None,
                 shapes: Mapping[str, Mapping[str, tuple[int, ...]]] | None = None,
                 gpus: tuple[str, ...] | None = None) -> None:
        """`gpus`: the GPUs whose energy counts (--gpus); None: perfclient's choice (the variant's instance
        groups, else CUDA_VISIBLE_DEVICES, else every GPU)."""
        self.target = target
        self.gpus = gpus
        # By variant: the shapes its requests take where config.pbtxt leaves dims free (load_shapes).
        self.shapes = dict(shapes or {})
        self.concurrencies = list(concurrencies)
        self.measurement = Measurement(measurement_ms=measurement_ms, max_trials=max_trials, warmup_requests=20)
        # Warm-up (at most a minute in perfclient), the windows, and slack, for each concurrency.
        self.point_timeout_s = point_timeout_s or len(self.concurrencies) * (
            60 + max_trials * measurement_ms / 1000 + 15) + 30
        self.count = 0
        self.power_source = power_source(target.endpoints if isinstance(target, RemoteTarget) else None)
        self.failures: dict[Point, str] = {}
        self.measured: dict[Point, list[Result]] = {}  # what the search measured (a run cut short reports it)
        self.search_bar: progress.Task | None = None  # the search's progress: a step per point
        # By point: a note for each time the private server died while measuring it and was restarted.
        self.restarts: dict[Point, list[str]] = {}

    def measure(self, point: Point) -> list[Result]:
        self.measured[point] = self.remeasure(point)
        if self.search_bar is not None:
            self.search_bar.advance(status=point.label())
        return self.measured[point]

    def _check_alive(self, point: Point, stage: str, wait_s: float = 0.0) -> None:
        """Raise ServerDied when the target's own server has exited (asked of the process, not the network:
        a dead server's stubs keep its sockets open, so a request would wait out its timeout)."""
        how = self.target.died(wait_s)
        if how is not None:
            raise ServerDied(point.label(), how=how, stage=stage, where=self.target.where())

    def _failed(self, point: Point, reason: str) -> list[Result]:
        # A failure because the server died (or is dying: it stopped answering) is no failure of the point.
        self._check_alive(point, "measuring")
        if not self.target.http.live():
            self._check_alive(point, "measuring", wait_s=10.0)
            self.failures[point] = reason
            log.warning("tune: %s failed: %s", point.label(), reason)
            raise ServerError(f"tune: the server stopped answering after {point.label()} ({reason}); "
                              f"see {self.target.where()}")
        self.failures[point] = reason
        log.warning("tune: %s failed: %s", point.label(), reason)
        return []

    def remeasure(self, point: Point) -> list[Result]:
        """Measure `point` (again) without recording it as a point of the search. When the private server
        dies meanwhile (a crash inside tritonserver, any signal), it is started again and the point measured
        once more; a second death ends the run (ServerDied)."""
        self.count += 1
        try:
            return self._measure_once(point)
        except ServerDied as died:
            if self.target.died() is None:  # attach mode never restarts (died() is None there)
                raise
            note = (f"the tuning server {died.how} while {died.stage} it; restarted the server and measured "
                    "the point again")
            log.warning("tune: %s: %s (%s)", point.label(), note, self.target.where())
            self.restarts.setdefault(point, []).append(note)
            self.failures.pop(point, None)
            self.target.restart()
        return self._measure_once(point)

    async def _watched(self, point: Point, measurement: Coroutine[Any, Any, list[ModelResult]]
                       ) -> list[ModelResult]:
        """The measurement, cancelled when the target's server dies (its requests would hang on the sockets
        the stubs keep open until the point's timeout) or when the point's time is up."""
        task = asyncio.ensure_future(measurement)
        deadline = time.monotonic() + self.point_timeout_s
        while not task.done():
            await asyncio.wait({task}, timeout=0.2)
            if task.done():
                break
            if self.target.died() is not None or time.monotonic() > deadline:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, PerfClientError):
                    await task
                self._check_alive(point, "measuring")
                raise asyncio.TimeoutError
        return task.result()

    def _measure_once(self, point: Point) -> list[Result]:
        try:
            self.target.load(point)
        except Rejected as exc:
            return self._failed(point, f"did not load: {exc}")
        endpoints = self.target.endpoints
        config = session.SessionConfig(
            models=(point.variant,), url=endpoints.grpc,
            levels=tuple(LoadLevel(concurrency=c) for c in self.concurrencies), measurement=self.measurement,
            metrics_url=endpoints.metrics, power_source=self.power_source,
            shapes=self.shapes.get(point.variant, {}), gpus=self.gpus,
        )
        try:
            # perfclient's windows show inside it, one bar per concurrency.
            with progress.task(f"measuring {point.label()}"):
                rows = asyncio.run(self._watched(point, session.measure(config)))
        except asyncio.TimeoutError:
            return self._failed(point, f"timed out after {self.point_timeout_s:.0f} s")
        except PerfClientError as exc:
            return self._failed(point, f"measurement failed: {exc}")
        finally:
            if self.target.died() is None:  # a dead server has nothing to unload (and would not answer)
                with contextlib.suppress(Rejected):  # a model that is already gone needs no unloading
                    self.target.unload(point.variant)
        self._check_alive(point, "measuring")  # requests that failed because it died are not the point's
        results = []
        for concurrency, row in zip(self.concurrencies, rows, strict=True):
            summary = row.result.summary
            results.append(Result(
                point=point, concurrency=concurrency, throughput=summary.throughput,
                p50_us=summary.latency_us.p50 if summary.latency_us else None,
                p99_us=summary.latency_us.p99 if summary.latency_us else None,
                infer_per_joule=row.result.power.infer_per_j, avg_batch=row.result.server.avg_batch,
                stable=row.result.stable, errors=sum(summary.errors.values()),
            ))
        log.debug("tune: %s -> %s", point.label(), ", ".join(
            f"c={r.concurrency} {r.throughput:.1f}/s p99 "
            + (f"{r.p99_us / 1e3:.1f} ms" if r.p99_us is not None else "-") for r in results))
        # perfclient says when no request completed at a level (LevelResult.failed); such a level has no
        # latencies, and a zero or missing p99 must not pass for a fast one.
        idle = [c for c, row, r in zip(self.concurrencies, rows, results, strict=True)
                if row.result.failed or not r.completed]
        if idle:
            self.failures[point] = f"completed no request at concurrency {', '.join(map(str, idle))}"
            log.warning("tune: %s failed: %s", point.label(), self.failures[point])
        elif any(r.errors for r in results):
            self.failures[point] = f"{sum(r.errors for r in results)} requests failed"
        return results


@contextlib.contextmanager
def TuneServer(repository: Path, variants: Sequence[str], concurrencies: Sequence[int],
               measurement_ms: int = 3000, max_trials: int = 6) -> Iterator[Tuner]:
    """A private server over a copy of the variants and a tuner on it (bench scripts use this)."""
    with LocalTarget(repository, variants) as target:
        yield Tuner(target, concurrencies, measurement_ms=measurement_ms, max_trials=max_trials,
                    shapes={v: load_shapes(repository / v) for v in variants})
