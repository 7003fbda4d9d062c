"""Stress the bundled tritonserver (2.51, python backend) the way trtbuild and perfclient drive it, to make it
crash on purpose and get a native backtrace (issue 24: `Signal (11) received`, pthread_mutex_lock; findings
in docs/triton-crash.md).

A private server over a copy of one variant, explicit model control, as tune starts it. By default each
cycle writes the variant's config with the next serving point (instances alternate 1 and 2), loads it, puts
load on it for a while (HTTP inference threads, or perfclient's session with `--client session`), scrapes
/metrics meanwhile, unloads it, and goes on. Knobs:

    --race               keep the inference threads going through unload and the next load
    --gap-ms A,B         a random pause in [A, B] ms between the unload's answer and the next load
    --wait-unloaded      wait until the index says UNAVAILABLE and the old stubs are gone before loading
    --kill-stub          SIGKILL one of the model's python-backend stubs while requests run (once a cycle)
    --hog N              N busy-loop processes beside (CPU contention, as in a full test run)
    --cancel-threads N   gRPC requests with a client deadline of --cancel-ms A,B ms: cancelled in flight
    --steady             load once and keep the model loaded (no unload, no further load)
    --levels C           load once, then perfclient levels of 30 ms at concurrency C back to back;
                         --drain-s 0 ends them as perfclient used to (in-flight requests cancelled)
    --stop-during-load   end with SIGINT to the server while a load is under way

With `--gdb` the server runs under `gdb -batch` and the faulting thread's registers and backtrace land in
the output; without it, core dumps are enabled (RLIMIT_CORE) and a core found in the work folder is read
with gdb afterwards. The run ends at the first server death, or after `--seconds`.

    python bench/triton_crash_repro.py --repository REPO [--variant mlp_fp32] --seconds 120 [flags]
    python bench/triton_crash_repro.py --repository REPO --levels 16 --drain-s 0 --threads 0 --scrape-ms 0

Exit status: 0 when the server survived, 3 when it died (its output and backtrace are printed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.serving.processes import STUB_NAME, clean_leftovers
from builder.serving.triton_server import (
    ModelControl,
    Ports,
    command,
    environment,
    free_ports,
    prepare_backends,
)
from builder.tuning.points import Point, apply
from client import engine, session
from client.engine import LoadLevel, Measurement
from client.errors import PerfClientError

TOKENS_SHAPE = (4, 32)  # tests.helpers.tiny_models.mlp_onnx's x[batch, 4, 32]


@dataclass
class Tally:
    ok: int = 0
    errors: int = 0
    scrapes: int = 0
    cycles: int = 0
    stub_kills: int = 0
    cancelled: int = 0  # requests the client gave up on (deadline): cancelled in flight
    levels: int = 0  # perfclient levels run (--levels)
    events: list[str] = field(default_factory=list)


def _request(url: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        payload = response.read()
    try:
        return json.loads(payload) if payload else None
    except ValueError:
        return payload


class Server:
    """tritonserver as tune starts it (explicit model control), optionally under gdb."""

    def __init__(self, repository: Path, work: Path, *, gdb: bool) -> None:
        self.work = work
        self.state = work / "state"
        self.state.mkdir(parents=True, exist_ok=True)
        http, grpc, metrics = free_ports(3)
        self.ports = Ports(http, grpc, metrics)
        self.log_file = self.state / "tritonserver.log"
        self.out_file = work / "server.out"
        argv = command(repository, self.ports, prepare_backends(self.state), self.log_file, ModelControl.EXPLICIT)
        if gdb:
            argv = ["gdb", "-batch", "-q", "-ex", "set pagination off", "-ex", "handle SIGPIPE nostop noprint pass",
                    "-ex", "handle SIGINT nostop print pass", "-ex", "run", "-ex", "info registers",
                    "-ex", "x/8i $pc - 20", "-ex", "bt 12", "-ex", "thread apply all bt 12", "--args", *argv]
        with self.out_file.open("wb") as out:
            # The server's working folder is `work`: core_pattern `core` writes the core there.
            self.process = subprocess.Popen(argv, env=environment(), stdout=out, stderr=subprocess.STDOUT,
                                            cwd=work, start_new_session=True)
        self.base = f"http://127.0.0.1:{http}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited ({self.process.returncode}) before ready: {self.tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                if _request(f"{self.base}/v2/health/ready", timeout=1.0) is None:
                    return
            time.sleep(0.2)
        raise RuntimeError("tritonserver not ready within 120 s")

    def dead(self) -> bool:
        if self.process.poll() is not None:
            return True
        # Under gdb the process lives on while gdb prints the backtrace: the log says it first.
        return "Program received signal" in self.out_file.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        text = ""
        for path in (self.log_file, self.out_file):
            if path.is_file():
                text += f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"
        return text

    def stubs(self) -> list[int]:
        """This server's python-backend stubs (children whose argv[0] is the stub)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if Path(argv[0].decode(errors="replace")).name == STUB_NAME and str(self.state.resolve()) in \
                        b" ".join(argv).decode(errors="replace"):
                    found.append(int(entry.name))
        return found

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        clean_leftovers(self.state, timeout=10.0, grace=0.5)


