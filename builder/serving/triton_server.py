"""Starting and stopping the Triton Inference Server bundled in the nvidia-pytriton wheel.

That wheel ships `tritonserver` with only the python backend; the backend's stub must match the
running Python, and the server finds this virtualenv's packages (onnxruntime) through PATH.

Lifecycle. A state folder (`.run/` for `trtbuild serve`) belongs to one server at a time. Starting
records the server in `tritonserver.json` (pid, the kernel's start time of that pid, the argv, ports,
repository, backend folder, the trtbuild command), written atomically. "Ours and alive" means: the pid
exists and is not a zombie, its start time equals the recorded one (a recycled pid fails this), and
its command line is `tritonserver` with this state folder's `--backend-directory`. Only such a
process is ever signalled. The python backend's stubs run the executable copied into
`<state>/backends/python` and carry their /dev/shm region name in their argv; a stub whose parent is
no longer a tritonserver is a leftover of a dead server of this state folder (SIGKILL leaves them
running for a long time): starting and stopping find, stop and clean them, and say so. Inspecting processes for
all this (whose process is it, what did a dead one leave) is builder.serving.processes; this module launches.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from builder.errors import BuilderError, ServerError
from builder.repository.lock import LockBusy, exclusive, repository_lock
from builder.repository.staging import clear_leftovers, leftovers
from builder.serving import mps
from builder.serving.exposure import Exposure, has_open, hide_key_once_parsed
from builder.serving.processes import (
    STATE_FILE,
    STUB_NAME,
    Cleanup,
    ServerRecord,
    clean_leftovers,
    exited,
    forget,
    mismatch,
    read_record,
    running,
    start_ticks,
    wait_gone,
)
from builder.spec.untrusted import check_tree
from common import progress
from common.choices import Choice
from common.files import copy_atomic, write_json

log = logging.getLogger(__name__)

LOCK_FILE = "tritonserver.lock"
STUB_TIMEOUT_S = 300  # seconds the python backend waits on a stub (its default, 30, is too short on a GPU)
# Triton's CUDA memory pool per GPU (its default: 64 MB). GPU inputs (CUDA shared memory) reach python-backend
# stubs through it; 4 instances with batches of 64 images (602 KB each) need 154 MB at once. Measured on an
# H200, FP16 EfficientNet-Lite0, 4 instances, concurrency 256: 6785 infer/s with the default, 9421 with
# 1 GiB (bench/gpu/results/2026-11-22-h200-validate-{pool64,nhwc}.json).
CUDA_POOL_BYTES = 1 << 30


def exit_text(code: int) -> str:
    """How a process ended, from its return code: 'exited (code 1)', or for a signal 'exited (code -11:
    killed by signal 11, SIGSEGV)'."""
    if code >= 0:
        return f"exited (code {code})"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "an unknown signal"
    return f"exited (code {code}: killed by signal {-code}, {name})"


