"""A measurement session, the library API: a validated config in, typed results out.

    from client.session import LoadLevel, SessionConfig, run
    rows = run(SessionConfig(models=("mlp_fp32",), url="127.0.0.1:8001", levels=(LoadLevel(concurrency=8),)))
    rows[0].result.summary.throughput

Every type a config or a result is made of is importable from here too.

Nothing here prints; progress goes to a callback. A run cut short (the server stopped, Ctrl-C under
`run`, `time_limit_s`) raises RunAborted whose `.partial` holds the rows measured before, the last
one with `result.complete` False. A level in which no request succeeded has `result.failed` True.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from client.arrivals import arrivals_seed, inputs_seed, lengths_seed, random_seed
from client.engine import (
    Abort,
    Distribution,
    LevelResult,
    LevelStopped,
    LoadLevel,
    LoadRun,
    Measurement,
    Together,
)
from client.errors import PerfClientError, UsageConflict
from client.grpc_aio import GrpcClient
from client.inputs import InputData, InputKind, build_payloads
from client.power import (
    GpuSelection,
    Meter,
    NoMeter,
    PowerFigures,
    PowerSource,
    Reading,
    open_cross_checks,
    open_meter,
    parse_gpus,
    window_power,
)
from client.protocol import (
    REQUEST_TIMEOUT_S,
    TRANSPORT_ERRORS,
    Connection,
    ModelMeta,
    Prepared,
    Protocol,
    describe,
    host_port,
)
from client.sequences import Flags, SequenceOptions, Sequences
from client.server_stats import ServerBreakdown
from client.shared_memory import SharedMemory
from client.stats import Latency, Window, latency_summary
from client.tls import Tls
from client.validate import Check, Expected, ValidateOptions, load_expected, validated_payloads
from client.workers import ProcessPool
from common import progress as progress_display

__all__ = [
    "Distribution", "InputData", "InputKind", "Latency", "LevelResult", "LoadLevel", "Measurement", "ModelResult",
    "PerfClientError", "PowerFigures", "PowerSource", "ProgressFn", "Protocol", "RunAborted", "SequenceOptions",
    "ServerBreakdown", "SessionConfig", "Window", "measure", "run",
]

log = logging.getLogger(__name__)

METRICS_PORT = 8002
# The row of a --simultaneous run that covers every model together (energy is measured for it only).
WHOLE_RUN = "(whole run)"

# perf_analyzer's default load: one request in flight.
_DEFAULT_LEVELS = (LoadLevel(concurrency=1),)

# (model, load level, 1-based window index, the window just measured)
ProgressFn = Callable[[str, LoadLevel, int, Window], None]


def _concurrency_range(levels: tuple[LoadLevel, ...]) -> str:
    """Closed-loop levels as --concurrency-range writes them, START:END[:STEP] (evenly spaced, as the CLI makes
    them); otherwise the concurrencies listed."""
    values = [level.concurrency for level in levels]
    steps = {b - a for a, b in itertools.pairwise(values) if a is not None and b is not None}
    if None in values or len(steps) != 1:
        return ",".join(level.label for level in levels)
    (step,) = steps
    return f"{values[0]}:{values[-1]}" + (f":{step}" if step != 1 else "")


@dataclass(frozen=True)
class SessionConfig:
    """Everything one measurement session needs; invalid values raise PerfClientError naming the flag.

    `shapes` gives dims (without the batch dim) for inputs with dynamic dims, by input name.
    `metrics_url` defaults to Triton's metrics endpoint on the host of `url` (port 8002).
    `validate`: a `trtbuild verify --save` file; each model's payloads are its stored samples and every
    answer is checked against the stored outputs (a differing one counts as error kind "mismatch").
    `request_timeout_ms`: the deadline of every inference request (a late one counts as kind "timeout").
    `time_limit_s`: the whole run stops there, as on Ctrl-C (RunAborted with what was measured).
    `model_levels`: a model's own load levels instead of `levels`.
    `processes`: worker processes that generate the load (their windows' records merged exactly).
    `simultaneous`: every model under load at once (level i of each together); each model's row has its
    own client and server figures, energy is measured for the whole run (row WHOLE_RUN).
    `seed`: the root of every random draw (Poisson arrivals per model, level and worker process; synthetic
    inputs per model: client.arrivals); None draws one at random, kept here (and in the JSON report).
    `sequence`: the sequence flags (client.sequences); a sequence model (its config has sequence_batching) is
    driven as sequences with these, or perf_analyzer's defaults when None; given for a model that is not one,
    the run is refused.
    `grpc_client`: which client carries gRPC inference requests (client.grpc_aio: our own HTTP/2 one, or grpc.aio).
    `streaming`: every model is decoupled and driven over gRPC streams (client.streaming), closed loop only; a
    decoupled model without it, or it with a model that is not decoupled, is refused.
    """

    models: tuple[str, ...]
    url: str
    protocol: Protocol = Protocol.GRPC
    levels: tuple[LoadLevel, ...] = _DEFAULT_LEVELS
    batch: int = 1
    input_data: InputData = field(default_factory=InputData)
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    measurement: Measurement = field(default_factory=Measurement)
    metrics_url: str | None = None
    power_source: PowerSource = PowerSource.AUTO
    validate: Path | None = None
    validate_options: ValidateOptions = field(default_factory=ValidateOptions)  # tolerances, fraction, mix
    request_timeout_ms: int = int(REQUEST_TIMEOUT_S * 1000)
    time_limit_s: float | None = None
    model_levels: Mapping[str, tuple[LoadLevel, ...]] = field(default_factory=dict)
    simultaneous: bool = False
    processes: int = 1
    shared_memory: SharedMemory = field(default_factory=SharedMemory)  # --shared-memory, its output size
    seed: int | None = None  # --seed; None: drawn at random once, here
    gpus: tuple[str, ...] | None = None  # --gpus (indices or UUIDs) metered; None: chosen by choose_gpus
    tls: Tls | None = None  # --ssl-grpc-* / --ssl-https-*: every connection over TLS
    compression: str | None = None  # --grpc/--http-compression-algorithm: gzip | deflate
    sequence: SequenceOptions | None = None  # --sequence-length & co. (None: defaults, for sequence models only)
    # The load flag as the user typed it (`--concurrency-range 2:9:3`, `--concurrency 1`), quoted in messages;
    # None where no load flag was given (the CLI) or for a library caller: then it is written from `levels`.
    load_flag: str | None = None
    grpc_client: GrpcClient = GrpcClient.NATIVE  # --grpc-client
    streaming: bool = False  # --streaming

    def __post_init__(self) -> None:
        # Plain strings ("http", "nvml") and lists work too: stored as the enum members and tuples.
        object.__setattr__(self, "models", tuple(self.models))
        if self.seed is None:
            object.__setattr__(self, "seed", random_seed())
        object.__setattr__(self, "levels", tuple(self.levels))
        object.__setattr__(self, "shapes", dict(self.shapes))
        object.__setattr__(self, "model_levels", {m: tuple(levels) for m, levels in self.model_levels.items()})
        if self.validate is not None:
            object.__setattr__(self, "validate", Path(self.validate))
        object.__setattr__(self, "protocol", Protocol.parse(self.protocol, "-i", error=PerfClientError))
        object.__setattr__(self, "power_source",
                           PowerSource.parse(self.power_source, "--power-source", error=PerfClientError))
        object.__setattr__(self, "grpc_client", GrpcClient.parse(self.grpc_client, "--grpc-client",
                                                                 error=PerfClientError))
        self.check()

    def check(self) -> None:
        if not self.models or not all(isinstance(m, str) and m for m in self.models):
            raise PerfClientError(f"-m {list(self.models)}: expected one or more model names")
        host_port(self.url)
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
        if self.request_timeout_ms < 1:
            raise PerfClientError(f"--request-timeout-ms {self.request_timeout_ms}: expected a positive integer")
        unknown = sorted(set(self.model_levels) - set(self.models))
        if unknown:
            raise PerfClientError(f"--model-concurrency/--model-request-rate {', '.join(unknown)}: not among -m "
                                  f"{', '.join(self.models)}")
        for levels in self.model_levels.values():
            for level in levels:
                level.check()
        if self.processes < 1:
            raise PerfClientError(f"--processes {self.processes}: expected a positive integer")
        if self.gpus is not None:
            try:
                parse_gpus(",".join(self.gpus))
            except ValueError as exc:
                raise PerfClientError(str(exc)) from None
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise PerfClientError(f"--seed {self.seed}: expected an integer from 0 to 2**63 - 1")
        self._check_processes()
        if self.sequence is not None:
            self.sequence.check()
            if self.processes > 1:
                raise PerfClientError(f"--processes {self.processes}: not with the sequence flags (one loop holds "
                                      "a model's sequences)")
            for model in self.models:
                for level in self.levels_of(model):
                    self.sequence.check_live(self.sequence.live_sequences(level.concurrency), level.label)
        self._check_transport()
        if self.simultaneous:
            if len(self.models) < 2:
                raise PerfClientError(f"--simultaneous: expected two or more -m models, got {len(self.models)}")
            counts = {len(self.levels_of(m)) for m in self.models}
            if len(counts) != 1 or WHOLE_RUN in self.models:
                raise PerfClientError("--simultaneous: expected the same number of load levels for every model")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise PerfClientError(f"--time-limit {self.time_limit_s}: expected a positive number of seconds")
        if self.metrics_url is not None and not self.metrics_url.startswith(("http://", "https://")):
            raise PerfClientError(f"--metrics-url {self.metrics_url!r}: expected http://HOST:PORT/metrics")
        if self.validate is not None:
            if Path(self.validate).suffix != ".npz":
                raise PerfClientError(f"--validate {self.validate}: expected a .npz file from trtbuild verify --save")
            self.validate_options.check()
            if not self.validate_options.mix and (self.input_data != InputData() or self.shapes):
                raise PerfClientError(f"--validate {self.validate}: the inputs come from the file; "
                                      "drop --input-data and --shape")

    def _check_processes(self) -> None:
        """--processes N against the other options: the one place that decides, in one line naming both
        (UsageConflict: the CLI exits 2 on it, as on argparse's own usage errors).

        The workers each drive one model's load on their own loop and the parent only times the windows, so
        what needs one schedule or one loop (a replayed file, a window closed by a request count, several
        models at once) is refused, as is `--validate` (its sampling and mismatch counts across workers are
        not proven yet). `--shared-memory` works: the workers send through the parent's regions. A sequence
        model is refused when the run learns it is one (`_check_sequence_models`: it takes the server's word).
        """
        n = self.processes
        if n <= 1:
            return
        flag = f"--processes {n}"
        if self.simultaneous:
            raise UsageConflict(f"{flag}: not with --simultaneous (the workers drive one model at a time)")
        if self.measurement.request_count > 0:
            raise UsageConflict(f"{flag}: not with --request-count {self.measurement.request_count} "
                                "(the parent times the windows; use --measurement-interval)")
        used = [(model, self.levels_of(model)) for model in self.models]
        for _, levels in used:
            for level in levels:
                if level.intervals is not None:
                    raise UsageConflict(f"{flag}: not with --request-intervals {level.intervals.path} "
                                        "(one replayed schedule, one process)")
        if self.validate is not None:
            raise UsageConflict(f"{flag}: not with --validate {self.validate} "
                                "(answers are checked in one process only)")
        # Each worker keeps at least one request in flight: a concurrency below N cannot be split. The shared
        # levels count only where some model has no level of its own (--model-concurrency/--model-request-rate).
        for model, levels in used:
            if not any(level.concurrency is not None and level.concurrency < n for level in levels):
                continue
            if model in self.model_levels:
                shown = ", ".join(f"--model-concurrency {model}={level.concurrency}" for level in levels)
                raise UsageConflict(f"{flag}: not with {shown} (expected at least one request in flight per process)")
            if len(levels) > 1:
                typed = self.load_flag or f"--concurrency-range {_concurrency_range(levels)}"
                raise UsageConflict(f"{flag}: not with {typed} (every level needs >= {n})")
            shown = self.load_flag or (f"--concurrency {levels[0].concurrency}"
                                       + (" (the default)" if levels == _DEFAULT_LEVELS else ""))
            raise UsageConflict(f"{flag}: not with {shown} (expected at least one request in flight per process)")

    def _check_transport(self) -> None:
        """--grpc-client and --streaming against the other options, one line naming the flag."""
        if self.grpc_client is GrpcClient.AIO:
            if self.protocol is not Protocol.GRPC:
                raise PerfClientError(f"--grpc-client {self.grpc_client}: not with -i {self.protocol} "
                                      "(expected -i grpc)")
            if self.processes > 1:
                raise PerfClientError(f"--grpc-client {self.grpc_client}: not with --processes {self.processes} "
                                      "(the worker processes send with the native client)")
        if not self.streaming:
            return
        if self.protocol is not Protocol.GRPC:
            raise PerfClientError(f"--streaming: not with -i {self.protocol} (Triton streams over gRPC only; "
                                  "expected -i grpc)")
        if self.processes > 1:
            raise PerfClientError(f"--streaming: not with --processes {self.processes}")
        if self.shared_memory.enabled:
            raise PerfClientError(f"--streaming: not with --shared-memory {self.shared_memory.kind}")
        if self.validate is not None:
            raise PerfClientError(f"--streaming: not with --validate {self.validate}")
        if self.sequence is not None:
            raise PerfClientError("--streaming: not with the sequence flags")
        for model in self.models:
            for level in self.levels_of(model):
                if level.concurrency is None:
                    raise PerfClientError(f"--streaming: not with {level.label} (closed loop only: --concurrency)")

    @property
    def run_seed(self) -> int:
        """`seed`, drawn when it was None."""
        assert self.seed is not None  # __post_init__ draws one
        return self.seed

    def levels_of(self, model: str) -> tuple[LoadLevel, ...]:
        return self.model_levels.get(model, self.levels)

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


class RunAborted(PerfClientError):
    """The run stopped part-way (the server died); `partial` holds what was measured before, the
    last level possibly incomplete (`result.complete` False). Here, beside ModelResult, so that client.errors
    needs no type from the session (a TYPE_CHECKING import there closed a 13-module cycle)."""

    def __init__(self, message: str, partial: list[ModelResult]) -> None:
        super().__init__(message)
        self.partial = partial


async def measure(config: SessionConfig, progress: ProgressFn | None = None,
                  abort: Abort | None = None) -> list[ModelResult]:
    """Every model at every load level, in order. RunAborted carries the rows measured before a failure,
    `config.time_limit_s` or `abort` (set from outside, e.g. by a signal handler) stopped the run."""
    config.check()
    abort = abort if abort is not None else Abort()
    rows: list[ModelResult] = []
    async with await Connection.open(config.protocol, config.url, timeout_s=config.request_timeout_ms / 1000,
                                     shared_memory=config.shared_memory, tls=config.tls,
                                     compression=config.compression, grpc_client=config.grpc_client) as conn:
        plans, sequence_models = await _prepare(conn, config)
        # Off the event loop: opening a meter reads it (the Triton meter over blocking HTTP, up to its timeout).
        gpus = await _gpus(conn, config)
        meter = await asyncio.to_thread(open_meter, config.power_source, config.metrics_endpoint, gpus=gpus)
        if config.gpus and meter.source is PowerSource.NONE and config.power_source is not PowerSource.NONE:
            raise PerfClientError(f"--gpus {','.join(config.gpus)}: no meter counts these GPUs ({meter.reason})")
        cross_checks = await asyncio.to_thread(open_cross_checks, meter, config.metrics_endpoint, gpus)
        log.debug("power source %s on %s; cross-checks: %s", meter.source, gpus, [m.source for m in cross_checks])
        timer = None
        if config.time_limit_s is not None:
            timer = asyncio.get_running_loop().call_later(
                config.time_limit_s, abort.set, f"--time-limit {config.time_limit_s:g} s reached")
        try:
            if config.simultaneous:
                for step in range(len(config.levels_of(config.models[0]))):
                    rows.extend(await _measure_together(conn, plans, step, config, meter=meter, abort=abort,
                                                        progress=progress, done=rows,
                                                        sequence_models=sequence_models))
                return rows
            for model_index, (model, payloads) in enumerate(plans):
                for level_index, level in enumerate(config.levels_of(model)):
                    seed = arrivals_seed(config.run_seed, model_index, level_index)
                    log.debug("measuring %s at %s", model, level.label)
                    # Windows until stable, at most max_trials: the bar may end early.
                    with progress_display.task(f"{model} {level.label}: windows",
                                               total=config.measurement.max_trials) as bar:
                        pool = (ProcessPool(config.processes, protocol=config.protocol, url=config.url,
                                            timeout_s=config.request_timeout_ms / 1000, model=model,
                                            payloads=payloads, batch=config.batch, seed=seed, tls=config.tls)
                                if config.processes > 1 else None)
                        run_level = LoadRun(conn, model=model, payloads=payloads, batch=config.batch, meter=meter,
                                            measurement=config.measurement,
                                            on_window=_bind(progress, model, level, bar),
                                            cross_checks=cross_checks, abort=abort, pool=pool, seed=seed,
                                            sequences=_sequences(config, sequence_models, model_index,
                                                                 level_index), streaming=config.streaming)
                        try:
                            result = await run_level.run(level)
                        except LevelStopped as exc:
                            if exc.result is not None:
                                rows.append(ModelResult(model, exc.result))
                            raise RunAborted(str(exc), rows) from exc
                    rows.append(ModelResult(model, result))
        finally:
            if timer is not None:
                timer.cancel()
            for each in (meter, *cross_checks):
                await asyncio.to_thread(each.close)  # NVML's joins its sampling thread
    return rows


async def _measure_together(conn: Connection, plans: list[tuple[str, list[Prepared]]], step: int,
                            config: SessionConfig, *, meter: Meter, abort: Abort, progress: ProgressFn | None,
                            done: list[ModelResult], sequence_models: frozenset[str] = frozenset()
                            ) -> list[ModelResult]:
    """Load level `step` of every model at once; one row per model and a WHOLE_RUN row with the energy.

    The meter reads the whole device: it is read once when every model's first window has opened and
    once when the last model's last window has closed (the load of each stays on until then), and the
    whole run's inferences are counted over exactly that interval.
    """
    labels = sorted({config.levels_of(model)[step].label for model, _ in plans})
    # One progress task for the models together (the display shows one task at a time): every model's
    # windows count towards it.
    with progress_display.task(f"{len(plans)} models {', '.join(labels)}: windows",
                               total=config.measurement.max_trials * len(plans)) as bar:
        return await _measure_together_shown(conn, plans, step, config, meter=meter, abort=abort, progress=progress,
                                             done=done, bar=bar, sequence_models=sequence_models)


async def _measure_together_shown(conn: Connection, plans: list[tuple[str, list[Prepared]]], step: int,
                                  config: SessionConfig, *, meter: Meter, abort: Abort, progress: ProgressFn | None,
                                  done: list[ModelResult], bar: progress_display.Task,
                                  sequence_models: frozenset[str] = frozenset()) -> list[ModelResult]:
    together = Together()
    shared = NoMeter("energy is measured for the whole run with --simultaneous")
    runs, tasks = [], []
    for model_index, (model, payloads) in enumerate(plans):
        level = config.levels_of(model)[step]
        run_level = LoadRun(conn, model=model, payloads=payloads, batch=config.batch, meter=shared,
                            measurement=config.measurement, on_window=_bind(progress, model, level, bar),
                            abort=abort, together=together, seed=arrivals_seed(config.run_seed, model_index, step),
                            sequences=_sequences(config, sequence_models, model_index, step),
                            streaming=config.streaming)
        runs.append(run_level)
        tasks.append(asyncio.create_task(run_level.run(level)))

    async def all_set(events: list[asyncio.Event]) -> None:
        await asyncio.gather(*(e.wait() for e in events))

    await all_set([r.started for r in runs])  # set too by a level that ends before its first window
    t0, count0, before = time.monotonic_ns(), together.inferences, await asyncio.to_thread(_read, meter)
    trace_start = len(meter.trace.samples) if meter.trace is not None else 0
    await all_set([r.measured for r in runs])
    t1, count1, after = time.monotonic_ns(), together.inferences, await asyncio.to_thread(_read, meter)
    power_trace = tuple(meter.trace.samples[trace_start:]) if meter.trace is not None else ()
    together.release.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    rows, stopped = [], None
    for (model, _), outcome in zip(plans, outcomes, strict=True):
        if isinstance(outcome, LevelStopped):
            stopped = stopped or outcome
            if outcome.result is not None:
                rows.append(ModelResult(model, outcome.result))
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            rows.append(ModelResult(model, outcome))
    if rows:
        rows.append(ModelResult(WHOLE_RUN, _whole_run(rows, (t0, t1), count1 - count0, meter,
                                                      (before, after), stopped, power_trace)))
    if stopped is not None:
        raise RunAborted(str(stopped), [*done, *rows]) from stopped
    return rows


def choose_gpus(explicit: tuple[str, ...] | None, configs: Mapping[str, Mapping[str, Any]],
                environ: Mapping[str, str]) -> GpuSelection:
    """The GPUs to meter: `explicit` (--gpus); else those the measured models' instance groups name
    (KIND_GPU with `gpus`, from each model's served config); else CUDA_VISIBLE_DEVICES; else every GPU."""
    if explicit:
        return GpuSelection(tuple(explicit), "--gpus")
    named: set[int] = set()
    for config in configs.values():
        for group in config.get("instance_group") or []:
            if str(group.get("kind", "KIND_AUTO")) in ("KIND_GPU", "KIND_AUTO"):  # gpus listed: on those GPUs
                named.update(int(gpu) for gpu in group.get("gpus") or [])
    if named:
        return GpuSelection(tuple(str(g) for g in sorted(named)), f"instance groups of {', '.join(configs)}")
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        try:
            return GpuSelection(parse_gpus(visible, "CUDA_VISIBLE_DEVICES"), "CUDA_VISIBLE_DEVICES")
        except ValueError as exc:
            log.info("every GPU metered: %s", exc)
    return GpuSelection()


def sharing(selection: GpuSelection, others: Mapping[str, Mapping[str, Any]]) -> str | None:
    """One line naming the other loaded models whose GPU instances run on metered GPUs (their work is in
    the energy figures); None when there is none. A KIND_GPU group that lists no GPU runs on every one."""
    shared = []
    for name, config in others.items():
        for group in config.get("instance_group") or []:
            if str(group.get("kind", "KIND_AUTO")) not in ("KIND_GPU", "KIND_AUTO"):
                continue
            listed = {str(gpu) for gpu in group.get("gpus") or []}
            everywhere = not listed and str(group.get("kind")) == "KIND_GPU"
            if everywhere or (listed and (selection.ids is None or listed & set(selection.ids))):
                shared.append(name)
                break
    if not shared:
        return None
    return f"the GPUs metered ({selection}) also run {', '.join(shared)}: their work is in the energy figures"


async def _gpus(conn: Connection, config: SessionConfig) -> GpuSelection:
    """choose_gpus for this run: the models' served configs are asked for only when --gpus is not given.
    Other models loaded on the metered GPUs are said in one warning."""
    configs: dict[str, Mapping[str, Any]] = {}
    if config.power_source is PowerSource.NONE:
        return choose_gpus(config.gpus, configs, os.environ)
    others: dict[str, Mapping[str, Any]] = {}
    try:
        for model in dict.fromkeys([*config.models, *await conn.loaded_models()]):
            (configs if model in config.models else others)[model] = await conn.model_config(model)
    except PerfClientError as exc:  # checked already by _prepare: the server went away since
        log.debug("%s", exc)
    selection = choose_gpus(config.gpus, configs, os.environ)
    note = sharing(selection, others)
    if note is not None:
        log.warning("%s", note)
    return selection


def _read(meter: Meter) -> Reading:
    """One reading (in a worker thread); a failed one (the server behind Triton's metrics died) is None
    energy, so the rows measured before still reach the caller."""
    try:
        return meter.read()
    except Exception as exc:  # noqa: BLE001 - a failed read leaves the whole run's energy None
        log.debug("%s reading failed: %s", meter.source, exc)
        return Reading(time.monotonic(), None)


def _whole_run(rows: list[ModelResult], span_ns: tuple[int, int], inferences: int, meter: Meter,
               readings: tuple[Reading, Reading], stopped: LevelStopped | None,
               power_trace: tuple[tuple[float, float], ...] = ()) -> LevelResult:
    """Every model's row together: throughput and energy over the interval all of them were measured in,
    latency percentiles over every model's summary latencies pooled."""
    start, end = span_ns
    seconds = max(end - start, 1) / 1e9
    pooled = np.sort(np.concatenate([r.result.summary.latencies_ns for r in rows]))
    errors: dict[str, int] = {}
    for r in rows:
        for kind, count in r.result.summary.errors.items():
            errors[kind] = errors.get(kind, 0) + count
    summary = Window(start_ns=start, end_ns=end, requests=int(pooled.size), inferences=inferences,
                     throughput=inferences / seconds, latency_us=latency_summary(pooled), errors=errors,
                     latencies_ns=pooled)
    return LevelResult(level=rows[0].result.level, windows=(), summary=summary,
                       stable=stopped is None and all(r.result.stable for r in rows), server=ServerBreakdown(),
                       power=window_power(meter, readings[0], readings[1], inferences), power_trace=power_trace,
                       complete=stopped is None, stop_reason=str(stopped) if stopped is not None else None)


def run(config: SessionConfig, progress: ProgressFn | None = None, *,
        ctrl_c_keeps_results: bool = False) -> list[ModelResult]:
    """`measure` on a fresh uvloop event loop, for callers that are not async themselves.

    Ctrl-C raises KeyboardInterrupt as usual; with `ctrl_c_keeps_results` (the perfclient CLI, from the
    main thread) it, and SIGTERM too, end the run like `time_limit_s` instead: RunAborted with what was
    measured, after the connection closed (its shared-memory regions unregistered from the server).
    """
    import uvloop

    return uvloop.run(_run_interruptible(config, progress, ctrl_c_keeps_results))


async def _run_interruptible(config: SessionConfig, progress: ProgressFn | None,
                             ctrl_c_keeps_results: bool) -> list[ModelResult]:
    abort = Abort()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    if ctrl_c_keeps_results:
        # SIGTERM's default would end the process at once: no partial files, and regions left registered
        # with the server (the resource tracker unlinks the local segments, not the server's registration).
        for signum, reason in ((signal.SIGINT, "interrupted (Ctrl-C)"), (signal.SIGTERM, "terminated (SIGTERM)")):
            try:
                loop.add_signal_handler(signum, abort.set, reason)
            except (ValueError, RuntimeError, NotImplementedError):  # not the main thread: default handling
                continue
            handled.append(signum)
    try:
        return await measure(config, progress, abort)
    finally:
        for signum in handled:
            loop.remove_signal_handler(signum)


def _bind(progress: ProgressFn | None, model: str, level: LoadLevel,
          bar: progress_display.Task | None) -> Callable[[int, Window], None]:
    def on_window(index: int, window: Window) -> None:
        p99 = f"{window.latency_us.p99 / 1e3:.1f} ms" if window.latency_us is not None else "-"
        if bar is not None:
            bar.advance(status=f"{window.throughput:.1f} infer/s, p99 {p99}")
        if progress is not None:
            progress(model, level, index, window)

    return on_window


def _sequences(config: SessionConfig, sequence_models: frozenset[str], model_index: int,
               level_index: int) -> Sequences | None:
    """A sequence model's sequences for one load level (lengths seeded by the run's seed); None for other models."""
    if config.models[model_index] not in sequence_models:
        return None
    return Sequences(config.sequence or SequenceOptions(), lengths_seed(config.run_seed, model_index, level_index))


def _check_sequence_models(metas: list[ModelMeta], config: SessionConfig) -> frozenset[str]:
    """The sequence models among `metas`; the sequence flags on a model that is not one, or what a sequence
    model cannot do, refused in one line."""
    sequence_models = frozenset(meta.name for meta in metas if meta.sequence)
    others = [meta.name for meta in metas if not meta.sequence]
    if config.sequence is not None and others:
        raise PerfClientError(f"--sequence-length/--sequence-id-range/--num-of-sequences: -m {', '.join(others)} "
                              "is not a sequence model (its config has no sequence_batching)")
    if sequence_models and config.processes > 1:
        raise PerfClientError(f"--processes {config.processes}: -m {', '.join(sorted(sequence_models))} is a "
                              "sequence model (one loop holds its sequences); expected --processes 1")
    if sequence_models and config.validate is not None:
        raise PerfClientError(f"--validate {config.validate}: -m {', '.join(sorted(sequence_models))} is a "
                              "sequence model (its answers depend on the sequence's state, not on the sample alone)")
    return sequence_models


async def _prepare(conn: Connection,
                   config: SessionConfig) -> tuple[list[tuple[str, list[Prepared]]], frozenset[str]]:
    """Every model's payloads, serialized, each model probed once: bad input fails before any load. Also the
    sequence models among them."""
    metas = [await conn.model(model) for model in config.models]
    sequence_models = _check_sequence_models(metas, config)
    _check_decoupled(metas, config)
    unknown = sorted(set(config.shapes) - {t.name for meta in metas for t in meta.inputs})
    if unknown:
        raise PerfClientError(f"--shape {', '.join(unknown)}: not an input of {', '.join(config.models)}")
    # Read and checked against every model before any request: a bad file fails here in one line.
    expected = load_expected(config.validate, config.models) if config.validate is not None else None
    plans = []
    for meta in metas:
        payloads = []
        if expected is None or config.validate_options.mix:
            payloads = [await conn.prepare(meta.name, arrays) for arrays in _payloads(meta, config)]
        if expected is not None:
            payloads += await _validated(conn, meta, config, expected[meta.name])
        plans.append((meta.name, payloads))
    for name, payloads in plans:
        # One request first: wrong names, shapes or dtypes fail here with the server's reason. A sequence
        # model's is a whole sequence of one step, on the range's first id.
        probe = payloads[0]
        if name in sequence_models:
            first = (config.sequence or SequenceOptions()).id_start
            probe = conn.flagged(probe, Flags(first, start=True, end=True))
        try:
            if config.streaming:
                await _probe_stream(conn, name, probe)
            else:
                await conn.send(probe)
        except TRANSPORT_ERRORS as exc:
            raise PerfClientError(f"-m {name}: the server rejected the request: {describe(exc)}") from exc
    return plans, sequence_models


def _check_decoupled(metas: list[ModelMeta], config: SessionConfig) -> None:
    """--streaming with every model decoupled, or neither (perf_analyzer refuses a decoupled model without it)."""
    decoupled = [meta.name for meta in metas if meta.decoupled]
    others = [meta.name for meta in metas if not meta.decoupled]
    if config.streaming and others:
        raise PerfClientError(f"--streaming: -m {', '.join(others)} is not a decoupled model (its config has no "
                              "model_transaction_policy { decoupled: true })")
    if decoupled and not config.streaming:
        raise PerfClientError(f"-m {', '.join(decoupled)} is a decoupled model (any number of responses per request): "
                              "add --streaming")


async def _probe_stream(conn: Connection, model: str, probe: Prepared) -> None:
    """One request on a stream of its own; an error response is one line with the server's words."""
    stream = conn.open_stream()
    try:
        timing = await stream.request(conn.stream_message(probe))
    finally:
        await stream.aclose()
    if timing.error is not None:
        raise PerfClientError(f"-m {model}: the server rejected the request: {timing.detail}")


def _payloads(meta: ModelMeta, config: SessionConfig) -> list[dict[str, NDArray[Any]]]:
    names = {t.name for t in meta.inputs}
    shapes = {name: dims for name, dims in config.shapes.items() if name in names}
    index = config.models.index(meta.name) if meta.name in config.models else 0
    return build_payloads(meta, config.batch, config.input_data, shapes, inputs_seed(config.run_seed, index))


async def _validated(conn: Connection, meta: ModelMeta, config: SessionConfig,
                     expected: Expected) -> list[Prepared]:
    pairs = validated_payloads(meta, config.batch, expected, str(config.validate))
    return [await conn.prepare(meta.name, arrays, Check(outputs, config.validate_options))
            for arrays, outputs in pairs]
