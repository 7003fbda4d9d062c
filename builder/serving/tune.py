"""Auto-tuning: search the serving settings (variant, max batch, dynamic-batching delay, instances) of
one model on a real Triton, measured through perfclient's library.

The server is either a private one started here over a copy of the repository (explicit model
control), or a running one the user names (`--url`, attach mode, as Model Analyzer's remote mode):
each point is loaded with a config override through the repository API, measured, and the models
are restored at the end. A point that fails to load, times out or completes no request is recorded
as failed with its reason, and the search goes on.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import html
import io
import ipaddress
import itertools
import json
import logging
import math
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from builder.errors import BuilderError, ServerError
from builder.repository import triton_config
from builder.repository.lock import repository_lock
from builder.repository.model_folder import read_record
from builder.repository.untrusted import MAX_CONFIG_BYTES, check_tree, read_text
from builder.serving.exposure import KEY_HEADER
from builder.serving.triton_server import ModelControl, Ports, TritonServer, exit_text, free_ports
from builder.spec import tuned as tuned_file
from builder.spec.tuned import TunedServing
from client import power, progress, session
from client.choices import Choice
from client.engine import LoadLevel, Measurement
from client.errors import PerfClientError
from client.files import write_atomic, write_json
from client.session import ModelResult

log = logging.getLogger(__name__)


class Goal(Choice):
    THROUGHPUT = "throughput"
    P99 = "p99"
    INFER_PER_JOULE = "infer_per_joule"


class Search(Choice):
    HILL = "hill"
    EXHAUSTIVE = "exhaustive"
    TPE = "tpe"  # optuna's Tree-structured Parzen Estimator: a fixed budget of points, seeded


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


def energy_note(results: Sequence[Result]) -> str | None:
    """"energy unknown" (at which concurrencies, when only some) for results without inferences per joule
    (a window whose energy read failed or did not advance); None when every one has its figure."""
    missing = [r.concurrency for r in results if r.infer_per_joule is None]
    if not missing:
        return None
    if len(missing) == len(results):
        return "energy unknown"
    return f"energy unknown at concurrency {', '.join(map(str, missing))}"


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
        """Higher is better; the mean over the measured concurrencies. Inferences per joule: the mean over
        the concurrencies whose energy is known (energy_note says which are not), -inf when none is: such a
        point ranks below every point with a figure, never aborts the run."""
        if self.goal is Goal.THROUGHPUT:
            return _throughput(results)
        if self.goal is Goal.P99:
            return -_mean_p99(results)
        per_joule = [r.infer_per_joule for r in results if r.infer_per_joule is not None]
        return sum(per_joule) / len(per_joule) if per_joule else -math.inf

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

    def bounded(self, limit: int) -> Space:
        """This space without the max batch sizes over `limit` (what the engine or its TensorRT profile
        takes); the limit itself stands in when every value was over it. A model built without batching
        (max_batch_size 0) has one setting: no batch dim, no dynamic batching."""
        if limit == 0:
            log.info("tune: the model does not batch (max_batch_size 0): only instances are searched")
            return replace(self, max_batch_sizes=(0,), queue_delays_us=(None,))
        kept = tuple(b for b in self.max_batch_sizes if b <= limit)
        dropped = sorted(set(self.max_batch_sizes) - set(kept))
        if dropped:
            log.info("tune: max batch %s left out: the engine takes batches of at most %d",
                     ", ".join(map(str, dropped)), limit)
        return replace(self, max_batch_sizes=kept or (limit,))

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


def score(objective: Objective, results: Sequence[Result]) -> float:
    """One number for a sampler to maximize: a feasible point's value, else far below every feasible
    one and ordered by how far p99 is over (a point that completed nothing lowest)."""
    feasible, value = objective.rank(results)
    if feasible:
        return value if math.isfinite(value) else -1e14  # energy unknown: below every figure, above infeasible
    over = -value  # the worst p99 in µs, infinite when a concurrency completed nothing
    return -1e15 - (min(over, 1e12) if math.isfinite(over) else 1e12)


def tpe(space: Space, start: Point, measure: Measure, objective: Objective, *, trials: int,
        seed: int = 0) -> dict[Point, list[Result]]:
    """optuna's TPE over the space's axes, starting from `start`: at most `trials` distinct points
    measured. The same seed and the same measured values give the same sequence of points."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
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


def best(measured: dict[Point, list[Result]], objective: Objective) -> Point | None:
    feasible = [p for p, r in measured.items() if objective.feasible(r)]
    # Ties (points whose energy is unknown) go to the higher throughput.
    return (max(feasible, key=lambda p: (objective.value(measured[p]), _throughput(measured[p]))) if feasible
            else None)


