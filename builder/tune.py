"""Auto-tuning: measure serving configurations on a Triton server this process controls and pick
the best for an objective under constraints.

The search space is the product of variant x max_batch_size x dynamic-batching queue delay (or no
dynamic batching) x instance count. Every point is measured for real with perfclient's engine at
each requested concurrency. Exhaustive search measures every point; hill climbing starts from
the builder's default configuration and moves to the best measured neighbour (one parameter one
step away) while that improves the objective.
"""

from __future__ import annotations

import asyncio
import itertools
import json
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

from builder import triton_config
from builder.errors import BuilderError
from builder.repository import write_atomic
from builder.triton_server import Ports, TritonServer, free_ports
from client.errors import PerfClientError

log = logging.getLogger(__name__)

OBJECTIVES = ("throughput", "p99", "infer_per_joule")


@dataclass(frozen=True, order=True)
class Point:
    variant: str
    max_batch_size: int
    queue_delay_us: int  # -1: dynamic batching off
    instances: int

    def label(self) -> str:
        batching = "off" if self.queue_delay_us < 0 else f"{self.queue_delay_us}us"
        return f"{self.variant} mbs={self.max_batch_size} batching={batching} inst={self.instances}"


@dataclass
class Result:
    point: Point
    concurrency: int
    throughput: float
    p50_us: float
    p99_us: float
    infer_per_joule: float | None
    avg_batch: float
    stable: bool
    errors: int


@dataclass(frozen=True)
class Objective:
    goal: str = "throughput"
    p99_budget_us: float | None = None
    min_throughput: float | None = None

    def check(self) -> Objective:
        if self.goal not in OBJECTIVES:
            raise BuilderError(f"--objective {self.goal!r}: expected one of {', '.join(OBJECTIVES)}")
        return self

    def feasible(self, results: Sequence[Result]) -> bool:
        return bool(results) and all(
            r.errors == 0
            and (self.p99_budget_us is None or r.p99_us <= self.p99_budget_us)
            and (self.min_throughput is None or r.throughput >= self.min_throughput)
            for r in results
        )

    def value(self, results: Sequence[Result]) -> float:
        """Higher is better; the mean over the measured concurrencies."""
        if self.goal == "throughput":
            values = [r.throughput for r in results]
        elif self.goal == "p99":
            values = [-r.p99_us for r in results]
        else:
            if any(r.infer_per_joule is None for r in results):
                raise BuilderError("--objective infer_per_joule: no power source here (perfclient reports none)")
            values = [r.infer_per_joule or 0.0 for r in results]
        return sum(values) / len(values)

    def rank(self, results: Sequence[Result]) -> tuple[int, float]:
        """Feasible points first, then by value; infeasible ones by how far p99 is over budget."""
        if self.feasible(results):
            return (1, self.value(results))
        worst_p99 = max(r.p99_us for r in results) if results else math.inf
        return (0, -worst_p99)


@dataclass(frozen=True)
class Space:
    variants: tuple[str, ...]
    max_batch_sizes: tuple[int, ...]
    queue_delays_us: tuple[int, ...]  # -1 means dynamic batching off
    instances: tuple[int, ...]

    def points(self) -> list[Point]:
        return [Point(*p) for p in itertools.product(self.variants, self.max_batch_sizes, self.queue_delays_us,
                                                        self.instances)]

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
        best = max(space.neighbours(current), key=lambda p: objective.rank(measured[p]), default=current)
        if objective.rank(measured[best]) <= objective.rank(measured[current]):
            return measured
        current = best


def best(measured: dict[Point, list[Result]], objective: Objective) -> Point | None:
    feasible = [p for p, r in measured.items() if objective.feasible(r)]
    return max(feasible, key=lambda p: objective.value(measured[p])) if feasible else None


def pareto(measured: dict[Point, list[Result]]) -> list[Point]:
    """Points no other point beats on both mean throughput and worst p99."""
    stats = {p: (sum(r.throughput for r in rs) / len(rs), max(r.p99_us for r in rs)) for p, rs in measured.items()}
    return sorted(p for p, (t, lat) in stats.items()
                  if not any(t2 >= t and l2 <= lat and (t2, l2) != (t, lat) for t2, l2 in stats.values()))


def apply(config_text: str, point: Point) -> str:
    """The variant's config with the point's serving settings, through Triton's schema."""
    config = triton_config.parse(config_text)
    config.max_batch_size = point.max_batch_size
    config.instance_group[0].count = point.instances
    if point.queue_delay_us < 0:
        config.ClearField("dynamic_batching")
    else:
        config.dynamic_batching.max_queue_delay_microseconds = point.queue_delay_us
        del config.dynamic_batching.preferred_batch_size[:]
        if point.max_batch_size > 1:
            config.dynamic_batching.preferred_batch_size.append(point.max_batch_size)
    return triton_config.to_text(config)


