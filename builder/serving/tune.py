from __future__ import annotations

import itertools
import logging
import math
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from builder.errors import BuilderError
from builder.repository import triton_config
from builder.repository.lock import repository_lock
from builder.serving.triton_server import ModelControl, Ports, TritonServer, free_ports
from client import session
from client.choices import Choice
from client.engine import LoadLevel, Measurement
from client.errors import PerfClientError
from client.files import write_atomic, write_json

log = logging.getLogger(__name__)


class Goal(Choice):
    THROUGHPUT = "throughput"
    P99 = "p99"
    INFER_PER_JOULE = "infer_per_joule"


class Search(Choice):
    HILL = "hill"
    EXHAUSTIVE = "exhaustive"


@dataclass(frozen=True)
class Point:
    variant: str
    max_batch_size: int
    queue_delay_us: int | None  # None: dynamic batching off
    instances: int

    def label(self) -> str:
        batching = "off" if self.queue_delay_us is None else f"{self.queue_delay_us}us"
        return f"{self.variant} mbs={self.max_batch_size} batching={batching} inst={self.instances}"

    def sort_key(self) -> tuple[str, int, int, int]:
        return (self.variant, self.max_batch_size, _delay_key(self.queue_delay_us), self.instances)


def _delay_key(delay: int | None) -> int:
    return -1 if delay is None else delay  # "off" sorts before every delay


@dataclass(frozen=True)
class Result:
    point: Point
    concurrency: int
    throughput: float
    p50_us: float | None  # None: no request completed
    p99_us: float | None
    infer_per_joule: float | None
    avg_batch: float | None
    stable: bool
    errors: int

    @property
    def completed(self) -> bool:
        return self.p99_us is not None and self.throughput > 0


def _p99(results: Sequence[Result]) -> float:
    """The worst p99 over the concurrencies; infinite when one completed nothing."""
    return max((r.p99_us if r.p99_us is not None else math.inf for r in results), default=math.inf)


def _mean_p99(results: Sequence[Result]) -> float:
    """The mean p99 over the concurrencies; infinite when one completed nothing."""
    values = [r.p99_us if r.p99_us is not None else math.inf for r in results]
    return sum(values) / len(values) if values else math.inf


def _throughput(results: Sequence[Result]) -> float:
    return sum(r.throughput for r in results) / len(results) if results else 0.0


@dataclass(frozen=True)
class Objective:
    goal: Goal = Goal.THROUGHPUT
    p99_budget_us: float | None = None
    min_throughput: float | None = None

    def feasible(self, results: Sequence[Result]) -> bool:
        return bool(results) and all(
            r.completed and r.errors == 0
            and (self.p99_budget_us is None or (r.p99_us is not None and r.p99_us <= self.p99_budget_us))
            and (self.min_throughput is None or r.throughput >= self.min_throughput)
            for r in results
        )

    def value(self, results: Sequence[Result]) -> float:
        """Higher is better; the mean over the measured concurrencies."""
        if self.goal is Goal.THROUGHPUT:
            return _throughput(results)
        if self.goal is Goal.P99:
            return -_mean_p99(results)
        per_joule = [r.infer_per_joule for r in results]
        if any(v is None for v in per_joule):
            raise BuilderError("--objective infer_per_joule: no power source here (perfclient reports none)")
        return sum(v for v in per_joule if v is not None) / len(per_joule)

    def rank(self, results: Sequence[Result]) -> tuple[int, float]:
        """Feasible points first, then by value; infeasible ones by how far p99 is over budget."""
        if self.feasible(results):
            return (1, self.value(results))
        return (0, -_p99(results))