def pareto(measured: dict[Point, list[Result]]) -> list[Point]:
    """Points no other point beats on both mean throughput and worst p99 (points that completed nothing
    are on no front)."""
    stats = {p: (_throughput(rs), _p99(rs)) for p, rs in measured.items() if math.isfinite(_p99(rs))}
    front = [p for p, (t, lat) in stats.items()
             if not any(t2 >= t and l2 <= lat and (t2, l2) != (t, lat) for t2, l2 in stats.values())]
    return sorted(front, key=Point.sort_key)


def serving(point: Point) -> tuned_file.Serving:
    return tuned_file.Serving(point.max_batch_size, point.queue_delay_us, point.instances)


def apply(config_text: str, point: Point) -> str:
    """The variant's config with the point's serving settings, through Triton's schema."""
    return tuned_file.configure(config_text, serving(point))


def point_of(variant: str, config_text: str) -> Point:
    s = tuned_file.serving_of(config_text)
    return Point(variant, s.max_batch_size, s.queue_delay_us, s.instances)


# --- the server a tuning run measures -----------------------------------------------------------------
class Rejected(ServerError):
    """The server answered a repository request with an error (a model that does not load)."""


class ServerDied(ServerError):
    """The private tuning server's process ended while a point was loading, measured or unloading."""

    def __init__(self, label: str, *, how: str, stage: str, where: str) -> None:
        self.label, self.how, self.stage = label, how, stage  # how: exit_text(); stage: loading, measuring...
        super().__init__(f"tune: the tuning server {how} while {stage} {label}; see {where}")


class Http:
    """Triton's HTTP API for control requests: every failure is one line naming the URL."""

    def __init__(self, base: str, key: str | None = None) -> None:
        self.base = base.rstrip("/") if "://" in base else f"http://{base.rstrip('/')}"
        self.key = key  # the admin key of a server whose repository API is restricted (exposure.py)

    def request(self, path: str, body: dict[str, Any] | None = None, *, timeout: float = 30.0) -> Any:
        url = f"{self.base}{path}"
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **({KEY_HEADER: self.key} if self.key else {})}
        request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as exc:
            text = exc.read()[:600].decode("utf-8", "replace")
            with contextlib.suppress(ValueError, AttributeError):  # Triton's {"error": "..."}
                text = str(json.loads(text).get("error", text))
            raise Rejected(f"{url}: HTTP {exc.code}: {text.strip()}") from exc
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerError(f"{url}: no answer ({reason or type(exc).__name__})") from exc
        if not payload:
            return None
        try:
            return json.loads(payload)
        except ValueError:
            return None

    def live(self) -> bool:
        try:
            self.request("/v2/health/live", timeout=5.0)
        except ServerError:
            return False
        return True


@dataclass(frozen=True)
class Endpoints:
    """A running Triton: its HTTP (repository API), gRPC (measured) and metrics addresses."""

    http: str  # HOST:PORT
    grpc: str  # HOST:PORT
    metrics: str | None = None  # http://HOST:PORT/metrics; None: the gRPC host's port 8002
    key: str | None = field(default=None, repr=False)  # sent as triton-admin-key on repository requests


def _configs(repository: Path, variants: Sequence[str]) -> dict[str, str]:
    texts = {}
    for variant in variants:
        path = repository / variant / "config.pbtxt"
        if not path.is_file():
            raise BuilderError(f"--precisions: variant {variant} is not in {repository}; "
                               "run `trtbuild engines` first")
        # Untrusted: the folder is copied for a private server (a symlink out of it would copy what it names).
        check_tree(repository / variant)
        texts[variant] = read_text(path, limit=MAX_CONFIG_BYTES, root=repository)
    return texts