def point_of(variant: str, config_text: str) -> Point:
    config = triton_config.parse(config_text)
    delay = config.dynamic_batching.max_queue_delay_microseconds if config.HasField("dynamic_batching") else -1
    count = config.instance_group[0].count if config.instance_group else 1
    return Point(variant, config.max_batch_size, int(delay), int(count))


class TuneServer:
    """A Triton server with explicit model control over a private copy of the variants."""

    def __init__(self, repository: Path, variants: Sequence[str], concurrencies: Sequence[int],
                 measurement_ms: int = 3000, max_trials: int = 6, extra_client_args: Sequence[str] = ()) -> None:
        self.source = repository
        self.tmp = Path(tempfile.mkdtemp(prefix="trtbuild-tune-"))
        self.repo = self.tmp / "repository"
        self.repo.mkdir()
        for variant in variants:
            if not (repository / variant / "config.pbtxt").is_file():
                raise BuilderError(f"--variants {variant}: not in {repository}; run `make engines` first")
            shutil.copytree(repository / variant, self.repo / variant)
        http, grpc, metrics = free_ports(3)
        self.server = TritonServer(self.repo, self.tmp / "state", Ports(http, grpc, metrics), model_control="explicit")
        self.concurrencies = list(concurrencies)
        self.measurement_ms = measurement_ms
        self.max_trials = max_trials
        self.extra_client_args = list(extra_client_args)
        self.count = 0

    def __enter__(self) -> TuneServer:
        self.server.start(timeout=120)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _post(self, path: str) -> None:
        request = urllib.request.Request(f"http://127.0.0.1:{self.server.ports.http}{path}", data=b"{}",
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=120):
                pass
        except urllib.error.HTTPError as exc:
            raise BuilderError(f"tune: {path} failed: {exc.read()[:300].decode('utf-8', 'replace')}") from exc

    def measure(self, point: Point) -> list[Result]:
        from client.cli import measure, parse_config

        original = (self.source / point.variant / "config.pbtxt").read_text()
        (self.repo / point.variant / "config.pbtxt").write_text(apply(original, point))
        self._post(f"/v2/repository/models/{point.variant}/load")
        results = []
        try:
            for concurrency in self.concurrencies:
                config, _ = parse_config([
                    "-m", point.variant, "-u", f"127.0.0.1:{self.server.ports.grpc}", "--concurrency", str(concurrency),
                    "--measurement-interval", str(self.measurement_ms), "--max-trials", str(self.max_trials),
                    "--metrics-url", f"http://127.0.0.1:{self.server.ports.metrics}/metrics", "--no-progress",
                    *self.extra_client_args,
                ])
                try:
                    (_, level), = asyncio.run(measure(config))
                except PerfClientError as exc:
                    raise BuilderError(f"tune: measuring {point.label()} failed: {exc}; server log: "
                                       f"{self.server.log_tail(3)}") from exc
                assert level.summary is not None
                results.append(Result(point, concurrency, level.summary.throughput, level.summary.latency_us["p50"],
                                      level.summary.latency_us["p99"],
                                      level.power.get("infer_per_j"),  # type: ignore[arg-type]
                                      level.server.get("avg_batch", 0.0), level.stable,
                                      sum(level.summary.errors.values())))
        finally:
            self._post(f"/v2/repository/models/{point.variant}/unload")
        self.count += 1
        log.info("tune: %s -> %s", point.label(),
                 ", ".join(f"c={r.concurrency} {r.throughput:.1f}/s p99 {r.p99_us / 1e3:.1f} ms" for r in results))
        return results


@dataclass
class TuneReport:
    objective: Objective
    space: Space
    search: str
    measurements: int
    winner: Point | None
    default: Point
    points: list[dict[str, Any]] = field(default_factory=list)
    pareto: list[str] = field(default_factory=list)
    why: str = ""
    comparison: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0


def write_winner(repository: Path, point: Point) -> Path:
    """Replace the variant's config.pbtxt atomically, keeping the previous one as a backup."""
    target = repository / point.variant / "config.pbtxt"
    original = target.read_text()
    backup = target.with_name(f"config.pbtxt.bak-{time.strftime('%Y%m%d-%H%M%S')}")
    shutil.copy2(target, backup)
    write_atomic(target, apply(original, point).encode())
    return backup


