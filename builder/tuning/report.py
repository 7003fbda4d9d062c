"""What a tuning run reports: each measured point, the side-by-side comparison, why the pick won, and
writing the JSON report, the plot and the HTML page."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from builder.tuning.objective import Goal, Objective
from builder.tuning.points import Point, Result, Space, energy_note, mean_throughput, worst_p99
from builder.tuning.strategies import Search
from common.choices import Choice

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeasuredPoint:
    point: Point
    label: str
    feasible: bool
    results: list[Result]
    failure: str | None = None  # why the point failed to load, timed out or completed nothing
    restarts: list[str] = field(default_factory=list)  # each time the server died measuring it, and what was done

    @property
    def throughput(self) -> float:
        return mean_throughput(self.results)

    @property
    def p99_ms(self) -> float | None:
        p99 = worst_p99(self.results)
        return p99 / 1e3 if math.isfinite(p99) else None

    @property
    def infer_per_joule(self) -> float | None:
        """The mean over the concurrencies whose energy is known; None when none is."""
        known = [r.infer_per_joule for r in self.results if r.infer_per_joule is not None]
        return sum(known) / len(known) if known else None

    # "energy unknown" (where) when some concurrency has no inferences per joule (energy_note); set from `results`.
    energy: str | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "energy", energy_note(self.results))


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
    failed: int = 0
    attached: str | None = None  # the server's HTTP address in attach mode
    changes: list[str] = field(default_factory=list)  # unified diffs of what was (or, dry run, would be) written
    partial: str | None = None  # why the run stopped early, when it did
    restarts: int = 0  # times the private server died mid-point and was started again (each point's note says)
    mps: bool = False  # the private server ran under a CUDA MPS daemon, as `trtbuild serve` serves by default on a GPU
    mps_note: str | None = None  # why it did not where it would have by default (no daemon binary, one that failed)


def explain(winner: Point, measured: dict[Point, list[Result]], objective: Objective, default: Point) -> str:
    w = measured[winner]
    parts = [f"{winner.label()} has the best {objective.goal} among the "
             f"{sum(objective.feasible(r) for r in measured.values())} feasible of {len(measured)} measured points"]
    if default in measured and default != winner:
        d = measured[default]
        p99 = worst_p99(d)
        parts.append(f"default {default.label()}: {mean_throughput(d):.1f}/s, p99 "
                     + (f"{p99 / 1e3:.1f} ms" if math.isfinite(p99) else "-")
                     + ("" if objective.feasible(d) else " (infeasible)"))
    parts.append(f"winner: {mean_throughput(w):.1f}/s, p99 {worst_p99(w) / 1e3:.1f} ms")
    return "; ".join(parts)


def energy_gaps(report: TuneReport) -> list[MeasuredPoint]:
    """The points whose energy is unknown, where energy counts: the objective is inferences per joule, or
    some point has its figure (without any power source every point lacks it, and that is no news)."""
    counts = report.objective.goal is Goal.INFER_PER_JOULE or any(m.infer_per_joule is not None for m in report.points)
    return [m for m in report.points if m.energy] if counts else []


def report_points(measured: dict[Point, list[Result]], objective: Objective,
                  failures: dict[Point, str], restarts: Mapping[Point, list[str]] | None = None) -> list[MeasuredPoint]:
    return [MeasuredPoint(p, p.label(), objective.feasible(measured[p]), measured[p], failures.get(p),
                          list((restarts or {}).get(p, [])))
            for p in sorted(measured, key=Point.sort_key)]