def last_lines(paths: list[Path], count: int) -> list[str]:
    """The last `count` non-blank lines of the files, in order (a missing file adds none)."""
    lines: list[str] = []
    for path in paths:
        with contextlib.suppress(OSError):
            lines += [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    return lines[-count:]


def gpu_ids() -> list[int]:
    """The NVIDIA GPUs NVML lists (none where NVML or nvidia-ml-py is missing)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return list(range(int(pynvml.nvmlDeviceGetCount())))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU to give a pool
        return []


def cuda_pool_args(gpus: list[int]) -> list[str]:
    return [f"--cuda-memory-pool-byte-size={gpu}:{CUDA_POOL_BYTES}" for gpu in gpus]


class ModelControl(Choice):
    """Triton's --model-control-mode: load everything at start, or only what the client asks for."""

    NONE = "none"
    EXPLICIT = "explicit"


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


def _pytriton_root() -> Path:
    spec = importlib.util.find_spec("pytriton")  # locating only: importing pytriton needs its own deps
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("tritonserver: nvidia-pytriton is not installed; expected `make install` to add it")
    return Path(next(iter(spec.submodule_search_locations))) / "tritonserver"


def binary() -> Path:
    path = _pytriton_root() / "bin" / "tritonserver"
    if not path.is_file():
        raise ServerError(f"tritonserver: {path} not found in the nvidia-pytriton wheel")
    return path


def library_dir() -> Path:
    """The wheel's bundled shared libraries sit beside the pytriton package (also with pip --target)."""
    return _pytriton_root().parent.parent / "nvidia_pytriton.libs"


def _install(source: Path, target: Path) -> None:
    """Copy source to target by a temporary name and a rename, never by writing over target: a stub of a
    running (or dead but lingering) server executes `target`, and writing into it fails with ETXTBSY.
    A target already equal in size and modification time (the copy keeps them) is left alone."""
    with contextlib.suppress(OSError):
        have, want = target.stat(), source.stat()
        if have.st_size == want.st_size and have.st_mtime_ns == want.st_mtime_ns:
            return
    copy_atomic(source, target, keep_stat=True)


def prepare_backends(state_dir: Path) -> Path:
    """A backend folder whose python backend carries the stub for this interpreter's version."""
    root = _pytriton_root()
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / py / STUB_NAME
    if not stub.is_file():
        raise ServerError(f"tritonserver: no python backend stub for Python {py} in {stub.parent.parent}")
    target = state_dir.resolve() / "backends" / "python"
    target.mkdir(parents=True, exist_ok=True)
    for item in (root / "backends" / "python").iterdir():
        if item.is_file():
            _install(item, target / item.name)
    _install(stub, target / stub.name)
    return target.parent


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(count: int = 3) -> list[int]:
    """Distinct free loopback ports (for tests and tuning servers)."""
    sockets, ports = [], []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in sockets:
        sock.close()
    return ports


def check_ports(ports: Ports, host: str = "127.0.0.1") -> None:
    for label, port in (("--http-port", ports.http), ("--grpc-port", ports.grpc), ("--metrics-port", ports.metrics)):
        if not 1 <= port <= 65535:
            raise ServerError(f"{label} {port}: expected a port number 1-65535")
        if not port_free(port, host):
            raise ServerError(f"{label} {port}: port is in use; stop what holds it or choose another port")


def command(repository: Path, ports: Ports, backend_dir: Path, log_file: Path,
            model_control: ModelControl = ModelControl.NONE, extra: list[str] | None = None,
            exposure: Exposure | None = None) -> list[str]:
    """Triton's argv; it binds loopback unless `exposure` names another address (see exposure.py)."""
    return [
        str(binary()),
        f"--model-repository={repository.resolve()}",
        f"--backend-directory={backend_dir.resolve()}",  # absolute: stop and cleanup match on it
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        *(exposure or Exposure()).args(),
        "--allow-metrics=true",
        f"--model-control-mode={model_control.value}",
        f"--log-file={log_file.resolve()}",
        "--log-verbose=0",
        "--exit-timeout-secs=10",
        # A GPU runner loads a session (and CUDA graph) per batch bucket: up to ~36 s measured on an H100,
        # over the python backend's default 30 s wait for a stub. A later one in `extra` wins (checked).
        f"--backend-config=python,stub-timeout-seconds={STUB_TIMEOUT_S}",
        *cuda_pool_args(gpu_ids()),
        *(extra or []),
    ]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    libs = str(library_dir())
    env["LD_LIBRARY_PATH"] = libs + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    # The python backend's stub imports this interpreter's packages when its bin/ comes first.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def ready(port: int, host: str = "127.0.0.1", timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/v2/health/ready", timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


@contextlib.contextmanager
def _state_lock(state_dir: Path, timeout: float = 30.0) -> Iterator[None]:
    """One starter or stopper at a time per state folder (flock: released by the kernel if we die)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive(state_dir / LOCK_FILE, wait_s=timeout, poll_s=0.1):
            yield
    except LockBusy:
        raise ServerError(f"--state-dir {state_dir}: another trtbuild serve or stop held "
                          f"{LOCK_FILE} for {timeout:.0f} s") from None


def _clear_build_leftovers(repository: Path) -> None:
    """Triton would try to load a dead build's staging folder as a model and refuse to start: remove
    them while no build holds the repository lock; while one does, say so instead of failing later."""
    if not leftovers(repository):
        return
    try:
        with repository_lock(repository, what="serve", wait=False):
            clear_leftovers(repository)
    except BuilderError as exc:
        raise ServerError(f"--repository {repository}: a build is writing it right now; serve once it is done "
                          f"({exc})") from exc


class TritonServer:
    """A Triton process on loopback ports; `start()` returns once /v2/health/ready answers 200.

    The state folder holds one server at a time: start() refuses while the recorded one runs, and
    cleans what a dead one left (see the module docstring)."""

    def __init__(self, repository: Path, state_dir: Path, ports: Ports | None = None,
                 model_control: ModelControl = ModelControl.NONE, extra_args: list[str] | None = None,
                 exposure: Exposure | None = None, mps: bool | None = False) -> None:
        self.repository = repository
        # CUDA MPS for its GPU processes (builder.serving.mps): a daemon of this state folder. None: where
        # mps.auto says so (the CLI's default; a library caller's is False), and a daemon that does not start
        # is then a note (mps_note), not a refusal.
        self.mps = mps
        self.mps_used = False  # start() ran the server under the daemon
        self.mps_note: str | None = None  # with mps None: why the server runs without it (None: nothing to say)
        self._mps_started = False  # this object started the folder's daemon (and so may quit it)
        self._locked = False  # inside start()'s hold of the state lock
        self.exposure = exposure or Exposure()  # loopback unless asked
        self.state_dir = state_dir
        self.ports = ports or Ports()
        self.model_control = model_control
        self.extra_args = extra_args or []
        self.log_file = state_dir / "tritonserver.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.record: ServerRecord | None = None
        self.cleaned: Cleanup | None = None  # what start() found of a dead server

    def argv(self) -> list[str]:
        backend_dir = prepare_backends(self.state_dir)
        return command(self.repository, self.ports, backend_dir, self.log_file, self.model_control, self.extra_args,
                       exposure=self.exposure)

    def start(self, timeout: float = 120.0, detach: bool = False) -> None:
        if not self.repository.is_dir():
            raise ServerError(f"--repository {self.repository}: folder not found; run `make engines` first")
        _clear_build_leftovers(self.repository)
        check_tree(self.repository)  # Triton would follow a symlink out of the repository and load what it finds
        with _state_lock(self.state_dir), self._holding_lock():
            other = running(self.state_dir)
            if other is not None:
                http = other.ports.get("http")
                raise ServerError(f"--state-dir {self.state_dir}: a tritonserver started from here is already "
                                  f"running (pid {other.pid}{f', http :{http}' if http else ''}); "
                                  "stop it with `trtbuild stop` first")
            self.cleaned = _clean_folder(self.state_dir)
            check_ports(self.ports, self.exposure.host)
            env = environment()
            try:
                env |= self._start_mps()  # before anything is written: a refused --mps leaves the folder as it was
                argv = self.argv()
                log.debug("starting %s", " ".join(self.exposure.hide(argv)))
                stdout = (self.state_dir / "tritonserver.out").open("wb")
                try:
                    self.process = subprocess.Popen(
                        argv, env=env, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=detach,
                    )
                finally:
                    stdout.close()  # the child holds its own copy (or there is no child)
            except BaseException:  # no server (refused, interrupted, no binary): no daemon either
                self._quit_mps()
                raise
            pid = self.process.pid
            try:
                if self.exposure.key is not None:  # out of /proc/<pid>/cmdline once Triton has its own copy
                    process, log_file = self.process, self.log_file
                    hide_key_once_parsed(pid, self.exposure.key, lambda: has_open(pid, log_file),
                                         lambda: process.poll() is not None)
                self.record = ServerRecord(
                    pid=pid, start_ticks=start_ticks(pid), argv=self.exposure.hide(argv),
                    command=[sys.executable, *sys.argv], repository=str(self.repository.resolve()),
                    backend_dir=str(self.state_dir.resolve() / "backends"), ports=asdict(self.ports),
                    started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                )
                if self.record.start_ticks is None:  # exited at once; the readiness loop reports why
                    self.record = None
                else:
                    write_json(self.state_dir / STATE_FILE, asdict(self.record))
            except BaseException:
                # Unrecorded (or interrupted before it was), no `trtbuild stop` could find it: stop it here, and
                # its MPS daemon, rather than orphan them.
                self.record = None
                self.stop()
                raise
        deadline = time.monotonic() + timeout
        # Triton answers nothing until it has loaded every model (mode none): a status line meanwhile.
        models = sum(1 for child in self.repository.iterdir() if (child / "config.pbtxt").is_file())
        loading = (f"loading {models} model{'s' if models != 1 else ''}" if self.model_control is ModelControl.NONE
                   else "model control explicit: no model loaded at start")
        try:
            with progress.task(f"tritonserver: starting ({loading})"):
                while time.monotonic() < deadline:
                    if self.process.poll() is not None:
                        raise ServerError(f"tritonserver exited with status {self.process.returncode} before it "
                                          f"was ready; see {self.log_file}: {self.log_tail(1)}")
                    if ready(self.ports.http, self.exposure.host):
                        log.debug("tritonserver ready on http %d, grpc %d, metrics %d",
                                  self.ports.http, self.ports.grpc, self.ports.metrics)
                        return
                    time.sleep(0.25)
                raise ServerError(f"tritonserver was not ready within {timeout:.0f} s; see {self.log_file}")
        except BaseException:  # not ready, exited, or Ctrl-C while loading: nothing of it is left running
            self.stop()
            raise

    @contextlib.contextmanager
    def _holding_lock(self) -> Iterator[None]:
        self._locked = True
        try:
            yield
        finally:
            self._locked = False

    def _start_mps(self) -> dict[str, str]:
        """The environment that reaches this folder's MPS daemon, started here; {} without MPS."""
        self.mps_used, self.mps_note = False, None
        if self.mps is False:
            return {}
        gpus = gpu_ids()
        wanted, self.mps_note = (True, None) if self.mps else mps.auto(self.repository, gpus)
        if not wanted:
            return {}
        self._mps_started = True  # first: an interrupt inside start() leaves nothing to quit but is safe
        try:
            env = mps.start(self.state_dir, gpus)
        except (ServerError, OSError) as e:  # OSError: its folders (a default must not end the serve with it)
            self._mps_started = False  # mps.start left no daemon of this folder
            if self.mps is not None:
                raise
            self.mps_note = str(e).removeprefix("--mps: ")  # the CLIs say it; a library caller reads it
            log.debug("serving without CUDA MPS: %s", self.mps_note)
            return {}
        self.mps_used = True
        return env

    def _quit_mps(self) -> None:
        """Quit the folder's MPS daemon where this object started it and no other server has since taken the
        folder (a later `serve --mps` there, after `trtbuild stop` ended this one, has its own daemon)."""
        if not self._mps_started:
            return
        with contextlib.nullcontext() if self._locked else _state_lock(self.state_dir):
            record = read_record(self.state_dir)
            if record is None or (self.process is not None and record.pid == self.process.pid):
                mps.stop(self.state_dir)
        self._mps_started = False

    def log_tail(self, lines: int = 20) -> str:
        text = ""
        for path in (self.log_file, self.state_dir / "tritonserver.out"):
            if path.is_file():
                text += path.read_text(encoding="utf-8", errors="replace")
        errors = [ln for ln in text.splitlines() if ln.startswith(("E", "error", "Error")) or "failed" in ln]
        chosen = errors or text.splitlines()
        return " | ".join(chosen[-lines:]).strip() or "no log output"

    def crash_lines(self, frames: int = 6) -> list[str]:
        """Triton's own report of a fatal signal, from its stdout (crash_report)."""
        return crash_report(self.state_dir, frames)

    def last_lines(self, count: int = 12) -> list[str]:
        """The log's last lines, then what the process wrote to stdout (a crash's stack goes there)."""
        return last_lines([self.log_file, self.state_dir / "tritonserver.out"], count)

    def _forget(self) -> None:
        if self.record is not None:
            forget(self.state_dir, self.record)
            self.record = None

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver (pid %d) did not exit within %.0f s of SIGINT; killing it",
                            self.process.pid, timeout)
                self.process.kill()
                self.process.wait(timeout=timeout)
        self._forget()
        clean_leftovers(self.state_dir)  # a killed (or crashed) server leaves its stubs running
        self._quit_mps()  # after the server and its stubs, its only clients

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _clean_folder(state_dir: Path) -> Cleanup:
    """What a dead (or stopped) server of state_dir left: its stubs and their /dev/shm regions, then the folder's
    MPS daemon (quit after them, its only clients). Called with the state lock held."""
    cleaned = clean_leftovers(state_dir)
    mps.stop(state_dir)
    return cleaned