class Target:
    """Loads a point's config on a server with explicit model control, and unloads it."""

    endpoints: Endpoints
    http: Http
    originals: dict[str, str]  # each variant's config.pbtxt as the repository holds it

    def load(self, point: Point) -> None:
        raise NotImplementedError

    def unload(self, variant: str) -> None:
        self.http.request(f"/v2/repository/models/{variant}/unload", {}, timeout=120.0)

    def where(self) -> str:
        """Where to look when the server misbehaves."""
        return f"the server at {self.endpoints.http}"

    def died(self, wait_s: float = 0.0) -> str | None:
        """How the server's process ended (exit_text) when this target runs it and it has, waiting up to
        `wait_s` for it to finish dying; None while it runs, and always for a server this target does not
        run (attach mode: it cannot tell)."""
        return None

    def restart(self) -> None:
        """Start the server again after it died (only a target that runs its own server can)."""
        raise ServerError(f"tune: cannot restart {self.where()}: it is not ours")

    def apply(self, point: Point) -> None:
        """Leave the server serving `point` (attach mode: the tuned config on the user's server)."""

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class LocalTarget(Target):
    """A private Triton (explicit model control) over a temporary copy of the variants."""

    def __init__(self, repository: Path, variants: Sequence[str]) -> None:
        self.originals = _configs(repository, variants)  # before any folder exists: nothing to clean
        self.source = repository
        self.tmp: Path | None = None
        self.server: TritonServer | None = None

    def __enter__(self) -> LocalTarget:
        self.tmp = Path(tempfile.mkdtemp(prefix="trtbuild-tune-"))
        try:
            repo = self.tmp / "repository"
            repo.mkdir()
            for variant in self.originals:
                shutil.copytree(self.source / variant, repo / variant)
            http, grpc, metrics = free_ports(3)
            self.server = TritonServer(repo, self.tmp / "state", Ports(http, grpc, metrics),
                                       model_control=ModelControl.EXPLICIT)
            self.endpoints = Endpoints(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}",
                                       f"http://127.0.0.1:{metrics}/metrics")
            self.http = Http(self.endpoints.http)
            self.server.start(timeout=120)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.server is not None:
                self.server.stop()
        finally:
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            self.server = self.tmp = None

    def load(self, point: Point) -> None:
        assert self.tmp is not None, "use LocalTarget as a context manager"
        write_atomic(self.tmp / "repository" / point.variant / "config.pbtxt",
                     apply(self.originals[point.variant], point))
        self._while_running(point.label(), lambda: self.http.request(f"/v2/repository/models/{point.variant}/load", {},
                                                             timeout=300.0))

    def unload(self, variant: str) -> None:
        self._while_running(variant, lambda: Target.unload(self, variant), stage="unloading")

    def died(self, wait_s: float = 0.0) -> str | None:
        process = self.server.process if self.server is not None else None
        if process is None:
            return None
        if wait_s > 0:  # Triton's handler of a fatal signal prints a stack (and the kernel may dump a core) first
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=wait_s)
        code = process.poll()
        return None if code is None else exit_text(code)

    def restart(self) -> None:
        """A fresh server over the same repository copy, on new ports (the dead one's stubs may still
        hold its sockets until stop() has cleaned them)."""
        assert self.server is not None and self.tmp is not None, "use LocalTarget as a context manager"
        old = self.server
        old.stop()  # reaps it, removes its record, stops the stubs it left and frees their /dev/shm regions
        http, grpc, metrics = free_ports(3)
        self.server = TritonServer(old.repository, old.state_dir, Ports(http, grpc, metrics),
                                   model_control=ModelControl.EXPLICIT)
        self.endpoints = Endpoints(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics")
        self.http = Http(self.endpoints.http)
        self.server.start(timeout=120)

    def _while_running(self, label: str, call: Callable[[], object], stage: str = "loading") -> None:
        """Run a repository request, but stop waiting when the server process exits. A server killed
        mid-load (a backend's crash, the OOM killer) does not close the request's connection: its
        python-backend stubs inherit the socket and keep it open, so the request would wait its whole
        timeout (minutes) for an answer that cannot come."""
        assert self.server is not None and self.server.process is not None
        process = self.server.process
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                call()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, raised there
                outcome.append(exc)
            else:
                outcome.append(None)

        worker = threading.Thread(target=run, name="tune-load", daemon=True)
        worker.start()
        while not outcome:
            worker.join(0.2)
            if not outcome and process.poll() is not None:
                raise ServerDied(label, how=exit_text(process.returncode), stage=stage,
                                 where=self.where())
        if outcome[0] is not None:
            raise outcome[0]

    def where(self) -> str:
        assert self.server is not None
        crash = self.server.crash_lines() if self.died() is not None else []
        if crash:  # Triton's report of the fatal signal, with its first stack frames
            return f"what the tuning server wrote ({' | '.join(crash)})"
        return f"the tuning server's log ({self.server.log_tail(2)})"


class RemoteTarget(Target):
    """A running Triton started with explicit model control (attach mode): each point is loaded with a
    config override; at the end each variant is restored (reloaded from its repository if it was
    loaded before, unloaded if not), and `apply` leaves the winner loaded with its config."""

    def __init__(self, endpoints: Endpoints, repository: Path, variants: Sequence[str]) -> None:
        self.originals = _configs(repository, variants)
        self.endpoints = endpoints
        self.http = Http(endpoints.http, endpoints.key)
        self.loaded_before: set[str] = set()
        self.touched: set[str] = set()
        self.applied: str | None = None

    def __enter__(self) -> RemoteTarget:
        try:
            self.http.request("/v2/health/ready", timeout=10.0)
        except ServerError as exc:
            raise ServerError(f"--url {self.endpoints.http}: Triton is not ready ({exc})") from exc
        index = self.http.request("/v2/repository/index", {}, timeout=30.0) or []
        self.loaded_before = {str(m.get("name")) for m in index if isinstance(m, dict) and m.get("state") == "READY"}
        return self

    def _load(self, variant: str, config_text: str | None) -> None:
        body: dict[str, Any] = {}
        if config_text is not None:
            config = json_format.MessageToJson(triton_config.parse(config_text), preserving_proto_field_name=True)
            body = {"parameters": {"config": config}}
        try:
            self.http.request(f"/v2/repository/models/{variant}/load", body, timeout=300.0)
        except Rejected as exc:
            if "not allowed" in str(exc):
                raise ServerError(f"--url {self.endpoints.http}: the server does not load models on request; "
                                  "start it with explicit model control (`trtbuild serve --model-control "
                                  "explicit`, or tritonserver --model-control-mode=explicit)") from exc
            raise

    def load(self, point: Point) -> None:
        self.touched.add(point.variant)
        self._load(point.variant, apply(self.originals[point.variant], point))

    def apply(self, point: Point) -> None:
        self.touched.add(point.variant)
        self._load(point.variant, apply(self.originals[point.variant], point))
        self.applied = point.variant
        log.info("tune: %s now serves %s", self.endpoints.http, point.label())

    def __exit__(self, *exc: object) -> None:
        for variant in sorted(self.touched - {self.applied}):
            try:
                if variant in self.loaded_before:
                    self._load(variant, None)  # the repository's own config again
                else:
                    self.unload(variant)
            except ServerError as error:
                log.warning("tune: could not restore %s on %s: %s", variant, self.endpoints.http, error)


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


def load_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """The shapes a variant's requests take where its config.pbtxt leaves dims free (-1): each such
    input's opt shape from build.json, without the batch axis for a batching model and whole for one
    built with max_batch_size 0. Empty for a record without shapes (an older build)."""
    record = read_record(model_dir)
    if record is None or record.shapes is None:
        return {}
    shapes = record.shapes
    return {name: shapes.sample_range(name).opt for name in shapes.inputs if -1 in shapes.config_dims(name)}


@contextlib.contextmanager
def TuneServer(repository: Path, variants: Sequence[str], concurrencies: Sequence[int],
               measurement_ms: int = 3000, max_trials: int = 6) -> Iterator[Tuner]:
    """A private server over a copy of the variants and a tuner on it (bench scripts use this)."""
    with LocalTarget(repository, variants) as target:
        yield Tuner(target, concurrencies, measurement_ms=measurement_ms, max_trials=max_trials,
                    shapes={v: load_shapes(repository / v) for v in variants})


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
        return _throughput(self.results)

    @property
    def p99_ms(self) -> float | None:
        p99 = _p99(self.results)
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


def explain(winner: Point, measured: dict[Point, list[Result]], objective: Objective, default: Point) -> str:
    w = measured[winner]
    parts = [f"{winner.label()} has the best {objective.goal} among the "
             f"{sum(objective.feasible(r) for r in measured.values())} feasible of {len(measured)} measured points"]
    if default in measured and default != winner:
        d = measured[default]
        p99 = _p99(d)
        parts.append(f"default {default.label()}: {_throughput(d):.1f}/s, p99 "
                     + (f"{p99 / 1e3:.1f} ms" if math.isfinite(p99) else "-")
                     + ("" if objective.feasible(d) else " (infeasible)"))
    parts.append(f"winner: {_throughput(w):.1f}/s, p99 {_p99(w) / 1e3:.1f} ms")
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


def plot_png(measured: dict[Point, list[Result]], front: list[Point], winner: Point | None) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = {p: rs for p, rs in measured.items() if math.isfinite(_p99(rs))}
    energy = bool(shown) and all(r.infer_per_joule is not None for rs in shown.values() for r in rs)
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
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=110, format="png")
    plt.close(fig)
    return buffer.getvalue()