@dataclass(frozen=True)
class Space:
    variants: tuple[str, ...]
    max_batch_sizes: tuple[int, ...]
    queue_delays_us: tuple[int | None, ...]  # None: dynamic batching off
    instances: tuple[int, ...]

    def points(self) -> list[Point]:
        return [Point(*p) for p in itertools.product(self.variants, self.max_batch_sizes, self.queue_delays_us,
                                                        self.instances)]

    def including(self, point: Point) -> Space:
        """This space with the point's settings added to each axis (kept in order)."""
        return Space(self.variants, tuple(sorted(set(self.max_batch_sizes) | {point.max_batch_size})),
                     tuple(sorted(set(self.queue_delays_us) | {point.queue_delay_us}, key=_delay_key)),
                     tuple(sorted(set(self.instances) | {point.instances})))

    def neighbours(self, point: Point) -> list[Point]:
        out = []
        axes: list[tuple[str, Sequence[Any]]] = [("variant", self.variants), ("max_batch_size", self.max_batch_sizes),
                                                 ("queue_delay_us", self.queue_delays_us),
                                                 ("instances", self.instances)]
        for name, values in axes:
            index = list(values).index(getattr(point, name))
            for step in (-1, 1):
                if 0 <= index + step < len(values):
                    out.append(replace(point, **{name: values[index + step]}))
        # max_batch_size and the queue delay act together (a larger batch with batching off, or batching
        # with a batch of 1, changes nothing), so also step both at once.
        b = list(self.max_batch_sizes).index(point.max_batch_size)
        d = list(self.queue_delays_us).index(point.queue_delay_us)
        for step in (-1, 1):
            if 0 <= b + step < len(self.max_batch_sizes) and 0 <= d + step < len(self.queue_delays_us):
                out.append(replace(point, max_batch_size=self.max_batch_sizes[b + step],
                                   queue_delay_us=self.queue_delays_us[d + step]))
        return out


Measure = Callable[[Point], list[Result]]


def exhaustive(space: Space, measure: Measure) -> dict[Point, list[Result]]:
    return {point: measure(point) for point in space.points()}


def hill_climb(space: Space, start: Point, measure: Measure, objective: Objective) -> dict[Point, list[Result]]:
    measured: dict[Point, list[Result]] = {start: measure(start)}
    current = start
    while True:
        for point in space.neighbours(current):
            if point not in measured:
                measured[point] = measure(point)
        best_step = max(space.neighbours(current), key=lambda p: objective.rank(measured[p]), default=current)
        if objective.rank(measured[best_step]) <= objective.rank(measured[current]):
            return measured
        current = best_step


def best(measured: dict[Point, list[Result]], objective: Objective) -> Point | None:
    feasible = [p for p, r in measured.items() if objective.feasible(r)]
    return max(feasible, key=lambda p: objective.value(measured[p])) if feasible else None


def pareto(measured: dict[Point, list[Result]]) -> list[Point]:
    """Points no other point beats on both mean throughput and worst p99 (points that completed nothing
    are on no front)."""
    stats = {p: (_throughput(rs), _p99(rs)) for p, rs in measured.items() if math.isfinite(_p99(rs))}
    front = [p for p, (t, lat) in stats.items()
             if not any(t2 >= t and l2 <= lat and (t2, l2) != (t, lat) for t2, l2 in stats.values())]
    return sorted(front, key=Point.sort_key)


def apply(config_text: str, point: Point) -> str:
    """The variant's config with the point's serving settings, through Triton's schema."""
    config = triton_config.parse(config_text)
    config.max_batch_size = point.max_batch_size
    config.instance_group[0].count = point.instances
    if point.queue_delay_us is None:
        config.ClearField("dynamic_batching")
    else:
        config.dynamic_batching.max_queue_delay_microseconds = point.queue_delay_us
        del config.dynamic_batching.preferred_batch_size[:]
        if point.max_batch_size > 1:
            config.dynamic_batching.preferred_batch_size.append(point.max_batch_size)
    return triton_config.to_text(config)


def point_of(variant: str, config_text: str) -> Point:
    config = triton_config.parse(config_text)
    delay = int(config.dynamic_batching.max_queue_delay_microseconds) if config.HasField("dynamic_batching") else None
    count = config.instance_group[0].count if config.instance_group else 1
    return Point(variant, config.max_batch_size, delay, int(count))