class Infer:
    """Threads posting JSON inference requests until stopped; outcomes counted, never raised."""

    def __init__(self, base: str, model: str, threads: int, batch: int, tally: Tally) -> None:
        self.url = f"{base}/v2/models/{model}/infer"
        values = [0.1] * (batch * TOKENS_SHAPE[0] * TOKENS_SHAPE[1])
        self.body = {"inputs": [{"name": "x", "shape": [batch, *TOKENS_SHAPE], "datatype": "FP32", "data": values}]}
        self.tally = tally
        self.stop_event = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                _request(self.url, self.body, timeout=10.0)
                self.tally.ok += 1
            except (OSError, urllib.error.URLError, ValueError):
                self.tally.errors += 1
                self.stop_event.wait(0.005)

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=15)


class Canceller:
    """Threads sending gRPC inference requests (tritonclient) with a client deadline of a random A..B ms, so
    that the client cancels many of them in flight, some just as the server completes them (Triton 2.51's
    gRPC front end races there: issues 7368, 8034; fixed in later releases by PRs 7840, 8078, 8220)."""

    def __init__(self, grpc_port: int, model: str, threads: int, timeout_ms: tuple[float, float], tally: Tally,
                 seed: int) -> None:
        self.url = f"127.0.0.1:{grpc_port}"
        self.model = model
        self.timeout_ms = timeout_ms
        self.tally = tally
        self.seed = seed
        self.stop_event = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def _run(self, index: int) -> None:
        import numpy as np
        import tritonclient.grpc as tc
        from tritonclient.utils import InferenceServerException

        rng = random.Random(self.seed * 1000 + index)
        client = tc.InferenceServerClient(self.url)
        data = np.full((1, *TOKENS_SHAPE), 0.1, dtype=np.float32)
        while not self.stop_event.is_set():
            tensor = tc.InferInput("x", list(data.shape), "FP32")
            tensor.set_data_from_numpy(data)
            try:
                client.infer(self.model, [tensor], client_timeout=rng.uniform(*self.timeout_ms) / 1000)
                self.tally.ok += 1
            except InferenceServerException as exc:
                if "Deadline" in str(exc) or "DEADLINE" in str(exc):
                    self.tally.cancelled += 1
                else:
                    self.tally.errors += 1
                    self.stop_event.wait(0.005)
        client.close()

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(timeout=15)


class Scraper:
    """GET /metrics every `period_s` (tune's power meter and cross-checks read it during a point)."""

    def __init__(self, port: int, period_s: float, tally: Tally) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.period_s = period_s
        self.tally = tally
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.wait(self.period_s):
            with contextlib.suppress(OSError, urllib.error.URLError):
                _request(self.url, timeout=5.0)
                self.tally.scrapes += 1

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=10)


def _session_measure(server: Server, model: str, measurement_ms: int) -> None:
    """One short perfclient measurement, as tune's Tuner.remeasure does."""
    config = session.SessionConfig(
        models=(model,), url=f"127.0.0.1:{server.ports.grpc}", levels=(LoadLevel(concurrency=1),),
        measurement=Measurement(measurement_ms=measurement_ms, max_trials=1, warmup_requests=20),
        metrics_url=f"http://127.0.0.1:{server.ports.metrics}/metrics")
    with contextlib.suppress(PerfClientError, asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(session.measure(config), 60))


def _control(server: Server, model: str, action: str) -> str | None:
    """POST a load or unload, but stop waiting when the server dies (its stubs keep the connection open).
    None when it answered 200, else what went wrong."""
    outcome: list[str | None] = []

    def call() -> None:
        try:
            _request(f"{server.base}/v2/repository/models/{model}/{action}", {}, timeout=120.0)
            outcome.append(None)
        except urllib.error.HTTPError as exc:
            outcome.append(f"{exc}: {exc.read()[:300].decode(errors='replace')}")
        except (OSError, urllib.error.URLError) as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    while not outcome:
        thread.join(0.05)
        if not outcome and server.dead():
            return "the server died"
    return outcome[0]


def _quiet_load(server: Server, model: str) -> None:
    with contextlib.suppress(OSError, urllib.error.URLError):
        _request(f"{server.base}/v2/repository/models/{model}/load", {}, timeout=300.0)


