"""The server a tuning run measures: a private Triton over a copy of the variants, or a running one
(attach mode); each loads a point's config and unloads it."""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from google.protobuf import json_format

from builder.errors import BuilderError, ServerError
from builder.repository import triton_config
from builder.serving import mps
from builder.serving.triton_server import ModelControl, Ports, TritonServer, exit_text, free_ports
from builder.spec.untrusted import MAX_CONFIG_BYTES, check_tree, read_text
from builder.tuning.control import Endpoints, Http, Rejected
from builder.tuning.points import Point, apply
from common.files import write_atomic

log = logging.getLogger(__name__)


class ServerDied(ServerError):
    """The private tuning server's process ended while a point was loading, measured or unloading."""

    def __init__(self, label: str, *, how: str, stage: str, where: str) -> None:
        self.label, self.how, self.stage = label, how, stage  # how: exit_text(); stage: loading, measuring...
        super().__init__(f"tune: the tuning server {how} while {stage} {label}; see {where}")

def read_configs(repository: Path, variants: Sequence[str]) -> dict[str, str]:
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
    mps_used = False  # its server ran under CUDA MPS (a private server: builder.serving.mps)
    mps_note: str | None = None  # why not, where the default would have (TritonServer.mps_note)

    def load(self, point: Point) -> None:
        raise NotImplementedError

    def unload(self, variant: str) -> None:
        self.http.unload(variant)

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


def _tune_note(note: str | None) -> str | None:
    """A server's reason for running without MPS, as it reads for tune: its private state folder is removed with
    the run (no log to see there) and has no --state-dir of its own (it lives under TMPDIR)."""
    if note is None:
        return None
    note = re.sub(r"; see \S+$", "", note)
    return note.replace("use a shorter --state-dir", "set a shorter TMPDIR (tune's server runs in a folder there)")


def _refuse_past_mps_clients(config_text: str) -> None:
    """Under CUDA MPS a GPU takes 48 client contexts: the server's and one per python-runner instance, so a point
    with more instances on one GPU cannot load there. Rejected (the point "did not load") with that reason, not
    Triton's load error; the as-built counts were checked when the server started (mps.auto). Only the point's
    own model counts: tune loads one at a time. (A group without `gpus` puts its count on every GPU, so GPU 0
    stands for each.)"""
    count = max(mps.config_gpu_instances(triton_config.parse(config_text), [0]).values(), default=0)
    if mps.past_clients(count):
        raise Rejected(f"{count} python-runner instances on one GPU and the server are more than the "
                       f"{mps.CLIENTS_PER_GPU} clients a CUDA MPS server takes per GPU; tune with --no-mps "
                       "to measure this many")


class LocalTarget(Target):
    """A private Triton (explicit model control) over a temporary copy of the variants."""

    def __init__(self, repository: Path, variants: Sequence[str], *, mps: bool | None = False) -> None:
        self.originals = read_configs(repository, variants)  # before any folder exists: nothing to clean
        # Its servers under a CUDA MPS daemon of their state folder (builder.serving.mps); None: where mps.auto
        # says so, as `trtbuild serve` decides.
        self.mps = mps
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
                                       model_control=ModelControl.EXPLICIT, mps=self.mps)
            self.endpoints = Endpoints(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}",
                                       f"http://127.0.0.1:{metrics}/metrics")
            self.http = Http(self.endpoints.http)
            self.server.start(timeout=120)
            self.mps_used, self.mps_note = self.server.mps_used, _tune_note(self.server.mps_note)
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
        text = apply(self.originals[point.variant], point)
        if self.mps_used:
            _refuse_past_mps_clients(text)
        write_atomic(self.tmp / "repository" / point.variant / "config.pbtxt", text)
        self._while_running(point.label(), lambda: self.http.load(point.variant))

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
                                   model_control=ModelControl.EXPLICIT, mps=self.mps)
        self.endpoints = Endpoints(f"127.0.0.1:{http}", f"127.0.0.1:{grpc}", f"http://127.0.0.1:{metrics}/metrics")
        self.http = Http(self.endpoints.http)
        self.server.start(timeout=120)
        self.mps_used = self.mps_used and self.server.mps_used  # every server of the run under MPS, or not said
        self.mps_note = self.mps_note or _tune_note(self.server.mps_note)

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
        self.originals = read_configs(repository, variants)
        self.endpoints = endpoints
        self.http = Http(endpoints.http, endpoints.key)
        self.loaded_before: set[str] = set()
        self.touched: set[str] = set()
        self.applied: str | None = None

    def __enter__(self) -> RemoteTarget:
        try:
            self.http.ready()
        except ServerError as exc:
            raise ServerError(f"--url {self.endpoints.http}: Triton is not ready ({exc})") from exc
        self.loaded_before = {str(m.get("name")) for m in self.http.index() if m.get("state") == "READY"}
        return self

    def _load(self, variant: str, config_text: str | None) -> None:
        config = None if config_text is None else json_format.MessageToJson(
            triton_config.parse(config_text), preserving_proto_field_name=True)
        try:
            self.http.load(variant, config)
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
