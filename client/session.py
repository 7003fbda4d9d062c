"""A measurement session, the library API: a validated config in, typed results out.

    from client.session import LoadLevel, SessionConfig, run
    rows = run(SessionConfig(models=("mlp_fp32",), url="127.0.0.1:8001", levels=(LoadLevel(concurrency=8),)))
    rows[0].result.summary.throughput

Every type a config or a result is made of is importable from here too.

Nothing here prints; progress goes to a callback. A run cut short by the server raises RunAborted
whose `.partial` holds the rows measured before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from numpy.typing import NDArray

from client import progress as progress_display
from client.engine import Distribution, LevelResult, LoadLevel, LoadRun, Measurement, ServerStopped
from client.errors import PerfClientError, RunAborted
from client.inputs import InputData, InputKind, build_payloads
from client.power import PowerFigures, PowerSource, open_cross_checks, open_meter
from client.protocol import TRANSPORT_ERRORS, Connection, ModelMeta, Prepared, Protocol, describe
from client.server_stats import ServerBreakdown
from client.stats import Latency, Window
from client.validate import Expected, load_expected, validated_payloads

__all__ = [
    "Distribution", "InputData", "InputKind", "Latency", "LevelResult", "LoadLevel", "Measurement", "ModelResult",
    "PerfClientError", "PowerFigures", "PowerSource", "ProgressFn", "Protocol", "RunAborted", "ServerBreakdown",
    "SessionConfig", "Window", "measure", "run",
]

log = logging.getLogger(__name__)

METRICS_PORT = 8002

# (model, load level, 1-based window index, the window just measured)
ProgressFn = Callable[[str, LoadLevel, int, Window], None]


@dataclass(frozen=True)
class SessionConfig:
    """Everything one measurement session needs; invalid values raise PerfClientError naming the flag.

    `shapes` gives dims (without the batch dim) for inputs with dynamic dims, by input name.
    `metrics_url` defaults to Triton's metrics endpoint on the host of `url` (port 8002).
    `validate`: a `trtbuild verify --save` file; each model's payloads are its stored samples and every
    answer is checked against the stored outputs (a differing one counts as error kind "mismatch").
    """

    models: tuple[str, ...]
    url: str
    protocol: Protocol = Protocol.GRPC
    levels: tuple[LoadLevel, ...] = (LoadLevel(concurrency=1),)
    batch: int = 1
    input_data: InputData = field(default_factory=InputData)
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    measurement: Measurement = field(default_factory=Measurement)
    metrics_url: str | None = None
    power_source: PowerSource = PowerSource.AUTO
    validate: Path | None = None

    def __post_init__(self) -> None:
        # Plain strings ("http", "nvml") and lists work too: stored as the enum members and tuples.
        object.__setattr__(self, "models", tuple(self.models))
        object.__setattr__(self, "levels", tuple(self.levels))
        object.__setattr__(self, "shapes", dict(self.shapes))
        if self.validate is not None:
            object.__setattr__(self, "validate", Path(self.validate))
        object.__setattr__(self, "protocol", Protocol.parse(self.protocol, "-i", error=PerfClientError))
        object.__setattr__(self, "power_source",
                           PowerSource.parse(self.power_source, "--power-source", error=PerfClientError))
        self.check()

    def check(self) -> None:
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise PerfClientError(f"-m {list(self.models)}: expected one or more model names")
        host, sep, port = self.url.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise PerfClientError(f"-u {self.url!r}: expected HOST:PORT")
        if not self.levels:
            raise PerfClientError("--concurrency: expected at least one load level")
        for level in self.levels:
            level.check()
        if self.batch < 1:
            raise PerfClientError(f"-b {self.batch}: expected a positive batch size")
        for name, dims in self.shapes.items():
            if not name or not dims or min(dims) < 1:
                raise PerfClientError(f"--shape {name}:{','.join(map(str, dims))}: expected NAME:D1,D2,... "
                                      f"with positive integers")
        self.measurement.check()
        if self.metrics_url is not None and not self.metrics_url.startswith(("http://", "https://")):
            raise PerfClientError(f"--metrics-url {self.metrics_url!r}: expected http://HOST:PORT/metrics")
        if self.validate is not None:
            if Path(self.validate).suffix != ".npz":
                raise PerfClientError(f"--validate {self.validate}: expected a .npz file from trtbuild verify --save")
            if self.input_data != InputData() or self.shapes:
                raise PerfClientError(f"--validate {self.validate}: the inputs come from the file; "
                                      "drop --input-data and --shape")

    @property
    def metrics_endpoint(self) -> str:
        """`metrics_url`, or Triton's default metrics port on the server's host."""
        if self.metrics_url is not None:
            return self.metrics_url
        host = self.url.rpartition(":")[0]
        return f"http://{host}:{METRICS_PORT}/metrics"


@dataclass(frozen=True)
class ModelResult:
    """One row of a session: a model at one load level."""

    model: str
    result: LevelResult


async def measure(config: SessionConfig, progress: ProgressFn | None = None) -> list[ModelResult]:
    """Every model at every load level, in order. RunAborted carries the rows measured before a failure."""
    config.check()
    rows: list[ModelResult] = []
    async with await Connection.open(config.protocol, config.url) as conn:
        plans = await _prepare(conn, config)
        meter = open_meter(config.power_source, config.metrics_endpoint)
        cross_checks = open_cross_checks(meter, config.metrics_endpoint)
        log.debug("power source %s; cross-checks: %s", meter.source, [m.source for m in cross_checks])
        try:
            for model, payloads in plans:
                for level in config.levels:
                    log.debug("measuring %s at %s", model, level.label)
                    # Windows until stable, at most max_trials: the bar may end early.
                    with progress_display.task(f"{model} {level.label}: windows",
                                               total=config.measurement.max_trials) as bar:
                        run_level = LoadRun(conn, model=model, payloads=payloads, batch=config.batch, meter=meter,
                                            measurement=config.measurement,
                                            on_window=_bind(progress, model, level, bar),
                                            cross_checks=cross_checks)
                        try:
                            result = await run_level.run(level)
                        except ServerStopped as exc:
                            rows.append(ModelResult(model, exc.result))
                            raise RunAborted(str(exc), rows) from exc
                    rows.append(ModelResult(model, result))
        finally:
            for each in (meter, *cross_checks):
                each.close()
    return rows


def run(config: SessionConfig, progress: ProgressFn | None = None) -> list[ModelResult]:
    """`measure` on a fresh event loop, for callers that are not async themselves."""
    return asyncio.run(measure(config, progress))


def _bind(progress: ProgressFn | None, model: str, level: LoadLevel,
          bar: progress_display.Task) -> Callable[[int, Window], None]:
    def on_window(index: int, window: Window) -> None:
        p99 = f"{window.latency_us.p99 / 1e3:.1f} ms" if window.latency_us is not None else "-"
        bar.advance(status=f"{window.throughput:.1f} infer/s, p99 {p99}")
        if progress is not None:
            progress(model, level, index, window)

    return on_window


async def _prepare(conn: Connection, config: SessionConfig) -> list[tuple[str, list[Prepared]]]:
    """Every model's payloads, serialized, each model probed once: bad input fails before any load."""
    metas = [await conn.model(model) for model in config.models]
    unknown = sorted(set(config.shapes) - {t.name for meta in metas for t in meta.inputs})
    if unknown:
        raise PerfClientError(f"--shape {', '.join(unknown)}: not an input of {', '.join(config.models)}")
    # Read and checked against every model before any request: a bad file fails here in one line.
    expected = load_expected(config.validate, config.models) if config.validate is not None else None
    plans = []
    for meta in metas:
        if expected is None:
            payloads = [conn.prepare(meta.name, arrays) for arrays in _payloads(meta, config)]
        else:
            payloads = _validated(conn, meta, config, expected[meta.name])
        plans.append((meta.name, payloads))
    for name, payloads in plans:
        # One request first: wrong names, shapes or dtypes fail here with the server's reason.
        try:
            await conn.send(payloads[0])
        except TRANSPORT_ERRORS as exc:
            raise PerfClientError(f"-m {name}: the server rejected the request: {describe(exc)}") from exc
    return plans


def _payloads(meta: ModelMeta, config: SessionConfig) -> list[dict[str, NDArray[Any]]]:
    names = {t.name for t in meta.inputs}
    shapes = {name: dims for name, dims in config.shapes.items() if name in names}
    return build_payloads(meta, config.batch, config.input_data, shapes)


def _validated(conn: Connection, meta: ModelMeta, config: SessionConfig, expected: Expected) -> list[Prepared]:
    pairs = validated_payloads(meta, config.batch, expected, str(config.validate))
    return [conn.prepare(meta.name, arrays, outputs) for arrays, outputs in pairs]