def _levels(server: Server, model: str, concurrency: int, seconds: float, started: float, tally: Tally) -> None:
    """Short perfclient levels back to back (30 ms windows): each level's end is where perfclient used to
    cancel its requests in flight."""
    config = session.SessionConfig(
        models=(model,), url=f"127.0.0.1:{server.ports.grpc}", levels=(LoadLevel(concurrency=concurrency),),
        measurement=Measurement(measurement_ms=30, max_trials=1, warmup_requests=1),
        metrics_url=f"http://127.0.0.1:{server.ports.metrics}/metrics")
    while time.monotonic() - started < seconds and not server.dead():
        with contextlib.suppress(PerfClientError, asyncio.TimeoutError):
            asyncio.run(asyncio.wait_for(session.measure(config), 60))
        tally.levels += 1
        if tally.levels % 200 == 0:
            print(f"{time.monotonic() - started:6.1f} s: {tally.levels} levels", flush=True)


def _state(server: Server, model: str) -> str:
    index = _request(f"{server.base}/v2/repository/index", {}, timeout=10.0) or []
    return next((str(m.get("state", "")) for m in index if isinstance(m, dict) and m.get("name") == model), "")


def _wait_unloaded(server: Server, model: str, before: set[int], deadline_s: float = 60.0) -> float:
    """Poll until the model's index state is UNAVAILABLE and the stubs it ran have exited; seconds taken."""
    start = time.monotonic()
    while time.monotonic() - start < deadline_s and not server.dead():
        if _state(server, model) == "UNAVAILABLE" and not (before & set(server.stubs())):
            return time.monotonic() - start
        time.sleep(0.02)
    return time.monotonic() - start


def _points(variant: str) -> list[Point]:
    """The tune test's exhaustive order: max batch 1,2,4,8 x batching off,0 x instances 1,2."""
    return [Point(variant, mbs, delay, inst) for mbs in (1, 2, 4, 8) for delay in (None, 0) for inst in (1, 2)]


def _core_backtrace(work: Path) -> str:
    cores = sorted(work.glob("core*"))
    if not cores:
        return ""
    exe = command(Path("/"), Ports(), Path("/"), Path("/"))[0]
    gdb = ["gdb", "-batch", "-q", "-ex", "info registers rip", "-ex", "bt 12", "-ex", "thread apply all bt 12"]
    done = subprocess.run([*gdb, exe, str(cores[-1])], capture_output=True, text=True, timeout=300, check=False)
    return f"--- gdb on {cores[-1]}\n{done.stdout}{done.stderr}"


