"""Open-loop arrivals (issue 26): every worker process draws its Poisson stream from its own seed, so
`--processes N --distribution poisson` sends one Poisson stream at the total rate; `--seed` makes the
schedule repeatable and is recorded in the JSON report. Schedules only: no server needed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from numpy.typing import NDArray

from client.arrivals import arrivals_seed, child, inputs_seed
from client.cli import parse_config
from client.engine import Distribution, LoadLevel, Measurement, send_times_ns
from client.report import document
from client.session import PowerSource, SessionConfig, run
from client.workers import merged_send_times_ns, shares
from tests.helpers.servers import Endpoints

RATE = 2000.0  # requests per second, over every process
SPAN_NS = 10e9  # 10 s of schedule: ~20 000 sends
POISSON = LoadLevel(request_rate=RATE, distribution=Distribution.POISSON)


def _ks_pvalue(times_ns: NDArray[np.float64], rate: float) -> float:
    """Kolmogorov–Smirnov p-value of the gaps between consecutive sends against the exponential at `rate`
    (numpy only: scipy is not a dependency): D = sup |F_n - F|, and Kolmogorov's asymptotic distribution
    with Stephens' small-sample correction."""
    gaps = np.sort(np.diff(times_ns))
    n = gaps.size
    cdf = 1.0 - np.exp(-gaps * rate / 1e9)
    d = max(float(np.max(np.arange(1, n + 1) / n - cdf)), float(np.max(cdf - np.arange(n) / n)))
    lam = (np.sqrt(n) + 0.12 + 0.11 / np.sqrt(n)) * d
    k = np.arange(1, 101)
    return float(np.clip(2 * np.sum((-1.0) ** (k - 1) * np.exp(-2 * k**2 * lam**2)), 0.0, 1.0))


def test_the_ks_check_itself() -> None:
    exponential = np.cumsum(np.random.default_rng(1).exponential(1e9 / RATE, size=5000))
    assert _ks_pvalue(exponential, RATE) > 0.05
    assert _ks_pvalue(exponential, RATE * 1.1) < 1e-3  # the wrong rate is seen
    assert _ks_pvalue(np.arange(5000) * 1e9 / RATE, RATE) < 1e-12  # constant gaps are no Poisson stream


@pytest.mark.parametrize("processes", [1, 4])
def test_merged_poisson_streams_are_poisson_at_the_total_rate(processes: int) -> None:
    times = merged_send_times_ns(POISSON, processes, arrivals_seed(20261125, 0, 0), SPAN_NS)
    assert len(times) == pytest.approx(RATE * SPAN_NS / 1e9, rel=0.05)
    assert _ks_pvalue(times, RATE) > 0.01
    # No two workers share a send time (the old design's phase-shifted copies shared every gap).
    assert len(np.unique(np.diff(times))) > 0.99 * (len(times) - 1)


def test_the_ks_check_rejects_one_seed_shared_by_every_worker() -> None:
    """The design before issue 26: each of 4 workers drew the same stream (seed 0), shifted by i/rate.
    Its merged gaps are far from exponential: the check above has the power to see it."""
    times = []
    for index, (level, offset_ns) in enumerate(shares(LoadLevel(request_rate=RATE), 4)):
        poisson = LoadLevel(request_rate=level.request_rate, distribution=Distribution.POISSON)
        times += [offset_ns + index * 1e9 / RATE + t for t in
                  itertools.takewhile(lambda t: t < SPAN_NS, send_times_ns(poisson, 0))]
    assert _ks_pvalue(np.sort(np.asarray(times)), RATE) < 1e-6


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    first = merged_send_times_ns(POISSON, 4, arrivals_seed(7, 0, 0), 1e9)
    np.testing.assert_array_equal(first, merged_send_times_ns(POISSON, 4, arrivals_seed(7, 0, 0), 1e9))
    for other in (arrivals_seed(8, 0, 0), arrivals_seed(7, 1, 0), arrivals_seed(7, 0, 1)):  # seed, model, level
        assert not np.array_equal(first[:100], merged_send_times_ns(POISSON, 4, other, 1e9)[:100])


def test_every_worker_model_and_purpose_gets_its_own_stream() -> None:
    level = arrivals_seed(3, 0, 0)
    states = {tuple(s.generate_state(4)) for s in
              (child(level, 0), child(level, 1), child(level, 2), inputs_seed(3, 0), inputs_seed(3, 1), level)}
    assert len(states) == 6
    # Keyed, not counted: asking twice gives the same child.
    assert child(level, 1).generate_state(4).tolist() == child(level, 1).generate_state(4).tolist()


def test_poisson_workers_start_together_and_constant_ones_interleave() -> None:
    assert [offset for _, offset in shares(POISSON, 4)] == [0.0] * 4
    assert [offset for _, offset in shares(LoadLevel(request_rate=RATE), 2)] == [0.0, 1e9 / RATE]


def test_the_seed_is_drawn_once_when_not_given_and_recorded_in_the_json() -> None:
    drawn = SessionConfig(models=("m",), url="localhost:8001")
    assert isinstance(drawn.seed, int) and 0 <= drawn.seed < 2**53
    assert document("m", drawn, [])["seed"] == drawn.seed
    assert SessionConfig(models=("m",), url="localhost:8001").seed != drawn.seed  # 1 in 2**48 to fail
    given = parse_config(["-m", "m", "--seed", "42", "--request-rate", "10", "--distribution", "poisson"])
    assert given.session.seed == 42 and document("m", given.session, [])["seed"] == 42


@pytest.mark.server
def test_worker_processes_send_their_poisson_streams(endpoints: Endpoints) -> None:
    """End to end: 2 worker processes, each with its seed crossing the process boundary."""
    measurement = Measurement(measurement_ms=500, stability_percentage=60, max_trials=3)
    level = LoadLevel(request_rate=100.0, distribution=Distribution.POISSON)
    (row,) = run(SessionConfig(models=("mlp_fp32",), url=endpoints.grpc, levels=(level,), measurement=measurement,
                               power_source=PowerSource.NONE, processes=2, seed=11))
    s = row.result.summary
    assert row.result.complete and s.errors == {} and s.requests == pytest.approx(100 * s.seconds, rel=0.5)