class TuneServer:
    """A Triton server with explicit model control over a private copy of the variants."""

    def __init__(self, repository: Path, variants: Sequence[str], concurrencies: Sequence[int],
                 measurement_ms: int = 3000, max_trials: int = 6) -> None:
        for variant in variants:
            if not (repository / variant / "config.pbtxt").is_file():
                raise BuilderError(f"tune: variant {variant} is not in {repository}; run `trtbuild engines` first")
        self.source = repository
        self.variants = list(variants)
        self.concurrencies = list(concurrencies)
        self.measurement = Measurement(measurement_ms=measurement_ms, max_trials=max_trials, warmup_requests=20)
        self.count = 0
        self.tmp: Path | None = None
        self.server: TritonServer | None = None

    def __enter__(self) -> TuneServer:
        self.tmp = Path(tempfile.mkdtemp(prefix="trtbuild-tune-"))
        try:
            repo = self.tmp / "repository"
            repo.mkdir()
            for variant in self.variants:
                shutil.copytree(self.source / variant, repo / variant)
            http, grpc, metrics = free_ports(3)
            self.server = TritonServer(repo, self.tmp / "state", Ports(http, grpc, metrics),
                                       model_control=ModelControl.EXPLICIT)
            self.server.start(timeout=120)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _post(self, path: str) -> None:
        assert self.server is not None, "use TuneServer as a context manager"
        request = urllib.request.Request(f"http://127.0.0.1:{self.server.ports.http}{path}", data=b"{}",
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=120):
                pass
        except urllib.error.HTTPError as exc:
            raise BuilderError(f"tune: {path} failed: {exc.read()[:300].decode('utf-8', 'replace')}") from exc

    def measure(self, point: Point) -> list[Result]:
        assert self.server is not None and self.tmp is not None, "use TuneServer as a context manager"
        ports = self.server.ports
        original = (self.source / point.variant / "config.pbtxt").read_text()
        write_atomic(self.tmp / "repository" / point.variant / "config.pbtxt", apply(original, point))
        self._post(f"/v2/repository/models/{point.variant}/load")
        config = session.SessionConfig(
            models=(point.variant,), url=f"127.0.0.1:{ports.grpc}",
            levels=tuple(LoadLevel(concurrency=c) for c in self.concurrencies), measurement=self.measurement,
            metrics_url=f"http://127.0.0.1:{ports.metrics}/metrics",
        )
        try:
            rows = session.run(config)
        except PerfClientError as exc:
            raise BuilderError(f"tune: measuring {point.label()} failed: {exc}; server log: "
                               f"{self.server.log_tail(3)}") from exc
        finally:
            self._post(f"/v2/repository/models/{point.variant}/unload")
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
        self.count += 1
        log.info("tune: %s -> %s", point.label(), ", ".join(
            f"c={r.concurrency} {r.throughput:.1f}/s p99 "
            + (f"{r.p99_us / 1e3:.1f} ms" if r.p99_us is not None else "-") for r in results))
        return results


@dataclass(frozen=True)
class MeasuredPoint:
    point: Point
    label: str
    feasible: bool
    results: list[Result]

    @property
    def throughput(self) -> float:
        return _throughput(self.results)

    @property
    def p99_ms(self) -> float | None:
        p99 = _p99(self.results)
        return p99 / 1e3 if math.isfinite(p99) else None


class Contender(Choice):
    """The configurations re-measured side by side at the end of a tuning run."""

    TUNED = "tuned"
    DEFAULT = "default"
    NO_BATCHING = "no dynamic batching"


@dataclass(frozen=True)
class Comparison:
    config: Contender
    label: str
    throughput: float
    p99_ms: float | None  # None: a concurrency completed no request
    feasible: bool


@dataclass
class TuneReport:
    objective: Objective
    space: Space
    search: Search
    measurements: int
    winner: Point | None
    default: Point
    points: list[MeasuredPoint] = field(default_factory=list)
    pareto: list[str] = field(default_factory=list)
    why: str = ""
    comparison: list[Comparison] = field(default_factory=list)
    seconds: float = 0.0


