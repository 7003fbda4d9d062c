"""optuna's Tree-structured Parzen Estimator: a fixed budget of points, seeded."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from builder.tuning.objective import Objective, score
from builder.tuning.points import Measure, Point, Result, Space
from builder.tuning.strategies.base import Strategy


@contextlib.contextmanager
def _optuna_quiet(optuna: Any) -> Iterator[None]:
    """optuna's verbosity at WARNING while the study runs, the caller's setting again after."""
    previous = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(previous)


def tpe(space: Space, start: Point, measure: Measure, objective: Objective, *, trials: int,
        seed: int = 0) -> dict[Point, list[Result]]:
    """optuna's TPE over the space's axes, starting from `start`: at most `trials` distinct points
    measured. The same seed and the same measured values give the same sequence of points."""
    import optuna  # imported here: only --search tpe pays for optuna

    with _optuna_quiet(optuna):  # its INFO line per trial, for this study only
        return _run(optuna, space, start, measure, objective, trials=trials, seed=seed)


def _run(optuna: Any, space: Space, start: Point, measure: Measure, objective: Objective, *, trials: int,
         seed: int) -> dict[Point, list[Result]]:
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(5, trials))
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.enqueue_trial({"variant": space.variants.index(start.variant),
                         "max_batch_size": space.max_batch_sizes.index(start.max_batch_size),
                         "queue_delay_us": space.queue_delays_us.index(start.queue_delay_us),
                         "instances": space.instances.index(start.instances)})
    budget = min(trials, len(space.points()))
    measured: dict[Point, list[Result]] = {}
    asked = 0
    # A sampler proposes measured points again; those are answered from what was measured (no new
    # measurement), and a generous cap on proposals ends a search that keeps repeating itself.
    while len(measured) < budget and asked < budget * 20:
        asked += 1
        trial = study.ask()
        # Categorical over each axis's index: the values keep their types (None: batching off).
        point = Point(space.variants[trial.suggest_categorical("variant", list(range(len(space.variants))))],
                      space.max_batch_sizes[trial.suggest_categorical("max_batch_size",
                                                                      list(range(len(space.max_batch_sizes))))],
                      space.queue_delays_us[trial.suggest_categorical("queue_delay_us",
                                                                      list(range(len(space.queue_delays_us))))],
                      space.instances[trial.suggest_categorical("instances", list(range(len(space.instances))))])
        if point not in measured:
            measured[point] = measure(point)
        study.tell(trial, score(objective, measured[point]))
    return measured



STRATEGY = Strategy(search=tpe, budget=lambda space, trials: min(trials, len(space.points())), starts_at_default=True)