def html_report(report: TuneReport, png: bytes | None) -> str:
    """One self-contained page: the pick and why, the side-by-side, the plot (inline) and every point."""
    e = html.escape

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    objective = report.objective
    constraints = [f"p99 ≤ {objective.p99_budget_us / 1e3:g} ms"] if objective.p99_budget_us is not None else []
    if objective.min_throughput is not None:
        constraints.append(f"throughput ≥ {objective.min_throughput:g}/s")
    front = set(report.pareto)
    gaps = {m.label for m in energy_gaps(report)}

    def per_joule(m: MeasuredPoint) -> str:
        figure = "-" if m.infer_per_joule is None else f"{m.infer_per_joule:.2f}"
        return figure if m.label not in gaps else e(f"{figure}; {m.energy}" if m.infer_per_joule else str(m.energy))

    rows = "".join(
        f"<tr class='{'win' if report.winner == m.point else 'front' if m.label in front else ''}'>"
        f"<td>{e(m.label)}</td><td>{m.throughput:.1f}</td><td>{ms(m.p99_ms)}</td><td>{per_joule(m)}</td>"
        f"<td>{'yes' if m.feasible else 'no'}</td><td>{'yes' if m.label in front else ''}</td>"
        f"<td>{e('; '.join(filter(None, [m.failure, *m.restarts])))}</td></tr>" for m in report.points)
    compared = "".join(f"<tr><td>{e(str(c.config))}</td><td>{e(c.label)}</td><td>{c.throughput:.1f}</td>"
                       f"<td>{ms(c.p99_ms)}</td><td>{'meets' if c.feasible else 'misses'}</td></tr>"
                       for c in report.comparison)
    image = "" if png is None else ("<img alt='points and Pareto front' src='data:image/png;base64,"
                                    f"{base64.b64encode(png).decode()}'>")
    where = f", on {e(report.attached)}" if report.attached else ""
    partial = f"<p class='partial'>Partial run: {e(report.partial)}</p>" if report.partial else ""
    winner = e(report.winner.label()) if report.winner else "none"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>trtbuild tune: {winner}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:70em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:right}}td:first-child{{text-align:left}}