@dataclass(frozen=True)
class Stopped:
    """What stop_recorded did: the server it stopped (None: none was running), the recorded pid that
    had already exited, and what it cleaned."""

    pid: int | None
    cleaned: Cleanup
    exited: int | None = None


def dead_server_lines(state_dir: Path, count: int = 12) -> list[str]:
    """When the server recorded in state_dir has exited (not by `trtbuild stop`, which removes the record):
    a line saying so, then its log's last lines, indented. Empty while it runs or when none is recorded."""
    record = read_record(state_dir)
    if record is None or not exited(record.pid, record.start_ticks):
        return []
    tail = last_lines([state_dir / "tritonserver.log", state_dir / "tritonserver.out"], count)
    crash = crash_report(state_dir)
    if crash and not any(line.startswith("Signal (") for line in tail):
        # Triton's stack after a fatal signal can outgrow the last lines: its first lines name the signal.
        tail = [*crash, "…", *tail[len(crash) + 1:]]
    return [f"the tritonserver started from {state_dir} (pid {record.pid}) has exited; the last lines it wrote:",
            *(f"  {line}" for line in tail)]


def crash_report(state_dir: Path, frames: int = 6) -> list[str]:
    """Triton's own report of a fatal signal ('Signal (11) received.' and the first stack frames after it, from
    its stdout), empty when it wrote none."""
    lines = last_lines([state_dir / "tritonserver.out"], 400)
    start = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("Signal (")), None)
    return [] if start is None else [" ".join(ln.split()) for ln in lines[start:start + 1 + frames]]