def explain(winner: Point, measured: dict[Point, list[Result]], objective: Objective, default: Point) -> str:
    w = measured[winner]
    parts = [f"{winner.label()} has the best {objective.goal} among the "
             f"{sum(objective.feasible(r) for r in measured.values())} feasible of {len(measured)} measured points"]
    if default in measured and default != winner:
        d = measured[default]
        parts.append(f"default {default.label()}: {sum(r.throughput for r in d) / len(d):.1f}/s, "
                     f"p99 {max(r.p99_us for r in d) / 1e3:.1f} ms"
                     + ("" if objective.feasible(d) else " (infeasible)"))
    parts.append(f"winner: {sum(r.throughput for r in w) / len(w):.1f}/s, p99 {max(r.p99_us for r in w) / 1e3:.1f} ms")
    return "; ".join(parts)


def report_points(measured: dict[Point, list[Result]], objective: Objective) -> list[dict[str, Any]]:
    return [{"point": asdict(p), "label": p.label(), "feasible": objective.feasible(rs),
             "results": [{k: v for k, v in asdict(r).items() if k != "point"} for r in rs]}
            for p, rs in sorted(measured.items())]


def plot(path: Path, measured: dict[Point, list[Result]], front: list[Point], winner: Point | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    energy = all(r.infer_per_joule is not None for rs in measured.values() for r in rs)
    fig, axes = plt.subplots(1, 2 if energy else 1, figsize=(12 if energy else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for p, rs in measured.items():
        t, l99 = sum(r.throughput for r in rs) / len(rs), max(r.p99_us for r in rs) / 1e3
        ax.scatter(t, l99, c="tab:red" if p == winner else "tab:blue" if p in front else "lightgray", zorder=3)
    line = sorted((sum(r.throughput for r in measured[p]) / len(measured[p]),
                   max(r.p99_us for r in measured[p]) / 1e3) for p in front)
    ax.plot([x for x, _ in line], [y for _, y in line], "b--", lw=1)
    ax.set_xlabel("throughput (inferences/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.set_title("measured points; blue: Pareto front, red: winner")
    ax.grid(True, alpha=0.3)
    if energy:
        ax2 = axes[0][1]
        for p, rs in measured.items():
            ax2.scatter(sum(r.throughput for r in rs) / len(rs),
                        sum(r.infer_per_joule or 0 for r in rs) / len(rs), c="tab:red" if p == winner else "tab:green")
        ax2.set_xlabel("throughput (inferences/s)")
        ax2.set_ylabel("inferences per joule")
        ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tune(repository: Path, space: Space, objective: Objective, search: str, concurrencies: Sequence[int],
         measurement_ms: int, default_variant: str, report_path: Path | None, plot_path: Path | None,
         write: bool = True, compare: bool = True, max_trials: int = 6) -> TuneReport:
    started = time.perf_counter()
    objective.check()
    if search not in ("exhaustive", "hill"):
        raise BuilderError(f"--search {search!r}: expected exhaustive or hill")
    default = point_of(default_variant, (repository / default_variant / "config.pbtxt").read_text())
    space = Space(space.variants, tuple(sorted(set(space.max_batch_sizes) | {default.max_batch_size})),
                  tuple(sorted(set(space.queue_delays_us) | {default.queue_delay_us})),
                  tuple(sorted(set(space.instances) | {default.instances})))
    with TuneServer(repository, space.variants, concurrencies, measurement_ms, max_trials) as server:
        if search == "exhaustive":
            measured = exhaustive(space, server.measure)
        else:
            measured = hill_climb(space, default, server.measure, objective)
        winner = best(measured, objective)
        count = server.count
        comparison: list[dict[str, Any]] = []
        if compare and winner is not None:
            # Side by side in one run: winner, the builder's default, and no dynamic batching.
            candidates = {"tuned": winner, "default": default,
                          "no dynamic batching": replace(default, queue_delay_us=-1)}
            for name, point in candidates.items():
                rs = server.measure(point)
                comparison.append({"config": name, "label": point.label(),
                                   "throughput": sum(r.throughput for r in rs) / len(rs),
                                   "p99_ms": max(r.p99_us for r in rs) / 1e3, "feasible": objective.feasible(rs)})
    front = pareto(measured)
    report = TuneReport(objective, space, search, count, winner, default, report_points(measured, objective),
                        [p.label() for p in front],
                        explain(winner, measured, objective, default) if winner else "no point met the constraints",
                        comparison, round(time.perf_counter() - started, 1))
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")
    if plot_path is not None:
        plot(plot_path, measured, front, winner)
    if winner is None:
        raise BuilderError(f"tune: none of the {len(measured)} measured points met the constraints "
                           f"(p99 budget {objective.p99_budget_us}, min throughput {objective.min_throughput}); "
                           "the repository is unchanged")
    if write:
        backup = write_winner(repository, winner)
        log.info("tune: wrote %s (previous config kept as %s)", repository / winner.variant / "config.pbtxt", backup)
    return report