def run(args: argparse.Namespace) -> int:
    source = Path(args.repository) / args.variant
    work = Path(tempfile.mkdtemp(prefix="triton-crash-", dir=args.work))
    repo = work / "repository"
    repo.mkdir()
    shutil.copytree(source, repo / args.variant)
    original = (source / "config.pbtxt").read_text()
    if not args.gdb:
        hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
        resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))
    if args.drain_s is not None:
        engine.DRAIN_S = args.drain_s
    tally = Tally()
    rng = random.Random(args.seed)
    server = Server(repo, work, gdb=args.gdb)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    print(f"work {work}; server pid {server.process.pid}; ports {server.ports}", flush=True)
    scraper = Scraper(server.ports.metrics, args.scrape_ms / 1000, tally) if args.scrape_ms > 0 else None
    cancel_ms = [float(x) for x in args.cancel_ms.split(",")]
    canceller: Canceller | None = None
    points = _points(args.variant)
    instances = [int(x) for x in args.instances.split(",")]
    gap = [int(x) for x in args.gap_ms.split(",")]
    infer: Infer | None = None
    started = time.monotonic()
    died = False
    stopped = False  # --stop-during-load ended the server on purpose
    try:
        while time.monotonic() - started < args.seconds and not died:
            point = points[tally.cycles % len(points)]
            point = Point(point.variant, point.max_batch_size, point.queue_delay_us,
                          instances[tally.cycles % len(instances)])
            (repo / args.variant / "config.pbtxt").write_text(apply(original, point))
            if args.stop_during_load and time.monotonic() - started > args.seconds * 0.8:
                loader = threading.Thread(target=_quiet_load, args=(server, args.variant), daemon=True)
                loader.start()
                time.sleep(rng.uniform(0, 0.3))
                server.process.send_signal(signal.SIGINT)  # to the server alone, as TritonServer.stop does
                stopped = True
                try:
                    server.process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    tally.events.append("SIGINT during load: still running 60 s later (a hang, not a crash)")
                    break
                tally.events.append(f"SIGINT during load: exit {server.process.returncode}")
                died = server.process.returncode not in (0, -signal.SIGINT)
                break
            failed = _control(server, args.variant, "load")
            if failed:
                tally.events.append(f"cycle {tally.cycles} load {point.label()}: {failed}")
            if server.dead():
                died = True
                tally.events.append(f"died while loading {point.label()} (cycle {tally.cycles})")
                break
            if infer is None:
                infer = Infer(server.base, args.variant, args.threads, 1, tally)
            if canceller is None and args.cancel_threads > 0:
                canceller = Canceller(server.ports.grpc, args.variant, args.cancel_threads,
                                      (cancel_ms[0], cancel_ms[-1]), tally, args.seed)
            if args.client == "session":
                _session_measure(server, args.variant, args.busy_ms)
            else:
                time.sleep(rng.uniform(0, args.busy_ms) / 1000)
            if args.kill_stub:
                stubs = server.stubs()
                if stubs:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(rng.choice(stubs), signal.SIGKILL)
                    tally.stub_kills += 1
                    time.sleep(rng.uniform(0, 0.2))
            if args.levels:
                _levels(server, args.variant, args.levels, args.seconds, started, tally)
                tally.events.append(f"{tally.levels} perfclient levels at concurrency {args.levels} "
                                    f"(drain {engine.DRAIN_S:g} s)")
            if args.steady or args.levels:  # one load, then only the traffic: the crash needs no load or unload
                while time.monotonic() - started < args.seconds and not server.dead():
                    time.sleep(0.2)
                tally.events.append("steady: no unload, no further load")
                died = server.dead()
                break
            before = set(server.stubs())
            if not args.race:
                infer.stop()
                infer = None
            failed = _control(server, args.variant, "unload")
            if failed:
                tally.events.append(f"cycle {tally.cycles} unload: {failed}")
            if server.dead():
                died = True
                tally.events.append(f"died while unloading {point.label()} (cycle {tally.cycles})")
                break
            if args.wait_unloaded:
                _wait_unloaded(server, args.variant, before)
            else:
                time.sleep(rng.uniform(gap[0], gap[-1]) / 1000)
            tally.cycles += 1
            if tally.cycles % 10 == 0:
                print(f"{time.monotonic() - started:6.1f} s: {tally.cycles} cycles, {tally.ok} ok, "
                      f"{tally.cancelled} cancelled, {tally.errors} errors, {tally.scrapes} scrapes", flush=True)
        died = died or (not stopped and server.dead())
    finally:
        if infer is not None:
            infer.stop()
        if canceller is not None:
            canceller.stop()
        if scraper is not None:
            scraper.stop()
        if died and args.gdb:  # let gdb finish printing the threads
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.process.wait(timeout=120)
        code = server.process.poll()
        server.stop()
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(f"{tally.cycles} cycles in {time.monotonic() - started:.0f} s, {tally.ok} requests ok, "
          f"{tally.cancelled} cancelled in flight, {tally.errors} failed, {tally.scrapes} scrapes, "
          f"{tally.stub_kills} stubs killed; server "
          f"{'DIED (exit ' + str(code) + ')' if died else 'survived'}")
    for event in tally.events[-20:]:
        print("  " + event)
    if died:
        print(server.tail(60))
        print(_core_backtrace(work))
        return 3
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repository", required=True, help="a built repository (trtbuild engines)")
    parser.add_argument("--variant", default="mlp_fp32")
    parser.add_argument("--seconds", type=float, default=120.0, help="stop after this long (default 120)")
    parser.add_argument("--instances", default="1,2", help="instance counts, in turn (default 1,2)")
    parser.add_argument("--threads", type=int, default=4, help="inference threads (default 4)")
    parser.add_argument("--busy-ms", type=int, default=200, help="load per cycle, at most (default 200)")
    parser.add_argument("--gap-ms", default="0,0", help="pause between unload and next load, A,B ms")
    parser.add_argument("--scrape-ms", type=int, default=50, help="metrics scrape period; 0: none")
    parser.add_argument("--client", choices=("threads", "session"), default="threads")
    parser.add_argument("--cancel-threads", type=int, default=0,
                        help="gRPC threads whose requests the client cancels in flight (default 0: none)")
    parser.add_argument("--cancel-ms", default="0.5,4", help="their client deadline, a random A,B ms")
    parser.add_argument("--hog", type=int, default=0, help="busy-loop processes beside (CPU contention)")
    parser.add_argument("--steady", action="store_true", help="load once and keep the model loaded")
    parser.add_argument("--levels", type=int, default=0, metavar="C",
                        help="load once, then short perfclient levels at concurrency C back to back")
    parser.add_argument("--drain-s", type=float, default=None,
                        help="perfclient's drain at a level's end (client.engine.DRAIN_S; 0: the old behaviour)")
    parser.add_argument("--race", action="store_true")
    parser.add_argument("--wait-unloaded", action="store_true")
    parser.add_argument("--kill-stub", action="store_true")
    parser.add_argument("--stop-during-load", action="store_true")
    parser.add_argument("--gdb", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", default=None, help="where the work folder goes (default: the temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder of a survived run")
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