def write_winner(repository: Path, point: Point, *, wait: bool = True) -> Path:
    """Replace the variant's config.pbtxt atomically under the repository lock, keeping the previous
    one as a backup."""
    with repository_lock(repository, what=f"tune's winner for {point.variant}", wait=wait):
        target = repository / point.variant / "config.pbtxt"
        original = target.read_text()
        backup = target.with_name(f"config.pbtxt.bak-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.copy2(target, backup)
        write_atomic(target, apply(original, point))
    return backup


def explain(winner: Point, measured: dict[Point, list[Result]], objective: Objective, default: Point) -> str:
    w = measured[winner]
    parts = [f"{winner.label()} has the best {objective.goal} among the "
             f"{sum(objective.feasible(r) for r in measured.values())} feasible of {len(measured)} measured points"]
    if default in measured and default != winner:
        d = measured[default]
        parts.append(f"default {default.label()}: {_throughput(d):.1f}/s, p99 {_p99(d) / 1e3:.1f} ms"
                     + ("" if objective.feasible(d) else " (infeasible)"))
    parts.append(f"winner: {_throughput(w):.1f}/s, p99 {_p99(w) / 1e3:.1f} ms")
    return "; ".join(parts)


def report_points(measured: dict[Point, list[Result]], objective: Objective) -> list[MeasuredPoint]:
    return [MeasuredPoint(p, p.label(), objective.feasible(measured[p]), measured[p])
            for p in sorted(measured, key=Point.sort_key)]


def plot(path: Path, measured: dict[Point, list[Result]], front: list[Point], winner: Point | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = {p: rs for p, rs in measured.items() if math.isfinite(_p99(rs))}
    energy = all(r.infer_per_joule is not None for rs in shown.values() for r in rs)
    fig, axes = plt.subplots(1, 2 if energy else 1, figsize=(12 if energy else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for p, rs in shown.items():
        ax.scatter(_throughput(rs), _p99(rs) / 1e3, zorder=3,
                   c="tab:red" if p == winner else "tab:blue" if p in front else "lightgray")
    line = sorted((_throughput(measured[p]), _p99(measured[p]) / 1e3) for p in front)
    ax.plot([x for x, _ in line], [y for _, y in line], "b--", lw=1)
    ax.set_xlabel("throughput (inferences/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_title("measured points; blue: Pareto front, red: winner")
    ax.grid(True, alpha=0.3)
    if energy:
        ax2 = axes[0][1]
        for p, rs in shown.items():
            ax2.scatter(_throughput(rs), sum(r.infer_per_joule or 0.0 for r in rs) / len(rs),
                        c="tab:red" if p == winner else "tab:green")
        ax2.set_xlabel("throughput (inferences/s)")
        ax2.set_ylabel("inferences per joule")
        ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tune(repository: Path, space: Space, objective: Objective, *, search: Search, concurrencies: Sequence[int],
         measurement_ms: int, default_variant: str, report_path: Path | None, plot_path: Path | None,
         write: bool = True, compare: bool = True, max_trials: int = 6, wait: bool = True) -> TuneReport:
    started = time.perf_counter()
    for variant in space.variants:
        if not (repository / variant / "config.pbtxt").is_file():
            raise BuilderError(f"tune: variant {variant} has no config.pbtxt in {repository}; "
                               "run `trtbuild engines` first")
    default = point_of(default_variant, (repository / default_variant / "config.pbtxt").read_text())
    space = space.including(default)
    with TuneServer(repository, space.variants, concurrencies, measurement_ms, max_trials) as server:
        if search is Search.EXHAUSTIVE:
            measured = exhaustive(space, server.measure)
        else:
            measured = hill_climb(space, default, server.measure, objective)
        winner = best(measured, objective)
        count = server.count
        comparison: list[Comparison] = []
        if compare and winner is not None:
            # Side by side in one run: winner, the builder's default, and no dynamic batching.
            candidates = {Contender.TUNED: winner, Contender.DEFAULT: default,
                          Contender.NO_BATCHING: replace(default, queue_delay_us=None)}
            for name, point in candidates.items():
                rs = server.measure(point)
                p99 = _p99(rs)
                comparison.append(Comparison(name, point.label(), _throughput(rs),
                                             p99 / 1e3 if math.isfinite(p99) else None, objective.feasible(rs)))
    front = pareto(measured)
    report = TuneReport(objective, space, search, count, winner, default, report_points(measured, objective),
                        [p.label() for p in front],
                        explain(winner, measured, objective, default) if winner else "no point met the constraints",
                        comparison, round(time.perf_counter() - started, 1))
    if report_path is not None:
        write_json(report_path, asdict(report))
    if plot_path is not None:
        plot(plot_path, measured, front, winner)
    if winner is None:
        raise BuilderError(f"tune: none of the {len(measured)} measured points met the constraints "
                           f"(p99 budget {objective.p99_budget_us}, min throughput {objective.min_throughput}); "
                           "the repository is unchanged")
    if write:
        backup = write_winner(repository, winner, wait=wait)
        log.info("tune: wrote %s (previous config kept as %s)", repository / winner.variant / "config.pbtxt", backup)
    return report