def stop_recorded(state_dir: Path, timeout: float = 30.0) -> Stopped:
    """Stop the server recorded in state_dir, only when that pid is our live tritonserver.

    A record of an exited server is removed (`exited` says so). A record whose pid is alive but not
    ours (a recycled pid, another program, another folder's server) is refused with a ServerError,
    nothing signalled, and removed: it no longer describes our server. The previous version's bare
    pid file is honoured when its process is a tritonserver with this state folder's backend folder
    (it has no start time to compare). Stubs a dead server left are cleaned in every case."""
    if not state_dir.is_dir():  # nothing was ever started from here (and stop creates nothing)
        return Stopped(None, Cleanup([], [], []))
    with _state_lock(state_dir):
        record = read_record(state_dir)
        if record is None:
            return Stopped(None, _clean_folder(state_dir))
        if exited(record.pid, record.start_ticks):  # ours is gone (its pid may serve another now)
            forget(state_dir, record)
            return Stopped(None, _clean_folder(state_dir), exited=record.pid)
        why = mismatch(record.pid, record.start_ticks, state_dir)
        if why is not None:
            forget(state_dir, record)
            raise ServerError(f"pid {record.pid} in {state_dir / record.source} {why}: not signalled; "
                              "removed the stale record")
        ticks = start_ticks(record.pid)
        with contextlib.suppress(ProcessLookupError):  # it may exit between the check and the signal
            os.kill(record.pid, signal.SIGINT)
        if wait_gone([record.pid], timeout):
            if start_ticks(record.pid) == ticks:  # still the same process
                log.warning("tritonserver (pid %d) did not exit within %.0f s of SIGINT; killing it",
                            record.pid, timeout)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(record.pid, signal.SIGKILL)
            if wait_gone([record.pid], 10.0):
                raise ServerError(f"tritonserver (pid {record.pid}) did not exit after SIGKILL")
        forget(state_dir, record)
        return Stopped(record.pid, _clean_folder(state_dir))