tr.win{{background:#fdd}}tr.front{{background:#def}}.partial{{color:#a00;font-weight:bold}}img{{max-width:100%}}</style>
</head><body>
<h1>trtbuild tune</h1>{partial}
<p>Objective: {e(str(objective.goal))}{' under ' + e(', '.join(constraints)) if constraints else ''};
{e(str(report.search))} search, {report.measurements} measurements ({report.failed} failed) in \
{report.seconds:.0f} s{where}.</p>
<h2>Pick: {winner}</h2><p>{e(report.why)}</p>
{'<h2>Side by side (re-measured in this run)</h2><table><tr><th>configuration</th><th>point</th><th>infer/s</th>'
 '<th>p99 ms</th><th>constraints</th></tr>' + compared + '</table>' if compared else ''}
{image}
<h2>Measured points</h2><p>Red: the pick; blue: on the Pareto front (throughput against worst p99).</p>
<table><tr><th>point</th><th>infer/s</th><th>p99 ms</th><th>infer/J</th><th>feasible</th><th>Pareto</th>
<th>failure</th></tr>
{rows}</table>
</body></html>
"""


def tuned_entry(model: str, winner: Point, measured: list[Result], objective: Objective,
                search: Search) -> TunedServing:
    p99 = _p99(measured)
    return TunedServing(model=model, variant=winner.variant, max_batch_size=winner.max_batch_size,
                        queue_delay_us=winner.queue_delay_us, instances=winner.instances, measured={
                            "objective": str(objective.goal), "search": str(search),
                            "p99_budget_ms": None if objective.p99_budget_us is None else objective.p99_budget_us / 1e3,
                            "min_throughput": objective.min_throughput,
                            "throughput": round(_throughput(measured), 2),
                            "p99_ms": round(p99 / 1e3, 3) if math.isfinite(p99) else None,
                            "concurrency": [r.concurrency for r in measured],
                            "tuned_at": datetime.now(timezone.utc).isoformat(timespec="seconds")})


JOURNAL = ".trtbuild.tune-journal.json"  # beside the lock file: not a model folder, never served


def write_winner(repository: Path, point: Point, *, wait: bool = True, tuned: TunedServing | None = None,
                 tuned_toml: Path | None = None) -> Path:
    """Replace the variant's config.pbtxt atomically under the repository lock; record the settings in
    build.json and, given `tuned_toml`, as the model's entry there (so `trtbuild engines` keeps them).
    Returns the config's path.

    No backup is left in the model folder: Triton skips it, but every deploy would copy it, one more per
    tune. Nothing is lost: the config is the builder's own with the serving settings replaced, so the
    previous one is what `trtbuild engines` writes again (build.json keeps `serving_as_built`), and the
    tune report's `changes` hold the exact diff.

    The files change together or not at all. Each is renamed into place on its own, so before the first
    rename a journal in the repository root keeps the previous content of all three; it is removed
    after the last. A write that fails puts the others back at once; one killed between renames leaves
    the journal, and the next winner written to this repository puts them back first
    (`recover_interrupted_write`)."""
    with repository_lock(repository, what=f"tune's winner for {point.variant}", wait=wait):
        recover_interrupted_write(repository)
        target = repository / point.variant / tuned_file.CONFIG
        original = target.read_text(encoding="utf-8")
        built = tuned_file.as_built(target.parent) or tuned_file.serving_of(original)
        new: dict[Path, bytes] = {target: apply(original, point).encode("utf-8")}
        if tuned is not None:
            new[target.parent / tuned_file.RECORD] = _record_after(target.parent, tuned, built)
            if tuned_toml is not None:
                new[tuned_toml.absolute()] = tuned_file.render(tuned_toml, tuned)[1].encode("utf-8")
        previous = {path: path.read_bytes() if path.exists() else None for path in new}
        changed = {path: data for path, data in new.items() if previous[path] != data}
        journal = repository / JOURNAL
        write_atomic(journal, json.dumps({"variant": point.variant, "files": [
            {"path": str(path.absolute()), "previous": None if previous[path] is None
             else base64.b64encode(previous[path] or b"").decode("ascii"),
             "written_sha256": hashlib.sha256(data).hexdigest()} for path, data in changed.items()]}, indent=1))
        try:
            for path, data in changed.items():
                write_atomic(path, data)
        except BaseException:
            if not _restore({path: previous[path] for path in changed}):
                journal.unlink(missing_ok=True)
            raise
        journal.unlink()
    return target


def _record_after(model_dir: Path, tuned: TunedServing, built: tuned_file.Serving) -> bytes:
    """build.json as `record_tuned` would leave it, computed in a scratch folder so that it can be
    journalled before anything in the repository changes."""
    with tempfile.TemporaryDirectory(prefix="trtbuild-tune-record-") as scratch:
        record = model_dir / tuned_file.RECORD
        if record.exists():
            shutil.copyfile(record, Path(scratch) / tuned_file.RECORD)
        tuned_file.record_tuned(Path(scratch), tuned, built)
        written = Path(scratch) / tuned_file.RECORD
        return written.read_bytes() if written.exists() else b""


def recover_interrupted_write(repository: Path) -> bool:
    """Called under the repository lock: when a winner's write was killed between its renames (its
    journal is still there), put config.pbtxt, build.json and tuned.toml back as they were before it.
    A file that holds neither its previous content nor the killed write's means another writer (a
    rebuild) has written since; that later state stands and nothing is put back. True when a journal
    was found and dealt with."""
    journal = repository / JOURNAL
    try:
        entries = json.loads(journal.read_text(encoding="utf-8"))["files"]
        files = {Path(e["path"]): (None if e["previous"] is None else base64.b64decode(e["previous"]),
                                   str(e["written_sha256"])) for e in entries}
    except FileNotFoundError:
        return False
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BuilderError(f"{journal}: expected the journal of an interrupted tune write ({exc}); check "
                           "config.pbtxt, build.json and tuned.toml, then delete it") from exc
    current = {path: path.read_bytes() if path.exists() else None for path in files}
    later = [path for path, (previous, written) in files.items()
             if current[path] != previous
             and (current[path] is None or hashlib.sha256(current[path] or b"").hexdigest() != written)]
    if later:
        log.warning("tune: %s: a winner's write was interrupted, but %s changed since; leaving the files as "
                    "they are", journal, ", ".join(map(str, later)))
    else:
        log.warning("tune: %s: a winner's write was interrupted; putting %s back as they were", journal,
                    ", ".join(map(str, files)))
        if _restore({path: previous for path, (previous, _) in files.items()}):
            raise BuilderError(f"{journal}: could not put back the files of an interrupted tune write; "
                               "check config.pbtxt, build.json and tuned.toml, then delete it")
    journal.unlink()
    return True


def _restore(previous: dict[Path, bytes | None]) -> list[Path]:
    """Put each file back as it was (absent where it was absent); a file that cannot be put back is
    logged, and the error on its way stays the one raised. Returns those not put back."""
    failed = []
    for path, data in previous.items():
        try:
            if data is None:
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # never written: nothing to undo
                    path.unlink()
            elif not path.exists() or path.read_bytes() != data:
                write_atomic(path, data)
        except OSError as exc:
            failed.append(path)
            log.error("tune: could not restore %s (%s); it may hold the new winner's settings",
                      path, exc.strerror or exc)
    return failed


def planned_changes(repository: Path, point: Point, *, tuned: TunedServing | None,
                    tuned_toml: Path | None) -> list[str]:
    """Unified diffs of what writing the winner changes (shown by --dry-run)."""
    target = repository / point.variant / "config.pbtxt"
    before = target.read_text()
    changes = [tuned_file.diff(target, before, apply(before, point))]
    if tuned is not None and tuned_toml is not None:
        changes.append(tuned_file.diff(tuned_toml, *tuned_file.render(tuned_toml, tuned)))
    return [c for c in changes if c]


def _search(search: Search, space: Space, default: Point, tuner: Tuner, objective: Objective, *, trials: int,
            seed: int) -> dict[Point, list[Result]]:
    if search is Search.EXHAUSTIVE:
        return exhaustive(space, tuner.measure)
    if search is Search.TPE:
        return tpe(space, default, tuner.measure, objective, trials=trials, seed=seed)
    return hill_climb(space, default, tuner.measure, objective)


def _write_outputs(report: TuneReport, report_path: Path | None, plot_path: Path | None,
                   measured: dict[Point, list[Result]], front: list[Point],
                   html_path: Path | None = None) -> str | None:
    """Write the report, the plot and the HTML page; a file that cannot be written is a line returned (and logged), so
    that it neither hides an error already on its way nor stops the server's and folder's clean-up."""
    png = plot_png(measured, front, report.winner) if plot_path is not None or html_path is not None else None
    for flag, path in (("--report", report_path), ("--plot", plot_path), ("--html", html_path)):
        if path is None:
            continue
        try:
            if flag == "--report":
                write_json(path, asdict(report))
            elif flag == "--plot":
                write_atomic(path, png or b"")
            else:
                write_atomic(path, html_report(report, png))
        except OSError as exc:
            line = f"{flag} {path}: cannot write ({exc.strerror or exc})"
            log.error("tune: %s", line)
            return line
    return None


def power_source(endpoints: Endpoints | None) -> power.PowerSource:
    """Where a point's energy is read. A server on another host (a pod, a GPU box) is measured by its
    own `nv_energy_consumption`: this machine's NVML or RAPL would meter the wrong hardware. A server on
    this host: perfclient's auto order (NVML, Triton's metrics, RAPL)."""
    if endpoints is None:
        return power.PowerSource.AUTO
    host = endpoints.grpc.rpartition(":")[0].strip("[]").lower().rstrip(".")
    if host in {"localhost", socket.gethostname().lower(), socket.getfqdn().lower()}:
        return power.PowerSource.AUTO
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name other than this host's own
        return power.PowerSource.TRITON
    # Compared as addresses, not as text: "::", "0:0:0:0:0:0:0:1" and "::ffff:127.0.0.1" are this host too.
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    local = any(a.is_loopback or a.is_unspecified for a in (address, mapped) if a is not None)
    return power.PowerSource.AUTO if local else power.PowerSource.TRITON


def require_power(attach: Endpoints | None) -> None:
    """Fail before anything is measured when perfclient would find no energy reading, which
    `--objective infer_per_joule` ranks by. Probes what perfclient's `auto` source tries: NVML and RAPL
    here, and for an attached server its metrics endpoint. A private server's Triton metrics are left
    out: Triton reports GPU energy through NVML, so they have none where NVML has none."""
    if attach is not None:
        metrics = attach.metrics or f"http://{attach.grpc.rpartition(':')[0]}:{session.METRICS_PORT}/metrics"
        source = power_source(attach)
        sources = [(source, metrics)]
        expected = (f"nv_energy_consumption on {metrics} (the server is on another host)"
                    if source is power.PowerSource.TRITON else
                    f"an NVIDIA GPU readable through NVML, RAPL readable here, or nv_energy_consumption on {metrics}")
    else:
        sources = [(power.PowerSource.NVML, ""), (power.PowerSource.RAPL, "")]
        expected = "an NVIDIA GPU readable through NVML, or RAPL energy counters readable under /sys/class/powercap"
    reasons = []
    for source, url in sources:
        meter = power.open_meter(source, url)
        meter.close()
        if meter.source is not power.PowerSource.NONE:
            log.debug("tune: power source %s", meter.source)
            return
        reasons.append(" ".join(str(meter.reason).split()))  # one line whatever the library said
    raise BuilderError(f"--objective infer_per_joule: expected a power source ({expected}); "
                       f"found none ({'; '.join(reasons)})")


def require_gpus(attach: Endpoints | None, gpus: tuple[str, ...]) -> None:
    """--gpus: fail before anything is measured when no meter finds those GPUs, which every point's
    perfclient session would refuse (NVML here; for an attached server, its metrics endpoint too)."""
    url = "" if attach is None else (attach.metrics or
                                     f"http://{attach.grpc.rpartition(':')[0]}:{session.METRICS_PORT}/metrics")
    # A private server's Triton metric reads NVML too: where NVML has no such GPU, neither has the metric.
    source = power.PowerSource.NVML if attach is None else power_source(attach)
    meter = power.open_meter(source, url, gpus=power.GpuSelection(gpus, "--gpus"))
    meter.close()
    if meter.source is power.PowerSource.NONE:
        raise BuilderError(f"--gpus {','.join(gpus)}: no meter counts these GPUs "
                           f"({' '.join(str(meter.reason).split())})")

def tune(repository: Path, space: Space, objective: Objective, *, search: Search, concurrencies: Sequence[int],
         measurement_ms: int, default_variant: str, report_path: Path | None, plot_path: Path | None,
         write: bool = True, compare: bool = True, max_trials: int = 6, wait: bool = True,
         attach: Endpoints | None = None, model: str | None = None, tuned_toml: Path | None = None,
         trials: int = 12, seed: int = 0, point_timeout_s: float | None = None,
         html_path: Path | None = None, gpus: tuple[str, ...] | None = None) -> TuneReport:
    """Search `space` for `objective`; write the winner (config.pbtxt, build.json, and `tuned_toml`'s
    entry for `model`) unless `write` is False. With `attach`, measure on that running server and leave
    it serving the winner."""
    started = time.perf_counter()
    if objective.goal is Goal.INFER_PER_JOULE:
        require_power(attach)  # before a server starts: without energy readings no point has a value
    if gpus:
        require_gpus(attach, gpus)  # before a server starts: each point's session would refuse them
    configs = _configs(repository, space.variants)
    # The builder's own settings (build.json keeps them once a tune replaced them): where hill climbing
    # and TPE start, and the "default" of the side-by-side comparison.
    built = tuned_file.as_built(repository / default_variant)
    default = (point_of(default_variant, configs[default_variant]) if built is None
               else Point(default_variant, built.max_batch_size, built.queue_delay_us, built.instances))
    limit = min(tuned_file.max_batch_limit(repository / v) for v in space.variants)
    if search is not Search.EXHAUSTIVE:
        space = space.including(default)  # where hill climbing and TPE start
    space = space.bounded(limit)
    target: Target = (LocalTarget(repository, space.variants) if attach is None
                      else RemoteTarget(attach, repository, space.variants))
    comparison: list[Comparison] = []
    partial: str | None = None
    unwritten: str | None = None
    count: int | None = None
    winner: Point | None = None
    changes: list[str] = []
    with target:
        tuner = Tuner(target, concurrencies, measurement_ms=measurement_ms, max_trials=max_trials,
                      point_timeout_s=point_timeout_s, gpus=gpus,
                      shapes={v: load_shapes(repository / v) for v in space.variants})
        measured = tuner.measured
        try:
            # Points (and their perfclient windows) show inside: plain lines only for the search as a whole.
            total = {Search.EXHAUSTIVE: len(space.points()), Search.TPE: min(trials, len(space.points()))}.get(search)
            with progress.task(f"tune: {search} search", total=total, loop=True) as tuner.search_bar:
                _search(search, space, default, tuner, objective, trials=trials, seed=seed)
            winner = best(measured, objective)
            count = tuner.count  # the search's measurements (the side-by-side ones come after)
            if compare and winner is not None:
                # Side by side in one run: winner, the builder's default, and no dynamic batching.
                candidates = {Contender.TUNED: winner, Contender.DEFAULT: default,
                              Contender.NO_BATCHING: replace(default, queue_delay_us=None)}
                with progress.task("tune: side by side", total=len(candidates)) as bar:
                    for name, point in candidates.items():
                        rs = tuner.remeasure(point)
                        bar.advance(status=str(name))
                        p99 = _p99(rs)
                        comparison.append(Comparison(name, point.label(), _throughput(rs),
                                                     p99 / 1e3 if math.isfinite(p99) else None, objective.feasible(rs)))
            if winner is not None:
                entry = tuned_entry(model, winner, measured[winner], objective, search) if model else None
                toml = tuned_toml if model else None
                changes = planned_changes(repository, winner, tuned=entry, tuned_toml=toml)
                if write:
                    config = write_winner(repository, winner, wait=wait, tuned=entry, tuned_toml=toml)
                    log.info("tune: wrote %s%s (the report's `changes` hold the diff from the previous one)",
                             config, f" and {toml}" if toml else "")
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
                objective, space, search, tuner.count if count is None else count, winner, default,
                report_points(measured, objective, tuner.failures, tuner.restarts), [p.label() for p in front],
                explain(winner, measured, objective, default) if winner else
                # A run cut short has no pick even where its measured points met the constraints.
                f"no pick: the run stopped before the search ended ({partial})" if partial else
                "no point met the constraints",
                comparison, round(time.perf_counter() - started, 1), failed=len(tuner.failures),
                attached=attach.http if attach else None, changes=changes, partial=partial,
                restarts=sum(map(len, tuner.restarts.values())))
            unwritten = _write_outputs(report, report_path, plot_path, measured, front, html_path)
    if unwritten:
        raise BuilderError(unwritten)
    if winner is None:
        failed = f", {len(tuner.failures)} failed" if tuner.failures else ""
        raise BuilderError(f"tune: none of the {len(measured)} measured points{failed} met the constraints "
                           f"(p99 budget {objective.p99_budget_us}, min throughput {objective.min_throughput}); "
                           "the repository is unchanged")
    return report
