"""`trtbuild tune`'s run: search a space on a server, compare the pick side by side, write it and report."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, replace
from pathlib import Path

from builder.errors import BuilderError, ServerError
from builder.repository import tuned_serving
from builder.repository.model_folder import load_shapes
from builder.tuning.control import Endpoints
from builder.tuning.energy import require_gpus, require_power
from builder.tuning.journal import planned_changes, tuned_entry, write_winner
from builder.tuning.measure import Tuner
from builder.tuning.objective import Goal, Objective, best, pareto
from builder.tuning.outputs import write_outputs
from builder.tuning.points import Point, Space, mean_throughput, point_of, worst_p99
from builder.tuning.report import Comparison, Contender, TuneReport, explain, report_points
from builder.tuning.strategies import Search, strategy
from builder.tuning.targets import LocalTarget, RemoteTarget, Target, read_configs
from common import progress

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TuneConfig:
    """One tuning run, built once by the CLI (or a bench script)."""

    repository: Path
    space: Space
    objective: Objective
    _: KW_ONLY
    search: Search
    concurrencies: Sequence[int]
    measurement_ms: int
    default_variant: str  # where hill climbing and TPE start, and the side-by-side's "default"
    report_path: Path | None = None
    plot_path: Path | None = None
    html_path: Path | None = None
    write: bool = True  # False: --dry-run (the report's `changes` say what would be written)
    compare: bool = True  # re-measure the winner, the default and no dynamic batching side by side
    max_trials: int = 6  # perfclient's windows per concurrency
    wait: bool = True  # wait for the repository lock rather than fail
    attach: Endpoints | None = None  # a running server to tune (--url); None: a private one
    model: str | None = None  # the models.toml entry whose tuned.toml entry is written
    tuned_toml: Path | None = None
    trials: int = 12  # TPE's budget of points
    seed: int = 0
    point_timeout_s: float | None = None  # None: from the concurrencies and windows
    gpus: tuple[str, ...] | None = None  # the GPUs whose energy counts (--gpus)
    # A grid search also measures the as-built instance count (4 per GPU for the python runner on CUDA, outside
    # tune's default 1,2), so it never writes an unmeasured count over it; False where the user named the counts.
    measure_built_instances: bool = False
    # The private server under CUDA MPS (True), not (False), or as `trtbuild serve` decides by itself (None).
    mps: bool | None = False

    def __post_init__(self) -> None:
        for name in ("measurement_ms", "max_trials", "trials"):
            if getattr(self, name) < 1:
                raise ValueError(f"TuneConfig.{name} {getattr(self, name)}: expected a positive integer")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"TuneConfig.concurrencies {list(self.concurrencies)}: expected positive integers")


def tune(config: TuneConfig) -> TuneReport:
    """Search the config's space for its objective; write the winner (config.pbtxt, build.json, and
    `tuned_toml`'s entry for `model`) unless `write` is False. With `attach`, measure on that running
    server and leave it serving the winner."""
    started = time.perf_counter()
    space = config.space
    if config.objective.goal is Goal.INFER_PER_JOULE:
        require_power(config.attach)  # before a server starts: without energy readings no point has a value
    if config.gpus:
        require_gpus(config.attach, config.gpus)  # before a server starts: each point's session would refuse them
    configs = read_configs(config.repository, space.variants)
    # The builder's own settings (build.json keeps them once a tune replaced them): where hill climbing
    # and TPE start, and the "default" of the side-by-side comparison.
    built = tuned_serving.as_built(config.repository / config.default_variant)
    default = (point_of(config.default_variant, configs[config.default_variant]) if built is None
               else Point(config.default_variant, built.max_batch_size, built.queue_delay_us, built.instances))
    limit = min(tuned_serving.max_batch_limit(config.repository / v) for v in space.variants)
    search = strategy(config.search)
    if search.starts_at_default:
        space = space.including(default)  # where hill climbing and TPE start
    elif config.measure_built_instances:
        space = space.with_instances(default.instances)
    space = space.bounded(limit)
    target: Target = (LocalTarget(config.repository, space.variants, mps=config.mps) if config.attach is None
                      else RemoteTarget(config.attach, config.repository, space.variants))
    comparison: list[Comparison] = []
    partial: str | None = None
    unwritten: str | None = None
    count: int | None = None
    winner: Point | None = None
    changes: list[str] = []
    with target:
        tuner = Tuner(target, config.concurrencies, measurement_ms=config.measurement_ms,
                      max_trials=config.max_trials, point_timeout_s=config.point_timeout_s, gpus=config.gpus,
                      shapes={v: load_shapes(config.repository / v) for v in space.variants})
        measured = tuner.measured
        try:
            # Points (and their perfclient windows) show inside: plain lines only for the search as a whole.
            total = search.budget(space, config.trials)
            with progress.task(f"tune: {config.search} search", total=total, loop=True) as tuner.search_bar:
                search.search(space, default, tuner.measure, config.objective, trials=config.trials, seed=config.seed)
            winner = best(measured, config.objective)
            count = tuner.count  # the search's measurements (the side-by-side ones come after)
            if config.compare and winner is not None:
                # Side by side in one run: winner, the builder's default, and no dynamic batching.
                candidates = {Contender.TUNED: winner, Contender.DEFAULT: default,
                              Contender.NO_BATCHING: replace(default, queue_delay_us=None)}
                with progress.task("tune: side by side", total=len(candidates)) as bar:
                    for name, point in candidates.items():
                        rs = tuner.remeasure(point)
                        bar.advance(status=str(name))
                        p99 = worst_p99(rs)
                        comparison.append(Comparison(name, point.label(), mean_throughput(rs),
                                                     p99 / 1e3 if math.isfinite(p99) else None,
                                                     config.objective.feasible(rs)))
            if winner is not None:
                entry = (tuned_entry(config.model, winner, measured[winner], config.objective, config.search)
                         if config.model else None)
                toml = config.tuned_toml if config.model else None
                changes = planned_changes(config.repository, winner, tuned=entry, tuned_toml=toml)
                if config.write:
                    written = write_winner(config.repository, winner, wait=config.wait, tuned=entry, tuned_toml=toml)
                    log.info("tune: wrote %s%s (the report's `changes` hold the diff from the previous one)",
                             written, f" and {toml}" if toml else "")
                    target.apply(winner)
        except ServerError as exc:
            partial = str(exc)
            raise
        except KeyboardInterrupt:
            partial = "interrupted"
            raise
        except Exception as exc:  # any other end before the search's: still a run cut short, said so
            partial = str(exc) or type(exc).__name__
            raise
        finally:
            front = pareto(measured)
            report = TuneReport(
                config.objective, space, config.search, tuner.count if count is None else count, winner, default,
                report_points(measured, config.objective, tuner.failures, tuner.restarts), [p.label() for p in front],
                explain(winner, measured, config.objective, default) if winner else
                # A run cut short has no pick even where its measured points met the constraints.
                f"no pick: the run stopped before the search ended ({partial})" if partial else
                "no point met the constraints",
                comparison, round(time.perf_counter() - started, 1), failed=len(tuner.failures),
                attached=config.attach.http if config.attach else None, changes=changes, partial=partial,
                restarts=sum(map(len, tuner.restarts.values())), mps=target.mps_used,
                mps_note=target.mps_note)
            unwritten = write_outputs(report, config.report_path, config.plot_path, measured, front, config.html_path)
    if unwritten:
        raise BuilderError(unwritten)
    if winner is None:
        failed = f", {len(tuner.failures)} failed" if tuner.failures else ""
        raise BuilderError(f"tune: none of the {len(measured)} measured points{failed} met the constraints "
                           f"(p99 budget {config.objective.p99_budget_us}, "
                           f"min throughput {config.objective.min_throughput}); the repository is unchanged")
    return report
